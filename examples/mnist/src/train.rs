//! The training loop: Adam on cross-entropy, one test-set evaluation per
//! epoch, one memory reading per step. Generic over any Burn autodiff backend,
//! so the stock and the caching backends run exactly the same code.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::dataset::{IMAGE_PIXELS, MnistSet};
use super::model::{Classifier, Cnn, Mlp, ModelKind};
use super::probe::MemoryProbe;
use super::report::{EpochReport, TrainReport};

/// What to train and how.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Which classifier.
    pub model: ModelKind,
    /// Passes over the training set.
    pub epochs: usize,
    /// Images per training step.
    pub batch_size: usize,
    /// Images per evaluation batch.
    pub eval_batch_size: usize,
    /// Adam's learning rate.
    pub learning_rate: f64,
    /// Seeds the backend (weight initialisation) and the batch order, so two
    /// runs with the same seed see the same batches.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: ModelKind::Mlp,
            epochs: 1,
            batch_size: 64,
            eval_batch_size: 500,
            learning_rate: 1e-3,
            seed: 42,
        }
    }
}

/// Why training could not run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A configuration value that cannot work.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The backend failed while executing (for example out of memory).
    #[error("backend failed during {during}: {message}")]
    Backend {
        /// What the loop was doing.
        during: &'static str,
        /// The backend's error.
        message: String,
    },
}

/// Hooks for progress display; every method has an empty default.
pub trait TrainObserver {
    /// An epoch begins with `steps` training steps.
    fn epoch_started(&mut self, _epoch: usize, _steps: usize) {}
    /// A training step was submitted.
    fn step_finished(&mut self, _epoch: usize, _step: usize) {}
    /// An epoch ended (training and evaluation).
    fn epoch_finished(&mut self, _report: &EpochReport) {}
}

/// Observes nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl TrainObserver for Silent {}

/// Trains `config.model` on `train` and evaluates it on `test` after every
/// epoch, reading `probe` after every step.
///
/// `backend` is the name written into the report. The backend is seeded with
/// `config.seed` before the model is built.
pub fn train<B: AutodiffBackend>(
    device: &B::Device,
    backend: &str,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    probe: &mut dyn MemoryProbe,
    observer: &mut dyn TrainObserver,
) -> Result<TrainReport, TrainError> {
    validate(train, test, config)?;
    B::seed(device, config.seed);
    match config.model {
        ModelKind::Mlp => {
            let model = Mlp::<B>::new(device);
            run(model, device, backend, train, test, config, probe, observer)
        }
        ModelKind::Cnn => {
            let model = Cnn::<B>::new(device);
            run(model, device, backend, train, test, config, probe, observer)
        }
    }
}

