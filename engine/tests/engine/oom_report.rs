//! The out-of-memory report: PyTorch's numbers (`OutOfMemoryError` in
//! `CUDACachingAllocator.cpp`'s `malloc`), then why — the largest free block, the free bytes in
//! blocks too small for the request — and the configuration the numbers point at; the
//! observers that run at an out-of-memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use caching_alloc_engine::alloc::{AllocError, ObserverThread, OomAdvice};

use crate::common::{MIB, S0, S1, allocator};

fn advice(err: &AllocError) -> Vec<OomAdvice> {
    match err.oom_diagnosis() {
        Some(diagnosis) => diagnosis.advice.clone(),
        None => panic!("expected out-of-memory, got {err}"),
    }
}

#[test]
fn fragmented_free_memory_is_measured_and_points_at_expandable_segments_and_max_split_size() {
    let (alloc, _device) = allocator(64 * MIB, "");
    // Three 20 MiB segments, each split 9 + 9 + 2 (free) MiB.
    let blocks: Vec<_> = (0..6)
        .map(|_| alloc.malloc(9 * MIB, S0).expect("fits"))
        .collect();
    assert_eq!(alloc.stats().memory_reserved(), 60 * MIB);
    // Free the first block of each segment: 3 x 9 + 3 x 2 MiB free, none contiguous.
    let mut kept = Vec::new();
    for (i, b) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            alloc.free(b).expect("live");
        } else {
            kept.push(b);
        }
    }
    let err = alloc.malloc(12 * MIB, S0).expect_err("no 12 MiB anywhere");
    let AllocError::OutOfMemory {
        reserved_unallocated,
        device_free,
        diagnosis,
        ..
    } = &err
    else {
        panic!("expected out-of-memory, got {err}");
    };
    assert_eq!(diagnosis.rounded, 12 * MIB);
    assert_eq!(diagnosis.largest_free_block, 9 * MIB);
    assert_eq!(diagnosis.fragmented, 33 * MIB);
    assert_eq!(*reserved_unallocated, 33 * MIB);
    assert_eq!(*device_free, 4 * MIB);
    assert_eq!(
        advice(&err),
        [OomAdvice::ExpandableSegments, OomAdvice::MaxSplitSize]
    );
    let message = err.to_string();
    println!("{message}");
    for part in [
        "tried to allocate 12.00 MiB",
        "the largest free block is 9.00 MiB",
        "33.00 MiB of the reserved-but-unallocated memory is in free blocks too small",
        "expandable_segments:True",
        "max_split_size_mb",
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert!(
        !message.contains("garbage_collection_threshold"),
        "{message}"
    );
    for b in kept {
        alloc.free(b).expect("live");
    }
}

/// A free block of exactly the request's size that the request cannot use (it belongs to
/// another stream) is not fragmentation: only blocks *smaller* than the rounded request
/// count as too small for it.
#[test]
fn a_free_block_of_the_requests_size_on_another_stream_is_not_fragmentation() {
    let (alloc, _device) = allocator(64 * MIB, "");
    // Stream 1: a 20 MiB segment split 5 (live) + 15 (free) MiB; stream 0: 40 MiB live.
    let kept = alloc.malloc(5 * MIB, S1).unwrap();
    let freed = alloc.malloc(5 * MIB, S1).unwrap();
    alloc.free(freed).unwrap();
    let big = alloc.malloc(40 * MIB, S0).unwrap();
    let err = alloc
        .malloc(15 * MIB, S0)
        .expect_err("16 MiB more does not fit in 64");
    let diagnosis = err.oom_diagnosis().expect("out of memory");
    assert_eq!(diagnosis.rounded, 15 * MIB);
    assert_eq!(diagnosis.largest_free_block, 15 * MIB);
    assert_eq!(diagnosis.fragmented, 0);
    for b in [kept, big] {
        alloc.free(b).unwrap();
    }
}

