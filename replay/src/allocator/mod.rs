//! The allocators a trace is replayed through, behind one small trait.
//!
//! Every allocator is generic over the
//! [`DeviceMemory`](burn_caching_alloc::device::DeviceMemory) it allocates segments from, and
//! every pass of a measurement gives each one a fresh device of the same kind and capacity (a
//! [`SimDevice`](burn_caching_alloc::device::sim::SimDevice), or a CUDA device; see
//! [`crate::devices`]), so device calls, reserved bytes and out-of-memory behave the same for
//! all of them. The `SimDevice` constructors (`EngineAllocator::new`,
//! `CubeclAllocator::subslices`, `CachingStackAllocator::new`, ...) take the capacity from the
//! simulated device; the generic ones take it as an argument.
//!
//! - `caching`: burn-caching-alloc's engine ([`burn_caching_alloc::alloc::CachingAllocator`])
//!   alone;
//! - `cubecl-subslices`: CubeCL 0.10's `MemoryManagement` with its default
//!   `MemoryConfiguration::SubSlices`, over [`crate::device_storage::DeviceStorage`];
//! - `cubecl-exclusive`: the same with `MemoryConfiguration::ExclusivePages`;
//! - `caching-stack`: what burn-caching-alloc's CubeCL server runs per stream: CubeCL's
//!   persistent pool over the engine (`EngineStorage`), with the runtime's reclaim policy.
//!
//! A free in the trace drops the CubeCL handle, as Burn does when a tensor goes away.
//!
//! Private pools (a trace recorded from a program that used
//! [`MemPool`](burn_caching_alloc::backend::MemPool)) are made and routed to in `caching` and
//! `caching-stack`; CubeCL's pools have none, so there the requests routed to a pool are
//! served like any other: what a user of Burn's stock backend gets for the same program.

mod cubecl;
mod engine;
mod stack;

pub use cubecl::CubeclAllocator;
pub use engine::EngineAllocator;
pub use stack::{CachingStackAllocator, caching_stack_memory};

use burn_caching_alloc::alloc::{MemPoolId, MemPoolOptions};
use burn_caching_alloc::device::DeviceStream;
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryManagement};
use cubecl_runtime::storage::ComputeStorage;

/// Why a replayed request failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// The allocator could not find memory: the replay counts it and goes on.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// Anything else stops the replay.
    #[error("{0}")]
    Failed(String),
}

/// An allocator a trace can be replayed through.
///
/// Dropping one returns every segment it holds to its device once every handle it gave out
/// was freed (a completed replay frees them all; a failed one frees the rest before it
/// returns): the next pass on a real device then starts from what the last one found.
pub trait ReplayAllocator {
    /// What a live allocation is held by (dropping it may be the free).
    type Handle;
    fn malloc(&mut self, size: u64, stream: DeviceStream) -> Result<Self::Handle, ReplayError>;
    /// A request routed to private pool `pool` (made by [`ReplayAllocator::create_pool`]).
    /// By default, for an allocator without private pools, served as [`ReplayAllocator::malloc`].
    fn malloc_in(
        &mut self,
        pool: u32,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Self::Handle, ReplayError> {
        let _ = pool;
        self.malloc(size, stream)
    }
    /// Makes private pool `pool` (numbered from 0 in the order a program makes them).
    /// By default nothing: an allocator without private pools.
    fn create_pool(&mut self, pool: u32, options: MemPoolOptions) -> Result<(), ReplayError> {
        let _ = (pool, options);
        Ok(())
    }
    /// Private pool `pool` returns its wholly free segments. By default nothing.
    fn pool_empty_cache(&mut self, pool: u32) -> Result<(), ReplayError> {
        let _ = pool;
        Ok(())
    }
    /// Private pool `pool` is let go. By default nothing.
    fn release_pool(&mut self, pool: u32) -> Result<(), ReplayError> {
        let _ = pool;
        Ok(())
    }
    fn free(&mut self, handle: Self::Handle) -> Result<(), ReplayError>;
    fn record_stream(
        &mut self,
        handle: &Self::Handle,
        stream: DeviceStream,
    ) -> Result<(), ReplayError>;
    fn empty_cache(&mut self) -> Result<(), ReplayError>;
    /// Bytes of live requests as the allocator itself counts them (may walk its state).
    fn live_bytes(&self) -> u64;
}

/// Which allocator to replay through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocatorKind {
    Caching,
    CubeclSubslices,
    CubeclExclusive,
    CachingStack,
}

