//! The device path of `to_device` (`peer`) over the recording driver with peer copies on:
//! the staging block the source reserves, held until the destination's copy completed (PyTorch's
//! `record_stream` rule across devices) through reservations, `empty_cache` and a failed
//! `recv`; the destination's out-of-memory on its stream. No GPU needed: the CUDA driver's
//! copies themselves run under the fake driver (`tests/`) and on a GPU.

use cubecl_common::stream_id::StreamId;
use cubecl_ir::{ElemType, FloatKind};
use cubecl_runtime::server::{ComputeServer, Handle, ServerCommunication};

use super::super::driver::MetadataLayout;
use super::comm_tests::{connect, read, tensor, whole};
use super::tests::{Harness, PEER_EVENTS, harness_of, stream};

const F32: ElemType = ElemType::Float(FloatKind::F32);

/// A server whose driver copies device to device.
fn server(capacity: u64) -> Harness {
    let h = harness_of(MetadataLayout::DriverBinding, 4, capacity);
    h.seen.lock().peer_copies = true;
    h
}

fn pair() -> (Harness, Harness) {
    let (mut a, mut b) = (server(1 << 30), server(1 << 30));
    connect(&mut a, &mut b);
    (a, b)
}

fn send(src: &mut Harness, dst: &Harness, handle: &Handle, len: usize, on: StreamId) {
    src.server
        .send(whole(handle, len), F32, on, dst.server.device)
        .expect("send");
}

fn recv(dst: &mut Harness, src: &Harness, len: usize, on: StreamId) -> Handle {
    let received = Handle::new(on, len as u64);
    dst.server
        .recv(received.clone(), F32, on, src.server.device)
        .expect("recv");
    dst.server.sync_collective(on).expect("sync_collective");
    received
}

fn peer_reads(h: &Harness) -> usize {
    h.server.uses.peer_reads()
}

#[test]
fn a_peer_transfer_reads_a_staging_block_the_source_reuses_only_after_the_copy_completed() {
    let (mut a, mut b) = pair();
    let on = stream(0);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let source = tensor(&mut a, &data, on);
    let allocated = |h: &Harness| h.server.allocator().stats().allocated_bytes.all.current;

    send(&mut a, &b, &source, data.len(), on);
    // The staging block is the source device's, in its statistics, and held.
    assert_eq!(allocated(&a), 2 * 4096);
    assert_eq!(peer_reads(&a), 1);
    let (from, staging) = a.seen.lock().exports[0];
    assert_eq!(from, a.location(&source));
    assert_ne!(
        staging, from,
        "the peer reads a copy, never the tensor itself"
    );

    let moved = recv(&mut b, &a, data.len(), on);
    assert_eq!(read(&mut b, &moved, data.len(), on).expect("read"), data);
    let (_, event) = b.seen.lock().imports[0];
    assert_eq!(event, PEER_EVENTS);

    // The copy has not completed: a new block of the staging size goes elsewhere, however
    // often the source polls (each reservation does).
    let other = a.buffer(4096, on);
    assert_ne!(a.location(&other), staging);
    a.server.memory_usage(on).expect("usage");
    assert_eq!(peer_reads(&a), 1);
    // Completed (the source's server asks its own driver, as CUDA's events answer anywhere):
    // released at the next poll, and CubeCL hands the same slice to the next 4 KiB tensor.
    a.complete(&[event]);
    let again = a.buffer(4096, on);
    assert_eq!(peer_reads(&a), 0);
    assert_eq!(a.location(&again), staging);
}

#[test]
fn empty_cache_waits_for_an_issued_peer_copy_and_keeps_a_block_whose_copy_is_not_issued() {
    let (mut a, mut b) = pair();
    let on = stream(1);
    let data = vec![3u8; 8192];
    let source = tensor(&mut a, &data, on);
    send(&mut a, &b, &source, data.len(), on);
    drop(source);

    // No recv yet: `empty_cache` cannot wait for a copy nobody issued, and never frees it.
    let syncs = a.seen.lock().event_syncs;
    a.server.memory_cleanup(on);
    assert_eq!(peer_reads(&a), 1);
    assert_eq!(a.seen.lock().event_syncs, syncs);
    assert_eq!(
        a.server.allocator().stats().allocated_bytes.all.current,
        8192,
        "the staging block stays allocated"
    );

    let moved = recv(&mut b, &a, data.len(), on);
    assert_eq!(read(&mut b, &moved, data.len(), on).expect("read"), data);
    // Now issued: `empty_cache` waits for the copy's event (PyTorch's `synchronize_and_free_events`)
    // and the staging block goes back to the device.
    a.server.memory_cleanup(on);
    assert_eq!(peer_reads(&a), 0);
    assert_eq!(a.seen.lock().event_syncs, syncs + 1);
    assert_eq!(a.server.allocator().stats().allocated_bytes.all.current, 0);
    assert_eq!(a.server.allocator().memory_reserved(), 0);
}