#[test]
fn earlier_cache_flushes_point_at_garbage_collection_unless_it_is_set() {
    for (config, expect_gc) in [("", true), ("garbage_collection_threshold:0.8", false)] {
        let (alloc, _device) = allocator(64 * MIB, config);
        // 50 MiB cached on stream 1 cannot serve stream 0: the next 30 MiB request flushes
        // the cache and retries (PyTorch's `release_cached_blocks` path).
        let other = alloc.malloc(50 * MIB, S1).expect("fits");
        alloc.free(other).expect("live");
        let live = alloc.malloc(30 * MIB, S0).expect("fits after a flush");
        assert_eq!(alloc.stats().num_alloc_retries, 1);
        let err = alloc
            .malloc(40 * MIB, S0)
            .expect_err("40 beside 30 in 64 MiB");
        assert_eq!(
            advice(&err).contains(&OomAdvice::GarbageCollectionThreshold),
            expect_gc,
            "config {config:?}: {err}"
        );
        alloc.free(live).expect("live");
    }
}

#[test]
fn observers_run_at_every_out_of_memory_and_the_snapshot_is_written_at_the_first() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    alloc.on_out_of_memory(move |err| {
        assert!(err.is_out_of_memory());
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let path = std::env::temp_dir().join(format!("oom-snapshot-{}.pickle", std::process::id()));
    let _ = std::fs::remove_file(&path);
    alloc.dump_snapshot_on_oom(Some(path.clone()));
    let live = alloc.malloc(40 * MIB, S0).expect("fits");
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    assert!(!path.exists());
    alloc
        .malloc(30 * MIB, S0)
        .expect_err("30 beside 40 in 64 MiB");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let first = std::fs::read(&path).expect("the snapshot was written at the first OOM");
    assert_eq!(&first[..2], &[0x80, 2], "a pickle");
    std::fs::remove_file(&path).expect("removed");
    alloc.malloc(30 * MIB, S0).expect_err("still too much");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert!(
        !path.exists(),
        "only the first out-of-memory writes a snapshot"
    );
    // Other errors are not out-of-memory: no observer runs.
    alloc.malloc(0, S0).expect_err("zero bytes");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    alloc.free(live).expect("live");
}

#[test]
fn a_request_that_can_never_fit_is_an_out_of_memory_for_the_observers() {
    // PyTorch learns that a request exceeds the device only when `cudaMalloc` fails, and
    // handles it as any out-of-memory: `num_ooms`, the observers (`OutOfMemoryError`).
    let (alloc, _device) = allocator(64 * MIB, "");
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    alloc.on_out_of_memory(move |err| {
        assert!(matches!(err, AllocError::TooLarge { .. }), "{err}");
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let err = alloc.malloc(100 * MIB, S0).expect_err("beyond the device");
    assert!(err.is_out_of_memory());
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    // The cache-only path knows it too, and says so once.
    let err = alloc
        .malloc_cached(100 * MIB, S0)
        .expect_err("beyond the device");
    assert!(err.is_out_of_memory());
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert_eq!(alloc.stats().num_ooms, 2);
}

#[test]
fn a_request_short_of_the_flush_counts_nothing_and_the_full_path_counts_once() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    alloc.on_out_of_memory(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let live = alloc.malloc(40 * MIB, S0).expect("fits");
    let cached = alloc.malloc(20 * MIB, S1).expect("fits");
    alloc.free(cached).expect("live");
    // 20 MiB on stream 0: the device has 4 MiB left, stream 1's cache holds 20 MiB. Short of
    // the flush: no block, nothing counted, nothing observed, the cache untouched.
    assert!(
        alloc
            .malloc_before_flush(20 * MIB, S0)
            .expect("no error")
            .is_none()
    );
    let stats = alloc.stats();
    assert_eq!((stats.num_ooms, stats.num_alloc_retries), (0, 0));
    assert_eq!(stats.memory_reserved(), 60 * MIB);
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    // The full path flushes and is served.
    let served = alloc.malloc(20 * MIB, S0).expect("after the flush");
    let stats = alloc.stats();
    assert_eq!((stats.num_ooms, stats.num_alloc_retries), (0, 1));
    // What even the full path cannot serve is one out-of-memory.
    alloc.malloc(20 * MIB, S0).expect_err("4 MiB left");
    assert_eq!(alloc.stats().num_ooms, 1);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    alloc.free(served).expect("live");
    alloc.free(live).expect("live");
}

#[test]
fn observers_on_their_own_thread_may_call_the_allocator_and_a_panic_is_reported() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let alloc = Arc::new(alloc);
    alloc.set_observer_thread(ObserverThread::Own);
    let caller = std::thread::current().id();
    let (sender, received) = std::sync::mpsc::channel();
    let weak = Arc::downgrade(&alloc);
    alloc.on_out_of_memory(|_| panic!("an observer that panics"));
    alloc.on_out_of_memory(move |err| {
        let alloc = weak.upgrade().expect("the allocator is alive");
        // Another thread than the failing request's, where the allocator's API is free to
        // use: statistics of after the failure, `empty_cache`.
        let stats = alloc.stats();
        let released = alloc.empty_cache().expect("empty_cache");
        // Waiting for the observers from an observer does not wait for itself.
        alloc.wait_for_oom_observers();
        sender
            .send((
                std::thread::current().id(),
                err.to_string(),
                stats.num_ooms,
                released,
            ))
            .expect("the test waits");
    });
    let live = alloc.malloc(40 * MIB, S0).expect("fits");
    let cached = alloc.malloc(20 * MIB, S1).expect("fits");
    alloc.free(cached).expect("live");
    let err = alloc
        .malloc(30 * MIB, S0)
        .expect_err("30 beside 40 in 64 MiB");
    let report = alloc.wait_for_oom_observers();
    assert_eq!((report.failures, report.ran, report.panicked), (1, 1, 1));
    let (thread, message, num_ooms, released) = received.recv().expect("the observer ran");
    assert_ne!(thread, caller, "observers run on the allocator's thread");
    assert_eq!(message, err.to_string());
    assert_eq!(num_ooms, 1, "the numbers of after the failure");
    // The failure already flushed the cache: nothing was left to release.
    assert_eq!(released, 0);
    // The allocator goes on after the panic.
    let fits = alloc.malloc(20 * MIB, S0).expect("20 beside 40 fits");
    alloc.check_invariants().expect("consistent");
    alloc.free(fits).expect("live");
    alloc.free(live).expect("live");
}

/// Issue 33: `wait_for_oom_observers` called from an observer on the failing request's thread
/// (`ObserverThread::Caller`) waited for the very observer that called it: a deadlock,
/// contrary to its doc. It returns at once there now, with the failures finished so far. The
/// test runs the request on a thread of its own so that a regression fails instead of hanging.
#[test]
fn waiting_for_the_observers_from_an_observer_on_the_callers_thread_returns() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let alloc = Arc::new(alloc);
    let weak = Arc::downgrade(&alloc);
    let (sender, received) = std::sync::mpsc::channel();
    alloc.on_out_of_memory(move |_| {
        let alloc = weak.upgrade().expect("the allocator is alive");
        sender
            .send(alloc.wait_for_oom_observers())
            .expect("the test waits");
    });
    let requester = alloc.clone();
    std::thread::spawn(move || {
        requester
            .malloc(100 * MIB, S0)
            .expect_err("100 MiB in 64 MiB");
    });
    let inside = received
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the observer's wait returned (no deadlock)");
    assert_eq!(inside.failures, 0, "its own failure is still running");
    // Outside, the wait sees it done.
    let mut after = alloc.wait_for_oom_observers();
    for _ in 0..100 {
        if after.failures == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        after = alloc.wait_for_oom_observers();
    }
    assert_eq!((after.failures, after.ran), (1, 1));
}
