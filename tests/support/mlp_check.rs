//! The Burn MLP check both backend tests run: a small MLP trains on synthetic data, the loss
//! falls by 10x, reserved memory stops growing after the first steps, and after everything
//! is dropped and `empty_cache` runs, neither layer holds a byte.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingDevice};

/// Features per input row.
pub const INPUTS: usize = 16;
/// Steps after which reserved memory must not grow any more.
const WARMUP: usize = 5;

/// The size of the run.
pub struct MlpShape {
    pub hidden: usize,
    pub batch: usize,
    pub steps: usize,
}

/// Three linear layers with ReLU between: `INPUTS` -> hidden -> hidden -> 1.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    input: Linear<B>,
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Mlp<B> {
    pub fn new(hidden: usize, device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(INPUTS, hidden).init(device),
            hidden: LinearConfig::new(hidden, hidden).init(device),
            output: LinearConfig::new(hidden, 1).init(device),
            activation: Relu::new(),
        }
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.activation.forward(self.input.forward(x));
        let x = self.activation.forward(self.hidden.forward(x));
        self.output.forward(x)
    }
}

/// Deterministic pseudo-random numbers in [-1, 1) (no backend RNG, so data never varies).
pub fn lcg(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Inputs and the targets of a fixed nonlinear teacher: y = sin(x . w) + 0.5 * x0 * x1.
fn dataset(batch: usize) -> (Vec<f32>, Vec<f32>) {
    let x = lcg(1, batch * INPUTS);
    let w = lcg(2, INPUTS);
    let y = x
        .chunks(INPUTS)
        .map(|row| {
            let dot: f32 = row.iter().zip(&w).map(|(a, b)| a * b).sum();
            dot.sin() + 0.5 * row[0] * row[1]
        })
        .collect();
    (x, y)
}

/// Trains on `device` and asserts the loss, the reserved-memory plateau and the final release.
pub fn train_and_check<B>(device: &B::Device, shape: MlpShape)
where
    B: AutodiffBackend,
    B::Device: CachingDevice,
{
    let MlpShape {
        hidden,
        batch,
        steps,
    } = shape;
    // The device may have run other tests of this process: start, as a fresh device does,
    // with nothing cached.
    backend::empty_cache(device);
    B::seed(device, 42);
    let (x, y) = dataset(batch);

    let mut reserved_per_step = Vec::with_capacity(steps);
    let (first_loss, last_loss) = {
        let inputs = Tensor::<B, 2>::from_data(TensorData::new(x, [batch, INPUTS]), device);
        let targets = Tensor::<B, 2>::from_data(TensorData::new(y, [batch, 1]), device);
        let mut model = Mlp::<B>::new(hidden, device);
        let mut optim = AdamConfig::new().init();
        let mut losses = Vec::with_capacity(steps);
        for _ in 0..steps {
            let prediction = model.forward(inputs.clone());
            let loss = (prediction - targets.clone()).powi_scalar(2).mean();
            let value: f32 = loss.clone().into_data().to_vec::<f32>().expect("f32 loss")[0];
            losses.push(value);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
            reserved_per_step.push(backend::memory_stats(device).memory_reserved());
        }
        assert!(
            backend::memory_stats(device).memory_allocated() > 0,
            "the model is live"
        );
        println!("{}", backend::memory_summary(device));
        (losses[0], losses[steps - 1])
    };

    println!(
        "loss {first_loss:.5} -> {last_loss:.5}; reserved after step 1: {} B, after step \
         {WARMUP}: {} B, after step {steps}: {} B",
        reserved_per_step[0],
        reserved_per_step[WARMUP - 1],
        reserved_per_step[steps - 1]
    );
    assert!(
        last_loss < first_loss / 10.0,
        "loss {first_loss} -> {last_loss}"
    );
    let settled = reserved_per_step[WARMUP - 1];
    for (step, bytes) in reserved_per_step.iter().enumerate().skip(WARMUP) {
        assert_eq!(*bytes, settled, "reserved grew at step {}", step + 1);
    }

    // Model, optimizer state, data and graph are dropped: nothing is live; empty_cache hands
    // every cached byte of both layers back to the device.
    backend::empty_cache(device);
    let stats = backend::memory_stats(device);
    assert_eq!(stats.memory_allocated(), 0, "{:?}", stats.cubecl);
    assert_eq!(
        stats.memory_reserved(),
        0,
        "{}",
        backend::memory_summary(device)
    );
    assert_eq!(stats.cached_in_cubecl(), 0);
}
