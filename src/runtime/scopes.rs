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

use cubecl_common::stream_id::StreamId;

use super::stream_routes::{RouteGuard, StreamRoutes};
use crate::alloc::{ActiveCount, Tag, count_active};

/// Per stream id, its active scopes.
static SCOPES: StreamRoutes<u64, Tag> = StreamRoutes::new();

/// An active scope of one stream; dropping it ends the scope.
#[derive(Debug)]
pub(crate) struct StreamScope {
    _entry: RouteGuard<u64, Tag>,
    _counted: ActiveCount,
}

/// Makes `tag` the innermost scope of the calling thread's CubeCL stream until the returned
/// value drops.
pub(crate) fn enter(tag: Tag) -> StreamScope {
    StreamScope {
        _entry: SCOPES.enter(StreamId::current().value, tag),
        _counted: count_active(),
    }
}

/// The scope a reservation made on `stream` is tagged with: the stream's innermost scope, else
/// the calling thread's own (`alloc::Tag::enter`). One relaxed atomic load while no scope is
/// active anywhere.
pub(crate) fn current(stream: StreamId) -> Option<Tag> {
    if !Tag::any_active() {
        return None;
    }
    SCOPES.current(&stream.value).or_else(Tag::current)
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
