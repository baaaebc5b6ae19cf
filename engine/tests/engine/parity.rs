//! PyTorch parity, rule by rule, with the numbers worked out from PyTorch's code
//! (`c10/cuda/CUDACachingAllocator.cpp` and `c10/core/AllocatorConfig.cpp`, PyTorch 2.9; the
//! function each test follows is named in its doc comment).

use caching_alloc_engine::alloc::{AllocError, CachingAllocator, TraceEvent};
use caching_alloc_engine::device::sim::SimDevice;

use crate::common::*;

/// A 3 MiB request on stream 1, freed at once: one large-pool search that reuses the
/// stream-1 segment, which stays split by `_keep`, so it is never a collection candidate.
fn tick(alloc: &CachingAllocator<SimDevice>) {
    let t = alloc.malloc(3 * MIB, S1).unwrap();
    alloc.free(t).unwrap();
}

fn addresses(alloc: &CachingAllocator<SimDevice>) -> Vec<(u64, u64)> {
    alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| (s.address, s.total_size))
        .collect()
}

/// `garbage_collect_cached_blocks` with `get_free_block`'s ages: 200 MiB device, fraction 0.5
/// (100 MiB allowed), threshold 0.5 (collect above 50 MiB). At the 30 MiB miss the cached
/// 12, 14 and 16 MiB segments have ages 7, 6 and 1 (large-pool searches since cached), mean
/// 4.67: one pass frees both the 12 and the 14 MiB segment, though the first alone covers
/// the 12 MiB excess; the youngest stays.
#[test]
fn garbage_collection_frees_every_block_at_least_the_mean_age_in_a_pass() {
    let (alloc, device) = allocator(
        200 * MIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
    );
    let _keep = alloc.malloc(3 * MIB, S1).unwrap(); // search 1: 20 MiB on stream 1
    let a = alloc.malloc(12 * MIB, S0).unwrap(); // search 2
    let b = alloc.malloc(14 * MIB, S0).unwrap(); // search 3: 46 MiB reserved
    let (a_at, b_at) = (a.address(), b.address());
    alloc.free(a).unwrap(); // cached at 3
    tick(&alloc); // 4
    alloc.free(b).unwrap(); // cached at 4
    for _ in 0..4 {
        tick(&alloc); // 5 to 8
    }
    let c = alloc.malloc(16 * MIB, S0).unwrap(); // search 9: a miss, 46 <= 50, no collection
    let c_at = c.address();
    assert_eq!(device.counters().frees, 0);
    alloc.free(c).unwrap(); // cached at 9; 62 MiB reserved
    let d = alloc.malloc(30 * MIB, S0).unwrap(); // search 10: ages 7, 6, 1
    assert_eq!(device.counters().frees, 2);
    let segments = addresses(&alloc);
    assert!(!segments.iter().any(|(at, _)| *at == a_at || *at == b_at));
    assert!(segments.contains(&(c_at, 16 * MIB)));
    assert_eq!(alloc.stats().memory_reserved(), (20 + 16 + 30) * MIB);
    alloc.free(d).unwrap();
    check_invariants(&alloc, &device);
}

