//! The engine's state and its two entry points, malloc and free.
//!
//! Its parts are child modules, each adding methods to [`Engine`]: placement (best fit,
//! split, merge) in `placement`, the release steps of the miss path and `empty_cache` in
//! `release`, cross-stream frees in `events`, and the snapshot in `snapshot`. The public, thread-safe face is `CachingAllocator` in `allocator.rs`.
//!
//! A request walks this path, PyTorch's, in order:
//! 1. complete pending frees whose stream events have finished;
//! 2. round the size, pick the pool, take the best-fitting cached block of the same stream;
//! 3. on a miss, collect garbage if a threshold is set (oldest unsplit cached segments first);
//! 4. allocate a new segment from the device (refused up front if it would break the
//!    per-process memory fraction);
//! 5. if that fails, free cached oversize blocks and retry;
//! 6. if that fails, synchronise pending events, free every unsplit cached segment and retry
//!    (`num_alloc_retries` += 1);
//! 7. if that fails, report out-of-memory (`num_ooms` += 1) with the numbers that explain it.

mod events;
mod placement;
mod release;
mod self_check;
mod snapshot;

use crate::alloc::block::{BlockId, BlockState, Blocks};
use crate::alloc::config::AllocatorConfig;
use crate::alloc::error::AllocError;
use crate::alloc::free_list::FreeList;
use crate::alloc::size::{
    MIN_BLOCK_SIZE, PoolKind, SMALL_BUFFER, SMALL_SIZE, round_size, segment_size,
};
use crate::alloc::units::MIB;
use events::PendingFree;

/// The largest large-pool block size kept in size classes (1.5 MiB of class vectors per
/// stream); larger free blocks live in an ordered map.
const LARGE_CLASS_LIMIT: u64 = 32 * MIB;
use crate::alloc::stats::MemoryStats;
use crate::alloc::trace::{TraceEvent, TraceRing};
use crate::device::{DeviceMemory, StreamId};

pub(crate) struct Engine<D: DeviceMemory> {
    device: D,
    config: AllocatorConfig,
    blocks: Blocks<D::Handle>,
    small: FreeList,
    large: FreeList,
    pending: Vec<PendingFree<D::Event>>,
    stats: MemoryStats,
    history: Option<TraceRing>,
    /// Logical time: one tick per request.
    clock: u64,
    next_allocation_id: u64,
    /// The device's total memory, asked once.
    device_total: Option<u64>,
    /// The device's largest segment, asked once (a property of the device, and the miss path
    /// needs it for every request).
    max_segment: Option<u64>,
}

/// A live block as the allocator hands it out.
pub(super) struct BlockInfo<H> {
    pub(super) allocation_id: u64,
    pub(super) address: u64,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) stream: StreamId,
    pub(super) segment: H,
}

/// Whether a miss may allocate new device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Growth {
    Allowed,
    CacheOnly,
}

impl<D: DeviceMemory> Engine<D> {
    pub fn new(device: D, config: AllocatorConfig) -> Self {
        let history = config
            .record_history
            .then(|| TraceRing::new(config.history_capacity));
        let stats = MemoryStats {
            max_split_size: config.max_split_size.unwrap_or(u64::MAX),
            ..MemoryStats::default()
        };
        Self {
            max_segment: device.max_segment_size(),
            device,
            config,
            blocks: Blocks::default(),
            // Small-pool blocks are at most one small segment: all of them in size classes.
            small: FreeList::with_classes(MIN_BLOCK_SIZE, SMALL_BUFFER),
            // Large-pool blocks are over 1 MiB; classes hold the 20 MiB segments and their
            // splits, the ordered map anything larger.
            large: FreeList::with_classes(SMALL_SIZE + MIN_BLOCK_SIZE, LARGE_CLASS_LIMIT),
            pending: Vec::new(),
            stats,
            history,
            clock: 0,
            next_allocation_id: 1,
            device_total: None,
        }
    }

    /// The statistics.
    pub(super) fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    /// The statistics, for resetting peaks and counters.
    pub(super) fn stats_mut(&mut self) -> &mut MemoryStats {
        &mut self.stats
    }

    /// The configuration in force.
    pub(super) fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// Caps reserved memory at `fraction` of the device's total from now on.
    pub(super) fn set_memory_fraction(&mut self, fraction: f64) {
        self.config.memory_fraction = Some(fraction);
    }

    /// The trace recorded so far (empty when history is off).
    pub(super) fn trace(&self) -> super::trace::Trace {
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
        let b = &self.blocks.blocks[block];
        let segment = &self.blocks.segments[b.segment];
        BlockInfo {
            allocation_id: b.allocation_id,
            address: segment.address + b.offset,
            offset: b.offset,
            size: b.size,
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
            history.push(event());
        }
    }

