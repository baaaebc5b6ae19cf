//! The engine's state and its two entry points, malloc and free.
//!
//! Its parts are child modules, each adding methods to [`Engine`]: placement (best fit,
//! split, merge) in `placement`, borrowing the other pool's free memory in `borrowing`,
//! expandable segments (pages mapped into a reserved range) in
//! `expandable`, private pools (PyTorch's `MemPool`) in `pools`, the release steps of the miss path and `empty_cache` in `release`,
//! cross-stream frees in `events`, other streams' cached segments in `sharing`, the mode
//! that caches nothing (`no_cuda_memory_caching`) in `uncached`, the snapshot in `snapshot`, and the consistency check of
//! blocks, pools and statistics in `self_check`. The public, thread-safe face is
//! `CachingAllocator` in `allocator.rs`.
//!
//! A request walks this path, PyTorch's, in order:
//! 1. complete pending frees whose stream events have finished;
//! 2. round the size, pick the pool, take the best-fitting cached block of the same stream;
//! 3. on a miss, unless the request may only use the cache: borrow the other pool's free
//!    memory (`pool_borrowing`, ours, on by default: see `borrowing`); else take a wholly
//!    free segment another stream cached once its work is done (`cross_stream_reuse`, ours,
//!    on by default: see `sharing`); else collect
//!    garbage if a threshold and a memory fraction below 1 are set (whole free large segments
//!    at least the mean age, by large-pool searches since cached);
//! 4. allocate a new segment from the device (refused up front if it would break the
//!    per-process memory fraction); for a large request, the stream's wholly free large
//!    segments it outgrew go back to the device first, up to the new segment's size
//!    (`release_outgrown`, ours, on by default: see `release`);
//! 5. if that fails, free cached oversize blocks and retry;
//! 6. if that fails, synchronise pending events, free every unsplit cached segment and retry
//!    (`num_alloc_retries` += 1);
//! 7. if that fails, take a cached block of a `use_on_oom` private pool (see `pools`), else
//!    report out-of-memory (`num_ooms` += 1) with the numbers that explain it.
//!
//! A request that can never fit (beyond the device or its largest buffer) fails before step 3
//! with `TooLarge`, counted as an out-of-memory as PyTorch counts it.

mod borrowing;
mod cached_above;
mod events;
mod expandable;
mod placement;
mod pools;
mod release;
mod self_check;
mod settings;
mod sharing;
mod snapshot;
mod tags;
mod uncached;

use crate::alloc::block::{BlockId, BlockState, Blocks};
use crate::alloc::config::{AllocatorConfig, ConfigError};
use crate::alloc::error::{AllocError, OomDiagnosis, OomNumbers};
use crate::alloc::free_list::FreeList;
use crate::alloc::history::{HistoryEntry, HistoryOptions, Recorder, Trace, TraceEvent};
use crate::alloc::mem_pool::MemPoolId;
use crate::alloc::scope::Tag;
use crate::alloc::size::{
    MIN_BLOCK_SIZE, PoolKind, SMALL_BUFFER, SMALL_SIZE, round_size, segment_size,
};
use crate::alloc::stack::Stack;
use crate::alloc::units::MIB;
pub use cached_above::CachedAbove;
use events::PendingFrees;
use sharing::StreamTable;

/// The largest large-pool block size kept in size classes (8 KiB of bitmap per stream, and
/// 1.5 KiB of vectors for each group of 64 sizes a stream lists); larger free blocks live in
/// an ordered map.
const LARGE_CLASS_LIMIT: u64 = 32 * MIB;
use crate::alloc::stats::{FreeSpace, MemoryStats};
use crate::device::{DeviceMemory, DeviceStream};

