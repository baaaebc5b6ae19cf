//! Bad input gets a clear error and leaves the pool intact; traces and snapshots round-trip.

use std::collections::HashMap;

use caching_alloc_engine::alloc::{
    AllocError, AllocatorConfig, CachingAllocator, HistoryOptions, Snapshot, Trace, TraceEvent,
};
use caching_alloc_engine::device::DeviceError;
use caching_alloc_engine::device::sim::{INJECTED_FAILURE, SimCall, SimDevice};

use crate::common::*;

#[test]
fn zero_size_is_an_error() {
    let (alloc, device) = allocator(64 * MIB, "");
    assert_eq!(alloc.malloc(0, S0).unwrap_err(), AllocError::ZeroSize);
    assert_eq!(device.counters().allocs, 0);
    assert!(!alloc.can_serve_from_cache(0, S0));
}

/// A clear `TooLarge` error, counted as an OOM as PyTorch counts it (see `parity.rs`).
#[test]
fn a_size_beyond_the_device_is_a_clear_error() {
    let (alloc, device) = allocator(64 * MIB, "");
    let err = alloc.malloc(65 * MIB, S0).unwrap_err();
    assert_eq!(
        err,
        AllocError::TooLarge {
            requested: 65 * MIB,
            max: 64 * MIB
        }
    );
    assert!(err.to_string().contains("larger than the largest segment"));
    assert_eq!(alloc.stats().num_ooms, 1);
    assert_eq!(device.counters().allocs, 0);
    let err = alloc.malloc(u64::MAX, S0).unwrap_err();
    assert!(matches!(err, AllocError::TooLarge { .. }), "{err:?}");
}

/// Issue 11 point 7, PyTorch's `malloc`: a request larger than the whole device is an
/// out-of-memory (`num_ooms` += 1, an `oom` trace entry); the error stays the clear one.
#[test]
fn a_size_beyond_the_device_counts_as_an_oom() {
    let (alloc, _device) = allocator(64 * MIB, "record_history:true");
    let err = alloc.malloc(65 * MIB, S0).unwrap_err();
    assert!(matches!(err, AllocError::TooLarge { .. }), "{err:?}");
    assert_eq!(alloc.stats().num_ooms, 1);
    assert!(
        alloc
            .trace()
            .events
            .iter()
            .any(|e| matches!(e, TraceEvent::Oom { .. })),
        "an oom trace entry"
    );
}

#[test]
fn a_device_buffer_limit_caps_segments_and_rejects_larger_requests() {
    let device = SimDevice::new(1024 * MIB).with_max_segment_size(16 * MIB);
    let config = AllocatorConfig::parse("segment_sizing:pytorch").unwrap();
    let alloc = CachingAllocator::new(device.clone(), config).unwrap();
    // 5 MiB would take a 20 MiB segment: the segment shrinks to the request.
    let a = alloc.malloc(5 * MIB, S0).unwrap();
    assert_eq!(device.live_segments()[0].1, 5 * MIB);
    let err = alloc.malloc(17 * MIB, S0).unwrap_err();
    assert_eq!(
        err,
        AllocError::TooLarge {
            requested: 17 * MIB,
            max: 16 * MIB
        }
    );
    alloc.free(a).unwrap();
    check_invariants(&alloc, &device);
}

