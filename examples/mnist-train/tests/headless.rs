//! The burn-train example end to end, tiny and headless: `SupervisedTraining` on
//! `Autodiff<CachingWgpu>` with burn-train's plain-text renderer, 256 training images for one
//! epoch and 128 validation images, on lavapipe (or any wgpu adapter). Without an adapter it
//! skips with a message, except under `CI` where that is a failure.
//!
//! It checks that the run finished, that the snapshots (JSON and pickle) and the viewer were
//! written and parse, and that the memory values burn-train handed its renderer equal
//! `memory_stats` read at the same point. burn-train updates metrics on its own processor
//! thread while the training thread runs on, so "the same point" is made: the group's first
//! metric (the one that takes the group's reading) is wrapped in [`Quiet`], which waits until
//! the device is still (burn-train's processor has a one-slot queue, so the training thread
//! stops within two steps; the data loader has no worker threads), reads `memory_stats`, lets
//! the metric take its reading, and reads again. A reading taken while nothing moved must
//! equal the statistics around it, to the byte.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::alloc::Snapshot;

const MIB: u64 = 1 << 20;
use burn_caching_alloc::backend::{
    self, CachingMemoryMetric, CachingMemoryStats, CachingWgpu, MemoryMetrics, MemoryQuantity,
};
use burn_train::LearnerSummary;
use burn_train::metric::{
    Metric, MetricAttributes, MetricDefinition, MetricId, MetricMetadata, MetricName, Numeric,
    NumericEntry, SerializedEntry,
};
use burn_train::renderer::{
    CliMetricsRenderer, EvaluationName, EvaluationProgress, MetricState, MetricsRenderer,
    MetricsRendererEvaluation, MetricsRendererTraining, ProgressType, TrainingProgress,
};
use mnist::dataset::{MnistSet, Split, default_data_dir};
use mnist_train::{MemoryFiles, TrainingConfig, run_with};

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// The numbers that move when anything is allocated or freed, in the engine or in CubeCL.
fn movement(stats: &CachingMemoryStats) -> [u64; 9] {
    let e = &stats.engine;
    [
        e.allocated_bytes.all.current,
        e.allocated_bytes.all.allocated,
        e.allocated_bytes.all.freed,
        e.reserved_bytes.all.current,
        e.reserved_bytes.all.allocated,
        e.reserved_bytes.all.freed,
        e.allocation.all.allocated,
        stats.cubecl.live_slices,
        stats.cubecl.tensor_bytes,
    ]
}

/// What [`Quiet`] saw around one reading of the group.
#[derive(Debug, Clone)]
struct Witness {
    /// `memory_stats` just before the reading.
    before: CachingMemoryStats,
    /// Whether nothing moved between `before` and just after the reading.
    still: bool,
}

/// The group's first metric, waiting for a still device around its reading (module docs).
#[derive(Clone)]
struct Quiet {
    inner: CachingMemoryMetric<WgpuDevice>,
    device: WgpuDevice,
    witnesses: Arc<Mutex<Vec<Witness>>>,
}

impl Quiet {
    /// `memory_stats` once two readings 20 ms apart agree (at most 10 s).
    fn still_stats(&self) -> CachingMemoryStats {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut last = backend::memory_stats(&self.device);
        loop {
            std::thread::sleep(Duration::from_millis(20));
            let now = backend::memory_stats(&self.device);
            if movement(&now) == movement(&last) || Instant::now() > deadline {
                return now;
            }
            last = now;
        }
    }
}

impl Metric for Quiet {
    type Input = ();

    fn name(&self) -> MetricName {
        self.inner.name()
    }

    fn description(&self) -> Option<String> {
        self.inner.description()
    }

    fn attributes(&self) -> MetricAttributes {
        self.inner.attributes()
    }

    fn update(&mut self, item: &(), metadata: &MetricMetadata) -> SerializedEntry {
        let before = self.still_stats();
        let entry = self.inner.update(item, metadata);
        let after = backend::memory_stats(&self.device);
        let still = movement(&before) == movement(&after);
        self.witnesses
            .lock()
            .unwrap()
            .push(Witness { before, still });
        entry
    }

    fn clear(&mut self) {
        self.inner.clear();
    }
}

impl Numeric for Quiet {
    fn value(&self) -> NumericEntry {
        self.inner.value()
    }

    fn running_value(&self) -> NumericEntry {
        self.inner.running_value()
    }
}

/// One numeric value burn-train handed the renderer.
#[derive(Debug, Clone, PartialEq)]
struct Shown {
    valid: bool,
    name: String,
    value: f64,
    serialized: String,
}

