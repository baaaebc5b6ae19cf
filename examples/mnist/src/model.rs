//! The two MNIST classifiers: a multilayer perceptron and a small CNN.
//!
//! Both take a batch of flattened images `[batch, 784]` and return logits
//! `[batch, 10]`, so the training loop is the same for both.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;

use super::dataset::{IMAGE_PIXELS, IMAGE_SIDE, NUM_CLASSES};

/// Which classifier to train (also the `--model` value of both MNIST binaries).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// 784 -> 128 -> 10 perceptron with ReLU.
    Mlp,
    /// Two 3x3 convolutions with max pooling, then two linear layers.
    Cnn,
}

impl ModelKind {
    /// Lower-case name, as on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
        }
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A module that maps flattened images `[batch, 784]` to logits `[batch, 10]`.
pub trait Classifier<B: Backend>: Module<B> {
    /// Logits for a batch of normalised, flattened images.
    fn forward(&self, images: Tensor<B, 2>) -> Tensor<B, 2>;
}

/// Hidden width of the perceptron.
const MLP_HIDDEN: usize = 128;

/// 784 -> 128 -> 10 perceptron with ReLU.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Mlp<B> {
    /// A freshly initialised perceptron (uses the backend's seeded RNG).
    pub fn new(device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(IMAGE_PIXELS, MLP_HIDDEN).init(device),
            output: LinearConfig::new(MLP_HIDDEN, NUM_CLASSES).init(device),
            activation: Relu::new(),
        }
    }
}

impl<B: Backend> Classifier<B> for Mlp<B> {
    fn forward(&self, images: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.activation.forward(self.hidden.forward(images));
        self.output.forward(x)
    }
}

/// Channels after the first and second convolution, and the width of the
/// hidden linear layer.
const CNN_CHANNELS: [usize; 2] = [8, 16];
const CNN_HIDDEN: usize = 64;
/// Side of the feature map after conv(3) -> pool(2) -> conv(3) -> pool(2): 28 -> 26 -> 13 -> 11 -> 5.
const CNN_FEATURE_SIDE: usize = 5;

/// conv 3x3 (8) -> ReLU -> max pool 2 -> conv 3x3 (16) -> ReLU -> max pool 2
/// -> linear 400 -> 64 -> ReLU -> linear 64 -> 10.
#[derive(Module, Debug)]
pub struct Cnn<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    pool: MaxPool2d,
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Cnn<B> {
    /// A freshly initialised CNN (uses the backend's seeded RNG).
    pub fn new(device: &B::Device) -> Self {
        let features = CNN_CHANNELS[1] * CNN_FEATURE_SIDE * CNN_FEATURE_SIDE;
        Self {
            conv1: Conv2dConfig::new([1, CNN_CHANNELS[0]], [3, 3]).init(device),
            conv2: Conv2dConfig::new(CNN_CHANNELS, [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            hidden: LinearConfig::new(features, CNN_HIDDEN).init(device),
            output: LinearConfig::new(CNN_HIDDEN, NUM_CLASSES).init(device),
            activation: Relu::new(),
        }
    }
}

impl<B: Backend> Classifier<B> for Cnn<B> {
    fn forward(&self, images: Tensor<B, 2>) -> Tensor<B, 2> {
        let [batch, _] = images.dims();
        let x = images.reshape([batch, 1, IMAGE_SIDE, IMAGE_SIDE]);
        let x = self
            .pool
            .forward(self.activation.forward(self.conv1.forward(x)));
        let x = self
            .pool
            .forward(self.activation.forward(self.conv2.forward(x)));
        let x = x.flatten(1, 3);
        let x = self.activation.forward(self.hidden.forward(x));
        self.output.forward(x)
    }
}