#[test]
fn a_destination_out_of_memory_is_the_allocators_error_on_its_stream_and_frees_the_staging() {
    // 4 MiB of device on the destination; 8 MiB sent.
    let mut a = server(1 << 30);
    let mut b = server(4 << 20);
    connect(&mut a, &mut b);
    let len = 8 << 20;
    let on = stream(0);
    let source = tensor(&mut a, &vec![7u8; len], on);
    send(&mut a, &b, &source, len, on);
    let moved = recv(&mut b, &a, len, on);
    let err = read(&mut b, &moved, len, on).expect_err("the destination could not hold it");
    let message = err.to_string();
    assert!(
        message.contains("larger than the largest segment this device can hold"),
        "{message}"
    );
    assert_eq!(b.server.allocator().stats().num_ooms, 1);
    assert!(b.seen.lock().imports.is_empty(), "nothing was copied");
    // No copy reads the staging block: the source's next poll releases it.
    a.server.memory_usage(on).expect("usage");
    assert_eq!(peer_reads(&a), 0);

    // Both keep working: a transfer that fits arrives.
    let small = vec![5u8; 2048];
    let source = tensor(&mut a, &small, on);
    send(&mut a, &b, &source, small.len(), on);
    let moved = recv(&mut b, &a, small.len(), on);
    assert_eq!(read(&mut b, &moved, small.len(), on).expect("read"), small);
}

#[test]
fn a_failed_peer_copy_is_an_error_on_the_destination_stream_and_releases_the_staging() {
    let (mut a, mut b) = pair();
    b.seen.lock().failing_imports = true;
    let on = stream(2);
    let data = vec![1u8; 1024];
    let source = tensor(&mut a, &data, on);
    send(&mut a, &b, &source, data.len(), on);
    let moved = recv(&mut b, &a, data.len(), on);
    let err = read(&mut b, &moved, data.len(), on).expect_err("the copy failed");
    assert!(err.to_string().contains("injected"), "{err}");
    a.server.memory_usage(on).expect("usage");
    assert_eq!(peer_reads(&a), 0);
}

#[test]
fn transfers_from_several_threads_pair_up_by_stream_and_cross_without_deadlock() {
    let (mut a, mut b) = pair();
    let on = [stream(5), stream(6)];
    let data = [vec![1u8; 512], vec![2u8; 1024]];
    // Each side sends first, then receives: neither `send` waits for its peer.
    let sources: Vec<Handle> = on
        .iter()
        .zip(&data)
        .map(|(s, d)| tensor(&mut a, d, *s))
        .collect();
    let back = tensor(&mut b, &[9u8; 512], on[0]);
    for (source, (s, d)) in sources.iter().zip(on.iter().zip(&data)) {
        send(&mut a, &b, source, d.len(), *s);
    }
    send(&mut b, &a, &back, 512, on[0]);
    let returned = recv(&mut a, &b, 512, on[0]);
    // Received in the other order: each stream's route has its own queue.
    let second = recv(&mut b, &a, data[1].len(), on[1]);
    let first = recv(&mut b, &a, data[0].len(), on[0]);
    assert_eq!(read(&mut b, &first, 512, on[0]).expect("read"), data[0]);
    assert_eq!(read(&mut b, &second, 1024, on[1]).expect("read"), data[1]);
    assert_eq!(
        read(&mut a, &returned, 512, on[0]).expect("read"),
        vec![9u8; 512]
    );
}

/// A transfer ends on the path its `send` chose: the communication setting is read at each
/// transfer, and `set_communication` between a `send` and its `recv` (here: the drivers'
/// answer flipped between the two) must not send the `recv` to wait on the other path's
/// queue. Both directions: device path then host, host then device.
#[test]
fn a_transfer_ends_on_the_path_its_send_chose_when_the_setting_changes_before_its_recv() {
    let set_path = |a: &Harness, b: &Harness, device: bool| {
        a.seen.lock().peer_copies = device;
        b.seen.lock().peer_copies = device;
    };
    for device_at_send in [true, false] {
        let (mut a, mut b) = pair();
        let on = stream(0);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
        let source = tensor(&mut a, &data, on);

        set_path(&a, &b, device_at_send);
        send(&mut a, &b, &source, data.len(), on);
        set_path(&a, &b, !device_at_send);
        let moved = recv(&mut b, &a, data.len(), on);

        assert_eq!(
            read(&mut b, &moved, data.len(), on).expect("read"),
            data,
            "send on the {} path",
            if device_at_send { "device" } else { "host" }
        );
        let (exports, imports) = (a.seen.lock().exports.len(), b.seen.lock().imports.len());
        let copies = usize::from(device_at_send);
        assert_eq!((exports, imports), (copies, copies));
        assert_eq!(
            peer_reads(&a),
            copies,
            "the staging block is held iff copied"
        );
    }
}
