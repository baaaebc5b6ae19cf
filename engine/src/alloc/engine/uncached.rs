//! `no_cuda_memory_caching`: every request its own device allocation, every free its return.
//!
//! PyTorch's switch is `PYTORCH_NO_CUDA_MEMORY_CACHING`, read by `forceUncachedAllocator()`
//! (c10/cuda/CUDACachingAllocator.cpp): under it `allocate` calls `cudaMalloc` for the request
//! alone, and the tensor's deleter (`uncached_delete`) calls `cudaFree`, which waits for the
//! whole device. Its caching allocator is bypassed entirely, so its statistics see none of it.
//! The point is compute-sanitizer: its memcheck knows allocations, not blocks, so an
//! out-of-bounds access into a neighbouring block of the same segment goes unseen while
//! caching, and is reported once every block is an allocation of its own.
//!
//! Here the engine keeps its path and its numbers:
//!
//! - a request takes a new segment of its size rounded up to 512 bytes (in the small or large
//!   pool by that size, as any block), never a cached block, never split; the memory fraction
//!   and `throw_on_cudamalloc_oom` apply. A device out-of-memory completes the pending frees
//!   (waiting for their events), returns their segments and retries once
//!   (`num_alloc_retries`), then reports the out-of-memory;
//! - a free records an event on the block's own stream (and on every stream `record_stream`
//!   named); the block stays active until all of them completed, then its segment goes back to
//!   the device. The host never waits for a free: events are polled at every request and
//!   free, and waited for only by `empty_cache`, the out-of-memory retry and a drop.
//!
//! So `allocated`, `active` and `reserved` keep their meaning: a block is allocated until its
//! free, active until its stream's work is done, reserved until its segment went back.

use super::{Engine, MissPath};
use crate::alloc::block::BlockId;
use crate::alloc::error::AllocError;
use crate::alloc::mem_pool::MemPoolId;
use crate::alloc::size::{MIN_BLOCK_SIZE, PoolKind};
use crate::device::{DeviceMemory, DeviceStream};

impl<D: DeviceMemory> Engine<D> {
    /// Whether nothing is cached (`no_cuda_memory_caching`).
    pub(super) fn uncached(&self) -> bool {
        self.config.no_cuda_memory_caching
    }

    /// A request of `size` bytes (> 0) without caching: a device allocation of its own (see the
    /// module docs). `routed` (the private pool the request was routed to, which nothing
    /// cached serves here) is recorded with it. `Ok(None)` for [`MissPath::CacheOnly`] (nothing is cached), and for
    /// [`MissPath::BeforeFlush`] when the device has no room before pending frees completed.
    pub(super) fn malloc_uncached(
        &mut self,
        routed: Option<MemPoolId>,
        size: u64,
        stream: DeviceStream,
        growth: MissPath,
    ) -> Result<Option<BlockId>, AllocError> {
        let rounded = size
            .checked_next_multiple_of(MIN_BLOCK_SIZE)
            .unwrap_or(u64::MAX);
        if let Some(total) = self.device_total()
            && rounded > total
        {
            return Err(self.too_large(size, total, stream));
        }
        if let Some(max) = self.max_segment
            && rounded > max
        {
            return Err(self.too_large(size, max, stream));
        }
        if growth == MissPath::CacheOnly {
            return Ok(None);
        }
        let pool = PoolKind::for_size(rounded);
        self.reject_over_cap(size, rounded, stream)?;
        let mut block = self.new_uncached_segment(size, rounded, pool, stream)?;
        if block.is_none() && growth == MissPath::Allowed {
            self.release_cached_blocks()?;
            self.stats.num_alloc_retries += 1;
            block = self.new_uncached_segment(size, rounded, pool, stream)?;
            self.rescued_by_flush += u64::from(block.is_some());
        }
        match block {
            Some(block) => Ok(Some(self.allocate_block(routed, block, rounded, size))),
            None if growth == MissPath::BeforeFlush => Ok(None),
            None => Err(self.out_of_memory(size, stream)),
        }
    }

    /// A segment of exactly `rounded` bytes; `None` when the device (or the memory fraction)
    /// has no room.
    fn new_uncached_segment(
        &mut self,
        size: u64,
        rounded: u64,
        pool: PoolKind,
        stream: DeviceStream,
    ) -> Result<Option<BlockId>, AllocError> {
        match self.allocate_segment(rounded, pool, stream) {
            Err(AllocError::TooLarge { max, .. }) => Err(self.too_large(size, max, stream)),
            other => other,
        }
    }

    /// Returns to the device every whole free segment, the blocks whose frees completed
    /// (without caching no free block stays listed; a segment the device refused to take back
    /// stays until the next call, and the error is returned).
    pub(super) fn release_completed_frees(&mut self) -> Result<(), AllocError> {
        for pool in [PoolKind::Large, PoolKind::Small] {
            for block in self.whole_free_segments(pool) {
                self.release_segment(block)?;
            }
        }
        Ok(())
    }
}
