//! Burn backends and the user API.
//!
//! `CachingWgpu` and `CachingCuda` (and their `...Unfused` forms) are Burn backends over
//! Burn's own device types, `WgpuDevice` and `CudaDevice`; every function of this module takes
//! such a device ([`CachingDevice`]) and reaches the allocator of that device's server. The
//! examples below need a device, so they are compiled but not run here; the same calls on the
//! engine alone run in the crate's root documentation.
//!
//! # Choosing the backend and configuring a device
//!
//! ```no_run
//! # #[cfg(feature = "wgpu")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use burn::backend::Autodiff;
//! use burn::backend::wgpu::WgpuDevice;
//! use burn::tensor::Tensor;
//! use burn_caching_alloc::alloc::AllocatorConfig;
//! use burn_caching_alloc::backend::{self, CachingWgpu};
//!
//! type B = Autodiff<CachingWgpu>;
//! let device = WgpuDevice::default();
//!
//! // Optional, before the device's first tensor: this device's configuration. Without it,
//! // BURN_CACHING_ALLOC_CONF, else the defaults. Too late is an error, never a silent no-op.
//! backend::configure(&device, AllocatorConfig::parse("max_split_size_mb:128")?)?;
//! let x = Tensor::<B, 2>::ones([512, 512], &device);
//! assert!(backend::configure(&device, AllocatorConfig::default()).is_err()); // already open
//!
//! // Reserved memory may not pass half the device from here on.
//! backend::set_per_process_memory_fraction(&device, 0.5)?;
//! # drop(x);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "wgpu"))]
//! # fn main() {}
//! ```
//!
//! # Reading memory
//!
//! ```no_run
//! # #[cfg(feature = "wgpu")]
//! # fn main() {
//! use burn::backend::wgpu::WgpuDevice;
//! use burn::tensor::Tensor;
//! use burn_caching_alloc::backend::{self, CachingWgpu};
//!
//! let device = WgpuDevice::default();
//! let before = backend::memory_point(&device);
//! let kept: Vec<_> = (0..4)
//!     .map(|_| Tensor::<CachingWgpu, 1>::ones([1 << 18], &device).exp())
//!     .collect();
//!
//! // torch.cuda.memory_stats(), with CubeCL's layer beside the engine's numbers.
//! let stats = backend::memory_stats(&device);
//! assert!(stats.memory_allocated() >= 4 << 20); // the four 1 MiB tensors are live
//! println!("reserved {} B, peak {} B", stats.memory_reserved(), stats.max_memory_reserved());
//! println!("{:?}", stats.engine.to_map().get("num_alloc_retries"));
//!
//! println!("{}", backend::memory_summary(&device)); // torch.cuda.memory_summary()
//! let snapshot = backend::memory_snapshot(&device); // every segment and block (serde)
//! println!("{} segments", snapshot.segments.len());
//!
//! // Leak or cache? Live tensors grew here: the report lists what holds them.
//! let report = backend::memory_report(&device, Some(&before));
//! println!("{report}");
//!
//! drop(kept);
//! backend::empty_cache(&device); // cached segments without a live block go back
//! backend::reset_peak_memory_stats(&device);
//! # }
//! # #[cfg(not(feature = "wgpu"))]
//! # fn main() {}
//! ```
//!
//! # Snapshots, the viewer and out-of-memory reports
//!
//! ```no_run
//! # #[cfg(feature = "wgpu")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use burn::backend::wgpu::WgpuDevice;
//! use burn_caching_alloc::alloc::HistoryOptions;
//! use burn_caching_alloc::backend;
//!
//! let device = WgpuDevice::default();
//! // torch.cuda.memory._record_memory_history(): every allocation with its stack.
//! backend::record_memory_history(&device, HistoryOptions::default());
//! // At the next out-of-memory: a snapshot, and a callback (on the allocator's own thread,
//! // so it may read the numbers).
//! backend::dump_snapshot_on_oom(&device, Some("oom.pickle".into()));
//! backend::on_out_of_memory(&device, |error| eprintln!("{error}"));
//!
//! // ... train ...
//!
//! // PyTorch's snapshot pickle (https://pytorch.org/memory_viz), and our offline viewer.
//! backend::dump_snapshot(&device, "snapshot.pickle")?;
//! backend::dump_html(&device, "memory.html")?;
//! backend::record_memory_history(&device, HistoryOptions::off());
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "wgpu"))]
//! # fn main() {}
//! ```
//!
//! With `BURN_CACHING_ALLOC_TRACE=path` set before the device opens, [`write_trace`] writes the
//! whole allocation trace, which the repository's `replay` benchmark replays through any
//! allocator. With feature `train`, `MemoryMetrics` puts the memory on burn-train's dashboard.
//!
//! Every call reaches the allocator the device's server uses. Calls first drain the calling
//! thread's fusion queue on that device (feature `fusion`) and wait until the server has run
//! everything submitted before them, so the numbers include the user's last operation.
//!
//! # What "allocated" means
//!
//! As in PyTorch, `memory_allocated()`, `allocated_bytes.*`, `active_bytes.*`,
//! `requested_bytes.*`, the summary's first rows, snapshots and the viewer describe what live
//! tensors hold. To the engine, a slice CubeCL keeps free for the next tensor of its size is
//! still a live block; handing those back before a reading would make the reading part of the
//! program (the engine would then place later requests in them, and a run that reads after
//! every step would allocate differently from one that never reads). So every reading call
//! (`memory_stats`, `memory_summary`, `memory_snapshot`, `memory_point`, `dump_*`) has the
//! server *name* the blocks of CubeCL's free slices, found with CubeCL's own exact-size lookup
//! and left where they are, and reads them as cache: the current values of the live-allocation
//! statistics (per pool too) and the scopes leave them out, the snapshot shows them as
//! inactive blocks, and they are reported as "cached in CubeCL"
//! ([`CachingMemoryStats::cached_in_cubecl`]). Nothing moves: every later decision, the
//! cumulative amounts and the counters are those of a run that never read. Peaks are the
//! engine's and may include slices CubeCL had cached: an upper bound of the live tensors'
//! peak (exact under `BURN_CACHING_ALLOC_TRACE`, which hands slices back before every
//! reservation). Fragmentation (`inactive_split`, the free space) is the engine's own free
//! blocks.

