//! Expandable segments: PyTorch's `expandable_segments:True` ("Note [Expandable Segments]"
//! in `CUDACachingAllocator.cpp`).
//!
//! Per stream and pool, one reserved address range of 9/8 of the device's memory, backed by
//! pages only where blocks need them: 2 MiB pages in the small pool, 20 MiB in the large one.
//! The range's blocks tile all of it; an unmapped block is page-aligned address space in no
//! free list (the engine keeps those in `unmapped`, by pool, stream and address). A miss maps
//! pages at the lowest address where free and unmapped blocks together fit the request
//! (`find_expandable_block`), so a free tail and the new pages become one block instead of a
//! new segment, and every size tiles one range. Releasing the cache (`empty_cache`, the last
//! retry before an out-of-memory) unmaps the whole pages inside free blocks (`unmap_block`)
//! and gives a range back once nothing in it is mapped. Garbage collection and the oversize
//! release never touch expandable blocks (PyTorch PR 134338); reserved memory counts mapped
//! bytes, `num_device_alloc` / `num_device_free` count maps and unmaps.

use super::Engine;
use crate::alloc::block::{Backing, BlockId, BlockState, End, NewSegment};
use crate::alloc::error::AllocError;
use crate::alloc::history::TraceEvent;
use crate::alloc::size::{LARGE_BUFFER, PoolKind, SMALL_BUFFER};
use crate::device::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream};

impl<D: DeviceMemory> Engine<D> {
    /// Whether new memory comes from expandable segments: configured, and the device has
    /// virtual memory.
    pub fn expandable(&self) -> bool {
        self.config.expandable_segments && self.vm_granularity.is_some()
    }

    /// The page an expandable segment of `pool` maps at a time.
    fn page_size(&self, pool: PoolKind) -> u64 {
        let page = match pool {
            PoolKind::Small => SMALL_BUFFER,
            PoolKind::Large => LARGE_BUFFER,
        };
        page.next_multiple_of(self.vm_granularity.unwrap_or(1))
    }

    /// Whether `block` is free address space: a free mapped block or an unmapped one.
    fn allocatable(&self, block: Option<BlockId>) -> bool {
        block.is_some_and(|b| self.blocks[b].state == BlockState::Inactive)
    }

    /// The key of an unmapped block in `unmapped`.
    pub(super) fn unmapped_key(&self, block: BlockId) -> (PoolKind, u64, u64) {
        (
            self.blocks.pool(block),
            self.blocks.stream(block).0,
            self.blocks.address(block),
        )
    }

    /// The range of an expandable segment, as the device knows it.
    fn range_of(&self, block: BlockId) -> DeviceSegment<D::Handle> {
        let s = self.blocks.segment_of(block);
        DeviceSegment {
            address: s.address,
            size: s.size,
            handle: s.handle.clone(),
        }
    }

    /// The block to grow from for a request of `size` bytes (PyTorch's
    /// `find_expandable_block`): the lowest-address unmapped block of the stream and pool
    /// (or the free block just before it) from which free and unmapped blocks add up to
    /// `size`; a new range when there is none.
    fn find_expandable_block(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        size: u64,
    ) -> Result<BlockId, AllocError> {
        let keys = (pool, stream.0, 0)..=(pool, stream.0, u64::MAX);
        for &unmapped in self.unmapped.range(keys).map(|(_, b)| b) {
            let prev = self.blocks[unmapped].prev();
            let start = if self.allocatable(prev) {
                prev.unwrap_or(unmapped)
            } else {
                unmapped
            };
            let (mut bytes, mut at) = (0, Some(start));
            while bytes < size && self.allocatable(at) {
                let b = &self.blocks[at.unwrap_or(start)];
                bytes += b.size();
                at = b.next();
            }
            if bytes >= size {
                return Ok(start);
            }
        }
        let page = self.page_size(pool);
        let total = self.device_total().unwrap_or(size);
        let range_size = (total + total / 8).max(size).next_multiple_of(page);
        let range = self.device.reserve_range(range_size, stream)?;
        let segment = NewSegment {
            address: range.address,
            size: range.size,
            stream,
            pool,
            handle: range.handle,
            expandable: true,
            mem_pool: None,
        };
        let block = self.blocks.new_segment(segment, Backing::Unmapped);
        self.unmapped.insert((pool, stream.0, range.address), block);
        Ok(block)
    }

