//! When freed CubeCL slices go back to the engine.
//!
//! CubeCL's persistent pool keeps a freed slice for the next tensor of exactly the same size;
//! any other size is a new engine block. Left alone, memory held in free slices of sizes that
//! never come back would make the engine grow while reclaimable memory exists. So every
//! reservation first asks for a cached engine block only ([`Growth::CacheOnly`]); if neither
//! CubeCL's pool nor the engine's cache can serve it, the engine would have to grow, and the
//! stream first reclaims: `cleanup(true)` hands every free slice back to the engine (which
//! coalesces them), then the reservation is retried with growth allowed.
//!
//! `cleanup(true)` walks every slice of the stream, live or free. Run at every would-grow miss,
//! loading a model of n parameters (each one a miss) would cost O(n^2). The reclaim is therefore
//! paid from a budget: every reservation earns [`CREDIT_PER_RESERVE`] slice-visits, and a
//! reclaim spends as many as the stream has slices. A reclaim runs only when the budget covers
//! it, so the reclaim work over any sequence of reservations is at most
//! `CREDIT_PER_RESERVE` x reservations: O(1) amortised per allocation. When a model loads, the
//! slice count grows by one per reservation, so reclaims happen at geometrically spaced points
//! (each time the count has grown by a quarter); in steady training, where the slice count is
//! stable, a reclaim is affordable every `slices / CREDIT_PER_RESERVE` reservations.
//!
//! The budget alone lets a stream with many live slices (a large model) grow for a long time
//! between reclaims while its churning activations leave free slices of odd sizes behind. So a
//! would-grow miss the budget cannot pay for still reclaims when (a) CubeCL has reused a freed
//! slice since the stream's last reclaim, the sign that tensors are being dropped, and (b) the
//! engine's reserved memory has grown by 1/[`GROWTH_STEP`] since then. (a) keeps loading a
//! model, where nothing is dropped and a walk would find nothing, at the budget's cost; (b)
//! bounds the number of such walks by the growth of device memory (about `GROWTH_STEP` x
//! ln(growth factor) while memory only grows), and each one stands in front of a device
//! allocation anyway. On the replay's many-parameters trace this takes the stack from 1.9x to
//! 1.45x the engine's peak reserved memory.
//!
//! On a real failure (the engine's own out-of-memory path already ran) the stream reclaims
//! unconditionally and retries once: an out-of-memory error is rare, and worth a full scan.
//!
//! While the engine records its history ([`ReclaimPolicy::EveryReserve`]), the stream reclaims
//! before every reservation instead: CubeCL's exact-size reuse is bypassed, so every tensor's
//! reservation is an engine `malloc` and its release an engine `free` (seen at the next
//! reservation, which is the first moment an allocator could reuse it). The recorded trace is
//! then the workload itself, a fair input for any allocator, and not just what missed CubeCL's
//! pool. This costs one walk of the stream's slices per reservation: a diagnostic mode.

use std::sync::Arc;

use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryUsage};
use cubecl_runtime::server::IoError;

use super::storage::{Growth, PersistentManager, persistent_manager};
use crate::alloc::{AllocError, CachingAllocator};
use crate::device::{DeviceMemory, StreamId};

/// Slice-visits of reclaim work each reservation pays for.
pub(crate) const CREDIT_PER_RESERVE: u64 = 4;

/// A would-grow miss of a stream that is dropping tensors reclaims even when the budget is
/// short once the engine's reserved memory has grown by 1/`GROWTH_STEP` since the stream's
/// last reclaim.
pub(crate) const GROWTH_STEP: u64 = 32;

/// The amortisation budget of one stream's reclaims.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReclaimBudget {
    credits: u64,
}

impl ReclaimBudget {
    /// Earns the credit of one reservation.
    pub(crate) fn earn(&mut self) {
        self.credits = self.credits.saturating_add(CREDIT_PER_RESERVE);
    }

