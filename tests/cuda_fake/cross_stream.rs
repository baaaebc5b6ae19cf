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
