//! `CudaMemory` under the engine, without CubeCL: segments from `cuMemAlloc` on fake device 3
//! (no virtual memory), expandable segments on fake device 5 (virtual memory, 2 MiB
//! granularity), and a server and an allocator dropped leaving nothing on the device.

use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator};
use burn_caching_alloc::cuda::{CudaDriver, CudaMemory};
use burn_caching_alloc::device::{DeviceMemory, DeviceStream};
use burn_caching_alloc::runtime::{CachingServer, Driver as _};
use cubecl_common::device::DeviceId;
use cudarc::driver::result;

use crate::MIB;
use crate::fake_cuda::{Schedule, fake_or_skip};

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Device memory `ptr` holds what was written (synchronous copies).
fn roundtrip(ptr: u64, data: &[u8]) {
    let mut back = vec![0u8; data.len()];
    // SAFETY: `ptr` addresses at least `data.len()` bytes of a live block; the context is
    // current (the memory bound it).
    unsafe {
        result::memcpy_htod_sync(ptr, data).expect("upload");
        result::memcpy_dtoh_sync(&mut back, ptr).expect("download");
    }
    assert!(back == data, "the block returns what was written");
}

#[test]
fn segments_hold_data_and_the_dropped_allocator_leaves_nothing_on_the_device() {
    let Some(driver) = fake_or_skip() else { return };
    let _real = driver.real_turn();
    let memory = CudaMemory::new(driver.ordinal(3)).expect("device 3");
    if driver.fake().is_some() {
        assert_eq!(
            memory.virtual_memory_granularity(),
            None,
            "device 3 has no virtual memory"
        );
    }
    let alloc = CachingAllocator::new(memory, AllocatorConfig::default()).expect("allocator");
    let small = alloc.malloc(3000, DeviceStream(0)).expect("small");
    let large = alloc.malloc(5 * MIB, DeviceStream(1)).expect("large");
    roundtrip(small.address(), &pattern(3000, 1));
    roundtrip(large.address(), &pattern(5 * MIB, 2));
    let reserved = alloc.stats().memory_reserved();
    // A 2 MiB small segment and a large one of at least 5 MiB.
    assert!(reserved >= 7 * MIB, "{reserved}");
    if let Some(fake) = driver.fake() {
        assert_eq!(
            fake.live(3).allocated,
            reserved,
            "the fake holds what the engine reserves"
        );
    }
    alloc.free(small).expect("free");
    alloc.free(large).expect("free");
    assert_eq!(alloc.empty_cache().expect("empty_cache"), reserved);
    if let Some(fake) = driver.fake() {
        assert_eq!(fake.live(3).allocated, 0);
    }
    let again = alloc.malloc(MIB, DeviceStream(0)).expect("again");
    alloc.free(again).expect("free");
    // Cached, not given back: the allocator's drop gives it back.
    if let Some(fake) = driver.fake() {
        assert!(fake.live(3).allocated > 0);
    }
    drop(alloc);
    if let Some(fake) = driver.fake() {
        assert_eq!(
            fake.live(3).allocated,
            0,
            "dropping the allocator gave its segments back"
        );
        fake.assert_no_violations();
    }
}

#[test]
fn expandable_segments_map_grow_and_unmap_on_the_granularity_on_two_streams() {
    let Some(driver) = fake_or_skip() else { return };
    let _real = driver.real_turn();
    let memory = CudaMemory::new(driver.ordinal(5)).expect("device 5");
    let granularity = memory
        .virtual_memory_granularity()
        .expect("device 5 has virtual memory");
    assert_eq!(granularity, 2 * MIB);
    let config = AllocatorConfig::parse("expandable_segments:True").expect("config");
    let alloc = CachingAllocator::new(memory, config).expect("allocator");
    for mode in crate::fake_cuda::SCHEDULES {
        if let Some(fake) = driver.fake() {
            fake.set_schedule(mode, 7);
        }
        let a = alloc.malloc(30 * MIB, DeviceStream(0)).expect("30 MiB");
        let b = alloc.malloc(25 * MIB, DeviceStream(0)).expect("25 MiB");
        assert_eq!(
            b.address(),
            a.address() + 30 * MIB,
            "one range, grown in place"
        );
        // Another stream: a range of its own.
        let c = alloc.malloc(3 * MIB, DeviceStream(1)).expect("3 MiB");
        let data = pattern(55 * MIB, 3);
        roundtrip(a.address(), &data);
        roundtrip(c.address(), &pattern(3 * MIB, 4));
        if let Some(fake) = driver.fake() {
            let live = fake.live(5);
            assert_eq!(live.created, alloc.stats().memory_reserved(), "{mode:?}");
            assert_eq!(live.created % granularity, 0);
        }
        alloc.free(a).expect("free");
        alloc.free(b).expect("free");
        alloc.free(c).expect("free");
        alloc.empty_cache().expect("empty_cache");
        assert_eq!(alloc.stats().memory_reserved(), 0, "{mode:?}");
        if let Some(fake) = driver.fake() {
            assert_eq!(
                fake.live(5).created,
                0,
                "{mode:?}: every page unmapped and released"
            );
            fake.assert_no_violations();
        }
    }
    drop(alloc);
    if let Some(fake) = driver.fake() {
        let live = fake.live(5);
        assert_eq!((live.allocated, live.created), (0, 0));
        fake.assert_no_violations();
    }
}

#[test]
fn a_dropped_server_leaves_nothing_allocated_on_its_device() {
    let Some(driver) = fake_or_skip() else { return };
    let Some(fake) = driver.fake() else {
        crate::fake_cuda::fake_only("needs the fake's count of what a device holds");
        return;
    };
    if !crate::child::in_child(
        "memory::a_dropped_server_leaves_nothing_allocated_on_its_device",
        &[],
    ) {
        return;
    }
    fake.set_schedule(Schedule::Delayed, 3);
    let id = DeviceId {
        type_id: 0,
        index_id: 3,
    };
    let server = CachingServer::new(
        CudaDriver::open(id).expect("driver"),
        id,
        AllocatorConfig::default(),
    )
    .expect("server");
    let allocator = server.allocator().clone();
    let block = allocator.malloc(4 * MIB, DeviceStream(0)).expect("4 MiB");
    roundtrip(block.address(), &pattern(4 * MIB, 5));
    allocator.free(block).expect("free");
    drop(allocator);
    assert!(fake.live(3).allocated > 0, "the freed block stays cached");
    drop(server);
    let leaks = fake.leaks();
    assert_eq!(
        fake.live(3).allocated,
        0,
        "the server's cached segments went back: {leaks:#?}"
    );
    assert!(
        !leaks.iter().any(|l| l.contains("cuStreamCreate")
            || l.contains("cuEventCreate")
            || l.contains("cuMemHostAlloc")),
        "streams, events and pinned buffers were destroyed: {leaks:#?}"
    );
    fake.assert_no_violations();
}
