//! Cross-stream ordering, as cubecl-runtime's event streams (`stream/event.rs`) do it: work on
//! one stream that uses a buffer of another stream waits for that stream only when the buffer
//! may be newer than the last point the two streams synced at.
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
//! Not covered, as in CubeCL: a stream writing in place into another stream's buffer, which
//! that stream then uses without a wait (buffers are ordered by the stream that created them).

use std::collections::HashMap;

use cubecl_common::stream_id::StreamId as CubeStreamId;
use cubecl_runtime::server::ServerError;

use super::super::driver::Driver;
use super::streams::Streams;

/// A foreign buffer's producer and the producer's cursor when the buffer was bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BufferUse {
    pub(super) stream: CubeStreamId,
    pub(super) cursor: u64,
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
    stream: CubeStreamId,
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
    consumer: CubeStreamId,
    uses: &[BufferUse],
) -> Result<(), ServerError> {
    let consumer_slot = streams.slot(consumer);
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
