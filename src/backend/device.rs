//! The device types the caching runtimes open, and how the user API reaches a device's
//! allocator with current numbers.
//!
//! Before it reads anything, every call of the user API
//!
//! 1. drains the **fusion queue** of the calling thread on that device (under the `fusion`
//!    feature): Burn's fused backends queue operations until something reads a tensor, so
//!    without this the numbers would miss the user's last operations. The queue is burn-fusion's
//!    `GlobalFusionClient` for `FusionCubeRuntime<our runtime>`, which depends on the runtime
//!    only, never on the float, int and bool types the user chose;
//! 2. makes a blocking round trip through the device's server, so everything submitted before
//!    (by this thread) has run on the server;
//! 3. for the reading calls, has the server name the engine blocks CubeCL holds in free slices
//!    ([`CachingServer::free_slices`]) without handing them back: the readings count them as
//!    cache ([`CachedAbove`]), so "allocated" is the live tensors' blocks while every later
//!    decision stays the one a run that never reads makes. See "What allocated means" in the
//!    module docs of [`crate::backend`].

use cubecl_common::device::Device;
use cubecl_common::device_handle::DeviceHandle;
use cubecl_runtime::runtime::Runtime;

use crate::alloc::{AllocatorConfig, CachedAbove, ConfigError};
use crate::device::DeviceMemory;
use crate::runtime::open;
use crate::runtime::registry::{self, DeviceEntry};
use crate::runtime::{CachingServer, CubeclLayerUsage, Driver};

/// A device type the caching runtimes open (`WgpuDevice`, `CudaDevice`).
pub trait CachingDevice: Device + sealed::Fused {
    /// The runtime whose servers run on this device type.
    type Runtime: Runtime<Device = Self, Server = CachingServer<Self::Driver>>;
    /// The driver the runtime's server runs on.
    type Driver: Driver<Memory = Self::Memory>;
    /// The engine's device memory on this device type.
    type Memory: DeviceMemory;

    /// Refuses what no device of this type can serve (checked by `backend::configure`).
    fn check_config(config: &AllocatorConfig) -> Result<(), ConfigError> {
        let _ = config;
        Ok(())
    }
}

// Sealed on purpose: users name `CachingDevice`, never the trait that keeps it closed.
#[allow(unnameable_types)]
pub(crate) mod sealed {
    /// Draining the fusion queue of a device (nothing to drain without the `fusion` feature).
    pub trait Fused {
        /// Runs every operation the calling thread queued in burn-fusion on this device.
        fn drain_fusion_queue(&self);
    }
}

#[cfg(feature = "wgpu")]
impl CachingDevice for cubecl_wgpu::WgpuDevice {
    type Runtime = crate::wgpu::CachingWgpuRuntime;
    type Driver = crate::wgpu::WgpuDriver;
    type Memory = crate::wgpu::WgpuMemory;

    fn check_config(config: &AllocatorConfig) -> Result<(), ConfigError> {
        if config.expandable_segments {
            return Err(ConfigError::Unsupported {
                key: "expandable_segments".into(),
                reason: "wgpu devices have no virtual memory (wgpu cannot map pages into a \
                         reserved address range); use the CUDA backend or leave it off"
                    .into(),
            });
        }
        Ok(())
    }
}

#[cfg(feature = "wgpu")]
impl sealed::Fused for cubecl_wgpu::WgpuDevice {
    fn drain_fusion_queue(&self) {
        #[cfg(feature = "fusion")]
        drain::<crate::wgpu::CachingWgpuRuntime>(self);
    }
}

#[cfg(feature = "cuda")]
impl CachingDevice for cubecl_cuda::CudaDevice {
    type Runtime = crate::cuda::CachingCudaRuntime;
    type Driver = crate::cuda::CudaDriver;
    type Memory = crate::cuda::CudaMemory;
}

#[cfg(feature = "cuda")]
impl sealed::Fused for cubecl_cuda::CudaDevice {
    fn drain_fusion_queue(&self) {
        #[cfg(feature = "fusion")]
        drain::<crate::cuda::CachingCudaRuntime>(self);
    }
}

/// Drains the calling thread's fusion stream of `device` (what Burn's `Fusion::sync` does
/// before it syncs the device).
#[cfg(feature = "fusion")]
fn drain<R: burn_cubecl::CubeRuntime>(device: &R::CubeDevice) {
    burn_fusion::client::GlobalFusionClient::<burn_cubecl::fusion::FusionCubeRuntime<R>>::load(
        device,
    )
    .sync(|| ());
}

/// The device's server, reached directly (the same one `ComputeClient::load` reaches), opened
/// on this thread if it was not.
///
/// # Panics
/// When the device cannot open, with the reason (`backend::open` returns it instead).
fn server<Dev: CachingDevice>(device: &Dev) -> DeviceHandle<CachingServer<Dev::Driver>> {
    if let Err(err) = open::ensure_open::<Dev::Driver>(device.to_id()) {
        panic!("caching allocator: cannot open {device:?}: {err}");
    }
    DeviceHandle::new(device.to_id())
}

/// The registry entry of an open `device`.
fn entry<Dev: CachingDevice>(device: &Dev) -> DeviceEntry<Dev::Memory> {
    registry::lookup::<Dev::Memory>(device.to_id()).unwrap_or_else(|| {
        panic!(
            "caching allocator: {device:?} was opened by a server that did not register its \
             allocator"
        )
    })
}

/// Opens `device` if needed, drains its fusion queue, waits until the server ran everything
/// submitted before, and returns its entry (for calls that change settings, not numbers).
pub(crate) fn opened<Dev: CachingDevice>(device: &Dev) -> DeviceEntry<Dev::Memory> {
    device.drain_fusion_queue();
    if let Err(err) = server(device).submit_blocking(|_| ()) {
        log::warn!("caching allocator: the server of {device:?} did not answer: {err:?}");
    }
    entry(device)
}

/// As [`opened`], then has the server hand CubeCL's free slices back to the engine
/// ([`CachingServer::hand_back_free_slices`]), for the private pools' readings and actions,
/// whose numbers the engine keeps per pool. A walk of every stream, outside the reclaim
/// policy: later placement may differ from a run that does not call it.
pub(crate) fn handed_back<Dev: CachingDevice>(device: &Dev) {
    device.drain_fusion_queue();
    if let Err(err) = server(device).submit_blocking(|server| {
        server.hand_back_free_slices();
    }) {
        log::warn!("caching allocator: the server of {device:?} did not answer: {err:?}");
    }
}

/// A device's entry with current numbers, CubeCL's layer, and the engine blocks CubeCL holds
/// in free slices (to be read as cache, not allocated).
pub(crate) struct Settled<M: DeviceMemory> {
    pub(crate) entry: DeviceEntry<M>,
    pub(crate) cubecl: CubeclLayerUsage,
    pub(crate) cached: CachedAbove,
}

/// As [`opened`], then has the server name the engine blocks of CubeCL's free slices
/// ([`CachingServer::free_slices`]), changing nothing: the readings count them as cache (see
/// the module docs).
pub(crate) fn settled<Dev: CachingDevice>(device: &Dev) -> Settled<Dev::Memory> {
    device.drain_fusion_queue();
    let found = server(device).submit_blocking(|server| server.free_slices());
    let entry = entry(device);
    let (cubecl, cached) = found.unwrap_or_else(|err| {
        log::warn!("caching allocator: the server of {device:?} did not answer: {err:?}");
        (*entry.cubecl.lock(), CachedAbove::default())
    });
    Settled {
        entry,
        cubecl,
        cached,
    }
}
