//! The networks, each mapping a rank-3 batch (see [`Batch`](crate::Batch)) to logits
//! `[batch, classes]`. Burn 0.21's own `nn` modules throughout: the point is Burn's real
//! allocation sequences, not accuracy.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, Lstm, LstmConfig, Relu};
use burn::prelude::*;

use crate::workload::{CLASSES, CONV_SIDE, LSTM_D_INPUT, TRANSFORMER_D_MODEL, Workload};

/// A network of the benchmark.
pub trait Net<B: Backend>: Module<B> {
    /// Logits `[batch, classes]` of a rank-3 batch.
    fn logits(&self, inputs: Tensor<B, 3>) -> Tensor<B, 2>;
}

/// `TransformerEncoder` (2 layers, 4 heads, feed-forward 256), mean over the sequence, linear.
#[derive(Module, Debug)]
pub struct TransformerNet<B: Backend> {
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl<B: Backend> TransformerNet<B> {
    /// A freshly initialised network (the backend's seeded RNG): `d_model` 64, feed-forward 256.
    pub fn new(device: &B::Device) -> Self {
        Self::sized(TRANSFORMER_D_MODEL, 256, 4, device)
    }

    /// The same network with `d_model` `width`, a feed-forward layer of `ff` and `heads`
    /// attention heads.
    pub fn sized(width: usize, ff: usize, heads: usize, device: &B::Device) -> Self {
        Self {
            encoder: TransformerEncoderConfig::new(width, ff, heads, 2).init(device),
            head: LinearConfig::new(width, CLASSES).init(device),
        }
    }
}

impl<B: Backend> Net<B> for TransformerNet<B> {
    fn logits(&self, inputs: Tensor<B, 3>) -> Tensor<B, 2> {
        let encoded = self.encoder.forward(TransformerEncoderInput::new(inputs));
        let pooled: Tensor<B, 2> = encoded.mean_dim(1).squeeze_dim(1);
        self.head.forward(pooled)
    }
}

/// conv 3x3 (3 -> 16), ReLU, max pool 2, conv 3x3 (16 -> 32), ReLU, adaptive average pool to
/// 1 x 1, linear 32 -> 10.
#[derive(Module, Debug)]
pub struct ConvNet<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    pool: MaxPool2d,
    squeeze: AdaptiveAvgPool2d,
    head: Linear<B>,
    activation: Relu,
}

impl<B: Backend> ConvNet<B> {
    /// A freshly initialised network (the backend's seeded RNG).
    pub fn new(device: &B::Device) -> Self {
        Self {
            conv1: Conv2dConfig::new([3, 16], [3, 3]).init(device),
            conv2: Conv2dConfig::new([16, 32], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            squeeze: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }
}

impl<B: Backend> Net<B> for ConvNet<B> {
    fn logits(&self, inputs: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, _, _] = inputs.dims();
        let x = inputs.reshape([batch, 3, CONV_SIDE, CONV_SIDE]);
        let x = self
            .pool
            .forward(self.activation.forward(self.conv1.forward(x)));
        let x = self.activation.forward(self.conv2.forward(x));
        let x: Tensor<B, 2> = self.squeeze.forward(x).flatten(1, 3);
        self.head.forward(x)
    }
}

/// LSTM (input 32, hidden 64), its output at the last step through a linear layer.
#[derive(Module, Debug)]
pub struct LstmNet<B: Backend> {
    lstm: Lstm<B>,
    head: Linear<B>,
}

impl<B: Backend> LstmNet<B> {
    /// A freshly initialised network (the backend's seeded RNG).
    pub fn new(device: &B::Device) -> Self {
        Self {
            lstm: LstmConfig::new(LSTM_D_INPUT, 64, true).init(device),
            head: LinearConfig::new(64, CLASSES).init(device),
        }
    }
}

impl<B: Backend> Net<B> for LstmNet<B> {
    fn logits(&self, inputs: Tensor<B, 3>) -> Tensor<B, 2> {
        let (_, state) = self.lstm.forward(inputs, None);
        self.head.forward(state.hidden)
    }
}

/// The MNIST showcase's perceptron (`mnist::model::Mlp`) on flattened images.
#[derive(Module, Debug)]
pub struct MnistMlpNet<B: Backend> {
    mlp: mnist::model::Mlp<B>,
}

impl<B: Backend> MnistMlpNet<B> {
    /// A freshly initialised network (the backend's seeded RNG).
    pub fn new(device: &B::Device) -> Self {
        Self {
            mlp: mnist::model::Mlp::new(device),
        }
    }
}

impl<B: Backend> Net<B> for MnistMlpNet<B> {
    fn logits(&self, inputs: Tensor<B, 3>) -> Tensor<B, 2> {
        use mnist::model::Classifier;
        let [batch, _, pixels] = inputs.dims();
        self.mlp.forward(inputs.reshape([batch, pixels]))
    }
}

/// Which network a workload trains (for documentation and the report).
pub fn describe(workload: Workload) -> String {
    match workload {
        Workload::TransformerVarlen => {
            "TransformerEncoder 2 x d64 h4 ff256, seq 16..=128, batch 8".into()
        }
        Workload::Conv => "Conv2d 3-16-32, pools, linear, 32 x 32 RGB, batch 16".into(),
        Workload::Lstm => "Lstm 32 -> 64, 24 steps, linear, batch 16".into(),
        Workload::MnistMlp => "MNIST MLP 784-128-10, batch 64".into(),
        Workload::MnistLoader => format!(
            "MNIST MLP 784-128-10, a step an epoch of {} images in batches of {} from {} new \
             loader threads",
            crate::workload::LOADER_EPOCH,
            crate::workload::LOADER_BATCH,
            crate::workload::LOADER_WORKERS
        ),
        Workload::Varlen(s) => format!(
            "TransformerEncoder 2 x d{} h{} ff{}, seq {}..={}, batch {}",
            s.width,
            s.heads(),
            s.ff(),
            s.min_len,
            s.max_len,
            s.batch
        ),
    }
}
