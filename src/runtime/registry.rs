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

use super::server::CubeclLayerUsage;
use crate::alloc::CachingAllocator;
use crate::device::DeviceMemory;

/// What the registry keeps for one device.
pub(crate) struct DeviceEntry<M: DeviceMemory> {
    /// The engine the device's server allocates through.
    pub(crate) allocator: Arc<CachingAllocator<M>>,
    /// CubeCL-layer numbers, refreshed by the server on every `memory_usage`.
    pub(crate) cubecl: Arc<Mutex<CubeclLayerUsage>>,
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
pub(crate) fn register<M: DeviceMemory>(device: DeviceId, entry: DeviceEntry<M>) {
    entries()
        .lock()
        .insert((TypeId::of::<M>(), device), Box::new(entry));
}

/// The entry of `device`, if a server with memory type `M` opened it.
pub(crate) fn lookup<M: DeviceMemory>(device: DeviceId) -> Option<DeviceEntry<M>> {
    entries()
        .lock()
        .get(&(TypeId::of::<M>(), device))
        .and_then(|entry| entry.downcast_ref::<DeviceEntry<M>>())
        .cloned()
}
