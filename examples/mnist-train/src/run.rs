//! The training: burn-train's `SupervisedTraining` on any caching backend, the allocator's
//! memory metrics registered beside the loss and the accuracy, the memory files written at the
//! end.
//!
//! [`run`] is generic over the backend, as Burn's own `examples/mnist` `training::run` is: Burn
//! 0.21's `Dispatch` backend picks its device from a closed list (Burn's own backends), so a
//! third-party backend is named by its type instead: `run::<Autodiff<CachingWgpu>>(device,
//! ..)`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig};
use burn::tensor::backend::AutodiffBackend;
use burn_caching_alloc::alloc::inspect::InspectError;
use burn_caching_alloc::alloc::{HistoryOptions, StackContext};
use burn_caching_alloc::backend::{
    CachingDevice, CachingMemoryStats, MemoryMetrics, dump_html, dump_snapshot, memory_snapshot,
    memory_stats, record_memory_history,
};
use burn_train::metric::{AccuracyMetric, LossMetric};
use burn_train::renderer::{CliMetricsRenderer, MetricsRenderer};
use burn_train::{Learner, LearningComponentsMarker, MetricRegistration, SupervisedTraining};
use mnist::{MnistSet, ModelKind};

use super::data::{MnistBatcher, MnistIndices};
use super::model::Model;

/// What to train, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingConfig {
    /// The classifier.
    pub model: ModelKind,
    /// Passes over the training set.
    pub epochs: usize,
    /// Images per step (training and validation).
    pub batch_size: usize,
    /// Adam's learning rate (constant).
    pub learning_rate: f64,
    /// Seeds the weights and the order of the training batches.
    pub seed: u64,
}

impl Default for TrainingConfig {
    /// `examples/mnist`'s defaults: the perceptron, one epoch of batches of 64, Adam at 1e-3,
    /// seed 42.
    fn default() -> Self {
        Self {
            model: ModelKind::Mlp,
            epochs: 1,
            batch_size: 64,
            learning_rate: 1e-3,
            seed: 42,
        }
    }
}

/// How burn-train shows the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dashboard {
    /// burn-train's choice: the terminal dashboard when stdout is a terminal (feature `tui`),
    /// else its plain-text renderer.
    Auto,
    /// burn-train's plain-text renderer (`CliMetricsRenderer`), whatever stdout is.
    Text,
}

/// The memory files written at the end of a run. Asking for any records the allocator's
/// history from the start (PyTorch's `_record_memory_history`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryFiles {
    /// Snapshots: `.json` gets the crate's `Snapshot` as JSON, any other name a PyTorch-format
    /// pickle (pytorch.org/memory_viz, `_memory_viz.py`).
    pub snapshots: Vec<PathBuf>,
    /// The offline HTML viewer.
    pub viewer: Option<PathBuf>,
    /// Record a stack with every allocation (the frames then name the model's `forward`).
    pub stacks: bool,
}

impl MemoryFiles {
    fn any(&self) -> bool {
        !self.snapshots.is_empty() || self.viewer.is_some()
    }
}

/// A finished run.
pub struct Outcome {
    /// The memory files written, in the order asked.
    pub files: Vec<PathBuf>,
    /// The device's statistics once training ended and the files were written.
    pub stats: CachingMemoryStats,
    /// burn-train's renderer, handed back by `SupervisedTraining::launch`: the dashboard stays
    /// open until it is dropped (or, after `manual_close`, until the user quits it).
    pub renderer: Box<dyn MetricsRenderer>,
}

/// Why a run did not finish.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// An empty training or validation set, or a batch size of 0.
    #[error("{0}")]
    BadInput(String),
    /// Training finished but a memory file could not be written.
    #[error(transparent)]
    Write(#[from] InspectError),
    /// A JSON snapshot could not be encoded.
    #[error("cannot encode the snapshot as JSON: {0}")]
    Json(String),
}

/// burn-train's learning components of a run on `B`: a constant learning rate, [`Model`],
/// Adam. Custom metrics for [`run_with`] are registered against it.
pub type Components<B> =
    LearningComponentsMarker<B, f64, Model<B>, OptimizerAdaptor<Adam, Model<B>, B>>;

/// Trains on `device` with `SupervisedTraining`: loss, accuracy and the allocator's memory
/// ([`MemoryMetrics::all`]: allocated, reserved and their peaks) for training and validation,
/// artifacts (burn-train's logs) in `artifact_dir`, then writes `files`.
pub fn run<B>(
    device: B::Device,
    train: MnistSet,
    valid: MnistSet,
    config: &TrainingConfig,
    artifact_dir: &Path,
    dashboard: Dashboard,
    files: &MemoryFiles,
) -> Result<Outcome, RunError>
where
    B: AutodiffBackend,
    B::Device: CachingDevice,
{
    let memory = MemoryMetrics::new(&device).all();
    let renderer = match dashboard {
        Dashboard::Auto => None,
        Dashboard::Text => Some(CliMetricsRenderer::new()),
    };
    run_with::<B, _, _>(
        device,
        train,
        valid,
        config,
        artifact_dir,
        renderer,
        memory,
        files,
    )
}

