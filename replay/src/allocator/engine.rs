//! `caching`: the engine alone, with its default configuration (or the one given).

use burn_caching_alloc::alloc::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, MemPoolId, MemPoolOptions,
};
use burn_caching_alloc::device::{DeviceMemory, DeviceStream};

use super::{ReplayAllocator, ReplayError, engine_pool, record_pool};

/// The caching engine over a device `D` (the simulated device, a metered one, CUDA).
///
/// Dropping it empties the engine's cache: once every allocation was freed (a replay frees
/// them all), every segment goes back to the device.
pub struct EngineAllocator<D: DeviceMemory> {
    engine: CachingAllocator<D>,
    /// The engine's pool for each pool the program made, by the program's number.
    pools: Vec<MemPoolId>,
}

impl<D: DeviceMemory> EngineAllocator<D> {
    pub fn new(device: D) -> Self {
        Self::with_config(device, AllocatorConfig::default())
    }

    pub fn with_config(device: D, config: AllocatorConfig) -> Self {
        Self {
            engine: CachingAllocator::new(device, config).unwrap_or_else(|err| {
                panic!("replay: the engine refuses the configuration: {err}")
            }),
            pools: Vec::new(),
        }
    }

    pub fn engine(&self) -> &CachingAllocator<D> {
        &self.engine
    }
}

impl<D: DeviceMemory> Drop for EngineAllocator<D> {
    fn drop(&mut self) {
        if let Err(err) = self.engine.empty_cache() {
            log::error!("EngineAllocator: emptying the cache on drop failed: {err}");
        }
    }
}

/// An out-of-memory the trace may continue past, or a failure that stops the replay: a request
/// larger than the device ([`AllocError::TooLarge`], an out-of-memory for the allocator's
/// observers) is a trace this device cannot run at all.
fn replay_error(err: AllocError) -> ReplayError {
    if matches!(err, AllocError::OutOfMemory { .. }) {
        ReplayError::OutOfMemory(err.to_string())
    } else {
        ReplayError::Failed(err.to_string())
    }
}

impl<D: DeviceMemory> ReplayAllocator for EngineAllocator<D> {
    type Handle = Allocation<D::Handle>;

    fn malloc(&mut self, size: u64, stream: DeviceStream) -> Result<Self::Handle, ReplayError> {
        self.engine.malloc(size, stream).map_err(replay_error)
    }

    fn malloc_in(
        &mut self,
        pool: u32,
        size: u64,
        stream: DeviceStream,
    ) -> Result<Self::Handle, ReplayError> {
        let pool = engine_pool(&self.pools, pool)?;
        self.engine
            .malloc_in(pool, size, stream)
            .map_err(replay_error)
    }

    fn create_pool(&mut self, pool: u32, options: MemPoolOptions) -> Result<(), ReplayError> {
        let made = self.engine.create_pool(options).map_err(replay_error)?;
        record_pool(&mut self.pools, pool, made)
    }

    fn pool_empty_cache(&mut self, pool: u32) -> Result<(), ReplayError> {
        let pool = engine_pool(&self.pools, pool)?;
        self.engine
            .pool_empty_cache(pool)
            .map(|_| ())
            .map_err(replay_error)
    }

    fn release_pool(&mut self, pool: u32) -> Result<(), ReplayError> {
        let pool = engine_pool(&self.pools, pool)?;
        self.engine
            .release_pool(pool)
            .map(|_| ())
            .map_err(replay_error)
    }

    fn free(&mut self, handle: Self::Handle) -> Result<(), ReplayError> {
        self.engine.free(handle).map_err(replay_error)
    }

    fn record_stream(
        &mut self,
        handle: &Self::Handle,
        stream: DeviceStream,
    ) -> Result<(), ReplayError> {
        self.engine
            .record_stream(handle, stream)
            .map_err(replay_error)
    }

    fn empty_cache(&mut self) -> Result<(), ReplayError> {
        self.engine.empty_cache().map(|_| ()).map_err(replay_error)
    }

    fn live_bytes(&self) -> u64 {
        self.engine.stats().requested_bytes.all.current
    }
}
