//! burn-caching-alloc: a PyTorch-style caching allocator for CubeCL, shipped as Burn backends.
//!
//! Layers, each knowing only the one below:
//! - [`alloc`]: the engine (pools, best fit, split, coalesce, statistics, snapshots, traces);
//! - [`device`]: raw device memory behind the [`device::DeviceMemory`] trait.

pub mod alloc;
pub mod device;

pub use alloc::{AllocError, AllocatorConfig, Allocation, CachingAllocator, MemoryStats};
pub use device::{DeviceMemory, StreamId};
