//! `pool_borrowing:true` (the default): a miss that would allocate device memory first
//! borrows the other pool's free memory (`src/alloc/engine/borrowing.rs`).
//! `pool_borrowing:false` is PyTorch's rule: `DeviceCachingAllocator::malloc` searches the
//! request's own pool only (`get_free_block` on `get_pool(size, stream)`), then calls
//! `alloc_block`.

use caching_alloc_engine::alloc::{CachingAllocator, PoolKind};
use caching_alloc_engine::device::sim::SimDevice;

use crate::common::{A, F, KIB, MIB, S0, S1, allocator, check_invariants, layout};

const BORROWING: &str = "pool_borrowing:true,segment_sizing:grow";

/// (segments, reserved bytes, allocated bytes) of one pool.
fn pool(alloc: &CachingAllocator<SimDevice>, pool: PoolKind) -> (u64, u64, u64) {
    let stats = alloc.stats();
    (
        stats.segment.pool(pool).current,
        stats.reserved_bytes.pool(pool).current,
        stats.allocated_bytes.pool(pool).current,
    )
}

#[test]
fn a_large_request_of_at_most_2_mib_takes_a_small_free_block_in_place() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    let pinned = alloc.malloc(40 * KIB, S0).unwrap();
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    assert_eq!(large.address(), pinned.address() + 40 * KIB);
    // The small pool's split rule: the 472 KiB remainder stays free for small requests.
    assert_eq!(large.size(), 1536 * KIB);
    assert_eq!(
        layout(&alloc),
        vec![vec![(40 * KIB, A), (1536 * KIB, A), (472 * KIB, F)]]
    );
    assert_eq!(pool(&alloc, PoolKind::Small), (1, 2 * MIB, 1576 * KIB));
    assert_eq!(pool(&alloc, PoolKind::Large), (0, 0, 0));
    let stats = alloc.stats();
    assert_eq!(stats.num_pool_borrows, 1);
    assert_eq!((stats.num_device_alloc, device.counters().allocs), (1, 1));
    let small = alloc.malloc(400 * KIB, S0).unwrap();
    assert_eq!(
        small.address(),
        large.address() + 1536 * KIB,
        "the remainder"
    );
    check_invariants(&alloc, &device);
    // Freed, it merges back into its small segment.
    alloc.free(large).unwrap();
    alloc.free(small).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(40 * KIB, A), (2008 * KIB, F)]]);
    alloc.free(pinned).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(2 * MIB, F)]]);
    check_invariants(&alloc, &device);
}

