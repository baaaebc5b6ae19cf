//! burn-caching-alloc: a PyTorch-style caching allocator for CubeCL, shipped as Burn backends.
//!
//! Layers, each knowing only the ones below it:
//! - [`alloc`]: the engine (pools, best fit, split, coalesce, statistics, snapshots, traces).
//!   Pure Rust: it knows devices only through [`device::DeviceMemory`];
//! - [`device`]: the raw-memory trait, a simulated device and a metering wrapper;
//! - [`runtime`]: the CubeCL server over the engine, generic over a [`runtime::Driver`], and
//!   the per-stream pieces that put the engine under CubeCL's memory management;
//! - `cuda` (feature `cuda`) and `wgpu` (feature `wgpu`): one folder per backend, each with its
//!   device memory, its driver and its `cubecl::Runtime`;
//! - `backend` (features `cuda` or `wgpu`): the Burn aliases (`CachingCuda`, `CachingWgpu`) and
//!   the user API (`memory_stats`, `empty_cache`, ...).
//!
//! Each public item has one path: its own module's (`alloc::CachingAllocator`,
//! `device::DeviceStream`, `cuda::CachingCudaRuntime`, `backend::CachingWgpu`, ...); no layer
//! re-exports what sits above it.
//!
//! The MNIST showcase (`examples/mnist`) and the trace replay benchmark (`replay/`) are
//! workspace crates of their own, built on this API.
#![warn(unnameable_types)]
#![warn(missing_docs)]

pub mod alloc;
#[cfg(feature = "runtime")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod runtime;
#[cfg(feature = "wgpu")]
pub mod wgpu;
