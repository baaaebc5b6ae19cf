//! Cross-stream order: waits before another stream's buffer is used, and memory another
//! stream used handed out again only after that stream's event completed.

use cubecl_runtime::server::{ComputeServer, CopyDescriptor, Handle, MetadataBindingInfo};

use super::super::super::driver::MetadataLayout;
use super::harness::{harness, stream};
use crate::device::DeviceStream;

#[test]
fn cross_stream_waits_happen_once_per_newer_buffer_not_once_per_use() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let weights = h.buffer(4096, stream(1));
    let out = h.buffer(4096, stream(2));
    let info = || MetadataBindingInfo::new(Vec::new(), 0);

    // Stream 2 uses stream 1's buffer ten times: one wait.
    for _ in 0..10 {
        h.launch(&[&weights, &out], info(), stream(2));
    }
    assert_eq!(h.waits(), 1);

    // A buffer stream 1 made after that sync needs a new wait; the old one alone does not.
    let fresh = h.buffer(4096, stream(1));
    h.launch(&[&fresh, &out], info(), stream(2));
    assert_eq!(h.waits(), 2);
    h.launch(&[&weights, &out], info(), stream(2));
    let read = h.server.read(
        vec![CopyDescriptor::new(
            weights.clone().binding(),
            [1024].into(),
            [1].into(),
            4,
        )],
        stream(2),
    );
    cubecl_common::future::block_on(read).expect("read");
    assert_eq!(h.waits(), 2);

    // Another stream has never synced with stream 1: it waits once.
    h.launch(&[&weights], info(), stream(3));
    h.launch(&[&weights], info(), stream(3));
    assert_eq!(h.waits(), 3);

    // Ids that share a slot are one stream: no event between them.
    h.launch(&[&out], info(), stream(2 + 8));
    assert_eq!(h.waits(), 3);
}

#[test]
fn a_buffer_its_stream_rewrites_after_a_sync_is_waited_for_again() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    // A loader stream (1) makes two batches; the training stream (2) syncs while using the
    // first, after the second was already created.
    let first = h.buffer(4096, stream(1));
    let second = h.buffer(4096, stream(1));
    let out = h.buffer(4096, stream(2));
    h.launch(&[&first, &out], info(), stream(2));
    assert_eq!(h.waits(), 1);
    // The loader works on a fresh buffer only: the second batch is still covered.
    let scratch = h.buffer(4096, stream(1));
    h.launch(&[&scratch], info(), stream(1));
    h.launch(&[&second, &out], info(), stream(2));
    assert_eq!(h.waits(), 1);
    // The loader updates the second batch in place: it waits for the trainer's use of it,
    // which may not have run yet (an event on the trainer's stream), once; the trainer must
    // wait for the update.
    h.launch(&[&second], info(), stream(1));
    assert_eq!(h.waits(), 2);
    h.launch(&[&second], info(), stream(1));
    assert_eq!(h.waits(), 2, "the trainer's use is ordered already");
    h.launch(&[&second, &out], info(), stream(2));
    assert_eq!(h.waits(), 3);
    // Once waited for, further uses are free again.
    h.launch(&[&second, &out], info(), stream(2));
    assert_eq!(h.waits(), 3);
    // Once the trainer's uses completed (seen at the next reservation), an update waits for
    // nothing.
    h.complete(&h.events_on(DeviceStream(2)));
    let _next = h.buffer(4096, stream(1));
    h.launch(&[&second], info(), stream(1));
    assert_eq!(h.waits(), 3);
}

