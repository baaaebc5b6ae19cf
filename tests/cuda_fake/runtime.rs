//! `CachingCudaRuntime` through CubeCL's client on fake device 0: what is written reads back
//! exactly, a copy to the same device, statistics after each step, `empty_cache` handing
//! segments back to the driver, pinned staging for large writes and reads.

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::backend;
use burn_caching_alloc::cuda::CachingCudaRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use parking_lot::Mutex;

use crate::MIB;
use crate::fake_cuda::{Driver, fake_or_skip};

/// The tests of this file share device 0 (one engine per device per process): one at a time.
static DEVICE_0: Mutex<()> = Mutex::new(());

fn device() -> CudaDevice {
    CudaDevice::new(0)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn finish(driver: &Driver) {
    if let Some(fake) = driver.fake() {
        fake.assert_no_violations();
    }
}

#[test]
fn what_is_written_reads_back_exactly_small_and_large_with_statistics_after_each_step() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_0.lock();
    let _real = driver.real_turn();
    let device = device();
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
    backend::empty_cache(&device);
    let before = backend::memory_stats(&device).engine;

    // Small (pageable write), large (pinned staging: over 64 KiB), and one over a MiB.
    let small = pattern(3000, 1);
    let medium = pattern(200_000, 2);
    let large = pattern(3 * MIB as usize + 17, 3);
    let handles: Vec<_> = [&small, &medium, &large]
        .iter()
        .map(|data| client.create(Bytes::from_bytes_vec((*data).clone())))
        .collect();
    let stats = backend::memory_stats(&device).engine;
    // Three live blocks: the two small ones exactly their 512-byte roundings, the large one
    // at least its request (the default rounding may take more).
    assert_eq!(
        stats.allocation.all.current - before.allocation.all.current,
        3
    );
    assert_eq!(
        stats.allocated_bytes.small_pool.current - before.allocated_bytes.small_pool.current,
        3072 + 200_192
    );
    assert!(
        stats.allocated_bytes.large_pool.current - before.allocated_bytes.large_pool.current
            >= (3 * MIB + 17).next_multiple_of(512)
    );

    if let Some(fake) = driver.fake() {
        // Device 0 has virtual memory and no configuration chose: expandable segments are the
        // default there, so the blocks are in mapped pages, none from cuMemAlloc.
        let live = fake.live(0);
        assert_eq!(live.allocated, 0, "{live:?}");
        assert!(
            live.created >= stats.allocated_bytes.all.current,
            "{live:?}"
        );
    }

    let back = client.read(handles.clone());
    assert_eq!(back[0].to_vec(), small);
    assert_eq!(back[1].to_vec(), medium);
    assert_eq!(back[2].to_vec(), large);

    drop(handles);
    drop(back);
    client.sync_collective();
    let _ = cubecl_common::future::block_on(client.sync());
    backend::empty_cache(&device);
    let after = backend::memory_stats(&device).engine;
    assert_eq!(
        after.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    assert_eq!(
        after.reserved_bytes.all.current, before.reserved_bytes.all.current,
        "empty_cache gave the segments back"
    );
    if let Some(fake) = driver.fake() {
        let live = fake.live(0);
        assert_eq!(
            live.allocated + live.created,
            after.reserved_bytes.all.current,
            "the fake holds exactly what the engine reserves"
        );
    }
    finish(&driver);
}

/// Writes over 64 KiB go through pinned staging buffers held until the event after their copy
/// (`src/cuda/staging.rs`, `src/cuda/in_flight.rs`), reads of several buffers copy into pinned
/// memory together. Under the delayed schedule no copy has run when the next write takes a
/// staging buffer, so a buffer handed out again too early shows as wrong bytes; under every
/// mode the values are exact and the fake reports nothing.
#[test]
fn large_writes_and_reads_through_pinned_staging_are_exact_with_copies_still_queued() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_0.lock();
    let _real = driver.real_turn();
    let device = device();
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
    for (round, mode) in crate::fake_cuda::SCHEDULES.into_iter().enumerate() {
        if let Some(fake) = driver.fake() {
            fake.set_schedule(mode, 11 + round as u64);
        }
        let data: Vec<Vec<u8>> = (0..12)
            .map(|i| pattern((1 << 20) + i * 4096 + 100, (i as u8) ^ (round as u8 * 50)))
            .collect();
        let handles: Vec<_> = data
            .iter()
            .map(|d| client.create(Bytes::from_bytes_vec(d.clone())))
            .collect();
        // One read of all twelve, then each again on its own.
        let back = client.read(handles.clone());
        for (i, (got, want)) in back.iter().zip(&data).enumerate() {
            assert!(got.to_vec() == *want, "{mode:?}: buffer {i} read together");
        }
        for (i, handle) in handles.iter().enumerate() {
            let one = client.read(vec![handle.clone()]).remove(0);
            assert!(one.to_vec() == data[i], "{mode:?}: buffer {i} read alone");
        }
        if let Some(fake) = driver.fake() {
            fake.assert_no_violations();
        }
    }
}

