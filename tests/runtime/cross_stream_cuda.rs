//! Stream-ordered reuse on a real CUDA device (PyTorch's `recordStream` rule): a buffer made on
//! one thread's stream and read on another's, by its last user, is not handed to the first
//! thread's next tensor of that size before the read's copy has completed. Ignored by default
//! ("needs a CUDA device"); `scripts/gpu-check.sh` runs it with `--include-ignored`.

use std::sync::mpsc::channel;

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::cuda::CachingCudaRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_runtime::runtime::Runtime;

use crate::burn_mlp_cuda::cuda_turn;

const SIZE: usize = 256 << 20;

#[test]
#[ignore = "needs a CUDA device"]
fn a_read_on_another_stream_returns_what_was_written_although_the_producer_reallocates_at_once() {
    let Some(_turn) = cuda_turn() else {
        return;
    };
    let device = CudaDevice::default();
    let (to_reader, at_reader) = channel();
    let (to_producer, at_producer) = channel();
    let reader_device = device.clone();
    let reader = std::thread::spawn(move || {
        // Its own thread: its own CubeCL stream, so its own stream slot.
        let client = CachingCudaRuntime::client(&reader_device);
        let handle = at_reader.recv().expect("the producer's buffer");
        // The last user: the read takes the only handle left.
        let copy = client.read_async(vec![handle]);
        to_producer.send(()).expect("the producer waits");
        let bytes = cubecl_common::future::block_on(copy).expect("read");
        bytes.into_iter().next().expect("one buffer")
    });
    let client = CachingCudaRuntime::client(&device);
    let first = client.create(Bytes::from_bytes_vec(vec![0xA5u8; SIZE]));
    to_reader.send(first).expect("the reader waits");
    at_producer.recv().expect("the read was issued");
    // At once, the same size again: CubeCL's exact-size cache would hand out the first
    // buffer's slice, and this write would race the other stream's copy out of it.
    let second = client.create(Bytes::from_bytes_vec(vec![0x3Cu8; SIZE]));
    let read = reader.join().expect("the reader thread");
    assert_eq!(read.len(), SIZE);
    let wrong = read.iter().filter(|byte| **byte != 0xA5).count();
    assert_eq!(
        wrong, 0,
        "{wrong} bytes of the read were overwritten by the next tensor"
    );
    let again = client.read(vec![second]);
    assert!(
        again[0].iter().all(|byte| *byte == 0x3C),
        "the second tensor's bytes"
    );
}
