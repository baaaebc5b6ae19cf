//! The public, thread-safe caching allocator.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};

use super::block::BlockId;
use super::config::{AllocatorConfig, ConfigError, validate_memory_fraction};
use super::engine::{CachedAbove, Engine, MissPath};
use super::error::{AllocError, InvariantViolation};
use super::history::{HistoryOptions, PhaseStage, Snapshot, StackContext, Trace};
use super::inspect::{self, InspectError, ViewerLayer};
use super::mem_pool::{MemPoolId, MemPoolOptions, MemPoolStats};
use super::observers::{ObserverReport, ObserverThread, Observers, OomObserver};
use super::scope::Tag;
use super::stack::Stack;
use super::stats::MemoryStats;
use super::summary::Summary;
use super::units::format_bytes;
use crate::device::{DeviceMemory, DeviceStream, MemoryInfo};

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
    stream: DeviceStream,
    segment: H,
}

impl<H> Allocation<H> {
    /// Unique within its allocator, never reused.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The engine's block it was handed out as.
    pub(crate) fn block(&self) -> BlockId {
        self.block
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

    /// The stream whose cache holds the block: the stream it was allocated for, or, for a
    /// block another stream lent it (`cross_stream_reuse`), that stream (the requesting
    /// stream is then recorded as a use of the block).
    pub fn stream(&self) -> DeviceStream {
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
    oom_observers: Observers,
    oom_snapshot: Mutex<Option<PathBuf>>,
    /// The device ordinal PyTorch-format snapshots name (`device`, `device_traces` index).
    device_index: AtomicU16,
    /// The operation that panicked while it held the engine, if one did (see [`Changing`]).
    poisoned: OnceLock<&'static str>,
}

/// The engine, locked for an operation that changes it. If the thread panics while holding it
/// (parking_lot's mutex does not poison, and CubeCL catches panics in server tasks and carries
/// on), dropping it during the unwind marks the allocator poisoned before the lock is released,
/// so the next operation, on any thread, sees the mark as soon as it holds the lock.
struct Changing<'a, D: DeviceMemory> {
    engine: MutexGuard<'a, Engine<D>>,
    poisoned: &'a OnceLock<&'static str>,
    operation: &'static str,
}

impl<D: DeviceMemory> Drop for Changing<'_, D> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.poisoned.set(self.operation);
            log::error!(
                "caching allocator: `{}` panicked half-way through; the allocator is poisoned \
                 and hands out no more memory",
                self.operation
            );
        }
    }
}

impl<D: DeviceMemory> core::ops::Deref for Changing<'_, D> {
    type Target = Engine<D>;

    fn deref(&self) -> &Engine<D> {
        &self.engine
    }
}

