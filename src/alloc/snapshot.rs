//! A serialisable picture of every segment and block, like `torch.cuda.memory_snapshot()`.

use serde::{Deserialize, Serialize};

use super::block::BlockState;
use super::config::AllocatorConfig;
use super::engine::Engine;
use super::size::PoolKind;
use super::stats::MemoryStats;
use super::trace::Trace;
use crate::device::DeviceMemory;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockSnapshot {
    pub address: u64,
    pub size: u64,
    /// What the owner asked for; 0 for a free block.
    pub requested_size: u64,
    pub state: BlockState,
    /// The allocation id of an allocated block.
    pub allocation_id: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentSnapshot {
    pub address: u64,
    pub total_size: u64,
    /// Bytes in allocated blocks.
    pub allocated_size: u64,
    /// Bytes in allocated and pending-free blocks.
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: u64,
    pub pool: PoolKind,
    /// The segment's blocks in address order; they tile it exactly.
    pub blocks: Vec<BlockSnapshot>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Segments by address.
    pub segments: Vec<SegmentSnapshot>,
    pub stats: MemoryStats,
    pub config: AllocatorConfig,
    /// The trace ring, when history is recorded.
    pub trace: Option<Trace>,
}

impl Snapshot {
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("a snapshot always serialises")
    }
}

impl<D: DeviceMemory> Engine<D> {
    pub fn snapshot(&self) -> Snapshot {
        let mut segments: Vec<SegmentSnapshot> = self
            .blocks
            .segments
            .iter()
            .map(|(id, segment)| {
                let blocks: Vec<BlockSnapshot> = self
                    .blocks
                    .segment_blocks(id)
                    .map(|b| {
                        let block = &self.blocks.blocks[b];
                        BlockSnapshot {
                            address: segment.address + block.offset,
                            size: block.size,
                            requested_size: block.requested,
                            state: block.state,
                            allocation_id: (block.state == BlockState::ActiveAllocated)
                                .then_some(block.allocation_id),
                        }
                    })
                    .collect();
                let sum = |f: &dyn Fn(&BlockSnapshot) -> bool| -> u64 {
                    blocks.iter().filter(|b| f(b)).map(|b| b.size).sum()
                };
                SegmentSnapshot {
                    address: segment.address,
                    total_size: segment.size,
                    allocated_size: sum(&|b| b.state == BlockState::ActiveAllocated),
                    active_size: sum(&|b| b.state != BlockState::Inactive),
                    requested_size: blocks.iter().map(|b| b.requested_size).sum(),
                    stream: segment.stream.0,
                    pool: segment.pool,
                    blocks,
                }
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        Snapshot {
            segments,
            stats: self.stats.clone(),
            config: self.config.clone(),
            trace: self.history.as_ref().map(|h| h.to_trace()),
        }
    }
}
