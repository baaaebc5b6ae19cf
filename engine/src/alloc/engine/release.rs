//! Growing and shrinking reserved memory: new segments, and the steps of the miss path that
//! hand cached segments back to the device.
//!
//! Only whole free segments go back: a segment with any allocated or pending block stays.

use super::Engine;
use crate::alloc::block::{Backing, BlockId, NewSegment};
use crate::alloc::error::AllocError;
use crate::alloc::history::TraceEvent;
use crate::alloc::mem_pool::MemPoolId;
use crate::alloc::size::PoolKind;
use crate::device::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream};

impl<D: DeviceMemory> Engine<D> {
    /// Allocates a segment of `size` bytes and returns its one free, unlisted block; `None`
    /// when the device is out of memory or the memory fraction would be exceeded.
    pub fn allocate_segment(
        &mut self,
        size: u64,
        pool: PoolKind,
        stream: DeviceStream,
    ) -> Result<Option<BlockId>, AllocError> {
        self.allocate_segment_in(None, size, pool, stream)
    }

    /// [`Engine::allocate_segment`] for private pool `mem` (`None`: the allocator's own).
    pub(super) fn allocate_segment_in(
        &mut self,
        mem: Option<MemPoolId>,
        size: u64,
        pool: PoolKind,
        stream: DeviceStream,
    ) -> Result<Option<BlockId>, AllocError> {
        if let Some(limit) = self.fraction_limit()
            && self.stats.memory_reserved() + size > limit
        {
            return Ok(None);
        }
        let segment = match self.device.allocate(size, stream) {
            Ok(segment) => segment,
            Err(DeviceError::OutOfMemory { .. }) => return Ok(None),
            Err(DeviceError::TooLarge { max, .. }) => {
                return Err(AllocError::TooLarge {
                    requested: size,
                    max,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let address = segment.address;
        let segment = NewSegment {
            address,
            size,
            stream,
            pool,
            handle: segment.handle,
            expandable: false,
            mem_pool: mem,
        };
        let block = self.blocks.new_segment(segment, Backing::Mapped);
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, size);
        if size >= self.max_split() {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.record(|| TraceEvent::SegmentAlloc {
            address,
            size,
            stream: stream.0,
        });
        Ok(Some(block))
    }

    /// Returns the segment of a listed free block that spans it whole to the device.
    #[allow(unsafe_code)] // the device's free (SAFETY inside)
    pub(super) fn release_segment(&mut self, block: BlockId) -> Result<u64, AllocError> {
        debug_assert!(!self.blocks[block].is_split());
        let s = self.blocks.segment_of(block);
        let (address, size, pool) = (s.address, s.size, s.pool);
        // SAFETY: the segment was allocated by this device and is listed, so not freed; its one
        // free block spans it, and a listed free block has no stream use still pending.
        unsafe {
            self.device.free(DeviceSegment {
                address,
                size,
                handle: s.handle.clone(),
            })
        }?;
        self.unlist(block);
        self.blocks.remove_segment(block);
        self.stats.segment.decrease(pool, 1);
        self.stats.reserved_bytes.decrease(pool, size);
        if size >= self.max_split() {
            self.stats.oversize_segments.decrease(1);
        }
        self.stats.num_device_free += 1;
        self.record(|| TraceEvent::SegmentFree { address, size });
        Ok(size)
    }

    /// Free blocks of a pool that span their whole segment.
    pub(super) fn whole_free_segments(&self, pool: PoolKind) -> Vec<BlockId> {
        self.free_list_ref(pool)
            .iter()
            .filter(|&b| !self.blocks[b].is_split() && !self.in_expandable_segment(b))
            .collect()
    }

    /// Frees cached oversize blocks of the request's stream so that a request of `rounded`
    /// bytes may fit: the smallest one at least as large as the request if there is one,
    /// else the largest ones until as many bytes as requested are freed. Only with a
    /// `max_split_size` configured. Returns whether enough was freed.
    pub fn release_oversize_blocks(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.max_split();
        if max_split == u64::MAX {
            return Ok(false);
        }
        let wanted = rounded.max(max_split);
        let list = self.free_list_ref(pool);
        if let Some((_, block)) = list.best_fit(stream, wanted)
            && !self.blocks[block].is_split()
        {
            self.release_segment(block)?;
            return Ok(true);
        }
        let candidates: Vec<(u64, BlockId)> = list
            .largest_first(stream)
            .take_while(|(size, _)| *size >= max_split)
            .collect();
        let mut released = 0;
        for (size, block) in candidates {
            if released >= wanted {
                break;
            }
            if !self.blocks[block].is_split() {
                self.release_segment(block)?;
                released += size;
            }
        }
        Ok(released >= wanted)
    }

    /// `release_outgrown` (ours, on by default): a large request of the allocator's own pools
    /// (a block of `rounded` bytes) that none of `stream`'s cached blocks could serve is about
    /// to take a new segment of `new_segment` bytes; `stream`'s wholly free large segments
    /// smaller than the block (outgrown: none could ever serve it) go back to the device
    /// first, smallest first, until `new_segment` bytes did. The bytes returned; a device
    /// that refuses a segment back ends the release there (logged), and the request goes on.
    ///
    /// A working set that climbs (the first long sequence after short ones) then trades the
    /// segments it outgrew for the new one instead of keeping both: reserved memory follows
    /// the largest working set, not the sum of every size it passed through. Nothing else
    /// changes: a segment with a live or pending block is never touched, nor one at least as
    /// large as the block (kept whole by `max_split_size`, say: PyTorch's rules decide about
    /// those), an expandable segment maps pages instead (its free pages already go back), and
    /// the segments returned had no work pending (free blocks are listed only once their
    /// events completed). The cost is a device free per segment returned, paid at a climb, not
    /// at every step: once the working set has reached its largest size, every request fits a
    /// cached block again.
    pub(super) fn release_outgrown(
        &mut self,
        stream: DeviceStream,
        rounded: u64,
        new_segment: u64,
    ) -> u64 {
        if !self.config.release_outgrown || self.expandable() {
            return 0;
        }
        let mut candidates: Vec<(u64, BlockId)> = self
            .free_list_ref(PoolKind::Large)
            .largest_first(stream)
            .filter(|(size, block)| {
                *size < rounded
                    && !self.blocks[*block].is_split()
                    && !self.in_expandable_segment(*block)
            })
            .collect();
        candidates.reverse();
        let mut released = 0;
        for (size, block) in candidates {
            if released >= new_segment {
                break;
            }
            // The request does not depend on this: a device that refuses a segment back
            // keeps it cached (as `empty_cache` leaves it) and the request goes on.
            if let Err(err) = self.release_segment(block) {
                log::warn!("caching allocator: returning an outgrown segment failed ({err})");
                break;
            }
            released += size;
        }
        released
    }

    /// Completes every pending free (waiting on its events), then returns every whole free
    /// segment of both pools to the device. Returns the bytes released; stops at the first
    /// failure.
    pub fn release_cached_blocks(&mut self) -> Result<u64, AllocError> {
        self.synchronize_pending()?;
        self.release_free_segments(&mut |e| Err(e))
    }

    /// What a dropped allocator does: completes every pending free it can, then returns every
    /// whole free segment to the device, going on past failures. A block whose event could
    /// not be recorded or waited for stays (its stream may still read it), and so does its
    /// segment; a segment the device refused to take back stays too. Returns the bytes
    /// released and every failure.
    pub fn release_at_drop(&mut self) -> (u64, Vec<AllocError>) {
        let mut failures = self.synchronize_what_can_be();
        self.release_fences();
        let mut go_on = |e| {
            failures.push(e);
            Ok(())
        };
        let released = self.release_free_segments(&mut go_on).unwrap_or_default()
            + self.release_all_pools(&mut go_on).unwrap_or_default();
        (released, failures)
    }

    /// Returns every whole free segment of both pools to the device, large pool first, and
    /// unmaps the free pages of expandable segments. A failure goes to `failed`, which stops
    /// the release by returning it or lets it go on by returning `Ok`.
    fn release_free_segments(
        &mut self,
        failed: &mut dyn FnMut(AllocError) -> Result<(), AllocError>,
    ) -> Result<u64, AllocError> {
        let mut released = 0;
        for pool in [PoolKind::Large, PoolKind::Small] {
            for block in self.whole_free_segments(pool) {
                match self.release_segment(block) {
                    Ok(bytes) => released += bytes,
                    Err(e) => failed(e)?,
                }
            }
            released += self.release_expandable(pool, failed)?;
        }
        Ok(released)
    }

    /// PyTorch's `garbage_collect_cached_blocks`, called on a cache miss when a threshold
    /// and a memory fraction below 1 are set. While reserved memory exceeds threshold x
    /// allowed, each pass returns to the device *every* whole free large-pool segment whose
    /// age (large-pool searches since it was cached) is at least the mean age of those
    /// segments; it does not stop at the target inside a pass, so that collection is not
    /// triggered again at once. Passes repeat until the excess is reclaimed or a pass frees
    /// nothing. No synchronisation: pending frees stay pending.
    pub fn collect_garbage(&mut self) -> Result<(), AllocError> {
        let Some(threshold) = self.config.garbage_collection_threshold else {
            return Ok(());
        };
        let Some(allowed) = self.fraction_limit() else {
            return Ok(());
        };
        let gc_threshold = (threshold * allowed as f64) as u64;
        let reserved = self.stats.memory_reserved();
        if reserved <= gc_threshold {
            return Ok(());
        }
        let target = reserved - gc_threshold;
        let now = self.large_searches;
        let mut candidates: Vec<(BlockId, u64)> = self
            .whole_free_segments(PoolKind::Large)
            .into_iter()
            .map(|b| (b, now - self.blocks[b].gc_base))
            .collect();
        let mut total_age: u64 = candidates.iter().map(|(_, age)| age).sum();
        let mut reclaimed = 0;
        let mut freed_any = true;
        while reclaimed < target && freed_any && !candidates.is_empty() {
            let mean_age = total_age as f64 / candidates.len() as f64;
            freed_any = false;
            let mut kept = Vec::with_capacity(candidates.len());
            for (block, age) in std::mem::take(&mut candidates) {
                if age as f64 >= mean_age {
                    reclaimed += self.release_segment(block)?;
                    total_age -= age;
                    freed_any = true;
                } else {
                    kept.push((block, age));
                }
            }
            candidates = kept;
        }
        Ok(())
    }
}
