//! (c) A small conv net (Conv2d + ReLU + max pool, twice, then a linear head) trained on images
//! whose size (16, 24 or 32 square) and batch (4 or 8) vary per step.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::init::HostInit;
use crate::measure::Workload;
use crate::rng::Rng;

const CLASSES: usize = 10;

#[derive(Module, Debug)]
struct Model {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    squeeze: AdaptiveAvgPool2d,
    activation: Relu,
    head: Linear,
}

impl Model {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self
            .pool
            .forward(self.activation.forward(self.conv1.forward(images)));
        let x = self
            .pool
            .forward(self.activation.forward(self.conv2.forward(x)));
        let [batch, channels, _, _] = x.dims();
        self.head
            .forward(self.squeeze.forward(x).reshape([batch, channels]))
    }
}

pub struct ConvNet {
    device: Device,
    model: Option<Model>,
    optim: ModuleOptimizer,
    rng: Rng,
}

impl ConvNet {
    pub fn new(device: &Device, seed: u64) -> Self {
        let device = device.clone().autodiff();
        let conv = |from, to| {
            Conv2dConfig::new([from, to], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(&device)
        };
        let model = Model {
            conv1: conv(1, 8),
            conv2: conv(8, 16),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            squeeze: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            activation: Relu::new(),
            head: LinearConfig::new(16, CLASSES).init(&device),
        }
        .map(&mut HostInit::new(seed));
        Self {
            device,
            model: Some(model),
            optim: SgdConfig::new().init(),
            rng: Rng::new(seed),
        }
    }
}

impl Workload for ConvNet {
    fn step(&mut self, _step: usize) -> f32 {
        let batch = 4 * self.rng.range(1, 2);
        let side = 8 * self.rng.range(2, 4);
        let images = TensorData::new(self.rng.floats(batch * side * side), [batch, 1, side, side]);
        let labels = TensorData::new(self.rng.labels(batch, CLASSES), [batch]);
        let images = Tensor::<4>::from_data(images, &self.device);
        let labels = Tensor::<1, Int>::from_data(labels, &self.device);

        let model = self.model.take().expect("model");
        let loss = CrossEntropyLossConfig::new()
            .init(&self.device)
            .forward(model.forward(images), labels);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        self.model = Some(self.optim.step(0.05, model, grads));
        loss.into_scalar::<f32>()
    }
}
