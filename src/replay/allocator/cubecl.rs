//! `cubecl-subslices` and `cubecl-exclusive`: CubeCL 0.10's own `MemoryManagement` over the
//! simulated device, driven the way cubecl-cuda's server drives it.
//!
//! One manager per stream (cubecl-cuda keeps one per stream). A malloc is the server's
//! `empty`: `reserve(size)`, then `bind` the reservation to a fresh client handle; a free
//! drops that client handle, which makes the slice reusable; `empty_cache` is the server's
//! `memory_cleanup`: `cleanup(true)` on every manager. cubecl-cuda 0.10 calls
//! `cleanup(false)` (the dealloc-period sweep of exclusive pages) only after a stream error,
//! so a replay never does. CubeCL has no cross-stream reuse, so `record_stream` is a no-op.

use std::sync::Arc;

use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    ManagedMemoryHandle, MemoryAllocationMode, MemoryConfiguration, MemoryManagement,
    MemoryManagementOptions,
};

use super::{ReplayAllocator, ReplayError, cuda_memory_properties};
use crate::device::sim::SimDevice;
use crate::device::{DeviceError, StreamId};
use crate::replay::sim_storage::SimStorage;

/// CubeCL's memory management over a simulated device.
pub struct CubeclAllocator {
    device: SimDevice,
    config: MemoryConfiguration,
    logger: Arc<ServerLogger>,
    managers: Vec<(StreamId, MemoryManagement<SimStorage>)>,
    cursor: u64,
}

impl CubeclAllocator {
    /// CubeCL's default pools (`MemoryConfiguration::SubSlices`).
    pub fn subslices(device: SimDevice) -> Self {
        Self::new(device, MemoryConfiguration::SubSlices)
    }

    /// CubeCL's exclusive pages (`MemoryConfiguration::ExclusivePages`).
    pub fn exclusive(device: SimDevice) -> Self {
        Self::new(device, MemoryConfiguration::ExclusivePages)
    }

    pub fn new(device: SimDevice, config: MemoryConfiguration) -> Self {
        Self {
            device,
            config,
            logger: Arc::new(ServerLogger::default()),
            managers: Vec::new(),
            cursor: 0,
        }
    }

    fn manager(&mut self, stream: StreamId) -> &mut MemoryManagement<SimStorage> {
        let index = match self.managers.iter().position(|(s, _)| *s == stream) {
            Some(index) => index,
            None => {
                let properties = cuda_memory_properties(self.device.capacity());
                let storage =
                    SimStorage::new(self.device.clone(), stream, properties.alignment as usize);
                let manager = MemoryManagement::from_configuration(
                    storage,
                    &properties,
                    self.config.clone(),
                    self.logger.clone(),
                    // What cubecl-cuda's default configuration resolves to, set explicitly so
                    // that no cubecl.toml on the machine changes the baseline.
                    MemoryManagementOptions::new(format!("replay {stream}"))
                        .mode(MemoryAllocationMode::Auto),
                );
                self.managers.push((stream, manager));
                self.managers.len() - 1
            }
        };
        &mut self.managers[index].1
    }
}

impl ReplayAllocator for CubeclAllocator {
    type Handle = ManagedMemoryHandle;

    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<Self::Handle, ReplayError> {
        self.cursor += 1;
        let cursor = self.cursor;
        let manager = self.manager(stream);
        let reserved = match manager.reserve(size) {
            Ok(reserved) => reserved,
            Err(io) => {
                return Err(match manager.storage().take_error() {
                    Some(DeviceError::OutOfMemory { .. }) => {
                        ReplayError::OutOfMemory(format!("{size} bytes: {io}"))
                    }
                    _ => ReplayError::Failed(format!("CubeCL reserve of {size} bytes: {io}")),
                });
            }
        };
        let client = ManagedMemoryHandle::new();
        manager
            .bind(reserved, client.clone(), cursor)
            .map_err(|io| ReplayError::Failed(format!("CubeCL bind: {io}")))?;
        Ok(client)
    }

    fn free(&mut self, handle: Self::Handle) -> Result<(), ReplayError> {
        drop(handle);
        Ok(())
    }

    fn record_stream(&mut self, _: &Self::Handle, _: StreamId) -> Result<(), ReplayError> {
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), ReplayError> {
        for (_, manager) in &mut self.managers {
            manager.cleanup(true);
        }
        Ok(())
    }

    fn live_bytes(&self) -> u64 {
        self.managers
            .iter()
            .map(|(_, m)| m.memory_usage().bytes_in_use)
            .sum()
    }
}