/// `garbage_collect_cached_blocks` repeats passes until the excess is reclaimed: threshold
/// 0.4 (40 MiB), 62 MiB reserved, ages 6, 3 and 1 for 12, 14 and 16 MiB. Pass one (mean
/// 3.33) frees the 12 MiB segment; pass two (mean 2 of the rest) the 14 MiB one, reaching the
/// 22 MiB excess; the youngest stays.
#[test]
fn garbage_collection_repeats_passes_until_the_excess_is_reclaimed() {
    let (alloc, device) = allocator(
        200 * MIB,
        "garbage_collection_threshold:0.4,per_process_memory_fraction:0.5",
    );
    let _keep = alloc.malloc(3 * MIB, S1).unwrap(); // search 1
    let a = alloc.malloc(12 * MIB, S0).unwrap(); // 2
    let b = alloc.malloc(14 * MIB, S0).unwrap(); // 3
    // Search 4 misses with 46 MiB reserved: collection runs, but nothing is cached.
    let c = alloc.malloc(16 * MIB, S0).unwrap();
    let (a_at, b_at, c_at) = (a.address(), b.address(), c.address());
    alloc.free(a).unwrap(); // cached at 4
    for _ in 0..3 {
        tick(&alloc); // 5 to 7
    }
    alloc.free(b).unwrap(); // cached at 7
    tick(&alloc); // 8
    tick(&alloc); // 9
    alloc.free(c).unwrap(); // cached at 9
    let d = alloc.malloc(40 * MIB, S0).unwrap(); // search 10: ages 6, 3, 1
    assert_eq!(device.counters().frees, 2);
    let segments = addresses(&alloc);
    assert!(!segments.iter().any(|(at, _)| *at == a_at || *at == b_at));
    assert!(segments.contains(&(c_at, 16 * MIB)));
    assert_eq!(alloc.stats().memory_reserved(), (20 + 16 + 40) * MIB);
    alloc.free(d).unwrap();
    check_invariants(&alloc, &device);
}

/// `get_free_block` counts a large-pool search (`get_free_blocks_call_count`) only while
/// collection can run (a fraction set and a positive threshold), so the ages of segments
/// cached before `setMemoryFraction` start when it is called. Threshold 0.5 and no fraction:
/// 12 and 14 MiB cached with three searches between them, 16 MiB live; then fraction 0.5
/// (100 MiB allowed, collect above 50) and a 30 MiB miss with 62 MiB reserved: both cached
/// segments are one search old, the mean is one, and one pass frees both. Had the searches
/// before the fraction counted, the 12 MiB segment (age 4 against 1, mean 2.5) would have gone
/// alone, covering the 12 MiB excess.
/// Fraction 1.0 is no fraction (PyTorch 2.9's `setMemoryFraction` leaves
/// `allowed_memory_maximum` empty for it), so it counts no searches either.
#[test]
fn garbage_collection_ages_count_searches_only_once_collection_can_run() {
    for config in [
        "garbage_collection_threshold:0.5",
        "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0",
    ] {
        gc_ages_start_at_the_fraction(config);
    }
}