    /// Spends `cost` slice-visits if the budget covers them.
    pub(crate) fn try_spend(&mut self, cost: u64) -> bool {
        if self.credits >= cost {
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
    /// Only when the engine would otherwise grow, paid from an amortisation budget (each
    /// reservation earns 4 slice-visits of reclaim work).
    #[default]
    Amortised,
    /// Before every reservation, so the engine sees every tensor (for recording traces).
    EveryReserve,
}

/// What a stream's reservations did, for tests, benchmarks and the user-facing summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReclaimCounters {
    /// Reservations asked of this stream.
    pub reserves: u64,
    /// Reservations that neither CubeCL's pool nor the engine's cache could serve.
    pub would_grow: u64,
    /// Reclaims run before a reservation (budgeted, or every one under
    /// [`ReclaimPolicy::EveryReserve`]).
    pub reclaims: u64,
    /// Would-grow misses the budget could not pay for, reclaimed anyway because CubeCL had
    /// reused a freed slice and the engine's reserved memory had grown by 1/32
    /// since the stream's last reclaim.
    pub growth_reclaims: u64,
    /// Would-grow misses that grew without a reclaim.
    pub skipped_reclaims: u64,
    /// Unconditional reclaims run after an allocation failure.
    pub oom_reclaims: u64,
    /// Slice-visits spent by all reclaims (the work the budget bounds).
    pub reclaim_work: u64,
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
    counters: ReclaimCounters,
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

impl<D: DeviceMemory> StreamMemory<D> {
    /// The memory of engine stream `stream`, with the [`ReclaimPolicy::Amortised`] policy.
    pub fn new(
        allocator: Arc<CachingAllocator<D>>,
        stream: StreamId,
        properties: &MemoryDeviceProperties,
    ) -> Self {
        Self {
            manager: persistent_manager(allocator, stream, properties),
            policy: ReclaimPolicy::Amortised,
            budget: ReclaimBudget::default(),
            reserved_mark: 0,
            reuse_seen: false,
            counters: ReclaimCounters::default(),
        }
    }

    /// The same memory with reclaim policy `policy`.
    pub fn with_policy(mut self, policy: ReclaimPolicy) -> Self {
        self.policy = policy;
        self
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
        self.counters
    }

    /// CubeCL's view of this stream: live slices, their bytes, and all slices' bytes.
    pub fn usage(&self) -> MemoryUsage {
        self.manager.memory_usage()
    }

    /// Reserves `size` bytes: CubeCL's exact-size reuse, else a cached engine block, else a
    /// (budgeted) reclaim and an engine allocation that may grow; on failure an unconditional
    /// reclaim and one retry. Under [`ReclaimPolicy::EveryReserve`]: a reclaim, then the
    /// engine allocation.
    pub fn reserve(&mut self, size: u64) -> Result<ManagedMemoryHandle, ReserveError> {
        self.counters.reserves += 1;
        if self.policy == ReclaimPolicy::EveryReserve {
            self.counters.reclaims += 1;
            self.reclaim();
            return self.reserve_growing(size);
        }
        self.budget.earn();

        let blocks = self.manager.storage().blocks();
        self.manager.storage().set_growth(Growth::CacheOnly);
        let first = self.manager.reserve(size);
        self.manager.storage().set_growth(Growth::Allowed);
        let refused = self.manager.storage().take_refused();
        match first {
            Ok(handle) => {
                // No new engine block: CubeCL reused a slice a dropped tensor left free.
                if self.manager.storage().blocks() == blocks {
                    self.reuse_seen = true;
                }
                return Ok(handle);
            }
            Err(io) if !refused => {
                let engine = self.manager.storage().take_error();
                return Err(ReserveError { io, engine });
            }
            Err(_) => {}
        }

        self.counters.would_grow += 1;
        let cost = (self.manager.storage().blocks() as u64).max(1);
        if self.budget.try_spend(cost) {
            self.counters.reclaims += 1;
            self.reclaim();
        } else if self.reuse_seen && self.grew_past_mark() {
            self.counters.growth_reclaims += 1;
            self.reclaim();
        } else {
            self.counters.skipped_reclaims += 1;
        }
        self.reserve_growing(size)
    }

    /// Reserves with engine growth allowed; on failure reclaims everything and retries once.
    fn reserve_growing(&mut self, size: u64) -> Result<ManagedMemoryHandle, ReserveError> {
        match self.manager.reserve(size) {
            Ok(handle) => Ok(handle),
            Err(_) => {
                self.manager.storage().take_error();
                self.counters.oom_reclaims += 1;
                self.reclaim();
                self.manager.reserve(size).map_err(|io| ReserveError {
                    io,
                    engine: self.manager.storage().take_error(),
                })
            }
        }
    }

    /// Retries a reservation after other streams reclaimed (no further reclaim here).
    pub fn retry_reserve(&mut self, size: u64) -> Result<ManagedMemoryHandle, ReserveError> {
        self.manager.reserve(size).map_err(|io| ReserveError {
            io,
            engine: self.manager.storage().take_error(),
        })
    }

    /// Whether the engine's reserved memory grew by more than 1/[`GROWTH_STEP`] since this
    /// stream last reclaimed.
    fn grew_past_mark(&mut self) -> bool {
        let reserved = self.manager.storage().allocator().memory_reserved();
        reserved >= self.reserved_mark + self.reserved_mark / GROWTH_STEP
    }

    /// Hands every free CubeCL slice of this stream back to the engine.
    pub fn reclaim(&mut self) {
        self.counters.reclaim_work += self.manager.storage().blocks() as u64;
        self.manager.cleanup(true);
        self.reserved_mark = self.manager.storage().allocator().memory_reserved();
        self.reuse_seen = false;
    }
}
