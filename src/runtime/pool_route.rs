//! Which private pool a CubeCL stream's reservations on a device go to (PyTorch's
//! `torch.cuda.use_mem_pool`, which routes the calling thread's allocations only).
//!
//! A route is entered by the thread that makes the tensors ([`PoolRoute::enter`], behind
//! `backend::use_mem_pool`) for its CubeCL stream (`StreamId::current()`, one per thread), and
//! read where that stream's client calls run the server's layout policy (`caller_stack`: the
//! pool travels with the reservation to the device thread). That is the caller's thread
//! without fusion, and burn-fusion's device thread with it: fusion runs a stream's queued
//! operations under that stream's id (`StreamId::executes`), which is why routes are kept by
//! stream, not in a thread-local. Routes nest: the innermost one of a device and stream wins.
//! Reading costs one relaxed atomic load while no route exists anywhere.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};

use cubecl_common::stream_id::StreamId;
use parking_lot::Mutex;

use crate::alloc::MemPoolId;

/// Routes entered and not yet left, on every stream.
static ROUTES_ANYWHERE: AtomicUsize = AtomicUsize::new(0);

/// Every route, innermost last: (allocator id, stream, pool).
static ROUTES: Mutex<Vec<(u64, StreamId, MemPoolId)>> = Mutex::new(Vec::new());

/// The pool that `stream`'s reservations through allocator `allocator` go to now.
pub(crate) fn current(allocator: u64, stream: StreamId) -> Option<MemPoolId> {
    if ROUTES_ANYWHERE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    ROUTES
        .lock()
        .iter()
        .rev()
        .find(|(a, s, _)| *a == allocator && *s == stream)
        .map(|(_, _, pool)| *pool)
}

/// The calling thread's stream's reservations through one allocator go to one pool while
/// this lives. Bound to its thread (not `Send`), as its stream is.
pub(crate) struct PoolRoute {
    route: (u64, StreamId, MemPoolId),
    _thread: PhantomData<*const ()>,
}

impl PoolRoute {
    /// Routes the calling thread's reservations through allocator `allocator` to `pool`.
    pub(crate) fn enter(allocator: u64, pool: MemPoolId) -> Self {
        let route = (allocator, StreamId::current(), pool);
        ROUTES.lock().push(route);
        ROUTES_ANYWHERE.fetch_add(1, Ordering::Relaxed);
        Self {
            route,
            _thread: PhantomData,
        }
    }
}

impl Drop for PoolRoute {
    fn drop(&mut self) {
        let mut routes = ROUTES.lock();
        // Guards dropped out of order leave the others in place.
        if let Some(at) = routes.iter().rposition(|r| *r == self.route) {
            routes.remove(at);
        }
        ROUTES_ANYWHERE.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_nest_per_allocator_and_stay_on_their_stream() {
        let (a, b) = (MemPoolId(1), MemPoolId(2));
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