/// The device's buffer limit is inclusive on both sides: a segment rule that asks for
/// exactly the limit keeps its segment (5 MiB takes PyTorch's 20 MiB under a 20 MiB limit),
/// and a request of exactly the limit is served (6 MiB under a 6 MiB limit, in a segment of
/// its own size); one byte more is too large.
#[test]
fn a_device_buffer_limit_admits_exactly_the_limit() {
    let pytorch = AllocatorConfig::parse("segment_sizing:pytorch").unwrap();
    let device = SimDevice::new(1024 * MIB).with_max_segment_size(20 * MIB);
    let alloc = CachingAllocator::new(device.clone(), pytorch.clone()).unwrap();
    let a = alloc.malloc(5 * MIB, S0).unwrap();
    assert_eq!(device.live_segments()[0].1, 20 * MIB);
    alloc.free(a).unwrap();
    check_invariants(&alloc, &device);

    let device = SimDevice::new(1024 * MIB).with_max_segment_size(6 * MIB);
    let alloc = CachingAllocator::new(device.clone(), pytorch).unwrap();
    let b = alloc.malloc(6 * MIB, S0).unwrap();
    assert_eq!(device.live_segments()[0].1, 6 * MIB);
    assert_eq!(
        alloc.malloc(6 * MIB + 1, S0).unwrap_err(),
        AllocError::TooLarge {
            requested: 6 * MIB + 1,
            max: 6 * MIB
        }
    );
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn freeing_twice_or_on_another_allocator_is_an_error() {
    let (alloc, device) = allocator(64 * MIB, "");
    let (other, _) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let copy = a.clone();
    alloc.free(a).unwrap();
    assert_eq!(
        alloc.free(copy.clone()).unwrap_err(),
        AllocError::InvalidFree { id: copy.id() }
    );
    let b = alloc.malloc(4096, S0).unwrap();
    assert!(matches!(
        other.free(b.clone()),
        Err(AllocError::InvalidFree { .. })
    ));
    assert!(other.record_stream(&b, S1).is_err());
    assert!(alloc.record_stream(&copy, S1).is_err(), "stale handle");
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn freeing_after_empty_cache_is_still_exact() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let stale = a.clone();
    alloc.free(a).unwrap();
    alloc.empty_cache().unwrap();
    assert!(device.live_segments().is_empty());
    assert!(matches!(
        alloc.free(stale),
        Err(AllocError::InvalidFree { .. })
    ));
    // New allocations after empty_cache work as usual.
    let b = alloc.malloc(4096, S0).unwrap();
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// The device error of an injected failure, as the allocator must report it.
fn assert_injected(err: AllocError, call: SimCall) {
    match err {
        AllocError::Device(DeviceError::Driver(message)) => {
            assert!(message.contains(INJECTED_FAILURE), "{message}");
            assert!(message.contains(&format!("{call:?}")), "{message}");
        }
        other => panic!("expected the injected {call:?} failure, got {other:?}"),
    }
}

/// A live block used on a second stream, freed: pending on its event. Returns its address.
fn pending_block(alloc: &CachingAllocator<SimDevice>) -> u64 {
    let a = alloc.malloc(4096, S0).unwrap();
    let address = a.address();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(layout(alloc), [vec![(4096, P), (2 * MIB - 4096, F)]]);
    address
}

/// PyTorch's `release_cached_blocks` / `release_block`: a failing `cudaFree` raises. The
/// segment stays cached and counted, the device keeps it, and the next `empty_cache`
/// releases it.
#[test]
fn a_failing_device_free_is_reported_and_the_segment_stays_cached() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.free(a).unwrap();
    device.fail_next(SimCall::Free);
    assert_injected(alloc.empty_cache().unwrap_err(), SimCall::Free);
    assert_eq!(layout(&alloc), [vec![(2 * MIB, F)]]);
    assert_eq!(device.live_segments().len(), 1);
    let stats = alloc.stats();
    assert_eq!(
        (stats.memory_reserved(), stats.num_device_free),
        (2 * MIB, 0)
    );
    check_invariants(&alloc, &device);
    assert_eq!(alloc.empty_cache().unwrap(), 2 * MIB);
    assert!(device.live_segments().is_empty());
    check_invariants(&alloc, &device);
}

/// A failing free on the out-of-memory path (the last retry's `release_cached_blocks`) is
/// the error the request gets, not an out-of-memory, and nothing is lost.
#[test]
fn a_failing_device_free_on_the_retry_path_is_the_requests_error() {
    let (alloc, device) = allocator(40 * MIB, "");
    let a = alloc.malloc(15 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    device.fail_next(SimCall::Free);
    // 30 MiB does not fit beside the cached 16 MiB segment: the cache must go first.
    assert_injected(alloc.malloc(30 * MIB, S0).unwrap_err(), SimCall::Free);
    assert_eq!(alloc.stats().num_ooms, 0);
    assert_eq!(layout(&alloc), [vec![(16 * MIB, F)]]);
    check_invariants(&alloc, &device);
    let b = alloc.malloc(30 * MIB, S0).unwrap();
    assert_eq!(layout(&alloc), [vec![(30 * MIB, A)]]);
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `insert_events`: a failing `cudaEventRecord` raises from `free`. The free is
/// reported and the allocator stays consistent; the allocation is no longer live.
#[test]
fn a_failing_event_record_is_reported_and_the_allocator_stays_consistent() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    let copy = a.clone();
    device.fail_next(SimCall::RecordEvent);
    assert_injected(alloc.free(a).unwrap_err(), SimCall::RecordEvent);
    let stats = alloc.stats();
    assert_eq!(
        stats.allocation.all.current, 0,
        "the allocation was given up"
    );
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert!(matches!(
        alloc.free(copy),
        Err(AllocError::InvalidFree { .. })
    ));
    check_invariants(&alloc, &device);
}

/// PyTorch's `insert_events`: when the second of two event records fails, the first event
/// was recorded and counts, and the block is not reused before it completes. Unlike PyTorch,
/// which then frees the block although the stream whose record failed may still read it, the
/// engine keeps that stream on the block and retries its record at the next request (a
/// failure there is reported too): the block is freed only once an event on *every* such
/// stream completed; stream 1's event completing is not enough while stream 2 has none.
#[test]
fn a_failing_second_event_record_leaves_the_block_waiting_for_both() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let address = a.address();
    alloc.record_stream(&a, S1).unwrap();
    alloc.record_stream(&a, DeviceStream(2)).unwrap();
    device.fail_nth(SimCall::RecordEvent, 2); // stream 2's event, at the free
    device.fail_nth(SimCall::RecordEvent, 3); // and again at the next request
    assert_injected(alloc.free(a).unwrap_err(), SimCall::RecordEvent);
    assert_eq!(
        device.counters().events_recorded,
        1,
        "stream 1's event only"
    );
    let pending = vec![vec![(4096, P), (2 * MIB - 4096, F)]];
    assert_eq!(layout(&alloc), pending);
    assert_eq!(alloc.stats().active_bytes.all.current, 4096);
    check_invariants(&alloc, &device);

    // The next request retries stream 2's record, which fails again: the error is reported
    // (errors stay errors) and the block stays.
    assert_injected(alloc.malloc(4096, S0).unwrap_err(), SimCall::RecordEvent);
    assert_eq!(layout(&alloc), pending);
    let b = alloc.malloc(4096, S0).unwrap();
    assert_ne!(
        b.address(),
        address,
        "reused before stream 1's event completed"
    );
    assert_eq!(
        device.counters().events_recorded,
        2,
        "stream 2's event recorded at the next request"
    );
    check_invariants(&alloc, &device);
    device.complete_events(S1);
    let c = alloc.malloc(4096, S0).unwrap();
    assert_ne!(c.address(), address, "stream 2 may still read it");
    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    assert_eq!(layout(&alloc)[0][0], (4096, P));
    device.complete_events(DeviceStream(2));
    let d = alloc.malloc(4096, S0).unwrap();
    assert_eq!(d.address(), address, "freed once both events completed");
    assert_eq!(alloc.stats().active_bytes.all.current, 4096);
    alloc.free(d).unwrap();
    assert_eq!(alloc.stats().requested_bytes.all.current, 0);
    check_invariants(&alloc, &device);
}

/// Issue 11 point 8, PyTorch's `free` / `insert_events`: when recording the event fails, the
/// block is left as it is (never freed early), since the other stream may still read it. A
/// request of the same size must not get its address; the failed record is retried at that
/// request, and only once that event completed is the block freed.
#[test]
fn a_failing_event_record_never_frees_the_block_early() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(4096, S0).unwrap();
    let address = a.address();
    alloc.record_stream(&a, S1).unwrap();
    device.fail_next(SimCall::RecordEvent);
    assert_injected(alloc.free(a).unwrap_err(), SimCall::RecordEvent);
    assert_eq!(device.counters().events_recorded, 0);
    let state = layout(&alloc)[0][0];
    assert_ne!(state.1, F, "the block was freed although its event failed");
    let b = alloc.malloc(4096, S0).unwrap();
    assert_ne!(
        b.address(),
        address,
        "the block was reused while stream 1 may read it"
    );
    assert_eq!(
        device.counters().events_recorded,
        1,
        "the record is retried"
    );
    check_invariants(&alloc, &device);
    device.complete_all_events();
    alloc.empty_cache().unwrap();
    assert_eq!(
        layout(&alloc)[0][0].1,
        F,
        "freed once the retried event completed"
    );
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `synchronize_and_free_events`: a failing `cudaEventSynchronize` raises from
/// `empty_cache`. The block stays pending and its segment stays; the next `empty_cache`
/// completes the free and releases the segment.
#[test]
fn a_failing_synchronisation_is_reported_and_the_segment_stays() {
    let (alloc, device) = allocator(64 * MIB, "");
    pending_block(&alloc);
    device.fail_next(SimCall::SynchronizeEvent);
    assert_injected(alloc.empty_cache().unwrap_err(), SimCall::SynchronizeEvent);
    assert_eq!(layout(&alloc), [vec![(4096, P), (2 * MIB - 4096, F)]]);
    assert_eq!(device.live_segments().len(), 1);
    check_invariants(&alloc, &device);
    assert_eq!(alloc.empty_cache().unwrap(), 2 * MIB);
    assert!(device.live_segments().is_empty());
    assert_eq!(device.armed_failures(SimCall::SynchronizeEvent), 0);
    check_invariants(&alloc, &device);
}

/// The out-of-memory path synchronises every pending event before its last retry: a failing
/// synchronisation there is the request's error, not an out-of-memory.
#[test]
fn a_failing_synchronisation_on_the_retry_path_is_the_requests_error() {
    let (alloc, device) = allocator(21 * MIB, "");
    pending_block(&alloc);
    device.fail_next(SimCall::SynchronizeEvent);
    // 20 MiB does not fit beside the 2 MiB segment held by the pending block.
    assert_injected(
        alloc.malloc(5 * MIB, S0).unwrap_err(),
        SimCall::SynchronizeEvent,
    );
    assert_eq!(alloc.stats().num_ooms, 0);
    assert_eq!(layout(&alloc), [vec![(4096, P), (2 * MIB - 4096, F)]]);
    check_invariants(&alloc, &device);
    let b = alloc.malloc(5 * MIB, S0).unwrap();
    assert_eq!(layout(&alloc), [vec![(5 * MIB, A), (15 * MIB, F)]]);
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn the_trace_records_inputs_and_outcomes_and_replays() {
    let (alloc, _device) = allocator(64 * MIB, "record_history:true");
    let a = alloc.malloc(1000, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    alloc.free(a).unwrap();
    alloc.empty_cache().unwrap();
    alloc.set_memory_fraction(0.5).unwrap();
    assert!(alloc.malloc(40 * MIB, S0).unwrap_err().is_out_of_memory());
    let trace = alloc.trace();
    let ops: Vec<&str> = trace
        .events
        .iter()
        .map(|e| match e {
            TraceEvent::Malloc { .. } => "malloc",
            TraceEvent::FreeRequested { .. } => "free_requested",
            TraceEvent::FreeCompleted { .. } => "free_completed",
            TraceEvent::RecordStream { .. } => "record_stream",
            TraceEvent::SegmentAlloc { .. } => "segment_alloc",
            TraceEvent::SegmentFree { .. } => "segment_free",
            TraceEvent::EmptyCache => "empty_cache",
            TraceEvent::Oom { .. } => "oom",
            // `TraceEvent` is non-exhaustive: a new kind of event fails the comparison below.
            _ => "another event",
        })
        .collect();
    assert_eq!(
        ops,
        [
            "segment_alloc",
            "malloc",
            "record_stream",
            "free_requested",
            "empty_cache",
            "free_completed",
            "segment_free",
            "oom"
        ]
    );
    let json = trace.to_json();
    let back = Trace::from_json(&json).unwrap();
    assert_eq!(back, trace);
    assert_eq!(back.operations().count(), 4);

    // Replay on a fresh allocator reproduces the same inputs.
    let (fresh, device) = allocator(64 * MIB, "record_history:true");
    let (mallocs, frees, ooms) = replay(&back, &fresh);
    assert_eq!((mallocs, frees, ooms), (1, 1, 0));
    assert_eq!(device.counters().allocs, 1);
    let replayed: Vec<TraceEvent> = fresh.trace().operations().cloned().collect();
    let original: Vec<TraceEvent> = trace.operations().cloned().collect();
    assert_eq!(replayed, original);
}

/// Replays the trace's inputs through `alloc`, allocations keyed by their recorded id: a malloc
/// that fails with out-of-memory is counted and its later free skipped; allocations still live
/// at the end are freed. Returns (mallocs, frees, out-of-memory failures).
fn replay(trace: &Trace, alloc: &CachingAllocator<SimDevice>) -> (u64, u64, u64) {
    let mut live = HashMap::new();
    let (mut mallocs, mut frees, mut ooms) = (0, 0, 0);
    for event in trace.operations() {
        match *event {
            TraceEvent::Malloc {
                id, size, stream, ..
            } => match alloc.malloc(size, DeviceStream(stream)) {
                Ok(allocation) => {
                    mallocs += 1;
                    live.insert(id, allocation);
                }
                Err(err) if err.is_out_of_memory() => ooms += 1,
                Err(err) => panic!("replaying malloc {id}: {err}"),
            },
            TraceEvent::FreeRequested { id } => {
                if let Some(allocation) = live.remove(&id) {
                    alloc.free(allocation).unwrap();
                    frees += 1;
                }
            }
            TraceEvent::RecordStream { id, stream } => {
                if let Some(allocation) = live.get(&id) {
                    alloc
                        .record_stream(allocation, DeviceStream(stream))
                        .unwrap();
                }
            }
            TraceEvent::EmptyCache => {
                alloc.empty_cache().unwrap();
            }
            _ => {}
        }
    }
    for (_, allocation) in live {
        alloc.free(allocation).unwrap();
        frees += 1;
    }
    (mallocs, frees, ooms)
}

#[test]
fn the_history_ring_keeps_the_newest_events() {
    let (alloc, _device) = allocator(64 * MIB, "record_history:true,history_capacity:3");
    for _ in 0..3 {
        let a = alloc.malloc(512, S0).unwrap();
        alloc.free(a).unwrap();
    }
    let trace = alloc.trace();
    assert_eq!(trace.events.len(), 3);
    // 4 events in the first round (with the segment), 3 in each other: 10, of which 3 kept.
    assert_eq!(trace.dropped, 7);
    assert!(matches!(trace.events[2], TraceEvent::FreeCompleted { .. }));
    alloc.record_memory_history(HistoryOptions::off());
    assert!(alloc.trace().events.is_empty());
}

#[test]
fn the_snapshot_serialises_and_reads_back() {
    let (alloc, _device) = allocator(64 * MIB, "record_history:true");
    let _a = alloc.malloc(3000, S0).unwrap();
    let snapshot = alloc.snapshot();
    let json = snapshot.to_json_pretty();
    assert!(json.contains("\"active_allocated\""), "{json}");
    assert!(json.contains("\"pool\": \"small\""), "{json}");
    let back: Snapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, snapshot);
    assert_eq!(back.segments[0].blocks[0].requested_size, 3000);
    assert_eq!(back.segments[0].blocks[0].size, 3072);
    assert!(back.trace.is_some());
}
