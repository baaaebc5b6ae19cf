//! Kernel launches on wgpu (the CPU adapter, lavapipe in CI): the launches recorded between two
//! submits share one compute pass and the driver's metadata arena, and each still reads its
//! own scalars, shapes and strides.

use burn::tensor::Tensor;
use burn_caching_alloc::backend::CachingWgpuUnfused;

use crate::support::lavapipe::cpu_device;

/// Tensors of 200 shapes, each filled and then scaled and shifted by launches of its own, with
/// no read or write in between (so about 32 launches share each submit and its arena), read
/// back only at the end. A launch that read another launch's metadata would have written the
/// wrong value, or the wrong number of elements.
#[test]
fn launches_between_submits_each_read_their_own_metadata() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let shape = |i: usize| [i, 1 + i % 7];
    let tensors: Vec<Tensor<CachingWgpuUnfused, 2>> = (1..=200)
        .map(|i| {
            Tensor::<CachingWgpuUnfused, 2>::ones(shape(i), &device)
                .mul_scalar(i as f32)
                .add_scalar(0.5)
        })
        .collect();
    for (k, tensor) in tensors.into_iter().enumerate() {
        let i = k + 1;
        let values = tensor
            .into_data()
            .to_vec::<f32>()
            .expect("an f32 tensor reads back as f32");
        let [rows, columns] = shape(i);
        assert_eq!(values.len(), rows * columns, "tensor {i}");
        let expected = i as f32 + 0.5;
        assert!(
            values.iter().all(|value| *value == expected),
            "tensor {i}: expected every element to be {expected}, read {values:?}"
        );
    }
}
