//! The fake NCCL (the fake driver's library linked as `libnccl.so.2`), loaded by name as our
//! code loads NCCL: communicators over two fake devices, operations queued on each rank's
//! stream and run once both ranks queued theirs, values exact for every reduction on several
//! data types, send/recv in a group, a communicator per thread through `ncclCommInitRank`, and a
//! rank that never calls reported as a deadlock instead of hanging. In a child process each
//! (the fake's devices 0 and 1, fresh).

use std::ffi::{c_int, c_void};

use cudarc::driver::{CudaContext, result, sys};

use crate::child::in_child;
use crate::fake_cuda::{Driver, Fake, fake_or_skip};

type Comm = *mut c_void;
type InitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> u32;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    sys::CUstream,
) -> u32;
type SendRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, sys::CUstream) -> u32;
type Group = unsafe extern "C" fn() -> u32;
type Destroy = unsafe extern "C" fn(Comm) -> u32;

fn fake_in_child(test: &str, envs: &[(&str, Option<&std::ffi::OsStr>)]) -> Option<Fake> {
    match fake_or_skip()? {
        Driver::Real => {
            crate::fake_cuda::fake_only("the fake NCCL's own test");
            None
        }
        Driver::Fake(fake) => in_child(test, envs).then_some(fake),
    }
}

fn nccl() -> libloading::Library {
    // SAFETY: the fake's library, first on the library path.
    unsafe { libloading::Library::new("libnccl.so.2") }.expect("libnccl.so.2 (the fake)")
}

/// A buffer on `device` holding `bytes`, and a stream there.
fn upload(context: &CudaContext, bytes: &[u8]) -> (u64, sys::CUstream) {
    context.bind_to_thread().expect("bind");
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).expect("stream");
    let ptr = unsafe { result::malloc_sync(bytes.len()) }.expect("alloc");
    unsafe { result::memcpy_htod_async(ptr, bytes, stream) }.expect("upload");
    (ptr, stream)
}

fn download(context: &CudaContext, ptr: u64, len: usize, stream: sys::CUstream) -> Vec<u8> {
    context.bind_to_thread().expect("bind");
    let mut out = vec![0u8; len];
    unsafe {
        result::stream::synchronize(stream).expect("sync");
        result::memcpy_dtoh_async(&mut out, ptr, stream).expect("download");
    }
    out
}

pub(crate) fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

