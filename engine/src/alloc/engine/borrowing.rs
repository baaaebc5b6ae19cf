//! A miss borrows the other pool's free memory before it asks the device for more.
//!
//! PyTorch's pools never lend to each other: a miss in one pool allocates device memory while
//! the other pool may cache free memory that would serve it, until `empty_cache` or an
//! out-of-memory flush returns it. On variable shapes this is where reserved memory goes: on
//! Burn's transformer with varying sequence lengths, requests of a little over 1 MiB make new
//! large-pool segments while empty 2 MiB small-pool segments sit in the cache, and small
//! requests make new small segments beside an empty 2 MiB large-pool one (the measurements
//! are in the guide's benchmarks chapter, `docs/src/benchmarks.md`).
//!
//! With `pool_borrowing:true` (the default), a miss that would allocate device memory (not a
//! cache-only request) first borrows:
//!
//! - a **large request of at most 2 MiB** (the small pool's segment size) takes the
//!   best-fitting free block of the small pool (smallest, lowest address), in place: it
//!   becomes a block of that small segment, split by the small pool's rule (a remainder of
//!   512 B or more stays free for small requests). Large requests over 2 MiB never borrow:
//!   no small segment could hold them;
//! - a **small request** takes a wholly free large-pool segment of exactly 2 MiB, which moves
//!   to the small pool; never a larger one, which a small tensor would pin, and never a
//!   segment with a live block.
//!
//! Every segment still belongs to one pool, and every block to its segment's pool (as in
//! PyTorch, whose statistics count a block in its segment's pool): a borrowed block counts
//! in the small pool's statistics, a moved segment's `segment` and `reserved_bytes` move from
//! the large pool to the small one while `all` stays (no device memory came or went), and
//! `num_pool_borrows` counts the borrows. A borrow costs no device call and reserves nothing.
//! Expandable segments never lend: their pages are mapped per pool and given back on their
//! own. `pool_borrowing:false` is PyTorch's rule.

use super::Engine;
use crate::alloc::block::BlockId;
use crate::alloc::size::{PoolKind, SMALL_BUFFER};
use crate::device::{DeviceMemory, DeviceStream};

impl<D: DeviceMemory> Engine<D> {
    /// A free, unlisted block of the other pool's memory for a request of `rounded` bytes
    /// that missed `pool`, now a small-pool block; `None` when there is none to borrow.
    pub(super) fn borrow_from_other_pool(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Option<BlockId> {
        if !self.config.pool_borrowing || self.expandable() {
            return None;
        }
        let block = match pool {
            PoolKind::Large if rounded <= SMALL_BUFFER => {
                self.free_list_ref(PoolKind::Small)
                    .best_fit(stream, rounded)?
                    .1
            }
            PoolKind::Large => return None,
            PoolKind::Small => self.empty_small_sized_large_segment(stream)?,
        };
        // A segment made expandable before a settings change turned them off maps its own
        // pages: it is never lent.
        if self.in_expandable_segment(block) {
            return None;
        }
        self.unlist(block);
        if self.blocks.pool(block) == PoolKind::Large {
            let size = self.blocks[block].size();
            self.blocks.set_pool(block, PoolKind::Small);
            self.stats
                .segment
                .transfer(PoolKind::Large, PoolKind::Small, 1);
            self.stats
                .reserved_bytes
                .transfer(PoolKind::Large, PoolKind::Small, size);
        }
        self.stats.num_pool_borrows += 1;
        Some(block)
    }

    /// The lowest wholly free large-pool segment of `stream` that is exactly the small
    /// pool's segment size (its one free block).
    fn empty_small_sized_large_segment(&self, stream: DeviceStream) -> Option<BlockId> {
        let list = self.free_list_ref(PoolKind::Large);
        let mut next = list.best_fit(stream, SMALL_BUFFER);
        while let Some((size, block)) = next {
            if size > SMALL_BUFFER {
                return None;
            }
            if !self.blocks[block].is_split() {
                return Some(block);
            }
            next = list.next_after(stream, size, self.blocks.address(block));
        }
        None
    }
}
