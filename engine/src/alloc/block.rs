//! Blocks and segments: the address-ordered tiling of every device segment.
//!
//! A segment is one device allocation. Its blocks cover it exactly, in address order, linked
//! through `prev`/`next`. A block is allocated, free (in its pool's free list), or freed by
//! its owner but still waiting for events on other streams before it may be reused.
//!
//! [`Blocks`] is the block list: the only code that links, splits and merges blocks. The
//! engine asks it for a new segment ([`Blocks::new_segment`]), to carve a free block off one
//! end of another ([`Blocks::split_off`]), for the free neighbours of a block
//! ([`Blocks::free_neighbours`]) and to merge one into it ([`Blocks::merge`]), to walk a
//! segment ([`Blocks::segment_blocks`]) and to drop a segment ([`Blocks::remove_segment`]);
//! what the engine keeps beside the list (free lists, the unmapped index, statistics) stays
//! the engine's.

use std::fmt;
use std::ops::{Index, IndexMut};

use serde::{Deserialize, Serialize};
use slab::Slab;

use super::mem_pool::MemPoolId;
use super::scope::Tag;
use super::size::PoolKind;
use crate::device::DeviceStream;

/// A block of the block list. Printed as its number.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockId(usize);

/// A segment of the block list. Printed as its number.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SegmentId(usize);

macro_rules! id_as_number {
    ($id:ty) => {
        impl fmt::Debug for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}
id_as_number!(BlockId);
id_as_number!(SegmentId);

#[cfg(test)]
impl BlockId {
    /// A made-up id, for tests of structures that only store ids.
    pub fn for_test(id: usize) -> Self {
        Self(id)
    }
}

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

/// Whether pages back a block's address range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backing {
    /// Backed by device memory: every block outside expandable segments.
    Mapped,
    /// Reserved address space at page boundaries with no pages behind it (expandable
    /// segments only); free, and in no free list.
    Unmapped,
}

/// Which end of a block [`Blocks::split_off`] carves from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// The low addresses: the new block comes before the old one.
    Front,
    /// The high addresses: the new block comes after the old one.
    Back,
}

#[derive(Debug)]
pub(crate) struct Block {
    segment: SegmentId,
    /// Offset inside the segment.
    offset: u64,
    size: u64,
    prev: Option<BlockId>,
    next: Option<BlockId>,
    /// What the owner asked for (0 when free).
    pub requested: u64,
    pub state: BlockState,
    /// Other streams this block was used on while allocated.
    pub stream_uses: Vec<DeviceStream>,
    /// Events still pending before a pending-free block becomes free.
    pub pending_events: usize,
    /// The allocation id while allocated.
    pub allocation_id: u64,
    /// The large pool's search count when the block was last put in a free list: its
    /// garbage-collection age is the count now minus this (PyTorch's `gc_count_base`).
    pub gc_base: u64,
    /// Whether pages back the block. Always mapped outside expandable segments.
    pub backing: Backing,
    /// Its stream's free count when the block last became free: other streams may take it
    /// once an event recorded after that free has completed (see the engine's `sharing`).
    pub freed_at: u64,
    /// Whether the live allocation was lent to another stream than the block's own (see the
    /// engine's `sharing`): it does not count in its stream's own use.
    pub lent: bool,
    /// The scope the live allocation was made in ([`Tag`]), if any.
    pub tag: Option<Tag>,
}

impl Block {
    /// A free, unlinked block of `size` bytes at `offset` of `segment`.
    fn free(segment: SegmentId, offset: u64, size: u64, backing: Backing) -> Self {
        Self {
            segment,
            offset,
            size,
            prev: None,
            next: None,
            requested: 0,
            state: BlockState::Inactive,
            stream_uses: Vec::new(),
            pending_events: 0,
            allocation_id: 0,
            gc_base: 0,
            backing,
            freed_at: 0,
            lent: false,
            tag: None,
        }
    }

    /// The segment the block lies in.
    pub fn segment(&self) -> SegmentId {
        self.segment
    }

    /// Offset inside the segment.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The block just below in the segment.
    pub fn prev(&self) -> Option<BlockId> {
        self.prev
    }

