//! `cubecl-subslices` and `cubecl-exclusive`: CubeCL 0.10's own `MemoryManagement` over a
//! device (through [`DeviceStorage`]), driven the way cubecl-cuda's server drives it.
//!
//! One manager per stream (cubecl-cuda keeps one per stream), all sharing the device. A malloc
//! is the server's `empty`: `reserve(size)`, then `bind` the reservation to a fresh client
//! handle; a free drops that client handle, which makes the slice reusable; `empty_cache` is
//! the server's `memory_cleanup`: `cleanup(true)` on every manager. cubecl-cuda 0.10 calls
//! `cleanup(false)` (the dealloc-period sweep of exclusive pages) only after a stream error,
//! so a replay never does. CubeCL has no cross-stream reuse, so `record_stream` is a no-op.
//!
//! The pools are sized from the device's capacity as cubecl-cuda sizes them from the device's
//! total memory ([`cuda_memory_properties`]). Dropping the allocator drops the managers and
//! their storages, which return every segment to the device.

use std::sync::Arc;

use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::device::{DeviceError, DeviceMemory, DeviceStream};
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    ManagedMemoryHandle, MemoryAllocationMode, MemoryConfiguration, MemoryManagement,
    MemoryManagementOptions,
};
use parking_lot::Mutex;

use super::{ReplayAllocator, ReplayError, bind_client, cuda_memory_properties};
use crate::device_storage::{DeviceStorage, SharedDevice};

/// CubeCL's memory management over a device `D`.
pub struct CubeclAllocator<D: DeviceMemory> {
    device: SharedDevice<D>,
    capacity: u64,
    config: MemoryConfiguration,
    logger: Arc<ServerLogger>,
    managers: Vec<(DeviceStream, MemoryManagement<DeviceStorage<D>>)>,
    cursor: u64,
}

impl CubeclAllocator<SimDevice> {
    /// CubeCL's default pools (`MemoryConfiguration::SubSlices`) on a simulated device.
    pub fn subslices(device: SimDevice) -> Self {
        let capacity = device.capacity();
        Self::new(device, capacity, MemoryConfiguration::SubSlices)
    }

    /// CubeCL's exclusive pages (`MemoryConfiguration::ExclusivePages`) on a simulated device.
    pub fn exclusive(device: SimDevice) -> Self {
        let capacity = device.capacity();
        Self::new(device, capacity, MemoryConfiguration::ExclusivePages)
    }
}

impl<D: DeviceMemory> CubeclAllocator<D> {
    /// CubeCL's `config` on `device`, whose total memory is `capacity` bytes (what CubeCL's
    /// page sizes derive from).
    pub fn new(device: D, capacity: u64, config: MemoryConfiguration) -> Self {
        Self {
            device: Arc::new(Mutex::new(device)),
            capacity,
            config,
            logger: Arc::new(ServerLogger::default()),
            managers: Vec::new(),
            cursor: 0,
        }
    }

    fn manager(&mut self, stream: DeviceStream) -> &mut MemoryManagement<DeviceStorage<D>> {
        let index = match self.managers.iter().position(|(s, _)| *s == stream) {
            Some(index) => index,
            None => {
                let properties = cuda_memory_properties(self.capacity);
                let storage =
                    DeviceStorage::new(self.device.clone(), stream, properties.alignment as usize);
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

impl<D: DeviceMemory> ReplayAllocator for CubeclAllocator<D> {
    type Handle = ManagedMemoryHandle;

    fn malloc(&mut self, size: u64, stream: DeviceStream) -> Result<Self::Handle, ReplayError> {
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
        bind_client(manager, reserved, cursor)
    }

    fn free(&mut self, handle: Self::Handle) -> Result<(), ReplayError> {
        drop(handle);
        Ok(())
    }

    fn record_stream(&mut self, _: &Self::Handle, _: DeviceStream) -> Result<(), ReplayError> {
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
