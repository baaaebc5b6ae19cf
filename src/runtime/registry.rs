//! Where the user API finds the allocator a server uses: one entry per opened device, and the
//! configurations given in code for devices not opened yet.
//!
//! A server registers its engine when CubeCL opens the device; `memory_stats(&device)` and the
//! other user calls look it up by device id and memory type. The entry also carries the
//! per-layer numbers the server computed at its last `memory_usage` call, and the driver's
//! pinned host pool where it has one. The registry holds
//! the entry weakly: the server owns its engine, so a server that is dropped takes its engine
//! (and the device memory it cached) with it instead of leaving it here for the process's life.
//!
//! `backend::configure` leaves a configuration here for a device that is not open; the server
//! takes it when CubeCL opens the device ([`take_config`]). Both happen under one lock, so a
//! configuration is either taken by the opening server or refused as too late, never lost.

use std::any::{Any, TypeId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock, Weak};

use cubecl_common::device::DeviceId;
use parking_lot::Mutex;

use super::pinned_host::PinnedHostPool;
use super::server::CubeclLayerUsage;
use crate::alloc::{AllocatorConfig, CachingAllocator};
use crate::device::DeviceMemory;

/// What the registry keeps for one device.
pub(crate) struct DeviceEntry<M: DeviceMemory> {
    /// The engine the device's server allocates through.
    pub(crate) allocator: Arc<CachingAllocator<M>>,
    /// CubeCL-layer numbers, refreshed by the server on every `memory_usage`.
    pub(crate) cubecl: Arc<Mutex<CubeclLayerUsage>>,
    /// The driver's pinned host pool, if it has one (CUDA).
    pub(crate) host: Option<Arc<dyn PinnedHostPool>>,
}

impl<M: DeviceMemory> Clone for DeviceEntry<M> {
    fn clone(&self) -> Self {
        Self {
            allocator: self.allocator.clone(),
            cubecl: self.cubecl.clone(),
            host: self.host.clone(),
        }
    }
}

/// What the registry stores: the entry without keeping it alive.
struct WeakEntry<M: DeviceMemory> {
    allocator: Weak<CachingAllocator<M>>,
    cubecl: Weak<Mutex<CubeclLayerUsage>>,
    host: Option<Weak<dyn PinnedHostPool>>,
}

type Key = (TypeId, DeviceId);

#[derive(Default)]
struct Registry {
    entries: HashMap<Key, Box<dyn Any + Send + Sync>>,
    /// Devices a server started to open (configurations for them come too late).
    opened: HashSet<Key>,
    /// Configurations given in code, waiting for their device to open.
    pending: HashMap<Key, AllocatorConfig>,
    /// Devices whose server could not open, with the reason (returned again on every try).
    failed: HashMap<Key, super::error::DriverError>,
    /// Devices whose server CubeCL's device thread holds (opened through `open::ensure_open`).
    serving: HashSet<Key>,
}

/// Where a device stands (see [`open_state`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum OpenState {
    /// No server started to open it.
    NotOpened,
    /// Its server is on CubeCL's device thread, ready.
    Opened,
    /// A server tried and could not, for this reason.
    Failed(super::error::DriverError),
}

fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn key<M: DeviceMemory>(device: DeviceId) -> Key {
    (TypeId::of::<M>(), device)
}

/// Records the entry of `device` (a server calls this when it opens the device).
pub(crate) fn register<M: DeviceMemory>(device: DeviceId, entry: DeviceEntry<M>) {
    let mut registry = registry().lock();
    registry.opened.insert(key::<M>(device));
    let weak = WeakEntry {
        allocator: Arc::downgrade(&entry.allocator),
        cubecl: Arc::downgrade(&entry.cubecl),
        host: entry.host.as_ref().map(Arc::downgrade),
    };
    registry.entries.insert(key::<M>(device), Box::new(weak));
}

/// The entry of `device`, if a server with memory type `M` opened it and is still alive.
pub(crate) fn lookup<M: DeviceMemory>(device: DeviceId) -> Option<DeviceEntry<M>> {
    let registry = registry().lock();
    let entry = registry
        .entries
        .get(&key::<M>(device))?
        .downcast_ref::<WeakEntry<M>>()?;
    Some(DeviceEntry {
        allocator: entry.allocator.upgrade()?,
        cubecl: entry.cubecl.upgrade()?,
        host: match &entry.host {
            Some(host) => Some(host.upgrade()?),
            None => None,
        },
    })
}

/// Whether a server with memory type `M` serves `device`, failed to open, or is not ready
/// (never tried, or still opening).
pub(crate) fn open_state<M: DeviceMemory>(device: DeviceId) -> OpenState {
    let registry = registry().lock();
    let key = key::<M>(device);
    if let Some(err) = registry.failed.get(&key) {
        OpenState::Failed(err.clone())
    } else if registry.serving.contains(&key) {
        OpenState::Opened
    } else {
        OpenState::NotOpened
    }
}

/// Records that CubeCL's device thread holds the server of `device`: [`open_state`] says
/// `Opened` from now on.
pub(crate) fn mark_serving<M: DeviceMemory>(device: DeviceId) {
    registry().lock().serving.insert(key::<M>(device));
}

/// Records why `device` could not open: [`open_state`] returns it from now on.
pub(crate) fn record_failure<M: DeviceMemory>(device: DeviceId, err: super::error::DriverError) {
    registry().lock().failed.insert(key::<M>(device), err);
}

/// Leaves `config` for `device`, to be taken when it opens; `false` (and nothing left) when a
/// server with memory type `M` already opened it or is opening it. A second call before the
/// device opens replaces the first configuration.
pub(crate) fn configure<M: DeviceMemory>(device: DeviceId, config: AllocatorConfig) -> bool {
    let mut registry = registry().lock();
    if registry.opened.contains(&key::<M>(device)) {
        return false;
    }
    registry.pending.insert(key::<M>(device), config);
    true
}

/// Marks `device` as opening and takes the configuration left for it, if any (the server
/// calls this first thing when CubeCL opens the device).
pub(crate) fn take_config<M: DeviceMemory>(device: DeviceId) -> Option<AllocatorConfig> {
    let mut registry = registry().lock();
    registry.opened.insert(key::<M>(device));
    registry.pending.remove(&key::<M>(device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDevice;

    fn device(index: u16) -> DeviceId {
        // A device type no other test of this binary uses.
        DeviceId::new(900, index)
    }

    #[test]
    fn a_configuration_waits_for_its_device_and_is_taken_once() {
        let first = AllocatorConfig::parse("max_split_size_mb:64").unwrap();
        let second = AllocatorConfig::parse("max_split_size_mb:128").unwrap();
        assert!(configure::<SimDevice>(device(0), first));
        // Replaced before the device opens; another device keeps its own.
        assert!(configure::<SimDevice>(device(0), second.clone()));
        assert!(configure::<SimDevice>(
            device(1),
            AllocatorConfig::default()
        ));
        assert_eq!(take_config::<SimDevice>(device(0)), Some(second));
        // Opening: too late for another configuration, and nothing left to take.
        assert!(!configure::<SimDevice>(
            device(0),
            AllocatorConfig::default()
        ));
        assert_eq!(take_config::<SimDevice>(device(0)), None);
        assert_eq!(
            take_config::<SimDevice>(device(1)),
            Some(AllocatorConfig::default())
        );
    }

    #[test]
    fn an_unconfigured_device_opens_with_nothing_taken_and_then_refuses() {
        assert_eq!(take_config::<SimDevice>(device(2)), None);
        assert!(!configure::<SimDevice>(
            device(2),
            AllocatorConfig::default()
        ));
    }
}
