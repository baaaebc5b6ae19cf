//! What a CubeCL stream's reservations carry while a guard lives: a table of entries per
//! stream, innermost last, shared by memory scopes (`scopes`) and private-pool routes
//! (`pool_route`).
//!
//! An entry is entered by the thread that makes the tensors, for its CubeCL stream
//! (`StreamId::current()`, one per thread), and read where that stream's client calls run the
//! server's layout policy (`caller_stack`). That is the caller's thread without fusion, and
//! burn-fusion's device thread with it: fusion runs a stream's queued operations under that
//! stream's id (`StreamId::executes`), which is why entries are kept by stream, not in a
//! thread-local. Entries nest: the innermost one of a key wins; guards may drop in any order.
//! Reading costs one relaxed atomic load while the table is empty.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Entries of `V` by key `K` (a stream, or an allocator and a stream), innermost last.
pub(crate) struct StreamRoutes<K, V> {
    /// Entries entered and not yet left.
    active: AtomicUsize,
    /// The number of the next entry (a guard removes its own, whatever the order).
    next: AtomicU64,
    entries: Mutex<Vec<(u64, K, V)>>,
}

impl<K: PartialEq, V: Clone> StreamRoutes<K, V> {
    pub(crate) const fn new() -> Self {
        Self {
            active: AtomicUsize::new(0),
            next: AtomicU64::new(1),
            entries: Mutex::new(Vec::new()),
        }
    }

    /// The innermost entry of `key`.
    pub(crate) fn current(&self, key: &K) -> Option<V> {
        if self.active.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.entries
            .lock()
            .iter()
            .rev()
            .find(|(_, k, _)| k == key)
            .map(|(_, _, value)| value.clone())
    }

    /// Makes `value` the innermost entry of `key` until the returned guard drops.
    pub(crate) fn enter(&'static self, key: K, value: V) -> RouteGuard<K, V> {
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        self.entries.lock().push((number, key, value));
        self.active.fetch_add(1, Ordering::Relaxed);
        RouteGuard {
            routes: self,
            number,
            _thread: PhantomData,
        }
    }
}

/// One entry of a [`StreamRoutes`]; dropping it removes the entry. Bound to its thread (not
/// `Send`), as its stream is.
pub(crate) struct RouteGuard<K: 'static, V: 'static> {
    routes: &'static StreamRoutes<K, V>,
    number: u64,
    _thread: PhantomData<*const ()>,
}

impl<K, V> std::fmt::Debug for RouteGuard<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteGuard")
            .field("number", &self.number)
            .finish()
    }
}

impl<K, V> Drop for RouteGuard<K, V> {
    fn drop(&mut self) {
        let mut entries = self.routes.entries.lock();
        if let Some(at) = entries.iter().position(|(n, _, _)| *n == self.number) {
            entries.remove(at);
        }
        self.routes.active.fetch_sub(1, Ordering::Relaxed);
    }
}
