//! Threads on bounded stream slots: shared slots beyond `max_streams`, rounds of new threads,
//! idle slots taken over, exits reported, and the first use of another thread's buffer.

use cubecl_common::stream_id::StreamId;
use cubecl_runtime::server::{ComputeServer, Handle, MetadataBindingInfo};

use super::super::super::driver::MetadataLayout;
use super::harness::{harness, harness_configured, harness_on, stream};
use crate::alloc::AllocatorConfig;
use crate::device::DeviceStream;
use crate::device::sim::SimDevice;

#[test]
fn threads_beyond_max_streams_share_slots_and_their_cached_memory() {
    let mut h = harness(MetadataLayout::DriverBinding, 4);
    // CubeCL's mapping alone (`id % max_streams`): no thread is given an idle slot.
    h.server.streams.never_reuse_slots();
    // 64 threads, each making and dropping a tensor of the same size.
    for value in 0..64 {
        let handle = h.buffer(1 << 20, stream(value));
        drop(handle);
    }
    assert_eq!(h.server.streams_in_use(), 4);
    assert_eq!(h.seen.lock().streams_created.len(), 4);
    // Memory one thread left cached is reused by the next thread of its slot.
    assert!(
        h.meter.allocs() <= 4,
        "64 threads on 4 slots allocated {} segments",
        h.meter.allocs()
    );
}

#[test]
fn rounds_of_new_threads_reuse_the_memory_of_the_threads_that_are_gone() {
    // A data loader's workers, epoch after epoch: every round's threads are new CubeCL
    // streams. The slots of the previous round hand their free slices back when a new slot
    // appears, and the engine gives their whole free segments to the new streams once each
    // old stream's fence has completed (here the test completes them, as a GPU would have by
    // the time a new thread starts).
    // Every thread gets a slot of its own here (see
    // `new_threads_take_the_idle_slots_of_threads_that_are_gone` for the slots themselves
    // reused).
    let device = SimDevice::new(1 << 30);
    let mut h = harness_on(device.clone(), MetadataLayout::DriverBinding, 128);
    h.server.streams.never_reuse_slots();
    let sizes: Vec<u64> = (0..30u64).map(|i| 1024 + i * 41 * 1024).collect();
    let mut reserved = Vec::new();
    let mut next_thread = 0;
    for _round in 0..4 {
        let threads: Vec<u64> = (next_thread..next_thread + 6).collect();
        next_thread += 6;
        // The round's first operation makes its slot: the idle slots give their slices back
        // and record their fences, which complete before the round allocates.
        h.server.flush(stream(threads[0])).expect("flush");
        device.complete_all_events();
        for &thread in &threads {
            let handles: Vec<Handle> = sizes.iter().map(|&s| h.buffer(s, stream(thread))).collect();
            drop(handles);
        }
        reserved.push(h.server.allocator().memory_reserved());
    }
    assert!(
        reserved.iter().all(|&r| r == reserved[0]),
        "reserved after each round: {reserved:?}"
    );
    assert!(h.server.allocator().stats().num_stream_shares > 0);
    // The test's threads run one after another, so each new slot finds every earlier one
    // idle: each of the 24 slots but the last was handed back exactly once (an idle slot is
    // not walked again before an operation touches it).
    let last = h.server.streams.slot(stream(next_thread - 1));
    for slot in 0..next_thread as usize {
        let idle = h
            .server
            .streams
            .get_slot(&mut h.server.driver, slot)
            .memory
            .policy_counters()
            .idle_reclaims;
        assert_eq!(idle, u64::from(slot != last), "slot {slot}");
    }
}

