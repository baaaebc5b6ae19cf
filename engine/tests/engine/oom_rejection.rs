//! `throw_on_cudamalloc_oom` (PyTorch 2.12's preemptive rejection, pytorch/pytorch#179473):
//! with a memory fraction below 1, a request whose new device memory would take reserved
//! memory over the cap fails at once in `alloc_block`, before the oversize release and the
//! cache flush, counted in `num_oom_rejections`, and the out-of-memory observers see why.

use std::sync::{Arc, Mutex};

use crate::common::*;
use caching_alloc_engine::alloc::{AllocError, Allocation, CachingAllocator, TraceEvent};
use caching_alloc_engine::device::sim::SimDevice;

/// 30 MiB live and a cached 20 MiB segment under a 60 MiB cap (0.6 of 100 MiB); a 22 MiB
/// request fits no cached block and needs a new 22 MiB segment: over the cap, and under it
/// once the cache is flushed.
fn at_the_cap(settings: &str) -> (CachingAllocator<SimDevice>, SimDevice, Allocation<u64>) {
    let (alloc, device) = allocator(100 * MIB, settings);
    let live = alloc.malloc(30 * MIB, S0).unwrap();
    let cached = alloc.malloc(5 * MIB, S0).unwrap();
    alloc.free(cached).unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 50 * MIB);
    (alloc, device, live)
}

#[test]
fn a_request_over_the_cap_fails_at_once_without_flushing_the_cache() {
    let (alloc, device, live) = at_the_cap(
        "per_process_memory_fraction:0.6,throw_on_cudamalloc_oom:true,record_history:true",
    );
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    alloc.on_out_of_memory(move |err| log.lock().unwrap().push(err.to_string()));

    let err = alloc.malloc(22 * MIB, S0).unwrap_err();
    assert_eq!(
        err,
        AllocError::Rejected {
            requested: 22 * MIB,
            needed: 22 * MIB,
            reserved: 50 * MIB,
            allocated: 30 * MIB,
            limit: 60 * MIB,
            device_total: 100 * MIB,
        }
    );
    assert!(err.is_out_of_memory());
    let stats = alloc.stats();
    assert_eq!(stats.num_oom_rejections, 1);
    assert_eq!(
        stats.num_ooms, 0,
        "a rejection is not counted as an out-of-memory"
    );
    assert_eq!(stats.num_alloc_retries, 0, "no flush and retry");
    assert_eq!(stats.num_device_free, 0, "the cached segment stays");
    assert_eq!(stats.memory_reserved(), 50 * MIB);
    assert_eq!(
        device.counters().failed_allocs,
        0,
        "the device was never asked"
    );
    assert!(matches!(
        alloc.trace().events.last(),
        Some(TraceEvent::Oom { size, .. }) if *size == 22 * MIB
    ));
    alloc.wait_for_oom_observers();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].contains("throw_on_cudamalloc_oom"), "{}", seen[0]);
    assert!(seen[0].contains("cache was not flushed"), "{}", seen[0]);

    // What fits the cache is still served: 5 MiB takes the cached 20 MiB segment.
    let fits = alloc.malloc(5 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().num_oom_rejections, 1);
    alloc.free(fits).unwrap();
    alloc.free(live).unwrap();
    check_invariants(&alloc, &device);
}

/// The same request without the key: the cache is flushed, the request retried and served
/// (PyTorch's default order).
#[test]
fn without_the_key_the_cache_is_flushed_and_the_request_served() {
    let (alloc, device, live) = at_the_cap("per_process_memory_fraction:0.6");
    let served = alloc.malloc(22 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        (
            stats.num_oom_rejections,
            stats.num_alloc_retries,
            stats.num_device_free
        ),
        (0, 1, 1)
    );
    alloc.free(served).unwrap();
    alloc.free(live).unwrap();
    check_invariants(&alloc, &device);
}

/// Without a memory fraction (or with 1.0) the key changes nothing: a device out-of-memory
/// still frees the cache and retries before it fails.
#[test]
fn without_a_fraction_the_key_changes_nothing() {
    let (alloc, device) = allocator(64 * MIB, "throw_on_cudamalloc_oom:true");
    let live = alloc.malloc(30 * MIB, S0).unwrap();
    let cached = alloc.malloc(5 * MIB, S0).unwrap();
    alloc.free(cached).unwrap();
    let served = alloc.malloc(30 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!((stats.num_oom_rejections, stats.num_alloc_retries), (0, 1));
    alloc.free(served).unwrap();
    alloc.free(live).unwrap();
    check_invariants(&alloc, &device);
}

/// The key changes at run time like any other: on, a rejection; off, the flush serves it.
#[test]
fn the_key_can_be_turned_on_and_off_at_run_time() {
    let (alloc, device, live) = at_the_cap("per_process_memory_fraction:0.6");
    alloc
        .set_allocator_settings("throw_on_cudamalloc_oom:True")
        .unwrap();
    assert!(matches!(
        alloc.malloc(22 * MIB, S0),
        Err(AllocError::Rejected { .. })
    ));
    alloc
        .set_allocator_settings("throw_on_cudamalloc_oom:False")
        .unwrap();
    let served = alloc.malloc(22 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().num_oom_rejections, 1);
    alloc.free(served).unwrap();
    alloc.free(live).unwrap();
    check_invariants(&alloc, &device);
}
