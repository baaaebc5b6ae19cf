//! The public, thread-safe caching allocator.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::block::BlockId;
use super::config::{AllocatorConfig, ConfigError, validate_memory_fraction};
use super::engine::{Engine, Growth};
use super::error::AllocError;
use super::snapshot::Snapshot;
use super::stats::MemoryStats;
use super::summary::summary;
use super::trace::Trace;
use super::units::format_bytes;
use crate::device::{DeviceMemory, MemoryInfo, StreamId};

static NEXT_ALLOCATOR_ID: AtomicU64 = AtomicU64::new(1);

/// One live block handed out by a [`CachingAllocator`].
///
/// It describes memory like a pointer does: cloning it is allowed, and freeing it twice (or
/// freeing it on another allocator) is reported as [`AllocError::InvalidFree`].
#[derive(Clone, Debug)]
pub struct Allocation<H> {
    allocator: u64,
    id: u64,
    block: BlockId,
    address: u64,
    offset: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
    segment: H,
}

impl<H> Allocation<H> {
    /// Unique within its allocator, never reused.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The device address of the block.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The block's size: the request rounded up (at least `requested_size`).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The size the caller asked for, in bytes.
    pub fn requested_size(&self) -> u64 {
        self.requested
    }

    /// The stream the block was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The device handle of the segment holding the block.
    pub fn segment(&self) -> &H {
        &self.segment
    }

    /// The block's offset inside its segment.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

/// A PyTorch-style caching allocator over any [`DeviceMemory`].
///
/// Every method takes `&self` and locks one mutex, so one allocator serves many threads.
pub struct CachingAllocator<D: DeviceMemory> {
    id: u64,
    engine: Mutex<Engine<D>>,
}

impl<D: DeviceMemory> CachingAllocator<D> {
    /// An allocator over `device` with `config`; it reserves nothing until the first `malloc`.
    pub fn new(device: D, config: AllocatorConfig) -> Self {
        Self {
            id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
            engine: Mutex::new(Engine::new(device, config)),
        }
    }

    fn allocation(&self, engine: &Engine<D>, block: BlockId) -> Allocation<D::Handle> {
        let info = engine.block_info(block);
        Allocation {
            allocator: self.id,
            id: info.allocation_id,
            block,
            address: info.address,
            offset: info.offset,
            size: info.size,
            requested: info.requested,
            stream: info.stream,
            segment: info.segment,
        }
    }

    /// Allocates `size` bytes for `stream`, growing reserved memory if no cached block fits.
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<Allocation<D::Handle>, AllocError> {
        let mut engine = self.engine.lock();
        let block = engine
            .malloc(size, stream, Growth::Allowed)?
            .expect("growth allowed always yields a block or an error");
        Ok(self.allocation(&engine, block))
    }

    /// Allocates from cached blocks only: `Ok(None)` where `malloc` would grow.
    pub fn malloc_cached(
        &self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation<D::Handle>>, AllocError> {
        let mut engine = self.engine.lock();
        let block = engine.malloc(size, stream, Growth::CacheOnly)?;
        Ok(block.map(|b| self.allocation(&engine, b)))
    }

    /// Whether a cached block would serve this request without new device memory.
    pub fn can_serve_from_cache(&self, size: u64, stream: StreamId) -> bool {
        if size == 0 {
            return false;
        }
        let engine = self.engine.lock();
        let (rounded, pool) = engine.block_for(size);
        engine.find_free_block(pool, stream, rounded).is_some()
    }

    /// Frees an allocation. Its block is reusable at once, or, if it was used on other
    /// streams, once events recorded on those streams now have completed.
    pub fn free(&self, allocation: Allocation<D::Handle>) -> Result<(), AllocError> {
        if allocation.allocator != self.id {
            return Err(AllocError::InvalidFree { id: allocation.id });
        }
        self.engine.lock().free(allocation.id, allocation.block)
    }

    /// Notes that `allocation` is used on `stream` as well as its own.
    pub fn record_stream(
        &self,
        allocation: &Allocation<D::Handle>,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        if allocation.allocator != self.id {
            return Err(AllocError::InvalidFree { id: allocation.id });
        }
        self.engine
            .lock()
            .record_stream(allocation.id, allocation.block, stream)
    }

    /// Returns every cached segment that holds no live block to the device; returns the bytes
    /// released. Segments holding a live block stay.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        self.engine.lock().empty_cache()
    }

