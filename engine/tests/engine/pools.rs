//! Private pools (PyTorch's `MemPool`): requests routed to a pool (`beginAllocateToPool` /
//! `get_pool`) take only its blocks and segments; `no_split` (`should_split` with
//! `no_split_pools`); `use_on_oom` (the end of `malloc`: `use_on_oom_pools` tried with
//! `get_free_block` before raising); a pool's own `empty_cache` (`emptyCache(mempool_id)`) and
//! statistics; a released pool (`releasePool`) returning its memory with its last block; and
//! random sequences over pools that keep every invariant.

use caching_alloc_engine::alloc::{AllocError, MemPoolOptions, MemPoolStats};
use proptest::prelude::*;

use crate::common::*;

/// Each segment's pool number (0: the allocator's own) and blocks, segments by address.
fn pooled_layout(
    alloc: &caching_alloc_engine::alloc::CachingAllocator<
        caching_alloc_engine::device::sim::SimDevice,
    >,
) -> Vec<(u64, Vec<(u64, caching_alloc_engine::alloc::BlockState)>)> {
    alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| {
            (
                s.mem_pool.unwrap_or(0),
                s.blocks.iter().map(|b| (b.size, b.state)).collect(),
            )
        })
        .collect()
}

const PLAIN: MemPoolOptions = MemPoolOptions {
    no_split: false,
    use_on_oom: false,
};

