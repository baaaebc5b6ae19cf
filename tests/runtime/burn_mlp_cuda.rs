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

/// Issue 37 on a real GPU: a tensor made under `use_mem_pool` takes the private pool's memory
/// on `CachingCuda`, its bytes read back exactly through the pinned staging pool, and both
/// pools' numbers say so: the pool holds the tensor's block and the pinned host pool counts
/// the upload's and the read's staging buffers (`host_*` in `memory_stats`). Dropping the
/// tensor and the pool returns the pool's memory.
#[test]
#[ignore = "needs a CUDA device"]
fn a_private_pool_and_the_pinned_host_pool_on_caching_cuda() {
    use burn::tensor::{Tensor, TensorData};
    use burn_caching_alloc::alloc::MemPoolOptions;
    use burn_caching_alloc::backend::{self, MemPool, use_mem_pool};

    let Some(_turn) = cuda_turn() else {
        return;
    };
    let device = CudaDevice::default();
    const ELEMENTS: usize = 1 << 20; // 4 MiB of f32: staged through pinned buffers
    let values: Vec<f32> = (0..ELEMENTS).map(|i| (i % 1000) as f32).collect();
    let pool = MemPool::new(&device, MemPoolOptions::default()).expect("a pool");
    let tensor = {
        let _inside = use_mem_pool(&pool);
        Tensor::<CachingCuda, 1>::from_data(TensorData::new(values.clone(), [ELEMENTS]), &device)
    };
    let back: Vec<f32> = tensor.to_data().to_vec().expect("f32 data");
    assert_eq!(back, values);
    let in_pool = pool.memory_stats();
    assert!(
        in_pool.allocated_bytes >= (ELEMENTS * 4) as u64,
        "the tensor's block is the pool's: {in_pool:?}"
    );
    let host = backend::memory_stats(&device)
        .host
        .expect("CachingCuda has a pinned host pool");
    assert!(
        host.allocation.allocated >= 2,
        "an upload and a read staged: {host:?}"
    );
    assert_eq!(
        host.allocated_bytes.current, 0,
        "no copy in flight: {host:?}"
    );
    drop(tensor);
    drop(pool);
    backend::empty_cache(&device);
    assert_eq!(backend::memory_reserved(&device), 0);
}
