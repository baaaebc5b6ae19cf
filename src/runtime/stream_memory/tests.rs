//! The reclaim policy on the simulated device: a stream's CubeCL pool over the engine
//! (`StreamMemory`, the exact layering the runtime uses, without any GPU or feature), and for
//! each rule of the policy the walk it runs or skips, read from the stream's
//! [`PolicyCounters`] (which rule ran each walk: not public, a user reads the totals).

use std::sync::Arc;

use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::memory_management::ManagedMemoryHandle;

use super::{
    CREDIT_PER_RESERVE, NEW_SIZE_CREDIT, PRODUCTIVE_SHARE, PolicyCounters, ReclaimPolicy,
    StreamMemory,
};
use crate::alloc::{AllocError, AllocatorConfig, CachingAllocator, HistoryOptions, TraceEvent};
use crate::device::DeviceStream;
use crate::device::sim::SimDevice;

const MIB: u64 = 1 << 20;

const STREAM: DeviceStream = DeviceStream(7);

/// A simulated device of `capacity` bytes and an engine with the default configuration on it.
fn engine(capacity: u64) -> (SimDevice, Arc<CachingAllocator<SimDevice>>) {
    let device = SimDevice::new(capacity);
    let config = AllocatorConfig::default();
    (
        device.clone(),
        Arc::new(CachingAllocator::new(device, config).unwrap()),
    )
}

/// CubeCL's memory properties as CUDA reports them: 256-byte alignment.
fn props() -> MemoryDeviceProperties {
    MemoryDeviceProperties {
        max_page_size: 1 << 30,
        alignment: 256,
    }
}

#[test]
fn a_would_grow_miss_reclaims_instead_of_growing() {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());

    // Four 512 KiB slices fill one 2 MiB small segment (the first one had to grow).
    let mut held: Vec<_> = (0..4)
        .map(|_| memory.reserve(512 * 1024).expect("reserve"))
        .collect();
    assert_eq!(device.counters().allocs, 1);
    held.pop();
    // 256 KiB: no free slice of that size, no free engine block (the dropped slice is still
    // CubeCL's): the engine would grow. The stream reclaims the free slice first and the
    // engine splits it instead of allocating a second segment.
    let _smaller = memory.reserve(256 * 1024).expect("reserve");
    let counters = memory.policy_counters();
    assert_eq!(counters.totals.reserves, 5);
    assert_eq!(counters.would_grow, 2, "{counters:?}");
    assert_eq!(counters.budget_reclaims, 2, "{counters:?}");
    assert_eq!(
        counters.placement_reclaims, 0,
        "small requests never place-reclaim"
    );
    assert_eq!(device.counters().allocs, 1, "no second segment");
    assert_eq!(allocator.stats().memory_reserved(), 2 * MIB);
}

#[test]
fn a_new_large_size_reclaims_before_the_engine_places_it() {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());

    // 12 MiB gets a 12 MiB segment of its own; 4 MiB is cut from a 20 MiB segment. The
    // 12 MiB tensor is dropped, CubeCL's pool serves the next 12 MiB tensor from its slice (a
    // sign that tensors are being dropped), and that one is dropped too.
    let big = memory.reserve(12 * MIB).expect("reserve");
    let small = memory.reserve(4 * MIB).expect("reserve");
    drop(big);
    drop(memory.reserve(12 * MIB).expect("CubeCL reuse"));
    // 11 MiB: no slice of that size, so CubeCL's pool cannot serve it, and the engine's cache
    // could serve it from the 20 MiB segment's free 16 MiB. The stream first hands the free
    // 12 MiB slice back, so best fit picks the 12 MiB block, as the engine alone would.
    let eleven = memory.reserve(11 * MIB).expect("reserve");
    let counters = memory.policy_counters();
    // 12 MiB and 4 MiB do not walk before placement (nothing was dropped yet), 11 MiB does.
    assert_eq!(counters.placement_reclaims, 1, "{counters:?}");
    assert_eq!(counters.totals.pool_hits, 1, "{counters:?}");
    assert_eq!(counters.would_grow, 2, "{counters:?}");
    assert_eq!(device.counters().allocs, 2, "no third segment");
    let resolved = memory.manager().storage().blocks();
    assert_eq!(resolved, 2);
    let snapshot = allocator.snapshot();
    let twelve = snapshot
        .segments
        .iter()
        .find(|s| s.total_size == 12 * MIB)
        .expect("the 12 MiB segment is still there");
    // 11 MiB rounds to 12 MiB's block whole (a large block is split only for a remainder
    // over 1 MiB), and the 20 MiB segment keeps its free 16 MiB for the next large tensor.
    assert_eq!(twelve.allocated_size, 12 * MIB, "{snapshot:?}");
    assert_eq!(allocator.stats().allocated_bytes.all.current, 16 * MIB);

    // The same size again, freed: CubeCL's pool serves it, with no walk (a seen size).
    drop(eleven);
    let again = memory.reserve(11 * MIB).expect("reserve");
    let after = memory.policy_counters();
    assert_eq!(after.totals.pool_hits, 2);
    assert_eq!(after.placement_reclaims, counters.placement_reclaims);
    assert_eq!(after.totals.reclaim_work, counters.totals.reclaim_work);
    drop((again, small));
}

