//! Private pools on a Burn device (PyTorch's `torch.cuda.MemPool` and
//! `torch.cuda.use_mem_pool`).
//!
//! [`MemPool::new`] makes a pool in the device's allocator; [`use_mem_pool`] returns a guard
//! under which the calling thread's new tensors on that device take their memory from the pool
//! (other threads' and other devices' tensors do not). The guard drains the thread's fusion
//! queue of the device and waits for the device's server when it starts and when it ends, so
//! that what was queued before it is allocated outside and what was queued inside is allocated
//! inside. Guards nest; the
//! innermost one of a device wins.
//!
//! A tensor made inside keeps its pool's memory wherever it is used later; when it is dropped
//! its block goes back to the pool's cache, which only the pool's requests reuse (and, with
//! [`MemPoolOptions::use_on_oom`], other requests before an out-of-memory). Dropping the
//! [`MemPool`] releases the pool: its cached segments go back to the device, each other one
//! when its last tensor is dropped.
//!
//! CubeCL 0.10's layer above the allocator keeps a dropped tensor's slice for the next tensor
//! of exactly its size until the stream's next reclaim walk. Requests inside a pool never take
//! a slice from there (each walks first); a request outside that CubeCL hands a pool's slice
//! gives it back, walks and asks the engine (`StreamMemory`), so pools stay apart both ways.

use std::sync::Arc;

use super::device::{CachingDevice, handed_back, opened};
use crate::alloc::{
    AllocError, CachingAllocator, MemPoolId, MemPoolOptions, MemPoolStats, Snapshot,
};
use crate::runtime::pool_route::PoolRoute;

/// A private pool of one device's allocator (PyTorch's `torch.cuda.MemPool`). Dropping it
/// releases the pool (PyTorch's `releasePool`).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{CachingDevice, MemPool, use_mem_pool};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// let pool = MemPool::new(&device, Default::default())?;
/// {
///     let _inside = use_mem_pool(&pool);
///     // ... this thread's new tensors on `device` take the pool's memory ...
/// }
/// println!("{:?} on {:?}: {:?}", pool.id(), pool.device(), pool.memory_stats());
/// let snapshot = pool.snapshot(); // the pool's segments only
/// let returned = pool.empty_cache()?; // bytes of free segments given back
/// drop(pool); // released: the rest goes back with its last tensor
/// # Ok(())
/// # }
/// ```
pub struct MemPool<Dev: CachingDevice> {
    device: Dev,
    id: MemPoolId,
    options: MemPoolOptions,
    allocator: Arc<CachingAllocator<Dev::Memory>>,
}

impl<Dev: CachingDevice> std::fmt::Debug for MemPool<Dev> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPool")
            .field("device", &self.device)
            .field("id", &self.id)
            .field("options", &self.options)
            .finish()
    }
}

impl<Dev: CachingDevice> MemPool<Dev> {
    /// A new pool on `device` (opened if it was not) with `options`.
    ///
    /// # Errors
    ///
    /// [`AllocError::Poisoned`] after a panic inside the device's allocator.
    pub fn new(device: &Dev, options: MemPoolOptions) -> Result<Self, AllocError> {
        let allocator = opened(device).allocator;
        let id = allocator.create_pool(options)?;
        Ok(Self {
            device: device.clone(),
            id,
            options,
            allocator,
        })
    }

    /// The pool's id (PyTorch's `MemPool.id` is `(0, id.get())`).
    pub fn id(&self) -> MemPoolId {
        self.id
    }

    /// The options the pool was made with.
    pub fn options(&self) -> MemPoolOptions {
        self.options
    }

    /// The device the pool is on.
    pub fn device(&self) -> &Dev {
        &self.device
    }

    /// What the pool holds now, after CubeCL's free slices went back to the allocator (a walk
    /// of every stream: unlike `backend::memory_stats`, this reading may change where later
    /// requests go): its segments, reserved and allocated bytes, free blocks.
    pub fn memory_stats(&self) -> MemPoolStats {
        handed_back(&self.device);
        self.allocator
            .pool_stats(self.id)
            .expect("a MemPool's pool is live until the MemPool is dropped")
    }

    /// The pool's segments and blocks only (PyTorch's `MemPool.snapshot`), after CubeCL's free
    /// slices went back to the allocator (as for [`MemPool::memory_stats`]); statistics,
    /// configuration and history are the device's.
    pub fn snapshot(&self) -> Snapshot {
        handed_back(&self.device);
        self.allocator
            .pool_snapshot(self.id)
            .expect("a MemPool's pool is live until the MemPool is dropped")
    }

    /// Returns the pool's cached segments with no live tensor to the device, while the pool
    /// lives (PyTorch returns a private pool's segments only once the pool is released); the
    /// bytes returned. `backend::empty_cache` leaves pools alone.
    ///
    /// # Errors
    ///
    /// A device error returning a segment.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        handed_back(&self.device);
        self.allocator.pool_empty_cache(self.id)
    }
}

impl<Dev: CachingDevice> Drop for MemPool<Dev> {
    fn drop(&mut self) {
        // After everything this thread queued (which may still route here) has run.
        opened(&self.device);
        if let Err(err) = self.allocator.release_pool(self.id) {
            log::warn!("caching allocator: releasing {}: {err}", self.id);
        }
    }
}

/// While alive, the calling thread's new tensors on the pool's device take their memory from
/// the pool (PyTorch's `torch.cuda.use_mem_pool`). Not `Send`: it routes its own thread's
/// CubeCL stream.
#[must_use = "the pool is used only while the guard lives"]
pub struct MemPoolGuard<'a, Dev: CachingDevice> {
    pool: &'a MemPool<Dev>,
    route: Option<PoolRoute>,
}

/// Routes the calling thread's new tensors on `pool`'s device to `pool` while the returned
/// guard lives; see [`MemPool`]. What the thread queued in the fusion queue before is run
/// first (allocated outside); what it queues inside is run when the guard ends (inside).
///
/// ```no_run
/// # use burn_caching_alloc::backend::{CachingDevice, MemPool, use_mem_pool};
/// # fn example<D: CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
/// let pool = MemPool::new(&device, Default::default())?;
/// let guard = use_mem_pool(&pool);
/// assert_eq!(guard.pool().id(), pool.id());
/// // ... tensors made here live in `pool` ...
/// drop(guard);
/// # Ok(())
/// # }
/// ```
pub fn use_mem_pool<Dev: CachingDevice>(pool: &MemPool<Dev>) -> MemPoolGuard<'_, Dev> {
    // Everything queued before has reserved its memory before the route exists: the policy
    // hands the server a pool only for what it applied under the route, and the server pairs
    // those in order (`caller_stack`).
    opened(&pool.device);
    let route = PoolRoute::enter(pool.allocator.allocator_id(), pool.id);
    MemPoolGuard {
        pool,
        route: Some(route),
    }
}

impl<Dev: CachingDevice> MemPoolGuard<'_, Dev> {
    /// The pool this guard routes to.
    pub fn pool(&self) -> &MemPool<Dev> {
        self.pool
    }
}

impl<Dev: CachingDevice> Drop for MemPoolGuard<'_, Dev> {
    fn drop(&mut self) {
        // Everything queued inside has reserved its memory (in the pool) before the route goes.
        opened(&self.pool.device);
        self.route.take();
    }
}
