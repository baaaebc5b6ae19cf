//! Issue 33, "observing changes nothing": every way a user reads a device's memory
//! (`memory_stats` and its map, the summary, a snapshot, `memory_point` and `memory_report`,
//! the settings, the `max_memory_*` peaks, burn-train's `MemoryMetrics`) read twice in a row
//! after a workload gives the same answer both times, and the device's peaks are still the
//! workload's after all of it.

use burn::tensor::Tensor;
use burn_caching_alloc::backend::{self, CachingWgpuUnfused};

use crate::MIB;
use crate::support::lavapipe::cpu_device;

type B = CachingWgpuUnfused;

/// Everything a reading shows, as text (what a user compares by eye).
fn read_everything(device: &burn::backend::wgpu::WgpuDevice) -> Vec<(&'static str, String)> {
    let stats = backend::memory_stats(device);
    let point = backend::memory_point(device);
    #[allow(unused_mut)] // pushed to with the `train` feature only
    let mut seen = vec![
        ("memory_stats", format!("{:?}", stats.to_map())),
        ("memory_summary", backend::memory_summary(device)),
        (
            "memory_snapshot",
            backend::memory_snapshot(device).to_json_pretty(),
        ),
        ("memory_point", format!("{:?}", point.snapshot().stats)),
        (
            "memory_report",
            backend::memory_report(device, Some(&point)).to_string(),
        ),
        (
            "allocator_settings",
            format!("{:?}", backend::allocator_settings(device)),
        ),
        (
            "peaks",
            format!(
                "{} {} {} {}",
                backend::memory_allocated(device),
                backend::max_memory_allocated(device),
                backend::memory_reserved(device),
                backend::max_memory_reserved(device)
            ),
        ),
    ];
    #[cfg(feature = "train")]
    {
        let (allocated, reserved, peak_allocated, peak_reserved) =
            backend::MemoryMetrics::new(device).all();
        seen.push((
            "metrics",
            format!(
                "{} {} {} {}",
                allocated.bytes(),
                reserved.bytes(),
                peak_allocated.bytes(),
                peak_reserved.bytes()
            ),
        ));
    }
    seen
}

#[test]
fn reading_everything_twice_gives_the_same_answers_and_leaves_the_peaks() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let kept = Tensor::<B, 1>::ones([MIB as usize], &device); // 4 MiB, live throughout
    let spike = Tensor::<B, 1>::ones([6 * MIB as usize], &device); // 24 MiB, then dropped
    let product = spike.clone() * 2.0;
    assert_eq!(product.into_data().to_vec::<f32>().expect("f32")[7], 2.0);
    drop(spike);
    let peak_allocated = backend::max_memory_allocated(&device);
    let peak_reserved = backend::max_memory_reserved(&device);
    assert!(peak_allocated >= 28 * MIB, "the spike is in the peak");

    let first = read_everything(&device);
    let second = read_everything(&device);
    for ((name, a), (_, b)) in first.iter().zip(&second) {
        assert_eq!(a, b, "{name} changed between two readings in a row");
    }
    assert_eq!(backend::max_memory_allocated(&device), peak_allocated);
    assert_eq!(backend::max_memory_reserved(&device), peak_reserved);

    drop(kept);
    backend::empty_cache(&device);
}
