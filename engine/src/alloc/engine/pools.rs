//! Private pools (PyTorch's `MemPool` and the allocator's `PrivatePool`): segments kept apart
//! from the allocator's own pools, each pool with its own small and large free lists.
//!
//! - A request routed to a pool ([`Engine::malloc_in`]) takes the best-fitting cached block of
//!   the pool (same stream, same rules as the allocator's pools), else a new segment that
//!   belongs to the pool. It never borrows the other size pool's memory, never takes another
//!   stream's segment and never collects garbage: those serve the allocator's own pools. Its
//!   miss path does flush the allocator's own cache before an out-of-memory (PyTorch's
//!   `release_cached_blocks(context, {0, 0})` there), never another pool's.
//! - Split and merge work as in the allocator's pools, inside the pool; with `no_split` a
//!   block is never split (PyTorch's `should_split` returns false for the pools in
//!   `no_split_pools`).
//! - `use_on_oom`: a request of the allocator's own pools that would fail with an
//!   out-of-memory first takes a cached free block of such a pool (PyTorch tries each pool in
//!   `use_on_oom_pools` with `get_free_block` just before raising); the block is the pool's.
//! - The allocator's `empty_cache` leaves pools alone; a pool's own [`Engine::pool_empty_cache`]
//!   returns its wholly free segments (PyTorch's `emptyCache(mempool_id)`).
//! - Released ([`Engine::release_pool`], PyTorch's `releasePool` to a use count of 0): no
//!   request may route to the pool any more; its wholly free segments go back at once, and
//!   every other one as soon as its last block is freed (PyTorch waits for the next
//!   `empty_cache`; memory of a pool no one can use has no reason to stay cached). The pool is
//!   forgotten with its last segment.
//!
//! The device-wide statistics count pool memory as any other (by block size: small or large);
//! a pool's own numbers are recounted from its segments ([`Engine::pool_stats`]).

use super::{Engine, LARGE_CLASS_LIMIT};
use crate::alloc::block::{BlockId, BlockState};
use crate::alloc::error::AllocError;
use crate::alloc::free_list::FreeList;
use crate::alloc::history::TraceEvent;
use crate::alloc::mem_pool::{MemPoolId, MemPoolOptions, MemPoolStats};
use crate::alloc::size::{MIN_BLOCK_SIZE, PoolKind, SMALL_BUFFER, SMALL_SIZE};
use crate::device::{DeviceMemory, DeviceStream};

/// One private pool: its options and its free lists.
pub(super) struct PrivatePool {
    options: MemPoolOptions,
    small: FreeList,
    large: FreeList,
    /// Its owner let it go: nothing routes to it, and its segments go back once wholly free.
    released: bool,
}

impl PrivatePool {
    fn new(options: MemPoolOptions) -> Self {
        Self {
            options,
            small: FreeList::with_classes(MIN_BLOCK_SIZE, SMALL_BUFFER),
            large: FreeList::with_classes(SMALL_SIZE + MIN_BLOCK_SIZE, LARGE_CLASS_LIMIT),
            released: false,
        }
    }

    fn list(&self, kind: PoolKind) -> &FreeList {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    fn list_mut(&mut self, kind: PoolKind) -> &mut FreeList {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }
}

const OUTLIVES: &str = "a private pool is forgotten only with its last segment";

impl<D: DeviceMemory> Engine<D> {
    /// A new private pool with `options` (PyTorch's `createOrIncrefPool`, `setUseOnOOM`,
    /// `setNoSplit`).
    pub fn create_pool(&mut self, options: MemPoolOptions) -> MemPoolId {
        self.next_pool += 1;
        let id = MemPoolId(self.next_pool);
        self.private.insert(id, PrivatePool::new(options));
        self.record(|| TraceEvent::PoolCreate {
            pool: id.0,
            no_split: options.no_split,
            use_on_oom: options.use_on_oom,
        });
        id
    }

    /// The options of live pool `id`; [`AllocError::UnknownPool`] if it was never created here
    /// or is released.
    pub fn pool_options(&self, id: MemPoolId) -> Result<MemPoolOptions, AllocError> {
        match self.private.get(&id) {
            Some(pool) if !pool.released => Ok(pool.options),
            _ => Err(AllocError::UnknownPool { id: id.0 }),
        }
    }

    /// The live pools, by id.
    pub fn pools(&self) -> Vec<(MemPoolId, MemPoolOptions)> {
        self.private
            .iter()
            .filter(|(_, p)| !p.released)
            .map(|(id, p)| (*id, p.options))
            .collect()
    }

    /// The free list of `kind` of private pool `mem`, or of the allocator's own pools.
    pub(super) fn pool_list(&self, mem: Option<MemPoolId>, kind: PoolKind) -> &FreeList {
        match mem {
            None => self.free_list_ref(kind),
            Some(id) => self.private.get(&id).expect(OUTLIVES).list(kind),
        }
    }

    pub(super) fn pool_list_mut(
        &mut self,
        mem: Option<MemPoolId>,
        kind: PoolKind,
    ) -> &mut FreeList {
        match mem {
            None => self.free_list(kind),
            Some(id) => self.private.get_mut(&id).expect(OUTLIVES).list_mut(kind),
        }
    }

    /// Every free list: the allocator's own two, then each pool's, with the pool they serve.
    pub(super) fn all_lists(&self) -> Vec<(Option<MemPoolId>, PoolKind, &FreeList)> {
        let mut lists = Vec::with_capacity(2 + 2 * self.private.len());
        for (mem, pool) in std::iter::once((None, None))
            .chain(self.private.iter().map(|(id, p)| (Some(*id), Some(p))))
        {
            for kind in [PoolKind::Small, PoolKind::Large] {
                let list = pool.map_or_else(|| self.free_list_ref(kind), |p| p.list(kind));
                lists.push((mem, kind, list));
            }
        }
        lists
    }