pub(crate) struct Engine<D: DeviceMemory> {
    device: D,
    config: AllocatorConfig,
    blocks: Blocks<D::Handle>,
    small: FreeList,
    large: FreeList,
    pending: PendingFrees<D::Event>,
    /// Freed blocks with streams whose event failed to record: held until it records.
    needs_events: Vec<BlockId>,
    /// Unmapped blocks of expandable segments, by (pool, stream, address).
    unmapped: std::collections::BTreeMap<(PoolKind, u64, u64), BlockId>,
    /// The device's virtual-memory page granularity, asked once (`None`: no virtual memory).
    vm_granularity: Option<u64>,
    stats: MemoryStats,
    history: Option<Recorder>,
    /// Large-pool cache searches while garbage collection is on: the clock that ages cached
    /// blocks (PyTorch's `get_free_blocks_call_count`).
    large_searches: u64,
    /// Misses that a full cache release saved from an out-of-memory (for the OOM advice).
    rescued_by_flush: u64,
    next_allocation_id: u64,
    /// The device's total memory, asked once.
    device_total: Option<u64>,
    /// The device's largest segment, asked once (a property of the device, and the miss path
    /// needs it for every request).
    max_segment: Option<u64>,
    /// Per stream, what sharing its cache with other streams needs (see `sharing`).
    streams: StreamTable<D::Event>,
    /// The scope of the request being served (see `tags`).
    request_tag: Option<Tag>,
    /// The private pools, by id (see `pools`).
    private: std::collections::BTreeMap<MemPoolId, pools::PrivatePool>,
    /// The last private pool id handed out.
    next_pool: u64,
}

/// A live block as the allocator hands it out.
pub(super) struct BlockInfo<H> {
    pub(super) allocation_id: u64,
    pub(super) address: u64,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) stream: DeviceStream,
    pub(super) segment: H,
}

/// Whether a miss may allocate new device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissPath {
    /// The whole miss path, to an out-of-memory error.
    Allowed,
    /// A cached block only; a miss is `Ok(None)`.
    CacheOnly,
    /// The miss path up to step 5; where step 6 (the cache flush) would be next, `Ok(None)`,
    /// with nothing counted: a caller with caches of its own above the engine gives them back
    /// first and then asks again with [`MissPath::Allowed`].
    BeforeFlush,
}

/// Refuses a configuration that asks `device` for a capability it lacks, rather than serving
/// it some other way: `expandable_segments` maps pages into a reserved address range, which a
/// device without virtual memory ([`DeviceMemory::virtual_memory_granularity`] `None`, e.g.
/// wgpu) cannot do. The one check for it: the server opening a device reaches it through
/// [`CachingAllocator::new`](crate::alloc::CachingAllocator::new) too.
fn unsupported_by<D: DeviceMemory>(
    config: &AllocatorConfig,
    device: &D,
) -> Result<(), ConfigError> {
    if config.expandable_segments && device.virtual_memory_granularity().is_none() {
        return Err(ConfigError::Unsupported {
            key: "expandable_segments".into(),
            reason: "this device has no virtual memory (it cannot map pages into a reserved \
                     address range, e.g. wgpu); use a device that has (CUDA) or leave it off"
                .into(),
        });
    }
    Ok(())
}

