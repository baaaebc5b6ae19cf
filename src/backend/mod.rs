//! Burn backends and the user API.
//!
//! ```ignore
//! use burn::backend::Autodiff;
//! use burn_caching_alloc::backend::{self, CachingWgpu};
//!
//! type B = Autodiff<CachingWgpu>;
//! let device = burn::backend::wgpu::WgpuDevice::Cpu;
//! // ... train ...
//! let stats = backend::memory_stats(&device);
//! println!("{}", backend::memory_summary(&device));
//! backend::empty_cache(&device);
//! ```
//!
//! Every call reaches the allocator the device's server uses. Calls first wait until the
//! server has run everything submitted before them, so the numbers include it.

#[cfg(feature = "train")]
mod metric;
mod report;
mod stats;

#[cfg(feature = "train")]
pub use metric::{CachingMemoryMetric, MemoryMetrics, MemoryQuantity};
pub use report::{memory_point, memory_report};

pub use crate::runtime::CubeclLayerUsage;
pub use stats::CachingMemoryStats;

use std::path::{Path, PathBuf};

use cubecl_common::device::Device;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

use crate::alloc::inspect::{InspectError, ViewerLayer};
use crate::alloc::{AllocError, ConfigError, HistoryOptions, Snapshot};
use crate::device::DeviceMemory;
use crate::runtime::env::TRACE_ENV;
use crate::runtime::registry::{self, DeviceEntry};

#[cfg(feature = "wgpu")]
pub use crate::wgpu::CachingWgpuRuntime;

/// `Autodiff<CachingWgpu>` trains on wgpu with the caching allocator; the element types are
/// burn-wgpu 0.21's (`f32`, `i32`, `u32`). With the `fusion` feature (on by default, as in
/// burn-wgpu) it is `Fusion<CubeBackend<..>>`, exactly as Burn's `Wgpu` is; without it, it is
/// [`CachingWgpuUnfused`].
#[cfg(all(feature = "wgpu", feature = "fusion"))]
pub type CachingWgpu<F = f32, I = i32, B = u32> = burn_fusion::Fusion<CachingWgpuUnfused<F, I, B>>;

/// `Autodiff<CachingWgpu>` trains on wgpu with the caching allocator; the element types are
/// burn-wgpu 0.21's (`f32`, `i32`, `u32`). Built without the `fusion` feature, it is
/// [`CachingWgpuUnfused`], as Burn's `Wgpu` is without its `fusion` feature.
#[cfg(all(feature = "wgpu", not(feature = "fusion")))]
pub type CachingWgpu<F = f32, I = i32, B = u32> = CachingWgpuUnfused<F, I, B>;

/// The caching wgpu backend without kernel fusion: the plain `CubeBackend` over
/// [`CachingWgpuRuntime`] (what Burn's `Wgpu` is without its `fusion` feature). Every tensor
/// operation allocates when it is called, not when a fusion queue drains.
#[cfg(feature = "wgpu")]
pub type CachingWgpuUnfused<F = f32, I = i32, B = u32> =
    burn::backend::wgpu::CubeBackend<CachingWgpuRuntime, F, I, B>;

#[cfg(feature = "cuda")]
pub use crate::cuda::CachingCudaRuntime;

/// `Autodiff<CachingCuda>` trains on CUDA with the caching allocator; the element types are
/// burn-cuda 0.21's (`f32`, `i32`, `u8`). The device is Burn's `burn::backend::cuda::CudaDevice`.
/// With the `fusion` feature (on by default, as in burn-cuda) it is `Fusion<CubeBackend<..>>`,
/// exactly as Burn's `Cuda` is; without it, it is [`CachingCudaUnfused`].
#[cfg(all(feature = "cuda", feature = "fusion"))]
pub type CachingCuda<F = f32, I = i32, B = u8> = burn_fusion::Fusion<CachingCudaUnfused<F, I, B>>;

/// `Autodiff<CachingCuda>` trains on CUDA with the caching allocator; the element types are
/// burn-cuda 0.21's (`f32`, `i32`, `u8`). Built without the `fusion` feature, it is
/// [`CachingCudaUnfused`], as Burn's `Cuda` is without its `fusion` feature.
#[cfg(all(feature = "cuda", not(feature = "fusion")))]
pub type CachingCuda<F = f32, I = i32, B = u8> = CachingCudaUnfused<F, I, B>;

