//! `CudaMemory` under the engine, without CubeCL: segments from `cuMemAlloc` on fake device 3
//! (no virtual memory), expandable segments on fake device 5 (virtual memory, 2 MiB
//! granularity), and a server and an allocator dropped leaving nothing on the device.

use burn_caching_alloc::alloc::{Allocation, AllocatorConfig, CachingAllocator};
use burn_caching_alloc::cuda::{CudaDriver, CudaMemory, CudaStream};
use burn_caching_alloc::device::{DeviceMemory, DeviceStream};
use burn_caching_alloc::runtime::{CachingServer, Driver as _, Resource};
use cubecl_common::device::DeviceId;
use cudarc::driver::result;

use crate::MIB;

/// The tests of this file that open fake device 3 in this process count what it holds: one at
/// a time.
static DEVICE_3: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
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
    let _turn = DEVICE_3.lock();
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

/// The driver of fake device 3 and an engine with the default configuration over its memory
/// (the memory shares the driver's stream table, `CudaDriver::memory`).
fn device_3(driver: &crate::fake_cuda::Driver) -> (CudaDriver, CachingAllocator<CudaMemory>) {
    let id = DeviceId {
        type_id: 0,
        index_id: driver.ordinal(3) as u16,
    };
    let mut cuda = CudaDriver::open(id).expect("driver");
    let memory = cuda.memory();
    let alloc = CachingAllocator::new(memory, AllocatorConfig::default()).expect("allocator");
    (cuda, alloc)
}

/// Where the driver finds the first `len` bytes of `block`.
fn resource(
    block: &Allocation<<CudaMemory as DeviceMemory>::Handle>,
    len: u64,
) -> Resource<CudaDriver> {
    Resource::<CudaDriver> {
        segment: *block.segment(),
        offset: block.offset(),
        size: len,
    }
}

/// Writes `data` into `block` on `stream` and reads it back there.
///
/// # Safety
/// `block` is live, at least `data.len()` bytes long, and stays allocated until this returns.
unsafe fn write_and_read_back(
    cuda: &mut CudaDriver,
    stream: &mut CudaStream,
    block: &Allocation<<CudaMemory as DeviceMemory>::Handle>,
    data: &[u8],
) -> Vec<u8> {
    let len = data.len() as u64;
    // SAFETY: the caller's block, read before it returns.
    let back = unsafe {
        cuda.write(stream, &resource(block, len), data)
            .expect("the write");
        cubecl_common::future::block_on(cuda.read(stream, vec![(resource(block, len), data.len())]))
    };
    back.expect("the read")[0].to_vec()
}

/// The engine hands a segment freed behind queued work to another stream behind a device-side
/// wait (issue 50, RMM's `get_block_from_other_stream` behind `cudaStreamWaitEvent`), through
/// the driver alone: stream 0 writes 64 KiB into a 3 MiB block and the engine frees it at
/// once, its copy maybe still queued; stream 1's request takes that very segment (no new `cuMemAlloc`),
/// writes its own bytes and reads them back. Under every scheduler mode, 6 seeds each: stream
/// 1 reads what it wrote, and the fake's race detector (which sees every access of queued work
/// and every `cuStreamWaitEvent`) has nothing to report. With the wait taken out of the
/// engine (`hand_over` in `engine/src/alloc/engine/sharing.rs`) the detector reports stream
/// 1's write racing stream 0's.
#[test]
fn a_segment_freed_behind_queued_work_serves_another_stream_behind_a_device_wait() {
    let Some(driver) = fake_or_skip() else { return };
    let _real = driver.real_turn();
    let _turn = DEVICE_3.lock();
    let (mut cuda, alloc) = device_3(&driver);
    let (s0, s1) = (DeviceStream(0), DeviceStream(1));
    let (mut stream0, mut stream1) = (cuda.create_stream(s0), cuda.create_stream(s1));
    const SIZE: u64 = 3 * MIB;
    let mut taken = 0;
    for mode in crate::fake_cuda::SCHEDULES {
        for seed in 0..6u64 {
            if let Some(fake) = driver.fake() {
                fake.set_schedule(mode, seed);
            }
            let first = alloc.malloc(SIZE, s0).expect("stream 0's block");
            let address = first.address();
            // A write the driver copies from pageable memory (at most 64 KiB): queued on
            // stream 0 with no event of the driver's own, so nothing but the engine's fence
            // tells the host when it ran.
            // SAFETY: the block is live and at least 64 KiB long; the engine keeps it from
            // other streams until its free is ordered after stream 0's work.
            unsafe {
                cuda.write(
                    &mut stream0,
                    &resource(&first, SIZE),
                    &pattern(64 * 1024, 1),
                )
            }
            .expect("stream 0 writes");
            alloc.free(first).expect("free");
            let mine = alloc.malloc(SIZE, s1).expect("stream 1's block");
            if mine.address() == address {
                taken += 1;
            }
            let data = pattern(SIZE, 2);
            // SAFETY: stream 1's live block of SIZE bytes, freed after the read.
            let back = unsafe { write_and_read_back(&mut cuda, &mut stream1, &mine, &data) };
            assert!(
                back == data,
                "{mode:?}, seed {seed}: stream 1 reads what it wrote"
            );
            if let Some(fake) = driver.fake() {
                fake.assert_no_violations();
            }
            alloc.free(mine).expect("free");
            cubecl_common::future::block_on(cuda.sync(&mut stream0)).expect("sync");
            alloc.empty_cache().expect("empty_cache");
        }
    }
    if driver.fake().is_some() {
        assert_eq!(taken, 18, "every round, stream 1 took stream 0's segment");
    }
}