/// burn-train's plain-text renderer, keeping every numeric value it is handed.
struct Recording {
    text: CliMetricsRenderer,
    names: HashMap<MetricId, String>,
    shown: Arc<Mutex<Vec<Shown>>>,
}

impl Recording {
    fn keep(&mut self, valid: bool, state: &MetricState) {
        if let MetricState::Numeric(entry, numeric) = state {
            let value = match numeric {
                NumericEntry::Value(value) => *value,
                NumericEntry::Aggregated {
                    aggregated_value, ..
                } => *aggregated_value,
            };
            self.shown.lock().unwrap().push(Shown {
                valid,
                name: self.names[&entry.metric_id].clone(),
                value,
                serialized: entry.serialized_entry.serialized.clone(),
            });
        }
    }
}

impl MetricsRendererTraining for Recording {
    fn update_train(&mut self, state: MetricState) {
        self.keep(false, &state);
        self.text.update_train(state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.keep(true, &state);
        self.text.update_valid(state);
    }

    fn render_train(&mut self, item: TrainingProgress, progress: Vec<ProgressType>) {
        self.text.render_train(item, progress);
    }

    fn render_valid(&mut self, item: TrainingProgress, progress: Vec<ProgressType>) {
        self.text.render_valid(item, progress);
    }

    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        self.text.on_train_end(summary)
    }
}

impl MetricsRendererEvaluation for Recording {
    fn update_test(&mut self, name: EvaluationName, state: MetricState) {
        self.text.update_test(name, state);
    }

    fn render_test(&mut self, item: EvaluationProgress, progress: Vec<ProgressType>) {
        self.text.render_test(item, progress);
    }
}

impl MetricsRenderer for Recording {
    fn manual_close(&mut self) {
        self.text.manual_close();
    }

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id.clone(), definition.name.clone());
        self.text.register_metric(definition);
    }
}

