//! Out-of-memory observers: who is told, on which thread, and what a panicking one does.
//!
//! An observer is told once per request that really failed (after every cache was given back
//! and the allocation retried), with the request's error. Where it runs is the allocator's
//! [`ObserverThread`]:
//!
//! - [`ObserverThread::Caller`] (an allocator used directly): on the thread whose request
//!   failed, right after the allocator's lock is released, before the error is returned;
//! - [`ObserverThread::Own`] (what the CubeCL servers set): on a thread of the allocator's
//!   own, one failure after the other. A server's requests run inside the server's task, from
//!   where an observer could call nothing that goes through the server (`memory_stats`,
//!   `empty_cache`, a snapshot of both layers) without re-entering it; on its own thread it
//!   calls them like any other thread, and sees the numbers of after the failure.
//!
//! An observer that panics is caught and reported (`log::error!`, and counted in
//! [`ObserverReport::panicked`]); the request's error stands and the next observers still run.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar};

use parking_lot::Mutex;

use super::error::AllocError;

/// A callback run when a request fails with out-of-memory (see
/// [`CachingAllocator::on_out_of_memory`](super::CachingAllocator::on_out_of_memory)).
pub type OomObserver = Arc<dyn Fn(&AllocError) + Send + Sync>;

/// Where out-of-memory observers run (see
/// [`CachingAllocator::set_observer_thread`](super::CachingAllocator::set_observer_thread)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ObserverThread {
    /// On the thread whose request failed, once the allocator's lock is released and before
    /// the error is returned.
    #[default]
    Caller,
    /// On a thread of the allocator's own, in the order of the failures, while the failed
    /// request's caller goes on: observers may call into whatever made the request (a CubeCL
    /// server) without deadlock.
    Own,
}

/// What the observers did so far, all failures together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObserverReport {
    /// Failures the observers were told of (each observer once per failure).
    pub failures: u64,
    /// Observer calls that returned.
    pub ran: u64,
    /// Observer calls that panicked (caught and logged).
    pub panicked: u64,
}

std::thread_local! {
    /// How many observers the current thread is running (nested when an observer's own
    /// request fails): `wait` returns at once from inside one, which waits for nothing but
    /// itself otherwise, on either [`ObserverThread`].
    static RUNNING_OBSERVERS: core::cell::Cell<u32> = const { core::cell::Cell::new(0) };
}

/// One failure, for the observer thread.
struct Notice {
    error: AllocError,
    observers: Vec<OomObserver>,
}

/// The observer thread: where notices go.
struct Worker {
    notices: Sender<Notice>,
}

/// The registered observers and where they run.
#[derive(Default)]
pub(crate) struct Observers {
    list: Mutex<Vec<OomObserver>>,
    thread: Mutex<ObserverThread>,
    worker: Mutex<Option<Worker>>,
    /// Failures handed out so far (to be run, or run).
    sent: Mutex<u64>,
    report: Arc<(std::sync::Mutex<ObserverReport>, Condvar)>,
}

impl Observers {
    pub(crate) fn push(&self, observer: OomObserver) {
        self.list.lock().push(observer);
    }

    pub(crate) fn set_thread(&self, thread: ObserverThread) {
        *self.thread.lock() = thread;
    }

    /// Tells every observer of `error`, where they run.
    pub(crate) fn notify(&self, error: &AllocError) {
        let observers: Vec<OomObserver> = self.list.lock().clone();
        if observers.is_empty() {
            return;
        }
        *self.sent.lock() += 1;
        if *self.thread.lock() == ObserverThread::Caller {
            run(&self.report, error, &observers);
            return;
        }
        let notice = Notice {
            error: error.clone(),
            observers,
        };
        let mut worker = self.worker.lock();
        let notice = match worker.as_ref() {
            Some(running) => match running.notices.send(notice) {
                Ok(()) => return,
                Err(mpsc::SendError(notice)) => notice,
            },
            None => notice,
        };
        match spawn(self.report.clone()) {
            Ok(spawned) => {
                // A thread that was just started has its receiver: this cannot fail.
                let _ = spawned.notices.send(notice);
                *worker = Some(spawned);
            }
            Err(err) => {
                log::error!(
                    "caching allocator: cannot start the out-of-memory observer thread \
                     ({err}); running the observers on the failing request's thread"
                );
                drop(worker);
                run(&self.report, &notice.error, &notice.observers);
            }
        }
    }

    /// Waits until the observers ran for every failure told so far (at once on
    /// [`ObserverThread::Caller`], and when called from an observer), and says what they did.
    pub(crate) fn wait(&self) -> ObserverReport {
        let target = *self.sent.lock();
        let on_worker = RUNNING_OBSERVERS.get() > 0;
        let (report, done) = &*self.report;
        let mut guard = report
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while !on_worker && guard.failures < target {
            guard = done
                .wait(guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        *guard
    }
}

/// Starts the observer thread.
fn spawn(report: Arc<(std::sync::Mutex<ObserverReport>, Condvar)>) -> std::io::Result<Worker> {
    let (notices, received) = mpsc::channel::<Notice>();
    std::thread::Builder::new()
        .name("caching-alloc-oom-observers".into())
        .spawn(move || {
            // Ends when the allocator (the sender) is dropped.
            for notice in received {
                run(&report, &notice.error, &notice.observers);
            }
        })?;
    Ok(Worker { notices })
}

/// Runs `observers` on `error`, each caught, and counts the failure as handled.
fn run(
    report: &(std::sync::Mutex<ObserverReport>, Condvar),
    error: &AllocError,
    observers: &[OomObserver],
) {
    let (mut ran, mut panicked) = (0, 0);
    for observer in observers {
        RUNNING_OBSERVERS.set(RUNNING_OBSERVERS.get() + 1);
        let outcome = catch_unwind(AssertUnwindSafe(|| observer(error)));
        RUNNING_OBSERVERS.set(RUNNING_OBSERVERS.get() - 1);
        match outcome {
            Ok(()) => ran += 1,
            Err(payload) => {
                panicked += 1;
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string payload".to_owned());
                log::error!(
                    "caching allocator: an out-of-memory observer panicked ({message}); the \
                     request's error stands and the other observers ran"
                );
            }
        }
    }
    let (report, done) = report;
    let mut guard = report
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    guard.failures += 1;
    guard.ran += ran;
    guard.panicked += panicked;
    done.notify_all();
}