mod components;
mod configure;
mod device;
#[cfg(feature = "train")]
mod metric;
mod pool;
mod report;
mod scope;
mod stats;

#[cfg(feature = "train")]
pub use metric::{CachingMemoryMetric, MemoryMetrics, MemoryQuantity};
pub use report::{memory_point, memory_report};
pub use scope::{MemoryScope, Phase, annotate, memory_scope};

pub use components::{ComponentBytes, Components, OptimizerStep};
pub use configure::{ConfigureError, configure};
pub use device::CachingDevice;
pub use pool::{MemPool, MemPoolGuard, use_mem_pool};
pub use stats::CachingMemoryStats;

use std::path::{Path, PathBuf};

use cubecl_runtime::runtime::Runtime;

use crate::alloc::inspect::{InspectError, ViewerLayer};
use crate::alloc::{AllocError, AllocatorConfig, ConfigError, HistoryOptions, Snapshot};
use crate::runtime::env::TRACE_ENV;
use device::{Settled, opened, settled};

#[cfg(feature = "wgpu")]
use crate::wgpu::CachingWgpuRuntime;

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
use crate::cuda::CachingCudaRuntime;

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

/// Opens `device`'s caching server now, on this thread, and returns why it cannot open: a
/// `BURN_CACHING_ALLOC_CONF` that does not parse, expandable segments on a device without
/// virtual memory, no such device. Opening is otherwise implicit (the first tensor, or any
/// call of this module), and a device that cannot open panics there with the same reason;
/// call this first to handle the error instead. Opening an open device does nothing; a
/// device that failed to open returns the same error on every call.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// if let Err(err) = backend::open(&device) {
///     eprintln!("no caching allocator: {err}");
/// }
/// # }
/// ```
///
/// # Errors
/// [`DriverError`](crate::runtime::DriverError): the configuration's error
/// ([`DriverError::Config`](crate::runtime::DriverError::Config)), or the device's.
pub fn open<Dev: CachingDevice>(device: &Dev) -> Result<(), crate::runtime::DriverError> {
    crate::runtime::open::ensure_open::<Dev::Driver>(device.to_id())
}

