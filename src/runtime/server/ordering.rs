//! Cross-stream ordering, both ways.
//!
//! **A consumer after the producer**, as cubecl-runtime's event streams (`stream/event.rs`) do
//! it: work on one stream that uses a buffer of another stream waits for that stream only when
//! the buffer may be newer than the last point the two streams synced at.
//!
//! Every stream counts the operations issued on it (its cursor), and a buffer remembers the
//! cursor of its stream when it was bound (CubeCL's slice cursor). A consumer keeps, per
//! producer, the producer's cursor at its last wait. A foreign buffer bound at or before that
//! point is already ordered: no event. Otherwise the consumer records an event on the producer
//! and waits for it, and notes the producer's current cursor. So a consumer that reads a
//! producer's parameters on every launch waits once, not once per launch and buffer.
//!
//! A buffer's cursor is where it was created (CubeCL's rule), and one more rule closes the gap
//! that leaves: when a stream issues work on one of its own buffers that other streams may
//! already count as synced (an in-place update of a batch a loader thread made, after the
//! training thread synced for the previous one), those streams' sync points for it are lowered
//! below the buffer, so their next use waits for the new work. Single-stream work pays
//! nothing: there is no other stream to look at.
//!
//! **The owner after other streams' uses** ([`order_after_uses`]): work a stream issues on one
//! of its own buffers (an in-place update, which Burn makes when the handle is unique) waits on
//! the device for every other stream that holds a use of that buffer not completed yet (the
//! records below): an event recorded on that stream now, after the use. The records it covers
//! are marked for the owner, so its next work on them waits no more. Nothing to look at while no
//! stream holds another's buffer (one thread; one queue).
//!
//! Not covered, as in CubeCL: a third stream using a buffer after another stream wrote in place
//! into it (buffers are ordered by the stream that created them).
//!
//! **Reuse after the consumer** ([`PendingUses`]), PyTorch's `recordStream` rule
//! (`CUDACachingAllocator.cpp`: `recordStream`, `insert_events`, `process_events`): memory a
//! stream used is not handed to new work on any stream before an event recorded on that stream
//! after the use has completed. CubeCL's persistent pool reuses a freed slice at once on the
//! next reservation of the same size on the producer's stream, and gives it back to the engine
//! only when it is free; so after an operation (launch, read, write, `get_resource`) that used
//! another stream's buffer, the server records one event on the consumer's stream and keeps a
//! clone of each such binding until that event has completed. While the clone lives, the slice
//! is not free: neither CubeCL nor the engine can hand it out. The events are polled (no
//! blocking, oldest first per stream, as they complete in order) before each reservation and
//! each `memory_usage`;
//! `empty_cache` and the out-of-memory path wait for all of them. A use on the buffer's own
//! stream records nothing: stream order already protects it.
//!
//! The same rule across devices ([`PeerCopy`]): a block another device copies from (the
//! staging block of a `to_device` by peer copy, see `peer`) is held until the event the
//! destination recorded after its copy has completed. That event exists only once the
//! destination's `recv` has issued the copy; until then the block stays held, also through
//! `empty_cache` and the out-of-memory path, which never wait for a `recv` that has not run
//! (it may be queued behind work that waits for this device).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use cubecl_common::stream_id::StreamId;
use cubecl_runtime::memory_management::ManagedMemoryBinding;
use cubecl_runtime::server::{Handle, ServerError};
use cubecl_runtime::storage::{StorageHandle, StorageId};
use parking_lot::Mutex;

use super::super::driver::Driver;
use super::streams::Streams;

/// A buffer's producer, the producer's cursor when the buffer was bound, and its slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BufferUse {
    pub(super) stream: StreamId,
    pub(super) cursor: u64,
    pub(super) slice: SliceKey,
}

/// The slice a buffer is bound to (its block and offset there): the same for every handle and
/// view of one buffer, another for any other buffer while the first is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SliceKey {
    storage: StorageId,
    offset: u64,
}

impl SliceKey {
    pub(super) fn of(slice: &StorageHandle) -> Self {
        Self {
            storage: slice.id,
            offset: slice.utilization.offset,
        }
    }
}

/// Another stream's buffer used by a stream: its binding, held until the use completed, and
/// its slice.
pub(super) struct ForeignUse {
    pub(super) binding: ManagedMemoryBinding,
    pub(super) slice: SliceKey,
}