#[test]
fn a_pool_takes_its_own_segment_and_never_the_allocators_cached_blocks() {
    let (alloc, device) = allocator(64 * MIB, "");
    let outside = alloc.malloc(1000, S0).unwrap();
    alloc.free(outside).unwrap();
    let pool = alloc.create_pool(PLAIN).unwrap();
    assert_eq!(pool.get(), 1, "PyTorch's user pools count from (0, 1)");

    // get_pool: the pool's small list is empty, so a new 2 MiB segment of the pool, though
    // the allocator's own 2 MiB segment is wholly free.
    let a = alloc.malloc_in(pool, 1000, S0).unwrap();
    let b = alloc.malloc_in(pool, 4096, S0).unwrap();
    assert_eq!(
        b.address(),
        a.address() + 1024,
        "split inside the pool's segment"
    );
    let rest = 2 * MIB - 1024 - 4096;
    assert_eq!(
        pooled_layout(&alloc),
        vec![
            (0, vec![(2 * MIB, F)]),
            (1, vec![(1024, A), (4096, A), (rest, F)]),
        ]
    );
    // A request outside the pool takes the allocator's own free segment, never the pool's tail.
    let c = alloc.malloc(512, S0).unwrap();
    assert_eq!(
        pooled_layout(&alloc)[0],
        (0, vec![(512, A), (2 * MIB - 512, F)])
    );
    assert_eq!(
        alloc.pool_stats(pool).unwrap(),
        MemPoolStats {
            segments: 1,
            reserved_bytes: 2 * MIB,
            allocations: 2,
            allocated_bytes: 5120,
            active_bytes: 5120,
            requested_bytes: 5096,
            free_blocks: 1,
            largest_free_block: rest,
        }
    );
    // The device-wide statistics count both pools' memory.
    let stats = alloc.stats();
    assert_eq!(stats.segment.all.current, 2);
    assert_eq!(stats.reserved_bytes.all.current, 4 * MIB);
    assert_eq!(stats.allocated_bytes.all.current, 5120 + 512);

    // Merging stays inside the pool's segment.
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    assert_eq!(pooled_layout(&alloc)[1], (1, vec![(2 * MIB, F)]));
    alloc.free(c).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn two_pools_never_share_blocks() {
    let (alloc, device) = allocator(64 * MIB, "");
    let first = alloc.create_pool(PLAIN).unwrap();
    let second = alloc.create_pool(PLAIN).unwrap();
    let a = alloc.malloc_in(first, 3 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    // The first pool's 20 MiB segment is wholly free; the second pool still takes its own.
    let b = alloc.malloc_in(second, 3 * MIB, S0).unwrap();
    assert_eq!(
        pooled_layout(&alloc),
        vec![
            (1, vec![(20 * MIB, F)]),
            (2, vec![(3 * MIB, A), (17 * MIB, F)]),
        ]
    );
    assert_eq!(device.counters().allocs, 2);
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn no_split_gives_each_request_a_whole_block() {
    // PyTorch's `should_split` returns false for a block of a pool in `no_split_pools`.
    let (alloc, device) = allocator(64 * MIB, "");
    let pool = alloc
        .create_pool(MemPoolOptions {
            no_split: true,
            use_on_oom: false,
        })
        .unwrap();
    let a = alloc.malloc_in(pool, 1000, S0).unwrap();
    let b = alloc.malloc_in(pool, 1000, S0).unwrap();
    let c = alloc.malloc_in(pool, 3 * MIB, S0).unwrap();
    assert_eq!((a.size(), b.size(), c.size()), (2 * MIB, 2 * MIB, 20 * MIB));
    assert_eq!(
        pooled_layout(&alloc),
        vec![
            (1, vec![(2 * MIB, A)]),
            (1, vec![(2 * MIB, A)]),
            (1, vec![(20 * MIB, A)]),
        ]
    );
    assert_eq!(alloc.stats().allocated_bytes.all.current, 24 * MIB);
    // A freed block is reused whole by a request that fits it.
    alloc.free(c).unwrap();
    let d = alloc.malloc_in(pool, 5 * MIB, S0).unwrap();
    assert_eq!(d.size(), 20 * MIB);
    assert_eq!(device.counters().allocs, 3);
    for x in [a, b, d] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// A 4 MiB device: a use-on-OOM pool's free 2 MiB segment, and the allocator's own 2 MiB
/// segment filled by two 1 MiB blocks; a third 1 MiB request has no room.
fn full_device_with_a_free_pool_segment(
    use_on_oom: bool,
) -> (
    caching_alloc_engine::alloc::CachingAllocator<caching_alloc_engine::device::sim::SimDevice>,
    caching_alloc_engine::device::sim::SimDevice,
    Vec<caching_alloc_engine::alloc::Allocation<u64>>,
) {
    let (alloc, device) = allocator(4 * MIB, "");
    let pool = alloc
        .create_pool(MemPoolOptions {
            no_split: false,
            use_on_oom,
        })
        .unwrap();
    let p = alloc.malloc_in(pool, MIB, S0).unwrap();
    alloc.free(p).unwrap();
    let live = vec![
        alloc.malloc(MIB, S0).unwrap(),
        alloc.malloc(MIB, S0).unwrap(),
    ];
    (alloc, device, live)
}

#[test]
fn use_on_oom_serves_a_request_from_the_pools_free_block_before_raising() {
    let (alloc, device, live) = full_device_with_a_free_pool_segment(true);
    let c = alloc.malloc(MIB, S0).unwrap();
    // The cache flush came first (PyTorch's `release_cached_blocks` before the pools), and
    // freed nothing: the pool's segment is not the allocator's to flush.
    let stats = alloc.stats();
    assert_eq!((stats.num_alloc_retries, stats.num_ooms), (1, 0));
    assert_eq!(
        pooled_layout(&alloc),
        vec![(1, vec![(MIB, A), (MIB, F)]), (0, vec![(MIB, A), (MIB, A)]),],
        "the block is the pool's, split by its rules"
    );
    alloc.free(c).unwrap();
    for x in live {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn without_use_on_oom_the_same_request_is_out_of_memory() {
    let (alloc, device, live) = full_device_with_a_free_pool_segment(false);
    let err = alloc.malloc(MIB, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    assert_eq!(alloc.stats().num_ooms, 1);
    assert_eq!(pooled_layout(&alloc)[0], (1, vec![(2 * MIB, F)]));
    for x in live {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn a_pool_request_never_takes_another_pools_memory_on_oom() {
    // PyTorch: "if already trying to use a mempool, then just oom".
    let (alloc, device, live) = full_device_with_a_free_pool_segment(true);
    let other = alloc.create_pool(PLAIN).unwrap();
    let err = alloc.malloc_in(other, MIB, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    for x in live {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn empty_cache_leaves_pools_and_a_pools_empty_cache_returns_its_free_segments() {
    let (alloc, device) = allocator(64 * MIB, "");
    let pool = alloc.create_pool(PLAIN).unwrap();
    let kept = alloc.malloc_in(pool, 1000, S0).unwrap();
    let gone = alloc.malloc_in(pool, 3 * MIB, S0).unwrap();
    let outside = alloc.malloc(3 * MIB, S0).unwrap();
    alloc.free(gone).unwrap();
    alloc.free(outside).unwrap();

    assert_eq!(
        alloc.empty_cache().unwrap(),
        20 * MIB,
        "the allocator's own segment only"
    );
    assert_eq!(
        pooled_layout(&alloc),
        vec![
            (1, vec![(1024, A), (2 * MIB - 1024, F)]),
            (1, vec![(20 * MIB, F)]),
        ]
    );
    // emptyCache(mempool_id): the pool's wholly free segment; the split one stays.
    assert_eq!(alloc.pool_empty_cache(pool).unwrap(), 20 * MIB);
    assert_eq!(pooled_layout(&alloc).len(), 1);
    assert_eq!(alloc.pool_stats(pool).unwrap().reserved_bytes, 2 * MIB);
    alloc.free(kept).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn a_released_pool_returns_its_memory_when_its_last_block_is_freed() {
    let (alloc, device) = allocator(64 * MIB, "");
    let pool = alloc.create_pool(PLAIN).unwrap();
    let a = alloc.malloc_in(pool, 1000, S0).unwrap();
    let b = alloc.malloc_in(pool, 2000, S0).unwrap();
    let big = alloc.malloc_in(pool, 3 * MIB, S0).unwrap();
    alloc.free(big).unwrap();

    // releasePool: the wholly free 20 MiB segment goes back now; the 2 MiB one holds blocks.
    assert_eq!(alloc.release_pool(pool).unwrap(), 20 * MIB);
    assert!(alloc.pools().is_empty());
    let err = alloc.malloc_in(pool, 1000, S0).unwrap_err();
    assert_eq!(err, AllocError::UnknownPool { id: 1 });
    assert_eq!(
        alloc.pool_stats(pool).unwrap_err(),
        AllocError::UnknownPool { id: 1 }
    );
    check_invariants(&alloc, &device);

    alloc.free(a).unwrap();
    assert_eq!(pooled_layout(&alloc).len(), 1, "b still holds the segment");
    let frees = device.counters().frees;
    alloc.free(b).unwrap();
    assert_eq!(
        device.counters().frees,
        frees + 1,
        "its last block took the segment back"
    );
    assert!(pooled_layout(&alloc).is_empty());
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    // Releasing twice is an error, not a panic.
    assert_eq!(
        alloc.release_pool(pool).unwrap_err(),
        AllocError::UnknownPool { id: 1 }
    );
    check_invariants(&alloc, &device);
}

#[test]
fn a_pool_of_another_allocator_is_refused() {
    let (alloc, device) = allocator(64 * MIB, "");
    let (other, _) = allocator(64 * MIB, "");
    other.create_pool(PLAIN).unwrap();
    let theirs = other.create_pool(PLAIN).unwrap();
    let err = alloc.malloc_in(theirs, 1000, S0).unwrap_err();
    assert_eq!(err, AllocError::UnknownPool { id: 2 });
    assert_eq!(alloc.pool_empty_cache(theirs).unwrap_err(), err);
    assert_eq!(alloc.stats().num_ooms, 0);
    check_invariants(&alloc, &device);
}

#[test]
fn a_pools_snapshot_holds_its_segments_only() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let pool = alloc.create_pool(PLAIN).unwrap();
    let _outside = alloc.malloc(1000, S0).unwrap();
    let inside = alloc.malloc_in(pool, 1000, S0).unwrap();
    let snapshot = alloc.pool_snapshot(pool).unwrap();
    assert_eq!(snapshot.segments.len(), 1);
    assert_eq!(snapshot.segments[0].mem_pool, Some(1));
    assert_eq!(snapshot.segments[0].address, inside.address());
    assert_eq!(alloc.snapshot().segments.len(), 2);
}

#[test]
fn a_pending_free_in_a_pool_waits_for_its_stream() {
    let (alloc, device) = allocator(64 * MIB, "");
    let pool = alloc.create_pool(PLAIN).unwrap();
    let a = alloc.malloc_in(pool, 1000, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        pooled_layout(&alloc),
        vec![(1, vec![(1024, P), (2 * MIB - 1024, F)])]
    );
    assert_eq!(alloc.pool_stats(pool).unwrap().active_bytes, 1024);
    device.complete_events(S1);
    let _b = alloc.malloc_in(pool, 1000, S0).unwrap();
    assert_eq!(
        pooled_layout(&alloc),
        vec![(1, vec![(1024, A), (2 * MIB - 1024, F)])]
    );
    check_invariants(&alloc, &device);
}

#[derive(Clone, Debug)]
enum Op {
    /// A request in pool `0` (the allocator's own), 1 (plain), 2 (no_split) or 3 (use_on_oom).
    Malloc {
        pool: usize,
        size: u64,
    },
    Free {
        index: usize,
    },
    EmptyCache,
    PoolEmptyCache {
        pool: usize,
    },
    Release {
        pool: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let size =
        prop_oneof![4 => 1u64..=MIB, 3 => (MIB + 1)..=(12 * MIB), 1 => (12 * MIB)..=(40 * MIB)];
    prop_oneof![
        10 => (0usize..4, size).prop_map(|(pool, size)| Op::Malloc { pool, size }),
        8 => any::<usize>().prop_map(|index| Op::Free { index }),
        1 => Just(Op::EmptyCache),
        1 => (1usize..4).prop_map(|pool| Op::PoolEmptyCache { pool }),
        1 => (1usize..4).prop_map(|pool| Op::Release { pool }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random requests, frees and releases over the allocator's pools and three private ones
    /// on a 128 MiB device: after every step the engine's self-check and the snapshot's
    /// invariants hold, each live pool's statistics match its segments in the snapshot, and a
    /// released pool's memory is gone once its blocks are.
    #[test]
    fn every_step_keeps_the_invariants_with_pools(ops in prop::collection::vec(op(), 1..150)) {
        let (alloc, device) = allocator(128 * MIB, "");
        let options = [
            PLAIN,
            MemPoolOptions { no_split: true, use_on_oom: false },
            MemPoolOptions { no_split: false, use_on_oom: true },
        ];
        let pools: Vec<_> = options.iter().map(|o| alloc.create_pool(*o).unwrap()).collect();
        let mut released = [false; 3];
        let mut live = Vec::new();
        for op in ops {
            match op {
                Op::Malloc { pool, size } => {
                    let result = if pool == 0 {
                        alloc.malloc(size, S0)
                    } else {
                        alloc.malloc_in(pools[pool - 1], size, S0)
                    };
                    match result {
                        Ok(a) => live.push(a),
                        Err(AllocError::OutOfMemory { .. }) => {}
                        Err(AllocError::UnknownPool { .. }) => prop_assert!(released[pool - 1]),
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Free { index } if !live.is_empty() => {
                    let a = live.swap_remove(index % live.len());
                    alloc.free(a).unwrap();
                }
                Op::Free { .. } => {}
                Op::EmptyCache => {
                    alloc.empty_cache().unwrap();
                }
                Op::PoolEmptyCache { pool } => {
                    let result = alloc.pool_empty_cache(pools[pool - 1]);
                    prop_assert_eq!(result.is_err(), released[pool - 1]);
                }
                Op::Release { pool } => {
                    let result = alloc.release_pool(pools[pool - 1]);
                    prop_assert_eq!(result.is_err(), released[pool - 1]);
                    released[pool - 1] = true;
                }
            }
            check_invariants(&alloc, &device);
            let snapshot = alloc.snapshot();
            for (i, pool) in pools.iter().enumerate() {
                let segments: Vec<_> = snapshot
                    .segments
                    .iter()
                    .filter(|s| s.mem_pool == Some(pool.get()))
                    .collect();
                if released[i] {
                    prop_assert!(segments.iter().all(|s| s.active_size > 0));
                    continue;
                }
                let stats = alloc.pool_stats(*pool).unwrap();
                prop_assert_eq!(stats.segments, segments.len() as u64);
                prop_assert_eq!(stats.reserved_bytes, segments.iter().map(|s| s.total_size).sum::<u64>());
                prop_assert_eq!(stats.allocated_bytes, segments.iter().map(|s| s.allocated_size).sum::<u64>());
                if options[i].no_split {
                    prop_assert!(segments.iter().all(|s| s.blocks.len() == 1));
                }
            }
        }
        for a in live {
            alloc.free(a).unwrap();
        }
        for (i, pool) in pools.iter().enumerate() {
            if !released[i] {
                alloc.release_pool(*pool).unwrap();
            }
        }
        alloc.empty_cache().unwrap();
        prop_assert!(device.live_segments().is_empty(), "every pool's memory went back");
        check_invariants(&alloc, &device);
    }
}

#[test]
fn under_expandable_segments_a_pool_takes_ordinary_segments() {
    // The pool's requests get segments of their own, never pages of the allocator's
    // expandable range (which its own requests share).
    let (alloc, device) = allocator(256 * MIB, "expandable_segments:True");
    let pool = alloc.create_pool(PLAIN).unwrap();
    let outside = alloc.malloc(3 * MIB, S0).unwrap();
    let inside = alloc.malloc_in(pool, 3 * MIB, S0).unwrap();
    let kinds: Vec<(Option<u64>, bool)> = alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| (s.mem_pool, s.is_expandable))
        .collect();
    assert!(kinds.contains(&(None, true)), "{kinds:?}");
    assert!(kinds.contains(&(Some(1), false)), "{kinds:?}");
    assert_eq!(alloc.pool_stats(pool).unwrap().reserved_bytes, 20 * MIB);
    alloc.free(inside).unwrap();
    alloc.free(outside).unwrap();
    assert_eq!(alloc.pool_empty_cache(pool).unwrap(), 20 * MIB);
    check_invariants(&alloc, &device);
}
