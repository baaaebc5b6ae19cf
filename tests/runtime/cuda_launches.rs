//! Launches on `CachingCudaUnfused` on a real CUDA device (unfused, so that every operation is
//! its own launch through the server's metadata path): once warm, kernels with scalars, static and
//! dynamic metadata (strided tensors) allocate no device memory, and compute the right values
//! (the metadata reaches the kernel: by value as a grid constant from sm_70, the shapes and
//! strides through the stream's scratch). Ignored by default ("needs a CUDA device");
//! `scripts/gpu-check.sh` runs it with `--include-ignored`.

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingCudaUnfused};

use crate::burn_mlp_cuda::cuda_turn;

type B = CachingCudaUnfused;

/// One step: a strided (transposed) operand, a scalar, an addition; returns the result.
fn step(x: &Tensor<B, 2>, acc: Tensor<B, 2>, scale: f32) -> Tensor<B, 2> {
    acc.mul_scalar(0.5) + x.clone().transpose().mul_scalar(scale)
}

#[test]
#[ignore = "needs a CUDA device"]
fn warm_launches_allocate_no_device_memory_and_compute_right() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    let device = CudaDevice::default();
    let (rows, cols) = (48, 80);
    let values: Vec<f32> = (0..rows * cols).map(|i| (i % 17) as f32).collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [rows, cols]), &device);
    let mut acc = Tensor::<B, 2>::zeros([cols, rows], &device);
    // Warm up: kernels compiled, the metadata scratch and the tensors' sizes cached.
    for _ in 0..5 {
        acc = step(&x, acc, 1.0);
    }
    let _ = acc.clone().into_data();
    let before = backend::memory_stats(&device).engine.num_device_alloc;
    for _ in 0..200 {
        acc = step(&x, acc, 1.0);
    }
    let result = acc.into_data().to_vec::<f32>().expect("f32 data");
    let after = backend::memory_stats(&device).engine.num_device_alloc;
    assert_eq!(
        after,
        before,
        "200 warm steps allocated {} device segments",
        after - before
    );
    // acc converges to 2 * x^T (acc = acc / 2 + x^T, 205 times from zero).
    let expected = |r: usize, c: usize| 2.0 * values[c * cols + r] * (1.0 - 0.5f32.powi(205));
    for r in 0..cols {
        for c in 0..rows {
            let got = result[r * rows + c];
            assert!(
                (got - expected(r, c)).abs() <= 1e-3,
                "[{r}][{c}]: {got} != {}",
                expected(r, c)
            );
        }
    }
}