    /// (`no_split`, released) of pool `id`, live or released; `None` for a pool not known.
    pub(super) fn pool_flags(&self, id: MemPoolId) -> Option<(bool, bool)> {
        self.private
            .get(&id)
            .map(|p| (p.options.no_split, p.released))
    }

    /// Whether `block`'s pool keeps its blocks whole (`no_split`).
    pub(super) fn never_split(&self, block: BlockId) -> bool {
        self.blocks
            .mem_pool(block)
            .and_then(|id| self.private.get(&id))
            .is_some_and(|p| p.options.no_split)
    }

    /// PyTorch's last resort before an out-of-memory: the best cached free block of a
    /// `use_on_oom` pool (lowest id first), taken out of its free list; it stays the pool's.
    pub(super) fn take_from_oom_pools(
        &mut self,
        kind: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Option<BlockId> {
        let ids: Vec<MemPoolId> = self
            .private
            .iter()
            .filter(|(_, p)| p.options.use_on_oom && !p.released)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .find_map(|id| self.take_free_block_in(Some(id), kind, stream, rounded))
    }

    /// Returns the wholly free segments of pool `id` to the device (PyTorch's
    /// `emptyCache(mempool_id)`), after completing the pending frees that can complete
    /// (waiting on their events, as the allocator's `empty_cache` does); the bytes returned.
    pub fn pool_empty_cache(&mut self, id: MemPoolId) -> Result<u64, AllocError> {
        self.pool_options(id)?;
        self.record(|| TraceEvent::PoolEmptyCache { pool: id.0 });
        self.synchronize_pending()?;
        self.release_pool_segments(id)
    }

    /// Lets pool `id` go (PyTorch's `releasePool`): no request may route to it any more; its
    /// wholly free segments go back now and the others once their last block is freed. The
    /// bytes returned now.
    pub fn release_pool(&mut self, id: MemPoolId) -> Result<u64, AllocError> {
        self.pool_options(id)?;
        self.record(|| TraceEvent::PoolRelease { pool: id.0 });
        self.private.get_mut(&id).expect(OUTLIVES).released = true;
        let released = self.release_pool_segments(id)?;
        self.forget_pool_if_empty(id);
        Ok(released)
    }

    /// Returns every wholly free segment of pool `id` to the device; the bytes returned.
    fn release_pool_segments(&mut self, id: MemPoolId) -> Result<u64, AllocError> {
        let mut released = 0;
        for block in self.whole_free_pool_segments(id) {
            released += self.release_segment(block)?;
        }
        Ok(released)
    }

    /// The free blocks of pool `id` that span their segment.
    fn whole_free_pool_segments(&self, id: MemPoolId) -> Vec<BlockId> {
        let pool = self.private.get(&id).expect(OUTLIVES);
        [PoolKind::Large, PoolKind::Small]
            .into_iter()
            .flat_map(|kind| pool.list(kind).iter())
            .filter(|&b| !self.blocks[b].is_split())
            .collect()
    }

    /// After `block` became free and was listed: if its pool is released and the block spans
    /// its segment, the segment goes back to the device, and the pool with its last segment.
    /// A device that refuses the segment back leaves it cached (logged); the allocator's drop
    /// tries again.
    pub(super) fn release_if_orphaned(&mut self, block: BlockId) {
        let Some(id) = self.blocks.mem_pool(block) else {
            return;
        };
        if !self.private.get(&id).is_some_and(|p| p.released) || self.blocks[block].is_split() {
            return;
        }
        if let Err(e) = self.release_segment(block) {
            log::warn!("caching allocator: returning a segment of released {id}: {e}");
            return;
        }
        self.forget_pool_if_empty(id);
    }

    fn forget_pool_if_empty(&mut self, id: MemPoolId) {
        let released = self.private.get(&id).is_some_and(|p| p.released);
        if released && !self.blocks.segments().any(|(_, s)| s.mem_pool == Some(id)) {
            self.private.remove(&id);
        }
    }

    /// At the allocator's drop: every wholly free segment of every pool, going on past
    /// failures (given to `failed`); the bytes returned.
    pub(super) fn release_all_pools(
        &mut self,
        failed: &mut dyn FnMut(AllocError) -> Result<(), AllocError>,
    ) -> Result<u64, AllocError> {
        let ids: Vec<MemPoolId> = self.private.keys().copied().collect();
        let mut released = 0;
        for id in ids {
            for block in self.whole_free_pool_segments(id) {
                match self.release_segment(block) {
                    Ok(bytes) => released += bytes,
                    Err(e) => failed(e)?,
                }
            }
        }
        Ok(released)
    }

    /// What pool `id` holds now, recounted from its segments.
    pub fn pool_stats(&self, id: MemPoolId) -> Result<MemPoolStats, AllocError> {
        self.pool_options(id)?;
        let mut stats = MemPoolStats::default();
        for (segment_id, segment) in self.blocks.segments() {
            if segment.mem_pool != Some(id) {
                continue;
            }
            stats.segments += 1;
            stats.reserved_bytes += segment.size;
            for b in self.blocks.segment_blocks(segment_id) {
                let block = &self.blocks[b];
                match block.state {
                    BlockState::ActiveAllocated => {
                        stats.allocations += 1;
                        stats.allocated_bytes += block.size();
                    }
                    BlockState::ActivePendingFree => {}
                    BlockState::Inactive => {
                        stats.free_blocks += 1;
                        stats.largest_free_block = stats.largest_free_block.max(block.size());
                        continue;
                    }
                }
                stats.active_bytes += block.size();
                stats.requested_bytes += block.requested;
            }
        }
        Ok(stats)
    }
}
