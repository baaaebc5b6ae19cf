//! `CachingCudaRuntime`: the caching server over CUDA.
//!
//! Devices are cubecl-cuda's [`CudaDevice`] (Burn's `burn::backend::cuda::CudaDevice`), so the
//! device users already write for `Cuda` opens the caching runtime too; its servers are our
//! own, separate from stock `CudaRuntime` servers on the same device (both share the device's
//! primary context).

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::zspace::{Shape, Strides};
use cubecl_cuda::{CudaDevice, CudaRuntime};
use cubecl_ir::TargetProperties;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

use super::driver::CudaDriver;
use super::kernel::CudaCppCompiler;
use super::probe::cuda_available;
use crate::runtime::CachingServer;
use crate::runtime::server::is_contiguous;

/// A CubeCL runtime on CUDA whose device memory is the caching allocator.
#[derive(Debug, Clone)]
pub struct CachingCudaRuntime;

impl Runtime for CachingCudaRuntime {
    type Compiler = CudaCppCompiler;
    type Server = CachingServer<CudaDriver>;
    type Device = CudaDevice;

    /// # Panics
    /// When the device cannot open, with the reason, on the calling thread (see
    /// `backend::open`, which returns it instead).
    fn client(device: &CudaDevice) -> ComputeClient<Self> {
        crate::runtime::open::ensure_open::<CudaDriver>(device.to_id())
            .unwrap_or_else(|err| panic!("caching allocator: cannot open {device:?}: {err}"));
        // The servers learn when this thread is gone (see `runtime::thread_exit`).
        crate::runtime::thread_exit::watch_current_thread();
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "caching-cuda"
    }

    fn require_array_lengths() -> bool {
        true
    }

    fn max_cube_count() -> (u32, u32, u32) {
        (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32)
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        // The server copies contiguous tensors only.
        is_contiguous(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        // Same device, same compiler dialect: the stock CUDA runtime's register layouts.
        CudaRuntime::target_properties()
    }

    fn enumerate_devices(type_id: u16, info: &()) -> Vec<DeviceId> {
        // cudarc panics without libcuda; no CUDA means no device.
        if cuda_available().is_err() {
            return Vec::new();
        }
        CudaRuntime::enumerate_devices(type_id, info)
    }
}