#[test]
fn new_threads_take_the_idle_slots_of_threads_that_are_gone() {
    // The same rounds of threads, one after another, with slot reuse: a new thread is given
    // the least recently used slot that no operation touched for `REUSE_AFTER` operations,
    // with its stream, its CubeCL pool and its engine cache. Each thread here makes 30
    // reservations, so when a thread starts the slot of the thread before it was touched
    // just now and the one before that long ago: two slots serve all 24 threads, and the
    // memory is the two slots' own (no segment changes stream).
    let device = SimDevice::new(1 << 30);
    let mut h = harness_on(device.clone(), MetadataLayout::DriverBinding, 128);
    let sizes: Vec<u64> = (0..30u64).map(|i| 1024 + i * 41 * 1024).collect();
    let mut reserved = Vec::new();
    for round in 0..4u64 {
        for thread in round * 6..round * 6 + 6 {
            let handles: Vec<Handle> = sizes.iter().map(|&s| h.buffer(s, stream(thread))).collect();
            drop(handles);
        }
        reserved.push(h.server.allocator().memory_reserved());
    }
    assert!(
        reserved.iter().all(|&r| r == reserved[0]),
        "reserved after each round: {reserved:?}"
    );
    assert_eq!(h.server.streams_in_use(), 2);
    assert_eq!(h.server.streams.reuses(), 22);
    assert_eq!(h.server.allocator().stats().num_stream_shares, 0);
    // A thread keeps its slot: thread 2 was given thread 0's slot and still has it.
    assert_eq!(
        h.server.streams.slot(stream(2)),
        h.server.streams.slot(stream(0))
    );
    assert_ne!(
        h.server.streams.slot(stream(1)),
        h.server.streams.slot(stream(0))
    );
}

/// A thread that opened a client (so reports its exit) and waits until the sender is dropped:
/// its stream id, the sender, and the thread.
fn spawn_watched() -> (
    StreamId,
    std::sync::mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    use crate::runtime::thread_exit::watch_current_thread;
    use std::sync::mpsc;
    let (id_tx, id_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        watch_current_thread();
        id_tx.send(StreamId::current()).expect("send");
        let _ = go_rx.recv();
    });
    (id_rx.recv().expect("id"), go_tx, thread)
}

#[test]
fn a_thread_that_reported_its_exit_gives_its_slot_to_the_next_new_thread_at_once() {
    // Threads that opened a client report their exit (`runtime::thread_exit`): the next new
    // thread takes the slot of a thread that has gone even when it was touched a moment ago,
    // where silence alone would take `REUSE_AFTER` operations.
    use super::streams::slot;
    let (gone, gone_go, gone_thread) = spawn_watched();
    let (alive, alive_go, alive_thread) = spawn_watched();
    let (queued, queued_go, queued_thread) = spawn_watched();
    let mut h = harness(MetadataLayout::DriverBinding, 128);
    h.server.streams.listen_to_thread_exits();
    // New threads' ids whose own slots (CubeCL's `id % 128`) are neither thread's.
    let fresh: Vec<StreamId> = (1_000_000..)
        .map(stream)
        .filter(|id| {
            [gone, alive, queued]
                .iter()
                .all(|g| slot(*id, 128) != slot(*g, 128))
        })
        .take(5)
        .collect();
    for id in [gone, alive] {
        drop(h.buffer(4096, id));
    }
    // A new thread while both are alive and were just touched: a slot of its own.
    let early = fresh[0];
    drop(h.buffer(4096, early));
    assert_eq!(h.server.streams.reuses(), 0);
    assert_eq!(h.server.streams_in_use(), 3);
    // One of them exits; the next new thread, one operation later, gets its slot.
    drop(gone_go);
    gone_thread.join().expect("join");
    let late = fresh[1];
    drop(h.buffer(4096, late));
    assert_eq!(h.server.streams.reuses(), 1);
    assert_eq!(h.server.streams.slot(late), h.server.streams.slot(gone));
    assert_eq!(h.server.streams_in_use(), 3);
    // The slot is the new thread's now: another new thread does not share it.
    let third = fresh[2];
    drop(h.buffer(4096, third));
    assert_ne!(h.server.streams.slot(third), h.server.streams.slot(gone));
    assert_eq!(h.server.streams.reuses(), 1);
    // A thread whose exit is read before its first operation arrives (its work was still
    // queued): its slot is free for the next new thread all the same.
    drop(queued_go);
    queued_thread.join().expect("join");
    drop(h.buffer(4096, fresh[3]));
    drop(h.buffer(4096, queued));
    assert_eq!(h.server.streams.reuses(), 1);
    drop(h.buffer(4096, fresh[4]));
    assert_eq!(h.server.streams.reuses(), 2);
    assert_eq!(
        h.server.streams.slot(fresh[4]),
        h.server.streams.slot(queued)
    );
    // The thread that is still there never lent its slot.
    assert!(
        fresh
            .iter()
            .all(|id| h.server.streams.slot(*id) != h.server.streams.slot(alive))
    );
    drop(alive_go);
    alive_thread.join().expect("join");
}

