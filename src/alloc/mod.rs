//! The caching allocator engine: pools, best fit, splitting, coalescing, statistics,
//! snapshots and traces. Pure Rust: it knows devices only through [`DeviceMemory`].
//!
//! ```
//! use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator};
//! use burn_caching_alloc::device::{StreamId, sim::SimDevice};
//!
//! let config = AllocatorConfig::parse("max_split_size_mb:128,garbage_collection_threshold:0.8")?;
//! let alloc = CachingAllocator::new(SimDevice::new(16 << 30), config);
//! let stream = StreamId::default();
//!
//! let a = alloc.malloc(1000, stream)?; // small pool: 1024 bytes of a 2 MiB segment
//! let b = alloc.malloc(300 << 20, stream)?; // large pool: a 300 MiB segment of its own
//! alloc.free(a)?; // merges back into the cached 2 MiB segment
//! let stats = alloc.stats();
//! assert_eq!(stats.memory_allocated(), 300 << 20);
//! assert_eq!(stats.memory_reserved(), (300 << 20) + (2 << 20));
//! alloc.free(b)?;
//! alloc.empty_cache()?; // every cached segment goes back to the device
//! assert_eq!(alloc.stats().memory_reserved(), 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`DeviceMemory`]: crate::device::DeviceMemory

mod allocator;
mod block;
mod config;
mod engine;
mod error;
mod events;
mod free_list;
mod placement;
mod reclaim;
mod size;
mod snapshot;
mod stats;
mod summary;
mod trace;
mod trace_file;

pub use allocator::{Allocation, CachingAllocator};
pub use block::BlockState;
pub use config::{AllocatorConfig, CONFIG_ENV, ConfigError, KNOWN_KEYS, RoundupDivisions};
pub use error::AllocError;
pub use size::{
    KIB, LARGE_BUFFER, MIB, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, PoolKind, ROUND_LARGE, SMALL_BUFFER,
    SMALL_SIZE, format_bytes, round_size, segment_size,
};
pub use snapshot::{BlockSnapshot, SegmentSnapshot, Snapshot};
pub use stats::{MemoryStats, Stat, StatArray};
pub use summary::summary;
pub use trace::{ReplayStats, Trace, TraceEvent};
pub use trace_file::TraceFileError;
