//! burn-train's `SupervisedTraining` launched end to end on two caching wgpu devices
//! (lavapipe in CI) with `ExecutionStrategy::MultiDevice(.., OptimMainDevice)` and, with
//! feature `distributed`, `ExecutionStrategy::DistributedDataParallel` (gradients all-reduced
//! with `DistributedBackend::all_reduce`), each against the same run with `SingleDevice`: a
//! linear regression every run solves, so their last-epoch losses agree within a small
//! tolerance (the runs take different steps: `MultiDevice` sums two half-size batches'
//! gradients, DDP averages them).

use std::sync::Mutex;

use burn::backend::Autodiff;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu};
use burn_train::renderer::CliMetricsRenderer;
use burn_train::{
    ExecutionStrategy, InferenceStep, Learner, MultiDeviceOptim, RegressionOutput,
    SupervisedTraining, TrainOutput, TrainStep,
};

use crate::multi_device_wgpu::two_devices;

type B = Autodiff<CachingWgpu>;

const INPUTS: usize = 4;
const ITEMS: usize = 256;
const BATCH: usize = 32;
const EPOCHS: usize = 12;

/// Every training step's loss, in the order the steps ran (any device).
static LOSSES: Mutex<Vec<f32>> = Mutex::new(Vec::new());

#[derive(Clone, Debug)]
struct Item {
    x: [f32; INPUTS],
    y: f32,
}

#[derive(Clone, Debug)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 2>,
}

#[derive(Clone, Default)]
struct ItemBatcher;

impl<B: Backend> Batcher<B, Item, Batch<B>> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|item| item.x).collect();
        let y: Vec<f32> = items.iter().map(|item| item.y).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, INPUTS]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
        }
    }
}

#[derive(Module, Debug)]
struct Regression<B: Backend> {
    linear: Linear<B>,
}

impl<B: Backend> Regression<B> {
    fn regress(&self, batch: Batch<B>) -> RegressionOutput<B> {
        let output = self.linear.forward(batch.x);
        let loss = MseLoss::new().forward(output.clone(), batch.y.clone(), Reduction::Mean);
        RegressionOutput {
            loss,
            output,
            targets: batch.y,
        }
    }
}

impl<B: AutodiffBackend> TrainStep for Regression<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
        let item = self.regress(batch);
        let loss = item.loss.clone().into_data().to_vec::<f32>().unwrap()[0];
        LOSSES.lock().unwrap().push(loss);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Regression<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Batch<B>) -> RegressionOutput<B> {
        self.regress(batch)
    }
}

/// y = x . [1, -2, 0.5, 3] + 0.25 on deterministic inputs in [-1, 1).
fn items() -> Vec<Item> {
    let mut state = 11u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    (0..ITEMS)
        .map(|_| {
            let x = [next(), next(), next(), next()];
            let y = x[0] - 2.0 * x[1] + 0.5 * x[2] + 3.0 * x[3] + 0.25;
            Item { x, y }
        })
        .collect()
}

/// Trains `model` with `strategy`; returns every step's loss.
fn train(model: Regression<B>, strategy: ExecutionStrategy<B>, name: &str) -> Vec<f32> {
    LOSSES.lock().unwrap().clear();
    let train = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(BATCH)
        .build(InMemDataset::new(items()));
    let valid = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(BATCH)
        .build(InMemDataset::new(items()));
    let dir = std::env::temp_dir().join(format!(
        "burn-caching-alloc-learner-{name}-{}",
        std::process::id()
    ));
    let learner = Learner::new(model, SgdConfig::new().init(), 0.1);
    // burn-train's plain-text renderer: in the workspace build burn-train has `tui` (for
    // examples/mnist-train), and its default renderer would take over a developer's terminal.
    let _ = SupervisedTraining::new(&dir, train, valid)
        .renderer(CliMetricsRenderer::new())
        .num_epochs(EPOCHS)
        .with_training_strategy(strategy.into())
        .launch(learner);
    let _ = std::fs::remove_dir_all(&dir);
    std::mem::take(&mut *LOSSES.lock().unwrap())
}