fn gc_ages_start_at_the_fraction(config: &str) {
    let (alloc, device) = allocator(200 * MIB, config);
    let _keep = alloc.malloc(3 * MIB, S1).unwrap(); // 20 MiB on stream 1
    let a = alloc.malloc(12 * MIB, S0).unwrap();
    let b = alloc.malloc(14 * MIB, S0).unwrap();
    let c = alloc.malloc(16 * MIB, S0).unwrap(); // 62 MiB reserved
    let (a_at, b_at, c_at) = (a.address(), b.address(), c.address());
    alloc.free(a).unwrap();
    for _ in 0..3 {
        tick(&alloc);
    }
    alloc.free(b).unwrap();
    assert_eq!(device.counters().frees, 0);
    alloc.set_memory_fraction(0.5).unwrap();
    let d = alloc.malloc(30 * MIB, S0).unwrap(); // the first counted search: ages 1 and 1
    assert_eq!(device.counters().frees, 2, "{config}");
    let segments = addresses(&alloc);
    assert!(!segments.iter().any(|(at, _)| *at == a_at || *at == b_at));
    assert!(segments.contains(&(c_at, 16 * MIB)));
    assert_eq!(alloc.stats().memory_reserved(), (20 + 16 + 30) * MIB);
    for x in [c, d] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// `malloc` calls `garbage_collect_cached_blocks` only when a fraction is set and the
/// threshold is positive; fraction 1.0 is no limit (`setMemoryFraction`).
#[test]
fn garbage_collection_needs_a_memory_fraction_below_one() {
    let (alloc, device) = allocator(100 * MIB, "garbage_collection_threshold:0.1");
    let a = alloc.malloc(20 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    let b = alloc.malloc(30 * MIB, S0).unwrap(); // a miss 10x over the threshold
    assert_eq!(device.counters().frees, 0, "no fraction: no collection");
    alloc.set_memory_fraction(1.0).unwrap();
    let c = alloc.malloc(40 * MIB, S0).unwrap();
    assert_eq!(
        device.counters().frees,
        0,
        "fraction 1.0: no limit, no collection"
    );
    assert_eq!(alloc.stats().memory_reserved(), 90 * MIB);
    alloc.set_memory_fraction(0.95).unwrap();
    let d = alloc.malloc(21 * MIB, S0).unwrap(); // the cached 20 MiB is too small: a miss
    assert_eq!(device.counters().frees, 1, "now the cached 20 MiB goes");
    assert_eq!(alloc.stats().memory_reserved(), 92 * MIB);
    for x in [b, c, d] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// `free` lowers allocated bytes at once; `free_block` lowers active and requested bytes when
/// the free completes, after the other stream's event.
#[test]
fn requested_bytes_drop_when_the_free_completes() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(1000, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    let s = alloc.stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.requested_bytes.all.current, 1000, "still pending");
    assert_eq!(s.active_bytes.all.current, 1024);
    check_invariants(&alloc, &device);
    device.complete_events(S1);
    let b = alloc.malloc(4096, S0).unwrap();
    let s = alloc.stats();
    assert_eq!(s.requested_bytes.all.current, 4096);
    assert_eq!(s.requested_bytes.all.freed, 1000);
    assert_eq!(s.active_bytes.all.current, 4096);
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// `synchronize_and_free_events` counts `num_sync_all_streams` on every release of cached
/// blocks, pending events or not: each `empty_cache` and the last retry before an OOM.
#[test]
fn every_cache_release_counts_a_sync_of_all_streams() {
    let (alloc, _device) = allocator(64 * MIB, "");
    alloc.empty_cache().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().num_sync_all_streams, 2);
    let a = alloc.malloc(40 * MIB, S0).unwrap();
    assert!(alloc.malloc(30 * MIB, S0).unwrap_err().is_out_of_memory());
    let s = alloc.stats();
    assert_eq!(
        (s.num_sync_all_streams, s.num_alloc_retries, s.num_ooms),
        (3, 1, 1)
    );
    alloc.free(a).unwrap();
}

/// `DeviceCachingAllocator()` stores `max_split_size` as int64: SIZE_MAX when unlimited,
/// which `memory_stats` reports as -1.
#[test]
fn max_split_size_is_minus_one_when_unlimited() {
    let (alloc, _device) = allocator(64 * MIB, "");
    assert_eq!(alloc.stats().max_split_size, -1);
    assert_eq!(alloc.stats().to_map()["max_split_size"], -1);
    let (alloc, _device) = allocator(64 * MIB, "max_split_size_mb:20");
    assert_eq!(alloc.stats().to_map()["max_split_size"], 20 * MIB as i64);
}

/// `malloc`: a request beyond the device fails `cudaMalloc` in PyTorch and ends in its OOM
/// branch (`num_ooms` += 1, an `oom` trace entry). Here it is a `TooLarge` error, counted the
/// same way, found before the device is asked: the cache is not flushed for it.
#[test]
fn a_request_beyond_the_device_counts_as_an_oom_without_flushing_the_cache() {
    let (alloc, device) = allocator(64 * MIB, "record_history:true");
    let a = alloc.malloc(4 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    let err = alloc.malloc(65 * MIB, S0).unwrap_err();
    assert!(matches!(err, AllocError::TooLarge { .. }), "{err:?}");
    let s = alloc.stats();
    assert_eq!(s.num_ooms, 1);
    assert_eq!(
        (
            s.num_alloc_retries,
            s.num_sync_all_streams,
            s.num_device_free
        ),
        (0, 0, 0)
    );
    assert_eq!(s.memory_reserved(), 20 * MIB, "the cache stays");
    assert_eq!(device.counters().allocs, 1);
    let events = alloc.trace().events;
    assert!(matches!(
        events.last(),
        Some(TraceEvent::Oom { size, stream: 0, rounded, device_free })
            if *size == 65 * MIB && *rounded == 65 * MIB && *device_free == 44 * MIB
    ));
}