    /// The block just above in the segment.
    pub fn next(&self) -> Option<BlockId> {
        self.next
    }

    /// Whether pages back the block.
    pub fn is_mapped(&self) -> bool {
        self.backing == Backing::Mapped
    }

    /// Whether the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// A segment as the engine creates it; [`Blocks::new_segment`] links its first block.
#[derive(Debug)]
pub(crate) struct NewSegment<H> {
    pub address: u64,
    pub size: u64,
    pub stream: DeviceStream,
    pub pool: PoolKind,
    pub handle: H,
    /// An expandable segment: a reserved range whose blocks may be unmapped; `size` is the
    /// whole range and only mapped bytes count as reserved.
    pub expandable: bool,
    /// The private pool the segment belongs to (`None`: the allocator's own pools).
    pub mem_pool: Option<MemPoolId>,
}

#[derive(Debug)]
pub(crate) struct Segment<H> {
    pub address: u64,
    pub size: u64,
    pub stream: DeviceStream,
    pub pool: PoolKind,
    pub handle: H,
    /// An expandable segment: a reserved range whose blocks may be unmapped; `size` is the
    /// whole range and only mapped bytes count as reserved.
    pub expandable: bool,
    /// The private pool the segment belongs to (`None`: the allocator's own pools).
    pub mem_pool: Option<MemPoolId>,
    /// The block at offset 0.
    first: BlockId,
}

impl<H> Segment<H> {
    /// The block at offset 0.
    pub fn first(&self) -> BlockId {
        self.first
    }
}

/// Every block and segment the engine holds: the block list.
#[derive(Debug)]
pub(crate) struct Blocks<H> {
    blocks: Slab<Block>,
    segments: Slab<Segment<H>>,
}

impl<H> Default for Blocks<H> {
    fn default() -> Self {
        Self {
            blocks: Slab::new(),
            segments: Slab::new(),
        }
    }
}

impl<H> Index<BlockId> for Blocks<H> {
    type Output = Block;

    fn index(&self, block: BlockId) -> &Block {
        &self.blocks[block.0]
    }
}

impl<H> IndexMut<BlockId> for Blocks<H> {
    fn index_mut(&mut self, block: BlockId) -> &mut Block {
        &mut self.blocks[block.0]
    }
}

impl<H> Blocks<H> {
    /// A block, `None` when it is not in the list.
    pub fn get(&self, block: BlockId) -> Option<&Block> {
        self.blocks.get(block.0)
    }

    /// Every block, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        self.blocks.iter().map(|(id, b)| (BlockId(id), b))
    }

