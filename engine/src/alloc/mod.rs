//! The caching allocator engine: pools, best fit, splitting, coalescing, statistics,
//! snapshots and traces. Pure Rust: it knows devices only through [`DeviceMemory`].
//!
//! ```
//! use caching_alloc_engine::alloc::{AllocatorConfig, CachingAllocator};
//! use caching_alloc_engine::device::{DeviceStream, sim::SimDevice};
//!
//! let config = AllocatorConfig::parse("max_split_size_mb:128,garbage_collection_threshold:0.8")?;
//! let alloc = CachingAllocator::new(SimDevice::new(16 << 30), config)?;
//! let stream = DeviceStream::default();
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
//! No unsafe code but the engine's four calls into raw device memory (a segment freed, a range
//! mapped, unmapped, released: [`DeviceMemory`]'s `unsafe fn`s), each allowed where it is made
//! with the reason it holds.
//!
//! [`DeviceMemory`]: crate::device::DeviceMemory
#![deny(unsafe_code)]

mod allocator;
mod block;
mod config;
mod engine;
mod error;
mod free_list;
mod history;
mod mem_pool;
mod observers;
mod report;
mod scope;
mod size;
mod stack;
mod stats;
mod summary;
pub mod units;

pub use allocator::{Allocation, CachingAllocator};
pub use block::BlockState;
pub use config::{
    AllocatorConfig, CONFIG_ENV, ConfigError, MAX_HISTORY_CAPACITY, PYTORCH_CONFIG,
    PinnedHostConfig, RoundupDivisions,
};
pub use engine::{CachedAbove, MissPath};
pub use error::{AllocError, InvariantViolation, OomAdvice, OomDiagnosis};
pub use history::inspect;
pub use history::{
    BlockSnapshot, HistoryEntry, HistoryOptions, MAX_GZIP_RATIO, MAX_TRACE_BYTES, MAX_TRACE_EVENTS,
    PhaseMark, PhaseStage, RecordMode, SegmentSnapshot, Snapshot, StackContext, Trace, TraceAction,
    TraceEvent, TraceFileError,
};
pub use mem_pool::{MemPoolId, MemPoolOptions, MemPoolStats};
pub use observers::{ObserverReport, ObserverThread, OomObserver};
pub use report::{
    CacheState, HeldGroup, MemoryPoint, MemoryReport, OversizedRequest, ScopeChange, Verdict,
    segment_rules,
};
pub use scope::{ActiveCount, count_active};
pub use scope::{ScopeGuard, Tag};
pub use size::{PoolKind, SegmentSizing, round_size, segment_size};
pub use stack::{Frame, Stack, StackResolver};
pub use stats::signed;
pub use stats::{FreeSpace, MemoryStats, PoolFree, Stat, StatArray};
pub use summary::Summary;
pub use units::format_bytes;
