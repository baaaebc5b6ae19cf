//! (a) An MNIST-shaped MLP (784-512-10, batch 64) trained with autodiff and SGD.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::init::HostInit;
use crate::measure::Workload;
use crate::rng::Rng;

const BATCH: usize = 64;
const PIXELS: usize = 784;
const CLASSES: usize = 10;

#[derive(Module, Debug)]
struct Model {
    hidden: Linear,
    activation: Relu,
    output: Linear,
}

pub struct Mlp {
    device: Device,
    model: Option<Model>,
    optim: ModuleOptimizer,
    rng: Rng,
}

impl Mlp {
    pub fn new(device: &Device, seed: u64) -> Self {
        let device = device.clone().autodiff();
        let model = Model {
            hidden: LinearConfig::new(PIXELS, 512).init(&device),
            activation: Relu::new(),
            output: LinearConfig::new(512, CLASSES).init(&device),
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

impl Workload for Mlp {
    fn step(&mut self, _step: usize) -> f32 {
        let images = TensorData::new(self.rng.floats(BATCH * PIXELS), [BATCH, PIXELS]);
        let labels = TensorData::new(self.rng.labels(BATCH, CLASSES), [BATCH]);
        let images = Tensor::<2>::from_data(images, &self.device);
        let labels = Tensor::<1, Int>::from_data(labels, &self.device);

        let model = self.model.take().expect("model");
        let hidden = model.activation.forward(model.hidden.forward(images));
        let logits = model.output.forward(hidden);
        let loss = CrossEntropyLossConfig::new()
            .init(&self.device)
            .forward(logits, labels);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        self.model = Some(self.optim.step(0.05, model, grads));
        loss.into_scalar::<f32>()
    }
}
