//! Issue 20 point 4: a panic inside an engine operation (here a device implementation's,
//! injected by the simulated device) poisons the allocator. CubeCL catches panics in server
//! tasks and carries on, and parking_lot does not poison its mutex, so without the mark the
//! next request would be served from half-updated blocks and statistics.

use std::panic::{AssertUnwindSafe, catch_unwind};

use caching_alloc_engine::alloc::{AllocError, AllocatorConfig, CachingAllocator};
use caching_alloc_engine::device::sim::{SimCall, SimDevice};

use crate::common::*;

fn quiet_panic<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    catch_unwind(AssertUnwindSafe(f))
}

/// A device that panics while the engine frees a block used on two streams: the statistics
/// were already lowered, the block is neither free nor pending. Every later change is refused
/// with a typed error naming the operation; reading stays possible.
#[test]
fn a_panic_inside_free_poisons_the_allocator() {
    let (alloc, device) = allocator(1 << 30, "");
    let shared = alloc.malloc(4 * MIB, S0).unwrap();
    let other = alloc.malloc(4 * MIB, S0).unwrap();
    alloc.record_stream(&shared, S1).unwrap();
    device.panic_next(SimCall::RecordEvent);
    assert!(
        quiet_panic(|| alloc.free(shared.clone())).is_err(),
        "the device panicked"
    );
    assert_eq!(alloc.poisoned(), Some("free"));

    let poisoned = AllocError::Poisoned { operation: "free" };
    let allocs_before = device.counters().allocs;
    assert_eq!(alloc.malloc(4 * MIB, S0).unwrap_err(), poisoned);
    assert_eq!(alloc.malloc_cached(512, S0).unwrap_err(), poisoned);
    assert!(!alloc.can_serve_from_cache(512, S0));
    assert_eq!(alloc.free(other).unwrap_err(), poisoned);
    assert_eq!(alloc.empty_cache().unwrap_err(), poisoned);
    assert_eq!(
        device.counters().allocs,
        allocs_before,
        "nothing handed out"
    );
    let message = poisoned.to_string();
    assert!(message.contains("`free` panicked"), "{message}");
    // Statistics and snapshots still read (to diagnose): the half-done free shows.
    assert_eq!(alloc.stats().allocation.all.current, 1);
    assert_eq!(alloc.snapshot().segments.len(), 1);
}

/// A panic while the engine grows (in the device's `allocate`) poisons it too; the free that
/// follows is refused, and the drop leaves the device alone rather than free segments that a
/// half-updated structure calls free.
#[test]
fn a_panic_inside_malloc_poisons_the_allocator_and_the_drop_frees_nothing() {
    let device = SimDevice::new(1 << 30);
    let alloc = CachingAllocator::new(device.clone(), AllocatorConfig::default()).unwrap();
    let first = alloc.malloc(1000, S0).unwrap();
    device.panic_next(SimCall::Allocate);
    assert!(quiet_panic(|| alloc.malloc(64 * MIB, S0)).is_err());
    assert_eq!(
        alloc.malloc(1000, S0).unwrap_err(),
        AllocError::Poisoned {
            operation: "malloc"
        }
    );
    assert!(alloc.free(first).is_err());
    drop(alloc);
    assert_eq!(device.live_segments().len(), 1, "left to the device");
    assert_eq!(device.counters().frees, 0);
}

/// A panic on one thread is seen by the next operation on another (the mark is set before
/// the lock is released).
#[test]
fn the_poison_is_seen_from_another_thread() {
    let (alloc, device) = allocator(1 << 30, "");
    let alloc = std::sync::Arc::new(alloc);
    let a = alloc.malloc(1000, S0).unwrap();
    alloc.record_stream(&a, S1).unwrap();
    device.panic_next(SimCall::RecordEvent);
    let worker = alloc.clone();
    let joined = std::thread::spawn(move || worker.free(a)).join();
    assert!(joined.is_err(), "the free panicked on its thread");
    assert!(matches!(
        alloc.malloc(1000, S1),
        Err(AllocError::Poisoned { operation: "free" })
    ));
}

/// Without a panic nothing is poisoned: a device error is an ordinary error.
#[test]
fn an_injected_error_does_not_poison() {
    let (alloc, device) = allocator(1 << 30, "");
    device.fail_next(SimCall::Allocate);
    assert!(matches!(alloc.malloc(1000, S0), Err(AllocError::Device(_))));
    assert_eq!(alloc.poisoned(), None);
    let a = alloc.malloc(1000, S0).unwrap();
    alloc.free(a).unwrap();
}
