//! The out-of-memory report: PyTorch's numbers (`OutOfMemoryError` in
//! `CUDACachingAllocator.cpp`'s `malloc`), then why — the largest free block, the free bytes in
//! blocks too small for the request — and the configuration the numbers point at; the
//! observers that run at an out-of-memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_caching_alloc::alloc::{AllocError, OomAdvice};

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
