//! `caching`: the engine alone, with its default configuration.

use super::{ReplayAllocator, ReplayError};
use crate::alloc::{AllocError, Allocation, AllocatorConfig, CachingAllocator};
use crate::device::StreamId;
use crate::device::sim::SimDevice;

/// The caching engine over a simulated device.
pub struct EngineAllocator {
    engine: CachingAllocator<SimDevice>,
}

impl EngineAllocator {
    pub fn new(device: SimDevice) -> Self {
        Self::with_config(device, AllocatorConfig::default())
    }

    pub fn with_config(device: SimDevice, config: AllocatorConfig) -> Self {
        Self {
            engine: CachingAllocator::new(device, config),
        }
    }

    pub fn engine(&self) -> &CachingAllocator<SimDevice> {
        &self.engine
    }
}

fn replay_error(err: AllocError) -> ReplayError {
    if err.is_out_of_memory() {
        ReplayError::OutOfMemory(err.to_string())
    } else {
        ReplayError::Failed(err.to_string())
    }
}

impl ReplayAllocator for EngineAllocator {
    type Handle = Allocation<u64>;

    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<Self::Handle, ReplayError> {
        self.engine.malloc(size, stream).map_err(replay_error)
    }

    fn free(&mut self, handle: Self::Handle) -> Result<(), ReplayError> {
        self.engine.free(handle).map_err(replay_error)
    }

    fn record_stream(
        &mut self,
        handle: &Self::Handle,
        stream: StreamId,
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