#[test]
fn a_new_large_size_with_an_exact_cached_fit_goes_there_without_a_walk() {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());

    // A 16 MiB and a 12 MiB tensor, each in a segment of its own. The 16 MiB one is dropped
    // and a walk hands its slice back: the engine caches a free 16 MiB block, and the walk
    // released a slice (tensors are being dropped). Then the 12 MiB tensor is dropped:
    // CubeCL keeps its free slice.
    let sixteen = memory.reserve(16 * MIB).expect("reserve");
    let twelve = memory.reserve(12 * MIB).expect("reserve");
    drop(sixteen);
    memory.reclaim();
    drop(twelve);
    assert_eq!(memory.manager().storage().blocks(), 1);
    let before = memory.policy_counters();

    // 16 MiB less 256 B: a size this stream never reserved (CubeCL's key is the size padded
    // to 256 B), so a placement candidate, and the budget would pay for a walk. But it rounds
    // to 16 MiB in the engine, which caches a block of exactly that size: best fit takes it
    // whatever a walk would hand back, so there is no walk, and CubeCL keeps its free 12 MiB
    // slice for the next 12 MiB tensor.
    let almost = memory.reserve(16 * MIB - 256).expect("reserve");
    let after = memory.policy_counters();
    assert_eq!(
        after.placement_reclaims, before.placement_reclaims,
        "{after:?}"
    );
    assert_eq!(
        after.totals.reclaim_work, before.totals.reclaim_work,
        "{after:?}"
    );
    assert_eq!(memory.manager().storage().blocks(), 2);
    assert_eq!(
        device.counters().allocs,
        2,
        "the cached 16 MiB block served it"
    );

    // 11 MiB has no exact fit (the engine caches nothing now): the stream walks first, and
    // best fit takes the 12 MiB block the walk handed back instead of a new segment.
    let eleven = memory.reserve(11 * MIB).expect("reserve");
    let last = memory.policy_counters();
    assert_eq!(
        last.placement_reclaims,
        after.placement_reclaims + 1,
        "{last:?}"
    );
    assert_eq!(memory.manager().storage().blocks(), 2);
    assert_eq!(device.counters().allocs, 2, "no third segment");
    drop((almost, eleven));
}

