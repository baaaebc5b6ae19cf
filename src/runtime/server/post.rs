//! Where a transfer waits for its `recv`: one queue per (source device, destination device,
//! stream id), in send order, whichever path `send` took.
//!
//! `send` decides the path (host memory, or the driver's device copy: `comm`, `peer`) and
//! posts what that path hands over: the bytes read on the host, or the staging block and its
//! shared copy state. `recv` takes the oldest posting of its route and finishes the transfer
//! the way the posting says, without asking the path again. The communication setting
//! (`set_communication`, `BURN_CACHING_ALLOC_COMM`) is read at each transfer, and the two
//! sides run on different threads at different times: had `recv` chosen its own path, a
//! change between a `send` and its `recv` would have it wait on a queue that `send` never
//! posted to, forever. Errors travel the same way: a `send` that cannot read its source posts
//! the error, and the peer's `recv` returns it on its stream.
//!
//! Boxed as `Any`: one office serves every driver type (routes never mix them: device ids
//! carry their runtime's type, and a mismatch is an error, not a panic).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::LazyLock;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_runtime::server::ServerError;
use parking_lot::{Condvar, Mutex};

use super::super::driver::Driver;
use super::peer::Parcel;

/// Where a posting waits for its `recv`: the pair and the calling thread's stream (CubeCL
/// names both clients' streams after the calling thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Route {
    pub(super) src: DeviceId,
    pub(super) dst: DeviceId,
    pub(super) stream: u64,
}

/// What `send` posted: the path it chose, with what that path hands over, or its error.
pub(super) enum Posting<D: Driver> {
    /// The host path: the source's bytes.
    Host(Result<Bytes, ServerError>),
    /// The device path: the staging block the destination copies from.
    Device(Result<Parcel<D>, ServerError>),
}

/// Postings not yet received, per route in send order.
#[derive(Default)]
pub(super) struct Office {
    postings: Mutex<HashMap<Route, VecDeque<Box<dyn Any + Send>>>>,
    arrived: Condvar,
}

/// The process's one office.
pub(super) static OFFICE: LazyLock<Office> = LazyLock::new(Office::default);

impl Office {
    /// Posts `posting` on `route`, after every earlier posting of the route.
    pub(super) fn post<D: Driver>(&self, route: Route, posting: Posting<D>) {
        self.postings
            .lock()
            .entry(route)
            .or_default()
            .push_back(Box::new(posting));
        self.arrived.notify_all();
    }

    /// The oldest posting on `route`, waiting for its `send` if it has not run yet.
    pub(super) fn collect<D: Driver>(&self, route: Route) -> Posting<D> {
        let mut postings = self.postings.lock();
        let boxed = loop {
            if let Some(queue) = postings.get_mut(&route)
                && let Some(posting) = queue.pop_front()
            {
                if queue.is_empty() {
                    postings.remove(&route);
                }
                break posting;
            }
            self.arrived.wait(&mut postings);
        };
        match boxed.downcast::<Posting<D>>() {
            Ok(posting) => *posting,
            Err(_) => Posting::Host(Err(ServerError::Generic {
                reason: format!(
                    "caching allocator: the transfer from {} to {} was sent by another device API",
                    route.src, route.dst
                ),
                backtrace: BackTrace::capture(),
            })),
        }
    }
}