impl<D: DeviceMemory> Engine<D> {
    /// An engine over `device`; [`ConfigError::Unsupported`] for a configuration the device
    /// cannot serve (see [`unsupported_by`]).
    pub fn new(device: D, config: AllocatorConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        unsupported_by(&config, &device)?;
        // Nothing is live yet: the recorder starts from an empty device.
        let history = Recorder::start(config.history, []);
        let stats = MemoryStats {
            max_split_size: config
                .max_split_size
                .map_or(-1, crate::alloc::stats::signed),
            ..MemoryStats::default()
        };
        let fraction = config.memory_fraction;
        let mut engine = Self {
            vm_granularity: device.virtual_memory_granularity(),
            max_segment: device.max_segment_size(),
            device,
            config,
            blocks: Blocks::default(),
            // Small-pool blocks are at most one small segment: all of them in size classes.
            small: FreeList::with_classes(MIN_BLOCK_SIZE, SMALL_BUFFER),
            // Large-pool blocks are over 1 MiB; classes hold the 20 MiB segments and their
            // splits, the ordered map anything larger.
            large: FreeList::with_classes(SMALL_SIZE + MIN_BLOCK_SIZE, LARGE_CLASS_LIMIT),
            pending: PendingFrees::default(),
            needs_events: Vec::new(),
            unmapped: std::collections::BTreeMap::new(),
            stats,
            history,
            large_searches: 0,
            rescued_by_flush: 0,
            next_allocation_id: 1,
            device_total: None,
            streams: StreamTable::default(),
            request_tag: None,
            private: std::collections::BTreeMap::new(),
            next_pool: 0,
        };
        // A configured fraction that cannot be enforced is not kept in force silently: without
        // the device's total it is dropped (and `config()` shows it gone); one that allows no
        // block stays, so that every request fails with an out-of-memory naming the limit.
        if let Some(fraction) = fraction
            && let Err(err) = engine.enforceable_fraction(fraction)
        {
            log::warn!("caching allocator: {err}");
            if matches!(err, ConfigError::Unsupported { .. }) {
                engine.config.memory_fraction = None;
            }
        }
        Ok(engine)
    }

    /// The statistics.
    pub(super) fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    /// The free memory's shape now (a walk of every block: for readings).
    pub(super) fn free_space(&self) -> FreeSpace {
        let mut free = FreeSpace::default();
        for (_, block) in self.blocks.iter() {
            // Unmapped address space of expandable segments is not memory.
            if block.state == BlockState::Inactive && block.is_mapped() {
                free.add(self.blocks.segment(block.segment()).pool, block.size());
            }
        }
        free
    }

    /// The statistics, for resetting peaks and counters.
    pub(super) fn stats_mut(&mut self) -> &mut MemoryStats {
        &mut self.stats
    }