fn validate(train: &MnistSet, test: &MnistSet, config: &TrainConfig) -> Result<(), TrainError> {
    if train.is_empty() {
        return Err(TrainError::Config("the training set is empty".into()));
    }
    if test.is_empty() {
        return Err(TrainError::Config("the test set is empty".into()));
    }
    if config.batch_size == 0 || config.eval_batch_size == 0 {
        return Err(TrainError::Config("batch sizes must be at least 1".into()));
    }
    if !(config.learning_rate.is_finite() && config.learning_rate > 0.0) {
        return Err(TrainError::Config(format!(
            "learning rate must be a positive number, got {}",
            config.learning_rate
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run<B, M>(
    mut model: M,
    device: &B::Device,
    backend: &str,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    probe: &mut dyn MemoryProbe,
    observer: &mut dyn TrainObserver,
) -> Result<TrainReport, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Classifier<B>,
    M::InnerModule: Classifier<B::InnerBackend>,
{
    let mut optimizer = AdamConfig::new().init::<B, M>();
    let loss_fn = CrossEntropyLossConfig::new().init::<B>(device);
    let mut report = TrainReport {
        backend: backend.to_string(),
        model: config.model.name().to_string(),
        epochs: Vec::with_capacity(config.epochs),
        memory: Default::default(),
        timeline: Vec::new(),
    };

    for epoch in 1..=config.epochs {
        let started = Instant::now();
        let order = batch_order(train.len(), config.seed, epoch);
        let steps = order.len().div_ceil(config.batch_size);
        observer.epoch_started(epoch, steps);

        // Summed on the device and read once per epoch, so steps never wait for the device.
        let mut loss_sum: Option<Tensor<B::InnerBackend, 1>> = None;
        for (step, indices) in order.chunks(config.batch_size).enumerate() {
            let (images, labels) = batch::<B>(train, indices, device);
            let logits = model.forward(images);
            let loss = loss_fn.forward(logits, labels);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(config.learning_rate, model, grads);

            let weighted = loss.inner().mul_scalar(indices.len() as f64);
            loss_sum = Some(match loss_sum {
                Some(sum) => sum.add(weighted),
                None => weighted,
            });
            if let Some(point) = probe.point() {
                report.timeline.push(point);
            }
            observer.step_finished(epoch, step + 1);
        }
        let loss = match loss_sum {
            Some(sum) => read_f64(sum, "reading the epoch loss")? / train.len() as f64,
            None => f64::NAN,
        };
        let seconds = started.elapsed().as_secs_f64();
        let accuracy = evaluate::<B::InnerBackend, _>(&model.valid(), test, config, device)?;
        let epoch_report = EpochReport {
            epoch,
            loss,
            accuracy,
            seconds,
        };
        observer.epoch_finished(&epoch_report);
        report.epochs.push(epoch_report);
    }
    report.memory = probe.totals();
    Ok(report)
}

/// Share of `test` the model classifies correctly.
pub fn evaluate<B: Backend, M: Classifier<B>>(
    model: &M,
    test: &MnistSet,
    config: &TrainConfig,
    device: &B::Device,
) -> Result<f64, TrainError> {
    let order: Vec<usize> = (0..test.len()).collect();
    let mut correct: Option<Tensor<B, 1, Int>> = None;
    for indices in order.chunks(config.eval_batch_size) {
        let (images, labels) = batch::<B>(test, indices, device);
        let predicted = model.forward(images).argmax(1).reshape([indices.len()]);
        let hits = predicted.equal(labels).int().sum();
        correct = Some(match correct {
            Some(sum) => sum.add(hits),
            None => hits,
        });
    }
    let correct = match correct {
        Some(sum) => sum
            .try_into_scalar()
            .map_err(|e| backend_error("reading the test accuracy", e))?
            .elem::<i64>(),
        None => 0,
    };
    Ok(correct as f64 / test.len() as f64)
}

/// The training order for one epoch: a permutation of `0..len` fixed by
/// `(seed, epoch)`, so every backend sees the same batches.
pub fn batch_order(len: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = StdRng::seed_from_u64(
        seed.wrapping_add((epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
    );
    order.shuffle(&mut rng);
    order
}

/// Images `[n, 784]` and labels `[n]` of the given items, on `device`.
fn batch<B: Backend>(
    set: &MnistSet,
    indices: &[usize],
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let n = indices.len();
    let images = TensorData::new(set.normalized_pixels(indices), [n, IMAGE_PIXELS]);
    let labels = TensorData::new(set.labels_of(indices), [n]);
    (
        Tensor::from_data(images, device),
        Tensor::from_data(labels, device),
    )
}

fn read_f64<B: Backend>(tensor: Tensor<B, 1>, during: &'static str) -> Result<f64, TrainError> {
    let value = tensor
        .try_into_scalar()
        .map_err(|e| backend_error(during, e))?;
    Ok(value.elem::<f64>())
}

fn backend_error(during: &'static str, error: impl std::fmt::Debug) -> TrainError {
    TrainError::Backend {
        during,
        message: format!("{error:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::batch_order;

    #[test]
    fn batch_order_is_a_permutation_fixed_by_seed_and_epoch() {
        let a = batch_order(1000, 7, 1);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_eq!(a, batch_order(1000, 7, 1));
        assert_ne!(a, batch_order(1000, 7, 2));
        assert_ne!(a, batch_order(1000, 8, 1));
    }
}