/// The caching CUDA backend without kernel fusion: the plain `CubeBackend` over
/// [`CachingCudaRuntime`] (what Burn's `Cuda` is without its `fusion` feature).
#[cfg(feature = "cuda")]
pub type CachingCudaUnfused<F = f32, I = i32, B = u8> =
    burn_cubecl::CubeBackend<CachingCudaRuntime, F, I, B>;

/// A device type the caching runtimes open.
pub trait CachingDevice: Device {
    /// The runtime whose servers run on this device type.
    type Runtime: Runtime<Device = Self>;
    /// The engine's device memory on this device type.
    type Memory: DeviceMemory;
}

#[cfg(feature = "wgpu")]
impl CachingDevice for cubecl_wgpu::WgpuDevice {
    type Runtime = CachingWgpuRuntime;
    type Memory = crate::wgpu::WgpuMemory;
}

#[cfg(feature = "cuda")]
impl CachingDevice for cubecl_cuda::CudaDevice {
    type Runtime = CachingCudaRuntime;
    type Memory = crate::cuda::CudaMemory;
}

/// Opens `device` if needed, waits for the work submitted so far, and returns its entry.
fn settled<Dev: CachingDevice>(
    device: &Dev,
) -> (ComputeClient<Dev::Runtime>, DeviceEntry<Dev::Memory>) {
    let client = Dev::Runtime::client(device);
    // A blocking round trip through the server: everything submitted before has run, and the
    // CubeCL-layer numbers in the registry are fresh.
    if let Err(err) = client.memory_usage() {
        log::warn!("caching allocator: memory_usage failed: {err}");
    }
    let entry = registry::lookup::<Dev::Memory>(device.to_id()).unwrap_or_else(|| {
        panic!(
            "caching allocator: {device:?} was opened by a server that did not register its \
             allocator"
        )
    });
    (client, entry)
}

/// Statistics of `device` (PyTorch's `torch.cuda.memory_stats`, plus CubeCL's layer).
pub fn memory_stats<Dev: CachingDevice>(device: &Dev) -> CachingMemoryStats {
    let (_, entry) = settled(device);
    let engine = entry.allocator.stats();
    let info = entry.allocator.device_memory_info();
    let device_info = info.unwrap_or(crate::device::MemoryInfo { free: 0, total: 0 });
    let cubecl = *entry.cubecl.lock();
    CachingMemoryStats {
        engine,
        cubecl,
        device: device_info,
    }
}

/// A human-readable table of `device`'s memory (PyTorch's `memory_summary`), with a line for
/// each layer's cache.
pub fn memory_summary<Dev: CachingDevice>(device: &Dev) -> String {
    let stats = memory_stats(device);
    let (_, entry) = settled(device);
    let c = &stats.cubecl;
    format!(
        "{}\nCubeCL layer: {} live slices, {} B of live tensors, {} B cached in free slices \
         (exact-size reuse, {} reservations served from them), {} reclaims (+{} before placing \
         a new size, +{} after a productive walk, +{} on growth of reserved memory, {} skipped, \
         {} after out-of-memory)\nEngine layer: {} B reserved in segments, {} B cached in free \
         blocks\n",
        entry.allocator.summary(),
        c.live_slices,
        c.live_bytes,
        c.cached_bytes(),
        c.reclaim.pool_hits,
        c.reclaim.reclaims,
        c.reclaim.placement_reclaims,
        c.reclaim.productive_reclaims,
        c.reclaim.growth_reclaims,
        c.reclaim.skipped_reclaims,
        c.reclaim.oom_reclaims,
        stats.memory_reserved(),
        stats.cached_in_engine(),
    )
}

/// Every segment and block of `device`'s engine (PyTorch's `memory_snapshot`).
pub fn memory_snapshot<Dev: CachingDevice>(device: &Dev) -> Snapshot {
    settled(device).1.allocator.snapshot()
}

/// Returns every cached byte of both layers to the device: free CubeCL slices go back to the
/// engine, then the engine frees every segment with no live block (PyTorch's `empty_cache`).
/// Burn's `B::memory_cleanup(&device)` does the same.
pub fn empty_cache<Dev: CachingDevice>(device: &Dev) {
    let client = Dev::Runtime::client(device);
    client.memory_cleanup();
    settled(device);
}

