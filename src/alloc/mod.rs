//! The caching allocator engine: pools, best fit, splitting, coalescing, statistics,
//! snapshots and traces. Pure Rust: it knows devices only through [`DeviceMemory`].
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