/// Statistics of `device` (PyTorch's `torch.cuda.memory_stats`, plus CubeCL's layer).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let stats = backend::memory_stats(&device);
/// println!("allocated {} of reserved {}", stats.memory_allocated(), stats.memory_reserved());
/// let retries = stats.to_map()["num_alloc_retries"]; // torch.cuda.memory_stats()'s keys
/// # }
/// ```
pub fn memory_stats<Dev: CachingDevice>(device: &Dev) -> CachingMemoryStats {
    let mut stats = stats_of(settled(device));
    stats.components = ComponentBytes::of(&stats.engine, components::tracked_parameters(device));
    stats
}

fn stats_of<M: crate::device::DeviceMemory>(settled: Settled<M>) -> CachingMemoryStats {
    let allocator = &settled.entry.allocator;
    let device = allocator
        .device_memory_info()
        .unwrap_or(crate::device::MemoryInfo { free: 0, total: 0 });
    CachingMemoryStats {
        engine: allocator.stats_with(&settled.cached),
        cubecl: settled.cubecl,
        device,
        host: settled.entry.host.as_ref().map(|host| host.stats()),
        components: None,
    }
}

/// Bytes of `device`'s live tensors' blocks (PyTorch's `torch.cuda.memory_allocated`).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// println!("{} B in live tensors", backend::memory_allocated(&device));
/// # }
/// ```
pub fn memory_allocated<Dev: CachingDevice>(device: &Dev) -> u64 {
    memory_stats(device).memory_allocated()
}

/// Peak of [`memory_allocated`] since the last [`reset_peak_memory_stats`] (PyTorch's
/// `max_memory_allocated`; see the module docs for what the peak covers).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// backend::reset_peak_memory_stats(&device);
/// // ... a step ...
/// println!("the step's peak: {} B", backend::max_memory_allocated(&device));
/// # }
/// ```
pub fn max_memory_allocated<Dev: CachingDevice>(device: &Dev) -> u64 {
    memory_stats(device).max_memory_allocated()
}

/// Bytes of `device`'s segments (PyTorch's `torch.cuda.memory_reserved`).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// println!("{} B in segments", backend::memory_reserved(&device));
/// # }
/// ```
pub fn memory_reserved<Dev: CachingDevice>(device: &Dev) -> u64 {
    memory_stats(device).memory_reserved()
}

/// Peak of [`memory_reserved`] since the last [`reset_peak_memory_stats`].
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// println!("peak reserved: {} B", backend::max_memory_reserved(&device));
/// # }
/// ```
pub fn max_memory_reserved<Dev: CachingDevice>(device: &Dev) -> u64 {
    memory_stats(device).max_memory_reserved()
}

/// A human-readable table of `device`'s memory (PyTorch's `memory_summary`), with a line for
/// each layer's cache, and on CUDA one for the pinned host pool that stages copies.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// println!("{}", backend::memory_summary(&device));
/// # }
/// ```
pub fn memory_summary<Dev: CachingDevice>(device: &Dev) -> String {
    // One reading of the statistics: the table and the lines below it agree.
    let stats = stats_of(settled(device));
    let table = crate::alloc::Summary(&stats.engine);
    let c = &stats.cubecl;
    let r = &c.reclaim;
    let (live_bytes, live_slices) = (c.tensor_bytes, c.live_slices);
    let allocated = stats.memory_allocated();
    let (in_engine, in_cubecl) = (stats.cached_in_engine(), stats.cached_in_cubecl());
    format!(
        "{table}\nLive tensors: {live_bytes} B in {live_slices} slices ({allocated} B of blocks, \
         the \"Allocated memory\" row). Reserved but not allocated: {in_cubecl} B that CubeCL \
         keeps in free slices for exact-size reuse (inactive blocks in snapshots) and \
         {in_engine} B in the engine's free blocks.\nCubeCL layer: {hits} reservations \
         served from its free slices, {reclaims} walks handing its free slices back to the \
         engine ({work} slice visits)\n",
        hits = r.pool_hits,
        reclaims = r.reclaims,
        work = r.reclaim_work,
    ) + &stats.host.map(pinned_summary).unwrap_or_default()
}

