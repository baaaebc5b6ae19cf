//! Helpers shared by the engine tests: a small allocator over a simulated device, layouts,
//! and the invariant check the property test runs after every step.

use caching_alloc_engine::alloc::{
    AllocatorConfig, BlockState, CachingAllocator, MemoryStats, PoolKind, Snapshot, Stat, StatArray,
};
/// 1024 bytes.
pub const KIB: u64 = 1024;
/// 1024 KiB.
pub const MIB: u64 = 1024 * KIB;
pub use caching_alloc_engine::device::DeviceStream;
use caching_alloc_engine::device::sim::SimDevice;

pub const S0: DeviceStream = DeviceStream(0);
pub const S1: DeviceStream = DeviceStream(1);

/// An allocator over a simulated device of `capacity` bytes, configured by `config` under
/// PyTorch's rules (`segment_sizing:pytorch`, `pool_borrowing:false`,
/// `cross_stream_reuse:false`, `release_outgrown:false`) for each of the four keys
/// `config` does not name: the engine tests check PyTorch's layouts by number; `rounding.rs`,
/// `borrowing.rs`, `cross_stream.rs`, `outgrown.rs` and the property tests check the defaults
/// that differ.
pub fn allocator(capacity: u64, config: &str) -> (CachingAllocator<SimDevice>, SimDevice) {
    allocator_on(SimDevice::new(capacity), config)
}

/// [`allocator`] over a device made otherwise (one that can wait between streams, ...).
pub fn allocator_on(device: SimDevice, config: &str) -> (CachingAllocator<SimDevice>, SimDevice) {
    let mut items: Vec<&str> = config.split(',').filter(|item| !item.is_empty()).collect();
    for (key, pytorch) in [
        ("segment_sizing", "segment_sizing:pytorch"),
        ("pool_borrowing", "pool_borrowing:false"),
        ("cross_stream_reuse", "cross_stream_reuse:false"),
        ("release_outgrown", "release_outgrown:false"),
    ] {
        if !config.contains(key) {
            items.push(pytorch);
        }
    }
    let config = items.join(",");
    let config = AllocatorConfig::parse(&config).expect("test config parses");
    (
        CachingAllocator::new(device.clone(), config).unwrap(),
        device,
    )
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

/// Statistics as they were when cumulative amounts were last zeroed (allocator creation or
/// `reset_accumulated_memory_stats`): `allocated - freed` of each statistic is its change since.
#[derive(Clone, Debug, Default)]
pub struct Baseline {
    pub stats: MemoryStats,
    pub device_allocs: u64,
    pub device_frees: u64,
}

impl Baseline {
    /// The baseline now: call right after `reset_accumulated_memory_stats`.
    pub fn now(alloc: &CachingAllocator<SimDevice>, device: &SimDevice) -> Self {
        let counters = device.counters();
        Self {
            stats: alloc.stats(),
            device_allocs: counters.allocs,
            device_frees: counters.frees,
        }
    }
}

/// Checks everything that must hold between any two operations; panics with the reason.
/// Assumes cumulative statistics were never reset (see [`check_invariants_since`]).
pub fn check_invariants(alloc: &CachingAllocator<SimDevice>, device: &SimDevice) {
    check_invariants_since(alloc, device, &Baseline::default());
}

/// [`check_invariants`], with cumulative statistics counted from `baseline`.
pub fn check_invariants_since(
    alloc: &CachingAllocator<SimDevice>,
    device: &SimDevice,
    baseline: &Baseline,
) {
    self_check(alloc);
    check_snapshot_invariants(&alloc.snapshot(), device, baseline);
}

/// The engine's own check of its internal structures (`CachingAllocator::check_invariants`).
pub fn self_check(alloc: &CachingAllocator<SimDevice>) {
    if let Err(e) = alloc.check_invariants() {
        panic!("engine self-check: {e}");
    }
}

/// What [`check_invariants_since`] checks on a snapshot, without the engine's self-check.
pub fn check_snapshot_invariants(snapshot: &Snapshot, device: &SimDevice, baseline: &Baseline) {
    let stats = &snapshot.stats;
    check_tiling(snapshot);
    check_no_adjacent_free(snapshot);
    check_stats_match_recount(snapshot, stats);
    check_cumulative(stats, baseline, snapshot.config.expandable_segments);
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
        coalesce(device.mapped_runs(), &device.reserved_ranges()),
        "device maps exactly the allocator's expandable runs"
    );
    let counters = device.counters();
    assert_eq!(
        stats.num_device_alloc,
        counters.allocs - baseline.device_allocs,
        "num_device_alloc counts the device's allocations (and page maps)"
    );
    assert_eq!(
        stats.num_device_free,
        counters.frees - baseline.device_frees,
        "num_device_free counts the device's frees (and page unmaps)"
    );
}

/// Panics unless no two (address, size) spans overlap.
pub fn assert_disjoint(mut spans: Vec<(u64, u64)>) {
    spans.sort_unstable();
    for pair in spans.windows(2) {
        assert!(
            pair[0].0 + pair[0].1 <= pair[1].0,
            "live allocations overlap: {pair:?}"
        );
    }
}

