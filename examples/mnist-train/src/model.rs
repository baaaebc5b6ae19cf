//! `examples/mnist`'s classifiers as burn-train trains them: one [`Model`] for both, with the
//! training and validation steps burn-train calls ([`TrainStep`], [`InferenceStep`]).

use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn_train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use mnist::ModelKind;
use mnist::model::{Classifier, Cnn, Mlp};

use super::data::MnistBatch;

/// The perceptron or the CNN of `examples/mnist`.
// One model per run, moved a handful of times: the size difference costs nothing worth a box
// (which `#[derive(Module)]` would not see through).
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Model<B: Backend> {
    /// 784 -> 128 -> 10 perceptron with ReLU.
    Mlp(Mlp<B>),
    /// Two 3x3 convolutions with max pooling, then two linear layers.
    Cnn(Cnn<B>),
}

impl<B: Backend> Model<B> {
    /// A freshly initialised model of `kind` (from the backend's seeded RNG).
    pub fn new(kind: ModelKind, device: &B::Device) -> Self {
        match kind {
            ModelKind::Mlp => Model::Mlp(Mlp::new(device)),
            ModelKind::Cnn => Model::Cnn(Cnn::new(device)),
        }
    }

    /// Logits `[batch, 10]` of flattened images `[batch, 784]`.
    pub fn forward(&self, images: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Model::Mlp(net) => net.forward(images),
            Model::Cnn(net) => net.forward(images),
        }
    }

    /// The logits and the cross-entropy loss of a batch, as burn-train's classification
    /// metrics read them.
    pub fn forward_classification(&self, batch: MnistBatch<B>) -> ClassificationOutput<B> {
        let output = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl<B: AutodiffBackend> TrainStep for Model<B> {
    type Input = MnistBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: MnistBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Model<B> {
    type Input = MnistBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: MnistBatch<B>) -> ClassificationOutput<B> {
        self.forward_classification(batch)
    }
}