/// The values of metric `name` burn-train showed for one split, in order.
fn values(shown: &[Shown], name: &str, valid: bool) -> Vec<f64> {
    shown
        .iter()
        .filter(|s| s.name == name && s.valid == valid)
        .map(|s| s.value)
        .collect()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

#[test]
fn a_tiny_headless_run_shows_memory_stats_and_writes_the_memory_files() {
    // SAFETY: the only test of this binary, before its first wgpu call: no other thread reads
    // the environment through libc yet (see `mnist::headless`).
    let _runtime_dir = unsafe { mnist::headless::ensure_xdg_runtime_dir() };
    let device = WgpuDevice::DefaultDevice;
    if !burn_caching_alloc::wgpu::adapter_available(&device) {
        assert!(!in_ci(), "no wgpu adapter; CI is set, so this is a failure");
        eprintln!("skipped: no wgpu adapter (install Mesa's lavapipe)");
        return;
    }
    let data = default_data_dir();
    let train = MnistSet::load(&data, Split::Train, Some(256)).expect("the shipped data");
    let valid = MnistSet::load(&data, Split::Test, Some(128)).expect("the shipped data");
    let dir = std::env::temp_dir().join(format!("mnist-train-headless-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let files = MemoryFiles {
        snapshots: vec![dir.join("memory.json"), dir.join("memory.pickle")],
        viewer: Some(dir.join("memory.html")),
        stacks: false,
    };

    let group = MemoryMetrics::new(&device);
    let witnesses = Arc::new(Mutex::new(Vec::new()));
    let quiet = Quiet {
        inner: group.metric(MemoryQuantity::Allocated),
        device: device.clone(),
        witnesses: witnesses.clone(),
    };
    let memory = (
        quiet,
        group.metric(MemoryQuantity::Reserved),
        group.metric(MemoryQuantity::PeakAllocated),
        group.metric(MemoryQuantity::PeakReserved),
    );
    let shown = Arc::new(Mutex::new(Vec::new()));
    let renderer = Recording {
        text: CliMetricsRenderer::new(),
        names: HashMap::new(),
        shown: shown.clone(),
    };
    let config = TrainingConfig::default();
    let outcome = run_with::<Autodiff<CachingWgpu>, _, _>(
        device.clone(),
        train,
        valid,
        &config,
        &dir.join("artifacts"),
        Some(renderer),
        memory,
        &files,
    )
    .expect("the run finishes");

    // The run: 4 training and 2 validation steps, each with its loss and four memory values.
    let shown = shown.lock().unwrap().clone();
    for (valid, steps) in [(false, 4), (true, 2)] {
        assert_eq!(values(&shown, "Loss", valid).len(), steps, "valid {valid}");
        for quantity in [
            "GPU Memory Allocated",
            "GPU Memory Reserved",
            "GPU Memory Peak Allocated",
            "GPU Memory Peak Reserved",
        ] {
            assert_eq!(
                values(&shown, quantity, valid).len(),
                steps,
                "{quantity}, valid {valid}"
            );
        }
    }
    assert!(
        values(&shown, "Loss", false)
            .iter()
            .all(|l| l.is_finite() && *l > 0.0)
    );

    // Each value shown is the group's reading, checked against `memory_stats` where the device
    // was still around it: allocated, reserved, and the peaks since the previous reading.
    let witnesses = witnesses.lock().unwrap().clone();
    assert_eq!(
        witnesses.len(),
        6,
        "one group reading per step, training then validation"
    );
    let mut rounds = Vec::new();
    for valid in [false, true] {
        let allocated = values(&shown, "GPU Memory Allocated", valid);
        let reserved = values(&shown, "GPU Memory Reserved", valid);
        let peak_allocated = values(&shown, "GPU Memory Peak Allocated", valid);
        let peak_reserved = values(&shown, "GPU Memory Peak Reserved", valid);
        for i in 0..allocated.len() {
            rounds.push([
                allocated[i],
                reserved[i],
                peak_allocated[i],
                peak_reserved[i],
            ]);
        }
    }
    let mut still = 0;
    for (witness, shown) in witnesses.iter().zip(&rounds) {
        if !witness.still {
            continue;
        }
        still += 1;
        let s = &witness.before;
        // Allocated and reserved are the device's; the peaks are the group's own, since its
        // previous reading (it never resets the device's peaks), so each lies between what is
        // allocated (reserved) now and the device's all-time peak.
        assert_eq!(
            [shown[0], shown[1]],
            [mib(s.memory_allocated()), mib(s.memory_reserved())],
            "shown vs memory_stats, in MiB"
        );
        assert!(
            shown[0] <= shown[2] && shown[2] <= mib(s.engine.max_memory_allocated()),
            "peak allocated since the last reading {shown:?} vs the device's {}",
            mib(s.engine.max_memory_allocated())
        );
        assert!(
            shown[1] <= shown[3] && shown[3] <= mib(s.max_memory_reserved()),
            "peak reserved since the last reading {shown:?} vs the device's {}",
            mib(s.max_memory_reserved())
        );
        assert!(s.memory_reserved() > 0 && s.memory_allocated() > 0);
    }
    eprintln!("the device was still around {still} of 6 readings");
    assert!(
        still >= 3,
        "the device was still around only {still} of 6 readings: {witnesses:?}"
    );
    // What burn-train logs is the same number, written so that it reads back exactly.
    for s in shown.iter().filter(|s| s.name.starts_with("GPU Memory")) {
        assert_eq!(s.serialized.parse::<f64>().unwrap(), s.value, "{s:?}");
    }

    // The memory files: both snapshots and the viewer, in the order asked, and they parse.
    assert_eq!(
        outcome.files,
        [
            dir.join("memory.json"),
            dir.join("memory.pickle"),
            dir.join("memory.html")
        ]
    );
    let snapshot: Snapshot =
        serde_json::from_slice(&std::fs::read(dir.join("memory.json")).unwrap()).unwrap();
    assert_eq!(
        snapshot.stats.reserved_bytes.all.current,
        outcome.stats.memory_reserved()
    );
    let segment_bytes: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(segment_bytes, snapshot.stats.reserved_bytes.all.current);
    assert!(
        !snapshot.history.is_empty(),
        "history was recorded from the start"
    );
    let pickle = std::fs::read(dir.join("memory.pickle")).unwrap();
    assert_eq!(pickle.first(), Some(&0x80), "a pickle starts with PROTO");
    assert_eq!(pickle.last(), Some(&b'.'), "and ends with STOP");
    let html = std::fs::read_to_string(dir.join("memory.html")).unwrap();
    let data = viewer_data(&html);
    assert_eq!(
        data["entries"].as_u64(),
        Some(snapshot.history.len() as u64),
        "the viewer shows the same history"
    );
    assert!(data["segments"].as_array().is_some_and(|s| !s.is_empty()));
    // burn-train wrote its logs into the artifact folder.
    let logged = dir.join("artifacts/train/epoch-1/GPU_Memory_Reserved.log");
    drop(outcome);
    assert!(logged.is_file(), "{} is missing", logged.display());
    std::fs::remove_dir_all(&dir).ok();
}

/// The JSON the viewer page carries in its `data` script element.
fn viewer_data(html: &str) -> serde_json::Value {
    let start = "<script type=\"application/json\" id=\"data\">";
    let from = html.find(start).expect("the data element") + start.len();
    let to = from + html[from..].find("</script>").expect("its end");
    serde_json::from_str(&html[from..to].replace("<\\/", "</")).expect("the data parses")
}
