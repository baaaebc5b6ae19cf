//! When freed CubeCL slices go back to the engine.
//!
//! CubeCL's persistent pool keeps a freed slice for the next tensor of exactly the same size,
//! and hands it to the engine only when `cleanup(true)` walks every slice of the stream (live
//! or free; CubeCL gives no other way to learn that a handle was dropped). Memory held in free
//! slices is invisible to the engine: it can neither reuse it for other sizes nor coalesce it,
//! so a stack that walks too rarely reserves more than the engine alone, and one that walks at
//! every reservation pays O(slices) per tensor.
//!
//! A reservation therefore goes, in order:
//!
//! 1. for a *large* request (over the engine's 1 MiB small-pool limit), when tensors are
//!    being dropped (the last walk released a slice, or CubeCL reused one since), and CubeCL's
//!    pool cannot serve it (a size this stream has never reserved, whose padded size cannot
//!    be a key of CubeCL's pool; or a seen size for which a pool-only attempt,
//!    [`Growth::PoolOnly`], finds no free slice): a **placement reclaim**. The walk hands
//!    the free slices back before the engine chooses where the request goes, so best fit and
//!    coalescing see what the engine alone would see. A seen size that CubeCL's pool holds
//!    (the steady state of a fixed-shape loop) is served from it with no walk. Seen sizes
//!    the pool misses need the walk too: on variable shapes (lengths from a fixed set, so
//!    after a few steps every size is a seen one) the engine would otherwise place most large
//!    tensors while CubeCL still holds the slices of the previous step's lengths. What a
//!    seen-size miss adds is one pool-only attempt; the walks are paid from the budget below.
//!    No placement walk runs when the engine caches a free block of exactly the request's
//!    rounded size: best fit takes such a block whatever a walk hands back, and the walk
//!    would only take from CubeCL's pool the free slices the rest of the step is about to
//!    reuse, which makes the misses that pay for the next walk (a cycle of walks). Small
//!    requests live in 2 MiB segments, where a late placement costs little;
//! 2. to CubeCL's exact-size reuse, else the engine's cache only ([`Growth::CacheOnly`]);
//! 3. when the engine would grow, to a **growth reclaim**, then to the engine with growth
//!    allowed short of flushing its cache ([`Growth::BeforeFlush`]: new device memory, the
//!    release of oversize blocks);
//! 4. only when nothing but the engine's cache flush could help: an unconditional reclaim
//!    (the server reclaims every stream here) and one last reservation through the engine's
//!    full path, whose flush and retry come after every layer above gave back its cache, and
//!    whose failure is the one out-of-memory the user sees (`num_ooms` once, observers once),
//!    as PyTorch counts one per failed request.
//!
//! Walks are paid from a budget of slice-visits: every reservation earns
//! [`CREDIT_PER_RESERVE`], every large request of a new size [`NEW_SIZE_CREDIT`] more, and a walk
//! runs when the budget covers the stream's slice count (placement reclaims only then; growth
//! reclaims also on the two signs below). Loading a model of n parameters, where nothing is
//! dropped, earns no placement credit and walks only when the budget covers a would-grow
//! miss, at geometrically spaced points: O(1) amortised work per parameter (`benches/model_load`).
//!
//! A would-grow miss the budget cannot pay for still walks when
//!
//! - the stream's last walk was **productive**: it released at least 1/[`PRODUCTIVE_SHARE`]
//!   of the slices it visited. Its cost was then at most `PRODUCTIVE_SHARE` visits per
//!   released slice, each released slice was one earlier reservation, so these walks too stay
//!   O(1) amortised; and a model load, whose walks release nothing, never takes this path;
//! - or CubeCL has reused a freed slice since the stream's last walk (tensors are being
//!   dropped) and the engine's reserved memory has grown by 1/[`GROWTH_STEP`] since then: at
//!   most about `GROWTH_STEP` x ln(growth factor) such walks while memory only grows, each in
//!   front of a device allocation anyway.
//!
//! The credit per reservation is the trade between reserved memory and CPU: a walk visits
//! every slice of the stream, so the walks cost about `CREDIT_PER_RESERVE` slice-visits per
//! reservation. A larger credit walks more often than the traces need (the walks dominate the
//! stack's time on traces of many new sizes); a smaller one lets the free slices of varying
//! shapes pile up in CubeCL's pool. The measurements behind 2 (and the new-size credit of 32)
//! are in the guide's benchmarks chapter (`docs/src/benchmarks.md`, "The stack against
//! CubeCL's pool").
//!
//! While `BURN_CACHING_ALLOC_TRACE` records a trace ([`ReclaimPolicy::EveryReserve`]; recording
//! through `record_memory_history` changes no policy), the stream reclaims
//! before every reservation instead: CubeCL's exact-size reuse is bypassed, so every tensor's
//! reservation is an engine `malloc` and its release an engine `free` (seen at the next
//! reservation, which is the first moment an allocator could reuse it). The recorded trace is
//! then the workload itself, a fair input for any allocator, and not just what missed CubeCL's
//! pool. This costs one walk of the stream's slices per reservation: a diagnostic mode.
//!
//! **Readings.** A reading of the numbers (`memory_stats`, a snapshot, `memory_point`, ...)
//! must not change what happens next, so it does not walk: a walk would hand the free slices
//! to the engine, which would then place later requests in them where a run that never read
//! would have had CubeCL reuse them. [`StreamMemory::free_slices`] finds the free slices
//! instead with CubeCL's own exact-size lookup: for each size the stream's blocks were made
//! for, it reserves from the pool alone ([`Growth::PoolOnly`]) until the pool has no free slice
//! of it, holding what it got, then lets all of it go. The slices are as free as before, in
//! the same order, and no counter, mark or budget of the policy moves; the reading counts
//! their blocks as cache ([`CachedAbove`]). CubeCL writes the looked-up size into each free
//! slice it hands the lookup, the size the slice already records (the streams reserve padded
//! sizes, below), so not even that changes.
//! Every free slice is found this way because every slice stays under the key it was made
//! with (see "Padded sizes").
//!
//! **Padded sizes.** CubeCL files a slice under its size plus the padding of the first tensor
//! it held, and records each later tensor's own size in it; a walk that finds it live files it
//! again under that size plus the first padding. When the two tensors' sizes differ (both
//! under the same padded size) that sum is no padded size: no request computes it, so the free
//! slice can be neither reused nor found until a walk releases it. The stream therefore asks
//! CubeCL for sizes already padded to its alignment: no slice has padding, every slice keeps
//! its key, and the server resolves a binding to the bytes its handle asked for (the
//! binding's own size), not to the padded slice.
//!
//! **Handles that were never bound.** A handle whose reservation failed is left unbound by
//! CubeCL's memory management, with the location every new handle starts at: the first slice
//! of the stream (`MemoryLocation::uninit()`, pool 0, page 0, slice 0; with no dynamic pools
//! pool 0 is the persistent one), which CubeCL resolves without a check. Left there, a launch or
//! a write of the failed tensor would land in whatever tensor holds that slice. Every stream's
//! first slice is therefore its **guard**: a slice of no bytes and no engine block
//! ([`EngineStorage::is_unbacked`](super::EngineStorage::is_unbacked)), reserved when the
//! stream is created and held by it for its lifetime, so never free, never reused, never handed
//! back (CubeCL's walks keep the order of the slices they keep, so it stays first). Every
//! unbound handle, and only an unbound one, resolves to it: [`StreamMemory::bound_slice`] says
//! so (`None`), and the server refuses the handle. The guard is no tensor's:
//! [`StreamMemory::usage`] leaves it out.