#[test]
fn a_buffer_another_stream_used_is_reused_only_after_that_streams_event_completed() {
    // PyTorch's `recordStream`, `insert_events` and `process_events`
    // (CUDACachingAllocator.cpp): a block used on another stream is handed out again only once
    // an event recorded there after the use has completed.
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let batch = h.buffer(4096, stream(1));
    let first = h.location(&batch);
    let out = h.buffer(4096, stream(2));
    // The consumer (2) uses the producer's (1) batch, then the batch's last handle goes.
    h.launch(&[&batch, &out], info(), stream(2));
    let consumer_events = h.events_on(DeviceStream(2));
    assert_eq!(consumer_events.len(), 1, "one event after the use");
    assert_eq!(h.server.pending_uses(), (1, 1));
    drop(batch);
    // The producer's next tensor of the same size would be CubeCL's exact-size reuse of the
    // freed slice: while the consumer may still read it, it gets other memory.
    let next = h.buffer(4096, stream(1));
    assert_ne!(
        h.location(&next),
        first,
        "reused while the consumer may still read it"
    );
    // Once the consumer's event completed, the memory is free for new work again.
    h.complete(&consumer_events);
    let later = h.buffer(4096, stream(1));
    assert_eq!(h.location(&later), first);
    assert_eq!(h.server.pending_uses(), (0, 0));
    assert_eq!(h.seen.lock().event_syncs, 0, "polled, never waited for");
}

#[test]
fn a_buffer_reused_on_its_own_stream_costs_no_event() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let batch = h.buffer(4096, stream(1));
    let first = h.location(&batch);
    let out = h.buffer(4096, stream(1));
    h.launch(&[&batch, &out], info(), stream(1));
    // Ids that share a slot are one stream.
    h.launch(&[&batch, &out], info(), stream(1 + 8));
    drop(batch);
    let next = h.buffer(4096, stream(1));
    assert_eq!(h.location(&next), first, "stream order protects the reuse");
    assert_eq!(h.seen.lock().events_recorded, 0);
    assert_eq!(h.server.pending_uses(), (0, 0));
}

#[test]
fn a_read_keeps_its_source_until_the_copy_completed_and_its_stream_until_its_event() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let read_of = |handle: &Handle| {
        vec![CopyDescriptor::new(
            handle.clone().binding(),
            [1024].into(),
            [1].into(),
            4,
        )]
    };
    // Same stream: the future holds the source until it has yielded the bytes.
    let source = h.buffer(4096, stream(1));
    let first = h.location(&source);
    let copy = h.server.read(read_of(&source), stream(1));
    drop(source);
    let next = h.buffer(4096, stream(1));
    assert_ne!(
        h.location(&next),
        first,
        "the copy's source was reused before it completed"
    );
    let bytes = cubecl_common::future::block_on(copy).expect("read");
    assert_eq!(bytes[0].len(), 4096);
    let after = h.buffer(4096, stream(1));
    assert_eq!(h.location(&after), first, "free once the copy completed");
    assert_eq!(
        h.seen.lock().events_recorded,
        0,
        "no event on the same stream"
    );

    // Another stream reads it: the source stays held until that stream's event completed,
    // even once the read's future is done.
    let first = h.location(&after);
    let copy = h.server.read(read_of(&after), stream(2));
    drop(after);
    cubecl_common::future::block_on(copy).expect("read");
    let next = h.buffer(4096, stream(1));
    assert_ne!(h.location(&next), first);
    h.complete(&h.events_on(DeviceStream(2)));
    let free_again = h.buffer(4096, stream(1));
    assert_eq!(h.location(&free_again), first);
}

#[test]
fn empty_cache_waits_for_other_streams_uses_and_then_returns_their_memory() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let batch = h.buffer(1 << 20, stream(1));
    h.launch(&[&batch], info(), stream(2));
    drop(batch);
    h.server.memory_cleanup(stream(1));
    // PyTorch's `empty_cache` synchronises pending events, then frees what they held.
    assert_eq!(h.seen.lock().event_syncs, 1);
    assert_eq!(h.server.pending_uses(), (0, 0));
    assert_eq!(h.server.allocator().stats().allocated_bytes.all.current, 0);
    assert_eq!(h.server.allocator().memory_reserved(), 0);
}
