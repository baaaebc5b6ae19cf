//! `EngineStorage`, the persistent `MemoryManagement` over it and the amortised reclaim policy,
//! on the simulated device: the exact layering the runtime uses, without any GPU or feature.

use std::sync::Arc;

use burn_caching_alloc::alloc::{AllocError, AllocatorConfig, CachingAllocator, MIB};
use burn_caching_alloc::device::StreamId;
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::runtime::reclaim::{CREDIT_PER_RESERVE, StreamMemory};
use burn_caching_alloc::runtime::storage::{EngineStorage, Growth, persistent_manager};
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::storage::ComputeStorage;

const STREAM: StreamId = StreamId(7);

fn engine(capacity: u64) -> (SimDevice, Arc<CachingAllocator<SimDevice>>) {
    let device = SimDevice::new(capacity);
    let allocator = Arc::new(CachingAllocator::new(
        device.clone(),
        AllocatorConfig::default(),
    ));
    (device, allocator)
}

fn props() -> MemoryDeviceProperties {
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

#[test]
fn a_would_grow_miss_reclaims_instead_of_growing() {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());

    // 12 MiB gets a 12 MiB segment of its own.
    let big = memory.reserve(12 * MIB).expect("reserve");
    drop(big);
    // 11 MiB: no free slice of that size, no free engine block: the engine would grow.
    // The stream reclaims the free 12 MiB slice first, and the engine reuses its segment.
    let _smaller = memory.reserve(11 * MIB).expect("reserve");
    let counters = memory.counters();
    assert_eq!(counters.reserves, 2);
    assert_eq!(
        counters.would_grow, 2,
        "the first reservation also had to grow"
    );
    assert_eq!(counters.reclaims, 2);
    assert_eq!(device.counters().allocs, 1, "no second segment");
    assert_eq!(allocator.stats().memory_reserved(), 12 * MIB);
}

#[test]
fn loading_ten_thousand_parameters_costs_constant_reclaim_work_per_allocation() {
    let (device, allocator) = engine(1 << 50);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());

    // Every parameter is a new size over 10 MiB: each one misses both caches and would grow.
    let n = 10_000u64;
    let params: Vec<_> = (0..n)
        .map(|i| memory.reserve(10 * MIB + (i + 1) * 512).expect("reserve"))
        .collect();
    let counters = memory.counters();
    assert_eq!(counters.reserves, n);
    assert_eq!(counters.would_grow, n);
    // The budget bounds the total work of all reclaims by a constant per reservation...
    assert!(counters.reclaim_work <= CREDIT_PER_RESERVE * n);
    // ...so reclaims happen at geometrically spaced points, not at every miss.
    assert!(counters.reclaims < 64, "{counters:?}");
    assert!(counters.reclaims + counters.skipped_reclaims == n);
    assert_eq!(device.counters().allocs, n);
    drop(params);
}

#[test]
fn out_of_memory_reclaims_unconditionally_then_succeeds() {
    // Room for exactly eight 12 MiB segments.
    let (device, allocator) = engine(96 * MIB);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());

    let held: Vec<_> = (0..8)
        .map(|_| memory.reserve(12 * MIB).expect("reserve"))
        .collect();
    assert_eq!(device.bytes_in_use(), 96 * MIB);
    drop(held);

    // The ninth would-grow miss finds the budget short (8 slices to scan, 7 credits), so it
    // goes to the engine without reclaiming; the device is full of CubeCL's free slices and the
    // engine has nothing cached: it fails. The stream then reclaims unconditionally and the
    // engine frees the returned segments and retries.
    let handle = memory
        .reserve(14 * MIB)
        .expect("reserve after the out-of-memory reclaim");
    let counters = memory.counters();
    assert_eq!(counters.skipped_reclaims, 1, "{counters:?}");
    assert_eq!(counters.oom_reclaims, 1, "{counters:?}");
    assert_eq!(memory.manager().storage().blocks(), 1);
    assert_eq!(device.live_segments().len(), 1);
    assert_eq!(allocator.stats().memory_reserved(), 14 * MIB);
    drop(handle);
}

#[test]
fn a_hopeless_request_fails_with_the_engines_numbers_and_the_stream_keeps_working() {
    let (_device, allocator) = engine(96 * MIB);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    let live = memory.reserve(30 * MIB).expect("reserve");

    // 80 MiB fits the device, but not beside the live 30 MiB.
    let err = memory
        .reserve(80 * MIB)
        .expect_err("80 + 30 MiB cannot fit in 96 MiB");
    match &err.engine {
        Some(AllocError::OutOfMemory {
            requested,
            allocated,
            device_total,
            ..
        }) => {
            assert_eq!(*requested, 80 * MIB);
            assert_eq!(*allocated, 30 * MIB);
            assert_eq!(*device_total, 96 * MIB);
        }
        other => panic!("expected the engine's out-of-memory error, got {other:?}"),
    }
    assert!(err.to_string().contains("out of memory"), "{err}");

    let small = memory.reserve(4096).expect("the stream still works");
    drop(small);
    drop(live);
}
