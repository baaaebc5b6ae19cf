//! How the training loop reads memory statistics, one reading per step.
//!
//! The loop knows only [`MemoryProbe`]. Stock Burn backends get
//! [`CubeclUsageProbe`] (CubeCL's current `bytes_in_use` / `bytes_reserved`;
//! CubeCL keeps no peaks or device-call counters, so those stay `None`) or
//! [`NoMemoryStats`]; the caching backends get [`AllocatorProbe`], which reads
//! the allocator's PyTorch-named counters.

use cubecl_runtime::runtime::Runtime;
use serde::{Deserialize, Serialize};

/// Current bytes at one moment: what the timeline plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPoint {
    /// Bytes in live allocations.
    pub allocated: u64,
    /// Bytes held from the device (live plus cached).
    pub reserved: u64,
}

/// The report's memory section. `None` means the backend does not count it;
/// nothing here is ever estimated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryTotals {
    /// Highest allocated bytes (the allocator's own peak, not a sample).
    pub peak_allocated: Option<u64>,
    /// Highest reserved bytes (the allocator's own peak, not a sample).
    pub peak_reserved: Option<u64>,
    /// Segments taken from the device.
    pub num_device_alloc: Option<u64>,
    /// Segments handed back to the device.
    pub num_device_free: Option<u64>,
    /// Allocations that succeeded only after freeing the cache.
    pub num_alloc_retries: Option<u64>,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: Option<u64>,
}

/// One reading of an allocator's counters (all exact). All numbers are the
/// engine's: "allocated" counts the blocks the engine handed to CubeCL, which
/// includes the slices CubeCL keeps for exact-size reuse; "reserved" counts
/// the device segments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorCounters {
    /// `allocated_bytes.all.current`.
    pub allocated: u64,
    /// `reserved_bytes.all.current`.
    pub reserved: u64,
    /// `allocated_bytes.all.peak`.
    pub peak_allocated: u64,
    /// `reserved_bytes.all.peak`.
    pub peak_reserved: u64,
    /// `num_device_alloc`.
    pub num_device_alloc: u64,
    /// `num_device_free`.
    pub num_device_free: u64,
    /// `num_alloc_retries`.
    pub num_alloc_retries: u64,
    /// `num_ooms`.
    pub num_ooms: u64,
}

impl AllocatorCounters {
    /// The report's memory section, every field known.
    pub fn totals(&self) -> MemoryTotals {
        MemoryTotals {
            peak_allocated: Some(self.peak_allocated),
            peak_reserved: Some(self.peak_reserved),
            num_device_alloc: Some(self.num_device_alloc),
            num_device_free: Some(self.num_device_free),
            num_alloc_retries: Some(self.num_alloc_retries),
            num_ooms: Some(self.num_ooms),
        }
    }
}

impl From<&burn_caching_alloc::alloc::MemoryStats> for AllocatorCounters {
    fn from(stats: &burn_caching_alloc::alloc::MemoryStats) -> Self {
        Self {
            allocated: stats.allocated_bytes.all.current,
            reserved: stats.reserved_bytes.all.current,
            peak_allocated: stats.allocated_bytes.all.peak,
            peak_reserved: stats.reserved_bytes.all.peak,
            num_device_alloc: stats.num_device_alloc,
            num_device_free: stats.num_device_free,
            num_alloc_retries: stats.num_alloc_retries,
            num_ooms: stats.num_ooms,
        }
    }
}

/// Reads memory statistics for the training loop.
pub trait MemoryProbe {
    /// Current allocated and reserved bytes, if the backend reports them.
    fn point(&mut self) -> Option<MemoryPoint>;
    /// The report's memory section.
    fn totals(&mut self) -> MemoryTotals;
    /// A human-readable summary (the allocator's `memory_summary`), if any.
    fn summary(&mut self) -> Option<String> {
        None
    }
}

/// For backends that report nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMemoryStats;

impl MemoryProbe for NoMemoryStats {
    fn point(&mut self) -> Option<MemoryPoint> {
        None
    }
    fn totals(&mut self) -> MemoryTotals {
        MemoryTotals::default()
    }
}

/// A stock CubeCL runtime's `memory_usage()`: current bytes in use and
/// reserved. CubeCL 0.10 keeps no peaks and no device-call counters, so
/// [`MemoryProbe::totals`] is all `None`.
#[derive(Debug, Clone)]
pub struct CubeclUsageProbe<R: Runtime> {
    device: R::Device,
}

impl<R: Runtime> CubeclUsageProbe<R> {
    /// Probes the runtime's client for `device`.
    pub fn new(device: R::Device) -> Self {
        Self { device }
    }
}

impl<R: Runtime> MemoryProbe for CubeclUsageProbe<R> {
    fn point(&mut self) -> Option<MemoryPoint> {
        let usage = R::client(&self.device).memory_usage().ok()?;
        Some(MemoryPoint {
            allocated: usage.bytes_in_use,
            reserved: usage.bytes_reserved,
        })
    }
    fn totals(&mut self) -> MemoryTotals {
        MemoryTotals::default()
    }
}

/// Reads a caching allocator through two functions: its counters and its
/// summary (in practice `burn_caching_alloc::backend::memory_stats(&device)` and
/// `burn_caching_alloc::backend::memory_summary(&device)`).
pub struct AllocatorProbe<S, T>
where
    S: FnMut() -> AllocatorCounters,
    T: FnMut() -> String,
{
    counters: S,
    summary: T,
}

impl<S, T> AllocatorProbe<S, T>
where
    S: FnMut() -> AllocatorCounters,
    T: FnMut() -> String,
{
    /// A probe over the given readers.
    pub fn new(counters: S, summary: T) -> Self {
        Self { counters, summary }
    }
}

impl<S, T> MemoryProbe for AllocatorProbe<S, T>
where
    S: FnMut() -> AllocatorCounters,
    T: FnMut() -> String,
{
    fn point(&mut self) -> Option<MemoryPoint> {
        let c = (self.counters)();
        Some(MemoryPoint {
            allocated: c.allocated,
            reserved: c.reserved,
        })
    }
    fn totals(&mut self) -> MemoryTotals {
        (self.counters)().totals()
    }
    fn summary(&mut self) -> Option<String> {
        Some((self.summary)())
    }
}
