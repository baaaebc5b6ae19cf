//! A serialisable picture of every segment and block, like `torch.cuda.memory_snapshot()`.

use serde::{Deserialize, Serialize};

use super::entry::{HistoryEntry, PhaseMark};
use super::trace::Trace;
use crate::alloc::block::BlockState;
use crate::alloc::config::AllocatorConfig;
use crate::alloc::size::PoolKind;
use crate::alloc::stack::Stack;
use crate::alloc::stats::MemoryStats;

/// One block of a segment, like an entry of a segment's `blocks` in `torch.cuda.memory_snapshot()`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct BlockSnapshot {
    /// The block's address.
    pub address: u64,
    /// The block's size, in bytes.
    pub size: u64,
    /// What the owner asked for; 0 for a free block.
    pub requested_size: u64,
    /// Whether the block is allocated, pending free or free (PyTorch's `state`).
    pub state: BlockState,
    /// The allocation id of an allocated block.
    pub allocation_id: Option<u64>,
    /// The memory scope an allocated block was made in (`alloc::Tag`), if any.
    #[serde(default)]
    pub scope: Option<String>,
    /// Where an allocated or pending block was allocated, when stacks are recorded (not in
    /// the JSON; PyTorch-format snapshots carry it resolved).
    #[serde(skip)]
    pub stack: Option<Stack>,
}

/// One device segment, like an entry of `torch.cuda.memory_snapshot()`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SegmentSnapshot {
    /// The segment's address.
    pub address: u64,
    /// The segment's size, in bytes.
    pub total_size: u64,
    /// Bytes in allocated blocks.
    pub allocated_size: u64,
    /// Bytes in allocated and pending-free blocks.
    pub active_size: u64,
    /// Bytes the owners of its blocks asked for (before rounding).
    pub requested_size: u64,
    /// The stream the segment belongs to.
    pub stream: u64,
    /// The pool the segment belongs to (PyTorch's `segment_type`).
    pub pool: PoolKind,
    /// The segment's blocks in address order; they tile it exactly.
    pub blocks: Vec<BlockSnapshot>,
    /// One contiguous mapped run of an expandable segment (PyTorch's `is_expandable`): an
    /// expandable segment shows as one such segment per run.
    #[serde(default)]
    pub is_expandable: bool,
    /// The private pool the segment belongs to, by number (PyTorch's `segment_pool_id`
    /// `(0, number)`); `None` for the allocator's own pools (`(0, 0)`).
    #[serde(default)]
    pub mem_pool: Option<u64>,
    /// Where the request that allocated the segment came from, when stacks are recorded.
    #[serde(skip)]
    pub stack: Option<Stack>,
}

/// Every segment and block, with the statistics, the configuration and the history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// Segments by address.
    pub segments: Vec<SegmentSnapshot>,
    /// The statistics, as in `torch.cuda.memory_stats()`.
    pub stats: MemoryStats,
    /// The configuration the allocator runs with.
    pub config: AllocatorConfig,
    /// The recorded events (the trace the replay reads), when a trace is recorded.
    ///
    /// `trace` and `history` are two views of one recording (the recorder's one ring, see
    /// [`record_memory_history`](crate::alloc::CachingAllocator::record_memory_history)), not
    /// two recordings: each event of `trace` that PyTorch has a name for is one entry of
    /// `history`. One file carries both so that the replay and the viewer read the same one.
    pub trace: Option<Trace>,
    /// The same events in PyTorch's terms (timestamps, addresses, stacks), oldest first.
    #[serde(default)]
    pub history: Vec<HistoryEntry>,
    /// The phases marked while the history was recorded, oldest first (PyTorch's
    /// `external_annotations`).
    #[serde(default)]
    pub phases: Vec<PhaseMark>,
}

impl Snapshot {
    /// The snapshot as indented JSON.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("a snapshot always serialises")
    }
}