use std::collections::HashSet;
use std::sync::Arc;

use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::memory_management::{ManagedMemoryBinding, ManagedMemoryHandle, MemoryUsage};
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::{StorageHandle, StorageId};

use super::storage::{Growth, PersistentManager, persistent_manager};
use crate::alloc::{AllocError, CachedAbove, CachingAllocator, PoolKind};
use crate::device::{DeviceMemory, DeviceStream};

/// Slice-visits of reclaim work each reservation pays for (see the module documentation
/// for why 2).
pub(crate) const CREDIT_PER_RESERVE: u64 = 2;

/// Slice-visits a pool miss of a large request of a new size adds to the budget.
pub(crate) const NEW_SIZE_CREDIT: u64 = 32;

/// A would-grow miss of a stream that is dropping tensors reclaims even when the budget is
/// short once the engine's reserved memory has grown by 1/`GROWTH_STEP` since the stream's
/// last reclaim.
pub(crate) const GROWTH_STEP: u64 = 32;

/// A walk that released at least 1/`PRODUCTIVE_SHARE` of the slices it visited lets the
/// stream's next would-grow miss walk even when the budget is short.
pub(crate) const PRODUCTIVE_SHARE: usize = 256;

/// The distinct large sizes a stream remembers; past this many the memory starts over
/// (a workload with that many distinct large sizes has no steady state to protect).
const MAX_SEEN_SIZES: usize = 1 << 16;

