//! `CachingWgpuRuntime`: the caching server over wgpu (Vulkan, Metal, DX12; lavapipe on a CPU).

use cubecl_common::device::{Device, DeviceId};
use cubecl_core::zspace::{Shape, Strides};
use cubecl_ir::TargetProperties;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use cubecl_wgpu::{WgpuDevice, WgpuRuntime, WgslCompiler};

use super::driver::WgpuDriver;
use crate::runtime::CachingServer;
use crate::runtime::server::is_contiguous;

/// A CubeCL runtime on wgpu whose device memory is the caching allocator. Devices are
/// cubecl-wgpu's [`WgpuDevice`] (e.g. `WgpuDevice::Cpu` for lavapipe); the servers are our own,
/// separate from stock `WgpuRuntime` servers on the same device.
#[derive(Debug, Clone)]
pub struct CachingWgpuRuntime;

impl Runtime for CachingWgpuRuntime {
    type Compiler = WgslCompiler;
    type Server = CachingServer<WgpuDriver>;
    type Device = WgpuDevice;

    /// # Panics
    /// When the device cannot open, with the reason, on the calling thread (see
    /// `backend::open`, which returns it instead).
    fn client(device: &WgpuDevice) -> ComputeClient<Self> {
        crate::runtime::open::ensure_open::<WgpuDriver>(device.to_id())
            .unwrap_or_else(|err| panic!("caching allocator: cannot open {device:?}: {err}"));
        // The servers learn when this thread is gone (see `runtime::thread_exit`).
        crate::runtime::thread_exit::watch_current_thread();
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "caching-wgpu<wgsl>"
    }

    fn max_cube_count() -> (u32, u32, u32) {
        let max = u16::MAX as u32;
        (max, max, max)
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        // The server copies contiguous tensors only.
        is_contiguous(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        TargetProperties {
            mma: Default::default(),
        }
    }

    fn enumerate_devices(type_id: u16, info: &wgpu::Backend) -> Vec<DeviceId> {
        WgpuRuntime::enumerate_devices(type_id, info)
    }

    fn enumerate_all_devices(info: &wgpu::Backend) -> Vec<DeviceId> {
        WgpuRuntime::enumerate_all_devices(info)
    }
}
