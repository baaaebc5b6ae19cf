//! Data-parallel training on two caching wgpu devices (lavapipe in CI), step by step as
//! burn-train's `MultiDevice` strategy with `MultiDeviceOptim::OptimMainDevice` runs it
//! (burn-train 0.21 `learner/supervised/strategies/multi/epoch.rs`): the model forked onto
//! the second device (`Module::fork`), a forward and backward pass on each device's half of
//! the batch, the second device's gradients moved to the main device
//! (`GradientsParams::to_device`), summed (`GradientsAccumulator`) and applied there. With SGD
//! and half the learning rate, that is the single-device step on the whole batch, so the two
//! runs' losses agree step by step.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu};

use crate::multi_device_wgpu::two_devices;
use crate::support::mlp_check::lcg;

type B = Autodiff<CachingWgpu>;
type Device = burn::backend::wgpu::WgpuDevice;

const INPUTS: usize = 8;
const BATCH: usize = 64;
const STEPS: usize = 30;
const LR: f64 = 0.05;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Net<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.second
            .forward(self.activation.forward(self.first.forward(x)))
    }
}

fn batch(device: &Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x = lcg(7, BATCH * INPUTS);
    let y: Vec<f32> = x
        .chunks(INPUTS)
        .map(|row| {
            row.iter()
                .enumerate()
                .map(|(i, v)| v * (i as f32 - 3.5))
                .sum::<f32>()
        })
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [BATCH, INPUTS]), device),
        Tensor::from_data(TensorData::new(y, [BATCH, 1]), device),
    )
}

fn scalar(loss: &Tensor<B, 1>) -> f32 {
    loss.clone().into_data().to_vec::<f32>().unwrap()[0]
}

fn mse(out: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
    MseLoss::new().forward(out, y, Reduction::Mean)
}

fn single_device(mut model: Net<B>, device: &Device) -> Vec<f32> {
    let (x, y) = batch(device);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let loss = mse(model.forward(x.clone()), y.clone());
        losses.push(scalar(&loss));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    losses
}

fn two_device(mut model: Net<B>, main: &Device, second: &Device) -> Vec<f32> {
    let (x, y) = batch(main);
    let half = BATCH / 2;
    let (x_main, y_main) = (x.clone().narrow(0, 0, half), y.clone().narrow(0, 0, half));
    // The second device's half lives there, as its data loader would put it.
    let x_second = x.narrow(0, half, BATCH - half).to_device(second);
    let y_second = y.narrow(0, half, BATCH - half).to_device(second);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let forked = model.clone().fork(second);
        let loss_main = mse(model.forward(x_main.clone()), y_main.clone());
        let loss_second = mse(forked.forward(x_second.clone()), y_second.clone());
        losses.push((scalar(&loss_main) + scalar(&loss_second)) / 2.0);
        let grads_main = GradientsParams::from_grads(loss_main.backward(), &model);
        let grads_second =
            GradientsParams::from_grads(loss_second.backward(), &forked).to_device(main, &model);
        let mut accumulator = GradientsAccumulator::new();
        accumulator.accumulate(&model, grads_main);
        accumulator.accumulate(&model, grads_second);
        // The sum of two half-batch mean gradients is twice the whole batch's.
        model = optim.step(LR / 2.0, model, accumulator.grads());
    }
    losses
}

#[test]
fn two_device_data_parallel_training_matches_one_device_step_by_step() {
    let Some((main, second, _turn)) = two_devices() else {
        return;
    };
    backend::empty_cache(&main);
    backend::empty_cache(&second);
    backend::reset_peak_memory_stats(&main);
    backend::reset_peak_memory_stats(&second);
    let second_before = backend::memory_stats(&second);

    let model = Net::<B> {
        first: LinearConfig::new(INPUTS, 32).init(&main),
        second: LinearConfig::new(32, 1).init(&main),
        activation: Relu::new(),
    };
    // Parameters initialise lazily, on first use: without this, each clone would draw its own.
    let _ = (model.first.weight.val(), model.second.weight.val());
    let _ = (
        model.first.bias.as_ref().map(|b| b.val()),
        model.second.bias.as_ref().map(|b| b.val()),
    );
    let single = single_device(model.clone(), &main);
    let multi = two_device(model, &main, &second);
    B::sync(&main).expect("sync");
    B::sync(&second).expect("sync");

    for (step, (one, two)) in single.iter().zip(&multi).enumerate() {
        println!("step {step:2}: one device {one:.6}, two devices {two:.6}");
        assert!(
            (one - two).abs() <= 1e-3 * one.abs().max(1.0),
            "step {step}: one device {one}, two devices {two}"
        );
    }
    assert!(
        single[STEPS - 1] < single[0] / 4.0,
        "the loss fell from {} to {}",
        single[0],
        single[STEPS - 1]
    );

    let main_stats = backend::memory_stats(&main);
    let second_stats = backend::memory_stats(&second);
    println!(
        "peak reserved: main {} B, second {} B; second now allocates {} B",
        main_stats.max_memory_reserved(),
        second_stats.max_memory_reserved(),
        second_stats.memory_allocated()
    );
    // Both devices did work through their own allocator.
    assert!(main_stats.max_memory_reserved() > 0);
    assert!(second_stats.max_memory_reserved() > 0);
    assert!(
        second_stats.engine.allocation.all.allocated
            > second_before.engine.allocation.all.allocated
    );
    // Everything of the run is dropped: the second device's cache empties on its own call.
    backend::empty_cache(&second);
    assert_eq!(
        backend::memory_stats(&second).memory_reserved(),
        second_before.memory_reserved()
    );
    backend::empty_cache(&main);
}