/// The summary's line for the pinned host pool (CUDA).
fn pinned_summary(host: crate::runtime::PinnedHostStats) -> String {
    use crate::alloc::format_bytes;
    format!(
        "Pinned host memory: {in_use} in {buffers} staging buffers (peak {peak}), {cached} \
         idle, {reserved} held in {segments} pinned allocations (peak {reserved_peak}; \
         {reserve} reserved up front); {allocs} cuMemHostAlloc calls ({alloc_ms:.3} ms), \
         {frees} cuMemFreeHost calls\n",
        in_use = format_bytes(host.allocated_bytes.current),
        buffers = host.allocation.current,
        peak = format_bytes(host.allocated_bytes.peak),
        cached = format_bytes(host.cached_bytes()),
        reserved = format_bytes(host.reserved_bytes.current),
        segments = host.segment.current,
        reserved_peak = format_bytes(host.reserved_bytes.peak),
        reserve = format_bytes(host.reserve_segment_bytes),
        allocs = host.num_host_alloc(),
        alloc_ms = host.host_alloc_time.total.as_secs_f64() * 1e3,
        frees = host.num_host_free(),
    )
}

/// Every segment and block of `device`'s engine (PyTorch's `memory_snapshot`); CubeCL's free
/// slices are free blocks in it.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let snapshot = backend::memory_snapshot(&device);
/// for segment in &snapshot.segments {
///     println!("{:#x}: {} B in {} blocks", segment.address, segment.total_size, segment.blocks.len());
/// }
/// # }
/// ```
pub fn memory_snapshot<Dev: CachingDevice>(device: &Dev) -> Snapshot {
    let settled = settled(device);
    settled.entry.allocator.snapshot_with(&settled.cached)
}

/// Returns every cached byte of both layers to the device: free CubeCL slices go back to the
/// engine, then the engine frees every segment with no live block (PyTorch's `empty_cache`).
/// Burn's `B::memory_cleanup(&device)` does the same.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// backend::empty_cache(&device);
/// println!("{} B still reserved by live tensors' segments", backend::memory_reserved(&device));
/// # }
/// ```
pub fn empty_cache<Dev: CachingDevice>(device: &Dev) {
    opened(device);
    Dev::Runtime::client(device).memory_cleanup();
    opened(device);
}

/// Sets every peak statistic of `device` to its current value (PyTorch's
/// `reset_peak_memory_stats`).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// backend::reset_peak_memory_stats(&device);
/// // ... an epoch ...
/// println!("the epoch's peak: {} B", backend::max_memory_reserved(&device));
/// # }
/// ```
pub fn reset_peak_memory_stats<Dev: CachingDevice>(device: &Dev) {
    let entry = opened(device);
    entry.allocator.reset_peak_memory_stats();
    if let Some(host) = &entry.host {
        host.reset_peak_stats();
    }
}

/// Zeroes every cumulative statistic of `device`: the `allocated`/`freed` totals and the
/// counters (`num_ooms`, `num_device_alloc`, ...) (PyTorch's
/// `reset_accumulated_memory_stats`).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// backend::reset_accumulated_memory_stats(&device);
/// assert_eq!(backend::memory_stats(&device).engine.num_ooms, 0);
/// # }
/// ```
pub fn reset_accumulated_memory_stats<Dev: CachingDevice>(device: &Dev) {
    let entry = opened(device);
    entry.allocator.reset_accumulated_memory_stats();
    if let Some(host) = &entry.host {
        host.reset_accumulated_stats();
    }
}

/// Caps `device`'s reserved memory at `fraction` of its total: allocations that would go above
/// fail like a device out-of-memory (after the allocator freed what it could).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// backend::set_per_process_memory_fraction(&device, 0.5)?; // half the device at most
/// # Ok(())
/// # }
/// ```
pub fn set_per_process_memory_fraction<Dev: CachingDevice>(
    device: &Dev,
    fraction: f64,
) -> Result<(), ConfigError> {
    opened(device).allocator.set_memory_fraction(fraction)
}

