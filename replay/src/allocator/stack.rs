//! `caching-stack`: what burn-caching-alloc's CubeCL server runs for each stream, on a device
//! `D`: CubeCL's persistent pool (exact-size reuse of freed slices) over the engine's
//! `ComputeStorage` ([`EngineStorage`](burn_caching_alloc::runtime::EngineStorage)), with the
//! runtime's reclaim policy ([`StreamMemory`]: free slices go back to the engine before it
//! would grow).
//!
//! A malloc is `reserve` then `bind` to a fresh client handle, a free drops the client handle,
//! `empty_cache` reclaims every stream and empties the engine's cache. `record_stream` is a
//! no-op here: the server records streams on engine blocks it resolves through CubeCL
//! bindings, which a replay does not have. Dropping the allocator does what `empty_cache`
//! does, so that once every handle was dropped every segment goes back to the device.

use std::sync::Arc;

use burn_caching_alloc::alloc::{
    AllocError, AllocatorConfig, CachingAllocator, MemPoolId, MemPoolOptions,
};
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::device::{DeviceMemory, DeviceStream};
use burn_caching_alloc::runtime::StreamMemory;
use cubecl_runtime::memory_management::ManagedMemoryHandle;

use super::{
    ReplayAllocator, ReplayError, bind_client, cuda_memory_properties, engine_pool, record_pool,
};

/// One stream's memory of the caching stack, built the way the server builds it, on a device
/// of `capacity` bytes.
pub fn caching_stack_memory<D: DeviceMemory>(
    engine: Arc<CachingAllocator<D>>,
    stream: DeviceStream,
    capacity: u64,
) -> StreamMemory<D> {
    StreamMemory::new(engine, stream, &cuda_memory_properties(capacity))
}

/// The caching stack over a device `D`.
pub struct CachingStackAllocator<D: DeviceMemory> {
    engine: Arc<CachingAllocator<D>>,
    capacity: u64,
    streams: Vec<(DeviceStream, StreamMemory<D>)>,
    cursor: u64,
    /// The engine's pool for each pool the program made, by the program's number.
    pools: Vec<MemPoolId>,
    /// Bytes the live handles asked for (CubeCL's own count is of the padded sizes the
    /// streams reserve).
    live: u64,
}

impl CachingStackAllocator<SimDevice> {
    /// The stack with the engine's default configuration on a simulated device.
    pub fn new(device: SimDevice) -> Self {
        Self::with_config(device, AllocatorConfig::default())
    }

    /// The stack with the engine configured by `config` on a simulated device.
    pub fn with_config(device: SimDevice, config: AllocatorConfig) -> Self {
        let capacity = device.capacity();
        Self::with_capacity(device, capacity, config)
    }
}

impl<D: DeviceMemory> CachingStackAllocator<D> {
    /// The stack with the engine configured by `config` on `device`, whose total memory is
    /// `capacity` bytes (what CubeCL's memory properties derive from).
    pub fn with_capacity(device: D, capacity: u64, config: AllocatorConfig) -> Self {
        Self {
            engine: Arc::new(CachingAllocator::new(device, config).unwrap_or_else(|err| {
                panic!("replay: the engine refuses the configuration: {err}")
            })),
            capacity,
            streams: Vec::new(),
            cursor: 0,
            pools: Vec::new(),
            live: 0,
        }
    }

    pub fn engine(&self) -> &CachingAllocator<D> {
        &self.engine
    }

    fn stream(&mut self, stream: DeviceStream) -> &mut StreamMemory<D> {
        let index = match self.streams.iter().position(|(s, _)| *s == stream) {
            Some(index) => index,
            None => {
                let memory = caching_stack_memory(self.engine.clone(), stream, self.capacity);
                self.streams.push((stream, memory));
                self.streams.len() - 1
            }
        };
        &mut self.streams[index].1
    }
}