/// Adjacent (address, size) runs of one reserved range joined into one. Two ranges may touch
/// in address space; their runs stay apart, as the snapshot shows them (one per segment).
pub fn coalesce(runs: Vec<(u64, u64)>, ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let range_of = |address: u64| {
        ranges
            .iter()
            .position(|&(base, size)| base <= address && address < base + size)
    };
    let mut joined: Vec<(u64, u64)> = Vec::new();
    for (address, size) in runs {
        match joined.last_mut() {
            Some((at, len)) if *at + *len == address && range_of(*at) == range_of(address) => {
                *len += size
            }
            _ => joined.push((address, size)),
        }
    }
    joined
}

/// `allocated - freed == current - current at the baseline` for every statistic, and
/// segments held == device allocations - device frees (without expandable segments: their
/// maps and unmaps need not pair up, and they hold no `segment`).
fn check_cumulative(stats: &MemoryStats, baseline: &Baseline, expandable: bool) {
    let arrays = |s: &MemoryStats| {
        [
            ("allocation", s.allocation),
            ("segment", s.segment),
            ("active", s.active),
            ("inactive_split", s.inactive_split),
            ("allocated_bytes", s.allocated_bytes),
            ("reserved_bytes", s.reserved_bytes),
            ("active_bytes", s.active_bytes),
            ("inactive_split_bytes", s.inactive_split_bytes),
            ("requested_bytes", s.requested_bytes),
        ]
    };
    let stats_of = |a: &StatArray| [a.all, a.small_pool, a.large_pool];
    let mut pairs: Vec<(String, Stat, Stat)> = Vec::new();
    for ((name, now), (_, then)) in arrays(stats).into_iter().zip(arrays(&baseline.stats)) {
        for (pool, (n, t)) in ["all", "small_pool", "large_pool"]
            .into_iter()
            .zip(stats_of(&now).into_iter().zip(stats_of(&then)))
        {
            pairs.push((format!("{name}.{pool}"), n, t));
        }
    }
    pairs.push((
        "oversize_allocations".into(),
        stats.oversize_allocations,
        baseline.stats.oversize_allocations,
    ));
    pairs.push((
        "oversize_segments".into(),
        stats.oversize_segments,
        baseline.stats.oversize_segments,
    ));
    for (name, now, then) in pairs {
        assert!(
            now.peak >= now.current,
            "{name}: peak below current {now:?}"
        );
        assert_eq!(
            now.allocated as i128 - now.freed as i128,
            now.current as i128 - then.current as i128,
            "{name}: allocated - freed is not the change of current since the baseline {now:?}"
        );
    }
    if !expandable {
        assert_eq!(
            stats.num_device_alloc as i128 - stats.num_device_free as i128,
            stats.segment.all.current as i128 - baseline.stats.segment.all.current as i128,
            "segments held == device allocations - device frees"
        );
    }
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
            match block.state {
                BlockState::Inactive => {
                    assert_eq!(block.requested_size, 0);
                    assert_eq!(block.allocation_id, None);
                }
                BlockState::ActiveAllocated => {
                    assert!(block.requested_size > 0 && block.requested_size <= block.size);
                    assert!(block.allocation_id.is_some());
                }
                BlockState::ActivePendingFree => {
                    assert!(block.requested_size <= block.size);
                }
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
            PoolKind::Small => segment.total_size <= 2 * MIB,
            PoolKind::Large => segment.total_size > MIB,
        };
        assert!(
            pool_ok,
            "segment size {} in pool {:?}",
            segment.total_size, segment.pool
        );
        let sum = |f: &dyn Fn(BlockState) -> bool| -> u64 {
            segment
                .blocks
                .iter()
                .filter(|b| f(b.state))
                .map(|b| b.size)
                .sum()
        };
        assert_eq!(
            segment.allocated_size,
            sum(&|s| s == BlockState::ActiveAllocated)
        );
        assert_eq!(segment.active_size, sum(&|s| s != BlockState::Inactive));
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
    let max_split = snapshot.config.max_split_size.unwrap_or(u64::MAX);
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
            "requested bytes {pool:?} (pending frees still count)"
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
    let oversize_allocations = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::ActiveAllocated && b.size >= max_split)
        .count() as u64;
    let oversize_segments = snapshot
        .segments
        .iter()
        .filter(|s| !s.is_expandable && s.total_size >= max_split)
        .count() as u64;
    assert_eq!(stats.oversize_allocations.current, oversize_allocations);
    assert_eq!(stats.oversize_segments.current, oversize_segments);
    for array in [
        &stats.allocation,
        &stats.segment,
        &stats.active,
        &stats.inactive_split,
        &stats.allocated_bytes,
        &stats.reserved_bytes,
        &stats.active_bytes,
        &stats.inactive_split_bytes,
        &stats.requested_bytes,
    ] {
        for stat in [array.all, array.small_pool, array.large_pool] {
            assert!(stat.peak >= stat.current, "peak below current: {stat:?}");
        }
        assert_eq!(
            array.all.current,
            array.small_pool.current + array.large_pool.current
        );
    }
}
