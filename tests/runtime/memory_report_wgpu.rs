//! "Leak or cache?" through Burn (`backend::memory_report`) on `CachingWgpuUnfused` (every
//! operation allocates when called): tensors held between two points, the cache, and one
//! request's reservation (cubecl issue 1614's vocabulary-sized logits, scaled down to fit
//! lavapipe's 128 MiB binding limit).

use crate::MIB;
use burn::tensor::{Distribution, Tensor};
use burn_caching_alloc::alloc::{HistoryOptions, Verdict};
use burn_caching_alloc::backend::{self, CachingWgpuUnfused};

use crate::support::lavapipe::cpu_device;

type B = CachingWgpuUnfused;
type Device = burn::backend::wgpu::WgpuDevice;

#[inline(never)]
fn leaky_step(device: &Device, kept: &mut Vec<Tensor<B, 2>>) {
    let x = Tensor::<B, 2>::random([64, 1024], Distribution::Default, device);
    kept.push(x.clone().exp()); // the "leak": a result kept in a list
    drop(x);
}

#[test]
fn held_tensors_are_found_with_their_size_and_the_function_that_made_them() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    // History hands every freed CubeCL slice back at the next reservation, so the engine's
    // live blocks are exactly the live tensors; stacks name where they were made.
    backend::record_memory_history(&device, HistoryOptions::default());
    let mut kept = Vec::new();
    leaky_step(&device, &mut kept);
    let before = backend::memory_point(&device);
    for _ in 0..3 {
        leaky_step(&device, &mut kept);
    }
    let report = backend::memory_report(&device, Some(&before));
    println!("{report}");
    backend::record_memory_history(&device, HistoryOptions::off());

    assert_eq!(report.verdict(), Verdict::HeldTensors);
    let bytes = 64 * 1024 * 4;
    assert_eq!(report.allocated.1 - report.allocated.0, 3 * bytes);
    let group = report
        .held
        .iter()
        .find(|g| g.requested == bytes)
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(group.count, 3, "{report}");
    assert!(
        group.frames.iter().any(|f| f.name.ends_with("leaky_step")),
        "{report}"
    );
    drop(kept);
    backend::empty_cache(&device);
}

#[test]
fn reserved_growing_while_live_tensors_are_flat_is_reported_as_the_cache() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    // A first launch makes the stream's metadata scratch: before the first point.
    let warm = Tensor::<B, 1>::ones([1000], &device) * 2.0;
    assert_eq!(warm.into_data().to_vec::<f32>().expect("f32")[0], 2.0);
    let before = backend::memory_point(&device);
    for n in [300_000usize, 700_000, 1_500_000] {
        let t = Tensor::<B, 1>::ones([n], &device) * 2.0;
        assert_eq!(t.into_data().to_vec::<f32>().expect("f32")[0], 2.0);
    }
    let report = backend::memory_report(&device, Some(&before));
    println!("{report}");
    let stats = backend::memory_stats(&device);

    assert_eq!(report.verdict(), Verdict::Cache, "{report}");
    assert_eq!(
        report.allocated,
        (before.allocated, stats.memory_allocated())
    );
    assert!(report.reserved.1 > report.reserved.0);
    // CubeCL's free slices are the dropped tensors' (4 B a value, in 512-byte engine blocks)
    // that nothing reclaimed before: at least the last one (no request came after it), at most
    // all three (a miss of the engine may hand the earlier ones back first, as
    // `stream_memory`'s reclaim does when a new size would grow the pool). The report's
    // reading left them there: the reading after it finds the same.
    let dropped = [300_000u64, 700_000, 1_500_000].map(|n| (4 * n).next_multiple_of(512));
    assert!(
        report.cache.cached_above >= dropped[2]
            && report.cache.cached_above <= dropped.iter().sum::<u64>(),
        "{report}"
    );
    assert_eq!(stats.cached_in_cubecl(), report.cache.cached_above);
    assert_eq!(report.cache.cached_in_engine, stats.cached_in_engine());
    assert_eq!(
        stats.memory_reserved(),
        stats.memory_allocated() + stats.cached_in_cubecl() + stats.cached_in_engine()
    );
    backend::empty_cache(&device);
    let after = backend::memory_report(&device, Some(&before));
    assert!(after.reserved.1 <= before.reserved, "{after}");
}

/// cubecl issue 1614's logits (6 x 512 x 50257 f32, 589 MiB) cannot bind on lavapipe; one row
/// of 128 x 50257 f32 (24.54 MiB) takes the same rule: a segment of its own, the request
/// rounded up to 2 MiB. The engine test `cubecl_1614_...` runs the full size.
#[test]
fn one_large_tensor_reserves_its_size_rounded_to_2_mib() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let reserved_before = backend::memory_stats(&device).memory_reserved();
    let logits = Tensor::<B, 2>::zeros([128, 50257], &device);
    let report = backend::memory_report(&device, None);
    println!("{report}");
    let requested: u64 = 128 * 50257 * 4;
    assert_eq!(
        report.reserved.1 - reserved_before,
        requested.div_ceil(2 * MIB) * 2 * MIB
    );
    assert_eq!(report.reserved.1 - reserved_before, 26 * MIB);
    assert!(
        report.oversized.iter().all(|o| o.requested != requested),
        "{report}"
    );
    drop(logits);
    backend::empty_cache(&device);
}