    pub fn set_history(&mut self, enabled: bool) {
        self.config.record_history = enabled;
        if enabled {
            if self.history.is_none() {
                self.history = Some(TraceRing::new(self.config.history_capacity));
            }
        } else {
            self.history = None;
        }
    }

    /// The device's total memory (asked once; `None` if the device cannot say).
    pub fn device_total(&mut self) -> Option<u64> {
        if self.device_total.is_none() {
            self.device_total = self.device.memory_info().ok().map(|info| info.total);
        }
        self.device_total
    }

    /// What the per-process memory fraction allows reserved memory to reach.
    pub fn fraction_limit(&mut self) -> Option<u64> {
        let fraction = self.config.memory_fraction?;
        let total = self.device_total()?;
        Some((fraction * total as f64) as u64)
    }

    /// The block size and pool a request of `size` bytes (> 0) takes.
    pub fn block_for(&self, size: u64) -> (u64, PoolKind) {
        let rounded = round_size(size, &self.config.roundup_power2_divisions);
        (rounded, PoolKind::for_size(rounded))
    }

    /// Serves a request; `Ok(None)` only with [`Growth::CacheOnly`] on a miss.
    pub fn malloc(
        &mut self,
        size: u64,
        stream: StreamId,
        growth: Growth,
    ) -> Result<Option<BlockId>, AllocError> {
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        self.process_events()?;
        let total = self.device_total();
        let too_large = |max| AllocError::TooLarge {
            requested: size,
            max,
        };
        let (rounded, pool) = self.block_for(size);
        if let Some(total) = total
            && rounded > total
        {
            return Err(too_large(total));
        }
        let mut new_segment = segment_size(rounded);
        if let Some(max) = self.max_segment
            && new_segment > max
        {
            if rounded > max {
                return Err(too_large(max));
            }
            new_segment = rounded;
        }
        self.clock += 1;

        if let Some(block) = self.take_free_block(pool, stream, rounded) {
            return Ok(Some(self.allocate_block(block, rounded, size)));
        }
        if growth == Growth::CacheOnly {
            return Ok(None);
        }

        self.collect_garbage()?;
        let mut block = self.allocate_segment(new_segment, pool, stream)?;
        if block.is_none() && self.release_oversize_blocks(pool, stream, rounded)? {
            block = self.allocate_segment(new_segment, pool, stream)?;
        }
        if block.is_none() {
            self.release_cached_blocks()?;
            self.stats.num_alloc_retries += 1;
            block = self.allocate_segment(new_segment, pool, stream)?;
        }
        match block {
            Some(block) => Ok(Some(self.allocate_block(block, rounded, size))),
            None => Err(self.out_of_memory(size, stream)),
        }
    }

    /// The block of live allocation `id`, which was handed out as `block`; an error if that
    /// block is gone, free, or now serves another allocation (ids are never reused).
    fn live_block(&self, id: u64, block: BlockId) -> Result<BlockId, AllocError> {
        match self.blocks.blocks.get(block) {
            Some(b) if b.state == BlockState::ActiveAllocated && b.allocation_id == id => Ok(block),
            _ => Err(AllocError::InvalidFree { id }),
        }
    }

    /// Frees live allocation `id`, handed out as `block`.
    pub fn free(&mut self, id: u64, block: BlockId) -> Result<(), AllocError> {
        let block = self.live_block(id, block)?;
        let pool = self.blocks.pool(block);
        let max_split = self.max_split();
        let b = &self.blocks.blocks[block];
        let (size, requested) = (b.size, b.requested);
        self.stats.allocation.decrease(pool, 1);
        self.stats.allocated_bytes.decrease(pool, size);
        self.stats.requested_bytes.decrease(pool, requested);
        if size >= max_split {
            self.stats.oversize_allocations.decrease(1);
        }
        self.record(|| TraceEvent::FreeRequested { id });
        if self.blocks.blocks[block].stream_uses.is_empty() {
            self.free_block(block);
            Ok(())
        } else {
            self.blocks.blocks[block].state = BlockState::ActivePendingFree;
            self.insert_events(block)
        }
    }

    /// Notes that a live allocation is used on `stream` too.
    pub fn record_stream(
        &mut self,
        id: u64,
        block: BlockId,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let block = self.live_block(id, block)?;
        if self.blocks.stream(block) != stream {
            let uses = &mut self.blocks.blocks[block].stream_uses;
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

    fn out_of_memory(&mut self, size: u64, stream: StreamId) -> AllocError {
        self.stats.num_ooms += 1;
        self.record(|| TraceEvent::Oom {
            size,
            stream: stream.0,
        });
        let info = self.device.memory_info().ok();
        let allocated = self.stats.memory_allocated();
        AllocError::OutOfMemory {
            requested: size,
            allocated,
            reserved_unallocated: self.stats.memory_reserved() - allocated,
            device_free: info.map_or(0, |i| i.free),
            device_total: info.map_or(0, |i| i.total),
            limit: self.fraction_limit(),
        }
    }
}