/// Issue 33: a device that cannot open (here an index past the fake's ten devices) made
/// CubeCL's device thread panic and the caller see `RecvError`. `backend::open` returns why,
/// on the caller's thread, the same error on every try; `Runtime::client` panics with it.
#[test]
fn a_device_past_the_last_one_is_an_error_for_the_caller_not_a_dead_thread() {
    let Some(driver) = fake_or_skip() else { return };
    let missing = CudaDevice::new(10);
    let err = backend::open(&missing).expect_err("there is no eleventh device");
    let text = err.to_string();
    assert!(
        text.contains("cuDeviceGet") || text.contains("device"),
        "{text}"
    );
    assert_eq!(backend::open(&missing), Err(err.clone()));
    let panic = std::panic::catch_unwind(|| CachingCudaRuntime::client(&missing))
        .err()
        .expect("client panics on the caller's thread");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains(&err.to_string()), "{message}");
    finish(&driver);
}

/// A copy from device 0 to itself (`to_client_tensor` from a client to itself: the server's
/// `send` and `recv`, `cuMemcpyDtoDAsync` in one context from a staging block) arrives exact
/// in a new block of the same allocator, under every scheduler mode, and the source is
/// untouched.
#[test]
fn a_copy_to_the_same_device_is_exact_under_every_schedule() {
    use cubecl_ir::{ElemType, FloatKind};
    use cubecl_runtime::server::CopyDescriptor;

    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_0.lock();
    let _real = driver.real_turn();
    let device = device();
    let modes: &[crate::fake_cuda::Schedule] = match driver.fake() {
        Some(_) => &crate::fake_cuda::SCHEDULES,
        None => &[crate::fake_cuda::Schedule::Eager],
    };
    for (round, mode) in modes.iter().enumerate() {
        if let Some(fake) = driver.fake() {
            fake.set_schedule(*mode, round as u64);
        }
        let mut client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
        let data = pattern(4096 * 4, round as u8);
        let source = client.create(Bytes::from_bytes_vec(data.clone()));
        client.flush().expect("flush");
        let before = backend::memory_stats(&device).memory_allocated();
        let desc = CopyDescriptor::new(source.clone().binding(), [4096].into(), [1].into(), 4);
        let same = client.clone();
        let copy = client.to_client_tensor(desc, &same, ElemType::Float(FloatKind::F32));
        assert_eq!(
            client.read_one(copy.clone()).expect("read").to_vec(),
            data,
            "{mode:?}"
        );
        // 16 KiB, in a block of its own beside the live source.
        assert_eq!(
            backend::memory_stats(&device).memory_allocated() - before,
            16 * 1024,
            "{mode:?}"
        );
        assert_eq!(client.read_one(source).expect("read").to_vec(), data);
        drop(copy);
    }
    backend::empty_cache(&device);
    finish(&driver);
}
