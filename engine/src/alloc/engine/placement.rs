//! Where a block goes: best fit among cached blocks, splitting on allocation, merging on free.
//!
//! Best fit is the smallest free block of the request's own stream and pool that is large
//! enough (only a miss that would grow may then borrow from the other pool: `borrowing`).
//! `max_split_size` keeps oversize blocks whole: a request under it never takes an
//! oversize block (that would pin a large segment for a small tensor), and a request at or
//! above it takes one only if the block is less than `max_non_split_rounding` larger.
//!
//! Split: in the small pool any remainder of at least 512 bytes becomes a free block; in the
//! large pool only a remainder of more than 1 MiB, and only for a request under
//! `max_split_size` (PyTorch's `should_split` tests the request, not the block), so the large
//! pool does not fill with slivers no large request can use.
//!
//! Merge: a block that becomes free absorbs its free neighbours in the segment (a neighbour
//! still waiting on stream events stays apart until its own free completes).

use super::Engine;
use crate::alloc::block::{Backing, BlockId, BlockState, End};
use crate::alloc::history::TraceEvent;
use crate::alloc::mem_pool::MemPoolId;
use crate::alloc::size::{MIN_BLOCK_SIZE, PoolKind, SMALL_SIZE};
use crate::device::{DeviceMemory, DeviceStream};