/// The amortisation budget of one stream's reclaims.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReclaimBudget {
    credits: u64,
}

impl ReclaimBudget {
    /// Earns `credit` slice-visits.
    pub(crate) fn earn(&mut self, credit: u64) {
        self.credits = self.credits.saturating_add(credit);
    }

    /// Whether the budget covers `cost` slice-visits.
    pub(crate) fn covers(&self, cost: u64) -> bool {
        self.credits >= cost
    }

    /// Spends `cost` slice-visits if the budget covers them.
    pub(crate) fn try_spend(&mut self, cost: u64) -> bool {
        if self.covers(cost) {
            self.credits -= cost;
            true
        } else {
            false
        }
    }
}

/// When a stream hands CubeCL's free slices back to the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReclaimPolicy {
    /// Before the engine places a new large size, and before it would grow, paid from an
    /// amortisation budget (see the module documentation).
    #[default]
    Amortised,
    /// Before every reservation, so the engine sees every tensor (for recording traces).
    EveryReserve,
}

/// What a stream's reservations did, as a user reads it (`memory_stats`' `cubecl.*` keys and the
/// summary): how many CubeCL's exact-size reuse served, and how often and at what cost the
/// stream handed CubeCL's free slices back to the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReclaimCounters {
    /// Reservations asked of this stream.
    pub reserves: u64,
    /// Reservations CubeCL's pool served from a free slice of exactly the size.
    pub pool_hits: u64,
    /// Walks that handed CubeCL's free slices back to the engine, whatever the reason.
    pub reclaims: u64,
    /// Slice-visits spent by those walks (the work the budget bounds).
    pub reclaim_work: u64,
}

/// The policy's own numbers: [`ReclaimCounters`] and, for each walk, the rule that ran it.
/// For the crate's tests of the rules; a user reads [`ReclaimCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PolicyCounters {
    /// What a user reads.
    pub(crate) totals: ReclaimCounters,
    /// Walks run before the engine placed a large request CubeCL's pool could not serve.
    pub(crate) placement_reclaims: u64,
    /// Reservations that neither CubeCL's pool nor the engine's cache could serve.
    pub(crate) would_grow: u64,
    /// Walks before a would-grow reservation paid by the budget (or before every reservation
    /// under [`ReclaimPolicy::EveryReserve`], or routed to a private pool).
    pub(crate) budget_reclaims: u64,
    /// Would-grow misses the budget could not pay for, walked anyway because the stream's
    /// last walk released at least 1/[`PRODUCTIVE_SHARE`] of the slices it visited.
    pub(crate) productive_reclaims: u64,
    /// Would-grow misses the budget could not pay for, walked anyway because CubeCL had
    /// reused a freed slice and the engine's reserved memory had grown by 1/[`GROWTH_STEP`]
    /// since the stream's last walk.
    pub(crate) growth_reclaims: u64,
    /// Would-grow misses that grew without a walk.
    pub(crate) skipped_reclaims: u64,
    /// Unconditional walks because a reservation (of this stream or another) found nothing
    /// short of the engine's cache flush.
    pub(crate) oom_reclaims: u64,
    /// Walks because the stream's slot was idle (its thread gone, or no operation for a
    /// while), so that the engine shares its free slices with other streams.
    pub(crate) idle_reclaims: u64,
}

