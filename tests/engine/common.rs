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
    let runs = |expandable: bool| -> Vec<(u64, u64)> {
        snapshot
            .segments
            .iter()
            .filter(|s| s.is_expandable == expandable)
            .map(|s| (s.address, s.total_size))
            .collect()
    };
    assert_eq!(
        runs(false),
        device.live_segments(),
        "device holds exactly the allocator's segments"
    );
    assert_eq!(
        runs(true),
        coalesce(device.mapped_runs()),
        "device maps exactly the allocator's expandable runs"
    );
}

/// Adjacent (address, size) runs joined into one.
pub fn coalesce(runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut joined: Vec<(u64, u64)> = Vec::new();
    for (address, size) in runs {
        match joined.last_mut() {
            Some((at, len)) if *at + *len == address => *len += size,
            _ => joined.push((address, size)),
        }
    }
    joined
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
            // An expandable run maps whole 2 MiB pages in the small pool.
            PoolKind::Small if segment.is_expandable => segment.total_size % (2 * MIB) == 0,
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
        // Expandable runs count neither in `segment` nor in `inactive_split` (PyTorch's
        // `map_block` and `free_block` leave them out).
        let ordinary = || blocks().filter(|(s, _)| !s.is_expandable);
        let inactive_split = ordinary()
            .filter(|(s, b)| b.state == BlockState::Inactive && s.blocks.len() > 1)
            .fold((0, 0), |(n, bytes), (_, b)| (n + 1, bytes + b.size));
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
            segments.iter().filter(|s| !s.is_expandable).count() as u64,
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