fn mean(values: &[f32]) -> f32 {
    values.iter().sum::<f32>() / values.len() as f32
}

/// A model with its parameters initialised (they initialise lazily, on first use): clones of
/// it start from the same parameters.
fn model(device: &burn::backend::wgpu::WgpuDevice) -> Regression<B> {
    let model = Regression::<B> {
        linear: LinearConfig::new(INPUTS, 1).init(device),
    };
    let _ = model.linear.weight.val();
    let _ = model.linear.bias.as_ref().map(|bias| bias.val());
    model
}

/// The one-device run and the two-device run agree: every batch ran once, both learn, and
/// their last-epoch losses are within 2% of the first-epoch loss of each other.
fn compare(single: &[f32], multi: &[f32], what: &str) {
    let steps_per_epoch = ITEMS / BATCH;
    assert_eq!(single.len(), EPOCHS * steps_per_epoch);
    assert_eq!(
        multi.len(),
        EPOCHS * steps_per_epoch,
        "{what}: every batch ran once"
    );
    let (single_first, multi_first) = (mean(&single[..8]), mean(&multi[..8]));
    let (single_last, multi_last) = (
        mean(&single[single.len() - steps_per_epoch..]),
        mean(&multi[multi.len() - steps_per_epoch..]),
    );
    println!(
        "{what}: first-epoch loss: one device {single_first:.6}, two devices {multi_first:.6}; \
         last-epoch loss: one device {single_last:.6}, two devices {multi_last:.6}"
    );
    assert!(
        single_last < single_first / 20.0,
        "one device did not learn"
    );
    assert!(
        multi_last < multi_first / 20.0,
        "{what}: two devices did not learn"
    );
    assert!(
        (single_last - multi_last).abs() <= 0.02 * single_first,
        "{what}: last-epoch losses: one device {single_last}, two devices {multi_last}"
    );
}

/// Trains with `strategy` on `main` and `second` and with one device; compares the runs and
/// the second device's allocator use.
fn against_one_device(
    main: &burn::backend::wgpu::WgpuDevice,
    second: &burn::backend::wgpu::WgpuDevice,
    strategy: ExecutionStrategy<B>,
    what: &str,
) {
    backend::empty_cache(main);
    backend::empty_cache(second);
    backend::reset_peak_memory_stats(main);
    backend::reset_peak_memory_stats(second);
    let model = model(main);
    let single = train(
        model.clone(),
        ExecutionStrategy::single(main.clone()),
        "single",
    );
    let multi = train(model, strategy, what);
    compare(&single, &multi, what);
    let (main_stats, second_stats) = (backend::memory_stats(main), backend::memory_stats(second));
    println!(
        "{what}: peak reserved: main {} B, second {} B",
        main_stats.max_memory_reserved(),
        second_stats.max_memory_reserved()
    );
    // The second device trained through its own allocator.
    assert!(second_stats.max_memory_reserved() > 0);
    backend::empty_cache(main);
    backend::empty_cache(second);
}

#[test]
fn burn_trains_multi_device_on_two_caching_devices_like_one_device() {
    let Some((main, second, _turn)) = two_devices() else {
        return;
    };
    let strategy = ExecutionStrategy::multi(
        vec![main.clone(), second.clone()],
        MultiDeviceOptim::OptimMainDevice,
    );
    against_one_device(&main, &second, strategy, "MultiDevice");
}

#[cfg(feature = "distributed")]
#[test]
fn burn_trains_distributed_data_parallel_on_two_caching_devices_like_one_device() {
    use burn::tensor::backend::distributed::{DistributedConfig, ReduceOperation};
    let Some((main, second, _turn)) = two_devices() else {
        return;
    };
    let config = DistributedConfig {
        all_reduce_op: ReduceOperation::Mean,
    };
    let strategy = ExecutionStrategy::ddp(vec![main.clone(), second.clone()], config);
    against_one_device(&main, &second, strategy, "DDP");
}
