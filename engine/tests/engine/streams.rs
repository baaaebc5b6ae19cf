//! Streams never share a cached block; a block used on another stream waits for its event.

use crate::common::*;

#[test]
fn a_block_freed_on_one_stream_is_not_reused_on_another() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let a_address = a.address();
    alloc.free(a).unwrap();
    let b = alloc.malloc(4096, S1).unwrap();
    assert_eq!(device.counters().allocs, 2, "stream 1 gets its own segment");
    assert_ne!(b.address(), a_address);
    let snapshot = alloc.snapshot();
    let streams: Vec<u64> = snapshot.segments.iter().map(|s| s.stream).collect();
    assert_eq!(streams, vec![0, 1]);
    // Back on stream 0 the cached block is reused.
    let c = alloc.malloc(4096, S0).unwrap();
    assert_eq!(c.address(), a_address);
    check_invariants(&alloc, &device);
}

#[test]
fn a_block_recorded_on_a_second_stream_waits_for_its_event() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let a_address = a.address();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        device.counters().events_recorded,
        1,
        "one event on stream 1"
    );
    assert_eq!(layout(&alloc), vec![vec![(4096, P), (2 * MIB - 4096, F)]]);
    let stats = alloc.stats();
    assert_eq!(stats.allocated_bytes.all.current, 0, "no longer allocated");
    assert_eq!(
        stats.active_bytes.all.current, 4096,
        "still active until the event"
    );

    // While the event is pending the block is not reused.
    let b = alloc.malloc(4096, S0).unwrap();
    assert_ne!(b.address(), a_address);
    check_invariants(&alloc, &device);

    // Once stream 1 passes the event, the next request completes the free and reuses it.
    device.complete_events(S1);
    let c = alloc.malloc(4096, S0).unwrap();
    assert_eq!(c.address(), a_address);
    assert_eq!(alloc.stats().active_bytes.all.current, 8192);
    check_invariants(&alloc, &device);
}

#[test]
fn recording_the_allocation_stream_itself_needs_no_event() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.record_stream(&a, S0).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(device.counters().events_recorded, 0);
    assert_eq!(layout(&alloc), vec![vec![(2 * MIB, F)]]);
}

#[test]
fn a_pending_block_merges_only_once_its_events_complete() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let b = alloc.malloc(4096, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    alloc.record_stream(&a, DeviceStream(2)).unwrap();
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    // b merged with the tail but not with the pending a.
    assert_eq!(layout(&alloc), vec![vec![(4096, P), (2 * MIB - 4096, F)]]);
    device.complete_events(S1);
    let _ = alloc.malloc(512, S1).unwrap();
    assert_eq!(
        layout(&alloc)[0],
        vec![(4096, P), (2 * MIB - 4096, F)],
        "still waiting on stream 2"
    );
    device.complete_events(DeviceStream(2));
    let _ = alloc.malloc(512, S1).unwrap();
    assert_eq!(layout(&alloc)[0], vec![(2 * MIB, F)]);
    check_invariants(&alloc, &device);
}

#[test]
fn empty_cache_synchronizes_pending_frees_and_releases_them() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    let released = alloc.empty_cache().unwrap();
    assert_eq!(released, 2 * MIB);
    assert_eq!(device.counters().events_synchronized, 1);
    assert_eq!(alloc.stats().num_sync_all_streams, 1);
    assert!(layout(&alloc).is_empty());
    check_invariants(&alloc, &device);
}

/// PyTorch's `process_events` (`CUDACachingAllocator.cpp`) stops at a stream's first event
/// that has not completed: events of one stream complete in the order they were recorded.
#[test]
fn a_malloc_asks_only_the_first_unfinished_event_of_each_stream() {
    let (alloc, device) = allocator(1 << 30, "");
    let users = [S1, DeviceStream(2)];
    // 50 blocks of stream 0, each used on both other streams: 100 pending events.
    for _ in 0..50 {
        let a = alloc.malloc(4096, S0).unwrap();
        for stream in users {
            alloc.record_stream(&a, stream).unwrap();
        }
        alloc.free(a).unwrap();
    }
    assert_eq!(device.counters().events_recorded, 100);
    let asked = device.counters().events_queried;
    let b = alloc.malloc(4096, S0).unwrap();
    // One question per stream with pending frees, not one per pending event.
    assert_eq!(device.counters().events_queried - asked, 2);
    assert_eq!(alloc.stats().num_alloc_retries, 0);
    alloc.free(b).unwrap();

    // Stream 1 finishes: its 50 events complete in one call (50 questions, and one more for
    // stream 2's first); the blocks still wait for stream 2.
    device.complete_events(S1);
    let asked = device.counters().events_queried;
    let c = alloc.malloc(4096, S0).unwrap();
    assert_eq!(device.counters().events_queried - asked, 50 + 1);
    alloc.free(c).unwrap();
    let pending = |alloc| {
        layout(alloc)
            .iter()
            .flatten()
            .filter(|(_, state)| *state == P)
            .count()
    };
    assert_eq!(pending(&alloc), 50);
    device.complete_events(DeviceStream(2));
    let d = alloc.malloc(4096, S0).unwrap();
    assert_eq!(pending(&alloc), 0);
    alloc.free(d).unwrap();
    check_invariants(&alloc, &device);
}
