//! One engine per device for the whole process, so that a user reads statistics, snapshots and
//! `empty_cache` from the engine whatever integration made the memory.
//!
//! An integration registers the engine it made for a device under a [`DeviceKey`] (a backend
//! name and an ordinal: `("cuda", 0)`, `("wgpu", 1)`); [`get_or_init`] gives every caller of
//! the process the same engine for that key, typed, and [`engine`] gives a reader its
//! statistics and snapshots without knowing the device type. An engine stays registered for
//! while its integration holds it: the registry keeps a weak reference, so an integration that
//! drops its engine (a server torn down) takes the engine's cached memory with it, and the next
//! [`get_or_init`] for that key makes a new one.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::alloc::inspect::InspectError;
use crate::alloc::{AllocError, CachingAllocator, MemoryStats, Snapshot};
use crate::device::DeviceMemory;

/// A device as the registry names it: the backend's name and the device's ordinal in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceKey {
    /// The backend: `"cuda"`, `"wgpu"`, or an integration's own name.
    pub backend: &'static str,
    /// The device's ordinal within the backend.
    pub index: u32,
}

impl DeviceKey {
    /// The device `index` of `backend`.
    pub const fn new(backend: &'static str, index: u32) -> Self {
        Self { backend, index }
    }
}

impl fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.backend, self.index)
    }
}

/// What a reader does with a registered engine without knowing its device type.
pub trait RegisteredEngine: Send + Sync {
    /// The statistics, as [`CachingAllocator::stats`].
    fn stats(&self) -> MemoryStats;
    /// The segments and blocks, as [`CachingAllocator::snapshot`].
    fn snapshot(&self) -> Snapshot;
    /// The statistics as a table, as [`CachingAllocator::summary`].
    fn summary(&self) -> String;
    /// Returns every cached segment without a live block, as [`CachingAllocator::empty_cache`];
    /// the bytes returned.
    fn empty_cache(&self) -> Result<u64, AllocError>;
    /// Sets every peak to its current value, as [`CachingAllocator::reset_peak_memory_stats`].
    fn reset_peak_memory_stats(&self);
    /// Writes a PyTorch-format snapshot pickle, as [`CachingAllocator::dump_snapshot`].
    fn dump_snapshot(&self, path: &Path) -> Result<(), InspectError>;
    /// The engine itself, for [`get_or_init`]'s typed access.
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

impl<D: DeviceMemory + 'static> RegisteredEngine for CachingAllocator<D> {
    fn stats(&self) -> MemoryStats {
        CachingAllocator::stats(self)
    }
    fn snapshot(&self) -> Snapshot {
        CachingAllocator::snapshot(self)
    }
    fn summary(&self) -> String {
        CachingAllocator::summary(self)
    }
    fn empty_cache(&self) -> Result<u64, AllocError> {
        CachingAllocator::empty_cache(self)
    }
    fn reset_peak_memory_stats(&self) {
        CachingAllocator::reset_peak_memory_stats(self)
    }
    fn dump_snapshot(&self, path: &Path) -> Result<(), InspectError> {
        CachingAllocator::dump_snapshot(self, path)
    }
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// Why the registry could not give an engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The key is registered with an engine over another device type.
    #[error("device {key} has an engine over another device type than {requested}")]
    OtherDeviceType {
        /// The device asked for.
        key: DeviceKey,
        /// The device type asked for.
        requested: &'static str,
    },
    /// Making the engine failed (its configuration, its device).
    #[error("making the engine for device {key} failed: {reason}")]
    Init {
        /// The device asked for.
        key: DeviceKey,
        /// Why.
        reason: String,
    },
}

static ENGINES: Mutex<BTreeMap<DeviceKey, Weak<dyn RegisteredEngine>>> =
    Mutex::new(BTreeMap::new());