impl<D: DeviceMemory> core::ops::DerefMut for Changing<'_, D> {
    fn deref_mut(&mut self) -> &mut Engine<D> {
        &mut self.engine
    }
}

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
    ///
    /// A configuration that asks the device for a capability it lacks is refused with
    /// [`ConfigError::Unsupported`], never served some other way: `expandable_segments` on a
    /// device without virtual memory ([`DeviceMemory::virtual_memory_granularity`] `None`).
    pub fn new(device: D, config: AllocatorConfig) -> Result<Self, ConfigError> {
        let stack_context = AtomicU8::new(context_level(&config.history));
        Ok(Self {
            id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
            engine: Mutex::new(Engine::new(device, config)?),
            stack_context,
            oom_observers: Observers::default(),
            oom_snapshot: Mutex::new(None),
            device_index: AtomicU16::new(0),
            poisoned: OnceLock::new(),
        })
    }

    /// Locks the engine for `operation`, which changes it; [`AllocError::Poisoned`] if an
    /// earlier operation panicked while it held the engine.
    fn change(&self, operation: &'static str) -> Result<Changing<'_, D>, AllocError> {
        let engine = self.engine.lock();
        if let Some(&operation) = self.poisoned.get() {
            return Err(AllocError::Poisoned { operation });
        }
        Ok(Changing {
            engine,
            poisoned: &self.poisoned,
            operation,
        })
    }

    /// The operation that panicked half-way through and poisoned this allocator, if one did
    /// (every operation that changes the allocator then fails with [`AllocError::Poisoned`]).
    pub fn poisoned(&self) -> Option<&'static str> {
        self.poisoned.get().copied()
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

    /// The number that tells this allocator from every other of the process.
    pub fn allocator_id(&self) -> u64 {
        self.id
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
        self.oom_observers.notify(err);
    }

    /// Serves a request with `growth`; a request that failed for good (out of memory, or one
    /// that can never fit) is reported to the observers and the first-OOM snapshot.
    fn malloc_with(
        &self,
        size: u64,
        stream: DeviceStream,
        growth: MissPath,
    ) -> Result<Option<Allocation<D::Handle>>, AllocError> {
        self.malloc_in_with(None, size, stream, growth)
    }

    /// [`malloc`](Self::malloc) for private pool `mem` (`None`: the allocator's own
    /// pools), with the miss path `growth`: what an integration with caches of its own above
    /// the engine calls (`Ok(None)` where `growth` stops before a step).
    pub fn malloc_in_with(
        &self,
        mem: Option<MemPoolId>,
        size: u64,
        stream: DeviceStream,
        growth: MissPath,
    ) -> Result<Option<Allocation<D::Handle>>, AllocError> {
        let stack = self.request_stack();
        let tag = Tag::of_request();
        let result = self.change("malloc").and_then(|mut engine| {
            engine.set_request_stack(stack);
            engine.set_request_tag(tag);
            let block = engine.malloc_in(mem, size, stream, growth);
            engine.set_request_stack(None);
            engine.set_request_tag(None);
            block.map(|b| b.map(|b| self.allocation(&engine, b)))
        });
        if let Err(err) = &result
            && err.is_out_of_memory()
        {
            self.out_of_memory(err);
        }
        result
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
    ///
    /// A request that fails for good (out of memory after the cache was freed and the
    /// allocation retried, or [`AllocError::TooLarge`]) is counted once in `num_ooms` and
    /// reported once to the observers and the first-OOM snapshot.
    pub fn malloc(
        &self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Allocation<D::Handle>, AllocError> {
        self.malloc_with(size, stream, MissPath::Allowed)
            .map(|block| block.expect("growth allowed always yields a block or an error"))
    }

    /// Allocates `size` bytes for `stream` from private pool `pool` (PyTorch's allocation
    /// inside `torch.cuda.use_mem_pool(pool)`): a cached block of the pool, or a new segment
    /// that belongs to it; see [`create_pool`](Self::create_pool).
    ///
    /// # Errors
    ///
    /// [`AllocError::UnknownPool`] for a pool not live on this allocator; otherwise as
    /// [`malloc`](Self::malloc).
    pub fn malloc_in(
        &self,
        pool: MemPoolId,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Allocation<D::Handle>, AllocError> {
        self.malloc_in_with(Some(pool), size, stream, MissPath::Allowed)
            .map(|block| block.expect("growth allowed always yields a block or an error"))
    }

    /// A new private pool (PyTorch's `torch.cuda.MemPool(use_on_oom=, no_split=)`): segments
    /// of its own that only requests routed to it ([`malloc_in`](Self::malloc_in)) take, and,
    /// with `use_on_oom`, other requests as a last resort before an out-of-memory. The
    /// device-wide statistics count its memory; [`pool_stats`](Self::pool_stats) its own.
    ///
    /// # Errors
    ///
    /// [`AllocError::Poisoned`] after a panic inside the allocator.
    pub fn create_pool(&self, options: MemPoolOptions) -> Result<MemPoolId, AllocError> {
        Ok(self.change("create_pool")?.create_pool(options))
    }

    /// Lets private pool `pool` go (PyTorch's `releasePool`): nothing may be allocated in it
    /// any more; its wholly free segments go back to the device now, each other one when its
    /// last block is freed. Returns the bytes released now.
    ///
    /// # Errors
    ///
    /// [`AllocError::UnknownPool`] for a pool not live on this allocator; a device error
    /// returning a segment.
    pub fn release_pool(&self, pool: MemPoolId) -> Result<u64, AllocError> {
        self.change("release_pool")?.release_pool(pool)
    }

    /// Returns the wholly free segments of private pool `pool` to the device while the pool
    /// lives (PyTorch returns a private pool's segments only once it is released); the bytes
    /// released. [`empty_cache`](Self::empty_cache) leaves
    /// private pools alone.
    ///
    /// # Errors
    ///
    /// [`AllocError::UnknownPool`] for a pool not live on this allocator; a device error.
    pub fn pool_empty_cache(&self, pool: MemPoolId) -> Result<u64, AllocError> {
        self.change("empty_cache")?.pool_empty_cache(pool)
    }

    /// What private pool `pool` holds now.
    ///
    /// # Errors
    ///
    /// [`AllocError::UnknownPool`] for a pool not live on this allocator.
    pub fn pool_stats(&self, pool: MemPoolId) -> Result<MemPoolStats, AllocError> {
        self.engine.lock().pool_stats(pool)
    }

    /// The options of private pool `pool`.
    ///
    /// # Errors
    ///
    /// [`AllocError::UnknownPool`] for a pool not live on this allocator.
    pub fn pool_options(&self, pool: MemPoolId) -> Result<MemPoolOptions, AllocError> {
        self.engine.lock().pool_options(pool)
    }

    /// The live private pools, by id, with their options.
    pub fn pools(&self) -> Vec<(MemPoolId, MemPoolOptions)> {
        self.engine.lock().pools()
    }

    /// The snapshot of private pool `pool`'s segments only (PyTorch's `MemPool.snapshot`);
    /// statistics, configuration and history stay the allocator's.
    ///
    /// # Errors
    ///
    /// [`AllocError::UnknownPool`] for a pool not live on this allocator.
    pub fn pool_snapshot(&self, pool: MemPoolId) -> Result<Snapshot, AllocError> {
        let engine = self.engine.lock();
        engine.pool_options(pool)?;
        let mut snapshot = engine.snapshot();
        snapshot.segments.retain(|s| s.mem_pool == Some(pool.get()));
        Ok(snapshot)
    }

    /// Allocates from cached blocks only: `Ok(None)` where `malloc` would grow. A request
    /// that can never fit is [`AllocError::TooLarge`] here too (counted and observed).
    pub fn malloc_cached(
        &self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Option<Allocation<D::Handle>>, AllocError> {
        self.malloc_with(size, stream, MissPath::CacheOnly)
    }

    /// Whether a cached free block of `stream` is exactly the size a request of `size` bytes
    /// rounds to. Best fit would place the request there whatever else were freed first
    /// (no block between the two sizes can exist), which lets a caching layer above skip
    /// handing its own free memory back before this request.
    pub fn has_exact_fit(&self, size: u64, stream: DeviceStream) -> bool {
        self.engine.lock().has_exact_fit(size, stream)
    }

    /// Allocates by every means short of flushing the cache: a cached block, new device
    /// memory, the release of oversize cached blocks. `Ok(None)` where only the flush could
    /// help, with nothing counted or observed: for a caller with caches of its own above the
    /// allocator, which gives those back and then calls [`malloc`](Self::malloc), whose
    /// failure is then the request's one out-of-memory (PyTorch's order: every cache is
    /// released before `num_ooms` counts).
    pub fn malloc_before_flush(
        &self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Option<Allocation<D::Handle>>, AllocError> {
        self.malloc_with(size, stream, MissPath::BeforeFlush)
    }

    /// Whether a cached block would serve this request without new device memory.
    pub fn can_serve_from_cache(&self, size: u64, stream: DeviceStream) -> bool {
        if size == 0 {
            return false;
        }
        let Ok(engine) = self.change("malloc") else {
            return false;
        };
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
        let mut engine = self.change("free")?;
        engine.set_request_stack(stack);
        let result = engine.free(allocation.id, allocation.block);
        engine.set_request_stack(None);
        result
    }

    /// Counts live `allocation` under scope `tag` from now on (`None`: under no scope), in
    /// place of the scope it was allocated in: for a cache above the engine that hands a live
    /// block to a new request (the runtime's CubeCL layer does, for same-size tensors).
    ///
    /// # Errors
    /// [`AllocError::InvalidFree`] when `allocation` is not live on this allocator.
    pub fn retag(
        &self,
        allocation: &Allocation<D::Handle>,
        tag: Option<Tag>,
    ) -> Result<(), AllocError> {
        if allocation.allocator != self.id {
            return Err(AllocError::InvalidFree { id: allocation.id });
        }
        self.change("retag")?
            .retag(allocation.id, allocation.block, tag)
    }

    /// Records that phase `name` begins or ends now, while the history is recorded (otherwise
    /// nothing): PyTorch's `external_annotations`, drawn as bands by the viewers. A phase
    /// marked from a thread other than the one serving the requests is ordered with them only
    /// as far as the caller made sure its requests were served first (the backend's
    /// `annotate` does).
    pub fn mark_phase(&self, name: &str, stage: PhaseStage) {
        self.engine.lock().mark_phase(name, stage);
    }

    /// Counts every live allocation of scope `from` under `to` from now on (`None`: under no
    /// scope), for a scope whose memory changes meaning (gradients that an optimizer step
    /// turned into its state); returns the bytes moved.
    ///
    /// # Errors
    /// [`AllocError::Poisoned`] when an earlier operation panicked inside the allocator.
    pub fn move_scope(&self, from: &str, to: Option<Tag>) -> Result<u64, AllocError> {
        self.move_scope_with(from, to, &CachedAbove::default())
    }

    /// [`move_scope`](Self::move_scope) that leaves the allocations of `cached` in `from`: no
    /// tensor holds them (a layer above caches them), so they do not change meaning.
    ///
    /// # Errors
    /// [`AllocError::Poisoned`] when an earlier operation panicked inside the allocator.
    pub fn move_scope_with(
        &self,
        from: &str,
        to: Option<Tag>,
        cached: &CachedAbove,
    ) -> Result<u64, AllocError> {
        Ok(self.change("move_scope")?.move_scope(from, to, cached))
    }

    /// Notes that `allocation` is used on `stream` as well as its own.
    pub fn record_stream(
        &self,
        allocation: &Allocation<D::Handle>,
        stream: DeviceStream,
    ) -> Result<(), AllocError> {
        if allocation.allocator != self.id {
            return Err(AllocError::InvalidFree { id: allocation.id });
        }
        self.change("record_stream")?
            .record_stream(allocation.id, allocation.block, stream)
    }

    /// Returns every cached segment that holds no live block to the device; returns the bytes
    /// released. Segments holding a live block stay.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        self.change("empty_cache")?.empty_cache()
    }

    /// A copy of the statistics, like `torch.cuda.memory_stats()`.
    pub fn stats(&self) -> MemoryStats {
        let engine = self.engine.lock();
        let mut stats = engine.stats().clone();
        stats.free_space = engine.free_space();
        stats
    }

    /// The statistics with the allocations of `cached` counted as cache of a layer above the
    /// engine, not as live (see [`CachedAbove`]): what a reading reports without handing that
    /// cache back, which would change where later requests go.
    pub fn stats_with(&self, cached: &CachedAbove) -> MemoryStats {
        let engine = self.engine.lock();
        let mut stats = engine.stats_with(cached);
        stats.free_space = engine.free_space();
        stats
    }

    /// Bytes the engine holds in device segments now (`stats().memory_reserved()`, without
    /// copying the statistics).
    pub fn memory_reserved(&self) -> u64 {
        self.engine.lock().stats().memory_reserved()
    }

    /// Sets every peak statistic to its current value (`torch.cuda.reset_peak_memory_stats()`).
    pub fn reset_peak_memory_stats(&self) {
        self.engine.lock().stats_mut().reset_peak();
    }

    /// Zeroes every cumulative amount and counter (`torch.cuda.reset_accumulated_memory_stats()`).
    pub fn reset_accumulated_memory_stats(&self) {
        self.engine.lock().stats_mut().reset_accumulated();
    }

    /// Every segment and block now, like `torch.cuda.memory_snapshot()`.
    pub fn snapshot(&self) -> Snapshot {
        self.engine.lock().snapshot()
    }

    /// [`snapshot`](Self::snapshot) with the allocations of `cached` shown as inactive blocks
    /// and the statistics of [`stats_with`](Self::stats_with).
    pub fn snapshot_with(&self, cached: &CachedAbove) -> Snapshot {
        self.engine.lock().snapshot_with(cached)
    }

    /// Checks the engine's internal structures against each other: free lists against blocks
    /// (no stale, missing or duplicated entry), `prev`/`next` links symmetric, every block
    /// reached from its segment, the pending-free queue against the blocks waiting on it, and
    /// each statistic's current value against a recount of the blocks. For tests and
    /// debugging: it walks everything (time linear in the blocks held). The error names the
    /// first disagreement found.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.engine
            .lock()
            .check_invariants()
            .map_err(InvariantViolation::new)
    }

    /// A table of the statistics, like `torch.cuda.memory_summary()`.
    pub fn summary(&self) -> String {
        Summary(&self.stats()).to_string()
    }

    /// Limits reserved memory to `fraction` of the device's total; `fraction` in (0, 1]. Below
    /// 1 the device must report its total memory ([`ConfigError::Unsupported`] otherwise), and
    /// the limit must hold at least one 512-byte block ([`ConfigError::InvalidValue`]
    /// otherwise); on an error the fraction in force stays.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), ConfigError> {
        let fraction = validate_memory_fraction(fraction)?;
        self.engine.lock().set_memory_fraction(fraction)
    }

    /// Changes settings of this allocator while it runs (PyTorch's
    /// `torch.cuda.memory._set_allocator_settings`): `settings` is a `key:value,...` string
    /// with the keys of [`AllocatorConfig::parse`]; each key it names takes its new value for
    /// the decisions made after the call, the others keep theirs. What was placed before
    /// stays as it is: blocks keep their size, segments their kind (`expandable_segments`
    /// applies to segments made after the call), and a lower memory fraction caps the next
    /// device allocation without giving back what is reserved. A change of `record_history`
    /// or `history_capacity` restarts the recording with the new options. A string that does
    /// not parse, or a key the device cannot serve now (`expandable_segments` without virtual
    /// memory, a fraction of a total the device cannot report), is an error and changes
    /// nothing.
    pub fn set_allocator_settings(&self, settings: &str) -> Result<(), ConfigError> {
        let mut engine = self.engine.lock();
        let (config, keys) = engine.config().with_settings(settings)?;
        engine.set_config(config, &keys)?;
        self.stack_context
            .store(context_level(&engine.config().history), Ordering::Relaxed);
        Ok(())
    }

    /// A copy of the configuration in use.
    pub fn config(&self) -> AllocatorConfig {
        self.engine.lock().config().clone()
    }

    /// Starts recording with `options`, or stops with [`HistoryOptions::off`] (PyTorch's
    /// `torch.cuda.memory._record_memory_history`). Starting clears what was recorded; the
    /// blocks and segments live now are remembered, so their frees are recorded with their
    /// addresses (without a stack).
    pub fn record_memory_history(&self, options: HistoryOptions) {
        let mut engine = self.engine.lock();
        engine.record_memory_history(options);
        self.stack_context
            .store(context_level(&options), Ordering::Relaxed);
    }

    /// Holds the engine's lock until the guard drops: an integration's tests check that a path
    /// takes no lock with it. Not for production use.
    #[doc(hidden)]
    pub fn hold_engine_lock(&self) -> impl Sized + '_ {
        self.engine.lock()
    }

    /// The options history is recorded with ([`HistoryOptions::off`] when not recording).
    pub fn history_options(&self) -> HistoryOptions {
        self.engine.lock().history_options()
    }

    /// Writes every segment, block and the recorded history to `path` as a pickle in the
    /// format of `torch.cuda.memory._dump_snapshot` (PyTorch's `_memory_viz.py` and
    /// <https://pytorch.org/memory_viz> open it). Stacks are resolved now, outside the lock.
    pub fn dump_snapshot(&self, path: impl AsRef<Path>) -> Result<(), InspectError> {
        self.dump_snapshot_with(path, &CachedAbove::default())
    }

    /// [`dump_snapshot`](Self::dump_snapshot) of [`snapshot_with`](Self::snapshot_with).
    pub fn dump_snapshot_with(
        &self,
        path: impl AsRef<Path>,
        cached: &CachedAbove,
    ) -> Result<(), InspectError> {
        let device = self.device_index.load(Ordering::Relaxed);
        inspect::write_torch_snapshot(&self.snapshot_with(cached), device, path.as_ref())
    }

    /// Sets the device ordinal snapshots name (0 until set; the runtimes set their device's).
    pub fn set_device_index(&self, index: u16) {
        self.device_index.store(index, Ordering::Relaxed);
    }

    /// Writes the offline viewer of the current snapshot to `path`: one self-contained HTML
    /// file (timeline, segment map, stacks, summary).
    pub fn dump_html(&self, path: impl AsRef<Path>) -> Result<(), InspectError> {
        self.dump_html_with_layers(path, &[], &CachedAbove::default())
    }

    /// [`dump_html`](Self::dump_html) with caches above the engine shown beside its numbers,
    /// the allocations of `cached` shown as inactive blocks (see
    /// [`snapshot_with`](Self::snapshot_with)).
    pub fn dump_html_with_layers(
        &self,
        path: impl AsRef<Path>,
        layers: &[ViewerLayer],
        cached: &CachedAbove,
    ) -> Result<(), InspectError> {
        inspect::write_viewer_html(
            &self.snapshot_with(cached),
            "burn-caching-alloc memory",
            layers,
            path.as_ref(),
        )
    }

    /// Runs `observer` with the error once every time a request fails for good with
    /// out-of-memory ([`AllocError::is_out_of_memory`]: after every cache was given back and
    /// the allocation retried, or a request that can never fit), outside the allocator's
    /// lock, where [`set_observer_thread`](Self::set_observer_thread) says. An observer that
    /// panics is caught and logged; the request's error stands.
    pub fn on_out_of_memory(&self, observer: impl Fn(&AllocError) + Send + Sync + 'static) {
        let observer: OomObserver = Arc::new(observer);
        self.oom_observers.push(observer);
    }

    /// Where the out-of-memory observers run from now on: on the failing request's thread
    /// (the default) or on a thread of the allocator's own. The CubeCL servers choose
    /// [`ObserverThread::Own`], so that an observer may call the backend's memory API.
    pub fn set_observer_thread(&self, thread: ObserverThread) {
        self.oom_observers.set_thread(thread);
    }

    /// Waits until the observers ran for every out-of-memory reported so far (returns at
    /// once when they run on the caller's thread, or when called from an observer), and says
    /// what they did.
    pub fn wait_for_oom_observers(&self) -> ObserverReport {
        self.oom_observers.wait()
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
/// `empty_cache` does, waiting for pending stream events first), going on past failures: a
/// failed event synchronisation keeps only its own block's segment, a segment the device
/// refuses keeps only itself, and each failure is logged as an error. Segments that still hold
/// a live allocation cannot be returned safely, since their memory may still be in use: they
/// are left to the device (freed when its context closes) and reported with a warning, like
/// gpu-allocator's leak report. A poisoned allocator (see [`AllocError::Poisoned`]) returns
/// nothing: its structures cannot say safely which segments are free.
impl<D: DeviceMemory> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        if let Some(operation) = self.poisoned.get() {
            log::error!(
                "caching allocator dropped after `{operation}` panicked half-way through: its \
                 segments are left to the device"
            );
            return;
        }
        let engine = self.engine.get_mut();
        let (_, failures) = engine.release_at_drop();
        for err in &failures {
            log::error!("caching allocator: returning cached segments on drop: {err}");
        }
        let stats = engine.stats();
        let live = stats.allocation.all.current;
        let held = stats.segment.all.current;
        if live > 0 || held > 0 {
            log::warn!(
                "caching allocator dropped with {live} live allocation(s) of {} in {held} \
                 segment(s) of {}: those segments are left to the device",
                format_bytes(stats.allocated_bytes.all.current),
                format_bytes(stats.reserved_bytes.all.current),
            );
        }
    }
}