/// Per producer slot, the producer's cursor at this stream's last wait for it.
#[derive(Debug, Default)]
pub(super) struct SyncPoints {
    last: HashMap<usize, u64>,
}

impl SyncPoints {
    /// Whether a buffer bound at `cursor` on `producer` may be newer than the last sync.
    pub(super) fn needs_wait(&self, producer: usize, cursor: u64) -> bool {
        self.last
            .get(&producer)
            .is_none_or(|synced| *synced < cursor)
    }

    /// This stream now waits for `producer`'s work up to `cursor`.
    pub(super) fn synced(&mut self, producer: usize, cursor: u64) {
        let entry = self.last.entry(producer).or_insert(cursor);
        *entry = (*entry).max(cursor);
    }

    /// `producer` issued new work on a buffer bound at `cursor`: a sync point at or past it no
    /// longer covers that buffer, so it moves just below.
    pub(super) fn rewritten(&mut self, producer: usize, cursor: u64) {
        if let Some(synced) = self.last.get_mut(&producer)
            && *synced >= cursor
        {
            match cursor.checked_sub(1) {
                Some(below) => *synced = below,
                None => {
                    self.last.remove(&producer);
                }
            }
        }
    }
}

/// Work on `stream` about to use `uses`: the stream's own buffers among them may be rewritten,
/// so every other stream's sync point with it is lowered below the oldest of them.
pub(super) fn note_rewrites<D: Driver>(
    streams: &mut Streams<D>,
    stream: StreamId,
    uses: &[BufferUse],
) {
    if streams.len() < 2 {
        return;
    }
    let slot = streams.slot(stream);
    let oldest = uses
        .iter()
        .filter(|buffer| streams.slot(buffer.stream) == slot)
        .map(|buffer| buffer.cursor)
        .min();
    if let Some(oldest) = oldest {
        for other in streams.others(stream) {
            other.synced.rewritten(slot, oldest);
        }
    }
}

/// Orders later work on `consumer` after the work that produced each buffer in `uses`, with
/// one event per producer that is not synced far enough yet.
pub(super) fn order_after<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    consumer: StreamId,
    uses: &[BufferUse],
) -> Result<(), ServerError> {
    // Assigned first: a thread whose first operation is this one gets its slot now, so the
    // wait below goes to the stream its work runs on.
    let consumer_slot = streams.assign_slot(consumer);
    // The newest buffer per producer slot: one wait covers the others.
    let mut newest: Vec<(usize, u64)> = Vec::new();
    for buffer in uses {
        let producer = streams.slot(buffer.stream);
        if producer == consumer_slot {
            continue;
        }
        match newest.iter_mut().find(|(slot, _)| *slot == producer) {
            Some((_, cursor)) => *cursor = (*cursor).max(buffer.cursor),
            None => newest.push((producer, buffer.cursor)),
        }
    }
    for (producer, cursor) in newest {
        if !streams
            .get_slot(driver, consumer_slot)
            .synced
            .needs_wait(producer, cursor)
        {
            continue;
        }
        let (event, producer_cursor) = {
            let stream = streams.get_slot(driver, producer);
            (driver.record_event(&mut stream.driver)?, stream.cursor)
        };
        let stream = streams.get_slot(driver, consumer_slot);
        driver.wait_event(&mut stream.driver, event)?;
        stream.synced.synced(producer, producer_cursor);
    }
    Ok(())
}

/// Orders later work on `issuer` after every other stream's held use (see [`PendingUses`]) of
/// a buffer of `issuer`'s own among `uses`: one event recorded now on each such stream, and a
/// wait for it. Every record of that stream is then marked as ordered for `issuer`, which waits
/// for them no more. Nothing while no use is held.
pub(super) fn order_after_uses<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    pending: &mut PendingUses<D::Event>,
    issuer: StreamId,
    uses: &[BufferUse],
) -> Result<(), ServerError> {
    if pending.by_slot.is_empty() {
        return Ok(());
    }
    let issuer_slot = streams.assign_slot(issuer);
    let own: Vec<SliceKey> = uses
        .iter()
        .filter(|buffer| streams.slot(buffer.stream) == issuer_slot)
        .map(|buffer| buffer.slice)
        .collect();
    if own.is_empty() {
        return Ok(());
    }
    for (&user, queue) in &mut pending.by_slot {
        let unordered = user != issuer_slot
            && queue.iter().any(|held| {
                !held.ordered.contains(&issuer_slot)
                    && held.uses.iter().any(|used| own.contains(&used.slice))
            });
        if !unordered {
            continue;
        }
        let (event, user_cursor) = {
            let stream = streams.get_slot(driver, user);
            (driver.record_event(&mut stream.driver)?, stream.cursor)
        };
        let stream = streams.get_slot(driver, issuer_slot);
        driver.wait_event(&mut stream.driver, event)?;
        stream.synced.synced(user, user_cursor);
        for held in queue.iter_mut() {
            if !held.ordered.contains(&issuer_slot) {
                held.ordered.push(issuer_slot);
            }
        }
    }
    Ok(())
}

