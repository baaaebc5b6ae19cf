//! Dropping an allocator returns its cached segments to the device and leaves only the
//! segments that still hold a live allocation.

use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator, MIB};
use burn_caching_alloc::device::StreamId;
use burn_caching_alloc::device::metered::Metered;
use burn_caching_alloc::device::sim::SimDevice;

#[test]
fn drop_returns_every_segment_without_a_live_block() {
    let device = Metered::new(SimDevice::new(1 << 34));
    let meter = device.meter();
    let alloc = CachingAllocator::new(device, AllocatorConfig::default());
    let s = StreamId(0);
    // Three segments: a small one (2 MiB), a shared large one (20 MiB), one of its own (64 MiB).
    let small = alloc.malloc(1000, s).unwrap();
    let mid = alloc.malloc(5 * MIB, s).unwrap();
    let big = alloc.malloc(64 * MIB, s).unwrap();
    assert_eq!(meter.allocs(), 3);
    alloc.free(small).unwrap();
    alloc.free(big).unwrap();
    // `mid` stays live: its 20 MiB segment cannot be returned.
    drop(alloc);
    assert_eq!(mid.size(), 5 * MIB);
    assert_eq!(
        meter.frees(),
        2,
        "the cached small and 64 MiB segments go back"
    );
    assert_eq!(
        meter.bytes_in_use(),
        20 * MIB,
        "only the live block's segment is left"
    );
}

#[test]
fn drop_of_an_idle_allocator_returns_everything() {
    let device = Metered::new(SimDevice::new(1 << 34));
    let meter = device.meter();
    let alloc = CachingAllocator::new(device, AllocatorConfig::default());
    for size in [512, 3 * MIB, 100 * MIB] {
        let a = alloc.malloc(size, StreamId(1)).unwrap();
        alloc.free(a).unwrap();
    }
    drop(alloc);
    assert_eq!(meter.allocs(), meter.frees());
    assert_eq!(meter.bytes_in_use(), 0);
}
