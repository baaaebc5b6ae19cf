//! `no_cuda_memory_caching`, PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING` switch (read by
//! `forceUncachedAllocator()` in c10/cuda/CUDACachingAllocator.cpp, whose `allocate` then calls
//! `cudaMalloc` per request and whose `uncached_delete` calls `cudaFree`): every request is a
//! device allocation of its own, every free returns it once its stream's work is done, and
//! the statistics keep their meaning (which PyTorch's bypass does not keep: it counts nothing).

use caching_alloc_engine::alloc::{AllocError, AllocatorConfig, ConfigError};

use crate::common::*;

/// The engine tests' allocator (PyTorch's rules) with caching off.
fn uncached(
    capacity: u64,
) -> (
    caching_alloc_engine::alloc::CachingAllocator<caching_alloc_engine::device::sim::SimDevice>,
    caching_alloc_engine::device::sim::SimDevice,
) {
    allocator(capacity, "no_cuda_memory_caching:True")
}

#[test]
fn every_request_is_a_device_allocation_of_its_own_rounded_to_512_bytes_never_split() {
    let (alloc, device) = uncached(64 * MIB);
    let small = alloc.malloc(1000, S0).unwrap();
    let page = alloc.malloc(4096, S0).unwrap();
    let large = alloc.malloc(3 * MIB + 1, S0).unwrap();
    // Three segments, each exactly its block: no 2 MiB small segment, no 20 MiB large one.
    assert_eq!(
        layout(&alloc),
        vec![vec![(1024, A)], vec![(4096, A)], vec![(3 * MIB + 512, A)]]
    );
    assert_eq!(device.counters().allocs, 3);
    let stats = alloc.stats();
    assert_eq!(stats.segment.small_pool.current, 2);
    assert_eq!(stats.segment.large_pool.current, 1);
    assert_eq!(
        stats.reserved_bytes.all.current,
        1024 + 4096 + 3 * MIB + 512
    );
    assert_eq!(
        stats.allocated_bytes.all.current,
        stats.reserved_bytes.all.current
    );
    assert_eq!(stats.requested_bytes.all.current, 1000 + 4096 + 3 * MIB + 1);
    assert_eq!(stats.num_device_alloc, 3);
    assert_eq!(stats.inactive_split.all.current, 0);
    check_invariants(&alloc, &device);
    for a in [small, page, large] {
        alloc.free(a).unwrap();
    }
    device.complete_all_events();
    // The next request completes the frees: their segments went back, and it gets its own.
    let again = alloc.malloc(4096, S0).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(4096, A)]]);
    let counters = device.counters();
    assert_eq!((counters.allocs, counters.frees), (4, 3));
    assert_eq!(alloc.stats().num_device_free, 3);
    alloc.free(again).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn a_free_returns_its_allocation_only_once_its_streams_work_is_done() {
    let (alloc, device) = uncached(64 * MIB);
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.free(a).unwrap();
    // An event on the block's own stream; until it completed the block is active, not
    // allocated, and its segment reserved.
    assert_eq!(device.counters().events_recorded, 1);
    assert_eq!(layout(&alloc), vec![vec![(4096, P)]]);
    let stats = alloc.stats();
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(stats.active_bytes.all.current, 4096);
    assert_eq!(stats.reserved_bytes.all.current, 4096);
    assert_eq!(device.counters().frees, 0);

    // A request while the stream still runs: a new allocation, the pending one untouched.
    let b = alloc.malloc(4096, S0).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(4096, P)], vec![(4096, A)]]);
    assert_eq!((device.counters().allocs, device.counters().frees), (2, 0));
    check_invariants(&alloc, &device);

    device.complete_events(S0);
    // Polled at the next call: the segment goes back, nothing waited on the host.
    let c = alloc.malloc(512, S0).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(4096, A)], vec![(512, A)]]);
    let counters = device.counters();
    assert_eq!((counters.allocs, counters.frees), (3, 1));
    assert_eq!(counters.events_synchronized, 0);
    let stats = alloc.stats();
    assert_eq!(stats.reserved_bytes.all.current, 4096 + 512);
    // The pending block went back before the new one was allocated.
    assert_eq!(stats.reserved_bytes.all.peak, 2 * 4096);
    assert_eq!(stats.active_bytes.all.peak, 2 * 4096);
    assert_eq!(stats.segment.all.freed, 1);
    for x in [b, c] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn a_free_waits_for_every_stream_record_stream_named() {
    let (alloc, device) = uncached(64 * MIB);
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        device.counters().events_recorded,
        2,
        "its own stream and S1"
    );
    device.complete_events(S0);
    let b = alloc.malloc(512, S0).unwrap();
    assert_eq!(device.counters().frees, 0, "S1 may still read it");
    assert_eq!(layout(&alloc), vec![vec![(4096, P)], vec![(512, A)]]);
    device.complete_events(S1);
    // A free polls the events too: the first block's streams are both done.
    alloc.free(b).unwrap();
    assert_eq!(device.counters().frees, 1);
    assert_eq!(layout(&alloc), vec![vec![(512, P)]]);
    device.complete_events(S0);
    let _ = alloc.malloc(512, S0).unwrap();
    assert_eq!(device.counters().frees, 2);
    check_invariants(&alloc, &device);
}

