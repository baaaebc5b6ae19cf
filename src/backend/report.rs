//! "Leak or cache?" for a Burn device in one call: [`memory_report`].
//!
//! ```no_run
//! # use burn_caching_alloc::backend::{self, CachingDevice};
//! # fn example<D: CachingDevice>(device: D) {
//! let before = backend::memory_point(&device);
//! // ... an epoch ...
//! let report = backend::memory_report(&device, Some(&before));
//! println!("{report}"); // LEAK? / CACHE / OVERSIZED / STEADY, with the numbers behind it
//! # }
//! ```
//!
//! The analysis is the engine's ([`MemoryReport`]); this side supplies what only the device
//! knows: the bytes of live tensors ([`memory_allocated`](super::CachingMemoryStats::memory_allocated)) and what is free
//! in CubeCL's slices ([`cached_in_cubecl`](super::CachingMemoryStats::cached_in_cubecl)). The engine counts CubeCL's
//! free slices as allocated blocks, so blocks listed as held since the first point may include
//! slices CubeCL keeps for reuse (their total is the report's "free in CubeCL's slices");
//! while history is recorded, CubeCL hands every freed slice back at the next reservation and
//! the held blocks are exactly the live tensors.

use super::CachingDevice;
use super::device::settled;
use crate::alloc::{MemoryPoint, MemoryReport};

/// One reading of `device`'s memory, to compare with a later one in [`memory_report`].
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let before = backend::memory_point(&device);
/// // ... some steps ...
/// println!("{}", backend::memory_report(&device, Some(&before)));
/// # }
/// ```
///
/// One reading: the snapshot (segments and statistics taken under one lock of the engine) and
/// CubeCL's layer come from one look at CubeCL's free slices, read as cache and left where they
/// are, so the numbers belong together and the reading changes nothing.
pub fn memory_point<Dev: CachingDevice>(device: &Dev) -> MemoryPoint {
    let settled = settled(device);
    let snapshot = settled.entry.allocator.snapshot_with(&settled.cached);
    let allocated = snapshot.stats.memory_allocated();
    MemoryPoint::with_layer_above(snapshot, allocated, settled.cubecl.cached_bytes())
}

/// What `device`'s memory is doing: since `before` when given (live tensors growing:
/// something holds them; reserved growing with live tensors flat: the cache), and now (what
/// each layer has free, how fragmented, what `empty_cache` would give back, and the requests
/// whose segment is much larger than they asked, with the rules that made it). Its `Display`
/// is the text a user reads.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let now = backend::memory_report(&device, None); // one point: the cache and oversized requests
/// println!("{now}");
/// # }
/// ```
pub fn memory_report<Dev: CachingDevice>(
    device: &Dev,
    before: Option<&MemoryPoint>,
) -> MemoryReport {
    let now = memory_point(device);
    match before {
        Some(before) => MemoryReport::between(before, &now),
        None => MemoryReport::at(&now),
    }
}