    /// The configuration in force.
    pub(super) fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// Caps reserved memory at `fraction` of the device's total from now on, if the fraction
    /// can be enforced (see [`Engine::enforceable_fraction`]); nothing changes otherwise.
    pub(super) fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), ConfigError> {
        self.enforceable_fraction(fraction)?;
        self.config.memory_fraction = Some(fraction);
        Ok(())
    }

    /// Whether a memory fraction (already checked to be in (0, 1]) can be enforced on this
    /// device: below 1 it needs the device's total memory, and it must allow at least one
    /// block of the smallest size, or no request could ever succeed.
    pub(super) fn enforceable_fraction(&mut self, fraction: f64) -> Result<(), ConfigError> {
        const KEY: &str = "per_process_memory_fraction";
        if fraction >= 1.0 {
            return Ok(());
        }
        let Some(total) = self.device_total() else {
            return Err(ConfigError::Unsupported {
                key: KEY.into(),
                reason: format!(
                    "the device cannot report its total memory, so a fraction of it ({fraction}) \
                     cannot be enforced"
                ),
            });
        };
        let limit = (fraction * total as f64) as u64;
        if limit < MIN_BLOCK_SIZE {
            return Err(ConfigError::InvalidValue {
                key: KEY.into(),
                value: fraction.to_string(),
                expected: format!(
                    "a fraction that allows at least one {MIN_BLOCK_SIZE}-byte block of the \
                     device's {total} bytes (it allows {limit} bytes)"
                ),
            });
        }
        Ok(())
    }

    /// The trace recorded so far (empty when history is off).
    pub(super) fn trace(&self) -> Trace {
        self.history
            .as_ref()
            .map(|h| h.to_trace())
            .unwrap_or_default()
    }

    /// The device, for reading what it reports (free and total bytes).
    pub(super) fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// Where live block `block` is: its allocation id, segment handle and address, offset,
    /// size, requested size and stream.
    pub(super) fn block_info(&self, block: BlockId) -> BlockInfo<D::Handle> {
        let b = &self.blocks[block];
        let segment = self.blocks.segment(b.segment());
        BlockInfo {
            allocation_id: b.allocation_id,
            address: segment.address + b.offset(),
            offset: b.offset(),
            size: b.size(),
            requested: b.requested,
            stream: segment.stream,
            segment: segment.handle.clone(),
        }
    }

    fn free_list(&mut self, pool: PoolKind) -> &mut FreeList {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    pub fn free_list_ref(&self, pool: PoolKind) -> &FreeList {
        match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    /// `max_split_size`, `u64::MAX` when unlimited.
    pub fn max_split(&self) -> u64 {
        self.config.max_split_size.unwrap_or(u64::MAX)
    }

    pub fn record(&mut self, event: impl FnOnce() -> TraceEvent) {
        if let Some(history) = &mut self.history {
            history.record(event());
        }
    }

    /// Starts recording with `options` (a fresh ring that knows the blocks and segments live
    /// now, so later frees match), or stops recording; the configuration in force says so.
    pub fn record_memory_history(&mut self, options: HistoryOptions) {
        self.config.history = options;
        self.history = Recorder::start(options, self.live_now());
    }

    /// The options history is recorded with (off when not recording).
    pub fn history_options(&self) -> HistoryOptions {
        self.history
            .as_ref()
            .map_or_else(HistoryOptions::off, |h| h.options())
    }

    /// The stack of the request about to be served (`None` after it).
    pub fn set_request_stack(&mut self, stack: Option<Stack>) {
        if let Some(history) = &mut self.history {
            history.set_request_stack(stack);
        }
    }

    /// The history in PyTorch's terms, oldest first (empty when not recording a trace).
    pub fn history_entries(&self) -> Vec<HistoryEntry> {
        self.history
            .as_ref()
            .map(|h| h.entries())
            .unwrap_or_default()
    }

    /// The device's total memory (asked once; `None` if the device cannot say).
    pub fn device_total(&mut self) -> Option<u64> {
        if self.device_total.is_none() {
            self.device_total = self.device.memory_info().ok().map(|info| info.total);
        }
        self.device_total
    }

    /// What the per-process memory fraction allows reserved memory to reach; `None` without
    /// a fraction, or with 1.0, which means no limit (PyTorch's `setMemoryFraction`).
    pub fn fraction_limit(&mut self) -> Option<u64> {
        let fraction = self.config.memory_fraction.filter(|f| *f < 1.0)?;
        let total = self.device_total()?;
        Some((fraction * total as f64) as u64)
    }

    /// Whether garbage collection is on: a threshold and a memory fraction below 1 (PyTorch
    /// runs `garbage_collect_cached_blocks` only with both).
    pub fn gc_enabled(&self) -> bool {
        self.config.garbage_collection_threshold.is_some()
            && self.config.memory_fraction.is_some_and(|f| f < 1.0)
    }

    /// The block size and pool a request of `size` bytes (> 0) takes.
    pub fn block_for(&self, size: u64) -> (u64, PoolKind) {
        let rounded = round_size(size, &self.config.roundup_power2_divisions);
        (rounded, PoolKind::for_size(rounded))
    }

    /// Whether the best fit for a request of `size` bytes on `stream` is a cached block of
    /// exactly its rounded size.
    pub fn has_exact_fit(&self, size: u64, stream: DeviceStream) -> bool {
        let (rounded, pool) = self.block_for(size);
        !self.uncached()
            && self
                .free_list_ref(pool)
                .best_fit(stream, rounded)
                .is_some_and(|(found, _)| found == rounded)
    }

    /// Serves a request from private pool `mem` (see `pools`), or from the allocator's own
    /// pools with `None`; `Ok(None)` only on a miss with [`MissPath::CacheOnly`], or with
    /// [`MissPath::BeforeFlush`] where only the cache flush could help;
    /// [`AllocError::UnknownPool`] for a pool that is not live. Under
    /// `no_cuda_memory_caching` nothing is cached, so the pool is not used.
    pub fn malloc_in(
        &mut self,
        mem: Option<MemPoolId>,
        size: u64,
        stream: DeviceStream,
        growth: MissPath,
    ) -> Result<Option<BlockId>, AllocError> {
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        if let Some(id) = mem {
            self.pool_options(id)?;
        }
        self.process_events()?;
        if self.uncached() {
            return self.malloc_uncached(mem, size, stream, growth);
        }
        let total = self.device_total();
        let (rounded, pool) = self.block_for(size);
        if let Some(total) = total
            && rounded > total
        {
            return Err(self.too_large(size, total, stream));
        }
        let large = (
            self.stats.reserved_bytes.large_pool.current,
            self.stats.active_bytes.large_pool.current,
        );
        let mut new_segment = segment_size(
            rounded,
            self.config.segment_sizing,
            large.0,
            large.0.saturating_sub(large.1),
        );
        if let Some(max) = self.max_segment
            && new_segment > max
        {
            if rounded > max {
                return Err(self.too_large(size, max, stream));
            }
            new_segment = rounded;
        }
        if pool == PoolKind::Large && mem.is_none() && self.gc_enabled() {
            self.large_searches += 1;
        }
        if let Some(block) = self.take_free_block_in(mem, pool, stream, rounded) {
            return Ok(Some(self.allocate_block(mem, block, rounded, size)));
        }
        if growth == MissPath::CacheOnly {
            return Ok(None);
        }

        let flush = growth == MissPath::Allowed;
        match self.grow(mem, new_segment, pool, stream, (size, rounded), flush) {
            // Another stream's block when lent (see `sharing`).
            Ok(Some(block)) => Ok(Some(
                self.allocate_block_for(mem, block, rounded, size, stream),
            )),
            Ok(None) if !flush => Ok(None),
            Ok(None) => {
                // PyTorch's last resort (a request of a private pool just fails).
                if mem.is_none()
                    && let Some(block) = self.take_from_oom_pools(pool, stream, rounded)
                {
                    return Ok(Some(self.allocate_block(mem, block, rounded, size)));
                }
                Err(self.out_of_memory(size, stream))
            }
            Err(AllocError::TooLarge { max, .. }) => Err(self.too_large(size, max, stream)),
            Err(e) => Err(e),
        }
    }

    /// Steps 3 to 6 of the miss path (to 5 without `flush`): a new segment of `new_segment`
    /// bytes for a request of `size` bytes (a block of `rounded`), freeing cache as needed;
    /// `None` when even that fails. With `throw_on_cudamalloc_oom`, a device allocation over
    /// the memory fraction's cap fails at once instead (see [`Engine::reject_over_cap`]).
    /// A request of private pool `mem` skips the steps that serve the allocator's own pools
    /// (borrowing, other streams' segments, garbage collection, oversize release) and takes an
    /// ordinary segment of the pool (see `pools`).
    fn grow(
        &mut self,
        mem: Option<MemPoolId>,
        new_segment: u64,
        pool: PoolKind,
        stream: DeviceStream,
        (size, rounded): (u64, u64),
        flush: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if mem.is_none() {
            if let Some(block) = self.borrow_from_other_pool(pool, stream, rounded) {
                return Ok(Some(block));
            }
            if let Some(block) = self.take_from_other_stream(pool, stream, rounded)? {
                return Ok(Some(block));
            }
            if let Some(block) = self.borrow_from_other_stream(pool, stream, rounded)? {
                return Ok(Some(block));
            }
            if let Some(block) = self.lend_from_other_stream(pool, stream, rounded) {
                return Ok(Some(block));
            }
            if self.gc_enabled() {
                self.collect_garbage()?;
            }
        }
        self.reject_over_cap(size, new_segment, stream)?;
        if mem.is_none() && pool == PoolKind::Large {
            self.release_outgrown(stream, rounded, new_segment);
        }
        let mut block = self.new_memory(mem, new_segment, pool, stream, rounded)?;
        if block.is_none()
            && mem.is_none()
            && self.release_oversize_blocks(pool, stream, rounded)?
        {
            block = self.new_memory(mem, new_segment, pool, stream, rounded)?;
        }
        if block.is_none() && flush {
            self.release_cached_blocks()?;
            self.stats.num_alloc_retries += 1;
            block = self.new_memory(mem, new_segment, pool, stream, rounded)?;
            self.rescued_by_flush += u64::from(block.is_some());
        }
        Ok(block)
    }

    /// A free, unlisted block of at least `rounded` bytes from new device memory: a segment of
    /// `new_segment` bytes, or pages mapped into the stream's expandable segment. The memory
    /// fraction is checked against `new_segment` either way (PyTorch's `alloc_block` checks
    /// `alloc_size` before it maps).
    fn new_memory(
        &mut self,
        mem: Option<MemPoolId>,
        new_segment: u64,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if !self.expandable() || mem.is_some() {
            return self.allocate_segment_in(mem, new_segment, pool, stream);
        }
        if let Some(limit) = self.fraction_limit()
            && self.stats.memory_reserved() + new_segment > limit
        {
            return Ok(None);
        }
        self.allocate_expandable(pool, stream, rounded)
    }

    /// PyTorch's `throw_on_cudamalloc_oom` (its preemptive rejection in `alloc_block`): with
    /// the key on and a memory fraction below 1, new device memory of `needed` bytes that
    /// would take reserved memory above the cap is refused at once, before any device call and
    /// without releasing oversize blocks or flushing the cache: [`AllocError::Rejected`],
    /// counted in `num_oom_rejections` (not `num_ooms`), with an `oom` trace entry. The steps
    /// before it (the cache, borrowing, garbage collection) have run, as PyTorch's do before
    /// `alloc_block`.
    fn reject_over_cap(
        &mut self,
        size: u64,
        needed: u64,
        stream: DeviceStream,
    ) -> Result<(), AllocError> {
        if !self.config.throw_on_cudamalloc_oom {
            return Ok(());
        }
        let Some(limit) = self.fraction_limit() else {
            return Ok(());
        };
        let reserved = self.stats.memory_reserved();
        if reserved + needed <= limit {
            return Ok(());
        }
        self.stats.num_oom_rejections += 1;
        let (rounded, _) = self.block_for(size);
        let device_free = self.device.memory_info().ok().map_or(0, |i| i.free);
        self.record(|| TraceEvent::Oom {
            size,
            stream: stream.0,
            rounded,
            device_free,
        });
        Err(AllocError::Rejected {
            requested: size,
            needed,
            reserved,
            allocated: self.stats.memory_allocated(),
            limit,
            device_total: self.device_total().unwrap_or(0),
        })
    }

    /// The block of live allocation `id`, which was handed out as `block`; an error if that
    /// block is gone, free, or now serves another allocation (ids are never reused).
    fn live_block(&self, id: u64, block: BlockId) -> Result<BlockId, AllocError> {
        match self.blocks.get(block) {
            Some(b) if b.state == BlockState::ActiveAllocated && b.allocation_id == id => Ok(block),
            _ => Err(AllocError::InvalidFree { id }),
        }
    }

    /// Frees live allocation `id`, handed out as `block`.
    pub fn free(&mut self, id: u64, block: BlockId) -> Result<(), AllocError> {
        let block = self.live_block(id, block)?;
        let pool = self.blocks.pool(block);
        let max_split = self.max_split();
        let size = self.blocks[block].size();
        self.stats.allocation.decrease(pool, 1);
        self.stats.allocated_bytes.decrease(pool, size);
        if size >= max_split {
            self.stats.oversize_allocations.decrease(1);
        }
        self.untag(block);
        self.note_free_requested(block);
        self.record(|| TraceEvent::FreeRequested { id });
        if self.uncached() {
            // Its segment goes back once the block's own stream is done with it too (see
            // `uncached`): an event there, polled now and at every later call.
            let own = self.blocks.stream(block);
            self.blocks[block].stream_uses.push(own);
        } else if self.blocks[block].stream_uses.is_empty() {
            self.free_block(block);
            return Ok(());
        }
        self.blocks[block].state = BlockState::ActivePendingFree;
        self.insert_events(block)?;
        if self.uncached() {
            self.process_events()?;
        }
        Ok(())
    }

    /// Notes that a live allocation is used on `stream` too.
    pub fn record_stream(
        &mut self,
        id: u64,
        block: BlockId,
        stream: DeviceStream,
    ) -> Result<(), AllocError> {
        let block = self.live_block(id, block)?;
        if self.blocks.stream(block) != stream {
            let uses = &mut self.blocks[block].stream_uses;
            if !uses.contains(&stream) {
                uses.push(stream);
            }
        }
        self.record(|| TraceEvent::RecordStream {
            id,
            stream: stream.0,
        });
        Ok(())
    }

    /// Returns every cached segment with no allocated block to the device.
    pub fn empty_cache(&mut self) -> Result<u64, AllocError> {
        self.record(|| TraceEvent::EmptyCache);
        self.release_cached_blocks()
    }

    /// A request that can never fit: the device (or its largest segment) holds at most `max`
    /// bytes. PyTorch learns this only when `cudaMalloc` fails and counts it as an
    /// out-of-memory (`num_ooms`, an `oom` trace entry); so does this allocator, but it knows
    /// up front, so it neither flushes the cache nor counts a retry first.
    fn too_large(&mut self, size: u64, max: u64, stream: DeviceStream) -> AllocError {
        let (rounded, _) = self.block_for(size);
        let device_free = self.device.memory_info().ok().map_or(0, |i| i.free);
        self.count_oom(size, rounded, device_free, stream);
        AllocError::TooLarge {
            requested: size,
            max,
        }
    }

    /// Counts an out-of-memory and records it in the trace, with the rounded size and the
    /// device's free bytes (PyTorch's `oom` entry).
    fn count_oom(&mut self, size: u64, rounded: u64, device_free: u64, stream: DeviceStream) {
        self.stats.num_ooms += 1;
        self.record(|| TraceEvent::Oom {
            size,
            stream: stream.0,
            rounded,
            device_free,
        });
    }

    /// The out-of-memory error for a request of `size` bytes, with the numbers that explain
    /// it: PyTorch's, the largest free block, the free bytes in blocks too small for the
    /// request, and the configuration that would help.
    fn out_of_memory(&mut self, size: u64, stream: DeviceStream) -> AllocError {
        let info = self.device.memory_info().ok();
        let device_free = info.map_or(0, |i| i.free);
        let (rounded, _) = self.block_for(size);
        self.count_oom(size, rounded, device_free, stream);
        let (mut largest_free_block, mut fragmented, mut fragmented_large) = (0, 0, 0);
        for (_, block) in self.blocks.iter() {
            // Unmapped address space of expandable segments is not memory.
            if block.state != BlockState::Inactive || !block.is_mapped() {
                continue;
            }
            largest_free_block = largest_free_block.max(block.size());
            if block.size() < rounded {
                fragmented += block.size();
                if self.blocks.segment(block.segment()).pool == PoolKind::Large {
                    fragmented_large += block.size();
                }
            }
        }
        let numbers = OomNumbers {
            rounded,
            device_free,
            fragmented,
            fragmented_large,
            max_split_size_set: self.config.max_split_size.is_some(),
            garbage_collection_threshold_set: self.config.garbage_collection_threshold.is_some(),
            expandable_segments_set: self.config.expandable_segments,
            earlier_flushes: self.rescued_by_flush,
        };
        let allocated = self.stats.memory_allocated();
        AllocError::OutOfMemory {
            requested: size,
            allocated,
            reserved_unallocated: self.stats.memory_reserved() - allocated,
            device_free,
            device_total: info.map_or(0, |i| i.total),
            limit: self.fraction_limit(),
            diagnosis: Box::new(OomDiagnosis {
                rounded,
                largest_free_block,
                fragmented,
                advice: numbers.advice(),
            }),
        }
    }
}
