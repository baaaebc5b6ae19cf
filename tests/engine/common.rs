//! Helpers shared by the engine tests: a small allocator over a simulated device, layouts,
//! and the invariant check the property test runs after every step.

use burn_caching_alloc::alloc::{
    AllocatorConfig, BlockState, CachingAllocator, MemoryStats, PoolKind, Snapshot, StatArray,
};
pub use burn_caching_alloc::alloc::{KIB, MIB};
pub use burn_caching_alloc::device::StreamId;
use burn_caching_alloc::device::sim::SimDevice;

pub const S0: StreamId = StreamId(0);
pub const S1: StreamId = StreamId(1);

pub fn allocator(capacity: u64, config: &str) -> (CachingAllocator<SimDevice>, SimDevice) {
    let device = SimDevice::new(capacity);
    let config = AllocatorConfig::parse(config).expect("test config parses");
    (CachingAllocator::new(device.clone(), config), device)
}

/// Each segment's blocks as (size, state), segments by address.
pub fn layout(alloc: &CachingAllocator<SimDevice>) -> Vec<Vec<(u64, BlockState)>> {
    alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| s.blocks.iter().map(|b| (b.size, b.state)).collect())
        .collect()
}

pub const A: BlockState = BlockState::ActiveAllocated;
pub const P: BlockState = BlockState::ActivePendingFree;
pub const F: BlockState = BlockState::Inactive;

/// Checks everything that must hold between any two operations; panics with the reason.
pub fn check_invariants(alloc: &CachingAllocator<SimDevice>, device: &SimDevice) {
    let snapshot = alloc.snapshot();
    let stats = &snapshot.stats;
    check_tiling(&snapshot);
    check_no_adjacent_free(&snapshot);
    check_stats_match_recount(&snapshot, stats);
    let device_segments = device.live_segments();
    let ours: Vec<(u64, u64)> = snapshot
        .segments
        .iter()
        .map(|s| (s.address, s.total_size))
        .collect();
    assert_eq!(
        ours, device_segments,
        "device holds exactly the allocator's segments"
    );
}

fn check_tiling(snapshot: &Snapshot) {
    for segment in &snapshot.segments {
        let mut cursor = segment.address;
        for block in &segment.blocks {
            assert_eq!(
                block.address, cursor,
                "blocks tile the segment without gaps"
            );
            assert!(
                block.size >= 512 && block.size % 512 == 0,
                "block size {}",
                block.size
            );
            if block.state == BlockState::Inactive {
                assert_eq!(block.requested_size, 0);
            } else {
                assert!(block.requested_size <= block.size);
            }
            cursor += block.size;
        }
        assert_eq!(
            cursor,
            segment.address + segment.total_size,
            "blocks cover the segment"
        );
        let pool_ok = match segment.pool {
            PoolKind::Small => segment.total_size == 2 * MIB,
            PoolKind::Large => segment.total_size > MIB,
        };
        assert!(
            pool_ok,
            "segment size {} in pool {:?}",
            segment.total_size, segment.pool
        );
    }
}

fn check_no_adjacent_free(snapshot: &Snapshot) {
    for segment in &snapshot.segments {
        for pair in segment.blocks.windows(2) {
            assert!(
                !(pair[0].state == BlockState::Inactive && pair[1].state == BlockState::Inactive),
                "two free neighbours were not merged in segment {:#x}",
                segment.address
            );
        }
    }
}

fn check_stats_match_recount(snapshot: &Snapshot, stats: &MemoryStats) {
    for pool in [None, Some(PoolKind::Small), Some(PoolKind::Large)] {
        let segments: Vec<_> = snapshot
            .segments
            .iter()
            .filter(|s| pool.is_none_or(|p| s.pool == p))
            .collect();
        let blocks = || {
            segments
                .iter()
                .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
        };
        let count = |f: &dyn Fn(BlockState, bool) -> bool| -> (u64, u64) {
            blocks()
                .filter(|(s, b)| f(b.state, s.blocks.len() > 1))
                .fold((0, 0), |(n, bytes), (_, b)| (n + 1, bytes + b.size))
        };
        let pick = |array: &StatArray| match pool {
            None => array.all.current,
            Some(PoolKind::Small) => array.small_pool.current,
            Some(PoolKind::Large) => array.large_pool.current,
        };
        let allocated = count(&|s, _| s == BlockState::ActiveAllocated);
        let active = count(&|s, _| s != BlockState::Inactive);
        let inactive_split = count(&|s, split| s == BlockState::Inactive && split);
        // Requested bytes drop when a free completes (PyTorch's `free_block`): pending
        // frees still count.
        let requested: u64 = blocks()
            .filter(|(_, b)| b.state != BlockState::Inactive)
            .map(|(_, b)| b.requested_size)
            .sum();
        let reserved: u64 = segments.iter().map(|s| s.total_size).sum();
        assert_eq!(
            pick(&stats.allocation),
            allocated.0,
            "allocation count {pool:?}"
        );
        assert_eq!(
            pick(&stats.allocated_bytes),
            allocated.1,
            "allocated bytes {pool:?}"
        );
        assert_eq!(pick(&stats.active), active.0, "active count {pool:?}");
        assert_eq!(pick(&stats.active_bytes), active.1, "active bytes {pool:?}");
        assert_eq!(
            pick(&stats.inactive_split),
            inactive_split.0,
            "inactive split {pool:?}"
        );
        assert_eq!(
            pick(&stats.inactive_split_bytes),
            inactive_split.1,
            "inactive split bytes {pool:?}"
        );
        assert_eq!(
            pick(&stats.requested_bytes),
            requested,
            "requested bytes {pool:?}"
        );
        assert_eq!(
            pick(&stats.segment),
            segments.len() as u64,
            "segments {pool:?}"
        );
        assert_eq!(
            pick(&stats.reserved_bytes),
            reserved,
            "reserved bytes {pool:?}"
        );
    }
    for array in [
        &stats.allocated_bytes,
        &stats.reserved_bytes,
        &stats.segment,
    ] {
        assert!(array.all.peak >= array.all.current);
        assert_eq!(
            array.all.current,
            array.small_pool.current + array.large_pool.current
        );
    }
}