#[test]
fn a_silent_thread_keeps_its_slot_while_it_is_watched_and_alive() {
    // Silence (`REUSE_AFTER` operations of the device without one of the slot's own) gives a
    // slot away only when one of its threads will never report its exit. A watched thread
    // waiting on a barrier or a channel is silent but alive: giving its slot to a new thread
    // made two working threads share one stream, whose cache then followed how they
    // interleaved (the runtime's soak grew a segment in a later round in 4 of 15 runs on a
    // loaded machine; none once watched threads kept their slots).
    use super::streams::{REUSE_AFTER, slot};
    use crate::runtime::thread_exit::is_watched;
    let (waiting, go_tx, waiting_thread) = spawn_watched();
    assert!(is_watched(waiting.value));
    let mut h = harness(MetadataLayout::DriverBinding, 128);
    h.server.streams.listen_to_thread_exits();
    // Ids of threads that never opened a client (never watched), on slots of their own.
    let fresh: Vec<StreamId> = (1_000_000..)
        .map(stream)
        .filter(|id| slot(*id, 128) != slot(waiting, 128))
        .take(5)
        .collect();
    let (unwatched, busy) = (fresh[0], fresh[1]);
    drop(h.buffer(4096, waiting));
    drop(h.buffer(4096, unwatched));
    for _ in 0..REUSE_AFTER {
        drop(h.buffer(4096, busy));
    }
    assert_eq!(h.server.streams_in_use(), 3);
    // Both slots have been silent for `REUSE_AFTER` operations: the new thread is given the
    // unwatched thread's, never the waiting one's.
    drop(h.buffer(4096, fresh[2]));
    assert_eq!(h.server.streams.reuses(), 1);
    assert_eq!(
        h.server.streams.slot(fresh[2]),
        h.server.streams.slot(unwatched)
    );
    for _ in 0..REUSE_AFTER {
        drop(h.buffer(4096, busy));
    }
    drop(h.buffer(4096, fresh[3]));
    assert_eq!(h.server.streams.reuses(), 2);
    assert_ne!(
        h.server.streams.slot(fresh[3]),
        h.server.streams.slot(waiting)
    );
    // Once the waiting thread has exited, its slot goes to the next new thread.
    drop(go_tx);
    waiting_thread.join().expect("join");
    assert!(!is_watched(waiting.value));
    drop(h.buffer(4096, fresh[4]));
    assert_eq!(h.server.streams.reuses(), 3);
    assert_eq!(
        h.server.streams.slot(fresh[4]),
        h.server.streams.slot(waiting)
    );
    assert_eq!(h.server.streams_in_use(), 3);
}

#[test]
fn without_cross_stream_reuse_each_round_of_threads_reserves_anew() {
    // The same rounds under PyTorch's per-stream rule: the new streams cannot use what the
    // old ones cached, so reserved memory grows with every round.
    let device = SimDevice::new(1 << 30);
    let config = AllocatorConfig::parse("cross_stream_reuse:false").expect("a valid key");
    let mut h = harness_configured(device.clone(), MetadataLayout::DriverBinding, 128, config);
    let sizes: Vec<u64> = (0..30u64).map(|i| 1024 + i * 41 * 1024).collect();
    let mut reserved = Vec::new();
    for round in 0..3u64 {
        for thread in round * 6..round * 6 + 6 {
            let handles: Vec<Handle> = sizes.iter().map(|&s| h.buffer(s, stream(thread))).collect();
            drop(handles);
        }
        device.complete_all_events();
        reserved.push(h.server.allocator().memory_reserved());
    }
    assert!(
        reserved[2] > reserved[1] && reserved[1] > reserved[0],
        "{reserved:?}"
    );
}