/// [`run`] with the renderer `renderer` (`None`: burn-train's choice) and the memory metrics
/// `memory_metrics` (any metrics of `()`, registered with `SupervisedTraining::metrics` for
/// training and validation).
#[allow(clippy::too_many_arguments)]
pub fn run_with<B, Me, R>(
    device: B::Device,
    train: MnistSet,
    valid: MnistSet,
    config: &TrainingConfig,
    artifact_dir: &Path,
    renderer: Option<R>,
    memory_metrics: Me,
    files: &MemoryFiles,
) -> Result<Outcome, RunError>
where
    B: AutodiffBackend,
    B::Device: CachingDevice,
    Me: MetricRegistration<Components<B>>,
    R: MetricsRenderer + 'static,
{
    if train.is_empty() || valid.is_empty() {
        return Err(RunError::BadInput(format!(
            "nothing to train on: {} training and {} validation images",
            train.len(),
            valid.len()
        )));
    }
    if config.batch_size == 0 {
        return Err(RunError::BadInput(
            "the batch size must be at least 1".into(),
        ));
    }
    if files.any() {
        let context = if files.stacks {
            StackContext::Alloc
        } else {
            StackContext::Off
        };
        record_memory_history(&device, HistoryOptions::default().with_context(context));
    }
    B::seed(&device, config.seed);

    let train_indices = MnistIndices::of(&train);
    let valid_indices = MnistIndices::of(&valid);
    let loader_train = DataLoaderBuilder::<B, _, _>::new(MnistBatcher::new(Arc::new(train)))
        .batch_size(config.batch_size)
        .shuffle(config.seed)
        .set_device(device.clone())
        .build(train_indices);
    let loader_valid =
        DataLoaderBuilder::<B::InnerBackend, _, _>::new(MnistBatcher::new(Arc::new(valid)))
            .batch_size(config.batch_size)
            .set_device(device.clone())
            .build(valid_indices);

    let mut training = SupervisedTraining::new(artifact_dir, loader_train, loader_valid)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .metrics(memory_metrics)
        .num_epochs(config.epochs)
        .summary();
    if let Some(renderer) = renderer {
        training = training.renderer(renderer);
    }
    let model = Model::<B>::new(config.model, &device);
    let optimizer = AdamConfig::new().init::<B, Model<B>>();
    let result = training.launch(Learner::new(model, optimizer, config.learning_rate));
    drop(result.model);

    let mut written = Vec::new();
    for path in &files.snapshots {
        write_snapshot(&device, path)?;
        written.push(path.clone());
    }
    if let Some(path) = &files.viewer {
        dump_html(&device, path)?;
        written.push(path.clone());
    }
    Ok(Outcome {
        files: written,
        stats: memory_stats(&device),
        renderer: result.renderer,
    })
}

/// A snapshot of `device` at `path`: JSON for `.json`, PyTorch's pickle otherwise.
fn write_snapshot<Dev: CachingDevice>(device: &Dev, path: &Path) -> Result<(), RunError> {
    if path.extension().is_none_or(|e| e != "json") {
        return Ok(dump_snapshot(device, path)?);
    }
    let json = serde_json::to_string(&memory_snapshot(device))
        .map_err(|e| RunError::Json(e.to_string()))?;
    std::fs::write(path, json).map_err(|source| {
        RunError::Write(InspectError {
            path: path.to_path_buf(),
            source,
        })
    })
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::backend::Autodiff;
    use burn::backend::wgpu::WgpuDevice;
    use burn_caching_alloc::backend::CachingWgpuUnfused;

    fn set(images: usize) -> MnistSet {
        MnistSet {
            images: vec![0; images * mnist::dataset::IMAGE_PIXELS],
            labels: vec![0; images],
        }
    }

    fn refusal(train: MnistSet, valid: MnistSet, batch_size: usize) -> String {
        let config = TrainingConfig {
            batch_size,
            ..TrainingConfig::default()
        };
        let outcome = run::<Autodiff<CachingWgpuUnfused>>(
            WgpuDevice::DefaultDevice,
            train,
            valid,
            &config,
            Path::new("/nonexistent/mnist-train"),
            Dashboard::Text,
            &MemoryFiles::default(),
        );
        match outcome {
            Err(RunError::BadInput(message)) => message,
            Err(other) => panic!("expected BadInput, got {other}"),
            Ok(_) => panic!("expected BadInput, the run trained"),
        }
    }

    // Refused before the device is opened or burn-train starts: no adapter is needed.
    #[test]
    fn an_empty_split_or_a_batch_of_zero_is_refused_with_what_is_wrong() {
        assert_eq!(
            refusal(set(0), set(4), 64),
            "nothing to train on: 0 training and 4 validation images"
        );
        assert_eq!(
            refusal(set(4), set(0), 64),
            "nothing to train on: 4 training and 0 validation images"
        );
        assert_eq!(
            refusal(set(4), set(4), 0),
            "the batch size must be at least 1"
        );
    }
}
