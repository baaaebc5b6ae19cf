//! PyTorch's `record_stream` rule through CubeCL's client on fake device 4, from several
//! threads (each thread is its own CubeCL stream, so its own CUDA stream): a buffer written on
//! one thread's stream and read on another's by its last user is not handed to the first
//! thread's next tensor of that size before the read's copy ran. Run under every scheduler mode
//! with 20 seeds each; the bytes are checked, and the fake's race detector (which does not
//! depend on the order work ran in) must have nothing to report.
//!
//! PyTorch: `CUDACachingAllocator.cpp`, `recordStream` and `insert_events` /
//! `process_events` (a block used on another stream is reused only after an event recorded
//! there at free time completed).

use std::sync::mpsc::channel;

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::cuda::CachingCudaRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;
use parking_lot::Mutex;

use crate::fake_cuda::{SCHEDULES, fake_or_skip};

/// The tests of this file share device 4: one at a time.
static DEVICE_4: Mutex<()> = Mutex::new(());

const SEEDS: u64 = 20;

/// One round: the producer writes `a`, hands it to the reader, which reads it as its last
/// user; at once the producer allocates the same size again and writes `b` into it. Returns
/// what the reader read and what the producer's second buffer holds.
fn round(device: &CudaDevice, size: usize, a: u8, b: u8) -> (Vec<u8>, Vec<u8>) {
    let (to_reader, at_reader) = channel();
    let (to_producer, at_producer) = channel();
    let reader_device = device.clone();
    let reader = std::thread::spawn(move || {
        let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&reader_device);
        let handle = at_reader.recv().expect("the producer's buffer");
        let copy = client.read_async(vec![handle]);
        to_producer.send(()).expect("the producer waits");
        let bytes = cubecl_common::future::block_on(copy).expect("read");
        bytes.into_iter().next().expect("one buffer").to_vec()
    });
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(device);
    let first = client.create(Bytes::from_bytes_vec(vec![a; size]));
    to_reader.send(first).expect("the reader waits");
    at_producer.recv().expect("the read was issued");
    let second = client.create(Bytes::from_bytes_vec(vec![b; size]));
    let read = reader.join().expect("the reader thread");
    let again = client.read(vec![second]).remove(0).to_vec();
    (read, again)
}

#[test]
fn a_read_on_another_stream_is_never_overwritten_by_the_next_tensor_under_every_schedule() {
    let Some(driver) = fake_or_skip() else { return };
    let _turn = DEVICE_4.lock();
    let _real = driver.real_turn();
    let device = CudaDevice::new(driver.ordinal(4));
    // Sizes on both sides of the pinned-staging threshold (64 KiB) and a large-pool size.
    let sizes = [4096usize, 256 << 10, 3 << 20];
    let mut rounds = 0;
    for mode in SCHEDULES {
        for seed in 0..SEEDS {
            if let Some(fake) = driver.fake() {
                fake.set_schedule(mode, seed);
            }
            let size = sizes[(seed as usize) % sizes.len()];
            let (a, b) = (0xA0 | (seed as u8 & 0xF), 0x30 | (seed as u8 & 0xF));
            let (read, again) = round(&device, size, a, b);
            let wrong = read.iter().filter(|byte| **byte != a).count();
            assert_eq!(
                wrong, 0,
                "{mode:?}, seed {seed}, {size} bytes: {wrong} bytes of the read were not what \
                 was written (overwritten by the next tensor, or read before the write ran)"
            );
            assert!(
                again.iter().all(|byte| *byte == b),
                "{mode:?}, seed {seed}: the second tensor"
            );
            if let Some(fake) = driver.fake() {
                fake.assert_no_violations();
            }
            rounds += 1;
        }
    }
    assert_eq!(rounds, 3 * SEEDS);
}

/// Rounds of two to four threads (a data loader's workers), each creating buffers of its own
/// patterns, reading them back without waiting and dropping them, then exiting: the next
/// rounds' threads take the gone threads' slots (they report their exit), and a round with
/// more threads than the last has streams with nothing cached, served by the free parts of
/// the others' segments (`cross_stream_reuse`: whole segments, lent blocks). Under every
/// scheduler mode, 6 seeds each: every byte read back is the byte written, the fake's race
/// detector has nothing to report, and memory did cross streams. In a child process, so that
/// device 4 opens without expandable segments (which turn sharing off).
#[test]
fn threads_that_come_and_go_reuse_each_others_memory_with_values_exact_under_every_schedule() {
    let Some(driver) = fake_or_skip() else { return };
    if !crate::child::in_child(
        "cross_stream::threads_that_come_and_go_reuse_each_others_memory_with_values_exact_under_every_schedule",
        &[(
            "BURN_CACHING_ALLOC_CONF",
            Some(std::ffi::OsStr::new("expandable_segments:False")),
        )],
    ) {
        return;
    }
    let _turn = DEVICE_4.lock();
    let _real = driver.real_turn();
    let device = CudaDevice::new(driver.ordinal(4));
    let sizes = [4096usize, 100 << 10, 700 << 10, 3 << 20];
    let mut rounds = 0u64;
    for mode in SCHEDULES {
        for seed in 0..6u64 {
            if let Some(fake) = driver.fake() {
                fake.set_schedule(mode, seed);
            }
            let threads = 2 + (rounds % 3) as usize;
            let start = std::sync::Arc::new(std::sync::Barrier::new(threads));
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let (device, start) = (device.clone(), start.clone());
                    std::thread::spawn(move || {
                        let client: ComputeClient<CachingCudaRuntime> =
                            CachingCudaRuntime::client(&device);
                        start.wait();
                        let reads: Vec<_> = (0..sizes.len())
                            .map(|j| {
                                let size = sizes[(j + t + seed as usize) % sizes.len()];
                                let byte =
                                    (rounds as u8).wrapping_mul(31) ^ (t as u8) << 4 ^ j as u8;
                                let handle = client.create(Bytes::from_bytes_vec(vec![byte; size]));
                                // The handle goes with the read: its memory is free for the
                                // next tensor once the read is issued.
                                (byte, client.read_async(vec![handle]))
                            })
                            .collect();
                        for (byte, read) in reads {
                            let bytes = cubecl_common::future::block_on(read).expect("read");
                            let bytes = bytes.into_iter().next().expect("one buffer");
                            let wrong = bytes.iter().filter(|b| **b != byte).count();
                            assert_eq!(wrong, 0, "thread {t}: {wrong} bytes not {byte:#x}");
                        }
                    })
                })
                .collect();
            for worker in workers {
                worker
                    .join()
                    .unwrap_or_else(|_| panic!("{mode:?}, seed {seed}: a thread failed"));
            }
            if let Some(fake) = driver.fake() {
                fake.assert_no_violations();
            }
            rounds += 1;
        }
    }
    let map = burn_caching_alloc::backend::memory_stats(&device).to_map();
    let key = |k: &str| map.get(k).copied().unwrap_or(0);
    println!(
        "{rounds} rounds: slot reuses {}, segments shared {}, blocks lent {}, device allocations {}",
        key("cubecl.slot_reuses"),
        key("num_stream_shares"),
        key("num_stream_lends"),
        key("num_device_alloc"),
    );
    assert!(
        key("cubecl.slot_reuses") > 0,
        "no thread took a gone thread's slot"
    );
    assert!(
        key("num_stream_shares") + key("num_stream_lends") > 0,
        "no memory crossed streams"
    );
}