/// What [`StreamMemory::free_slices`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeSlices {
    /// Free slices named as cached.
    pub listed: u64,
    /// Their engine blocks' bytes.
    pub bytes: u64,
    /// Free slices the lookup did not reach (CubeCL's count of its free slices less those
    /// named): 0, since every slice stays under its key (see "Padded sizes" in the module
    /// documentation). Their blocks would read as allocated.
    pub unlisted: u64,
}

/// A reservation that failed even after reclaiming.
#[derive(Debug)]
pub struct ReserveError {
    /// What CubeCL's memory manager reported.
    pub io: IoError,
    /// The engine's error, with its numbers, when the engine was the one that failed.
    pub engine: Option<AllocError>,
}

impl core::fmt::Display for ReserveError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match &self.engine {
            Some(engine) => write!(f, "{engine}"),
            None => write!(f, "{}", self.io),
        }
    }
}

impl std::error::Error for ReserveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.engine {
            Some(engine) => Some(engine),
            None => Some(&self.io),
        }
    }
}

/// One stream's memory: its persistent CubeCL manager over the engine, and its reclaim budget.
pub struct StreamMemory<D: DeviceMemory> {
    manager: PersistentManager<D>,
    policy: ReclaimPolicy,
    budget: ReclaimBudget,
    /// The engine's reserved bytes after this stream's last reclaim.
    reserved_mark: u64,
    /// Whether CubeCL reused a freed slice since the last reclaim (so tensors are being
    /// dropped, and free slices of other sizes may be waiting).
    reuse_seen: bool,
    /// Whether the last reclaim released at least 1/[`PRODUCTIVE_SHARE`] of the slices.
    last_productive: bool,
    /// Slices the last reclaim released (0 before the first one: a new stream has dropped
    /// nothing).
    last_released: usize,
    /// The large sizes (padded) this stream reserved.
    seen_sizes: HashSet<u64>,
    /// CubeCL's slice alignment (sizes are padded to it).
    alignment: u64,
    counters: PolicyCounters,
    /// The stream's first slice, where every unbound handle resolves (see the module
    /// documentation): held here, so never free.
    _guard: ManagedMemoryHandle,
    /// The guard's storage id.
    guard_id: StorageId,
}

impl<D: DeviceMemory> core::fmt::Debug for StreamMemory<D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StreamMemory")
            .field("policy", &self.policy)
            .field("budget", &self.budget)
            .field("counters", &self.counters)
            .finish()
    }
}

/// Reserves a new stream's guard: its first slice, of no bytes and with no engine block (see
/// the module documentation). Every handle CubeCL's memory management has not bound resolves
/// to it from now on (or fails to resolve); checked here once per stream, so that a CubeCL
/// that resolved unbound handles to another slice fails loudly instead of letting them through.
fn reserve_guard<D: DeviceMemory>(
    manager: &mut PersistentManager<D>,
) -> (ManagedMemoryHandle, StorageId) {
    manager.storage().unbacked_next();
    let guard = manager
        .reserve(0)
        .expect("an unbacked slice allocates nothing");
    let id = manager
        .get_storage(guard.clone().binding())
        .expect("the slice just reserved")
        .id;
    assert!(
        manager.storage().is_unbacked(id),
        "the stream's first reservation is its guard slice"
    );
    if let Ok(unbound) = manager.get_storage(ManagedMemoryHandle::new().binding()) {
        assert_eq!(
            unbound.id, id,
            "CubeCL resolves an unbound handle to the stream's first slice"
        );
    }
    (guard, id)
}

impl<D: DeviceMemory> StreamMemory<D> {
    /// The memory of engine stream `stream`, with the [`ReclaimPolicy::Amortised`] policy.
    pub fn new(
        allocator: Arc<CachingAllocator<D>>,
        stream: DeviceStream,
        properties: &MemoryDeviceProperties,
    ) -> Self {
        let mut manager = persistent_manager(allocator, stream, properties);
        let (guard, guard_id) = reserve_guard(&mut manager);
        Self {
            manager,
            _guard: guard,
            guard_id,
            policy: ReclaimPolicy::Amortised,
            budget: ReclaimBudget::default(),
            reserved_mark: 0,
            reuse_seen: false,
            last_productive: false,
            last_released: 0,
            seen_sizes: HashSet::new(),
            alignment: properties.alignment.max(1),
            counters: PolicyCounters::default(),
        }
    }