    /// Maps the pages covering the first `size` bytes of unmapped block `to_map` (PyTorch's
    /// `map_block`), merges them with free neighbours and lists the result, which it returns;
    /// `None` when the device has no pages left (nothing changes then).
    #[allow(unsafe_code)] // the device's map (SAFETY inside)
    fn map_block(&mut self, to_map: BlockId, size: u64) -> Result<Option<BlockId>, AllocError> {
        let pool = self.blocks.pool(to_map);
        let stream = self.blocks.stream(to_map);
        let key = self.unmapped_key(to_map);
        let (offset, block_size) = {
            let b = &self.blocks[to_map];
            debug_assert!(!b.is_mapped());
            (b.offset(), b.size())
        };
        let page = self.page_size(pool);
        let len = size.next_multiple_of(page).min(block_size);
        // Whole pages may overshoot what `new_memory` checked: the fraction holds for them too.
        if let Some(limit) = self.fraction_limit()
            && self.stats.memory_reserved() + len > limit
        {
            return Ok(None);
        }
        // SAFETY: the range is this segment's, reserved by this device and released only when
        // its last page is unmapped; `to_map` is listed unmapped, so its pages are.
        match unsafe {
            self.device
                .map_range(&self.range_of(to_map), offset, len, page)
        } {
            Ok(()) => {}
            Err(DeviceError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        self.unmapped.remove(&key);
        if len < block_size {
            let rest =
                self.blocks
                    .split_off(to_map, End::Back, block_size - len, Backing::Unmapped);
            let rest_key = self.unmapped_key(rest);
            self.unmapped.insert(rest_key, rest);
        }
        self.blocks[to_map].backing = Backing::Mapped;
        self.merge_free_neighbours(to_map, Backing::Mapped);
        self.list(to_map);
        let address = key.2;
        self.stats.reserved_bytes.increase(pool, len);
        self.stats.num_device_alloc += 1;
        self.record(|| TraceEvent::SegmentMap {
            address,
            size: len,
            stream: stream.0,
        });
        Ok(Some(to_map))
    }

    /// A free, unlisted block of at least `rounded` bytes from the stream's expandable
    /// segment, mapping pages as needed (PyTorch's `try_allocate_expandable_block`); `None`
    /// when the device has no pages left (pages mapped on the way stay mapped and cached).
    pub fn allocate_expandable(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let mut candidate = self.find_expandable_block(pool, stream, rounded)?;
        if !self.blocks[candidate].is_mapped() {
            let size = self.blocks[candidate].size().min(rounded);
            match self.map_block(candidate, size)? {
                Some(block) => candidate = block,
                None => return Ok(None),
            }
        }
        while self.blocks[candidate].size() < rounded {
            // Free mapped neighbours were merged: what follows is unmapped.
            let Some(next) = self.blocks[candidate].next() else {
                unreachable!("find_expandable_block found room up to the request");
            };
            let missing = rounded - self.blocks[candidate].size();
            let size = self.blocks[next].size().min(missing);
            match self.map_block(next, size)? {
                Some(block) => candidate = block,
                None => return Ok(None),
            }
        }
        self.unlist(candidate);
        Ok(Some(candidate))
    }

    /// The size a free block could grow to: itself plus the unmapped block after it
    /// (PyTorch's `expandable_size` in `get_free_block`).
    pub fn expandable_size(&self, block: BlockId) -> u64 {
        let b = &self.blocks[block];
        let tail = b
            .next()
            .map(|n| &self.blocks[n])
            .filter(|n| !n.is_mapped())
            .map_or(0, |n| n.size());
        b.size() + tail
    }

    /// Whether `block` lies in an expandable segment.
    pub fn in_expandable_segment(&self, block: BlockId) -> bool {
        self.blocks.segment_of(block).expandable
    }

    /// Unmaps the whole pages inside free block `block` (PyTorch's `unmap_block`): the
    /// partial pages before and after stay mapped as free blocks, the unmapped part merges
    /// with unmapped neighbours. Returns the bytes unmapped.
    #[allow(unsafe_code)] // the device's unmap (SAFETY inside)
    fn unmap_block(&mut self, block: BlockId) -> Result<u64, AllocError> {
        let pool = self.blocks.pool(block);
        let stream = self.blocks.stream(block);
        let page = self.page_size(pool);
        let (offset, size) = {
            let b = &self.blocks[block];
            (b.offset(), b.size())
        };
        let begin = offset.next_multiple_of(page);
        let end = (offset + size) / page * page;
        if begin >= end {
            return Ok(0);
        }
        // A failure part-way unmapped the pages up to some point: the block is split there, so
        // that no block is listed as mapped over pages that are gone.
        let (end, failure) =
            // SAFETY: the block is free and mapped (listed so), its stream uses completed
            // (a free block has no pending event), and the range is its segment's.
            match unsafe {
                self.device
                    .unmap_range(&self.range_of(block), begin, end - begin)
            } {
                Ok(()) => (end, None),
                Err(DeviceError::PartialUnmap { unmapped, reason })
                    if unmapped > 0 && unmapped <= end - begin && unmapped.is_multiple_of(page) =>
                {
                    let err = DeviceError::PartialUnmap { unmapped, reason };
                    (begin + unmapped, Some(err))
                }
                Err(e) => return Err(e.into()),
            };
        self.unlist(block);
        if begin > offset {
            let before = self
                .blocks
                .split_off(block, End::Front, begin - offset, Backing::Mapped);
            self.list(before);
        }
        if end < offset + size {
            let after =
                self.blocks
                    .split_off(block, End::Back, offset + size - end, Backing::Mapped);
            self.list(after);
        }
        let range_address = self.blocks.segment_of(block).address;
        self.blocks[block].backing = Backing::Unmapped;
        self.merge_free_neighbours(block, Backing::Unmapped);
        let key = self.unmapped_key(block);
        self.unmapped.insert(key, block);
        let len = end - begin;
        self.stats.reserved_bytes.decrease(pool, len);
        self.stats.num_device_free += 1;
        self.record(|| TraceEvent::SegmentUnmap {
            address: range_address + begin,
            size: len,
            stream: stream.0,
        });
        match failure {
            Some(err) => Err(err.into()),
            None => Ok(len),
        }
    }

    /// Unmaps the whole pages of every free block in the expandable segments of `pool`, then
    /// gives back every range left with nothing mapped. Returns the bytes unmapped. A failure
    /// goes to `failed`, which stops the release by returning it or lets it go on.
    #[allow(unsafe_code)] // the device's release of a range (SAFETY inside)
    pub fn release_expandable(
        &mut self,
        pool: PoolKind,
        failed: &mut dyn FnMut(AllocError) -> Result<(), AllocError>,
    ) -> Result<u64, AllocError> {
        let free: Vec<BlockId> = self
            .free_list_ref(pool)
            .iter()
            .filter(|&b| self.in_expandable_segment(b))
            .collect();
        let mut released = 0;
        for block in free {
            match self.unmap_block(block) {
                Ok(bytes) => released += bytes,
                Err(e) => failed(e)?,
            }
        }
        let empty: Vec<BlockId> = self
            .unmapped
            .range((pool, 0, 0)..=(pool, u64::MAX, u64::MAX))
            .map(|(_, &b)| b)
            .filter(|&b| !self.blocks[b].is_split())
            .collect();
        for block in empty {
            let range = self.range_of(block);
            let key = self.unmapped_key(block);
            // SAFETY: the segment's range, reserved by this device and not released (its key is
            // listed); its one block spans it unmapped, so nothing is mapped in it.
            if let Err(e) = unsafe { self.device.release_range(range) } {
                failed(e.into())?;
                continue;
            }
            self.unmapped.remove(&key);
            self.blocks.remove_segment(block);
        }
        Ok(released)
    }
}
