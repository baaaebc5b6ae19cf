//! Trains the MLP on the first 6,000 MNIST training images for one epoch and
//! checks it reaches at least 85% on the first 1,000 test images.
//!
//! Data: `../shared/data/mnist` beside the crate. Device: wgpu's default
//! adapter (lavapipe on a CPU), once with this crate's `CachingWgpu` and once
//! with Burn's stock `Wgpu`. Without an adapter the test skips with a message, except under
//! `CI=true`, where it fails.

use std::path::Path;
use std::time::Instant;

use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::backend::memory_stats;
use burn_caching_alloc::mnist::backend_choice::wgpu_adapter_present;
use burn_caching_alloc::mnist::dataset::{MnistSet, Split, default_data_dir};
use burn_caching_alloc::mnist::train::Silent;
use burn_caching_alloc::mnist::{BackendChoice, ModelKind, RunOutcome, TrainConfig, train_on};

const TRAIN_IMAGES: usize = 6_000;
const TEST_IMAGES: usize = 1_000;

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The data folder, or `None` (after printing why) when the test should skip.
fn data_dir() -> Option<std::path::PathBuf> {
    let dir = default_data_dir(Path::new(env!("CARGO_MANIFEST_DIR")));
    if dir.is_none() {
        let message = "MNIST data not found at ../shared/data/mnist beside the crate";
        assert!(!in_ci(), "{message} (CI=true: failing instead of skipping)");
        eprintln!("skipping: {message}");
    }
    dir
}

fn adapter_present() -> bool {
    if wgpu_adapter_present() {
        return true;
    }
    let message = "no wgpu adapter (install mesa-vulkan-drivers for lavapipe)";
    assert!(!in_ci(), "{message} (CI=true: failing instead of skipping)");
    eprintln!("skipping: {message}");
    false
}

fn train_mlp(choice: BackendChoice) -> Option<RunOutcome> {
    let dir = data_dir()?;
    if !adapter_present() {
        return None;
    }
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
    // One memory reading per training step: ceil(6000 / 64) = 94.
    assert_eq!(report.timeline.len(), TRAIN_IMAGES.div_ceil(64));
    for point in &report.timeline {
        assert!(point.reserved >= point.allocated, "{point:?}");
    }
}

/// Burn's stock wgpu backend: CubeCL keeps no peaks or device counters, so
/// every memory field of the report must be null, never estimated.
fn check_stock_memory(outcome: &RunOutcome) {
    let memory = outcome.report.memory;
    assert_eq!(
        memory,
        Default::default(),
        "stock backend reported {memory:?}"
    );
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
}

/// This crate's `CachingWgpu`: the report's memory section must be exactly
/// the allocator's own statistics after training.
fn check_caching_memory(outcome: &RunOutcome) {
    // `train_on` trains caching-wgpu on the default wgpu device.
    let stats = memory_stats(&WgpuDevice::DefaultDevice).engine;
    let memory = outcome.report.memory;
    assert_eq!(memory.peak_allocated, Some(stats.allocated_bytes.all.peak));
    assert_eq!(memory.peak_reserved, Some(stats.reserved_bytes.all.peak));
    assert_eq!(memory.num_device_alloc, Some(stats.num_device_alloc));
    assert_eq!(memory.num_device_free, Some(stats.num_device_free));
    assert_eq!(memory.num_alloc_retries, Some(stats.num_alloc_retries));
    assert_eq!(memory.num_ooms, Some(stats.num_ooms));
    assert_eq!(stats.num_ooms, 0);
    assert!(stats.num_device_alloc > 0, "training allocated no segment");
    assert!(stats.reserved_bytes.all.peak >= stats.allocated_bytes.all.peak);
    // No reading after a step exceeds the allocator's peaks.
    for point in &outcome.report.timeline {
        assert!(point.reserved <= stats.reserved_bytes.all.peak, "{point:?}");
        assert!(
            point.allocated <= stats.allocated_bytes.all.peak,
            "{point:?}"
        );
    }
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

    let (c, s) = (caching.report.epochs[0], stock.report.epochs[0]);
    assert_eq!(
        c.accuracy, s.accuracy,
        "same seed and batches, different accuracy"
    );
    assert!(
        (c.loss - s.loss).abs() <= 1e-4 * s.loss.abs(),
        "same seed and batches, different loss: {} vs {}",
        c.loss,
        s.loss
    );
}