    /// The same memory with reclaim policy `policy`.
    pub fn with_policy(mut self, policy: ReclaimPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Changes when this stream hands free slices back to the engine (for a stream slot handed
    /// to a new thread: as for a stream created then).
    pub fn set_policy(&mut self, policy: ReclaimPolicy) {
        self.policy = policy;
    }

    /// When this stream hands free slices back to the engine.
    pub fn policy(&self) -> ReclaimPolicy {
        self.policy
    }

    /// The CubeCL manager (to bind and resolve handles).
    pub fn manager(&mut self) -> &mut PersistentManager<D> {
        &mut self.manager
    }

    /// What this stream's reservations did so far.
    pub fn counters(&self) -> ReclaimCounters {
        self.counters.totals
    }

    /// The same, with the rule that ran each walk (for the tests of the rules).
    #[cfg(test)]
    pub(crate) fn policy_counters(&self) -> PolicyCounters {
        self.counters
    }

    /// CubeCL's view of this stream: live slices, their bytes, and all slices' bytes (the
    /// guard slice, no tensor's and of no bytes, left out).
    pub fn usage(&self) -> MemoryUsage {
        let mut usage = self.manager.memory_usage();
        usage.number_allocs = usage.number_allocs.saturating_sub(1);
        usage
    }

    /// The slice `binding` is bound to, or `None` when CubeCL's memory management never bound
    /// it (its reservation failed, see the module documentation): such a handle must not be
    /// resolved, it has no memory. An error when CubeCL finds no slice at all.
    pub fn bound_slice(
        &mut self,
        binding: &ManagedMemoryBinding,
    ) -> Result<Option<StorageHandle>, IoError> {
        let slice = self.manager.get_storage(binding.clone())?;
        Ok((slice.id != self.guard_id).then_some(slice))
    }

    /// Whether `handle` is bound to a slice of this stream (see [`StreamMemory::bound_slice`]).
    pub fn is_bound(&mut self, handle: &ManagedMemoryHandle) -> bool {
        matches!(self.bound_slice(&handle.clone().binding()), Ok(Some(_)))
    }

    /// Reserves `size` bytes, this stream alone: [`reserve_before_flush`](Self::reserve_before_flush),
    /// and when only the engine's cache flush could help, a reclaim and
    /// [`reserve_last_resort`](Self::reserve_last_resort). The server does the same across
    /// every stream.
    pub fn reserve(&mut self, size: u64) -> Result<ManagedMemoryHandle, ReserveError> {
        if let Some(handle) = self.reserve_before_flush(size)? {
            return Ok(handle);
        }
        self.reclaim_for_oom();
        self.reserve_last_resort(size)
    }

    /// Reserves `size` bytes by every means short of flushing the engine's cache: for a new
    /// large size, when the budget covers it, a placement reclaim first; then CubeCL's
    /// exact-size reuse, else a cached engine block, else a growth reclaim when the budget or
    /// the signs allow it and new device memory. `Ok(None)` when nothing but the flush could
    /// help: nothing was counted as an out-of-memory yet. Under [`ReclaimPolicy::EveryReserve`]:
    /// a reclaim, then the engine. A request that can never fit is an error here
    /// ([`AllocError::TooLarge`] in [`ReserveError::engine`]).
    pub fn reserve_before_flush(
        &mut self,
        size: u64,
    ) -> Result<Option<ManagedMemoryHandle>, ReserveError> {
        self.counters.totals.reserves += 1;
        self.refuse_unpaddable(size)?;
        // A reservation routed to a private pool walks first, so that CubeCL's exact-size reuse
        // has no free slice to hand it (any free slice may be another pool's block): it is an
        // engine `malloc` in the pool.
        if self.policy == ReclaimPolicy::EveryReserve || self.manager.storage().mem_pool().is_some()
        {
            self.counters.budget_reclaims += 1;
            self.reclaim();
            return self.reserve_up_to_flush(size);
        }
        self.budget.earn(CREDIT_PER_RESERVE);

        // A size this stream never reserved cannot be in CubeCL's pool (its key is the size
        // padded to the alignment): it will go to the engine, which should see the free
        // slices first.
        let large = PoolKind::for_size(size) == PoolKind::Large;
        let new_size = large && self.first_sight(size);
        if large && self.drops_possible() {
            if new_size {
                self.budget.earn(NEW_SIZE_CREDIT);
            } else {
                // A seen size: CubeCL's pool serves it when it holds a free slice of it (the
                // steady state of a fixed-shape loop, which must not walk). Only a miss goes
                // on to a placement walk.
                match self.reserve_limited(size, Growth::PoolOnly) {
                    Ok(handle) => {
                        self.counters.totals.pool_hits += 1;
                        self.reuse_seen = true;
                        return Ok(Some(handle));
                    }
                    Err(Some(err)) => return Err(err),
                    Err(None) => {}
                }
            }
            // The exact-fit question takes the engine's lock: asked only when the budget
            // could pay for the walk.
            let cost = self.walk_cost();
            if self.budget.covers(cost)
                && !self.exact_fit_cached(size)
                && self.budget.try_spend(cost)
            {
                self.counters.placement_reclaims += 1;
                self.reclaim();
            }
        }

        let blocks = self.manager.storage().blocks();
        match self.reserve_limited(size, Growth::CacheOnly) {
            Ok(handle) => {
                // No new engine block: CubeCL reused a slice a dropped tensor left free.
                if self.manager.storage().blocks() == blocks {
                    self.counters.totals.pool_hits += 1;
                    self.reuse_seen = true;
                }
                return Ok(Some(handle));
            }
            Err(Some(err)) => return Err(err),
            Err(None) => {}
        }

        self.counters.would_grow += 1;
        let cost = self.walk_cost();
        if self.budget.try_spend(cost) {
            self.counters.budget_reclaims += 1;
            self.reclaim();
        } else if self.last_productive {
            self.counters.productive_reclaims += 1;
            self.reclaim();
        } else if self.reuse_seen && self.grew_past_mark() {
            self.counters.growth_reclaims += 1;
            self.reclaim();
        } else {
            self.counters.skipped_reclaims += 1;
        }
        self.reserve_up_to_flush(size)
    }

    /// The engine with growth allowed short of its cache flush: `Ok(None)` when only the
    /// flush could help.
    fn reserve_up_to_flush(
        &mut self,
        size: u64,
    ) -> Result<Option<ManagedMemoryHandle>, ReserveError> {
        match self.reserve_limited(size, Growth::BeforeFlush) {
            Ok(handle) => Ok(Some(handle)),
            Err(None) => Ok(None),
            Err(Some(err)) => Err(err),
        }
    }

    /// Reserves with the storage limited to `growth`: `Err(None)` when the limit refused the
    /// request, `Err(Some(_))` on any other failure.
    fn reserve_limited(
        &mut self,
        size: u64,
        growth: Growth,
    ) -> Result<ManagedMemoryHandle, Option<ReserveError>> {
        self.manager.storage().set_growth(growth);
        let reserved = self.reserve_padded(size);
        let reserved = self.outside_other_pools(size, reserved);
        self.manager.storage().set_growth(Growth::Allowed);
        let refused = self.manager.storage().take_refused();
        match reserved {
            Ok(handle) => Ok(handle),
            Err(_) if refused => Err(None),
            Err(io) => {
                let engine = self.manager.storage().take_error();
                Err(Some(ReserveError { io, engine }))
            }
        }
    }

    /// A slice CubeCL's exact-size reuse handed out from a private pool other than the one the
    /// request is routed to (a pool tensor dropped since the last walk) is given back: a walk
    /// returns it (and every free slice) to the engine, and the request is reserved again,
    /// now from the engine. Only while this stream holds pool blocks (one check otherwise).
    fn outside_other_pools(
        &mut self,
        size: u64,
        reserved: Result<ManagedMemoryHandle, IoError>,
    ) -> Result<ManagedMemoryHandle, IoError> {
        let handle = reserved?;
        if !self.manager.storage().holds_pool_blocks() {
            return Ok(handle);
        }
        let Ok(slice) = self.manager.get_storage(handle.clone().binding()) else {
            return Ok(handle);
        };
        let storage = self.manager.storage();
        if storage.pool_of(slice.id) == storage.mem_pool() {
            return Ok(handle);
        }
        drop(handle);
        self.counters.budget_reclaims += 1;
        self.reclaim();
        self.reserve_padded(size)
    }

    /// Asks CubeCL's pool for `size` padded to its alignment, so that every slice carries no
    /// padding of its own and stays under its key for life (see "Padded sizes" in the module
    /// documentation); the server resolves each binding to the bytes its handle asked for.
    /// Sizes that cannot be padded were refused before.
    fn reserve_padded(&mut self, size: u64) -> Result<ManagedMemoryHandle, IoError> {
        let padded = self.padded(size).unwrap_or(size);
        self.manager.reserve(padded)
    }

    /// Whether this stream reserves `size` (padded to CubeCL's alignment, CubeCL's key) for
    /// the first time (and remembers it).
    fn first_sight(&mut self, size: u64) -> bool {
        if self.seen_sizes.len() >= MAX_SEEN_SIZES {
            self.seen_sizes.clear();
        }
        let padded = self.padded(size).unwrap_or(u64::MAX);
        self.seen_sizes.insert(padded)
    }

    /// `size` padded to CubeCL's alignment: what CubeCL asks the storage for, and its pool's
    /// key. Checked: a size near `u64::MAX` is refused later by the engine, never wrapped here.
    fn padded(&self, size: u64) -> Option<u64> {
        size.checked_next_multiple_of(self.alignment)
    }

    /// A size CubeCL cannot pad to its alignment (within one alignment of `u64::MAX`) would
    /// wrap inside CubeCL's pool (a tiny block in a release build, a panic in a debug one):
    /// the engine is asked for it instead, and refuses it as [`AllocError::TooLarge`] (counted
    /// as an out-of-memory, as any request that can never fit).
    fn refuse_unpaddable(&mut self, size: u64) -> Result<(), ReserveError> {
        if self.padded(size).is_some() {
            return Ok(());
        }
        let storage = self.manager.storage();
        let engine = match storage.allocator().malloc(size, storage.stream()) {
            Err(err) => err,
            Ok(block) => {
                // No device holds 2^64 bytes; should one, the request is still unusable here.
                let _ = storage.allocator().free(block);
                AllocError::TooLarge {
                    requested: size,
                    max: u64::MAX - self.alignment,
                }
            }
        };
        Err(ReserveError {
            io: IoError::BufferTooBig {
                size,
                backtrace: cubecl_common::backtrace::BackTrace::capture(),
            },
            engine: Some(engine),
        })
    }

    /// Whether a walk could find a free slice: the last one released some, or CubeCL has
    /// reused a freed slice since (tensors are being dropped). A model load, where nothing
    /// is dropped, thus earns and spends no placement credit after its first walk.
    fn drops_possible(&self) -> bool {
        self.last_released > 0 || self.reuse_seen
    }

    /// Whether the engine caches a free block of exactly the size `size` (padded to CubeCL's
    /// alignment, what CubeCL will ask for) rounds to: best fit places the request in such a
    /// block whatever a walk would hand back (a walk could only add others of the same size),
    /// so a placement walk would not change where it goes.
    fn exact_fit_cached(&mut self, size: u64) -> bool {
        let Some(padded) = self.padded(size) else {
            return false;
        };
        let storage = self.manager.storage();
        storage.allocator().has_exact_fit(padded, storage.stream())
    }

    /// Slice-visits of a walk now.
    fn walk_cost(&mut self) -> u64 {
        (self.manager.storage().blocks() as u64).max(1)
    }

    /// The last reservation, after every layer above the engine gave back what it caches: the
    /// engine's full path (its cache flush and retry), whose failure is the request's one
    /// out-of-memory (counted, observed and snapshotted by the engine once).
    pub fn reserve_last_resort(&mut self, size: u64) -> Result<ManagedMemoryHandle, ReserveError> {
        self.refuse_unpaddable(size)?;
        self.manager.storage().set_growth(Growth::Allowed);
        let reserved = self.reserve_padded(size);
        self.outside_other_pools(size, reserved)
            .map_err(|io| ReserveError {
                io,
                engine: self.manager.storage().take_error(),
            })
    }

    /// An unconditional reclaim because a reservation found nothing short of the engine's
    /// cache flush (counted among the walks of [`ReclaimCounters::reclaims`]).
    pub fn reclaim_for_oom(&mut self) {
        self.counters.oom_reclaims += 1;
        self.reclaim();
    }

    /// An unconditional reclaim because the stream's slot is idle (counted among the walks of
    /// [`ReclaimCounters::reclaims`]): its free slices become engine blocks, which other
    /// streams may take once the slot's work is done.
    pub fn reclaim_idle(&mut self) {
        self.counters.idle_reclaims += 1;
        self.reclaim();
    }

    /// Whether the engine's reserved memory grew by more than 1/[`GROWTH_STEP`] since this
    /// stream last reclaimed.
    fn grew_past_mark(&mut self) -> bool {
        let reserved = self.manager.storage().allocator().memory_reserved();
        reserved >= self.reserved_mark + self.reserved_mark / GROWTH_STEP
    }

    /// Names the engine blocks of this stream's free CubeCL slices in `cached`, changing
    /// nothing that decides anything: for a reading of the numbers (see "Readings" in the module
    /// documentation). Returns how many free slices it named, their bytes, and how many free
    /// slices it could not reach.
    pub fn free_slices(&mut self, cached: &mut CachedAbove) -> FreeSlices {
        let keys = self.manager.storage().held_sizes();
        let mut taken = Vec::new();
        self.manager.storage().set_growth(Growth::PoolOnly);
        for key in keys {
            // Each hit is the first free slice of the key; holding it makes the next call find
            // the next one, until the pool has none and the storage refuses to allocate.
            while let Ok(handle) = self.manager.reserve(key) {
                taken.push(handle);
            }
        }
        self.manager.storage().set_growth(Growth::Allowed);
        self.manager.storage().take_refused();
        let mut found = FreeSlices::default();
        for handle in &taken {
            let Ok(slice) = self.manager.get_storage(handle.clone().binding()) else {
                continue;
            };
            if let Some(block) = self.manager.storage().block_of(slice.id) {
                cached.insert(block);
                found.listed += 1;
                found.bytes += block.size();
            }
        }
        drop(taken);
        // Every slice but the guard has a block; the guard is always in use.
        let slices = self.manager.storage().blocks() as u64 + 1;
        let in_use = self.manager.memory_usage().number_allocs;
        found.unlisted = slices.saturating_sub(in_use).saturating_sub(found.listed);
        found
    }

    /// Names the engine block behind `handle` in `cached` (for a buffer the server holds for
    /// itself, which a reading counts as cache, not as a tensor's).
    pub fn name_cached(&mut self, handle: &ManagedMemoryHandle, cached: &mut CachedAbove) {
        if let Ok(Some(slice)) = self.bound_slice(&handle.clone().binding())
            && let Some(block) = self.manager.storage().block_of(slice.id)
        {
            cached.insert(block);
        }
    }

    /// Hands every free CubeCL slice of this stream back to the engine outside the reclaim
    /// policy: for a reading of the numbers (`memory_stats`, a snapshot, `empty_cache`), which
    /// must leave the counters and the marks the policy decides its next walks by as they were.
    pub fn hand_back(&mut self) {
        self.manager.cleanup(true);
    }

    /// Hands every free CubeCL slice of this stream back to the engine.
    pub fn reclaim(&mut self) {
        let visited = self.manager.storage().blocks();
        self.counters.totals.reclaims += 1;
        self.counters.totals.reclaim_work += visited as u64;
        self.manager.cleanup(true);
        let released = visited - self.manager.storage().blocks();
        self.last_released = released;
        self.last_productive = released > 0 && released * PRODUCTIVE_SHARE >= visited;
        self.reserved_mark = self.manager.storage().allocator().memory_reserved();
        self.reuse_seen = false;
    }
}

#[cfg(test)]
mod tests;