#[test]
fn a_borrowing_large_request_takes_the_best_fitting_small_block() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    // Segment 1 wholly free (2 MiB), segment 2 with 1.6 MiB free after a live 400 KiB block.
    let x = alloc.malloc(MIB, S0).unwrap();
    let y = alloc.malloc(MIB, S0).unwrap();
    let z = alloc.malloc(400 * KIB, S0).unwrap();
    alloc.free(x).unwrap();
    alloc.free(y).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(2 * MIB, F)], vec![(400 * KIB, A), (1648 * KIB, F)]]
    );
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    assert_eq!(large.address(), z.address() + 400 * KIB);
    assert_eq!(
        layout(&alloc),
        vec![
            vec![(2 * MIB, F)],
            vec![(400 * KIB, A), (1536 * KIB, A), (112 * KIB, F)]
        ]
    );
    // The next one takes the wholly free segment, which stays in the small pool.
    let next = alloc.malloc(1536 * KIB, S0).unwrap();
    assert_eq!(pool(&alloc, PoolKind::Small).0, 2);
    assert_eq!(pool(&alloc, PoolKind::Large).0, 0);
    assert_eq!(alloc.stats().num_pool_borrows, 2);
    assert_eq!(device.counters().allocs, 2);
    for a in [z, large, next] {
        alloc.free(a).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn a_large_request_over_2_mib_never_borrows() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    let small = alloc.malloc(512 * KIB, S0).unwrap();
    alloc.free(small).unwrap();
    let large = alloc.malloc(2 * MIB + 512, S0).unwrap();
    assert_eq!(pool(&alloc, PoolKind::Small), (1, 2 * MIB, 0));
    assert_eq!(pool(&alloc, PoolKind::Large), (1, 4 * MIB, 2 * MIB + 512));
    assert_eq!(alloc.stats().num_pool_borrows, 0);
    assert_eq!(device.counters().allocs, 2);
    alloc.free(large).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn a_small_request_takes_an_empty_2_mib_large_segment_which_moves_to_the_small_pool() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    let address = large.address();
    alloc.free(large).unwrap();
    assert_eq!(pool(&alloc, PoolKind::Large), (1, 2 * MIB, 0));

    let small = alloc.malloc(100 * KIB, S0).unwrap();
    assert_eq!(small.address(), address);
    assert_eq!(
        layout(&alloc),
        vec![vec![(100 * KIB, A), (2 * MIB - 100 * KIB, F)]]
    );
    assert_eq!(alloc.snapshot().segments[0].pool, PoolKind::Small);
    assert_eq!(pool(&alloc, PoolKind::Large), (0, 0, 0));
    assert_eq!(pool(&alloc, PoolKind::Small), (1, 2 * MIB, 100 * KIB));
    let stats = alloc.stats();
    assert_eq!(stats.num_pool_borrows, 1);
    assert_eq!(device.counters().allocs, 1);
    // `all` counts device memory: a move neither allocates nor releases any.
    assert_eq!(
        (
            stats.segment.all.current,
            stats.segment.all.allocated,
            stats.segment.all.freed
        ),
        (1, 1, 0)
    );
    assert_eq!(
        (
            stats.reserved_bytes.large_pool.allocated,
            stats.reserved_bytes.large_pool.freed,
            stats.reserved_bytes.small_pool.allocated
        ),
        (2 * MIB, 2 * MIB, 2 * MIB)
    );
    // The small pool serves its next request from the rest of that segment.
    let next = alloc.malloc(200 * KIB, S0).unwrap();
    assert_eq!(next.address(), address + 100 * KIB);
    assert_eq!(alloc.stats().num_pool_borrows, 1);
    check_invariants(&alloc, &device);
    alloc.free(small).unwrap();
    alloc.free(next).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn a_small_request_never_takes_a_large_segment_over_2_mib_or_one_in_use() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    let used = alloc.malloc(1536 * KIB, S0).unwrap();
    let big = alloc.malloc(3 * MIB, S0).unwrap();
    alloc.free(big).unwrap();
    assert_eq!(
        pool(&alloc, PoolKind::Large),
        (2, 6 * MIB, 2 * MIB),
        "2 and 4 MiB"
    );

    let small = alloc.malloc(100 * KIB, S0).unwrap();
    assert_eq!(pool(&alloc, PoolKind::Large).0, 2, "both kept");
    assert_eq!(pool(&alloc, PoolKind::Small).0, 1, "a new segment");
    assert_eq!(alloc.stats().num_pool_borrows, 0);
    assert_eq!(device.counters().allocs, 3);
    alloc.free(small).unwrap();
    alloc.free(used).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn another_streams_free_memory_is_never_borrowed() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    let other = alloc.malloc(4 * KIB, S1).unwrap();
    alloc.free(other).unwrap();
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    assert_eq!(alloc.stats().num_pool_borrows, 0);
    assert_eq!(pool(&alloc, PoolKind::Large).0, 1, "a new segment");
    alloc.free(large).unwrap();
    let small = alloc.malloc(4 * KIB, S1).unwrap();
    assert_eq!(small.address(), alloc.snapshot().segments[0].address);
    // Stream 1's small request found its own segment; stream 0's 2 MiB large one stays.
    assert_eq!(alloc.stats().num_pool_borrows, 0);
    alloc.free(small).unwrap();
    assert_eq!(device.counters().allocs, 2);
    check_invariants(&alloc, &device);
}

#[test]
fn pytorchs_rule_allocates_new_memory_beside_the_other_pools_free_memory() {
    let (alloc, device) = allocator(64 * MIB, "pool_borrowing:false,segment_sizing:grow");
    let small = alloc.malloc(512 * KIB, S0).unwrap();
    alloc.free(small).unwrap();
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    alloc.free(large).unwrap();
    let small = alloc.malloc(4 * KIB, S0).unwrap();
    assert_eq!(pool(&alloc, PoolKind::Small), (1, 2 * MIB, 4 * KIB));
    assert_eq!(pool(&alloc, PoolKind::Large), (1, 2 * MIB, 0));
    assert_eq!(alloc.stats().num_pool_borrows, 0);
    assert_eq!(device.counters().allocs, 2);
    alloc.free(small).unwrap();
    check_invariants(&alloc, &device);
}

/// A cache-only request (`malloc_cached`: the runtime's first try, before it hands CubeCL's
/// free slices back to the engine) stays in its own pool: those slices may refill it, and a
/// borrow stands in for new memory, which is the growth step's.
#[test]
fn a_cache_only_request_does_not_borrow() {
    let (alloc, device) = allocator(64 * MIB, BORROWING);
    let small = alloc.malloc(512 * KIB, S0).unwrap();
    alloc.free(small).unwrap();
    assert!(alloc.malloc_cached(1536 * KIB, S0).unwrap().is_none());
    assert_eq!(alloc.stats().num_pool_borrows, 0);
    let large = alloc.malloc(1536 * KIB, S0).unwrap();
    assert_eq!(alloc.stats().num_pool_borrows, 1);
    alloc.free(large).unwrap();
    assert_eq!(alloc.empty_cache().unwrap(), 2 * MIB);
    assert_eq!(device.counters().frees, 1);
    check_invariants(&alloc, &device);
}
