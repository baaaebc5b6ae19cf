//! A small MLP trains on `Autodiff<CachingCuda>` (fused) and `Autodiff<CachingCudaUnfused>`: the loss falls, reserved memory stops growing
//! after the first steps, and after everything is dropped and `empty_cache` runs, no memory is
//! reserved. Ignored by default ("needs a CUDA device"); run with `--include-ignored` (as
//! `scripts/gpu-check.sh` does) it skips, saying why, without one.

use burn::backend::Autodiff;
use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::backend::{CachingCuda, CachingCudaUnfused};
use burn_caching_alloc::cuda::cuda_available;

use crate::support::mlp_check::{MlpShape, train_and_check};

/// The CUDA Burn tests share the process's one `CachingCuda` device (and its engine); they
/// take this lock so that one test's allocations do not show in another's counters.
static CUDA_DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test's turn on the CUDA device; `None`, with the reason printed, where CUDA cannot be
/// used.
pub(crate) fn cuda_turn() -> Option<std::sync::MutexGuard<'static, ()>> {
    if let Err(reason) = cuda_available() {
        eprintln!("skipping: {reason}");
        return None;
    }
    Some(
        CUDA_DEVICE
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    )
}

const SHAPE: MlpShape = MlpShape {
    hidden: 64,
    batch: 128,
    steps: 300,
};

#[test]
#[ignore = "needs a CUDA device"]
fn mlp_trains_on_caching_cuda_and_memory_settles() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    train_and_check::<Autodiff<CachingCuda>>(&CudaDevice::default(), SHAPE);
}

#[test]
#[ignore = "needs a CUDA device"]
fn mlp_trains_on_caching_cuda_unfused_and_memory_settles() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    train_and_check::<Autodiff<CachingCudaUnfused>>(&CudaDevice::default(), SHAPE);
}
