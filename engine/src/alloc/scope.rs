//! Memory scopes: a name that tags every block allocated while it is active, so that
//! statistics, reports and snapshots can say what the memory is for (PyTorch's
//! `torch.cuda.memory._set_memory_metadata`, whose string is a snapshot block's
//! `user_metadata`).
//!
//! A [`Tag`] is a shared name. [`Tag::enter`] makes it the calling thread's scope until the
//! returned [`ScopeGuard`] drops; scopes nest, and the innermost one tags the blocks (the
//! outer one's counters do not include what an inner scope allocated). The engine reads the
//! tag of each request with [`Tag::of_request`]: the tag a serving thread was handed
//! ([`Tag::serving`], the runtime's device thread serving a caller's queued call), else the
//! calling thread's scope.
//!
//! While no scope is active anywhere, asking costs one relaxed atomic load
//! ([`Tag::any_active`]): the runtime asks on every reservation.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// How many scopes are active, over all threads (and every runtime's own scope registry).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Whether a tag was ever made: from then on, a block served from a cache above the engine
/// is re-tagged with its new request's tag (or its tag cleared).
static EVER: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The calling thread's scopes, innermost last.
    static SCOPES: RefCell<Vec<Tag>> = const { RefCell::new(Vec::new()) };
    /// The tag [`Tag::serving`] set on this thread.
    static SERVED: RefCell<Option<Tag>> = const { RefCell::new(None) };
}

/// A scope's name, shared by every block it tags. Cloning shares the name.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(Arc<str>);

impl Tag {
    /// A tag named `name`. Any string is accepted; the statistics' keys
    /// (`scope.<name>.allocated_bytes.current`) use it as it is.
    pub fn new(name: &str) -> Self {
        EVER.store(true, Ordering::Relaxed);
        Tag(Arc::from(name))
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.0
    }

    /// Makes this tag the calling thread's scope until the guard drops: the engine's requests
    /// made on this thread meanwhile are tagged with it (unless a nested scope is entered).
    pub fn enter(self) -> ScopeGuard {
        SCOPES.with(|scopes| scopes.borrow_mut().push(self));
        ScopeGuard::counted()
    }

    /// The calling thread's innermost scope, if one is active.
    pub fn current() -> Option<Tag> {
        if !Self::any_active() {
            return None;
        }
        SCOPES.with(|scopes| scopes.borrow().last().cloned())
    }

    /// Whether a scope is active on any thread: one relaxed atomic load.
    pub fn any_active() -> bool {
        ACTIVE.load(Ordering::Relaxed) != 0
    }

    /// Whether any tag was ever made in this process.
    pub fn ever_used() -> bool {
        EVER.load(Ordering::Relaxed)
    }

    /// Runs `f` with `tag` standing for the calling thread's scope: every allocation the
    /// engine serves inside `f`, on this thread, is tagged `tag`. `None` changes nothing.
    pub fn serving<R>(tag: Option<Tag>, f: impl FnOnce() -> R) -> R {
        super::stack::serving_with(&SERVED, tag, f)
    }

    /// The tag of the request being served on this thread ([`Tag::serving`]), or else the
    /// thread's own scope.
    pub(crate) fn of_request() -> Option<Tag> {
        if !Self::ever_used() {
            return None;
        }
        SERVED
            .with(|served| served.borrow().clone())
            .or_else(Self::current)
    }
}

impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An active scope; dropping it ends the scope (see [`Tag::enter`]). Scopes end in the order
/// opposite to the one they began in, as guards on one thread do.
#[must_use = "the scope ends when the guard drops"]
pub struct ScopeGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ScopeGuard {
    fn counted() -> Self {
        ACTIVE.fetch_add(1, Ordering::Relaxed);
        ScopeGuard {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl fmt::Debug for ScopeGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopeGuard").finish_non_exhaustive()
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        SCOPES.with(|scopes| scopes.borrow_mut().pop());
        ACTIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a scope another layer keeps (the runtime's scopes per CubeCL stream) as active, so
/// that [`Tag::any_active`] stays the one check; the count drops with the returned value.
pub fn count_active() -> ActiveCount {
    ACTIVE.fetch_add(1, Ordering::Relaxed);
    ActiveCount(())
}

/// One scope counted by [`count_active`].
#[derive(Debug)]
pub struct ActiveCount(());

impl Drop for ActiveCount {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_per_thread_and_serving_wins() {
        let outer = Tag::new("outer").enter();
        assert_eq!(Tag::of_request().as_ref().map(Tag::name), Some("outer"));
        {
            let _inner = Tag::new("inner").enter();
            assert_eq!(Tag::of_request().as_ref().map(Tag::name), Some("inner"));
            std::thread::spawn(|| assert_eq!(Tag::current(), None))
                .join()
                .unwrap();
            let served = Tag::serving(Some(Tag::new("served")), Tag::of_request);
            assert_eq!(served.as_ref().map(Tag::name), Some("served"));
        }
        assert_eq!(Tag::of_request().as_ref().map(Tag::name), Some("outer"));
        drop(outer);
        assert_eq!(Tag::current(), None);
    }
}