    /// A copy of the statistics, like `torch.cuda.memory_stats()`.
    pub fn stats(&self) -> MemoryStats {
        self.engine.lock().stats().clone()
    }

    /// Bytes the engine holds in device segments now (`stats().memory_reserved()`, without
    /// copying the statistics).
    pub fn memory_reserved(&self) -> u64 {
        self.engine.lock().stats().memory_reserved()
    }

    /// Sets every peak statistic to its current value (`torch.cuda.reset_peak_memory_stats()`).
    pub fn reset_peak_stats(&self) {
        self.engine.lock().stats_mut().reset_peak();
    }

    /// Zeroes every cumulative amount and counter (`torch.cuda.reset_accumulated_memory_stats()`).
    pub fn reset_accumulated_stats(&self) {
        self.engine.lock().stats_mut().reset_accumulated();
    }

    /// Every segment and block now, like `torch.cuda.memory_snapshot()`.
    pub fn snapshot(&self) -> Snapshot {
        self.engine.lock().snapshot()
    }

    /// Checks the engine's internal structures against each other: free lists against blocks
    /// (no stale, missing or duplicated entry), `prev`/`next` links symmetric, every block
    /// reached from its segment, the pending-free queue against the blocks waiting on it, and
    /// each statistic's current value against a recount of the blocks. For tests and
    /// debugging: it walks everything (time linear in the blocks held). The error names the
    /// first disagreement found.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.engine.lock().check_invariants()
    }

    /// A table of the statistics, like `torch.cuda.memory_summary()`.
    pub fn summary(&self) -> String {
        summary(&self.stats())
    }

    /// Limits reserved memory to `fraction` of the device's total; `fraction` in (0, 1].
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), ConfigError> {
        let fraction = validate_memory_fraction(fraction)?;
        self.engine.lock().set_memory_fraction(fraction);
        Ok(())
    }

    /// A copy of the configuration in use.
    pub fn config(&self) -> AllocatorConfig {
        self.engine.lock().config().clone()
    }

    /// Starts or stops recording the trace.
    pub fn record_history(&self, enabled: bool) {
        self.engine.lock().set_history(enabled);
    }

    /// The trace recorded so far (empty when history is off).
    pub fn trace(&self) -> Trace {
        self.engine.lock().trace()
    }

    /// Free and total bytes of the device, as its driver reports them now.
    pub fn device_memory_info(&self) -> Result<MemoryInfo, AllocError> {
        Ok(self.engine.lock().device_mut().memory_info()?)
    }
}

/// Dropping an allocator returns every segment that holds no live block to the device (as
/// `empty_cache` does, waiting for pending stream events first). Segments that still hold a
/// live allocation cannot be returned safely, since their memory may still be in use: they are
/// left to the device (freed when its context closes) and reported with a warning, like
/// gpu-allocator's leak report.
impl<D: DeviceMemory> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        let engine = self.engine.get_mut();
        if let Err(err) = engine.release_cached_blocks() {
            log::error!("caching allocator: returning cached segments on drop failed: {err}");
        }
        let stats = engine.stats();
        let live = stats.allocation.all.current;
        if live > 0 {
            log::warn!(
                "caching allocator dropped with {live} live allocation(s) of {} in {} \
                 segment(s) of {}: those segments are left to the device",
                format_bytes(stats.allocated_bytes.all.current),
                stats.segment.all.current,
                format_bytes(stats.reserved_bytes.all.current),
            );
        }
    }
}
