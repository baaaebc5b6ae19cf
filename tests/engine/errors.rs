//! Bad input gets a clear error and leaves the pool intact; traces and snapshots round-trip.

use std::collections::HashMap;

use burn_caching_alloc::alloc::{AllocError, CachingAllocator, Snapshot, Trace, TraceEvent};
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::device::{DeviceError, DeviceMemory, DeviceSegment};

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

#[test]
fn a_device_buffer_limit_caps_segments_and_rejects_larger_requests() {
    let device = SimDevice::new(1024 * MIB).with_max_segment_size(16 * MIB);
    let alloc = CachingAllocator::new(device.clone(), Default::default());
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

#[test]
fn driver_errors_surface_as_errors() {
    let (alloc, device) = allocator(64 * MIB, "");
    // A free the device does not know is a driver error, not a panic.
    let mut raw = device.clone();
    let err = raw
        .free(DeviceSegment {
            address: 1,
            size: 2,
            handle: 3,
        })
        .unwrap_err();
    assert!(matches!(err, DeviceError::Driver(_)));
    // The allocator's view is untouched by the bad call.
    assert_eq!(alloc.stats().num_device_free, 0);
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
            } => match alloc.malloc(size, StreamId(stream)) {
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
                    alloc.record_stream(allocation, StreamId(stream)).unwrap();
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
    alloc.record_history(false);
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