/// Where the copy of a block another device reads stands, shared by the block's server and
/// the reading device's server.
#[derive(Debug)]
pub(super) enum PeerCopy<E> {
    /// The reader has not issued its copy yet.
    Pending,
    /// The copy is issued; the event was recorded after it on the reader's stream.
    Issued(E),
    /// No copy reads the block (the reader failed before issuing one).
    NotIssued,
}

/// A [`PeerCopy`] both servers see.
pub(super) type PeerCopyState<E> = Arc<Mutex<PeerCopy<E>>>;

/// Buffers other streams used, held until an event recorded on the user's stream after the use
/// has completed (see the module documentation).
pub(super) struct PendingUses<E> {
    /// Per consumer slot, oldest first: the event recorded after the uses, and the bindings it
    /// keeps from being handed out.
    by_slot: HashMap<usize, VecDeque<HeldUses<E>>>,
    /// Per consumer slot, bindings whose event failed to record: held until the whole stream
    /// is synchronised ([`synchronize_uses`]).
    unrecorded: HashMap<usize, Vec<ManagedMemoryBinding>>,
    /// Blocks another device copies from, each held until that device's copy completed.
    peer_reads: Vec<(PeerCopyState<E>, Handle)>,
}

/// One operation's uses of other streams' buffers, held until `event` completed.
struct HeldUses<E> {
    event: E,
    uses: Vec<ForeignUse>,
    /// The buffers' own slots whose later work waits for this use already
    /// ([`order_after_uses`]).
    ordered: Vec<usize>,
}

impl<E> Default for PendingUses<E> {
    fn default() -> Self {
        Self {
            by_slot: HashMap::new(),
            unrecorded: HashMap::new(),
            peer_reads: Vec::new(),
        }
    }
}

impl<E> PendingUses<E> {
    /// Holds `block` until the copy `state` describes has completed.
    pub(super) fn hold_for_peer(&mut self, state: PeerCopyState<E>, block: Handle) {
        self.peer_reads.push((state, block));
    }

    /// The blocks held for peer copies that are done (`done` asks of an issued copy) or will
    /// never be issued: the server's own staging blocks, which the next poll releases and a
    /// reading counts as cache. Nothing is released here.
    pub(super) fn finished_peer_blocks(&self, mut done: impl FnMut(&E) -> bool) -> Vec<Handle> {
        self.peer_reads
            .iter()
            .filter(|(state, _)| match &*state.lock() {
                PeerCopy::Pending => false,
                PeerCopy::NotIssued => true,
                PeerCopy::Issued(event) => done(event),
            })
            .map(|(_, block)| block.clone())
            .collect()
    }

    /// How many blocks other devices still copy from (or may).
    #[cfg(test)]
    pub(super) fn peer_reads(&self) -> usize {
        self.peer_reads.len()
    }
}

/// Drops the blocks whose peer copy is done or will never be; `wait` tells, for an issued copy,
/// whether it is done (a query, or a wait). A failure keeps the block held and is returned.
fn release_peer_reads<E>(
    reads: &mut Vec<(PeerCopyState<E>, Handle)>,
    mut done: impl FnMut(&E) -> Result<bool, ServerError>,
) -> Result<(), ServerError> {
    let mut failure = Ok(());
    reads.retain(|(state, _)| match &*state.lock() {
        PeerCopy::Pending => true,
        PeerCopy::NotIssued => false,
        PeerCopy::Issued(event) => match done(event) {
            Ok(done) => !done,
            Err(err) => {
                failure = Err(err);
                true
            }
        },
    });
    failure
}

impl<E> PendingUses<E> {
    /// How many events are pending.
    #[cfg(test)]
    pub(super) fn events(&self) -> usize {
        self.by_slot.values().map(VecDeque::len).sum()
    }