impl AllocatorKind {
    pub const ALL: [AllocatorKind; 4] = [
        AllocatorKind::Caching,
        AllocatorKind::CubeclSubslices,
        AllocatorKind::CubeclExclusive,
        AllocatorKind::CachingStack,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AllocatorKind::Caching => "caching",
            AllocatorKind::CubeclSubslices => "cubecl-subslices",
            AllocatorKind::CubeclExclusive => "cubecl-exclusive",
            AllocatorKind::CachingStack => "caching-stack",
        }
    }

    /// The kind named `name` (as [`AllocatorKind::name`] writes it).
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == name.trim())
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
                format!("unknown allocator {name:?}; known: {}", known.join(", "))
            })
    }
}

impl core::fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// The simulated device's capacity, by default: 24 GiB, a common size of a CUDA
/// device (RTX 3090/4090, A10G, L4 has 24 GB too).
pub const DEFAULT_DEVICE_CAPACITY: u64 = 24 << 30;

/// CubeCL's memory properties of a CUDA device of `capacity` bytes, as cubecl-cuda 0.10 sets
/// them (`runtime.rs`): `max_page_size` is a quarter of the device's total memory
/// (`cuDeviceTotalMem / 4`) and the alignment is 512 bytes. On a real CUDA device the
/// capacity is its total memory. With `SubSlices` this yields
/// sliced pools with pages of 24 MiB, 96 MiB, 384 MiB, 1.5 GiB and 6 GiB on a 24 GiB device.
pub fn cuda_memory_properties(capacity: u64) -> MemoryDeviceProperties {
    MemoryDeviceProperties {
        max_page_size: capacity / 4,
        alignment: CUDA_ALIGNMENT,
    }
}

/// The buffer alignment cubecl-cuda 0.10 uses.
pub const CUDA_ALIGNMENT: u64 = 512;

/// Binds a reservation of `manager` to a fresh client handle, as a CubeCL server's `empty`
/// does: the handle a malloc returns, whose drop is the free.
pub(crate) fn bind_client<S: ComputeStorage>(
    manager: &mut MemoryManagement<S>,
    reserved: ManagedMemoryHandle,
    cursor: u64,
) -> Result<ManagedMemoryHandle, ReplayError> {
    let client = ManagedMemoryHandle::new();
    manager
        .bind(reserved, client.clone(), cursor)
        .map_err(|io| ReplayError::Failed(format!("CubeCL bind: {io}")))?;
    Ok(client)
}

/// The engine's pool for the program's pool `pool`.
pub(crate) fn engine_pool(pools: &[MemPoolId], pool: u32) -> Result<MemPoolId, ReplayError> {
    pools
        .get(pool as usize)
        .copied()
        .ok_or_else(|| ReplayError::Failed(format!("private pool {pool} was never made")))
}

/// Notes that the program's pool `pool` (the next number: a program numbers its pools in the
/// order it makes them) is the engine's `made`.
pub(crate) fn record_pool(
    pools: &mut Vec<MemPoolId>,
    pool: u32,
    made: MemPoolId,
) -> Result<(), ReplayError> {
    if pool as usize != pools.len() {
        return Err(ReplayError::Failed(format!(
            "private pool {pool} made out of order (next is {})",
            pools.len()
        )));
    }
    pools.push(made);
    Ok(())
}