    /// How many blocks the list holds.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn segment(&self, segment: SegmentId) -> &Segment<H> {
        &self.segments[segment.0]
    }

    /// A segment, `None` when it is not in the list.
    pub fn get_segment(&self, segment: SegmentId) -> Option<&Segment<H>> {
        self.segments.get(segment.0)
    }

    /// Every segment, in id order.
    pub fn segments(&self) -> impl Iterator<Item = (SegmentId, &Segment<H>)> + '_ {
        self.segments.iter().map(|(id, s)| (SegmentId(id), s))
    }

    /// The segment `block` lies in.
    pub fn segment_of(&self, block: BlockId) -> &Segment<H> {
        self.segment(self[block].segment)
    }

    /// The device address of a block.
    pub fn address(&self, block: BlockId) -> u64 {
        self.segment_of(block).address + self[block].offset
    }

    pub fn stream(&self, block: BlockId) -> DeviceStream {
        self.segment_of(block).stream
    }

    pub fn pool(&self, block: BlockId) -> PoolKind {
        self.segment_of(block).pool
    }

    /// The private pool of the segment `block` lies in.
    pub fn mem_pool(&self, block: BlockId) -> Option<MemPoolId> {
        self.segment_of(block).mem_pool
    }

    /// Hands the segment `block` lies in to `stream`.
    pub fn set_stream(&mut self, block: BlockId, stream: DeviceStream) {
        let segment = self[block].segment;
        self.segments[segment.0].stream = stream;
    }

    /// Hands the segment `block` lies in to `pool`.
    pub fn set_pool(&mut self, block: BlockId, pool: PoolKind) {
        let segment = self[block].segment;
        self.segments[segment.0].pool = pool;
    }

    /// Blocks of a segment in address order.
    pub fn segment_blocks(&self, segment: SegmentId) -> SegmentBlocks<'_, H> {
        SegmentBlocks {
            blocks: self,
            next: Some(self.segment(segment).first),
        }
    }

    /// Adds a segment tiled by one free block, which it returns.
    pub fn new_segment(&mut self, segment: NewSegment<H>, backing: Backing) -> BlockId {
        let NewSegment {
            address,
            size,
            stream,
            pool,
            handle,
            expandable,
            mem_pool,
        } = segment;
        let segment_id = SegmentId(self.segments.vacant_key());
        let first = BlockId(
            self.blocks
                .insert(Block::free(segment_id, 0, size, backing)),
        );
        let inserted = self.segments.insert(Segment {
            address,
            size,
            stream,
            pool,
            handle,
            expandable,
            mem_pool,
            first,
        });
        debug_assert_eq!(inserted, segment_id.0);
        first
    }

    /// Removes the segment that `block` tiles alone, with `block`, and returns the segment.
    pub fn remove_segment(&mut self, block: BlockId) -> Segment<H> {
        debug_assert!(
            !self[block].is_split(),
            "the block does not tile its segment"
        );
        let segment = self.blocks.remove(block.0).segment;
        self.segments.remove(segment.0)
    }

    /// Carves `size` bytes off the `end` of `block` (`size` less than its size) into a new
    /// free block backed as `backing`, linked in beside it, and returns the new block;
    /// `block` keeps the rest.
    pub fn split_off(&mut self, block: BlockId, end: End, size: u64, backing: Backing) -> BlockId {
        let b = &self[block];
        debug_assert!(
            size > 0 && size < b.size,
            "a split leaves both parts non-empty"
        );
        // The new block's memory was last freed when the block's was: another stream may use
        // it only behind the same fence (see the engine's `sharing`).
        let freed_at = b.freed_at;
        let (segment, offset) = match end {
            End::Front => (b.segment, b.offset),
            End::Back => (b.segment, b.offset + b.size - size),
        };
        let new = BlockId(
            self.blocks
                .insert(Block::free(segment, offset, size, backing)),
        );
        let b = &mut self[block];
        b.size -= size;
        let (prev, next) = match end {
            End::Front => {
                b.offset += size;
                let prev = b.prev.replace(new);
                (prev, Some(block))
            }
            End::Back => {
                let next = b.next.replace(new);
                (Some(block), next)
            }
        };
        let n = &mut self[new];
        n.prev = prev;
        n.next = next;
        n.freed_at = freed_at;
        match prev {
            Some(p) => self[p].next = Some(new),
            None => self.segments[segment.0].first = new,
        }
        if let Some(n) = next {
            self[n].prev = Some(new);
        }
        new
    }

    /// The neighbours of `block` that are free and backed as `backing`: those
    /// [`Blocks::merge`] may merge into it.
    pub fn free_neighbours(&self, block: BlockId, backing: Backing) -> Vec<BlockId> {
        let b = &self[block];
        [b.prev, b.next]
            .into_iter()
            .flatten()
            .filter(|&n| self[n].state == BlockState::Inactive && self[n].backing == backing)
            .collect()
    }

    /// Merges `neighbour`, just before or just after `block`, into `block` and drops it.
    pub fn merge(&mut self, block: BlockId, neighbour: BlockId) {
        let o = self.blocks.remove(neighbour.0);
        let segment = o.segment;
        let b = &mut self[block];
        b.size += o.size;
        if b.prev == Some(neighbour) {
            b.offset = o.offset;
            b.prev = o.prev;
            match o.prev {
                Some(prev) => self[prev].next = Some(block),
                None => self.segments[segment.0].first = block,
            }
        } else {
            debug_assert_eq!(
                b.next,
                Some(neighbour),
                "merging a block that is no neighbour"
            );
            b.next = o.next;
            if let Some(next) = o.next {
                self[next].prev = Some(block);
            }
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
        self.next = self.blocks[id].next;
        Some(id)
    }
}
