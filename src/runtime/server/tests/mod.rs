//! The generic server over a driver that only records what it is asked to do, on the
//! simulated device behind `Metered`: no GPU needed. These tests pin what the CUDA driver
//! relies on the server for: launch metadata without a device allocation per launch, stream
//! ids on bounded slots, cross-stream waits only when a buffer is newer than the last sync,
//! memory another stream used handed out again only after that stream's event completed, and
//! one out-of-memory per failed request.

mod harness;
mod metadata;
mod opening;
mod ordering;
mod out_of_memory;
mod recording;
mod threads;
mod uncached;

// What the server's other test modules (`comm_tests`, `failed_tests`, `peer_tests`) take from
// here, at the paths they have always used.
pub(super) use harness::{Harness, harness_of, harness_on, stream};
pub(super) use recording::PEER_EVENTS;

// The server's modules that the tests' bodies name as `super::...`.
use super::{checks, registry, streams};
