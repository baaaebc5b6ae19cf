//! The public, thread-safe caching allocator.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::block::BlockId;
use super::config::{AllocatorConfig, ConfigError, validate_memory_fraction};
use super::engine::{Engine, Growth};
use super::error::AllocError;
use super::history::{HistoryOptions, StackContext};
use super::inspect::{self, InspectError, ViewerLayer};
use super::snapshot::Snapshot;
use super::stack::Stack;
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
    /// The recording's stack context (0: no stacks, then `State`, `Alloc`, `All`), read
    /// before locking so that a stack is captured outside the lock.
    stack_context: AtomicU8,
    oom_observers: Mutex<Vec<OomObserver>>,
    oom_snapshot: Mutex<Option<PathBuf>>,
    /// The device ordinal PyTorch-format snapshots name (`device`, `device_traces` index).
    device_index: AtomicU32,
}

/// A callback run when a request fails with out-of-memory (see
/// [`CachingAllocator::on_out_of_memory`]).
pub type OomObserver = Arc<dyn Fn(&AllocError) + Send + Sync>;

fn context_level(options: &HistoryOptions) -> u8 {
    if !options.captures_stacks() {
        return 0;
    }
    match options.context {
        StackContext::Off => 0,
        StackContext::State => 1,
        StackContext::Alloc => 2,
        StackContext::All => 3,
    }
}

impl<D: DeviceMemory> CachingAllocator<D> {
    /// An allocator over `device` with `config`; it reserves nothing until the first `malloc`.
    pub fn new(device: D, config: AllocatorConfig) -> Self {
        Self {
            id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
            engine: Mutex::new(Engine::new(device, config)),
            stack_context: AtomicU8::new(0),
            oom_observers: Mutex::new(Vec::new()),
            oom_snapshot: Mutex::new(None),
            device_index: AtomicU32::new(0),
        }
    }

    /// A stack of the caller when the recording keeps stacks for `context` or more.
    fn capture_stack(&self, context: u8) -> Option<Stack> {
        let level = self.stack_context.load(Ordering::Relaxed);
        (level != 0 && level >= context).then(Stack::capture)
    }

    /// The stack an allocation records: the one of the request being served
    /// ([`Stack::serving`]), else the caller's; `None` when stacks are off.
    fn request_stack(&self) -> Option<Stack> {
        let level = self.stack_context.load(Ordering::Relaxed);
        (level != 0).then(Stack::of_request)
    }

    /// Whether allocations record a stack now (the history keeps stacks for blocks). One
    /// relaxed load: callers that capture a stack on another thread ask this first.
    pub fn records_stacks(&self) -> bool {
        self.stack_context.load(Ordering::Relaxed) != 0
    }

    /// Runs the out-of-memory observers (and writes the first-OOM snapshot, if asked).
    fn out_of_memory(&self, err: &AllocError) {
        if let Some(path) = self.oom_snapshot.lock().take() {
            match self.dump_snapshot(&path) {
                Ok(()) => log::warn!(
                    "caching allocator: out of memory; snapshot written to {}",
                    path.display()
                ),
                Err(e) => log::error!("caching allocator: out-of-memory snapshot: {e}"),
            }
        }
        let observers: Vec<OomObserver> = self.oom_observers.lock().clone();
        for observer in observers {
            observer(err);
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
        let stack = self.request_stack();
        let result = {
            let mut engine = self.engine.lock();
            engine.set_request_stack(stack);
            let block = engine.malloc(size, stream, Growth::Allowed);
            engine.set_request_stack(None);
            block.map(|b| {
                let b = b.expect("growth allowed always yields a block or an error");
                self.allocation(&engine, b)
            })
        };
        if let Err(err) = &result
            && err.is_out_of_memory()
        {
            self.out_of_memory(err);
        }
        result
    }

    /// Allocates from cached blocks only: `Ok(None)` where `malloc` would grow.
    pub fn malloc_cached(
        &self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation<D::Handle>>, AllocError> {
        let stack = self.request_stack();
        let mut engine = self.engine.lock();
        engine.set_request_stack(stack);
        let block = engine.malloc(size, stream, Growth::CacheOnly);
        engine.set_request_stack(None);
        Ok(block?.map(|b| self.allocation(&engine, b)))
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
        let stack = self.capture_stack(3);
        let mut engine = self.engine.lock();
        engine.set_request_stack(stack);
        let result = engine.free(allocation.id, allocation.block);
        engine.set_request_stack(None);
        result
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

    /// Starts or stops recording the trace (no stacks); starting keeps a trace already
    /// being recorded.
    pub fn record_history(&self, enabled: bool) {
        let mut engine = self.engine.lock();
        engine.set_history(enabled);
        self.stack_context
            .store(context_level(&engine.history_options()), Ordering::Relaxed);
    }

    /// Starts recording with `options`, or stops with [`HistoryOptions::off`] (PyTorch's
    /// `torch.cuda.memory._record_memory_history`). Starting clears what was recorded; the
    /// blocks and segments live now are remembered, so their frees are recorded with their
    /// addresses (without a stack).
    pub fn record_memory_history(&self, options: HistoryOptions) {
        let mut engine = self.engine.lock();
        engine.set_history_options(options);
        self.stack_context
            .store(context_level(&options), Ordering::Relaxed);
    }

    /// The options history is recorded with ([`HistoryOptions::off`] when not recording).
    pub fn history_options(&self) -> HistoryOptions {
        self.engine.lock().history_options()
    }

    /// Writes every segment, block and the recorded history to `path` as a pickle in the
    /// format of `torch.cuda.memory._dump_snapshot` (PyTorch's `_memory_viz.py` and
    /// <https://pytorch.org/memory_viz> open it). Stacks are resolved now, outside the lock.
    pub fn dump_snapshot(&self, path: impl AsRef<Path>) -> Result<(), InspectError> {
        let device = self.device_index.load(Ordering::Relaxed);
        inspect::write_torch_snapshot(&self.snapshot(), device, path.as_ref())
    }

    /// Sets the device ordinal snapshots name (0 until set; the runtimes set their device's).
    pub fn set_device_index(&self, index: u32) {
        self.device_index.store(index, Ordering::Relaxed);
    }

    /// Writes the offline viewer of the current snapshot to `path`: one self-contained HTML
    /// file (timeline, segment map, stacks, summary).
    pub fn dump_html(&self, path: impl AsRef<Path>) -> Result<(), InspectError> {
        self.dump_html_with_layers(path, &[])
    }

    /// [`dump_html`](Self::dump_html) with caches above the engine shown beside its numbers.
    pub fn dump_html_with_layers(
        &self,
        path: impl AsRef<Path>,
        layers: &[ViewerLayer],
    ) -> Result<(), InspectError> {
        inspect::write_viewer_html(
            &self.snapshot(),
            "burn-caching-alloc memory",
            layers,
            path.as_ref(),
        )
    }

    /// Runs `observer` with the error every time a request fails with out-of-memory (after
    /// the allocator's lock is released, so it may read statistics or dump a snapshot).
    pub fn on_out_of_memory(&self, observer: impl Fn(&AllocError) + Send + Sync + 'static) {
        self.oom_observers.lock().push(Arc::new(observer));
    }

    /// Writes a snapshot ([`dump_snapshot`](Self::dump_snapshot)) to `path` at the next
    /// out-of-memory, once; `None` cancels.
    pub fn dump_snapshot_on_oom(&self, path: Option<PathBuf>) {
        *self.oom_snapshot.lock() = path;
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
