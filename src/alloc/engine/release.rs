//! Growing and shrinking reserved memory: new segments, and the steps of the miss path that
//! hand cached segments back to the device.
//!
//! Only whole free segments go back: a segment with any allocated or pending block stays.

use super::Engine;
use crate::alloc::block::{Block, BlockId, BlockState, Segment};
use crate::alloc::error::AllocError;
use crate::alloc::size::PoolKind;
use crate::alloc::trace::TraceEvent;
use crate::device::{DeviceError, DeviceMemory, DeviceSegment, StreamId};

impl<D: DeviceMemory> Engine<D> {
    /// Allocates a segment of `size` bytes and returns its one free, unlisted block; `None`
    /// when the device is out of memory or the memory fraction would be exceeded.
    pub fn allocate_segment(
        &mut self,
        size: u64,
        pool: PoolKind,
        stream: StreamId,
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
        let segment_id = self.blocks.segments.insert(Segment {
            address,
            size,
            stream,
            pool,
            handle: segment.handle,
            first: usize::MAX,
        });
        let block = self.blocks.blocks.insert(Block {
            segment: segment_id,
            offset: 0,
            size,
            requested: 0,
            state: BlockState::Inactive,
            prev: None,
            next: None,
            stream_uses: Vec::new(),
            pending_events: 0,
            allocation_id: 0,
            freed_at: self.clock,
        });
        self.blocks.segments[segment_id].first = block;
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
    fn release_segment(&mut self, block: BlockId) -> Result<u64, AllocError> {
        debug_assert!(!self.blocks.blocks[block].is_split());
        let segment_id = self.blocks.blocks[block].segment;
        let s = &self.blocks.segments[segment_id];
        let (address, size, pool) = (s.address, s.size, s.pool);
        self.device.free(DeviceSegment {
            address,
            size,
            handle: s.handle.clone(),
        })?;
        self.unlist(block);
        self.blocks.blocks.remove(block);
        self.blocks.segments.remove(segment_id);
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
    fn whole_free_segments(&self, pool: PoolKind) -> Vec<BlockId> {
        self.free_list_ref(pool)
            .iter()
            .filter(|&b| !self.blocks.blocks[b].is_split())
            .collect()
    }

    /// Frees cached oversize blocks of the request's stream so that a request of `rounded`
    /// bytes may fit: the smallest one at least as large as the request if there is one,
    /// else the largest ones until as many bytes as requested are freed. Only with a
    /// `max_split_size` configured. Returns whether enough was freed.
    pub fn release_oversize_blocks(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.max_split();
        if max_split == u64::MAX {
            return Ok(false);
        }
        let wanted = rounded.max(max_split);
        let list = self.free_list_ref(pool);
        if let Some((_, block)) = list.best_fit(stream, wanted)
            && !self.blocks.blocks[block].is_split()
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
            if !self.blocks.blocks[block].is_split() {
                self.release_segment(block)?;
                released += size;
            }
        }
        Ok(released >= wanted)
    }

    /// Completes every pending free (waiting on its events), then returns every whole free
    /// segment of both pools to the device. Returns the bytes released.
    pub fn release_cached_blocks(&mut self) -> Result<u64, AllocError> {
        self.synchronize_pending()?;
        let mut released = 0;
        for pool in [PoolKind::Large, PoolKind::Small] {
            for block in self.whole_free_segments(pool) {
                released += self.release_segment(block)?;
            }
        }
        Ok(released)
    }

    /// With a garbage-collection threshold set and reserved memory above that fraction of
    /// the allowed memory, returns the large pool's whole free segments to the device, the
    /// longest-unused first, until reserved memory is back under the threshold.
    pub fn collect_garbage(&mut self) -> Result<(), AllocError> {
        let Some(threshold) = self.config.garbage_collection_threshold else {
            return Ok(());
        };
        let Some(allowed) = self.fraction_limit().or_else(|| self.device_total()) else {
            return Ok(());
        };
        let target = (threshold * allowed as f64) as u64;
        if self.stats.memory_reserved() <= target {
            return Ok(());
        }
        let mut candidates = self.whole_free_segments(PoolKind::Large);
        candidates.sort_by_key(|&b| self.blocks.blocks[b].freed_at);
        for block in candidates {
            if self.stats.memory_reserved() <= target {
                break;
            }
            self.release_segment(block)?;
        }
        Ok(())
    }
}
