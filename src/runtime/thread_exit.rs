//! Threads that have gone: the CubeCL stream id of every thread that used a caching runtime,
//! reported to every open server when the thread exits.
//!
//! CubeCL names a stream after the thread that uses it and says nothing when the thread ends,
//! so a server can only guess from silence that a stream's thread is gone (see the server's
//! slot reuse). A thread that opens a client of ours ([`watch_current_thread`], called by both
//! runtimes' `Runtime::client`, which Burn calls on the thread that creates a tensor: a data
//! loader's worker does at its first batch) carries a thread-local watch; its destructor, run
//! when the thread exits (before a `join` of it returns), posts the thread's stream id to the
//! [`ExitInbox`] of every live server. The server reads its inbox when it next meets a new
//! thread, and gives that thread the slot of one that is gone instead of a new one.
//!
//! The id is the one the thread had when the watch was made. A thread that first opens a client
//! while it runs another stream's work under that stream's id (burn-fusion does when it drains
//! a stream on another thread's behalf) reports that id at its exit: the slot is then shared
//! with a new thread while its own thread may still run, which is correct (ids beyond
//! `max_streams` share slots the same way) and costs only cache locality.

use std::sync::{Arc, Weak};

use cubecl_common::stream_id::StreamId;
use parking_lot::Mutex;

/// The inboxes of every live server.
static INBOXES: Mutex<Vec<Weak<ExitInbox>>> = Mutex::new(Vec::new());

/// The stream ids of the watched threads still alive, with how many threads carry each (a
/// thread that first opened a client under another thread's id carries that id as well).
static WATCHED: Mutex<Vec<(u64, u32)>> = Mutex::new(Vec::new());

/// The most exits of threads it has not matched to a slot that a server keeps in each of two
/// places, the newest: unread in its inbox, and read before the thread's first operation
/// reached it (the server's own list). A server that sees no new thread for a long time
/// (threads of other devices exiting, or `cross_stream_reuse:false`) would otherwise keep an
/// id per exiting thread for the process's life. An exit forgotten only keeps its slot from
/// being taken at once by the next new thread.
pub(crate) const UNMATCHED_EXITS: usize = 1024;

/// One server's list of stream ids whose threads have exited since it last read it (the
/// newest [`UNMATCHED_EXITS`]).
#[derive(Debug, Default)]
pub(crate) struct ExitInbox {
    ids: Mutex<std::collections::VecDeque<u64>>,
}

impl ExitInbox {
    /// A new inbox, posted to from now on by every watched thread that exits.
    pub(crate) fn subscribe() -> Arc<Self> {
        let inbox = Arc::new(Self::default());
        let mut inboxes = INBOXES.lock();
        inboxes.retain(|inbox| inbox.strong_count() > 0);
        inboxes.push(Arc::downgrade(&inbox));
        inbox
    }

    /// The ids posted since the last call.
    pub(crate) fn take(&self) -> Vec<u64> {
        core::mem::take(&mut *self.ids.lock()).into()
    }
}

/// Posts `id` to every live inbox.
fn post(id: u64) {
    for inbox in INBOXES.lock().iter().filter_map(Weak::upgrade) {
        let mut ids = inbox.ids.lock();
        if ids.len() == UNMATCHED_EXITS {
            ids.pop_front();
        }
        ids.push_back(id);
    }
}

/// The thread-local watch: posts its thread's stream id when the thread exits.
struct Watch {
    id: u64,
}

impl Watch {
    /// The watch of the calling thread, counted among the live watched ids.
    fn new() -> Self {
        let id = StreamId::current().value;
        let mut watched = WATCHED.lock();
        match watched.iter_mut().find(|(watched, _)| *watched == id) {
            Some((_, threads)) => *threads += 1,
            None => watched.push((id, 1)),
        }
        Self { id }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        {
            let mut watched = WATCHED.lock();
            if let Some(index) = watched.iter().position(|(id, _)| *id == self.id) {
                watched[index].1 -= 1;
                if watched[index].1 == 0 {
                    watched.swap_remove(index);
                }
            }
        }
        post(self.id);
    }
}

thread_local! {
    static WATCH: Watch = Watch::new();
}

/// Whether a live thread watched under stream id `id` will report its exit: a server then
/// waits for the report instead of taking the thread's silence for its exit.
pub(crate) fn is_watched(id: u64) -> bool {
    WATCHED.lock().iter().any(|(watched, _)| *watched == id)
}

/// Makes the calling thread report its exit to the servers (once per thread; a thread-local
/// lookup afterwards). A thread already being torn down is not watched.
pub(crate) fn watch_current_thread() {
    let _ = WATCH.try_with(|_| ());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_thread_reports_its_stream_id_at_exit_to_every_live_inbox() {
        let first = ExitInbox::subscribe();
        let second = ExitInbox::subscribe();
        let id = std::thread::spawn(|| {
            watch_current_thread();
            watch_current_thread();
            StreamId::current().value
        })
        .join()
        .expect("thread");
        // Other tests' threads may exit meanwhile: look for this one's id, once.
        for inbox in [&first, &second] {
            let ids = inbox.take();
            assert_eq!(
                ids.iter().filter(|&&posted| posted == id).count(),
                1,
                "{ids:?}"
            );
            assert!(!inbox.take().contains(&id), "taken once");
        }
        // A thread that never opened a client says nothing.
        let silent = std::thread::spawn(|| StreamId::current().value)
            .join()
            .expect("thread");
        assert!(!first.take().contains(&silent));
        // A dropped inbox is no longer posted to.
        drop(second);
        let id = std::thread::spawn(|| {
            watch_current_thread();
            StreamId::current().value
        })
        .join()
        .expect("thread");
        assert!(first.take().contains(&id));
    }

    /// An inbox nobody reads (a server that sees no new thread) keeps only the newest
    /// [`UNMATCHED_EXITS`] exits; it grew by one id per exiting thread for the process's life.
    #[test]
    fn an_unread_inbox_keeps_only_the_newest_exits() {
        let inbox = ExitInbox::subscribe();
        for id in 0..(3 * UNMATCHED_EXITS as u64) {
            post(u64::MAX - id);
        }
        let ids = inbox.take();
        assert!(ids.len() <= UNMATCHED_EXITS, "{} exits kept", ids.len());
        assert!(
            ids.contains(&(u64::MAX - (3 * UNMATCHED_EXITS as u64 - 1))),
            "the newest"
        );
        assert!(!ids.contains(&u64::MAX), "the oldest dropped");
    }
}