#[test]
fn all_reduce_on_two_devices_is_exact_for_every_reduction_and_send_recv_pairs_in_a_group() {
    let Some(fake) = fake_in_child(
        "nccl::all_reduce_on_two_devices_is_exact_for_every_reduction_and_send_recv_pairs_in_a_group",
        &[],
    ) else {
        return;
    };
    let lib = nccl();
    let contexts = [
        CudaContext::new(0).expect("0"),
        CudaContext::new(1).expect("1"),
    ];
    let mut comms: [Comm; 2] = [std::ptr::null_mut(); 2];
    unsafe {
        let mut version: c_int = 0;
        lib.get::<unsafe extern "C" fn(*mut c_int) -> u32>(b"ncclGetVersion")
            .unwrap()(&mut version);
        assert!(version >= 21000, "ncclAvg needs 2.10: {version}");
        let init: libloading::Symbol<InitAll> = lib.get(b"ncclCommInitAll").unwrap();
        assert_eq!(init(comms.as_mut_ptr(), 2, [0, 1].as_ptr()), 0);
    }
    let all_reduce: libloading::Symbol<AllReduce> = unsafe { lib.get(b"ncclAllReduce") }.unwrap();
    let group_start: libloading::Symbol<Group> = unsafe { lib.get(b"ncclGroupStart") }.unwrap();
    let group_end: libloading::Symbol<Group> = unsafe { lib.get(b"ncclGroupEnd") }.unwrap();
    // f32 (7): sum, prod, max, min, avg of [1.5, -2, 3] and [0.5, 4, -1].
    let inputs = [f32s(&[1.5, -2.0, 3.0]), f32s(&[0.5, 4.0, -1.0])];
    let expected = [
        f32s(&[2.0, 2.0, 2.0]),
        f32s(&[0.75, -8.0, -3.0]),
        f32s(&[1.5, 4.0, 3.0]),
        f32s(&[0.5, -2.0, -1.0]),
        f32s(&[1.0, 1.0, 1.0]),
    ];
    for (op, want) in expected.iter().enumerate() {
        let buffers: Vec<_> = (0..2).map(|r| upload(&contexts[r], &inputs[r])).collect();
        unsafe {
            assert_eq!(group_start(), 0);
            for (r, (ptr, stream)) in buffers.iter().enumerate() {
                contexts[r].bind_to_thread().unwrap();
                let code = all_reduce(
                    *ptr as *const c_void,
                    *ptr as *mut c_void,
                    3,
                    7,
                    op as c_int,
                    comms[r],
                    *stream,
                );
                assert_eq!(code, 0);
            }
            assert_eq!(group_end(), 0);
        }
        for (r, (ptr, stream)) in buffers.iter().enumerate() {
            assert_eq!(
                &download(&contexts[r], *ptr, 12, *stream),
                want,
                "op {op}, rank {r}"
            );
        }
    }
    // i32 (2) sum and u8 (1) max, bf16 (9) sum.
    for (dtype, a, b, want) in [
        (
            2,
            (-7i32).to_ne_bytes().to_vec(),
            9i32.to_ne_bytes().to_vec(),
            2i32.to_ne_bytes().to_vec(),
        ),
        (
            9,
            half::bf16::from_f32(1.5).to_ne_bytes().to_vec(),
            half::bf16::from_f32(2.25).to_ne_bytes().to_vec(),
            half::bf16::from_f32(3.75).to_ne_bytes().to_vec(),
        ),
    ] {
        let buffers = [upload(&contexts[0], &a), upload(&contexts[1], &b)];
        unsafe {
            group_start();
            for (r, (ptr, stream)) in buffers.iter().enumerate() {
                all_reduce(
                    *ptr as *const c_void,
                    *ptr as *mut c_void,
                    1,
                    dtype,
                    0,
                    comms[r],
                    *stream,
                );
            }
            group_end();
        }
        for (r, (ptr, stream)) in buffers.iter().enumerate() {
            assert_eq!(
                download(&contexts[r], *ptr, want.len(), *stream),
                want,
                "type {dtype}, rank {r}"
            );
        }
    }
    // Send rank 0 -> 1 and 1 -> 0 in one group per rank.
    let send: libloading::Symbol<SendRecv> = unsafe { lib.get(b"ncclSend") }.unwrap();
    let recv: libloading::Symbol<SendRecv> = unsafe { lib.get(b"ncclRecv") }.unwrap();
    let out = [
        upload(&contexts[0], &[1u8; 64]),
        upload(&contexts[1], &[2u8; 64]),
    ];
    let into = [
        upload(&contexts[0], &[0u8; 64]),
        upload(&contexts[1], &[0u8; 64]),
    ];
    // The receive buffers were written on streams of their own: done before NCCL writes them
    // on the senders' streams (the fake's race detector caught this test without it).
    for (r, (_, stream)) in into.iter().enumerate() {
        contexts[r].bind_to_thread().unwrap();
        unsafe { result::stream::synchronize(*stream) }.expect("sync");
    }
    unsafe {
        for r in 0..2 {
            contexts[r].bind_to_thread().unwrap();
            group_start();
            send(
                out[r].0 as *mut c_void,
                64,
                1,
                1 - r as c_int,
                comms[r],
                out[r].1,
            );
            recv(
                into[r].0 as *mut c_void,
                64,
                1,
                1 - r as c_int,
                comms[r],
                out[r].1,
            );
            group_end();
        }
    }
    assert_eq!(
        download(&contexts[0], into[0].0, 64, out[0].1),
        vec![2u8; 64]
    );
    assert_eq!(
        download(&contexts[1], into[1].0, 64, out[1].1),
        vec![1u8; 64]
    );
    let destroy: libloading::Symbol<Destroy> = unsafe { lib.get(b"ncclCommDestroy") }.unwrap();
    unsafe {
        assert_eq!(destroy(comms[0]), 0);
        assert_eq!(destroy(comms[1]), 0);
    }
    fake.assert_no_violations();
}