/// Changes `device`'s allocator settings now (PyTorch's
/// `torch.cuda.memory._set_allocator_settings`): `settings` is a `key:value,...` string with
/// the keys of `BURN_CACHING_ALLOC_CONF` (`max_split_size_mb`, `roundup_power2_divisions`,
/// `garbage_collection_threshold`, `per_process_memory_fraction`, `segment_sizing`,
/// `pool_borrowing`, `record_history`, `history_capacity`, `throw_on_cudamalloc_oom`,
/// `expandable_segments`, ...). The calling thread's fusion queue on the device is drained
/// and the server runs everything submitted before first, so operations queued before the
/// call are placed under the old settings and every later decision under the new ones. What
/// was placed before stays as it is (`expandable_segments` applies to segments made after
/// the call). See `CachingAllocator::set_allocator_settings` for each key.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// backend::set_allocator_settings(&device, "max_split_size_mb:64,garbage_collection_threshold:0.8")?;
/// assert_eq!(backend::allocator_settings(&device).max_split_size, Some(64 << 20));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// A string that does not parse, or a key the device cannot serve now (`expandable_segments`
/// on wgpu, which has no virtual memory; a fraction of a total the device cannot report):
/// nothing changes then.
pub fn set_allocator_settings<Dev: CachingDevice>(
    device: &Dev,
    settings: &str,
) -> Result<(), ConfigError> {
    opened(device).allocator.set_allocator_settings(settings)
}

/// The configuration `device`'s allocator runs with now: what it opened with, changed by
/// [`set_allocator_settings`], [`set_per_process_memory_fraction`] and
/// [`record_memory_history`].
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let config = backend::allocator_settings(&device);
/// println!("max_split_size: {:?}", config.max_split_size);
/// # }
/// ```
pub fn allocator_settings<Dev: CachingDevice>(device: &Dev) -> AllocatorConfig {
    opened(device).allocator.config()
}

/// Why a trace could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// `BURN_CACHING_ALLOC_TRACE` is not set (or empty), so there is no path to write to.
    #[error("{TRACE_ENV} is not set (or empty): there is no trace path")]
    NoPath,
    /// Writing the trace file failed.
    #[error("cannot write the trace: {0}")]
    File(#[from] crate::alloc::TraceFileError),
}

/// Writes `device`'s engine trace (JSON) to the path in `BURN_CACHING_ALLOC_TRACE` and returns
/// that path. Setting the variable before the device opens turns history recording on; the
/// trace is written only when this is called (the runtime never drops its servers).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// // Run with BURN_CACHING_ALLOC_TRACE=trace.json.gz set before the device opens.
/// let path = backend::write_trace(&device)?;
/// println!("trace written to {}", path.display());
/// # Ok(())
/// # }
/// ```
pub fn write_trace<Dev: CachingDevice>(device: &Dev) -> Result<PathBuf, TraceError> {
    let path = crate::runtime::env::trace_path().ok_or(TraceError::NoPath)?;
    write_trace_to(device, &path)?;
    Ok(path)
}

/// Writes `device`'s engine trace (JSON) to `path`, gzipped when `path` ends in `.gz`.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// backend::write_trace_to(&device, "trace.json.gz".as_ref())?;
/// # Ok(())
/// # }
/// ```
pub fn write_trace_to<Dev: CachingDevice>(device: &Dev, path: &Path) -> Result<(), TraceError> {
    Ok(opened(device).allocator.trace().write_file(path)?)
}

