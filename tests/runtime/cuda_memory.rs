//! `CudaMemory` and the engine on a real CUDA device: segments, out-of-memory, events, and
//! reserved memory handed back to the driver. The tests are ignored by default (`cargo test`
//! lists them as ignored: "needs a CUDA device"); `scripts/gpu-check.sh` runs them with
//! `--include-ignored`. Run that way without CUDA, each prints why it skips.
//! Each test opens a `CudaMemory` of its own: they share no engine, so they run in parallel.

use crate::MIB;
use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator};
use burn_caching_alloc::cuda::{CudaMemory, cuda_available};
use burn_caching_alloc::device::{DeviceError, DeviceMemory, DeviceStream};
use cudarc::driver::result;

fn device() -> Option<CudaMemory> {
    if let Err(reason) = cuda_available() {
        eprintln!("skipping: {reason}");
        return None;
    }
    Some(CudaMemory::new(0).expect("CUDA is available, so device 0 opens"))
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_segment_holds_data_and_goes_back_to_the_driver() {
    let Some(mut memory) = device() else { return };
    let segment = memory
        .allocate(4 * MIB, DeviceStream(0))
        .expect("4 MiB on an idle GPU");
    assert_eq!(segment.size, 4 * MIB);
    assert_eq!(segment.address, segment.handle);
    assert_ne!(segment.address, 0);

    let data: Vec<u8> = (0..4 * MIB).map(|i| (i % 251) as u8).collect();
    let mut back = vec![0u8; data.len()];
    // SAFETY: the segment holds 4 MiB; the context is current after `allocate`.
    unsafe {
        result::memcpy_htod_sync(segment.handle, &data).expect("upload");
        result::memcpy_dtoh_sync(&mut back, segment.handle).expect("download");
    }
    assert!(back == data, "the segment returns what was written");
    // SAFETY: allocated above, freed once, the synchronous copies done.
    unsafe { memory.free(segment) }.expect("free");
}

#[test]
#[ignore = "needs a CUDA device"]
fn more_than_the_device_holds_is_out_of_memory_not_a_panic() {
    let Some(mut memory) = device() else { return };
    let total = memory.memory_info().expect("cuMemGetInfo").total;
    assert_eq!(total, memory.total_memory());
    let requested = total * 2;
    match memory.allocate(requested, DeviceStream(0)) {
        Err(err) => assert_eq!(err, DeviceError::OutOfMemory { requested }),
        Ok(segment) => panic!("allocated {requested} bytes on a {total}-byte device: {segment:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn events_come_from_the_pool_and_complete() {
    let Some(mut memory) = device() else { return };
    let created = memory.events_created();
    for _ in 0..200 {
        let event = memory.record_event(DeviceStream(7)).expect("record");
        memory.synchronize_event(&event).expect("synchronize");
        assert!(
            memory.query_event(&event).expect("query"),
            "done after sync"
        );
        memory.release_event(event);
    }
    assert_eq!(
        memory.events_created(),
        created,
        "recording reuses pooled events"
    );
    assert_eq!(
        memory.streams_created(),
        1,
        "one stream for DeviceStream(7)"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_context_follows_the_memory_to_another_thread() {
    let Some(memory) = device() else { return };
    let handle = std::thread::spawn(move || {
        let mut memory = memory;
        let segment = memory.allocate(MIB, DeviceStream(0))?;
        // SAFETY: allocated just above, freed once, never used.
        unsafe { memory.free(segment) }
    });
    handle
        .join()
        .expect("no panic")
        .expect("a fresh thread allocates after the context is made current");
}

#[test]
#[ignore = "needs a CUDA device"]
fn empty_cache_returns_segments_to_the_driver() {
    let Some(memory) = device() else { return };
    let allocator = CachingAllocator::new(memory, AllocatorConfig::default()).unwrap();
    let free_before = allocator.device_memory_info().expect("info").free;
    let blocks: Vec<_> = (0..8)
        .map(|_| allocator.malloc(8 * MIB, DeviceStream(0)).expect("8 MiB"))
        .collect();
    let stats = allocator.stats();
    assert!(stats.memory_reserved() >= 64 * MIB);
    let reserved = stats.memory_reserved();
    for block in blocks {
        allocator.free(block).expect("free");
    }
    assert_eq!(allocator.stats().memory_allocated(), 0);
    assert_eq!(
        allocator.stats().memory_reserved(),
        reserved,
        "cached, not freed"
    );
    let released = allocator.empty_cache().expect("empty_cache");
    assert_eq!(released, reserved);
    assert_eq!(allocator.stats().memory_reserved(), 0);
    let free_after = allocator.device_memory_info().expect("info").free;
    // Other processes may allocate meanwhile; this process gave back all it took.
    println!("device free: {free_before} B before, {free_after} B after");
}

/// Expandable segments on a real device: pages mapped into one range hold data, the range
/// grows, and `empty_cache` unmaps the pages and gives the range back.
#[test]
#[ignore = "needs a CUDA device"]
fn expandable_segments_map_pages_that_hold_data_and_give_them_back() {
    let Some(memory) = device() else { return };
    if memory.virtual_memory_granularity().is_none() {
        eprintln!("skipping: this CUDA device has no virtual memory management");
        return;
    }
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let alloc = CachingAllocator::new(memory, config).unwrap();
    let a = alloc.malloc(30 * MIB, DeviceStream(0)).expect("30 MiB");
    let b = alloc.malloc(25 * MIB, DeviceStream(0)).expect("25 MiB");
    assert_eq!(
        b.address(),
        a.address() + 30 * MIB,
        "one range, grown in place"
    );
    assert_eq!(alloc.stats().memory_reserved(), 60 * MIB);
    // The pages of both blocks, across the two mappings, hold data.
    let data: Vec<u8> = (0..55 * MIB).map(|i| (i % 253) as u8).collect();
    let mut back = vec![0u8; data.len()];
    // SAFETY: a's and b's blocks are contiguous and mapped: 55 MiB from a's address.
    unsafe {
        result::memcpy_htod_sync(a.address(), &data).expect("upload");
        result::memcpy_dtoh_sync(&mut back, a.address()).expect("download");
    }
    assert!(back == data, "the mapped pages return what was written");
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    alloc.empty_cache().unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.memory_reserved(), 0);
    assert_eq!((stats.num_device_alloc, stats.num_device_free), (2, 1));
}