#[test]
fn a_rank_that_never_calls_is_a_reported_deadlock_not_a_hang() {
    let secs = std::ffi::OsStr::new("1");
    let Some(fake) = fake_in_child(
        "nccl::a_rank_that_never_calls_is_a_reported_deadlock_not_a_hang",
        &[("FAKE_CUDA_DEADLOCK_SECS", Some(secs))],
    ) else {
        return;
    };
    let lib = nccl();
    let contexts = [
        CudaContext::new(0).expect("0"),
        CudaContext::new(1).expect("1"),
    ];
    let mut comms: [Comm; 2] = [std::ptr::null_mut(); 2];
    unsafe {
        let init: libloading::Symbol<InitAll> = lib.get(b"ncclCommInitAll").unwrap();
        assert_eq!(init(comms.as_mut_ptr(), 2, std::ptr::null()), 0);
        let all_reduce: libloading::Symbol<AllReduce> = lib.get(b"ncclAllReduce").unwrap();
        let (ptr, stream) = upload(&contexts[0], &f32s(&[1.0]));
        assert_eq!(
            all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                1,
                7,
                0,
                comms[0],
                stream
            ),
            0
        );
        // Rank 1 never calls: rank 0's stream cannot finish.
        let sync = result::stream::synchronize(stream);
        assert_eq!(
            sync.map_err(|e| e.0),
            Err(sys::CUresult::CUDA_ERROR_TIMEOUT)
        );
    }
    let violations = fake.violations();
    assert_eq!(violations.len(), 1, "{violations:#?}");
    assert!(violations[0].contains("waits forever"), "{violations:#?}");
}

/// NCCL's `ncclCommAbort` ends the communicator's queued operations (its kernels exit), which
/// is how a process stops a rank waiting for a peer that will not call: rank 0 queues an
/// all-reduce rank 1 never makes, both communicators are aborted, and rank 0's stream then
/// completes with its buffer untouched (nothing was exchanged); work queued after the
/// collective runs. Without the abort this is the deadlock of the test above.
#[test]
fn an_abort_cancels_a_queued_collective_whose_peer_never_calls() {
    let secs = std::ffi::OsStr::new("5");
    let Some(fake) = fake_in_child(
        "nccl::an_abort_cancels_a_queued_collective_whose_peer_never_calls",
        &[("FAKE_CUDA_DEADLOCK_SECS", Some(secs))],
    ) else {
        return;
    };
    let lib = nccl();
    let contexts = [
        CudaContext::new(0).expect("0"),
        CudaContext::new(1).expect("1"),
    ];
    let mut comms: [Comm; 2] = [std::ptr::null_mut(); 2];
    unsafe {
        let init: libloading::Symbol<InitAll> = lib.get(b"ncclCommInitAll").unwrap();
        assert_eq!(init(comms.as_mut_ptr(), 2, std::ptr::null()), 0);
        let all_reduce: libloading::Symbol<AllReduce> = lib.get(b"ncclAllReduce").unwrap();
        let abort: libloading::Symbol<Destroy> = lib.get(b"ncclCommAbort").unwrap();
        let (ptr, stream) = upload(&contexts[0], &f32s(&[1.0, 2.0]));
        assert_eq!(
            all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                2,
                7,
                0,
                comms[0],
                stream
            ),
            0
        );
        // Queued after the collective: runs once the collective is cancelled.
        let later = result::malloc_sync(8).expect("alloc");
        result::memcpy_htod_async(later, &f32s(&[7.0, 8.0]), stream).expect("queued after");
        for comm in comms {
            assert_eq!(abort(comm), 0);
        }
        assert_eq!(download(&contexts[0], ptr, 8, stream), f32s(&[1.0, 2.0]));
        assert_eq!(download(&contexts[0], later, 8, stream), f32s(&[7.0, 8.0]));
    }
    fake.assert_no_violations();
    assert_eq!(fake.calls("ncclCommAbort"), 2);
}
