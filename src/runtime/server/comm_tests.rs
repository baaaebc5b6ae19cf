//! Communication between two servers (`comm`) over the recording driver and simulated devices:
//! what a transfer reserves on the destination, out of memory there, devices never
//! initialised, and all-reduce across threads. No GPU needed.

use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::block_on;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::{ElemType, FloatKind, IntKind};
use cubecl_runtime::server::{
    ComputeServer, CopyDescriptor, Handle, ReduceOperation, ServerCommunication, ServerError,
};

use super::super::driver::MetadataLayout;
use super::tests::{Harness, harness_of, stream};

const F32: ElemType = ElemType::Float(FloatKind::F32);

fn server(capacity: u64) -> Harness {
    harness_of(MetadataLayout::DriverBinding, 4, capacity)
}

pub(super) fn whole(handle: &Handle, len: usize) -> CopyDescriptor {
    CopyDescriptor::new(handle.clone().binding(), [len].into(), [1].into(), 1)
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// A buffer on `h`'s stream `on` holding `data`.
pub(super) fn tensor(h: &mut Harness, data: &[u8], on: StreamId) -> Handle {
    let handle = h.buffer(data.len() as u64, on);
    h.server.write(
        vec![(
            whole(&handle, data.len()),
            Bytes::from_bytes_vec(data.to_vec()),
        )],
        on,
    );
    handle
}

pub(super) fn read(
    h: &mut Harness,
    handle: &Handle,
    len: usize,
    on: StreamId,
) -> Result<Vec<u8>, ServerError> {
    let mut out = block_on(h.server.read(vec![whole(handle, len)], on))?;
    Ok(out.remove(0).to_vec())
}

/// Both servers joined the pair's group, as `ComputeClient::to_client_tensor` makes them.
pub(super) fn connect(a: &mut Harness, b: &mut Harness) {
    let ids = vec![a.server.device, b.server.device];
    a.server.comm_init(ids.clone()).expect("a joins");
    b.server.comm_init(ids).expect("b joins");
}

/// `to_client_tensor`'s calls, in its order, on one thread (`send` never waits for its peer).
fn transfer(
    src: &mut Harness,
    dst: &mut Harness,
    handle: &Handle,
    len: usize,
    on: StreamId,
) -> Handle {
    let received = Handle::new(on, len as u64);
    src.server
        .send(whole(handle, len), F32, on, dst.server.device)
        .expect("send");
    dst.server
        .recv(received.clone(), F32, on, src.server.device)
        .expect("recv");
    dst.server.sync_collective(on).expect("sync_collective");
    received
}

#[test]
fn a_sent_tensor_arrives_exact_and_is_reserved_by_the_destinations_allocator() {
    let (mut a, mut b) = (server(1 << 30), server(1 << 30));
    connect(&mut a, &mut b);
    let data = f32_bytes(&(0..1000).map(|i| i as f32 * 0.5 - 7.0).collect::<Vec<_>>());
    let on = stream(0);
    let source = tensor(&mut a, &data, on);
    let a_before = a.server.allocator().stats();
    let b_before = b.server.allocator().stats();

    let moved = transfer(&mut a, &mut b, &source, data.len(), on);
    assert_eq!(read(&mut b, &moved, data.len(), on).expect("read"), data);

    // The destination block is an engine block of 4000 bytes rounded to 4096 (512-byte
    // multiples, PyTorch's `round_size`), in a fresh 2 MiB small-pool segment.
    let b_after = b.server.allocator().stats();
    assert_eq!(
        b_after.allocated_bytes.all.current - b_before.allocated_bytes.all.current,
        4096
    );
    assert_eq!(
        b_after.segment.all.current - b_before.segment.all.current,
        1
    );
    // The source allocated nothing for the transfer.
    let a_after = a.server.allocator().stats();
    assert_eq!(
        a_after.allocated_bytes.all.current,
        a_before.allocated_bytes.all.current
    );

    // And back: the same bytes.
    let back = transfer(&mut b, &mut a, &moved, data.len(), on);
    assert_eq!(read(&mut a, &back, data.len(), on).expect("read"), data);
}

#[test]
fn a_recv_waiting_on_another_thread_gets_the_bytes_sent_later() {
    let (mut a, mut b) = (server(1 << 30), server(1 << 30));
    connect(&mut a, &mut b);
    let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
    let on = stream(3);
    let source = tensor(&mut a, &data, on);
    let (src_id, dst_id) = (a.server.device, b.server.device);
    let received = std::thread::scope(|scope| {
        let receiver = scope.spawn(|| {
            let received = Handle::new(on, data.len() as u64);
            b.server
                .recv(received.clone(), F32, on, src_id)
                .expect("recv");
            read(&mut b, &received, data.len(), on)
        });
        // The receiver may already wait: the send wakes it.
        a.server
            .send(whole(&source, data.len()), F32, on, dst_id)
            .expect("send");
        receiver.join().expect("the receiver returns")
    });
    assert_eq!(received.expect("read"), data);
}

#[test]
fn a_destination_out_of_memory_reports_the_allocators_error_on_its_stream() {
    // 4 MiB of device on the destination; 8 MiB sent.
    let (mut a, mut b) = (server(1 << 30), server(4 << 20));
    connect(&mut a, &mut b);
    let len = 8 << 20;
    let on = stream(0);
    let source = tensor(&mut a, &vec![7u8; len], on);
    let moved = transfer(&mut a, &mut b, &source, len, on);
    // `recv` returned (the client unwraps it on the device thread); the error waits on the
    // destination stream and its next read returns it.
    let err = read(&mut b, &moved, len, on).expect_err("the destination could not hold it");
    let message = err.to_string();
    // More than the whole device: the allocator's `TooLarge`, an out-of-memory counted once.
    assert!(
        message.contains("larger than the largest segment this device can hold"),
        "{message}"
    );
    let stats = b.server.allocator().stats();
    assert_eq!(stats.num_ooms, 1);
    assert_eq!(stats.allocated_bytes.all.current, 0);
    // The destination keeps working, and a transfer that fits arrives.
    let small = f32_bytes(&[5.0; 16]);
    let source = tensor(&mut a, &small, on);
    let moved = transfer(&mut a, &mut b, &source, small.len(), on);
    assert_eq!(read(&mut b, &moved, small.len(), on).expect("read"), small);
}

#[test]
fn devices_never_initialised_are_errors_not_panics_and_leave_no_peer_waiting() {
    let (mut a, mut b) = (server(1 << 30), server(1 << 30));
    let on = stream(1);
    let data = f32_bytes(&[1.0; 8]);
    let source = tensor(&mut a, &data, on);
    let err = a
        .server
        .send(whole(&source, data.len()), F32, on, b.server.device)
        .expect_err("no comm_init");
    assert!(err.to_string().contains("comm_init"), "{err}");
    let err = b
        .server
        .recv(Handle::new(on, 32), F32, on, a.server.device)
        .expect_err("no comm_init");
    assert!(err.to_string().contains("comm_init"), "{err}");
    let err = a
        .server
        .all_reduce(
            source.clone().binding(),
            source.clone().binding(),
            F32,
            on,
            ReduceOperation::Sum,
            vec![a.server.device, b.server.device],
        )
        .expect_err("no comm_init");
    assert!(err.to_string().contains("comm_init"), "{err}");
    // A group without this server is refused.
    let other = server(1 << 30);
    let err = a
        .server
        .comm_init(vec![b.server.device, other.server.device])
        .expect_err("not a member");
    assert!(err.to_string().contains("not in"), "{err}");

    // Only the destination joined: its recv gets the sender's error instead of waiting.
    b.server
        .comm_init(vec![a.server.device, b.server.device])
        .expect("b joins");
    let received = Handle::new(on, data.len() as u64);
    let _ = a
        .server
        .send(whole(&source, data.len()), F32, on, b.server.device);
    b.server
        .recv(received.clone(), F32, on, a.server.device)
        .expect("recv returns");
    let err = read(&mut b, &received, data.len(), on).expect_err("nothing arrived");
    assert!(err.to_string().contains("comm_init"), "{err}");
}

/// Joins one server per input into a group, then runs `work` on each member on its own thread
/// (as Burn's DDP does) with its input as a tensor on its own stream, and the group's ids.
fn on_every_member<T: Send>(
    inputs: &[Vec<u8>],
    work: impl Fn(&mut Harness, &Handle, StreamId, Vec<DeviceId>, usize) -> T + Sync,
) -> Vec<T> {
    let mut servers: Vec<Harness> = inputs.iter().map(|_| server(1 << 30)).collect();
    let ids: Vec<_> = servers.iter().map(|h| h.server.device).collect();
    for h in &mut servers {
        h.server.comm_init(ids.clone()).expect("join");
    }
    let work = &work;
    std::thread::scope(|scope| {
        let workers: Vec<_> = servers
            .into_iter()
            .zip(inputs)
            .enumerate()
            .map(|(i, (mut h, input))| {
                let ids = ids.clone();
                scope.spawn(move || {
                    let on = stream(i as u64);
                    let buffer = tensor(&mut h, input, on);
                    work(&mut h, &buffer, on, ids, input.len())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    })
}

/// Runs `all_reduce` of `inputs[i]` on server `i`, twice (rounds pair up by number), and
/// returns what each member reads back.
fn all_reduce(inputs: &[Vec<u8>], dtype: ElemType, op: fn() -> ReduceOperation) -> Vec<Vec<u8>> {
    on_every_member(inputs, |h, buffer, on, ids, len| {
        for _ in 0..2 {
            h.server
                .all_reduce(
                    buffer.clone().binding(),
                    buffer.clone().binding(),
                    dtype,
                    on,
                    op(),
                    ids.clone(),
                )
                .expect("all_reduce");
        }
        read(h, buffer, len, on).expect("read")
    })
}

#[test]
fn all_reduce_sums_and_averages_across_three_devices_as_nccl_would() {
    let inputs: Vec<Vec<u8>> = (0..3)
        .map(|d| f32_bytes(&[1.0 + d as f32, 10.0 * d as f32, -2.0]))
        .collect();
    // Sum twice: [6, 30, -6] then 3 x that.
    for out in all_reduce(&inputs, F32, || ReduceOperation::Sum) {
        assert_eq!(out, f32_bytes(&[18.0, 90.0, -18.0]));
    }
    // Mean twice: the mean of equal values is unchanged.
    for out in all_reduce(&inputs, F32, || ReduceOperation::Mean) {
        assert_eq!(out, f32_bytes(&[2.0, 10.0, -2.0]));
    }
    let ints: Vec<Vec<u8>> = (0..2)
        .map(|d| {
            [d * 5 - 3, 7]
                .iter()
                .flat_map(|v: &i32| v.to_ne_bytes())
                .collect()
        })
        .collect();
    for out in all_reduce(&ints, ElemType::Int(IntKind::I32), || ReduceOperation::Sum) {
        // [-3 + 2, 14] then doubled.
        let expected: Vec<u8> = [-2i32, 28].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(out, expected);
    }
}

#[test]
fn all_reduce_of_mismatched_buffers_is_an_error_on_every_members_stream() {
    // Each member reads back its own buffer after the all-reduce: the error is on its stream.
    let inputs = [f32_bytes(&[1.0, 2.0]), f32_bytes(&[1.0, 2.0, 3.0])];
    let errors: Vec<ServerError> = on_every_member(&inputs, |h, buffer, on, ids, len| {
        h.server
            .all_reduce(
                buffer.clone().binding(),
                buffer.clone().binding(),
                F32,
                on,
                ReduceOperation::Sum,
                ids,
            )
            .expect("the call itself returns");
        read(h, buffer, len, on).expect_err("sizes differ")
    });
    for err in errors {
        assert!(err.to_string().contains("different sizes"), "{err}");
    }
}

#[test]
fn a_member_that_fails_before_its_part_meets_the_others_in_the_host_round_with_its_error() {
    // The first member's destination holds fewer bytes than its source: refused before the
    // reduction. It still takes its place in the round (with its error), so the others get
    // that error instead of waiting for it forever; the next round pairs up as before.
    let inputs = [f32_bytes(&[1.0, 2.0]), f32_bytes(&[3.0, 4.0])];
    let results: Vec<(String, Vec<u8>)> = on_every_member(&inputs, |h, buffer, on, ids, len| {
        let first = h.server.device == ids[0];
        let dst = match first {
            true => tensor(h, &[0u8; 4], on),
            false => buffer.clone(),
        };
        h.server
            .all_reduce(
                buffer.clone().binding(),
                dst.binding(),
                F32,
                on,
                ReduceOperation::Sum,
                ids.clone(),
            )
            .expect("the call itself returns");
        let err = read(h, buffer, len, on).expect_err("the round failed");
        h.server
            .all_reduce(
                buffer.clone().binding(),
                buffer.clone().binding(),
                F32,
                on,
                ReduceOperation::Sum,
                ids,
            )
            .expect("the call itself returns");
        (
            err.to_string(),
            read(h, buffer, len, on).expect("the next round"),
        )
    });
    for (err, next) in results {
        assert!(err.contains("into a buffer of 4 bytes"), "{err}");
        assert_eq!(next, f32_bytes(&[4.0, 6.0]));
    }
}
