//! Trains the MLP on the first 6,000 MNIST training images for one epoch and
//! checks it reaches at least 85% on the first 1,000 test images.
//!
//! Data: the crate's shipped `data/` (checked against its `SHA256SUMS`). Device: wgpu's
//! default adapter (lavapipe on a CPU), once with the library's `CachingWgpu` and once with
//! Burn's stock `Wgpu`. Without an adapter the test skips with a message, except under CI
//! (see [`super::support::in_ci`]), where it fails.

use std::time::Instant;

use burn_caching_alloc::backend::{memory_snapshot, memory_stats};
use mnist::dataset::{MnistSet, Split, default_data_dir};
use mnist::train::Silent;
use mnist::{BackendChoice, ModelKind, RunOutcome, TrainConfig, train_on};

use super::support::wgpu_device;

const TRAIN_IMAGES: usize = 6_000;
const TEST_IMAGES: usize = 1_000;
/// Steps in the epoch: ceil(6000 / 64).
const STEPS: usize = TRAIN_IMAGES.div_ceil(64);

fn train_mlp(choice: BackendChoice) -> Option<RunOutcome> {
    wgpu_device()?;
    let dir = default_data_dir();
    let loaded = Instant::now();
    let train = MnistSet::load(&dir, Split::Train, Some(TRAIN_IMAGES)).expect("training images");
    let test = MnistSet::load(&dir, Split::Test, Some(TEST_IMAGES)).expect("test images");
    assert_eq!((train.len(), test.len()), (TRAIN_IMAGES, TEST_IMAGES));
    let load_seconds = loaded.elapsed().as_secs_f64();

    let config = TrainConfig {
        model: ModelKind::Mlp,
        epochs: 1,
        ..TrainConfig::default()
    };
    let started = Instant::now();
    let outcome = train_on(choice, &train, &test, &config, &mut Silent).expect("training runs");
    eprintln!(
        "{choice}: accuracy {:.2}%, loss {:.4}, epoch {:.2} s, train_on {:.2} s, data loading {:.2} s",
        outcome.report.epochs[0].accuracy * 100.0,
        outcome.report.epochs[0].loss,
        outcome.report.epochs[0].seconds,
        started.elapsed().as_secs_f64(),
        load_seconds
    );
    Some(outcome)
}

fn check_learning(outcome: &RunOutcome, backend: &str) {
    let report = &outcome.report;
    assert_eq!(report.backend, backend);
    assert_eq!(report.model, "mlp");
    assert_eq!(report.epochs.len(), 1);
    let epoch = report.epochs[0];
    assert_eq!(epoch.epoch, 1);
    assert!(
        epoch.loss.is_finite() && epoch.loss > 0.0,
        "loss {}",
        epoch.loss
    );
    assert!(
        epoch.accuracy >= 0.85,
        "accuracy {:.2}% is below 85%",
        epoch.accuracy * 100.0
    );
    // One memory reading per training step.
    assert_eq!(report.timeline.len(), STEPS);
    for point in &report.timeline {
        assert!(point.reserved >= point.allocated, "{point:?}");
    }
}

/// Burn's stock wgpu backend: CubeCL keeps no peaks or device counters, so
/// every memory field of the report must be null, never estimated; but the per-step readings
/// (CubeCL's `memory_usage`) are real ones.
fn check_stock_memory(outcome: &RunOutcome) {
    let memory = outcome.report.memory;
    assert_eq!(
        memory.peak_allocated, None,
        "stock backend reported {memory:?}"
    );
    assert_eq!(memory.peak_reserved, None, "{memory:?}");
    assert_eq!(memory.num_device_alloc, None, "{memory:?}");
    assert_eq!(memory.num_device_free, None, "{memory:?}");
    assert_eq!(memory.num_alloc_retries, None, "{memory:?}");
    assert_eq!(memory.num_ooms, None, "{memory:?}");
    let json: serde_json::Value =
        serde_json::from_str(&outcome.report.to_json().expect("report encodes"))
            .expect("valid JSON");
    for field in [
        "peak_allocated",
        "peak_reserved",
        "num_device_alloc",
        "num_device_free",
        "num_alloc_retries",
        "num_ooms",
    ] {
        assert!(
            json["memory"][field].is_null(),
            "memory.{field} = {}",
            json["memory"][field]
        );
    }
    assert!(outcome.summary.is_none());
    // The model's weights and Adam's state stay live across steps: every reading sees them.
    for point in &outcome.report.timeline {
        assert!(point.allocated > 0 && point.reserved > 0, "{point:?}");
    }
}