#[test]
fn a_fixed_shape_loop_keeps_cubecls_reuse_and_never_walks() {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    let sizes = [3 * MIB, 24 * MIB, 512 * 1024, 7 * MIB];
    let step = |memory: &mut StreamMemory<SimDevice>| {
        let tensors: Vec<_> = sizes
            .iter()
            .map(|&size| memory.reserve(size).expect("reserve"))
            .collect();
        drop(tensors);
    };
    step(&mut memory);
    let first = (memory.policy_counters(), device.counters().allocs);
    for _ in 0..100 {
        step(&mut memory);
    }
    let counters = memory.policy_counters();
    // After the first step every reservation is CubeCL's exact-size reuse: no walk, no
    // engine call, no device call.
    assert_eq!(
        counters.totals.pool_hits,
        first.0.totals.pool_hits + 400,
        "{counters:?}"
    );
    assert_eq!(counters.totals.reclaim_work, first.0.totals.reclaim_work);
    assert_eq!(device.counters().allocs, first.1);
    assert_eq!(allocator.stats().num_device_alloc, first.1);
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
    let counters = memory.policy_counters();
    assert_eq!(counters.totals.reserves, n);
    assert_eq!(counters.would_grow, n);
    // The budget bounds the total work of all reclaims by a constant per reservation...
    // ...so reclaims happen at geometrically spaced points, not at every miss: nothing is
    // dropped, so no placement credit is earned and no placement walk runs.
    assert!(
        counters.totals.reclaim_work <= CREDIT_PER_RESERVE * n + NEW_SIZE_CREDIT,
        "{counters:?}"
    );
    assert_eq!(counters.placement_reclaims, 0, "{counters:?}");
    assert!(counters.budget_reclaims < 64, "{counters:?}");
    // No tensor was dropped: no walk released anything, so none was walked for that reason.
    assert_eq!(counters.growth_reclaims, 0, "{counters:?}");
    assert_eq!(counters.productive_reclaims, 0, "{counters:?}");
    assert_eq!(counters.budget_reclaims + counters.skipped_reclaims, n);
    assert_eq!(device.counters().allocs, n);
    drop(params);
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
    config.history = HistoryOptions::trace(1 << 20);
    Arc::new(CachingAllocator::new(SimDevice::new(64 * MIB), config).unwrap())
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
    let counters = memory.policy_counters();
    assert_eq!(counters.totals.reserves, 3);
    assert_eq!(counters.budget_reclaims, 3);
    assert_eq!(memory.manager().storage().blocks(), 2);
    drop(kept);
}

