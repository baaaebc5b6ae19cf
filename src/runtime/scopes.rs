//! Memory scopes of CubeCL streams: the scope a caller's reservations are tagged with, found by
//! the stream id they are made on rather than by the thread that makes them.
//!
//! Without fusion, a tensor operation reserves its memory on the thread that called it, with
//! that thread's CubeCL stream id. Under burn-fusion, the operation is queued and executes
//! later on burn-fusion's device thread, but inside the stream id of the thread that queued it
//! (burn-fusion 0.21 `stream/multi.rs` `MultiStream::drain` and `op.rs` `UnfusedOp::execute`
//! both run under `StreamId::executes` with the queuing thread's id). So the layout policy, which
//! runs on whatever thread makes the client call, finds the caller's scope by the stream id it
//! is given, on both paths. A scope drains the fusion queue when it begins and ends (the
//! backend's guard does), so what was queued inside it executes inside it.

use std::collections::HashMap;

use cubecl_common::stream_id::StreamId;
use parking_lot::Mutex;

use crate::alloc::{ActiveCount, Tag, count_active};

/// One stream's active scopes, innermost last, each with the number its guard removes.
type StreamScopes = Vec<(u64, Tag)>;

/// Per stream id, its active scopes.
static SCOPES: Mutex<Option<HashMap<u64, StreamScopes>>> = Mutex::new(None);

/// The number of the next scope entered (a guard removes its own entry, whatever the order).
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// An active scope of one stream; dropping it ends the scope.
#[derive(Debug)]
pub(crate) struct StreamScope {
    stream: u64,
    number: u64,
    _counted: ActiveCount,
}

/// Makes `tag` the innermost scope of the calling thread's CubeCL stream until the returned
/// value drops.
pub(crate) fn enter(tag: Tag) -> StreamScope {
    let stream = StreamId::current().value;
    let number = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    SCOPES
        .lock()
        .get_or_insert_with(HashMap::new)
        .entry(stream)
        .or_default()
        .push((number, tag));
    StreamScope {
        stream,
        number,
        _counted: count_active(),
    }
}

impl Drop for StreamScope {
    fn drop(&mut self) {
        let mut scopes = SCOPES.lock();
        let Some(streams) = scopes.as_mut() else {
            return;
        };
        if let Some(stack) = streams.get_mut(&self.stream) {
            stack.retain(|(number, _)| *number != self.number);
            if stack.is_empty() {
                streams.remove(&self.stream);
            }
        }
    }
}

/// The scope a reservation made on `stream` is tagged with: the stream's innermost scope, else
/// the calling thread's own (`alloc::Tag::enter`). One relaxed atomic load while no scope is
/// active anywhere.
pub(crate) fn current(stream: StreamId) -> Option<Tag> {
    if !Tag::any_active() {
        return None;
    }
    let of_stream = SCOPES
        .lock()
        .as_ref()
        .and_then(|streams| streams.get(&stream.value))
        .and_then(|stack| stack.last().map(|(_, tag)| tag.clone()));
    of_stream.or_else(Tag::current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streams_scopes_nest_and_end_in_any_order() {
        let stream = StreamId::current();
        let outer = enter(Tag::new("outer"));
        let inner = enter(Tag::new("inner"));
        assert_eq!(current(stream).as_ref().map(Tag::name), Some("inner"));
        let other = StreamId {
            value: stream.value + 1_000_000,
        };
        assert_eq!(current(other), None, "another stream has no scope");
        drop(outer);
        assert_eq!(current(stream).as_ref().map(Tag::name), Some("inner"));
        drop(inner);
        assert_eq!(current(stream), None);
    }
}
