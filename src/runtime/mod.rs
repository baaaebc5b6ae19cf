//! The CubeCL runtime layer: a `ComputeServer` whose device memory is the caching engine.
//!
//! Two layers hold memory, and each does what it is best at:
//!
//! 1. **CubeCL's persistent pool** (one `MemoryManagement` per stream, no dynamic pools, always
//!    in persistent mode) owns CubeCL's opaque handles: it reserves, binds and resolves them,
//!    and hands a freed tensor's slice to the next tensor of exactly the same size.
//! 2. **The engine** ([`crate::alloc::CachingAllocator`]) is that manager's storage
//!    ([`storage::EngineStorage`]): every new slice is one engine block, placed by PyTorch's
//!    rules (small/large pools, best fit, split, coalesce) in segments it owns.
//!
//! Free slices go back to the engine ([`reclaim`]) before the engine would grow, on
//! `memory_cleanup`/`empty_cache`, and on the out-of-memory path.
//!
//! [`storage`] and [`reclaim`] need no GPU and no feature: they run on the simulated device in
//! tests and benchmarks. The server, its [`driver::Driver`] trait and the drivers need the
//! `runtime` feature (pulled in by `wgpu` and `cuda`).

pub mod reclaim;
pub mod storage;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "runtime")]
pub mod driver;
#[cfg(feature = "runtime")]
pub mod registry;
#[cfg(feature = "runtime")]
pub mod server;
#[cfg(feature = "wgpu")]
pub mod wgpu;

#[cfg(feature = "cuda")]
pub use cuda::{CachingCudaRuntime, CudaDriver};
#[cfg(feature = "runtime")]
pub use driver::Driver;
#[cfg(feature = "runtime")]
pub use server::CachingServer;
#[cfg(feature = "wgpu")]
pub use wgpu::{CachingWgpuRuntime, WgpuDriver};
