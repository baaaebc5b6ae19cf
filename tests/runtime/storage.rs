//! `EngineStorage` and the persistent `MemoryManagement` over it, on the simulated device: the
//! exact layering the runtime uses, without any GPU or feature. The reclaim policy above them
//! is tested inside the crate (`src/runtime/stream_memory/tests.rs`), where it can read which
//! rule ran each walk.

use std::sync::Arc;

use crate::MIB;
use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator};
use burn_caching_alloc::device::DeviceStream;
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::runtime::{EngineStorage, Growth, StreamMemory, persistent_manager};
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::storage::ComputeStorage;

const STREAM: DeviceStream = DeviceStream(7);

pub(crate) fn engine(capacity: u64) -> (SimDevice, Arc<CachingAllocator<SimDevice>>) {
    let device = SimDevice::new(capacity);
    let allocator =
        Arc::new(CachingAllocator::new(device.clone(), AllocatorConfig::default()).unwrap());
    (device, allocator)
}

pub(crate) fn props() -> MemoryDeviceProperties {
    MemoryDeviceProperties {
        max_page_size: 1 << 30,
        alignment: 256,
    }
}

#[test]
fn storage_alloc_is_an_engine_block_and_get_adds_offsets() {
    let (_device, allocator) = engine(64 * MIB);
    let mut storage = EngineStorage::new(allocator.clone(), STREAM, 256);

    let first = storage.alloc(1000).expect("alloc");
    let second = storage.alloc(3000).expect("alloc");
    let stats = allocator.stats();
    // 1000 -> 1024 and 3000 -> 3072 bytes: two blocks of one 2 MiB small segment.
    assert_eq!(stats.allocation.all.current, 2);
    assert_eq!(stats.allocated_bytes.all.current, 1024 + 3072);
    assert_eq!(stats.segment.all.current, 1);
    assert_eq!(storage.blocks(), 2);
    assert_eq!(storage.held_bytes(), 4000);

    let a = storage.get(&first);
    let b = storage.get(&second);
    assert_eq!(a.segment, b.segment, "both blocks live in the same segment");
    assert_eq!((a.offset, a.size), (0, 1000));
    assert_eq!((b.offset, b.size), (1024, 3000));

    // A handle's own offsets are added to the block's.
    let inner = storage.get(&second.offset_start(512).offset_end(488));
    assert_eq!((inner.offset, inner.size), (1024 + 512, 2000));

    storage.dealloc(first.id);
    storage.dealloc(second.id);
    let stats = allocator.stats();
    assert_eq!(stats.allocation.all.current, 0);
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(storage.blocks(), 0);
    assert_eq!(storage.held_bytes(), 0);
}

#[test]
fn cache_only_storage_refuses_growth_and_says_so() {
    let (device, allocator) = engine(64 * MIB);
    let mut storage = EngineStorage::new(allocator.clone(), STREAM, 256);
    storage.set_growth(Growth::CacheOnly);
    assert!(storage.alloc(4096).is_err());
    assert!(storage.take_refused(), "the refusal is remembered");
    assert!(!storage.take_refused(), "and cleared once taken");
    assert_eq!(device.counters().allocs, 0, "no segment was allocated");

    // Once a segment exists, a cached block serves without growth.
    storage.set_growth(Growth::Allowed);
    let held = storage.alloc(4096).expect("alloc");
    storage.set_growth(Growth::CacheOnly);
    let cached = storage
        .alloc(4096)
        .expect("served from the segment's free block");
    assert!(!storage.take_refused());
    assert_eq!(device.counters().allocs, 1);
    storage.dealloc(held.id);
    storage.dealloc(cached.id);
}

#[test]
fn pool_only_storage_refuses_even_what_the_engine_cache_holds() {
    // The reclaim policy asks CubeCL's pool alone first (issue 22): the storage must not touch
    // the engine then, not even its cache.
    let (device, allocator) = engine(64 * MIB);
    let mut storage = EngineStorage::new(allocator.clone(), STREAM, 256);
    let held = storage.alloc(4096).expect("alloc");
    storage.set_growth(Growth::PoolOnly);
    assert!(
        storage.alloc(4096).is_err(),
        "the segment has room, yet no engine call"
    );
    assert!(storage.take_refused(), "the refusal is remembered");
    assert_eq!(storage.blocks(), 1);
    assert_eq!(allocator.stats().allocation.all.current, 1);
    assert_eq!(device.counters().allocs, 1);
    storage.set_growth(Growth::Allowed);
    storage.dealloc(held.id);
}

