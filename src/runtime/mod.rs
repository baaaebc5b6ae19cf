//! The CubeCL runtime layer: a `ComputeServer` whose device memory is the caching engine.
//!
//! Two layers hold memory, and each does what it is best at:
//!
//! 1. **CubeCL's persistent pool** (one `MemoryManagement` per stream, no dynamic pools, always
//!    in persistent mode) owns CubeCL's opaque handles: it reserves, binds and resolves them,
//!    and hands a freed tensor's slice to the next tensor of exactly the same size.
//! 2. **The engine** ([`crate::alloc::CachingAllocator`]) is that manager's storage
//!    ([`EngineStorage`]): every new slice is one engine block, placed by PyTorch's rules
//!    (small/large pools, best fit, split, coalesce) in segments it owns.
//!
//! Free slices go back to the engine ([`StreamMemory::reclaim`]) before the engine would grow,
//! on `memory_cleanup`/`empty_cache`, on the out-of-memory path, and before the user API reads
//! the numbers ([`CachingServer::hand_back_free_slices`], so that "allocated" is what live
//! tensors hold).
//!
//! What is public here is what someone needs to put the engine under CubeCL's memory
//! management in a server of their own: [`EngineStorage`] and [`persistent_manager`] (the
//! storage and the manager over it), [`StreamMemory`] (one stream's manager with the reclaim
//! policy), and the [`Driver`] trait that [`CachingServer`] runs on. The first three need no
//! GPU and no feature: they run on the simulated device in tests and benchmarks. The server,
//! the driver trait and the drivers need the `runtime` feature (pulled in by `wgpu` and
//! `cuda`).
//!
//! Files: `storage` (the `ComputeStorage`), `stream_memory` (one stream's manager and its
//! reclaim policy), `server/` (the `ComputeServer`, one file per concern), `driver` (the trait
//! a device API implements), `error` (typed driver errors), `env` (the environment variables
//! read when a device opens), `comm_path` (host or device path between devices), `open` (a
//! device opened on the caller's thread, so that the reason it cannot open reaches the
//! caller), `pinned_host` (the numbers of a driver's pinned host pool), `registry` (where the
//! user API finds a device's allocator, and the configurations given in code for devices not
//! yet open), `scopes` (the memory scopes of each CubeCL stream, which tag its reservations), `thread_exit`
//! (the stream ids of threads that have gone, reported to the servers).

mod storage;
mod stream_memory;

#[cfg(feature = "runtime")]
mod comm_path;
#[cfg(feature = "runtime")]
mod driver;
#[cfg(feature = "runtime")]
pub(crate) mod env;
#[cfg(feature = "runtime")]
mod error;
#[cfg(feature = "runtime")]
pub(crate) mod open;

#[cfg(feature = "runtime")]
mod pinned_host;
#[cfg(feature = "runtime")]
pub(crate) mod pool_route;
#[cfg(feature = "runtime")]
pub(crate) mod registry;
#[cfg(feature = "runtime")]
pub(crate) mod scopes;
#[cfg(feature = "runtime")]
pub(crate) mod server;
#[cfg(feature = "runtime")]
mod stream_routes;
#[cfg(feature = "runtime")]
pub(crate) mod thread_exit;

#[cfg(feature = "runtime")]
pub use comm_path::{COMM_ENV, Communication, communication, set_communication};
#[cfg(feature = "runtime")]
pub use driver::{Collective, DeviceReduce, Driver, Launch, LaunchCount, MetadataLayout, Resource};
#[cfg(feature = "runtime")]
pub use env::{OOM_SNAPSHOT_ENV, TRACE_ENV};
#[cfg(feature = "runtime")]
pub use error::DriverError;
#[cfg(feature = "runtime")]
pub use pinned_host::{CallTime, PinnedHostPool, PinnedHostStats};
#[cfg(feature = "runtime")]
pub use server::{CachingServer, CallerStackPolicy, CubeclLayerUsage};
pub use storage::{
    EngineResource, EngineStorage, Growth, PersistentManager, device_io_error, persistent_manager,
};
pub use stream_memory::{FreeSlices, ReclaimCounters, ReclaimPolicy, ReserveError, StreamMemory};
