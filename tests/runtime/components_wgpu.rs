//! The components of a training loop's memory (`backend::Components`): a small model trained
//! with Adam on the fused `CachingWgpu` (lavapipe in CI) reports its parameters' bytes (its
//! parameter count times four, in blocks) and Adam's state as twice that (two moments per
//! parameter), the gradients consumed by the step, and every `component_bytes.*` key.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_caching_alloc::backend::{self, CachingWgpu, Components};

use crate::support::lavapipe::cpu_device;

type AB = Autodiff<CachingWgpu>;

#[derive(Module, Debug)]
struct Small<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Small<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(96, 48).init(device),
            output: LinearConfig::new(48, 10).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.output
            .forward(self.activation.forward(self.hidden.forward(x)))
    }
}

/// The engine block of `bytes` (a multiple of 512, at least 512: PyTorch's small-pool rounding).
fn block(bytes: u64) -> u64 {
    bytes.div_ceil(512).max(1) * 512
}

#[test]
fn adam_on_a_small_model_reports_parameters_and_twice_them_as_optimizer_state() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let components = Components::new(&device);
    let mut model: Small<AB> = {
        let _parameters = components.parameters();
        Small::new(&device)
    };
    let tracked = components.track(&model);
    let count = model.num_params() as u64;
    assert_eq!(count, 96 * 48 + 48 + 48 * 10 + 10);
    // Each of the four tensors in its own block.
    let expected = block(96 * 48 * 4) + block(48 * 4) + block(48 * 10 * 4) + block(10 * 4);
    assert_eq!(tracked, expected);
    assert!(tracked >= count * 4 && tracked - count * 4 < 4 * 512);

    let before = backend::memory_stats(&device).components.expect("tracked");
    assert_eq!(
        before.parameter, tracked,
        "the parameters, made in their scope"
    );
    assert_eq!(before.optimizer_state, 0);

    let mut optimizer = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    for step in 0..4 {
        let x = Tensor::<AB, 2>::ones([16, 96], &device).mul_scalar(0.01 * (step + 1) as f32);
        let y = Tensor::<AB, 1, Int>::from_data(
            TensorData::new((0..16).map(|i| i % 10).collect::<Vec<i64>>(), [16]),
            &device,
        );
        let loss = {
            let _forward = components.forward();
            loss_fn.forward(model.forward(x), y)
        };
        let grads = {
            let _backward = components.backward();
            GradientsParams::from_grads(loss.backward(), &model)
        };
        let mid = backend::memory_stats(&device).components.expect("tracked");
        assert!(
            mid.gradient >= tracked,
            "step {step}: the gradients of every parameter are live: {mid:?}"
        );
        model = {
            let _step = components.step();
            optimizer.step(1e-3, model, grads)
        };
        let after = backend::memory_stats(&device);
        let bytes = after.components.expect("tracked");
        println!("step {step}: {bytes:?}");
        assert_eq!(bytes.parameter, tracked, "step {step}");
        // Adam's two moments, each the shape of its parameter: twice the parameters' blocks,
        // give or take the rounding of tensors CubeCL places together in one block.
        let state = bytes.optimizer_state;
        assert!(
            state.abs_diff(2 * tracked) <= 4 * 512,
            "step {step}: optimizer state {state} B, parameters {tracked} B: {bytes:?}"
        );
        assert_eq!(
            bytes.gradient, 0,
            "step {step}: the step consumed the gradients"
        );
        let map = after.to_map();
        for key in [
            "component_bytes.parameter",
            "component_bytes.gradient",
            "component_bytes.optimizer_state",
            "component_bytes.activation",
            "component_bytes.other",
        ] {
            assert!(map.contains_key(key), "{key}");
        }
        assert_eq!(
            bytes.parameter
                + bytes.gradient
                + bytes.optimizer_state
                + bytes.activation
                + bytes.other,
            after.memory_allocated()
        );
    }
    drop((model, optimizer));
    backend::empty_cache(&device);
}