/// Sets every peak statistic of `device` to its current value.
pub fn reset_peak_memory_stats<Dev: CachingDevice>(device: &Dev) {
    settled(device).1.allocator.reset_peak_stats();
}

/// Caps `device`'s reserved memory at `fraction` of its total: allocations that would go above
/// fail like a device out-of-memory (after the allocator freed what it could).
pub fn set_per_process_memory_fraction<Dev: CachingDevice>(
    device: &Dev,
    fraction: f64,
) -> Result<(), ConfigError> {
    settled(device).1.allocator.set_memory_fraction(fraction)
}

/// Why a trace could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// `BURN_CACHING_ALLOC_TRACE` is not set, so there is no path to write to.
    #[error("{TRACE_ENV} is not set: there is no trace path")]
    NoPath,
    /// Writing the trace file failed.
    #[error("cannot write the trace: {0}")]
    File(#[from] crate::alloc::TraceFileError),
}

/// Writes `device`'s engine trace (JSON) to the path in `BURN_CACHING_ALLOC_TRACE` and returns
/// that path. Setting the variable before the device opens turns history recording on; the
/// trace is written only when this is called (the runtime never drops its servers).
pub fn write_trace<Dev: CachingDevice>(device: &Dev) -> Result<PathBuf, TraceError> {
    let path = std::env::var_os(TRACE_ENV).ok_or(TraceError::NoPath)?;
    let path = PathBuf::from(path);
    write_trace_to(device, &path)?;
    Ok(path)
}

/// Writes `device`'s engine trace (JSON) to `path`, gzipped when `path` ends in `.gz`.
pub fn write_trace_to<Dev: CachingDevice>(device: &Dev, path: &Path) -> Result<(), TraceError> {
    Ok(settled(device).1.allocator.trace().write_file(path)?)
}

/// Starts recording `device`'s history with `options`, or stops with
/// [`HistoryOptions::off`] (PyTorch's `torch.cuda.memory._record_memory_history`). Stacks are
/// captured on the thread that runs the allocation: with CubeCL 0.10's channel, the thread that
/// called the tensor operation, so the user's model code and Burn's operation are in them.
///
/// Recording started after the device opened sees the engine's blocks: a tensor whose freed
/// CubeCL slice is reused for one of exactly the same size makes no engine event (set
/// `BURN_CACHING_ALLOC_TRACE` before the device opens to hand every freed slice back).
pub fn record_memory_history<Dev: CachingDevice>(device: &Dev, options: HistoryOptions) {
    settled(device).1.allocator.record_memory_history(options);
}

/// Writes `device`'s segments, blocks and history as a PyTorch-format pickle (PyTorch's
/// `torch.cuda.memory._dump_snapshot`): `_memory_viz.py` and <https://pytorch.org/memory_viz>
/// open it.
pub fn dump_snapshot<Dev: CachingDevice>(
    device: &Dev,
    path: impl AsRef<Path>,
) -> Result<(), InspectError> {
    settled(device).1.allocator.dump_snapshot(path)
}

/// Writes the offline viewer of `device`'s memory to `path`: one self-contained HTML file
/// with the timeline, the segment map, the blocks' stacks, and the summary with CubeCL's layer.
pub fn dump_html<Dev: CachingDevice>(
    device: &Dev,
    path: impl AsRef<Path>,
) -> Result<(), InspectError> {
    let stats = memory_stats(device);
    let (_, entry) = settled(device);
    let layers = [
        ViewerLayer {
            name: "CubeCL layer: bytes of live tensors".into(),
            bytes: stats.cubecl.live_bytes,
        },
        ViewerLayer {
            name: "CubeCL layer: cached in free slices".into(),
            bytes: stats.cubecl.cached_bytes(),
        },
    ];
    entry.allocator.dump_html_with_layers(path, &layers)
}

/// Runs `observer` with the error every time one of `device`'s allocations fails with
/// out-of-memory (before CubeCL reclaims its free slices and retries, so it may run more than
/// once per failed tensor).
pub fn on_out_of_memory<Dev: CachingDevice>(
    device: &Dev,
    observer: impl Fn(&AllocError) + Send + Sync + 'static,
) {
    settled(device).1.allocator.on_out_of_memory(observer);
}