/// A segment goes back to the device (`cuMemFree`, by `empty_cache`) only once the work queued
/// on it has completed: stream 0 queues a pageable 64 KiB copy into a block, the engine frees
/// the block and `empty_cache` returns its segment at once. `CudaMemory::free` synchronises the
/// context first when work was issued since the last synchronisation (`sync_before_release`);
/// without it the fake reports the free of memory that queued work still uses. Under every
/// scheduler mode, 4 seeds each.
#[test]
fn a_segment_with_queued_work_goes_back_to_the_device_only_after_that_work() {
    let Some(driver) = fake_or_skip() else { return };
    let _real = driver.real_turn();
    let _turn = DEVICE_3.lock();
    let (mut cuda, alloc) = device_3(&driver);
    let mut stream0 = cuda.create_stream(DeviceStream(0));
    for mode in crate::fake_cuda::SCHEDULES {
        for seed in 0..4u64 {
            if let Some(fake) = driver.fake() {
                fake.set_schedule(mode, seed);
            }
            let block = alloc.malloc(3 * MIB, DeviceStream(0)).expect("block");
            // SAFETY: the block is live and at least 64 KiB long; its segment goes back to the
            // device only after the copy (what this test checks).
            unsafe {
                cuda.write(
                    &mut stream0,
                    &resource(&block, 3 * MIB),
                    &pattern(64 * 1024, 7),
                )
            }
            .expect("stream 0 writes");
            alloc.free(block).expect("free");
            let released = alloc.empty_cache().expect("empty_cache");
            assert!(
                released >= 3 * MIB,
                "{mode:?}, seed {seed}: the segment went back"
            );
            if let Some(fake) = driver.fake() {
                assert_eq!(fake.live(3).allocated, 0, "{mode:?}, seed {seed}");
                fake.assert_no_violations();
            }
        }
    }
}

/// One source of truth for a stream (issue 49): when `cuStreamCreate` fails for a stream, the
/// server's driver issues that stream's work on the device's default stream, and the device
/// memory must record the engine's events for that stream there too, not on a stream a later
/// `cuStreamCreate` makes. Stream 5's creation fails once; stream 5 writes into a block that
/// the engine frees at once; stream 6 takes it behind a wait for an event recorded on stream
/// 5, which must follow the write: the fake's race detector reports nothing and stream 6 reads
/// what it wrote.
#[test]
fn a_stream_whose_creation_failed_is_the_default_stream_for_its_work_and_its_events() {
    let Some(driver) = fake_or_skip() else { return };
    let Some(fake) = driver.fake() else {
        crate::fake_cuda::fake_only("needs the fake's fault injection");
        return;
    };
    let _turn = DEVICE_3.lock();
    let (mut cuda, alloc) = device_3(&driver);
    let (s5, s6) = (DeviceStream(5), DeviceStream(6));
    fake.set_schedule(Schedule::Delayed, 1);
    fake.inject("cuStreamCreate", 1, false, 0);
    let mut stream5 = cuda.create_stream(s5);
    fake.clear_faults();
    let mut stream6 = cuda.create_stream(s6);
    const SIZE: u64 = 3 * MIB;
    let first = alloc.malloc(SIZE, s5).expect("stream 5's block");
    let address = first.address();
    // SAFETY: a live block of at least 64 KiB, kept from other streams until its free is
    // ordered after stream 5's work.
    unsafe {
        cuda.write(
            &mut stream5,
            &resource(&first, SIZE),
            &pattern(64 * 1024, 1),
        )
    }
    .expect("stream 5 writes");
    alloc.free(first).expect("free");
    let mine = alloc.malloc(SIZE, s6).expect("stream 6's block");
    assert_eq!(mine.address(), address, "stream 6 took stream 5's segment");
    let data = pattern(SIZE, 2);
    // SAFETY: stream 6's live block of SIZE bytes, freed after the read.
    let back = unsafe { write_and_read_back(&mut cuda, &mut stream6, &mine, &data) };
    assert!(back == data, "stream 6 reads what it wrote");
    fake.assert_no_violations();
    alloc.free(mine).expect("free");
    cubecl_common::future::block_on(cuda.sync(&mut stream5)).expect("sync");
    drop(alloc);
    fake.assert_no_violations();
}
