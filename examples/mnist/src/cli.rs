//! The command-line options both MNIST binaries share (`mnist` and `examples/mnist-train`):
//! what to train, how long, and on which images. Each binary flattens them into its own
//! options (`#[command(flatten)]`).

use std::path::PathBuf;

use crate::model::ModelKind;

/// What to train, how long, and on which images.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainingArgs {
    /// Classifier to train.
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    pub model: ModelKind,
    /// Passes over the training set.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Images per training step.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Seed for weight initialisation and batch order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Train on the first N training images only.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Evaluate (validate) on the first N test images only.
    #[arg(long)]
    pub test_limit: Option<usize>,
    /// Folder with the four MNIST IDX files (plain or .gz) [default: examples/mnist/data].
    /// Files listed in its SHA256SUMS, if it has one, are checked before use.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
}