/// The engine registered for `key`, made with `init` (and registered) if there is none. Every
/// caller of the process gets the same engine for a key while one holds it; `init` runs under
/// the registry's lock (it must not call the registry).
pub fn get_or_init<D, E>(
    key: DeviceKey,
    init: impl FnOnce() -> Result<CachingAllocator<D>, E>,
) -> Result<Arc<CachingAllocator<D>>, RegistryError>
where
    D: DeviceMemory + 'static,
    E: fmt::Display,
{
    let mut engines = ENGINES.lock();
    if let Some(found) = engines.get(&key).and_then(Weak::upgrade) {
        return found
            .as_any()
            .downcast::<CachingAllocator<D>>()
            .map_err(|_| RegistryError::OtherDeviceType {
                key,
                requested: std::any::type_name::<D>(),
            });
    }
    let engine = Arc::new(init().map_err(|err| RegistryError::Init {
        key,
        reason: err.to_string(),
    })?);
    let weak: Weak<dyn RegisteredEngine> = Arc::downgrade(&engine) as Weak<dyn RegisteredEngine>;
    engines.insert(key, weak);
    Ok(engine)
}

/// Registers `engine` for `key` (replacing any other), weakly: the caller keeps it alive. The
/// engine the registry held, if it still lives.
pub fn register<D: DeviceMemory + 'static>(
    key: DeviceKey,
    engine: &Arc<CachingAllocator<D>>,
) -> Option<Arc<dyn RegisteredEngine>> {
    let weak: Weak<dyn RegisteredEngine> = Arc::downgrade(engine) as Weak<dyn RegisteredEngine>;
    ENGINES
        .lock()
        .insert(key, weak)
        .and_then(|old| old.upgrade())
}

/// The engine registered for `key`, whatever its device type, while its integration holds it.
pub fn engine(key: DeviceKey) -> Option<Arc<dyn RegisteredEngine>> {
    ENGINES.lock().get(&key).and_then(Weak::upgrade)
}

/// Every device with a live engine, in order.
pub fn devices() -> Vec<DeviceKey> {
    let mut engines = ENGINES.lock();
    engines.retain(|_, engine| engine.strong_count() > 0);
    engines.keys().copied().collect()
}

/// Forgets `key`; its engine, if it still lives.
pub fn unregister(key: DeviceKey) -> Option<Arc<dyn RegisteredEngine>> {
    ENGINES.lock().remove(&key).and_then(|old| old.upgrade())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::AllocatorConfig;
    use crate::device::DeviceStream;
    use crate::device::sim::SimDevice;

    fn sim() -> Result<CachingAllocator<SimDevice>, crate::alloc::ConfigError> {
        CachingAllocator::new(SimDevice::new(1 << 30), AllocatorConfig::default())
    }

    #[test]
    fn one_engine_per_key_typed_for_its_makers_and_untyped_for_readers() {
        let key = DeviceKey::new("registry-test", 0);
        let first = get_or_init(key, sim).unwrap();
        let second = get_or_init(key, || -> Result<_, String> { panic!("made twice") }).unwrap();
        assert!(Arc::ptr_eq(&first, &second));

        let block = first.malloc(4 << 20, DeviceStream(7)).unwrap();
        let reader = engine(key).expect("registered");
        assert_eq!(reader.stats().memory_allocated(), 4 << 20);
        assert_eq!(reader.snapshot().segments.len(), 1);
        first.free(block).unwrap();
        assert!(reader.empty_cache().unwrap() > 0);
        assert_eq!(reader.stats().memory_reserved(), 0);
        assert!(devices().contains(&key));
        drop((first, second, reader));
        assert!(engine(key).is_none(), "the registry keeps no engine alive");
        assert!(!devices().contains(&key));
        let again = get_or_init(key, sim).unwrap();
        assert_eq!(
            again.stats().memory_reserved(),
            0,
            "a new engine after the last one dropped"
        );
        assert!(unregister(key).is_some());
        assert!(engine(key).is_none());
    }

    #[test]
    fn a_key_of_another_device_type_is_an_error_not_a_panic() {
        let key = DeviceKey::new("registry-test", 1);
        let _held = get_or_init(key, sim).unwrap();
        let other = get_or_init(key, || {
            CachingAllocator::new(
                crate::device::metered::Metered::new(SimDevice::new(1 << 30)),
                AllocatorConfig::default(),
            )
        });
        assert!(matches!(other, Err(RegistryError::OtherDeviceType { .. })));
        let failing = get_or_init(DeviceKey::new("registry-test", 2), || {
            Err::<CachingAllocator<SimDevice>, _>("no device")
        });
        assert!(matches!(failing, Err(RegistryError::Init { .. })));
        unregister(key);
    }
}
