//! The burn-train metrics (`backend::MemoryMetrics`, feature `train`) on `CachingWgpuUnfused`:
//! each value equals `memory_stats` read at the same point, the metrics of one update round
//! share one reading, and the peaks are the peaks since the previous reading, without resetting
//! the device's.

use crate::MIB;
use burn::data::dataloader::Progress;
use burn::tensor::Tensor;
use burn_caching_alloc::backend::{self, CachingWgpuUnfused, MemoryMetrics};
use burn_train::metric::{Metric, MetricMetadata, Numeric};

use crate::support::lavapipe::cpu_device;

type B = CachingWgpuUnfused;

fn metadata() -> MetricMetadata {
    MetricMetadata {
        progress: Progress {
            items_processed: 1,
            items_total: 1,
        },
        global_progress: Progress {
            items_processed: 1,
            items_total: 1,
        },
        iteration: Some(1),
        lr: None,
    }
}

#[test]
fn the_metrics_show_memory_stats_and_the_peaks_since_the_last_reading() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    backend::empty_cache(&device);
    let group = MemoryMetrics::new(&device);
    let (mut allocated, mut reserved, mut peak_allocated, mut peak_reserved) = group.all();
    let kept = Tensor::<B, 1>::ones([MIB as usize], &device); // 4 MiB
    let spike = Tensor::<B, 1>::ones([6 * MIB as usize], &device); // 24 MiB, then dropped
    assert_eq!(spike.into_data().to_vec::<f32>().expect("f32")[0], 1.0);

    let stats = backend::memory_stats(&device);
    let meta = metadata();
    let entry = allocated.update(&(), &meta);
    reserved.update(&(), &meta);
    peak_allocated.update(&(), &meta);
    peak_reserved.update(&(), &meta);
    assert_eq!(allocated.bytes(), stats.memory_allocated());
    assert!(
        allocated.bytes() >= 4 * MIB,
        "the kept tensor (and the launch metadata)"
    );
    assert_eq!(reserved.bytes(), stats.memory_reserved());
    assert_eq!(peak_allocated.bytes(), stats.engine.max_memory_allocated());
    assert_eq!(peak_reserved.bytes(), stats.max_memory_reserved());
    assert!(
        peak_reserved.bytes() >= 28 * MIB,
        "the spike is in the peak"
    );
    let mib = allocated.bytes() as f64 / MIB as f64;
    assert_eq!(allocated.value().current(), mib, "in MiB");
    assert_eq!(entry.formatted, format!("{mib:.2} MiB"));
    assert_eq!(allocated.name().as_str(), "GPU Memory Allocated");

    // Issue 33: reading changed nothing on the device. Its peaks are still the spike's (the
    // user's own `max_memory_*` read what they would without the metrics); the metrics'
    // next peaks are those since this reading, from the group's own baseline.
    let stats = backend::memory_stats(&device);
    assert!(
        stats.max_memory_reserved() >= 28 * MIB,
        "the device's peak was not reset"
    );
    assert_eq!(stats.max_memory_allocated(), peak_allocated.bytes());
    reserved.update(&(), &meta);
    peak_reserved.update(&(), &meta);
    assert_eq!(peak_reserved.bytes(), stats.memory_reserved());
    assert_eq!(reserved.bytes(), stats.memory_reserved());

    drop(kept);
    backend::empty_cache(&device);
}
