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
