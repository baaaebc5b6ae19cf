//! caching-alloc-engine: a PyTorch-style caching allocator for GPU memory, knowing devices only
//! through one small trait.
//!
//! Large and small pools, best-fit splitting, coalescing on free, expandable segments,
//! PyTorch-named statistics (`memory_allocated`, `memory_reserved`, peaks, retries, OOMs),
//! `empty_cache`, snapshots in PyTorch's format, an offline viewer, and an out-of-memory path
//! that frees cache and retries before it fails. The engine ([`alloc`]) asks the device for
//! segments through [`device::DeviceMemory`]; an integration (a CubeCL runtime, a storage hook,
//! a CUDA or wgpu driver) implements that trait and calls [`alloc::CachingAllocator::malloc`]
//! and [`alloc::CachingAllocator::free`] with the stream each block is used on.
//!
//! On the simulated device ([`device::sim::SimDevice`]) it runs anywhere, which is how its
//! rules are tested. PyTorch's layout, step by step:
//!
//! ```
//! use caching_alloc_engine::alloc::{AllocatorConfig, CachingAllocator, PoolKind};
//! use caching_alloc_engine::device::{DeviceStream, sim::SimDevice};
//!
//! // PyTorch's rules exactly (our defaults differ; see `AllocatorConfig`).
//! let config = AllocatorConfig::parse("segment_sizing:pytorch,pool_borrowing:false")?;
//! let alloc = CachingAllocator::new(SimDevice::new(8 << 30), config)?;
//! let stream = DeviceStream::default();
//!
//! // 1000 B rounds up to 1024 B: a small-pool block of a new 2 MiB segment.
//! let small = alloc.malloc(1000, stream)?;
//! assert_eq!(small.size(), 1024);
//! // A 3 MiB request is under 10 MiB: a 20 MiB large-pool segment, split after the block.
//! let mid = alloc.malloc(3 << 20, stream)?;
//! let stats = alloc.stats();
//! assert_eq!(stats.memory_allocated(), 1024 + (3 << 20));
//! assert_eq!(stats.memory_reserved(), (2 << 20) + (20 << 20));
//! assert_eq!(stats.segment.pool(PoolKind::Large).current, 1);
//! assert_eq!(stats.inactive_split.pool(PoolKind::Large).current, 1); // the 17 MiB remainder
//!
//! // Freed blocks stay cached: a second 3 MiB request reuses the first one's block.
//! let address = mid.address();
//! alloc.free(mid)?;
//! let again = alloc.malloc(3 << 20, stream)?;
//! assert_eq!(again.address(), address);
//! assert_eq!(alloc.stats().num_device_alloc, 2);
//!
//! // empty_cache returns every segment without a live block.
//! alloc.free(again)?;
//! alloc.empty_cache()?;
//! assert_eq!(alloc.stats().memory_reserved(), 2 << 20); // `small` still lives
//! alloc.free(small)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Memory used on streams the engine does not own
//!
//! An integration whose streams belong to someone else (a CubeCL storage hook, a framework's
//! own CUDA streams) names each stream by a number of its choosing ([`device::DeviceStream`]):
//! a stream exists for the engine from its first `malloc`, and a block is cached for the
//! stream it was freed on. [`registry`] keeps one engine per device for the process, so a user
//! reads statistics, snapshots and `empty_cache` from it whatever integration made the memory.
//!
//! # Layers
//!
//! - [`alloc`]: the engine (pools, best fit, split, coalesce, statistics, snapshots, traces);
//! - [`device`]: the raw-memory trait, a simulated device and a metering wrapper;
//! - [`registry`]: one engine per device, process-wide.
#![warn(unnameable_types)]
#![warn(missing_docs)]

pub mod alloc;
pub mod device;
pub mod registry;