/// A thread whose first operation on the device uses another thread's buffer (here a launch
/// reading it) is given a gone thread's slot; the wait that orders its work after the buffer's
/// producer goes to that slot's stream, where the work runs. Decided before the slot was
/// assigned, the wait went to CubeCL's slot of the id, and the launch ran unordered with the
/// producer (`ordering::order_after` now assigns first).
#[test]
fn a_new_threads_first_use_of_anothers_buffer_waits_on_the_slot_it_is_given() {
    use super::streams::{REUSE_AFTER, slot};
    let mut h = harness(MetadataLayout::DriverBinding, 128);
    // Three ids on three distinct CubeCL slots: a producer, a thread that goes silent (never
    // watched, so silence frees its slot), and the new thread.
    let mut ids = (3_000_000..).map(stream);
    let producer = ids.next().expect("id");
    let gone = ids
        .by_ref()
        .find(|id| slot(*id, 128) != slot(producer, 128))
        .expect("id");
    let new = ids
        .find(|id| slot(*id, 128) != slot(producer, 128) && slot(*id, 128) != slot(gone, 128))
        .expect("id");
    drop(h.buffer(4096, gone));
    let produced = h.buffer(4096, producer);
    for _ in 0..REUSE_AFTER {
        drop(h.buffer(4096, producer));
    }
    let before = h.seen.lock().wait_streams.len();
    h.launch(&[&produced], MetadataBindingInfo::new(vec![1], 0), new);
    let given = h.server.streams.slot(new);
    assert_eq!(given, h.server.streams.slot(gone), "the gone thread's slot");
    assert_eq!(
        h.seen.lock().wait_streams[before..],
        [DeviceStream(given as u64)],
        "one wait, on the stream of the slot the work runs on"
    );
}

#[test]
fn a_slot_no_operation_touched_for_a_whole_idle_period_gives_its_free_slices_back() {
    use super::super::streams::IDLE_PERIOD;
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    h.server.streams.never_reuse_slots();
    // Thread 1 caches a freed 1 MiB tensor in its CubeCL pool and keeps a live one (so that
    // the new slot of thread 2 does not take its slices back at once), then does nothing.
    let live = h.buffer(4096, stream(1));
    drop(h.buffer(1 << 20, stream(1)));
    let idle_slot = h.server.streams.slot(stream(1));
    let idle_reclaims = |h: &mut super::harness::Harness| {
        h.server
            .streams
            .get_slot(&mut h.server.driver, idle_slot)
            .memory
            .policy_counters()
            .idle_reclaims
    };
    let allocated = |h: &super::harness::Harness| h.server.allocator().stats().memory_allocated();
    assert_eq!(allocated(&h), (1 << 20) + 4096, "CubeCL keeps the slice");
    // Thread 2 works. Every IDLE_PERIOD operations (the server counts each stream lookup of a
    // call) the server looks for slots untouched since its previous look: the first look
    // finds slot 1 touched after the look before (at operation 0), the second finds it idle a
    // whole period.
    let last_touch = h.server.streams.operations();
    let mut handed_back_at = None;
    let kept = h.buffer(4096, stream(2));
    while h.server.streams.operations() < last_touch + 3 * IDLE_PERIOD {
        drop(h.buffer(4096, stream(2)));
        if handed_back_at.is_none() && idle_reclaims(&mut h) == 1 {
            handed_back_at = Some(h.server.streams.operations());
        }
    }
    let at = handed_back_at.expect("the idle slot gave its slices back");
    assert!(
        (2 * IDLE_PERIOD..2 * IDLE_PERIOD + 8).contains(&at),
        "handed back at operation {at}"
    );
    // Once: a slot handed back is not walked again before an operation touches it.
    assert_eq!(idle_reclaims(&mut h), 1);
    // The 1 MiB block is free in the engine; the two threads' live 4 KiB tensors and the
    // 4 KiB slice thread 2's pool keeps (the last one dropped) are what is left.
    assert_eq!(allocated(&h), 3 * 4096);
    drop((kept, live));
}
