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
//! As in CubeCL, a buffer's cursor is where it was created: the work that fills a new buffer
//! is issued by its stream right after it (Burn's tensors are written by the operation that
//! creates them), before the buffer can reach another stream.

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
        // A sync point never moves back.
        points.synced(1, 4);
        assert!(!points.needs_wait(1, 10));
    }
}
