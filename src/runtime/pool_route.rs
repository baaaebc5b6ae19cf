//! Which private pool a CubeCL stream's reservations on a device go to (PyTorch's
//! `torch.cuda.use_mem_pool`, which routes the calling thread's allocations only).
//!
//! A route is entered by the thread that makes the tensors ([`PoolRoute::enter`], behind
//! `backend::use_mem_pool`) and kept by allocator and CubeCL stream in a
//! [`StreamRoutes`](super::stream_routes::StreamRoutes) table (why by stream: see there); the
//! pool travels with the reservation to the device thread (`caller_stack`). Routes nest: the
//! innermost one of an allocator and stream wins.

use cubecl_common::stream_id::StreamId;

use super::stream_routes::{RouteGuard, StreamRoutes};
use crate::alloc::MemPoolId;

/// Every route, by (allocator id, stream).
static ROUTES: StreamRoutes<(u64, StreamId), MemPoolId> = StreamRoutes::new();

/// The pool that `stream`'s reservations through allocator `allocator` go to now.
pub(crate) fn current(allocator: u64, stream: StreamId) -> Option<MemPoolId> {
    ROUTES.current(&(allocator, stream))
}

/// The calling thread's stream's reservations through one allocator go to one pool while
/// this lives. Bound to its thread (not `Send`), as its stream is.
pub(crate) struct PoolRoute {
    _route: RouteGuard<(u64, StreamId), MemPoolId>,
}

impl PoolRoute {
    /// Routes the calling thread's reservations through allocator `allocator` to `pool`.
    pub(crate) fn enter(allocator: u64, pool: MemPoolId) -> Self {
        Self {
            _route: ROUTES.enter((allocator, StreamId::current()), pool),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_nest_per_allocator_and_stay_on_their_stream() {
        let (a, b) = (MemPoolId::from_number(1), MemPoolId::from_number(2));
        let here = StreamId::current();
        assert_eq!(current(7, here), None);
        let outer = PoolRoute::enter(7, a);
        {
            let _inner = PoolRoute::enter(7, b);
            let _other = PoolRoute::enter(8, a);
            assert_eq!(
                current(7, here),
                Some(b),
                "the innermost route of the allocator"
            );
            assert_eq!(current(8, here), Some(a));
            let elsewhere = std::thread::spawn(StreamId::current).join().unwrap();
            assert_eq!(current(7, elsewhere), None, "another thread's stream");
        }
        assert_eq!(current(7, here), Some(a));
        assert_eq!(current(8, here), None);
        drop(outer);
        assert_eq!(current(7, here), None);
    }
}
