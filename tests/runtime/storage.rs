//! `EngineStorage`, the persistent `MemoryManagement` over it and the amortised reclaim policy,
//! on the simulated device: the exact layering the runtime uses, without any GPU or feature.

use std::sync::Arc;

use burn_caching_alloc::alloc::{AllocError, AllocatorConfig, CachingAllocator, MIB, TraceEvent};
use burn_caching_alloc::device::StreamId;
use burn_caching_alloc::device::sim::SimDevice;
use burn_caching_alloc::runtime::{
    EngineStorage, Growth, ReclaimCounters, ReclaimPolicy, StreamMemory, persistent_manager,
};
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::storage::ComputeStorage;

const STREAM: StreamId = StreamId(7);

/// Slice visits a reservation adds to the reclaim budget: the library's (private)
/// `CREDIT_PER_RESERVE`.
const CREDIT_PER_RESERVE: u64 = 4;

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
    // No tensor was dropped, so growing memory is no reason to walk the slices.
    assert_eq!(counters.growth_reclaims, 0, "{counters:?}");
    assert_eq!(counters.reclaims + counters.skipped_reclaims, n);
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
    // A reclaim while every slice is live returns nothing, but marks the engine's reserved
    // memory (96 MiB): no growth since then, so no growth reclaim below.
    memory.reclaim();
    drop(held);

    // The ninth would-grow miss finds the budget short (8 slices to scan, 7 credits) and no
    // growth of reserved memory since the last reclaim, so it goes to the engine without
    // reclaiming; the device is full of CubeCL's free slices and the
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

/// The engine's recorded inputs, as (op, allocation id, size) triples.
fn recorded_inputs(allocator: &CachingAllocator<SimDevice>) -> Vec<(&'static str, u64, u64)> {
    allocator
        .trace()
        .events
        .iter()
        .filter_map(|event| match *event {
            TraceEvent::Malloc { id, size, .. } => Some(("malloc", id, size)),
            TraceEvent::FreeRequested { id } => Some(("free", id, 0)),
            _ => None,
        })
        .collect()
}

fn recording_engine() -> Arc<CachingAllocator<SimDevice>> {
    let mut config = AllocatorConfig::default();
    config.record_history = true;
    Arc::new(CachingAllocator::new(SimDevice::new(64 * MIB), config))
}

#[test]
fn amortised_policy_hides_exact_size_reuse_from_the_engine() {
    let allocator = recording_engine();
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    assert_eq!(memory.policy(), ReclaimPolicy::Amortised);

    drop(memory.reserve(1024).expect("reserve"));
    let _again = memory.reserve(1024).expect("reserve");
    // CubeCL's persistent pool served the second tensor from the first one's free slice.
    assert_eq!(recorded_inputs(&allocator), vec![("malloc", 1, 1024)]);
}

#[test]
fn every_reserve_policy_shows_the_engine_every_tensor_and_its_release() {
    let allocator = recording_engine();
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props())
        .with_policy(ReclaimPolicy::EveryReserve);

    let kept = memory.reserve(3072).expect("reserve");
    drop(memory.reserve(1024).expect("reserve"));
    let _again = memory.reserve(1024).expect("reserve");
    // The released tensor is freed to the engine at the next reservation, before it; the kept
    // one never is.
    assert_eq!(
        recorded_inputs(&allocator),
        vec![
            ("malloc", 1, 3072),
            ("malloc", 2, 1024),
            ("free", 2, 0),
            ("malloc", 3, 1024),
        ]
    );
    let counters = memory.counters();
    assert_eq!(counters.reserves, 3);
    assert_eq!(counters.reclaims, 3);
    assert_eq!(memory.manager().storage().blocks(), 2);
    drop(kept);
}

/// Loads 100 parameters (12 MiB each, distinct sizes), frees a 64 MiB tensor (after reusing
/// its slice once when `reuse`), then reserves 60 MiB. Returns (reclaim counters before and
/// after the 60 MiB reservation, device allocations before and after).
fn load_churn_then_grow(reuse: bool) -> ((ReclaimCounters, ReclaimCounters), (u64, u64)) {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    let params: Vec<_> = (0..100u64)
        .map(|i| memory.reserve(12 * MIB + (i + 1) * 512).expect("reserve"))
        .collect();
    assert_eq!(
        memory.counters().growth_reclaims,
        0,
        "nothing was dropped yet"
    );
    drop(memory.reserve(64 * MIB).expect("reserve"));
    if reuse {
        drop(
            memory
                .reserve(64 * MIB)
                .expect("CubeCL reuses the dropped slice"),
        );
    }
    let before = (memory.counters(), device.counters().allocs);
    let tensor = memory.reserve(60 * MIB).expect("reserve");
    let after = (memory.counters(), device.counters().allocs);
    drop(tensor);
    drop(params);
    ((before.0, after.0), (before.1, after.1))
}

#[test]
fn a_stream_dropping_tensors_reclaims_on_growth_even_when_the_budget_is_short() {
    // The budget is short at the 60 MiB miss either way (the load spent it); memory grew by
    // 64 MiB (over 1/32 of 1.2 GiB) since the last reclaim.
    let ((before, after), (allocs_before, allocs_after)) = load_churn_then_grow(true);
    assert_eq!(
        after.growth_reclaims,
        before.growth_reclaims + 1,
        "{after:?}"
    );
    assert_eq!(after.reclaims, before.reclaims, "{after:?}");
    assert_eq!(after.skipped_reclaims, before.skipped_reclaims);
    // The walk visited every slice: 100 parameters and the free 64 MiB one...
    assert_eq!(after.reclaim_work, before.reclaim_work + 101);
    // ...and the engine split the returned 64 MiB block instead of allocating.
    assert_eq!(allocs_after, allocs_before);

    // Without a reuse there is no sign that tensors are being dropped: the miss grows.
    let ((before, after), (allocs_before, allocs_after)) = load_churn_then_grow(false);
    assert_eq!(after.growth_reclaims, 0, "{after:?}");
    assert_eq!(after.skipped_reclaims, before.skipped_reclaims + 1);
    assert_eq!(allocs_after, allocs_before + 1);
}