/// The library's `CachingWgpu`: the report's memory section must be the allocator's own
/// statistics, those statistics must agree with the segments the allocator actually holds
/// (its snapshot), and the allocator must have reused memory across steps.
fn check_caching_memory(outcome: &RunOutcome) {
    // `train_on` trains caching-wgpu on the default wgpu device.
    let device = wgpu_device().expect("the device trained on");
    let stats = memory_stats(&device).engine;
    let memory = outcome.report.memory;
    assert_eq!(memory.peak_allocated, Some(stats.allocated_bytes.all.peak));
    assert_eq!(memory.peak_reserved, Some(stats.reserved_bytes.all.peak));
    assert_eq!(memory.num_device_alloc, Some(stats.num_device_alloc));
    assert_eq!(memory.num_device_free, Some(stats.num_device_free));
    assert_eq!(memory.num_alloc_retries, Some(stats.num_alloc_retries));
    assert_eq!(memory.num_ooms, Some(stats.num_ooms));
    assert_eq!(stats.num_ooms, 0);
    assert!(stats.reserved_bytes.all.peak >= stats.allocated_bytes.all.peak);

    // The counters against the segment list: two bookkeepings of the same memory.
    let snapshot = memory_snapshot(&device);
    let segment_bytes: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
    let block_bytes: u64 = snapshot.segments.iter().map(|s| s.allocated_size).sum();
    assert_eq!(segment_bytes, snapshot.stats.reserved_bytes.all.current);
    assert_eq!(block_bytes, snapshot.stats.allocated_bytes.all.current);
    assert_eq!(
        snapshot.segments.len() as u64,
        snapshot.stats.num_device_alloc - snapshot.stats.num_device_free
    );

    // Caching: a training step allocates dozens of tensors, yet after the first steps the
    // device is asked for (almost) nothing: far fewer segments than steps.
    assert!(stats.num_device_alloc > 0, "training allocated no segment");
    assert!(
        (stats.num_device_alloc as usize) < STEPS,
        "{} device allocations for {STEPS} steps: the allocator did not reuse memory",
        stats.num_device_alloc
    );
    // No reading after a step exceeds the allocator's peaks, and the steady state holds:
    // the second half of the epoch reserves nothing new.
    let timeline = &outcome.report.timeline;
    for point in timeline {
        assert!(point.reserved <= stats.reserved_bytes.all.peak, "{point:?}");
        assert!(
            point.allocated <= stats.allocated_bytes.all.peak,
            "{point:?}"
        );
    }
    let half = timeline[timeline.len() / 2].reserved;
    assert!(
        timeline[timeline.len() / 2..]
            .iter()
            .all(|p| p.reserved == half),
        "reserved memory still changing in the second half of the epoch: {:?}",
        timeline.iter().map(|p| p.reserved).collect::<Vec<_>>()
    );

    let json: serde_json::Value =
        serde_json::from_str(&outcome.report.to_json().expect("report encodes"))
            .expect("valid JSON");
    assert_eq!(json["backend"], "caching-wgpu");
    assert_eq!(
        json["memory"]["peak_reserved"],
        stats.reserved_bytes.all.peak
    );
    assert_eq!(json["memory"]["num_device_alloc"], stats.num_device_alloc);
    let summary = outcome
        .summary
        .as_deref()
        .expect("caching backends have a summary");
    assert!(summary.contains("memory summary"), "{summary}");

    // The run's tensors are all dropped: PyTorch's "allocated" is 0 everywhere, and what
    // CubeCL caches is reserved, not allocated.
    let after = memory_stats(&device);
    assert_eq!(after.memory_allocated(), 0, "{:?}", after.cubecl);
    assert_eq!(after.to_map()["allocated_bytes.all.current"], 0);
    assert_eq!(after.cubecl.tensor_bytes, 0);
    assert!(after.memory_reserved() > 0);
    assert_eq!(
        after.cached_in_cubecl() + after.cached_in_engine(),
        after.memory_reserved()
    );
    let allocated_row = summary
        .lines()
        .find(|line| line.starts_with("| Allocated memory"))
        .expect("an Allocated memory row");
    assert_eq!(
        allocated_row.split('|').nth(2).map(str::trim),
        Some("0 B"),
        "{summary}"
    );
}

/// Trains on the caching backend and on the stock one, one after the other
/// (Burn's CubeCL backends share one global seed, so overlapping runs would
/// see each other's random weights). Same seed, same batches: the allocator
/// must not change the numbers.
#[test]
fn mlp_reaches_85_percent_on_caching_wgpu_as_on_stock_wgpu() {
    let Some(caching) = train_mlp(BackendChoice::CachingWgpu) else {
        return;
    };
    check_learning(&caching, "caching-wgpu");
    check_caching_memory(&caching);

    let Some(stock) = train_mlp(BackendChoice::Wgpu) else {
        return;
    };
    check_learning(&stock, "wgpu");
    check_stock_memory(&stock);

    // The allocator only decides where tensors live, so the numbers agree. Reductions on a
    // GPU need not be bit-reproducible across runs, so agreement is within a tolerance.
    let (c, s) = (caching.report.epochs[0], stock.report.epochs[0]);
    assert!(
        (c.accuracy - s.accuracy).abs() <= 0.01,
        "same seed and batches, accuracy differs by more than 1 point: {:.2}% vs {:.2}%",
        c.accuracy * 100.0,
        s.accuracy * 100.0
    );
    assert!(
        (c.loss - s.loss).abs() <= 1e-3 * s.loss.abs(),
        "same seed and batches, loss differs by more than 0.1%: {} vs {}",
        c.loss,
        s.loss
    );
}
