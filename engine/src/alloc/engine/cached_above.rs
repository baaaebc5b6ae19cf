//! Readings that see a cache above the engine without being handed it.
//!
//! A layer above the engine (CubeCL's persistent pool under the Burn 0.21 runtime) keeps
//! blocks its tensors freed for exact-size reuse. To the engine they are live allocations; to
//! a user they are cache. Handing them back before every reading (an engine `free` each)
//! would make the reading part of the program: the engine would place later requests in
//! them, and a run that reads its memory after every step would allocate differently from
//! one that never reads. Instead the layer names them ([`CachedAbove`]) and the reading counts
//! them as cache: the live-allocation statistics (`allocation`, `allocated_bytes`, `active`,
//! `active_bytes`, `requested_bytes`, oversize allocations, the scopes' bytes) leave them out
//! of their current values, and the snapshot shows them as inactive blocks. Nothing in the
//! engine changes: the cumulative amounts, the peaks, the counters and every later decision
//! are those of a run that never read. Fragmentation (`inactive_split`, the free space) stays
//! the engine's own: blocks cached above are not free engine blocks and do not coalesce.

use std::collections::HashSet;

use super::Engine;
use super::snapshot::sum_blocks;
use crate::alloc::allocator::Allocation;
use crate::alloc::block::{BlockId, BlockState};
use crate::alloc::history::Snapshot;
use crate::alloc::size::PoolKind;
use crate::alloc::stats::{MemoryStats, StatArray};
use crate::device::DeviceMemory;

/// Live allocations a layer above the engine holds as cache (no tensor of its own uses them),
/// named for one reading: [`CachingAllocator::stats_with`](crate::alloc::CachingAllocator::stats_with)
/// and [`snapshot_with`](crate::alloc::CachingAllocator::snapshot_with) count them as cached,
/// not allocated. An allocation freed or unknown by the time of the reading is ignored.
#[derive(Clone, Debug, Default)]
pub struct CachedAbove {
    blocks: Vec<(u64, BlockId)>,
}

impl CachedAbove {
    /// Names `allocation` as cached above the engine.
    pub fn insert<H>(&mut self, allocation: &Allocation<H>) {
        self.blocks.push((allocation.id(), allocation.block()));
    }

    /// How many allocations are named.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether none is named.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Lowers the current value of `all` and of `pool`'s entry by `amount`; the accumulated
/// amounts and the peak stay (nothing was freed).
fn lower(stat: &mut StatArray, pool: PoolKind, amount: u64) {
    stat.all.current = stat.all.current.saturating_sub(amount);
    let pool = stat.pool_mut(pool);
    pool.current = pool.current.saturating_sub(amount);
}

impl<D: DeviceMemory> Engine<D> {
    /// The named allocations that are live as handed out, each once.
    pub(super) fn live_cached(&self, cached: &CachedAbove) -> Vec<BlockId> {
        let mut seen = HashSet::new();
        cached
            .blocks
            .iter()
            .filter_map(|&(id, block)| self.live_block(id, block).ok())
            .filter(|block| seen.insert(*block))
            .collect()
    }

    /// The statistics with the blocks of `cached` counted as cache (see the module docs).
    pub(crate) fn stats_with(&self, cached: &CachedAbove) -> MemoryStats {
        let mut stats = self.stats.clone();
        let max_split = self.max_split();
        for block in self.live_cached(cached) {
            let pool = self.blocks.pool(block);
            let b = &self.blocks[block];
            let size = b.size();
            lower(&mut stats.allocation, pool, 1);
            lower(&mut stats.allocated_bytes, pool, size);
            lower(&mut stats.active, pool, 1);
            lower(&mut stats.active_bytes, pool, size);
            lower(&mut stats.requested_bytes, pool, b.requested);
            if size >= max_split {
                let oversize = &mut stats.oversize_allocations;
                oversize.current = oversize.current.saturating_sub(1);
            }
            if let Some(scope) = b.tag.as_ref().and_then(|t| stats.scopes.get_mut(t.name())) {
                scope.current = scope.current.saturating_sub(size);
            }
        }
        stats
    }

    /// The snapshot with the blocks of `cached` shown as inactive blocks (no allocation, no
    /// stack, no requested bytes) and the statistics of [`Engine::stats_with`].
    pub(crate) fn snapshot_with(&self, cached: &CachedAbove) -> Snapshot {
        let mut snapshot = self.snapshot();
        if cached.is_empty() {
            return snapshot;
        }
        let addresses: HashSet<u64> = self
            .live_cached(cached)
            .into_iter()
            .map(|block| self.blocks.address(block))
            .collect();
        for segment in &mut snapshot.segments {
            let mut marked = false;
            for block in &mut segment.blocks {
                if addresses.contains(&block.address) {
                    block.state = BlockState::Inactive;
                    block.allocation_id = None;
                    block.requested_size = 0;
                    block.stack = None;
                    block.scope = None;
                    marked = true;
                }
            }
            if marked {
                sum_blocks(segment);
            }
        }
        snapshot.stats = self.stats_with(cached);
        snapshot
    }
}