/// Loads 100 parameters (12 MiB each, distinct sizes), frees a 64 MiB tensor (after reusing
/// its slice once when `reuse`), then reserves 60 MiB. Returns (reclaim counters before and
/// after the 60 MiB reservation, device allocations before and after).
fn load_churn_then_grow(reuse: bool) -> ((PolicyCounters, PolicyCounters), (u64, u64)) {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    let params: Vec<_> = (0..100u64)
        .map(|i| memory.reserve(12 * MIB + (i + 1) * 512).expect("reserve"))
        .collect();
    assert_eq!(
        memory.policy_counters().growth_reclaims,
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
    let before = (memory.policy_counters(), device.counters().allocs);
    let tensor = memory.reserve(60 * MIB).expect("reserve");
    let after = (memory.policy_counters(), device.counters().allocs);
    drop(tensor);
    drop(params);
    ((before.0, after.0), (before.1, after.1))
}

#[test]
fn a_stream_dropping_tensors_reclaims_on_growth_even_when_the_budget_is_short() {
    // The 64 MiB slice was reused once, so tensors are being dropped: 60 MiB, a size the
    // stream never reserved, is a placement candidate, but the load spent the budget (101
    // slices to visit). The would-grow miss then walks anyway: CubeCL reused a slice and
    // memory grew by 64 MiB (over 1/32 of 1.2 GiB) since the last walk. It visits every slice
    // (100 parameters and the free 64 MiB one)...
    let ((before, after), (allocs_before, allocs_after)) = load_churn_then_grow(true);
    assert_eq!(
        after.placement_reclaims, before.placement_reclaims,
        "{after:?}"
    );
    assert_eq!(
        after.growth_reclaims,
        before.growth_reclaims + 1,
        "{after:?}"
    );
    assert_eq!(after.budget_reclaims, before.budget_reclaims, "{after:?}");
    assert_eq!(
        after.totals.reclaim_work,
        before.totals.reclaim_work + 101,
        "{after:?}"
    );
    // ...and the engine splits the returned 64 MiB block instead of allocating.
    assert_eq!(allocs_after, allocs_before, "{after:?}");

    // Without a reuse, and with every walk so far releasing nothing, there is no sign that
    // tensors are being dropped: the 60 MiB miss grows without a walk.
    let ((before, after), (allocs_before, allocs_after)) = load_churn_then_grow(false);
    assert_eq!(
        after.placement_reclaims, before.placement_reclaims,
        "{after:?}"
    );
    assert_eq!(
        after.skipped_reclaims,
        before.skipped_reclaims + 1,
        "{after:?}"
    );
    assert_eq!(allocs_after, allocs_before + 1);
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
    // A reclaim while every slice is live returns nothing, and marks the engine's reserved
    // memory: no growth since then, so no growth reclaim below.
    memory.reclaim();
    drop(held);

    // 14 MiB is a new large size, but nothing shows that tensors were dropped (the last walk
    // released nothing, CubeCL reused nothing): no placement walk. The would-grow miss finds
    // the budget short (8 slices to scan; 6 credits: the eight 12 MiB reservations earned 16
    // and their walks of 1, 1, 2, 3 and 5 slices spent 12, and this one earns 2) and no sign
    // either, so it goes to the engine without reclaiming; the device is full of CubeCL's
    // free slices and the engine has nothing cached: it fails. The stream then reclaims
    // unconditionally and retries: the eight 12 MiB segments are wholly free in the engine
    // now, each smaller than the request, so `release_outgrown` returns two (24 MiB, enough
    // for the new 14 MiB segment) and keeps six cached, with no cache flush.
    let before = memory.policy_counters();
    assert_eq!(before.budget_reclaims, 5, "{before:?}");
    let handle = memory
        .reserve(14 * MIB)
        .expect("reserve after the out-of-memory reclaim");
    let counters = memory.policy_counters();
    assert_eq!(counters.placement_reclaims, 0, "{counters:?}");
    assert_eq!(
        counters.budget_reclaims, before.budget_reclaims,
        "{counters:?}"
    );
    assert_eq!(
        counters.skipped_reclaims,
        before.skipped_reclaims + 1,
        "{counters:?}"
    );
    assert_eq!(counters.oom_reclaims, 1, "{counters:?}");
    assert_eq!(memory.manager().storage().blocks(), 1);
    assert_eq!(device.live_segments().len(), 7);
    let stats = allocator.stats();
    assert_eq!(stats.memory_reserved(), 6 * 12 * MIB + 14 * MIB);
    assert_eq!(stats.num_device_free, 2);
    assert_eq!(stats.num_alloc_retries, 0, "no cache flush");
    drop(handle);
}

/// Issue 33: `StreamMemory::reserve(u64::MAX)` returned Ok with a 512-byte block in a release
/// build and panicked in a debug one (CubeCL's pool pads the size and wraps). It is the
/// engine's `TooLarge` now, counted once as an out-of-memory, and the stream keeps serving.
#[test]
fn a_size_near_u64_max_is_too_large_not_a_tiny_block() {
    let (_device, allocator) = engine(64 * MIB);
    let mut memory = StreamMemory::new(allocator.clone(), STREAM, &props());
    for size in [u64::MAX, u64::MAX - 255, u64::MAX - 511] {
        let err = memory
            .reserve(size)
            .expect_err("no device holds 2^64 bytes");
        assert!(
            matches!(err.engine, Some(AllocError::TooLarge { requested, .. }) if requested == size),
            "{err}"
        );
        // `ReserveError` is a `std::error::Error` whose source is the engine's error.
        let source = std::error::Error::source(&err).expect("a source");
        assert_eq!(source.to_string(), err.to_string());
    }
    let stats = allocator.stats();
    assert_eq!(stats.num_ooms, 3);
    assert_eq!(stats.allocation.all.current, 0);
    assert_eq!(stats.reserved_bytes.all.current, 0);
    let handle = memory.reserve(4096).expect("the stream still serves");
    drop(handle);
}

/// Loads 300 parameters (2 MiB + 512 B x i each; the later ones share 20 MiB segments), then
/// keeps reserving tensors of new sizes over 10 MiB until the budget has paid for a walk and
/// then refused one, so that it holds less than the next walk costs. Nothing is dropped.
fn loaded_stream_with_a_short_budget() -> (
    SimDevice,
    StreamMemory<SimDevice>,
    Vec<ManagedMemoryHandle>,
    Vec<ManagedMemoryHandle>,
) {
    let (device, allocator) = engine(1 << 40);
    let mut memory = StreamMemory::new(allocator, STREAM, &props());
    let params: Vec<_> = (0..300u64)
        .map(|i| memory.reserve(2 * MIB + (i + 1) * 512).expect("reserve"))
        .collect();
    let start = memory.policy_counters();
    let mut extra = Vec::new();
    for j in 0..4096u64 {
        extra.push(memory.reserve(16 * MIB + (j + 1) * 512).expect("reserve"));
        let now = memory.policy_counters();
        if now.budget_reclaims > start.budget_reclaims
            && now.skipped_reclaims > start.skipped_reclaims
        {
            break;
        }
    }
    let counters = memory.policy_counters();
    assert!(
        counters.skipped_reclaims > start.skipped_reclaims,
        "{counters:?}"
    );
    assert_eq!(counters.growth_reclaims + counters.productive_reclaims, 0);
    (device, memory, params, extra)
}

/// Drops the last `first` parameters and walks (explicitly: the budget is untouched), drops 30
/// more below them (three whole 20 MiB segments' worth, still in CubeCL's pool), then reserves
/// 12 MiB, a new size the engine's cache cannot serve. Returns (counters before and after the
/// 12 MiB reservation, device allocations before and after, slices the walk visited).
fn walk_then_miss(first: usize) -> ((PolicyCounters, PolicyCounters), (u64, u64), u64) {
    let (device, mut memory, mut params, extra) = loaded_stream_with_a_short_budget();
    let visited = memory.usage().number_allocs;
    params.truncate(params.len() - first);
    memory.reclaim();
    params.truncate(params.len() - 30);
    let before = (memory.policy_counters(), device.counters().allocs);
    let tensor = memory.reserve(12 * MIB).expect("reserve");
    let after = (memory.policy_counters(), device.counters().allocs);
    drop((tensor, params, extra));
    ((before.0, after.0), (before.1, after.1), visited)
}

#[test]
fn a_would_grow_miss_after_a_productive_walk_walks_even_when_the_budget_is_short() {
    // The explicit walk released 4 of about 300 + n slices, at least 1/256 of them: productive.
    // The 12 MiB miss cannot be paid from the budget and no slice was reused since (so the
    // growth sign is off), yet it walks, hands back the 30 dropped parameters, and the engine
    // places it in their coalesced blocks without a device allocation.
    let ((before, after), (allocs_before, allocs_after), visited) = walk_then_miss(4);
    assert!(4 * PRODUCTIVE_SHARE as u64 >= visited, "{visited} slices");
    assert_eq!(after.budget_reclaims, before.budget_reclaims, "{after:?}");
    assert_eq!(after.placement_reclaims, before.placement_reclaims);
    assert_eq!(
        after.productive_reclaims,
        before.productive_reclaims + 1,
        "{after:?}"
    );
    assert_eq!(after.growth_reclaims, before.growth_reclaims);
    assert_eq!(allocs_after, allocs_before, "{after:?}");

    // A walk that released 1 slice of as many is under 1/256: the same miss grows the device
    // instead, with the 30 parameters still in CubeCL's pool.
    let ((before, after), (allocs_before, allocs_after), visited) = walk_then_miss(1);
    assert!((PRODUCTIVE_SHARE as u64) < visited, "{visited} slices");
    assert_eq!(after.productive_reclaims, before.productive_reclaims);
    assert_eq!(after.budget_reclaims, before.budget_reclaims);
    assert_eq!(
        after.skipped_reclaims,
        before.skipped_reclaims + 1,
        "{after:?}"
    );
    assert_eq!(allocs_after, allocs_before + 1, "{after:?}");
}
