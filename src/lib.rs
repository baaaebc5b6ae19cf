//! burn-caching-alloc: a PyTorch-style caching allocator for CubeCL, shipped as Burn backends.
//!
//! Layers, each knowing only the one below:
//! - [`alloc`]: the engine (pools, best fit, split, coalesce, statistics, snapshots, traces);
//! - [`device`]: raw device memory behind the [`device::DeviceMemory`] trait;
//! - [`runtime`]: the CubeCL server over the engine, generic over a device driver;
//! - `backend` (feature `runtime`): Burn aliases and the user API (`memory_stats`, ...);
//! - `mnist` (feature `runtime`): the MNIST showcase that `examples/mnist.rs` runs;
//! - [`replay`]: trace generators and replays through the engine and CubeCL's own pools, for
//!   `examples/replay` and `benches/replay.rs`.

pub mod alloc;
#[cfg(feature = "runtime")]
pub mod backend;
pub mod device;
#[cfg(feature = "runtime")]
pub mod mnist;
pub mod replay;
pub mod runtime;

pub use alloc::{AllocError, Allocation, AllocatorConfig, CachingAllocator, MemoryStats};
pub use device::{DeviceMemory, StreamId};
