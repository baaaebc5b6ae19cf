//! The engine's state as a [`Snapshot`]: every segment and block, the statistics, the
//! configuration and the trace.

use super::Engine;
use crate::alloc::block::{BlockState, Segment};
use crate::alloc::snapshot::{BlockSnapshot, SegmentSnapshot, Snapshot};
use crate::device::DeviceMemory;

impl<D: DeviceMemory> Engine<D> {
    pub fn snapshot(&self) -> Snapshot {
        let history = self.history.as_ref();
        let mut segments = Vec::new();
        let push = |segments: &mut Vec<SegmentSnapshot>, segment, run: Vec<BlockSnapshot>| {
            let mut snapshot = segment_snapshot(segment, run);
            snapshot.stack = history.and_then(|h| h.segment_stack(snapshot.address));
            segments.push(snapshot);
        };
        for (id, segment) in self.blocks.segments() {
            // An ordinary segment is one run; an expandable one has a run per mapped stretch
            // (PyTorch's `snapshot` reports one segment per contiguous mapped range).
            let mut run: Vec<BlockSnapshot> = Vec::new();
            for b in self.blocks.segment_blocks(id) {
                let block = &self.blocks[b];
                if !block.is_mapped() {
                    if !run.is_empty() {
                        push(&mut segments, segment, std::mem::take(&mut run));
                    }
                    continue;
                }
                run.push(BlockSnapshot {
                    address: segment.address + block.offset(),
                    size: block.size(),
                    requested_size: block.requested,
                    state: block.state,
                    allocation_id: (block.state == BlockState::ActiveAllocated)
                        .then_some(block.allocation_id),
                    stack: (block.state != BlockState::Inactive)
                        .then(|| history.and_then(|h| h.block_stack(block.allocation_id)))
                        .flatten(),
                });
            }
            if !run.is_empty() {
                push(&mut segments, segment, run);
            }
        }
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

/// One run of blocks of `segment` as a snapshot segment.
fn segment_snapshot<H>(segment: &Segment<H>, blocks: Vec<BlockSnapshot>) -> SegmentSnapshot {
    let sum = |f: &dyn Fn(&BlockSnapshot) -> bool| -> u64 {
        blocks.iter().filter(|b| f(b)).map(|b| b.size).sum()
    };
    SegmentSnapshot {
        address: blocks[0].address,
        total_size: sum(&|_| true),
        allocated_size: sum(&|b| b.state == BlockState::ActiveAllocated),
        active_size: sum(&|b| b.state != BlockState::Inactive),
        requested_size: blocks.iter().map(|b| b.requested_size).sum(),
        stream: segment.stream.0,
        pool: segment.pool,
        is_expandable: segment.expandable,
        blocks,
        stack: None,
    }
}