impl<D: DeviceMemory> Engine<D> {
    /// The best cached block for a request, without taking it.
    pub fn find_free_block(
        &self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Option<BlockId> {
        self.find_free_block_in(None, pool, stream, rounded)
    }

    /// The best cached block of private pool `mem` (or of the allocator's own pools with
    /// `None`) for a request, without taking it.
    pub fn find_free_block_in(
        &self,
        mem: Option<MemPoolId>,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Option<BlockId> {
        if self.uncached() {
            return None;
        }
        let list = self.pool_list(mem, pool);
        let (mut block_size, mut block) = list.best_fit(stream, rounded)?;
        if self.expandable() {
            // PyTorch's `get_free_block`: a block that could grow into unmapped space counts
            // at the size it could grow to, so best fit takes another block that fits first.
            while let Some((next_size, next)) =
                list.next_after(stream, block_size, self.blocks.address(block))
                && self.expandable_size(next) < self.expandable_size(block)
            {
                (block_size, block) = (next_size, next);
            }
        }
        // The oversize rules keep large segments whole. Expandable blocks are always split
        // and their pages given back, so the rules are left out for them: applied there (as
        // PyTorch does), a request under `max_split_size` skips a large free block in the
        // middle of the range and maps new pages at its end instead, and reserved memory
        // grows without bound (pytorch/pytorch#123548).
        if self.in_expandable_segment(block) {
            return Some(block);
        }
        self.oversize_rules_allow(rounded, block_size)
            .then_some(block)
    }

    /// Whether `max_split_size` lets a request of `rounded` bytes take a free block of
    /// `block_size` bytes (outside expandable segments).
    pub(super) fn oversize_rules_allow(&self, rounded: u64, block_size: u64) -> bool {
        let max_split = self.max_split();
        if rounded < max_split && block_size >= max_split {
            return false;
        }
        !(rounded >= max_split
            && block_size >= rounded.saturating_add(self.config.max_non_split_rounding))
    }

    /// Takes the best cached block of private pool `mem` (or of the allocator's own pools)
    /// for a request out of its free list.
    pub fn take_free_block_in(
        &mut self,
        mem: Option<MemPoolId>,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Option<BlockId> {
        let block = self.find_free_block_in(mem, pool, stream, rounded)?;
        self.unlist(block);
        Some(block)
    }

    /// Removes a free block from its free list.
    pub fn unlist(&mut self, block: BlockId) {
        let (pool, stream, address) = (
            self.blocks.pool(block),
            self.blocks.stream(block),
            self.blocks.address(block),
        );
        let size = self.blocks[block].size();
        let mem = self.blocks.mem_pool(block);
        let removed = self.pool_list_mut(mem, pool).remove(stream, size, address);
        debug_assert_eq!(
            removed,
            Some(block),
            "free block missing from its free list"
        );
    }

    /// Puts a free block in its free list; its garbage-collection age starts at 0 (PyTorch's
    /// `insert_into_blocks`).
    pub(super) fn list(&mut self, block: BlockId) {
        let (pool, stream, address) = (
            self.blocks.pool(block),
            self.blocks.stream(block),
            self.blocks.address(block),
        );
        let b = &mut self.blocks[block];
        b.gc_base = self.large_searches;
        let size = b.size();
        let mem = self.blocks.mem_pool(block);
        self.pool_list_mut(mem, pool)
            .insert(stream, size, address, block);
    }

    fn should_split(&self, block: BlockId, rounded: u64) -> bool {
        // PyTorch's `should_split` first: a block of a `no_split` pool stays whole.
        if self.never_split(block) {
            return false;
        }
        let remaining = self.blocks[block].size() - rounded;
        match self.blocks.pool(block) {
            PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
            // PyTorch's `should_split` compares the request, not the block: a request under
            // `max_split_size` splits even a block at or above it. A block of an expandable
            // segment always splits (PyTorch asks whether expandable segments are on; here
            // the block's segment says, since segments made before a settings change keep
            // their kind).
            PoolKind::Large if self.in_expandable_segment(block) => remaining >= MIN_BLOCK_SIZE,
            PoolKind::Large => rounded < self.max_split() && remaining > SMALL_SIZE,
        }
    }

    /// (count, bytes) a block adds to `inactive_split`: free blocks of split segments.
    fn inactive_split_share(&self, block: BlockId) -> (i64, i64) {
        let b = &self.blocks[block];
        // Expandable segments are left out, as PyTorch leaves them out: their free pages can
        // always be given back.
        if b.state == BlockState::Inactive && b.is_split() && !self.in_expandable_segment(block) {
            (1, b.size() as i64)
        } else {
            (0, 0)
        }
    }

    fn change_inactive_split(&mut self, pool: PoolKind, before: (i64, i64), after: (i64, i64)) {
        if before.0 != after.0 {
            self.stats.inactive_split.change(pool, after.0 - before.0);
        }
        if before.1 != after.1 {
            self.stats
                .inactive_split_bytes
                .change(pool, after.1 - before.1);
        }
    }

    /// Hands out a free, unlisted block for a request routed to private pool `routed` (`None`:
    /// the allocator's own pools), splitting off the remainder if the rules allow, and returns
    /// it.
    pub fn allocate_block(
        &mut self,
        routed: Option<MemPoolId>,
        block: BlockId,
        rounded: u64,
        requested: u64,
    ) -> BlockId {
        let stream = self.blocks.stream(block);
        self.allocate_block_for(routed, block, rounded, requested, stream)
    }

    /// [`allocate_block`](Self::allocate_block) for a request of `requester`: when the block
    /// is another stream's (lent, see `sharing`), `requester` is recorded as a use of it, so
    /// that its free waits for `requester`'s work, and the trace names `requester`.
    pub(super) fn allocate_block_for(
        &mut self,
        routed: Option<MemPoolId>,
        block: BlockId,
        rounded: u64,
        requested: u64,
        requester: DeviceStream,
    ) -> BlockId {
        let pool = self.blocks.pool(block);
        let before = self.inactive_split_share(block);
        let mut after = (0, 0);
        let block_size = self.blocks[block].size();
        if self.should_split(block, rounded) {
            let remainder =
                self.blocks
                    .split_off(block, End::Back, block_size - rounded, Backing::Mapped);
            self.list(remainder);
            after = self.inactive_split_share(remainder);
        }
        self.change_inactive_split(pool, before, after);

        let id = self.next_allocation_id;
        self.next_allocation_id += 1;
        let max_split = self.max_split();
        let b = &mut self.blocks[block];
        b.state = BlockState::ActiveAllocated;
        b.requested = requested;
        b.allocation_id = id;
        let size = b.size();

        let stats = &mut self.stats;
        stats.allocation.increase(pool, 1);
        stats.allocated_bytes.increase(pool, size);
        stats.active.increase(pool, 1);
        stats.active_bytes.increase(pool, size);
        stats.requested_bytes.increase(pool, requested);
        if size >= max_split {
            stats.oversize_allocations.increase(1);
        }
        self.tag(block);
        let (stream, address) = (self.blocks.stream(block), self.blocks.address(block));
        self.note_allocated(block, stream, requester);
        if requester != stream {
            self.blocks[block].stream_uses.push(requester);
        }
        self.record(|| TraceEvent::Malloc {
            id,
            size: requested,
            stream: requester.0,
            block_size: size,
            address,
            pool: routed.map_or(0, MemPoolId::get),
        });
        block
    }

    /// Makes a freed block reusable: merges it with free neighbours and lists the result.
    pub fn free_block(&mut self, block: BlockId) {
        let pool = self.blocks.pool(block);
        let b = &mut self.blocks[block];
        let (size, requested, id) = (b.size(), b.requested, b.allocation_id);
        b.state = BlockState::Inactive;
        b.stream_uses.clear();
        b.requested = 0;
        b.allocation_id = 0;
        b.tag = None;
        // Active and requested bytes drop when the free completes, not when it is asked for
        // (PyTorch's `free_block`): a free waiting on another stream still counts.
        self.stats.active.decrease(pool, 1);
        self.stats.active_bytes.decrease(pool, size);
        self.stats.requested_bytes.decrease(pool, requested);

        let before = self.merge_free_neighbours(block, Backing::Mapped);
        let after = self.inactive_split_share(block);
        self.change_inactive_split(pool, before, after);
        let stream = self.blocks.stream(block);
        self.note_freed(block, stream);
        self.list(block);
        self.record(|| TraceEvent::FreeCompleted { id });
        self.release_if_orphaned(block);
    }

    /// Merges into `block` its free neighbours backed as `backing`, taking each out of the
    /// index it is kept in first (its free list, or the unmapped index), and returns what they
    /// added to `inactive_split` (count, bytes).
    pub(super) fn merge_free_neighbours(&mut self, block: BlockId, backing: Backing) -> (i64, i64) {
        let mut share = (0, 0);
        for neighbour in self.blocks.free_neighbours(block, backing) {
            let (count, bytes) = self.inactive_split_share(neighbour);
            share = (share.0 + count, share.1 + bytes);
            match backing {
                Backing::Mapped => self.unlist(neighbour),
                Backing::Unmapped => {
                    let key = self.unmapped_key(neighbour);
                    self.unmapped.remove(&key);
                }
            }
            self.blocks.merge(block, neighbour);
        }
        share
    }
}
