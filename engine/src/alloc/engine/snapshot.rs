//! The engine's state as a [`Snapshot`]: every segment and block, the statistics, the
//! configuration and the history; and what is live, for a recorder that starts now.

use super::Engine;
use crate::alloc::block::{BlockId, BlockState, Segment};
use crate::alloc::history::{BlockSnapshot, Live, SegmentSnapshot, Snapshot};
use crate::device::DeviceMemory;

impl<D: DeviceMemory> Engine<D> {
    /// Every mapped run of blocks, segment by segment. An ordinary segment is one run; an
    /// expandable one has a run per mapped stretch (PyTorch's `snapshot` reports one segment
    /// per contiguous mapped range), and the history knows its segments by these runs too.
    fn mapped_runs(&self) -> Vec<(&Segment<D::Handle>, Vec<BlockId>)> {
        let mut runs = Vec::new();
        for (id, segment) in self.blocks.segments() {
            let mut run = Vec::new();
            for b in self.blocks.segment_blocks(id) {
                if self.blocks[b].is_mapped() {
                    run.push(b);
                } else if !run.is_empty() {
                    runs.push((segment, std::mem::take(&mut run)));
                }
            }
            if !run.is_empty() {
                runs.push((segment, run));
            }
        }
        runs
    }

    /// What is live now, for a recorder that starts now: every private pool that can still be
    /// routed to, every mapped run and every allocated or pending-free block.
    pub(super) fn live_now(&self) -> Vec<Live> {
        let mut live: Vec<Live> = self
            .pools()
            .into_iter()
            .map(|(id, options)| Live::Pool {
                pool: id.get(),
                no_split: options.no_split,
                use_on_oom: options.use_on_oom,
            })
            .collect();
        for (segment, run) in self.mapped_runs() {
            let stream = segment.stream.0;
            live.push(Live::Segment {
                address: segment.address + self.blocks[run[0]].offset(),
                stream,
            });
            for block in run.iter().map(|b| &self.blocks[*b]) {
                if block.state != BlockState::Inactive {
                    live.push(Live::Block {
                        id: block.allocation_id,
                        address: segment.address + block.offset(),
                        requested: block.requested,
                        size: block.size(),
                        stream,
                    });
                }
            }
        }
        live
    }

    pub fn snapshot(&self) -> Snapshot {
        let history = self.history.as_ref();
        let mut segments: Vec<SegmentSnapshot> = self
            .mapped_runs()
            .into_iter()
            .map(|(segment, run)| {
                let blocks = run
                    .iter()
                    .map(|b| {
                        let block = &self.blocks[*b];
                        BlockSnapshot {
                            address: segment.address + block.offset(),
                            size: block.size(),
                            requested_size: block.requested,
                            state: block.state,
                            allocation_id: (block.state == BlockState::ActiveAllocated)
                                .then_some(block.allocation_id),
                            scope: block.tag.as_ref().map(|tag| tag.name().to_owned()),
                            stack: (block.state != BlockState::Inactive)
                                .then(|| history.and_then(|h| h.block_stack(block.allocation_id)))
                                .flatten(),
                        }
                    })
                    .collect();
                let mut snapshot = segment_snapshot(segment, blocks);
                snapshot.stack = history.and_then(|h| h.segment_stack(snapshot.address));
                snapshot
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        Snapshot {
            segments,
            stats: self.stats.clone(),
            config: self.config.clone(),
            trace: history.map(|h| h.to_trace()),
            history: self.history_entries(),
            phases: history.map(|h| h.phases()).unwrap_or_default(),
        }
    }
}

/// One run of blocks of `segment` as a snapshot segment.
fn segment_snapshot<H>(segment: &Segment<H>, blocks: Vec<BlockSnapshot>) -> SegmentSnapshot {
    let mut snapshot = SegmentSnapshot {
        address: blocks[0].address,
        total_size: 0,
        allocated_size: 0,
        active_size: 0,
        requested_size: 0,
        stream: segment.stream.0,
        pool: segment.pool,
        is_expandable: segment.expandable,
        mem_pool: segment.mem_pool.map(|id| id.get()),
        blocks,
        stack: None,
    };
    sum_blocks(&mut snapshot);
    snapshot
}

/// Sets a snapshot segment's sizes from its blocks (all, allocated, active, requested).
pub(super) fn sum_blocks(segment: &mut SegmentSnapshot) {
    let blocks = &segment.blocks;
    let sum = |f: &dyn Fn(&BlockSnapshot) -> bool| -> u64 {
        blocks.iter().filter(|b| f(b)).map(|b| b.size).sum()
    };
    segment.total_size = sum(&|_| true);
    segment.allocated_size = sum(&|b| b.state == BlockState::ActiveAllocated);
    segment.active_size = sum(&|b| b.state != BlockState::Inactive);
    segment.requested_size = blocks.iter().map(|b| b.requested_size).sum();
}
