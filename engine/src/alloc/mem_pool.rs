//! Private memory pools: what a caller names a pool by, the options it is made with, and the
//! numbers it reports (PyTorch's `torch.cuda.MemPool`).
//!
//! A private pool holds segments of its own: a request routed to it takes only its cached
//! blocks, and new memory it needs becomes a segment of the pool; no other request takes its
//! blocks (except, with [`MemPoolOptions::use_on_oom`], as a last resort before an
//! out-of-memory). The device-wide statistics count its memory too. How a request is routed to
//! a pool is the caller's: [`CachingAllocator::malloc_in`](crate::alloc::CachingAllocator::malloc_in).

use serde::{Deserialize, Serialize};

/// A private pool of one allocator. PyTorch names a user-created pool `(0, id)`; this is the
/// `id`, from 1 (0 is no pool: the allocator's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct MemPoolId(pub(crate) u64);

impl MemPoolId {
    /// The pool's number, as in PyTorch's id `(0, number)`.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The id of pool `number` (as [`get`](Self::get) gives it), for a layer that keeps pool
    /// ids as numbers. An id no pool of the allocator has is refused by every call that takes
    /// one (`AllocError::UnknownPool`).
    pub const fn from_number(number: u64) -> Self {
        Self(number)
    }
}

impl std::fmt::Display for MemPoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pool {}", self.0)
    }
}

/// How a private pool serves its requests (PyTorch's `MemPool(use_on_oom=, no_split=)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemPoolOptions {
    /// A block of the pool is never split: every request takes a whole cached block, or a new
    /// segment sized by the usual rules, all of it its own (two 4000 B requests hold two 2 MiB
    /// small segments), as PyTorch's `setNoSplit` makes `should_split` answer no.
    pub no_split: bool,
    /// A request outside every private pool that would fail with an out-of-memory takes a
    /// cached free block of this pool first (PyTorch's `use_on_oom_pools`, tried at the end
    /// of `malloc`); the block then belongs to this pool.
    pub use_on_oom: bool,
}

/// What a private pool holds now, recounted from its segments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemPoolStats {
    /// Device segments of the pool.
    pub segments: u64,
    /// Bytes of those segments.
    pub reserved_bytes: u64,
    /// Allocated blocks.
    pub allocations: u64,
    /// Bytes of allocated blocks.
    pub allocated_bytes: u64,
    /// Bytes of allocated blocks and of freed blocks still waiting on other streams.
    pub active_bytes: u64,
    /// Bytes the owners of the active blocks asked for (before rounding).
    pub requested_bytes: u64,
    /// Free cached blocks (reusable by the pool's requests only).
    pub free_blocks: u64,
    /// The largest free cached block, in bytes.
    pub largest_free_block: u64,
}
