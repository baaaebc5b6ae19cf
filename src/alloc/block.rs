//! Blocks and segments: the address-ordered tiling of every device segment.
//!
//! A segment is one device allocation. Its blocks cover it exactly, in address order, linked
//! through `prev`/`next`. A block is allocated, free (in its pool's free list), or freed by
//! its owner but still waiting for events on other streams before it may be reused.

use serde::{Deserialize, Serialize};
use slab::Slab;

use super::size::PoolKind;
use crate::device::StreamId;

pub(crate) type BlockId = usize;
pub(crate) type SegmentId = usize;

/// What a block is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Handed out and not yet freed.
    ActiveAllocated,
    /// Freed by its owner, but another stream may still use it: waiting on events.
    ActivePendingFree,
    /// Free and cached for reuse.
    Inactive,
}

#[derive(Debug)]
pub(crate) struct Block {
    pub segment: SegmentId,
    /// Offset inside the segment.
    pub offset: u64,
    pub size: u64,
    /// What the owner asked for (0 when free).
    pub requested: u64,
    pub state: BlockState,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    /// Other streams this block was used on while allocated.
    pub stream_uses: Vec<StreamId>,
    /// Events still pending before a pending-free block becomes free.
    pub pending_events: usize,
    /// The allocation id while allocated.
    pub allocation_id: u64,
    /// The large pool's search count when the block was last put in a free list: its
    /// garbage-collection age is the count now minus this (PyTorch's `gc_count_base`).
    pub gc_base: u64,
    /// Whether pages back the block. Always true outside expandable segments; an unmapped
    /// block is reserved address space at page boundaries, in no free list.
    pub mapped: bool,
}

impl Block {
    /// A free block of `size` bytes at `offset` of `segment`, between `prev` and `next`
    /// (the caller links those back), backed by pages or not (`mapped`).
    pub fn free(
        segment: SegmentId,
        offset: u64,
        size: u64,
        prev: Option<BlockId>,
        next: Option<BlockId>,
        mapped: bool,
    ) -> Self {
        Self {
            segment,
            offset,
            size,
            requested: 0,
            state: BlockState::Inactive,
            prev,
            next,
            stream_uses: Vec::new(),
            pending_events: 0,
            allocation_id: 0,
            gc_base: 0,
            mapped,
        }
    }

    /// Whether the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

#[derive(Debug)]
pub(crate) struct Segment<H> {
    pub address: u64,
    pub size: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub handle: H,
    /// The block at offset 0.
    pub first: BlockId,
    /// An expandable segment: a reserved range whose blocks may be unmapped; `size` is the
    /// whole range and only mapped bytes count as reserved.
    pub expandable: bool,
}

/// Every block and segment the engine holds.
#[derive(Debug)]
pub(crate) struct Blocks<H> {
    pub blocks: Slab<Block>,
    pub segments: Slab<Segment<H>>,
}

impl<H> Default for Blocks<H> {
    fn default() -> Self {
        Self {
            blocks: Slab::new(),
            segments: Slab::new(),
        }
    }
}

impl<H> Blocks<H> {
    /// The device address of a block.
    pub fn address(&self, block: BlockId) -> u64 {
        let b = &self.blocks[block];
        self.segments[b.segment].address + b.offset
    }

    pub fn stream(&self, block: BlockId) -> StreamId {
        self.segments[self.blocks[block].segment].stream
    }

    pub fn pool(&self, block: BlockId) -> PoolKind {
        self.segments[self.blocks[block].segment].pool
    }

    /// Blocks of a segment in address order.
    pub fn segment_blocks(&self, segment: SegmentId) -> SegmentBlocks<'_, H> {
        SegmentBlocks {
            blocks: self,
            next: Some(self.segments[segment].first),
        }
    }
}

pub(crate) struct SegmentBlocks<'a, H> {
    blocks: &'a Blocks<H>,
    next: Option<BlockId>,
}

impl<H> Iterator for SegmentBlocks<'_, H> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        let id = self.next?;
        self.next = self.blocks.blocks[id].next;
        Some(id)
    }
}
