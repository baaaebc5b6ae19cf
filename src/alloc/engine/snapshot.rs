//! The engine's state as a [`Snapshot`]: every segment and block, the statistics, the
//! configuration and the trace.

use super::Engine;
use crate::alloc::block::BlockState;
use crate::alloc::snapshot::{BlockSnapshot, SegmentSnapshot, Snapshot};
use crate::device::DeviceMemory;

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
                            stack: (block.state != BlockState::Inactive)
                                .then(|| {
                                    self.history
                                        .as_ref()
                                        .and_then(|h| h.block_stack(block.allocation_id))
                                })
                                .flatten(),
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
                    stack: self
                        .history
                        .as_ref()
                        .and_then(|h| h.segment_stack(segment.address)),
                }
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        Snapshot {
            segments,
            stats: self.stats.clone(),
            config: self.config.clone(),
            trace: self.history.as_ref().map(|h| h.to_trace()),
            history: self.history_entries(),
        }
    }
}
