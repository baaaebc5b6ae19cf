//! A small MLP trains on `Autodiff<CachingCuda>`: the loss falls, reserved memory stops growing
//! after the first steps, and after everything is dropped and `empty_cache` runs, no memory is
//! reserved. Skips, saying why, without a CUDA device.
#![cfg(feature = "cuda")]

use burn::backend::Autodiff;
use burn::backend::cuda::CudaDevice;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingCuda};
use burn_caching_alloc::device::cuda::cuda_available;

type B = Autodiff<CachingCuda>;

const INPUTS: usize = 16;
const HIDDEN: usize = 64;
const BATCH: usize = 128;
const STEPS: usize = 300;
/// Steps after which reserved memory must not grow any more.
const WARMUP: usize = 5;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    input: Linear<B>,
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(INPUTS, HIDDEN).init(device),
            hidden: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, 1).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.activation.forward(self.input.forward(x));
        let x = self.activation.forward(self.hidden.forward(x));
        self.output.forward(x)
    }
}

/// Deterministic pseudo-random numbers in [-1, 1).
fn lcg(seed: u64, n: usize) -> Vec<f32> {
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

/// Inputs and the targets of a fixed teacher: y = sin(x . w) + 0.5 * x0 * x1.
fn dataset() -> (Vec<f32>, Vec<f32>) {
    let x = lcg(1, BATCH * INPUTS);
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

#[test]
fn mlp_trains_on_caching_cuda_and_memory_settles() {
    if let Err(reason) = cuda_available() {
        eprintln!("skipping: {reason}");
        return;
    }
    let device = CudaDevice::default();
    B::seed(&device, 42);
    let (x, y) = dataset();

    let mut reserved_per_step = Vec::with_capacity(STEPS);
    let (first_loss, last_loss) = {
        let inputs = Tensor::<B, 2>::from_data(TensorData::new(x, [BATCH, INPUTS]), &device);
        let targets = Tensor::<B, 2>::from_data(TensorData::new(y, [BATCH, 1]), &device);
        let mut model = Mlp::<B>::new(&device);
        let mut optim = AdamConfig::new().init();
        let mut losses = Vec::with_capacity(STEPS);
        for _ in 0..STEPS {
            let prediction = model.forward(inputs.clone());
            let loss = (prediction - targets.clone()).powi_scalar(2).mean();
            let value: f32 = loss.clone().into_data().to_vec::<f32>().expect("f32 loss")[0];
            losses.push(value);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
            reserved_per_step.push(backend::memory_stats(&device).memory_reserved());
        }
        assert!(backend::memory_stats(&device).memory_allocated() > 0);
        println!("{}", backend::memory_summary(&device));
        (losses[0], losses[STEPS - 1])
    };

    println!(
        "loss {first_loss:.5} -> {last_loss:.5}; reserved after step 1: {} B, after step \
         {WARMUP}: {} B, after step {STEPS}: {} B",
        reserved_per_step[0],
        reserved_per_step[WARMUP - 1],
        reserved_per_step[STEPS - 1]
    );
    assert!(
        last_loss < first_loss / 10.0,
        "loss {first_loss} -> {last_loss}"
    );
    let settled = reserved_per_step[WARMUP - 1];
    for (step, bytes) in reserved_per_step.iter().enumerate().skip(WARMUP) {
        assert_eq!(*bytes, settled, "reserved grew at step {}", step + 1);
    }

    backend::empty_cache(&device);
    let stats = backend::memory_stats(&device);
    assert_eq!(stats.memory_allocated(), 0, "{:?}", stats.cubecl);
    assert_eq!(
        stats.memory_reserved(),
        0,
        "{}",
        backend::memory_summary(&device)
    );
}