#[test]
fn zero_sized_slices_take_a_block() {
    let (_device, allocator) = engine(64 * MIB);
    let mut storage = EngineStorage::new(allocator.clone(), STREAM, 256);
    let empty = storage.alloc(0).expect("alloc");
    assert_eq!(storage.get(&empty).size, 0);
    assert_eq!(allocator.stats().allocated_bytes.all.current, 512);
    storage.dealloc(empty.id);
}

#[test]
fn persistent_manager_reuses_same_size_slices_without_the_engine() {
    let (device, allocator) = engine(64 * MIB);
    let mut manager = persistent_manager(allocator.clone(), STREAM, &props());

    let handle = manager.reserve(1000).expect("reserve");
    drop(handle);
    let again = manager.reserve(1000).expect("reserve");
    // CubeCL's persistent pool served the second request from the freed slice.
    assert_eq!(manager.storage().blocks(), 1);
    assert_eq!(allocator.stats().allocation.all.current, 1);
    assert_eq!(manager.memory_usage().bytes_in_use, 1000);

    // cleanup(true) hands free slices back; live ones stay and keep resolving.
    let other = manager.reserve(5000).expect("reserve");
    drop(other);
    manager.cleanup(true);
    assert_eq!(manager.storage().blocks(), 1);
    assert_eq!(allocator.stats().allocation.all.current, 1);
    let resource = manager
        .get_resource(again.binding(), None, None)
        .expect("live slice resolves");
    assert_eq!(resource.size, 1000);
    assert_eq!(device.counters().allocs, 1);
}

/// A handle CubeCL's memory management never bound (a reservation that failed) resolves to
/// the stream's guard slice, which is no tensor's, holds no memory and survives every walk:
/// `bound_slice` says it has no slice, whatever the stream holds (CubeCL alone resolves it,
/// unchecked, to the stream's first slice).
#[test]
fn an_unbound_handle_resolves_to_no_tensors_slice() {
    let (device, allocator) = engine(64 * MIB);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    assert_eq!(device.counters().allocs, 0, "the guard holds no memory");
    assert_eq!(memory.usage().number_allocs, 0, "the guard is no tensor");
    assert_eq!(memory.manager().storage().blocks(), 0);

    let first = memory.reserve(1000).expect("reserve");
    // An empty tensor's reservation is a block of its own, never the guard.
    let empty = memory.reserve(0).expect("an empty tensor");
    let unbound = ManagedMemoryHandle::new();
    assert!(
        memory
            .bound_slice(&unbound.clone().binding())
            .expect("CubeCL finds a slice")
            .is_none()
    );
    assert!(!memory.is_bound(&unbound));
    assert!(memory.is_bound(&first));
    assert!(memory.is_bound(&empty));
    assert_eq!(memory.usage().number_allocs, 2);

    drop((first, empty));
    memory.reclaim();
    assert_eq!(memory.usage().number_allocs, 0);
    assert_eq!(allocator.stats().allocated_bytes.all.current, 0);
    let next = memory.reserve(1000).expect("reserve");
    assert!(memory.is_bound(&next));
    assert!(!memory.is_bound(&unbound), "the guard outlived the walk");
}

/// Issue 33: `held_bytes` counted an empty tensor's block as 0 bytes on `alloc` and 1 byte on
/// `dealloc` (its block's requested size), which `saturating_sub` hid.
#[test]
fn held_bytes_stay_exact_across_empty_tensors() {
    let (_device, allocator) = engine(64 * MIB);
    let mut storage = EngineStorage::new(allocator, STREAM, 256);
    let full = storage.alloc(3000).expect("alloc");
    let empty = storage.alloc(0).expect("alloc");
    assert_eq!(storage.held_bytes(), 3000);
    storage.dealloc(empty.id);
    assert_eq!(storage.held_bytes(), 3000, "an empty tensor held 0 bytes");
    storage.dealloc(full.id);
    assert_eq!(storage.held_bytes(), 0);
}
