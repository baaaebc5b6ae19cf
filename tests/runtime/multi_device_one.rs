//! The communication calls on a single device, through CubeCL's client as Burn makes them: a
//! copy to the same device (`to_client_tensor` from a client to itself: `send` and `recv` on
//! one server) and an all-reduce of a group of one rank (`ComputeClient::all_reduce`, what
//! `DistributedBackend::all_reduce` calls). On wgpu (lavapipe in CI) and on CUDA (ignored
//! without a device, run by `scripts/gpu-check.sh`).

use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::{ComputeServer, CopyDescriptor, ReduceOperation};

use cubecl_ir::{ElemType, FloatKind};

const F32: ElemType = ElemType::Float(FloatKind::F32);

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// A copy from the device to itself arrives exact, in a new block of the same allocator.
fn copy_to_the_same_device<R: Runtime>(device: &R::Device, allocated: impl Fn() -> u64)
where
    R::Server: ComputeServer,
{
    let mut client: ComputeClient<R> = R::client(device);
    let values: Vec<f32> = (0..2048).map(|i| i as f32 - 1000.5).collect();
    let data = f32_bytes(&values);
    let source = client.create_from_slice(&data);
    client.flush().expect("flush");
    let before = allocated();
    let desc = CopyDescriptor::new(
        source.clone().binding(),
        [values.len()].into(),
        [1].into(),
        4,
    );
    let same = client.clone();
    let copy = client.to_client_tensor(desc, &same, F32);
    assert_eq!(client.read_one(copy.clone()).expect("read").to_vec(), data);
    // 8 KiB, in a block of its own: the source is still live beside it.
    assert_eq!(allocated() - before, 8192);
    assert_eq!(client.read_one(source).expect("read").to_vec(), data);
}

/// An all-reduce of one rank leaves its buffer as it was (sum) or divided by one (mean).
fn all_reduce_of_one_rank<R: Runtime>(device: &R::Device) {
    let mut client: ComputeClient<R> = R::client(device);
    let data = f32_bytes(&[1.5, -2.0, 3.25, 0.0]);
    let buffer = client.create_from_slice(&data);
    let ids = vec![device_id::<R>(device)];
    client.all_reduce(
        buffer.clone(),
        buffer.clone(),
        F32,
        ids.clone(),
        ReduceOperation::Sum,
    );
    client.all_reduce(
        buffer.clone(),
        buffer.clone(),
        F32,
        ids,
        ReduceOperation::Mean,
    );
    client.sync_collective();
    assert_eq!(client.read_one(buffer).expect("read").to_vec(), data);
}

fn device_id<R: Runtime>(device: &R::Device) -> cubecl_common::device::DeviceId {
    use cubecl_common::device::Device;
    device.to_id()
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use burn_caching_alloc::backend;
    use burn_caching_alloc::wgpu::CachingWgpuRuntime;

    use crate::support::lavapipe::cpu_device;

    #[test]
    fn a_copy_to_the_same_wgpu_device_arrives_exact() {
        let Some((device, _turn)) = cpu_device() else {
            return;
        };
        super::copy_to_the_same_device::<CachingWgpuRuntime>(&device, || {
            backend::memory_stats(&device).memory_allocated()
        });
        backend::empty_cache(&device);
    }

    #[test]
    fn an_all_reduce_of_one_wgpu_rank_keeps_its_values() {
        let Some((device, _turn)) = cpu_device() else {
            return;
        };
        super::all_reduce_of_one_rank::<CachingWgpuRuntime>(&device);
        backend::empty_cache(&device);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::backend::cuda::CudaDevice;
    use burn_caching_alloc::backend;
    use burn_caching_alloc::cuda::CachingCudaRuntime;

    use crate::burn_mlp_cuda::cuda_turn;

    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_copy_to_the_same_cuda_device_arrives_exact() {
        let Some(_turn) = cuda_turn() else {
            return;
        };
        let device = CudaDevice::default();
        super::copy_to_the_same_device::<CachingCudaRuntime>(&device, || {
            backend::memory_stats(&device).memory_allocated()
        });
        backend::empty_cache(&device);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn an_all_reduce_of_one_cuda_rank_keeps_its_values() {
        let Some(_turn) = cuda_turn() else {
            return;
        };
        super::all_reduce_of_one_rank::<CachingCudaRuntime>(&CudaDevice::default());
        backend::empty_cache(&CudaDevice::default());
    }
}
