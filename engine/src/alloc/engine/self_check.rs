//! The engine's self-check: every internal structure against every other, for tests and
//! debugging.
//!
//! The snapshot shows what a walk of each segment's `next` links finds; this check also sees
//! what such a walk cannot: free-list entries that disagree with their blocks (stale, missing,
//! duplicated, in the wrong pool, under the wrong key), `prev` links that do not mirror `next`
//! links, blocks no segment reaches (orphans), a pending-free queue that disagrees with the
//! blocks waiting on it, and statistics that disagree with a recount of the blocks.

use std::collections::{BTreeMap, BTreeSet};

use super::Engine;
use crate::alloc::block::{BlockId, BlockState, SegmentId};
use crate::alloc::size::{MIN_BLOCK_SIZE, PoolKind};
use crate::alloc::stats::StatArray;
use crate::device::DeviceMemory;

/// What a recount of the blocks gives for one pool: (count, bytes) per statistic.
#[derive(Default)]
struct Recount {
    allocation: (u64, u64),
    active: (u64, u64),
    inactive_split: (u64, u64),
    segment: (u64, u64),
    oversize_allocations: u64,
    oversize_segments: u64,
    /// Requested bytes of allocated and pending-free blocks.
    requested_active: u64,
}

/// A statistic whose current value a recount gives exactly: its name, the statistic, and the
/// recount's value for one pool.
type ExactStat<'a> = (&'static str, &'a StatArray, fn(&Recount) -> u64);