/// Starts recording `device`'s history with `options`, or stops with
/// [`HistoryOptions::off`] (PyTorch's `torch.cuda.memory._record_memory_history`). Stacks are
/// captured on the thread that called the operation which reserved the memory (the server's
/// `CallerStackPolicy`, `runtime/server/caller_stack.rs`). On the unfused aliases
/// (`CachingWgpuUnfused`, `CachingCudaUnfused`) that is the user's thread, so the model's
/// code and Burn's operation are in them; under fusion (`CachingWgpu`, `CachingCuda` with
/// the `fusion` feature) the operations run, and allocate, on burn-fusion's device thread, and
/// the stacks name burn-fusion's execution instead, never the model. Record on an unfused
/// alias to find the model's line.
///
/// Recording sees the engine's blocks and changes nothing the allocator decides: a tensor
/// whose freed CubeCL slice is reused for one of exactly the same size makes no engine event.
/// To see every tensor, set `BURN_CACHING_ALLOC_TRACE` before the device opens: every freed
/// slice then goes back to the engine before the next reservation (a diagnostic mode, which
/// places memory as the engine alone would).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// use burn_caching_alloc::alloc::{HistoryOptions, StackContext};
///
/// backend::record_memory_history(&device, HistoryOptions::default().with_context(StackContext::Alloc));
/// // ... the steps to look at ...
/// backend::dump_snapshot(&device, "snapshot.pickle")?;
/// backend::record_memory_history(&device, HistoryOptions::off());
/// # Ok(())
/// # }
/// ```
pub fn record_memory_history<Dev: CachingDevice>(device: &Dev, options: HistoryOptions) {
    opened(device).allocator.record_memory_history(options);
}

/// Writes `device`'s segments, blocks and history as a PyTorch-format pickle (PyTorch's
/// `torch.cuda.memory._dump_snapshot`): `_memory_viz.py` and <https://pytorch.org/memory_viz>
/// open it.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// backend::dump_snapshot(&device, "snapshot.pickle")?; // https://pytorch.org/memory_viz
/// # Ok(())
/// # }
/// ```
pub fn dump_snapshot<Dev: CachingDevice>(
    device: &Dev,
    path: impl AsRef<Path>,
) -> Result<(), InspectError> {
    let settled = settled(device);
    settled
        .entry
        .allocator
        .dump_snapshot_with(path, &settled.cached)
}

/// Writes the offline viewer of `device`'s memory to `path`: one self-contained HTML file
/// with the timeline, the segment map, the blocks' stacks, and the summary with CubeCL's layer.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// backend::dump_html(&device, "memory.html")?; // open it in any browser, offline
/// # Ok(())
/// # }
/// ```
pub fn dump_html<Dev: CachingDevice>(
    device: &Dev,
    path: impl AsRef<Path>,
) -> Result<(), InspectError> {
    let settled = settled(device);
    let allocator = settled.entry.allocator.clone();
    let cached = settled.cached.clone();
    let stats = stats_of(settled);
    let layers = [
        ViewerLayer {
            name: "CubeCL layer: bytes of live tensors".into(),
            bytes: stats.tensor_bytes(),
        },
        ViewerLayer {
            name: "CubeCL layer: cached in free slices (inactive blocks here: reserved, not \
                   allocated)"
                .into(),
            bytes: stats.cached_in_cubecl(),
        },
    ];
    allocator.dump_html_with_layers(path, &layers, &cached)
}

/// Runs `observer` with the error once every time one of `device`'s allocations fails for
/// good with out-of-memory (after every stream's CubeCL slices were reclaimed and the engine
/// flushed its cache and retried; or a request that can never fit). It runs on a thread of
/// the allocator's own, not inside the server's task, so it may call [`memory_stats`],
/// [`empty_cache`] or dump a snapshot; a panicking observer is caught and logged.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// backend::on_out_of_memory(&device, |error| eprintln!("{error}"));
/// # }
/// ```
pub fn on_out_of_memory<Dev: CachingDevice>(
    device: &Dev,
    observer: impl Fn(&AllocError) + Send + Sync + 'static,
) {
    opened(device).allocator.on_out_of_memory(observer);
}

/// Writes a PyTorch-format snapshot of `device` to `path` at its next out-of-memory (with the
/// history and stacks when they are recorded), once; `None` stops it. The same as
/// `BURN_CACHING_ALLOC_OOM_SNAPSHOT`, set from code (and the allocator's
/// `dump_snapshot_on_oom`).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// backend::dump_snapshot_on_oom(&device, Some("oom.pickle".into()));
/// # }
/// ```
pub fn dump_snapshot_on_oom<Dev: CachingDevice>(device: &Dev, path: Option<PathBuf>) {
    opened(device).allocator.dump_snapshot_on_oom(path);
}
