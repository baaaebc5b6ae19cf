//! Settings changed on an open allocator (`CachingAllocator::set_allocator_settings`,
//! PyTorch's `torch.cuda.memory._set_allocator_settings`, which re-parses
//! `CUDAAllocatorConfig::parseArgs` at run time): each key applies to the decisions made
//! after the call, a key the device cannot serve is refused and changes nothing.

use crate::common::*;
use caching_alloc_engine::alloc::{
    AllocatorConfig, CachingAllocator, ConfigError, RecordMode, SegmentSizing, TraceEvent,
    segment_size,
};
use caching_alloc_engine::device::sim::SimDevice;

/// PyTorch's `get_free_block` after `max_split_size_mb` changes: a request under it no longer
/// takes a cached block at or above it, and the oversize statistics count against the new
/// value (they are recounted, so the self-check's recount agrees).
#[test]
fn max_split_size_applies_to_the_next_request_and_the_oversize_counts_follow() {
    let (alloc, device) = allocator(1 << 30, "");
    let big = alloc.malloc(100 * MIB, S0).unwrap();
    let live = alloc.malloc(40 * MIB, S0).unwrap();
    alloc.free(big).unwrap();
    assert_eq!(alloc.stats().max_split_size, -1);

    alloc
        .set_allocator_settings("max_split_size_mb:64")
        .unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.max_split_size, 64 * MIB as i64);
    assert_eq!(
        stats.oversize_segments.current, 1,
        "the cached 100 MiB segment"
    );
    assert_eq!(stats.oversize_allocations.current, 0, "40 MiB is under 64");
    check_invariants(&alloc, &device);

    // 30 MiB is under 64 MiB: it no longer splits the cached 100 MiB block.
    let small = alloc.malloc(30 * MIB, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![
            vec![(100 * MIB, F)],
            vec![(40 * MIB, A)],
            vec![(30 * MIB, A)]
        ]
    );
    assert_eq!(alloc.stats().memory_reserved(), 170 * MIB);

    // Back to unlimited: the next 30 MiB request splits the 100 MiB block again.
    alloc
        .set_allocator_settings("max_split_size_mb:20")
        .unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.oversize_allocations.current, 2, "40 and 30 MiB");
    assert_eq!(stats.oversize_segments.current, 3);
    check_invariants(&alloc, &device);
    alloc
        .set_allocator_settings("max_split_size_mb:100000")
        .unwrap();
    assert_eq!(alloc.stats().oversize_segments.current, 0);
    let again = alloc.malloc(30 * MIB, S0).unwrap();
    assert_eq!(layout(&alloc)[0], vec![(30 * MIB, A), (70 * MIB, F)]);
    for a in [live, small, again] {
        alloc.free(a).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// PyTorch's `round_size` with `roundup_power2_divisions` changed at run time: 3 MiB + 1 byte
/// is 3 MiB + 512 B, then, with 4 divisions between 2 and 4 MiB, 3.5 MiB.
#[test]
fn roundup_power2_divisions_round_the_next_request() {
    let (alloc, device) = allocator(1 << 30, "");
    let before = alloc.malloc(3 * MIB + 1, S0).unwrap();
    assert_eq!(before.size(), 3 * MIB + 512);
    alloc
        .set_allocator_settings("roundup_power2_divisions:4")
        .unwrap();
    let after = alloc.malloc(3 * MIB + 1, S0).unwrap();
    assert_eq!(after.size(), 3 * MIB + 512 * KIB);
    alloc
        .set_allocator_settings("roundup_power2_divisions:[]")
        .unwrap();
    let back = alloc.malloc(3 * MIB + 1, S0).unwrap();
    assert_eq!(back.size(), 3 * MIB + 512);
    for a in [before, after, back] {
        alloc.free(a).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// Two free segments (20 and 16 MiB) under a 50 MiB cap, and a 25 MiB request that does not fit beside
/// them: without a threshold the miss path flushes the cache and retries
/// (`num_alloc_retries`); with `garbage_collection_threshold` set at run time,
/// `garbage_collect_cached_blocks` frees them first and the device allocation succeeds at once.
#[test]
fn garbage_collection_threshold_collects_before_the_next_device_allocation() {
    let run = |settings: Option<&str>| {
        let (alloc, device) = allocator(100 * MIB, "per_process_memory_fraction:0.5");
        let a = alloc.malloc(5 * MIB, S0).unwrap(); // a 20 MiB segment
        let b = alloc.malloc(16 * MIB, S0).unwrap(); // a 16 MiB one
        alloc.free(a).unwrap();
        alloc.free(b).unwrap();
        assert_eq!(alloc.stats().memory_reserved(), 36 * MIB);
        if let Some(settings) = settings {
            alloc.set_allocator_settings(settings).unwrap();
        }
        let c = alloc.malloc(25 * MIB, S0).unwrap();
        let stats = alloc.stats();
        alloc.free(c).unwrap();
        check_invariants(&alloc, &device);
        (
            stats.num_alloc_retries,
            stats.num_device_free,
            stats.memory_reserved(),
        )
    };
    assert_eq!(run(None), (1, 2, 26 * MIB));
    assert_eq!(
        run(Some("garbage_collection_threshold:0.5")),
        (0, 2, 26 * MIB)
    );
}

/// PyTorch's `setMemoryFraction` through the settings string: a lower cap refuses the next
/// device allocation (nothing reserved is given back), a cap of 1 lifts it.
#[test]
fn the_memory_fraction_caps_the_next_device_allocation() {
    let (alloc, device) = allocator(100 * MIB, "");
    let a = alloc.malloc(30 * MIB, S0).unwrap();
    alloc
        .set_allocator_settings("per_process_memory_fraction:0.25")
        .unwrap();
    assert_eq!(alloc.config().memory_fraction, Some(0.25));
    assert_eq!(
        alloc.stats().memory_reserved(),
        30 * MIB,
        "nothing given back"
    );
    let err = alloc.malloc(20 * MIB, S0).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    alloc
        .set_allocator_settings("per_process_memory_fraction:1")
        .unwrap();
    let b = alloc.malloc(20 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// `segment_sizing` (ours): a mid-size request's segment is PyTorch's 20 MiB before the
/// change and grows with the large pool after it.
#[test]
fn segment_sizing_sizes_the_next_segment() {
    let (alloc, device) = allocator(1 << 30, "");
    let a = alloc.malloc(3 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 20 * MIB);
    let rest = alloc.malloc(17 * MIB, S0).unwrap(); // the segment's 17 MiB remainder
    alloc.set_allocator_settings("segment_sizing:grow").unwrap();
    assert_eq!(alloc.config().segment_sizing, SegmentSizing::Grow);
    let b = alloc.malloc(3 * MIB, S0).unwrap();
    let expected = segment_size(3 * MIB, SegmentSizing::Grow, 20 * MIB, 0);
    assert!(expected < 20 * MIB, "{expected}");
    assert_eq!(alloc.stats().memory_reserved(), 20 * MIB + expected);
    for x in [a, rest, b] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// `pool_borrowing` (ours): a 1.5 MiB request beside a cached small segment makes a new
/// large segment with borrowing off, and takes the small segment's free block once it is on.
#[test]
fn pool_borrowing_applies_to_the_next_miss() {
    let (alloc, device) = allocator(1 << 30, "");
    let small = alloc.malloc(4096, S0).unwrap();
    alloc.free(small).unwrap();
    let a = alloc.malloc(1536 * KIB, S0).unwrap();
    assert_eq!(alloc.stats().num_device_alloc, 2, "a new large segment");
    alloc.free(a).unwrap();
    alloc.empty_cache().unwrap();

    let small = alloc.malloc(4096, S0).unwrap();
    alloc.free(small).unwrap();
    alloc.set_allocator_settings("pool_borrowing:true").unwrap();
    let before = alloc.stats().num_device_alloc;
    let b = alloc.malloc(1536 * KIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        stats.num_device_alloc, before,
        "served by the cached small segment"
    );
    assert_eq!(stats.num_pool_borrows, 1);
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// `record_history` / `history_capacity` at run time start, resize and stop the recording.
#[test]
fn history_keys_start_and_stop_the_recording() {
    let (alloc, device) = allocator(1 << 30, "");
    let a = alloc.malloc(4096, S0).unwrap();
    assert!(alloc.trace().events.is_empty());
    alloc
        .set_allocator_settings("record_history:true,history_capacity:3")
        .unwrap();
    let options = alloc.history_options();
    assert_eq!((options.enabled, options.max_entries), (RecordMode::All, 3));
    assert_eq!(alloc.config().history, options);
    alloc.free(a).unwrap();
    let b = alloc.malloc(4096, S0).unwrap();
    let events = alloc.trace().events;
    assert_eq!(events.len(), 3, "the ring keeps three: {events:?}");
    assert!(matches!(events.last(), Some(TraceEvent::Malloc { .. })));
    // Naming the key with the value in force changes nothing: the recording goes on.
    alloc.set_allocator_settings("record_history:true").unwrap();
    assert_eq!(alloc.trace().events.len(), 3);
    alloc
        .set_allocator_settings("record_history:false")
        .unwrap();
    alloc.free(b).unwrap();
    assert!(alloc.trace().events.is_empty());
    check_invariants(&alloc, &device);
}

/// `expandable_segments` applies to segments made after the call: a fixed segment made
/// before stays fixed, the next miss maps pages into a range, and turning it off again makes
/// fixed segments while the range keeps serving and giving back its pages.
#[test]
fn expandable_segments_apply_to_segments_made_after_the_call() {
    let (alloc, device) = allocator(1 << 30, "");
    let fixed = alloc.malloc(30 * MIB, S0).unwrap();
    alloc
        .set_allocator_settings("expandable_segments:True")
        .unwrap();
    let mapped = alloc.malloc(30 * MIB, S0).unwrap();
    // (fixed segments, expandable ones) in the snapshot.
    let kinds = |alloc: &CachingAllocator<SimDevice>| -> (usize, usize) {
        let segments = alloc.snapshot().segments;
        let expandable = segments.iter().filter(|s| s.is_expandable).count();
        (segments.len() - expandable, expandable)
    };
    assert_eq!(kinds(&alloc).0, 1, "the segment made before stays fixed");
    assert!(
        kinds(&alloc).1 >= 1,
        "the new memory is an expandable range"
    );
    assert_eq!(
        alloc.stats().memory_reserved(),
        30 * MIB + 40 * MIB,
        "two 20 MiB pages"
    );
    check_invariants(&alloc, &device);

    alloc
        .set_allocator_settings("expandable_segments:False")
        .unwrap();
    let later = alloc.malloc(30 * MIB, S0).unwrap();
    assert_eq!(
        kinds(&alloc).0,
        2,
        "the new memory is a fixed segment again"
    );
    // The range still serves a request that fits its free pages, and gives them back.
    alloc.free(mapped).unwrap();
    let reuse = alloc.malloc(30 * MIB, S0).unwrap();
    assert_eq!(
        alloc.stats().memory_reserved(),
        60 * MIB + 40 * MIB,
        "no new pages"
    );
    for a in [fixed, reuse, later] {
        alloc.free(a).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 0);
    check_invariants(&alloc, &device);
}

/// What cannot change now is refused with the reason, and nothing changes: expandable
/// segments on a device without virtual memory, and anything that does not parse (the whole
/// string is checked before any key applies).
#[test]
fn a_setting_that_cannot_apply_is_refused_and_changes_nothing() {
    let device = SimDevice::new(1 << 30).without_virtual_memory();
    let alloc = CachingAllocator::new(device, AllocatorConfig::default()).unwrap();
    let before = alloc.config();
    let err = alloc
        .set_allocator_settings("max_split_size_mb:64,expandable_segments:True")
        .unwrap_err();
    assert!(
        matches!(&err, ConfigError::Unsupported { key, .. } if key == "expandable_segments"),
        "{err:?}"
    );
    assert!(err.to_string().contains("no virtual memory"), "{err}");
    assert_eq!(alloc.config(), before);

    for (settings, key) in [
        (
            "max_split_size_mb:64,garbage_collection_threshold:2",
            "garbage_collection_threshold",
        ),
        ("max_split_size_mb:3", "max_split_size_mb"),
        (
            "per_process_memory_fraction:0",
            "per_process_memory_fraction",
        ),
    ] {
        let err = alloc.set_allocator_settings(settings).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidValue { key: k, .. } if k == key),
            "{settings}: {err:?}"
        );
        assert_eq!(alloc.config(), before, "{settings}");
    }
    assert!(matches!(
        alloc.set_allocator_settings("max_split_size_mb:64,max_split_size_mb:64"),
        Err(ConfigError::Duplicate { .. })
    ));
    assert!(matches!(
        alloc.set_allocator_settings("no_such_key:1"),
        Err(ConfigError::UnknownKey { .. })
    ));
    assert_eq!(alloc.config(), before);
    // An empty string changes nothing and is no error.
    alloc.set_allocator_settings("").unwrap();
    assert_eq!(alloc.config(), before);
}

/// A configuration given with `with_settings` keeps every key it does not name.
#[test]
fn with_settings_keeps_the_keys_it_does_not_name() {
    let base = AllocatorConfig::parse("max_split_size_mb:64,pool_borrowing:false").unwrap();
    let (changed, keys) = base
        .with_settings("garbage_collection_threshold:0.7")
        .unwrap();
    assert_eq!(keys, vec!["garbage_collection_threshold"]);
    assert_eq!(changed.max_split_size, Some(64 * MIB));
    assert!(!changed.pool_borrowing);
    assert_eq!(changed.garbage_collection_threshold, Some(0.7));
}

/// The out-of-memory advice names the call that applies it on an open device.
#[test]
fn the_oom_advice_prints_the_call_that_applies_it() {
    let (alloc, _device) = allocator(64 * MIB, "");
    // Three 20 MiB segments split 9 + 9 + 2 MiB; the first 9 MiB of each freed.
    let blocks: Vec<_> = (0..6).map(|_| alloc.malloc(9 * MIB, S0).unwrap()).collect();
    let kept: Vec<_> = blocks
        .into_iter()
        .enumerate()
        .filter_map(|(i, b)| {
            if i % 2 == 0 {
                alloc.free(b).map(|_| None).unwrap()
            } else {
                Some(b)
            }
        })
        .collect();
    let message = alloc.malloc(12 * MIB, S0).unwrap_err().to_string();
    for call in [
        r#"backend::set_allocator_settings(&device, "expandable_segments:True")"#,
        r#"backend::set_allocator_settings(&device, "max_split_size_mb:N")"#,
    ] {
        assert!(message.contains(call), "{call} missing from: {message}");
    }
    for b in kept {
        alloc.free(b).unwrap();
    }
}
