//! The miss path in order: cache, garbage collection, device, free oversize, free all, OOM.

use crate::common::*;
use caching_alloc_engine::alloc::AllocError;

#[test]
fn a_failed_device_allocation_frees_unused_segments_and_retries_once() {
    let (alloc, device) = allocator(64 * MIB, "");
    // Cache one free 20 MiB segment and one free small segment, keep one live.
    let cached = alloc.malloc(5 * MIB, S0).unwrap();
    let small = alloc.malloc(4096, S0).unwrap();
    let live = alloc.malloc(30 * MIB, S0).unwrap();
    alloc.free(cached).unwrap();
    alloc.free(small).unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 52 * MIB);

    // 30 MiB more does not fit the 64 MiB device next to 52 MiB reserved.
    let again = alloc.malloc(30 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(
        stats.num_device_free, 2,
        "the cached 20 MiB and 2 MiB segments went back"
    );
    assert_eq!(stats.num_device_alloc, 4);
    assert_eq!(stats.memory_reserved(), 60 * MIB);
    assert_eq!(device.counters().failed_allocs, 1);
    alloc.free(live).unwrap();
    alloc.free(again).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn with_max_split_size_oversize_blocks_go_first_and_no_retry_is_counted() {
    let (alloc, _) = allocator(200 * MIB, "max_split_size_mb:32");
    let small_cached = alloc.malloc(5 * MIB, S0).unwrap();
    let oversize = alloc.malloc(100 * MIB, S0).unwrap();
    alloc.free(small_cached).unwrap();
    alloc.free(oversize).unwrap();
    // 120 reserved; 150 MiB does not fit next to it, and no cached block can serve it.
    // The oversize step frees the 100 MiB block (the largest oversize ones until 150 MiB
    // are freed or none is left: here only one), which is not enough, so the full flush runs.
    let x = alloc.malloc(150 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_device_free, 2);
    alloc.free(x).unwrap();

    // A cached 150 MiB oversize block and a live 20 MiB segment: 60 MiB does not fit next
    // to them, and freeing the one oversize block of at least 60 MiB is enough: no flush.
    let (alloc, device) = allocator(200 * MIB, "max_split_size_mb:32");
    let keep = alloc.malloc(5 * MIB, S0).unwrap();
    let a = alloc.malloc(150 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    let b = alloc.malloc(60 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 0, "the oversize step was enough");
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(stats.memory_reserved(), 80 * MIB);
    alloc.free(keep).unwrap();
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn out_of_memory_reports_the_numbers_and_leaves_the_pool_intact() {
    let (alloc, device) = allocator(64 * MIB, "");
    let live = alloc.malloc(40 * MIB, S0).unwrap();
    let err = alloc.malloc(30 * MIB, S0).unwrap_err();
    match &err {
        AllocError::OutOfMemory {
            requested,
            allocated,
            reserved_unallocated,
            device_free,
            device_total,
            limit,
            ..
        } => {
            assert_eq!(*requested, 30 * MIB);
            assert_eq!(*allocated, 40 * MIB);
            assert_eq!(*reserved_unallocated, 0);
            assert_eq!(*device_free, 24 * MIB);
            assert_eq!(*device_total, 64 * MIB);
            assert_eq!(*limit, None);
        }
        other => panic!("expected out-of-memory, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains("30.00 MiB"), "{message}");
    assert!(message.contains("40.00 MiB is allocated"), "{message}");
    let stats = alloc.stats();
    assert_eq!(stats.num_ooms, 1);
    assert_eq!(stats.num_alloc_retries, 1);
    // The allocator keeps working.
    let small = alloc.malloc(4 * MIB, S0).unwrap();
    alloc.free(small).unwrap();
    alloc.free(live).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn device_failures_are_retried_after_the_cache_is_freed() {
    let (alloc, device) = allocator(1024 * MIB, "");
    let cached = alloc.malloc(4096, S0).unwrap();
    alloc.free(cached).unwrap();
    device.fail_nth_allocation(1);
    let a = alloc.malloc(50 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(
        stats.num_device_free, 1,
        "the cached small segment was freed first"
    );
    assert_eq!(a.size(), 50 * MIB);
    check_invariants(&alloc, &device);
}

#[test]
fn memory_fraction_limits_reserved_memory_like_a_device_oom() {
    let (alloc, device) = allocator(100 * MIB, "");
    alloc.set_memory_fraction(0.5).unwrap();
    let a = alloc.malloc(40 * MIB, S0).unwrap();
    let err = alloc.malloc(20 * MIB, S0).unwrap_err();
    match err {
        AllocError::OutOfMemory { limit, .. } => assert_eq!(limit, Some(50 * MIB)),
        other => panic!("expected out-of-memory, got {other:?}"),
    }
    assert_eq!(
        device.counters().failed_allocs,
        0,
        "the device was never asked"
    );
    assert_eq!(alloc.stats().num_ooms, 1);
    // 8 MiB would take a 20 MiB segment: over the limit too. 10 MiB takes exactly 10 MiB.
    assert!(alloc.malloc(8 * MIB, S0).unwrap_err().is_out_of_memory());
    let b = alloc.malloc(10 * MIB, S0).unwrap();
    assert_eq!(
        alloc.stats().memory_reserved(),
        50 * MIB,
        "exactly at the limit"
    );
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        assert!(alloc.set_memory_fraction(bad).is_err(), "fraction {bad}");
    }
    assert!(alloc.set_memory_fraction(1.0).is_ok());
}

#[test]
fn empty_cache_keeps_segments_that_hold_a_live_block() {
    let (alloc, device) = allocator(256 * MIB, "");
    let live_small = alloc.malloc(4096, S0).unwrap();
    let free_small = alloc.malloc(4096, S1).unwrap();
    let live_large = alloc.malloc(3 * MIB, S0).unwrap();
    let free_large = alloc.malloc(30 * MIB, S0).unwrap();
    alloc.free(free_small).unwrap();
    alloc.free(free_large).unwrap();
    let released = alloc.empty_cache().unwrap();
    assert_eq!(released, 2 * MIB + 30 * MIB);
    let sizes: Vec<u64> = alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| s.total_size)
        .collect();
    assert_eq!(sizes, vec![2 * MIB, 20 * MIB]);
    assert_eq!(alloc.stats().memory_reserved(), 22 * MIB);
    alloc.free(live_small).unwrap();
    alloc.free(live_large).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 0);
    assert!(device.live_segments().is_empty());
}

/// PyTorch's `release_available_cached_blocks`: when the device is full, the smallest cached
/// oversize block of the stream that covers the request (at least `max_split_size`) goes back
/// alone; the larger one stays cached, and no full flush (retry) is counted.
#[test]
fn a_full_device_releases_the_smallest_oversize_block_that_covers_the_request() {
    let (alloc, device) = allocator(250 * MIB, "max_split_size_mb:32");
    let keep = alloc.malloc(5 * MIB, S0).unwrap();
    let sixty = alloc.malloc(60 * MIB, S0).unwrap();
    let big = alloc.malloc(150 * MIB, S0).unwrap();
    let big_address = big.address();
    alloc.free(sixty).unwrap();
    alloc.free(big).unwrap();
    // 33 MiB refuses both (each is at least 33 + 20 MiB) and needs a 34 MiB segment: 230 MiB
    // are reserved, 250 MiB is the device.
    let a = alloc.malloc(33 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        stats.num_alloc_retries, 0,
        "releasing one oversize block was enough"
    );
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(
        stats.memory_reserved(),
        (20 + 150 + 34) * MIB,
        "the 60 MiB block went back"
    );
    assert!(
        device
            .live_segments()
            .iter()
            .any(|&(address, _)| address == big_address)
    );
    alloc.free(a).unwrap();
    alloc.free(keep).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `release_available_cached_blocks`: when no single cached oversize block covers
/// the request, the largest ones go back, largest first, until together they cover it; the
/// rest stays cached and no full flush (retry) is counted.
#[test]
fn a_full_device_releases_the_largest_oversize_blocks_until_they_cover_the_request() {
    let (alloc, device) = allocator(200 * MIB, "max_split_size_mb:32");
    let keep = alloc.malloc(5 * MIB, S0).unwrap();
    let blocks: Vec<_> = [60, 50, 40]
        .into_iter()
        .map(|mib| alloc.malloc(mib * MIB, S0).unwrap())
        .collect();
    let forty = blocks[2].address();
    for b in blocks {
        alloc.free(b).unwrap();
    }
    // 85 MiB fits no cached block and needs an 86 MiB segment beside 170 MiB reserved:
    // 60 + 50 go back (110 MiB, enough), the 40 MiB block stays.
    let a = alloc.malloc(85 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        stats.num_alloc_retries, 0,
        "the oversize release was enough"
    );
    assert_eq!(stats.num_device_free, 2);
    assert_eq!(stats.memory_reserved(), (20 + 40 + 86) * MIB);
    assert!(
        device
            .live_segments()
            .iter()
            .any(|&(address, _)| address == forty)
    );
    alloc.free(a).unwrap();
    alloc.free(keep).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `setMemoryFraction`: a fraction of 1.0 sets no cap (the device's own memory is
/// the limit), so the out-of-memory error names no limit; a fraction below one names its cap.
#[test]
fn a_memory_fraction_of_one_sets_no_limit() {
    for (config, limit) in [
        ("per_process_memory_fraction:1.0", None),
        ("per_process_memory_fraction:0.75", Some(768 * MIB)),
    ] {
        let (alloc, _device) = allocator(1024 * MIB, config);
        let first = alloc.malloc(600 * MIB, S0).unwrap();
        match alloc.malloc(600 * MIB, S0) {
            Err(AllocError::OutOfMemory { limit: got, .. }) => assert_eq!(got, limit, "{config}"),
            other => panic!("{config}: expected out of memory, got {other:?}"),
        }
        alloc.free(first).unwrap();
    }
}

/// `has_exact_fit` (what the stack asks before a placement walk): whether the best fit for a
/// request is a cached block of exactly the request's rounded size, on the request's stream.
#[test]
fn has_exact_fit_is_a_cached_block_of_exactly_the_rounded_size_on_the_stream() {
    let (alloc, device) = allocator(1 << 30, "");
    let large = alloc.malloc(12 * MIB, S0).unwrap();
    assert!(!alloc.has_exact_fit(12 * MIB, S0), "nothing is cached");
    alloc.free(large).unwrap();
    assert!(alloc.has_exact_fit(12 * MIB, S0));
    assert!(alloc.has_exact_fit(12 * MIB - 100, S0), "rounds to 12 MiB");
    assert!(
        !alloc.has_exact_fit(11 * MIB, S0),
        "the 12 MiB block fits 11 MiB, not exactly"
    );
    assert!(!alloc.has_exact_fit(12 * MIB, S1), "another stream's block");

    // In the small pool: a free 1 KiB block between the segment's start and a live block.
    let first = alloc.malloc(KIB, S0).unwrap();
    let second = alloc.malloc(KIB, S0).unwrap();
    alloc.free(first).unwrap();
    assert!(alloc.has_exact_fit(1000, S0), "1000 B rounds to 1 KiB");
    assert!(!alloc.has_exact_fit(512, S0));
    alloc.free(second).unwrap();
    assert!(
        !alloc.has_exact_fit(KIB, S0),
        "coalesced back into the free 2 MiB segment"
    );
    check_invariants(&alloc, &device);
}