#[test]
fn out_of_memory_waits_for_pending_frees_retries_once_and_then_reports() {
    let (alloc, device) = uncached(MIB);
    let a = alloc.malloc(768 * KIB, S0).unwrap();
    alloc.free(a).unwrap();
    // The device is full until the pending free completes: the retry waits for its event
    // (PyTorch's `synchronize_and_free_events`), returns it and allocates again.
    let b = alloc.malloc(768 * KIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(device.counters().events_synchronized, 1);
    assert_eq!(device.counters().frees, 1);
    // Nothing pending now: the next one is an out-of-memory, after one more retry.
    let err = alloc.malloc(768 * KIB, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    let stats = alloc.stats();
    assert_eq!((stats.num_alloc_retries, stats.num_ooms), (2, 1));
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn a_request_beyond_the_device_is_too_large_at_once() {
    let (alloc, device) = uncached(MIB);
    let err = alloc.malloc(MIB + 1, S0).unwrap_err();
    assert!(matches!(err, AllocError::TooLarge { .. }), "{err}");
    assert_eq!(device.counters().allocs, 0);
    assert_eq!(alloc.stats().num_ooms, 1);
    // The cache-only path finds nothing without asking the device.
    assert!(alloc.malloc_cached(4096, S0).unwrap().is_none());
    assert_eq!(device.counters().allocs, 0);
}

#[test]
fn empty_cache_and_drop_return_pending_frees_once_their_events_are_waited_for() {
    let (alloc, device) = uncached(64 * MIB);
    let a = alloc.malloc(4096, S0).unwrap();
    let b = alloc.malloc(8192, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(alloc.empty_cache().unwrap(), 4096);
    assert_eq!(device.counters().events_synchronized, 1);
    assert_eq!(alloc.stats().reserved_bytes.all.current, 8192);
    alloc.free(b).unwrap();
    drop(alloc);
    assert!(
        device.live_segments().is_empty(),
        "the drop waited and returned it"
    );
}

#[test]
fn turning_caching_off_at_run_time_returns_the_cache_and_later_frees() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let kept = alloc.malloc(4096, S0).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(4096, F), (4096, A), (2 * MIB - 8192, F)]]
    );
    alloc
        .set_allocator_settings("no_cuda_memory_caching:True")
        .unwrap();
    // The live block's segment stays; new requests get their own allocations.
    let b = alloc.malloc(4096, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![
            vec![(4096, F), (4096, A), (2 * MIB - 8192, F)],
            vec![(4096, A)]
        ]
    );
    // Once the old segment is whole and free (after its stream's event), it goes back.
    alloc.free(kept).unwrap();
    alloc.free(b).unwrap();
    device.complete_all_events();
    let _ = alloc.malloc(512, S0).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(512, A)]]);
    check_invariants(&alloc, &device);
}

#[test]
fn the_key_parses_and_refuses_expandable_segments_beside_it() {
    let config = AllocatorConfig::parse("no_cuda_memory_caching:True").unwrap();
    assert!(config.no_cuda_memory_caching);
    assert!(!AllocatorConfig::default().no_cuda_memory_caching);
    assert!(matches!(
        AllocatorConfig::parse("no_cuda_memory_caching:maybe"),
        Err(ConfigError::InvalidValue { .. })
    ));
    let err =
        AllocatorConfig::parse("expandable_segments:True,no_cuda_memory_caching:True").unwrap_err();
    assert!(
        matches!(err, ConfigError::Unsupported { ref key, .. } if key == "expandable_segments"),
        "{err}"
    );
    // Built in code: the same check when the allocator starts.
    let mut both = AllocatorConfig::default();
    both.no_cuda_memory_caching = true;
    both.expandable_segments = true;
    assert!(both.validate().is_err());
    // On an open allocator too, and nothing changes.
    let (alloc, _device) = uncached(64 * MIB);
    assert!(
        alloc
            .set_allocator_settings("expandable_segments:True")
            .is_err()
    );
    assert!(!alloc.config().expandable_segments);
}
