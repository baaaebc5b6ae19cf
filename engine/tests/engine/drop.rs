//! Dropping an allocator returns its cached segments to the device and leaves only the
//! segments that still hold a live allocation, or a block whose stream event failed: what is
//! left is read from the simulated device itself, not from the dropped allocator.

use caching_alloc_engine::alloc::{AllocatorConfig, CachingAllocator};

use crate::common::MIB;
use caching_alloc_engine::device::DeviceStream;
use caching_alloc_engine::device::metered::Metered;
use caching_alloc_engine::device::sim::{SimCall, SimDevice};

const S0: DeviceStream = DeviceStream(0);
const S1: DeviceStream = DeviceStream(1);

#[test]
fn drop_returns_every_segment_without_a_live_block() {
    let device = SimDevice::new(1 << 34);
    let alloc =
        CachingAllocator::new(Metered::new(device.clone()), AllocatorConfig::default()).unwrap();
    // Three segments: a small one (2 MiB), a mid-size one (the 5 MiB request rounded to 6 MiB:
    // the default `segment_sizing:grow` on an empty pool), one of its own (64 MiB).
    let small = alloc.malloc(1000, S0).unwrap();
    let mid = alloc.malloc(5 * MIB, S0).unwrap();
    let big = alloc.malloc(64 * MIB, S0).unwrap();
    assert_eq!(device.live_segments().len(), 3);
    alloc.free(small).unwrap();
    alloc.free(big).unwrap();
    // `mid` stays live: its 6 MiB segment cannot be returned.
    let mid_segment = mid.address() - mid.offset();
    drop(alloc);
    assert_eq!(
        device.live_segments(),
        vec![(mid_segment, 6 * MIB)],
        "only the live block's segment is left on the device"
    );
    assert_eq!(device.counters().frees, 2);
}

#[test]
fn drop_of_an_idle_allocator_returns_everything() {
    let device = Metered::new(SimDevice::new(1 << 34));
    let meter = device.meter();
    let alloc = CachingAllocator::new(device, AllocatorConfig::default()).unwrap();
    for size in [512, 3 * MIB, 100 * MIB] {
        let a = alloc.malloc(size, DeviceStream(1)).unwrap();
        alloc.free(a).unwrap();
    }
    drop(alloc);
    assert_eq!(meter.allocs(), meter.frees());
    assert_eq!(meter.bytes_in_use(), 0);
}

/// Issue 20 point 5: one failed event synchronisation used to make the drop return before it
/// freed any cached segment. Now only the block waiting on that event keeps its segment.
#[test]
fn a_failed_event_sync_at_drop_keeps_only_the_waiting_blocks_segment() {
    crate::bad_input::capture_warnings();
    let device = SimDevice::new(1 << 34);
    let alloc = CachingAllocator::new(device.clone(), AllocatorConfig::default()).unwrap();
    // A 64 MiB block used on stream 1: its free waits on an event recorded there.
    let shared = alloc.malloc(64 * MIB, S0).unwrap();
    alloc.record_stream(&shared, S1).unwrap();
    let shared_segment = shared.address();
    alloc.free(shared).unwrap();
    // Two more cached segments, free and idle.
    for size in [1000, 5 * MIB] {
        let a = alloc.malloc(size, S0).unwrap();
        alloc.free(a).unwrap();
    }
    assert_eq!(device.live_segments().len(), 3);
    device.fail_next(SimCall::SynchronizeEvent);
    drop(alloc);
    assert_eq!(
        device.armed_failures(SimCall::SynchronizeEvent),
        0,
        "the sync was tried"
    );
    assert_eq!(
        device.live_segments(),
        vec![(shared_segment, 64 * MIB)],
        "the two idle segments went back; the one stream 1 may still read stays"
    );
    // The failure is reported, with the driver's message.
    assert!(crate::bad_input::warned(
        "returning cached segments on drop: device driver error: injected failure of \
         SynchronizeEvent"
    ));
}

/// Issue 20 point 5: a segment the device refuses to take back does not stop the others.
#[test]
fn a_refused_segment_free_at_drop_does_not_keep_the_other_segments() {
    let device = SimDevice::new(1 << 34);
    let alloc = CachingAllocator::new(device.clone(), AllocatorConfig::default()).unwrap();
    for size in [1000, 5 * MIB, 64 * MIB] {
        let a = alloc.malloc(size, S0).unwrap();
        alloc.free(a).unwrap();
    }
    device.fail_next(SimCall::Free);
    drop(alloc);
    assert_eq!(device.counters().injected_failures, 1);
    assert_eq!(
        device.live_segments().len(),
        1,
        "only the refused segment is left: {:?}",
        device.live_segments()
    );
    assert_eq!(device.counters().frees, 2);
}

/// Issue 20 point 5, expandable segments: a failed event sync leaves the pages of the waiting
/// block mapped, and every other free page is unmapped.
#[test]
fn a_failed_event_sync_at_drop_unmaps_the_other_expandable_pages() {
    let device = SimDevice::new(1 << 34);
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let alloc = CachingAllocator::new(device.clone(), config).unwrap();
    let shared = alloc.malloc(40 * MIB, S0).unwrap();
    alloc.record_stream(&shared, S1).unwrap();
    alloc.free(shared).unwrap();
    let other = alloc.malloc(40 * MIB, DeviceStream(2)).unwrap();
    alloc.free(other).unwrap();
    assert_eq!(device.bytes_in_use(), 80 * MIB);
    device.fail_next(SimCall::SynchronizeEvent);
    drop(alloc);
    assert_eq!(
        device.bytes_in_use(),
        40 * MIB,
        "stream 2's pages were unmapped, the waiting block's stay"
    );
    assert_eq!(
        device.reserved_ranges().len(),
        1,
        "stream 2's range was given back"
    );
}