impl<D: DeviceMemory> Engine<D> {
    /// Checks every internal structure against the others; the first disagreement found is
    /// the error.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_free_lists()?;
        let segment_of = self.check_segments()?;
        self.check_blocks(&segment_of)?;
        self.check_pending()?;
        self.check_stream_table()?;
        self.check_stats()
    }

    /// Each stream's live count (kept whatever the settings) against a recount of
    /// the allocated and pending-free blocks of its segments, its own use per pool (which
    /// decides what it may lend) against a recount of its allocated blocks not lent, only
    /// allocated blocks marked lent, and no block stamped with a free its stream has not
    /// counted yet.
    fn check_stream_table(&self) -> Result<(), String> {
        for state in &self.streams.streams {
            let mut live = 0;
            let (mut small, mut large) = (0, 0);
            for (id, block) in self.blocks.iter() {
                let segment = self.blocks.segment(block.segment());
                if segment.stream != state.stream {
                    continue;
                }
                if block.lent && block.state != BlockState::ActiveAllocated {
                    return Err(format!(
                        "block {id} is marked lent but is {:?}",
                        block.state
                    ));
                }
                if block.state == BlockState::ActiveAllocated && !block.lent {
                    match segment.pool {
                        PoolKind::Small => small += block.size(),
                        PoolKind::Large => large += block.size(),
                    }
                }
                if block.state != BlockState::Inactive {
                    live += 1;
                } else if block.freed_at > state.frees {
                    return Err(format!(
                        "a free block of {} is stamped {} past its stream's {} frees",
                        state.stream, block.freed_at, state.frees
                    ));
                }
            }
            if live != state.live {
                return Err(format!(
                    "{} counts {} live blocks, its segments hold {live}",
                    state.stream, state.live
                ));
            }
            let counted = (state.own.small_pool.current, state.own.large_pool.current);
            if counted != (small, large) {
                return Err(format!(
                    "{} counts {counted:?} bytes of its own in use (small, large), its segments \
                     hold {:?}",
                    state.stream,
                    (small, large)
                ));
            }
        }
        Ok(())
    }

    /// Each free list's own bookkeeping, and each entry against its block.
    fn check_free_lists(&self) -> Result<(), String> {
        let mut seen = BTreeSet::new();
        for (mem, pool, list) in self.all_lists() {
            list.check()
                .map_err(|e| format!("{pool:?} free list of {mem:?}: {e}"))?;
            let mut entries = 0;
            for (stream, size, address, block) in list.entries() {
                entries += 1;
                let Some(b) = self.blocks.get(block) else {
                    return Err(format!("{pool:?} free list holds removed block {block}"));
                };
                if !seen.insert(block) {
                    return Err(format!("block {block} listed twice"));
                }
                if b.state != BlockState::Inactive {
                    return Err(format!("block {block} is listed free but is {:?}", b.state));
                }
                let Some(segment) = self.blocks.get_segment(b.segment()) else {
                    return Err(format!("block {block} of removed segment {}", b.segment()));
                };
                if segment.pool != pool || segment.mem_pool != mem {
                    return Err(format!(
                        "block {block} of a {:?} segment of {:?} listed in the {pool:?} pool \
                         of {mem:?}",
                        segment.pool, segment.mem_pool
                    ));
                }
                let key = (segment.stream, b.size(), segment.address + b.offset());
                if key != (stream, size, address) {
                    return Err(format!(
                        "block {block} listed as {:?} but is {key:?}",
                        (stream, size, address)
                    ));
                }
            }
            let free = self
                .blocks
                .iter()
                .filter(|(_, b)| b.state == BlockState::Inactive && b.is_mapped())
                .filter(|(_, b)| {
                    self.blocks
                        .get_segment(b.segment())
                        .map(|s| (s.pool, s.mem_pool))
                        == Some((pool, mem))
                })
                .count();
            if free != entries {
                return Err(format!(
                    "{pool:?} pool of {mem:?}: {free} free blocks but {entries} free-list entries"
                ));
            }
        }
        Ok(())
    }

    /// Walks every segment: its blocks tile it in address order, `prev` mirrors `next`, no
    /// two free blocks touch, and every block is reached exactly once. Returns each block's
    /// segment as the walk found it.
    fn check_segments(&self) -> Result<BTreeMap<BlockId, SegmentId>, String> {
        let mut segment_of = BTreeMap::new();
        for (id, segment) in self.blocks.segments() {
            let mut cursor = 0;
            let mut prev: Option<BlockId> = None;
            let mut next = Some(segment.first());
            while let Some(block) = next {
                let Some(b) = self.blocks.get(block) else {
                    return Err(format!("segment {id} links to removed block {block}"));
                };
                if segment_of.insert(block, id).is_some() {
                    return Err(format!(
                        "block {block} reached twice (a cycle or a shared block)"
                    ));
                }
                if b.segment() != id {
                    return Err(format!(
                        "block {block} in segment {id} says segment {}",
                        b.segment()
                    ));
                }
                if b.prev() != prev {
                    return Err(format!(
                        "block {block}: prev is {:?}, the walk came from {prev:?}",
                        b.prev()
                    ));
                }
                if b.offset() != cursor {
                    return Err(format!(
                        "block {block} at offset {}, expected {cursor}",
                        b.offset()
                    ));
                }
                if b.size() == 0 || !b.size().is_multiple_of(MIN_BLOCK_SIZE) {
                    return Err(format!("block {block} has size {}", b.size()));
                }
                if let Some(p) = prev
                    && b.state == BlockState::Inactive
                    && self.blocks[p].state == BlockState::Inactive
                    && self.blocks[p].is_mapped() == b.is_mapped()
                {
                    return Err(format!("free neighbours {p} and {block} were not merged"));
                }
                cursor += b.size();
                prev = Some(block);
                next = b.next();
            }
            if cursor != segment.size {
                return Err(format!(
                    "segment {id}: blocks cover {cursor} of {} bytes",
                    segment.size
                ));
            }
            self.check_pool_segment(id)?;
        }
        if segment_of.len() != self.blocks.len() {
            let orphans: Vec<BlockId> = self
                .blocks
                .iter()
                .map(|(id, _)| id)
                .filter(|id| !segment_of.contains_key(id))
                .collect();
            return Err(format!("blocks no segment reaches: {orphans:?}"));
        }
        Ok(segment_of)
    }

    /// A segment of a private pool: the pool is known; a `no_split` pool's segment is one
    /// block; a released pool holds no wholly free segment (it went back with its last block).
    fn check_pool_segment(&self, id: SegmentId) -> Result<(), String> {
        let segment = self.blocks.segment(id);
        let Some(mem) = segment.mem_pool else {
            return Ok(());
        };
        let (no_split, released) = self.pool_flags(mem).ok_or_else(|| {
            format!("segment {id} belongs to {mem}, which the engine does not know")
        })?;
        let first = &self.blocks[segment.first()];
        if no_split && first.is_split() {
            return Err(format!("segment {id} of no_split {mem} is split"));
        }
        if released && !first.is_split() && first.state == BlockState::Inactive {
            return Err(format!(
                "segment {id} of released {mem} is wholly free but kept"
            ));
        }
        Ok(())
    }

    /// Each block's fields against its state.
    fn check_blocks(&self, segment_of: &BTreeMap<BlockId, SegmentId>) -> Result<(), String> {
        let mut ids = BTreeSet::new();
        for (block, b) in self.blocks.iter() {
            debug_assert_eq!(segment_of.get(&block), Some(&b.segment()));
            let clean = b.stream_uses.is_empty() && b.pending_events == 0;
            let expandable = self.blocks.segment(b.segment()).expandable;
            if !b.is_mapped() {
                let key = (
                    self.blocks.pool(block),
                    self.blocks.stream(block).0,
                    self.blocks.address(block),
                );
                if !expandable || b.state != BlockState::Inactive {
                    return Err(format!(
                        "unmapped block {block} outside an expandable segment or not free: {b:?}"
                    ));
                }
                if self.unmapped.get(&key) != Some(&block) {
                    return Err(format!(
                        "unmapped block {block} missing from the unmapped index"
                    ));
                }
            }
            let waiting_to_record = self.needs_events.contains(&block);
            let ok = match b.state {
                BlockState::Inactive => clean && b.requested == 0 && b.allocation_id == 0,
                BlockState::ActiveAllocated => {
                    b.pending_events == 0
                        && b.requested > 0
                        && b.requested <= b.size()
                        && b.allocation_id > 0
                        && b.allocation_id < self.next_allocation_id
                        && ids.insert(b.allocation_id)
                }
                // Its stream uses became events; the streams whose event failed to record stay
                // on it until a retry records them (never reused before, as PyTorch leaves it).
                BlockState::ActivePendingFree => {
                    (waiting_to_record || (b.stream_uses.is_empty() && b.pending_events > 0))
                        && b.requested <= b.size()
                }
            };
            if !ok {
                return Err(format!("block {block} inconsistent with its state: {b:?}"));
            }
        }
        let unmapped = self.blocks.iter().filter(|(_, b)| !b.is_mapped()).count();
        if unmapped != self.unmapped.len() {
            return Err(format!(
                "{unmapped} unmapped blocks but {} entries in the unmapped index",
                self.unmapped.len()
            ));
        }
        Ok(())
    }

    /// The pending-free queue against the blocks waiting on it.
    fn check_pending(&self) -> Result<(), String> {
        let mut waits: BTreeMap<BlockId, usize> = BTreeMap::new();
        for pending in self.pending.iter() {
            match self.blocks.get(pending.block) {
                Some(b) if b.state == BlockState::ActivePendingFree => {
                    *waits.entry(pending.block).or_default() += 1;
                }
                Some(b) => {
                    return Err(format!(
                        "pending event for block {} which is {:?}",
                        pending.block, b.state
                    ));
                }
                None => return Err(format!("pending event for removed block {}", pending.block)),
            }
        }
        for (block, b) in self.blocks.iter() {
            let queued = waits.get(&block).copied().unwrap_or(0);
            if b.pending_events != queued {
                return Err(format!(
                    "block {block} counts {} pending events, the queue holds {queued}",
                    b.pending_events
                ));
            }
        }
        Ok(())
    }

    /// The current value of every statistic against a recount of the blocks, per pool; every
    /// peak at least its current value; `all` the sum of the pools.
    fn check_stats(&self) -> Result<(), String> {
        let max_split = self.max_split();
        let mut counts = [Recount::default(), Recount::default()];
        for (_, segment) in self.blocks.segments() {
            // An expandable segment holds no `segment` and reserves only its mapped bytes
            // (counted with its blocks below).
            if segment.expandable {
                continue;
            }
            let r = &mut counts[usize::from(segment.pool == PoolKind::Large)];
            r.segment.0 += 1;
            r.segment.1 += segment.size;
            r.oversize_segments += u64::from(segment.size >= max_split);
        }
        for (_, b) in self.blocks.iter() {
            if !b.is_mapped() {
                continue;
            }
            let segment = self.blocks.segment(b.segment());
            let r = &mut counts[usize::from(segment.pool == PoolKind::Large)];
            if segment.expandable {
                r.segment.1 += b.size();
            }
            match b.state {
                BlockState::ActiveAllocated => {
                    r.allocation.0 += 1;
                    r.allocation.1 += b.size();
                    r.oversize_allocations += u64::from(b.size() >= max_split);
                }
                BlockState::ActivePendingFree => {}
                BlockState::Inactive => {
                    if b.is_split() && !segment.expandable {
                        r.inactive_split.0 += 1;
                        r.inactive_split.1 += b.size();
                    }
                    continue;
                }
            }
            r.active.0 += 1;
            r.active.1 += b.size();
            r.requested_active += b.requested;
        }
        let s = &self.stats;
        let exact: [ExactStat; 8] = [
            ("allocation", &s.allocation, |r| r.allocation.0),
            ("allocated_bytes", &s.allocated_bytes, |r| r.allocation.1),
            ("active", &s.active, |r| r.active.0),
            ("active_bytes", &s.active_bytes, |r| r.active.1),
            ("inactive_split", &s.inactive_split, |r| r.inactive_split.0),
            ("inactive_split_bytes", &s.inactive_split_bytes, |r| {
                r.inactive_split.1
            }),
            ("segment", &s.segment, |r| r.segment.0),
            ("reserved_bytes", &s.reserved_bytes, |r| r.segment.1),
        ];
        for (name, array, recount) in &exact {
            for (pool, r) in [PoolKind::Small, PoolKind::Large].into_iter().zip(&counts) {
                let current = array.pool(pool).current;
                if current != recount(r) {
                    return Err(format!(
                        "{name}.{}.current is {current}, the blocks give {}",
                        pool.stat_name(),
                        recount(r)
                    ));
                }
            }
        }
        for (pool, r) in [PoolKind::Small, PoolKind::Large].into_iter().zip(&counts) {
            // PyTorch drops requested bytes when a free completes: pending frees count.
            let current = s.requested_bytes.pool(pool).current;
            if current != r.requested_active {
                return Err(format!(
                    "requested_bytes.{}.current is {current}, the active blocks ask {}",
                    pool.stat_name(),
                    r.requested_active
                ));
            }
        }
        let arrays = exact
            .iter()
            .map(|(name, array, _)| (*name, *array))
            .chain([("requested_bytes", &s.requested_bytes)]);
        for (name, array) in arrays {
            for stat in [&array.all, &array.small_pool, &array.large_pool] {
                if stat.peak < stat.current {
                    return Err(format!(
                        "{name}: peak {} below current {}",
                        stat.peak, stat.current
                    ));
                }
            }
            if array.all.current != array.small_pool.current + array.large_pool.current {
                return Err(format!("{name}.all.current is not the sum of the pools"));
            }
        }
        let oversize = (
            counts[0].oversize_allocations + counts[1].oversize_allocations,
            counts[0].oversize_segments + counts[1].oversize_segments,
        );
        if (s.oversize_allocations.current, s.oversize_segments.current) != oversize {
            return Err(format!(
                "oversize allocations and segments are {} and {}, the blocks give {oversize:?}",
                s.oversize_allocations.current, s.oversize_segments.current
            ));
        }
        for stat in [&s.oversize_allocations, &s.oversize_segments] {
            if stat.peak < stat.current {
                return Err(format!(
                    "oversize peak {} below current {}",
                    stat.peak, stat.current
                ));
            }
        }
        Ok(())
    }
}