impl<D: DeviceMemory> Drop for CachingStackAllocator<D> {
    fn drop(&mut self) {
        // Free slices go back to the engine (a slice still bound to a live handle stays an
        // allocated engine block, and its segment with it), then the engine's cache goes back
        // to the device.
        for (_, memory) in &mut self.streams {
            memory.reclaim();
        }
        self.streams.clear();
        if let Err(err) = self.engine.empty_cache() {
            log::error!("CachingStackAllocator: emptying the cache on drop failed: {err}");
        }
    }
}

impl<D: DeviceMemory> CachingStackAllocator<D> {
    /// A reservation of `stream`'s memory routed to `pool`, as the server routes the
    /// reservations made under a `use_mem_pool` guard.
    fn reserve_in(
        &mut self,
        pool: Option<MemPoolId>,
        size: u64,
        stream: DeviceStream,
    ) -> Result<(ManagedMemoryHandle, u64), ReplayError> {
        self.cursor += 1;
        let cursor = self.cursor;
        let memory = self.stream(stream);
        memory.manager().storage().set_mem_pool(pool);
        let reserved = memory.reserve(size);
        memory.manager().storage().set_mem_pool(None);
        let reserved = reserved.map_err(|err| match &err.engine {
            Some(AllocError::OutOfMemory { .. }) => ReplayError::OutOfMemory(err.to_string()),
            _ => ReplayError::Failed(format!("caching stack reserve of {size} bytes: {err}")),
        })?;
        let handle = bind_client(memory.manager(), reserved, cursor)?;
        self.live += size;
        Ok((handle, size))
    }
}

impl<D: DeviceMemory> ReplayAllocator for CachingStackAllocator<D> {
    /// The client's handle and the bytes it asked for.
    type Handle = (ManagedMemoryHandle, u64);

    fn malloc(&mut self, size: u64, stream: DeviceStream) -> Result<Self::Handle, ReplayError> {
        self.reserve_in(None, size, stream)
    }

    fn malloc_in(
        &mut self,
        pool: u32,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Self::Handle, ReplayError> {
        let pool = engine_pool(&self.pools, pool)?;
        self.reserve_in(Some(pool), size, stream)
    }

    fn create_pool(&mut self, pool: u32, options: MemPoolOptions) -> Result<(), ReplayError> {
        let made = self
            .engine
            .create_pool(options)
            .map_err(|err| ReplayError::Failed(err.to_string()))?;
        record_pool(&mut self.pools, pool, made)
    }

    fn pool_empty_cache(&mut self, pool: u32) -> Result<(), ReplayError> {
        // What the backend's `MemPool::empty_cache` does: CubeCL's free slices go back to
        // the engine first (outside the reclaim policy, as a reading hands them back), then
        // the pool's wholly free segments to the device.
        let pool = engine_pool(&self.pools, pool)?;
        for (_, memory) in &mut self.streams {
            memory.hand_back();
        }
        self.engine
            .pool_empty_cache(pool)
            .map(|_| ())
            .map_err(|err| ReplayError::Failed(err.to_string()))
    }

    fn release_pool(&mut self, pool: u32) -> Result<(), ReplayError> {
        // As the backend's `MemPool` drop: the pool's slices CubeCL still keeps go back to
        // the engine when the reclaim walks reach them, and the segments with them.
        let pool = engine_pool(&self.pools, pool)?;
        self.engine
            .release_pool(pool)
            .map(|_| ())
            .map_err(|err| ReplayError::Failed(err.to_string()))
    }

    fn free(&mut self, (handle, size): Self::Handle) -> Result<(), ReplayError> {
        drop(handle);
        self.live -= size;
        Ok(())
    }

    fn record_stream(&mut self, _: &Self::Handle, _: DeviceStream) -> Result<(), ReplayError> {
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), ReplayError> {
        for (_, memory) in &mut self.streams {
            memory.reclaim();
        }
        self.engine
            .empty_cache()
            .map(|_| ())
            .map_err(|err| ReplayError::Failed(err.to_string()))
    }

    fn live_bytes(&self) -> u64 {
        self.live
    }
}
