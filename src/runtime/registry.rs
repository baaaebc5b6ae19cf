//! Where the user API finds the allocator a server uses: one entry per opened device.
//!
//! A server registers its engine when CubeCL opens the device; `memory_stats(&device)` and the
//! other user calls look it up by device id and memory type. The entry also carries the
//! per-layer numbers the server computed at its last `memory_usage` call.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cubecl_common::device::DeviceId;
use parking_lot::Mutex;

use super::reclaim::ReclaimCounters;
use crate::alloc::CachingAllocator;
use crate::device::DeviceMemory;

/// CubeCL's layer of a device, summed over its streams: the persistent pools' slices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CubeclLayerUsage {
    /// Streams with a memory manager.
    pub streams: u64,
    /// Slices held by live tensors.
    pub live_slices: u64,
    /// Bytes of live tensors (what CubeCL calls `bytes_in_use`).
    pub live_bytes: u64,
    /// Alignment padding of live slices.
    pub padding_bytes: u64,
    /// Bytes of all slices, live or free (each one an engine block).
    pub slice_bytes: u64,
    /// What the streams' reservations did (reclaims, their work, ...), summed.
    pub reclaim: ReclaimCounters,
}

impl CubeclLayerUsage {
    /// Bytes in free slices: cached by CubeCL's exact-size reuse, allocated in the engine.
    pub fn cached_bytes(&self) -> u64 {
        self.slice_bytes
            .saturating_sub(self.live_bytes + self.padding_bytes)
    }
}

/// What the registry keeps for one device.
pub struct DeviceEntry<M: DeviceMemory> {
    /// The engine the device's server allocates through.
    pub allocator: Arc<CachingAllocator<M>>,
    /// CubeCL-layer numbers, refreshed by the server on every `memory_usage`.
    pub cubecl: Arc<Mutex<CubeclLayerUsage>>,
}

impl<M: DeviceMemory> Clone for DeviceEntry<M> {
    fn clone(&self) -> Self {
        Self {
            allocator: self.allocator.clone(),
            cubecl: self.cubecl.clone(),
        }
    }
}

type Key = (TypeId, DeviceId);

fn entries() -> &'static Mutex<HashMap<Key, Box<dyn Any + Send + Sync>>> {
    static ENTRIES: OnceLock<Mutex<HashMap<Key, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
    ENTRIES.get_or_init(Default::default)
}

/// Records the entry of `device` (a server calls this when it opens the device).
pub fn register<M: DeviceMemory>(device: DeviceId, entry: DeviceEntry<M>) {
    entries()
        .lock()
        .insert((TypeId::of::<M>(), device), Box::new(entry));
}

/// The entry of `device`, if a server with memory type `M` opened it.
pub fn lookup<M: DeviceMemory>(device: DeviceId) -> Option<DeviceEntry<M>> {
    entries()
        .lock()
        .get(&(TypeId::of::<M>(), device))
        .and_then(|entry| entry.downcast_ref::<DeviceEntry<M>>())
        .cloned()
}