    /// How many bindings are held.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        let recorded: usize = self
            .by_slot
            .values()
            .flat_map(|queue| queue.iter().map(|held| held.uses.len()))
            .sum();
        recorded + self.unrecorded.values().map(Vec::len).sum::<usize>()
    }
}

/// After work on `consumer` that used the foreign buffers `foreign` (bindings of other
/// streams' slices): records an event on `consumer` and holds the bindings until it completes.
/// Nothing when `foreign` is empty.
pub(super) fn hold_until_done<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    pending: &mut PendingUses<D::Event>,
    consumer: StreamId,
    foreign: Vec<ForeignUse>,
) -> Result<(), ServerError> {
    if foreign.is_empty() {
        return Ok(());
    }
    let slot = streams.slot(consumer);
    let stream = streams.get_slot(driver, slot);
    match driver.record_event(&mut stream.driver) {
        Ok(event) => {
            pending
                .by_slot
                .entry(slot)
                .or_default()
                .push_back(HeldUses {
                    event,
                    uses: foreign,
                    ordered: Vec::new(),
                });
            Ok(())
        }
        Err(err) => {
            // The buffers cannot be proven unused: held until the stream is synchronised,
            // never freed early (PyTorch's `insert_events` raises and leaves the block alone).
            let bindings = foreign.into_iter().map(|used| used.binding);
            pending.unrecorded.entry(slot).or_default().extend(bindings);
            Err(err)
        }
    }
}

/// Releases the held bindings whose events have completed, oldest first on each stream,
/// without blocking. A query that fails keeps its bindings held and is returned.
pub(super) fn release_completed<D: Driver>(
    driver: &mut D,
    pending: &mut PendingUses<D::Event>,
) -> Result<(), ServerError> {
    let mut failure =
        release_peer_reads(&mut pending.peer_reads, |event| driver.query_event(event));
    if pending.by_slot.is_empty() {
        return failure;
    }
    pending.by_slot.retain(|_, queue| {
        while let Some(held) = queue.front() {
            match driver.query_event(&held.event) {
                Ok(true) => {
                    queue.pop_front();
                }
                Ok(false) => break,
                Err(err) => {
                    failure = Err(err);
                    break;
                }
            }
        }
        !queue.is_empty()
    });
    failure
}

/// Waits for every pending event and releases every held binding (`empty_cache`, the
/// out-of-memory path). A wait that fails keeps what is still pending held and is returned.
pub(super) fn synchronize_uses<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    pending: &mut PendingUses<D::Event>,
) -> Result<(), ServerError> {
    release_peer_reads(&mut pending.peer_reads, |event| {
        driver.synchronize_event(event).map(|()| true)
    })?;
    for queue in pending.by_slot.values_mut() {
        while let Some(held) = queue.front() {
            driver.synchronize_event(&held.event)?;
            queue.pop_front();
        }
    }
    pending.by_slot.clear();
    let slots: Vec<usize> = pending.unrecorded.keys().copied().collect();
    for slot in slots {
        let stream = streams.get_slot(driver, slot);
        cubecl_common::future::block_on(driver.sync(&mut stream.driver))?;
        pending.unrecorded.remove(&slot);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_older_than_the_last_sync_needs_no_wait() {
        let mut points = SyncPoints::default();
        // Never synced with slot 1: any buffer of it needs a wait.
        assert!(points.needs_wait(1, 0));
        points.synced(1, 10);
        assert!(!points.needs_wait(1, 3));
        assert!(!points.needs_wait(1, 10));
        // Bound after the sync point: its producer may still be writing it.
        assert!(points.needs_wait(1, 11));
        // Other producers are tracked apart.
        assert!(points.needs_wait(2, 0));
        // A sync point never moves back by syncing.
        points.synced(1, 4);
        assert!(!points.needs_wait(1, 10));
        // Slot 1 issues work on its buffer of cursor 6: that buffer and newer ones need a
        // wait again, older ones do not.
        points.rewritten(1, 6);
        assert!(points.needs_wait(1, 6));
        assert!(!points.needs_wait(1, 5));
        // Work on a buffer newer than the sync point changes nothing.
        points.rewritten(1, 9);
        assert!(!points.needs_wait(1, 5));
        points.rewritten(1, 0);
        assert!(points.needs_wait(1, 0));
    }
}
