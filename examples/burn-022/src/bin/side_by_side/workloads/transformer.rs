//! (b) A TransformerEncoder trained on batches whose size and sequence lengths vary per step
//! (padded to a length bucket, with a padding mask).

use burn::module::Module;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Bool, Device, Tensor, TensorData};

use crate::init::HostInit;
use crate::measure::Workload;
use crate::rng::Rng;

const D_MODEL: usize = 64;

pub struct Transformer {
    device: Device,
    model: Option<TransformerEncoder>,
    optim: ModuleOptimizer,
    rng: Rng,
}

impl Transformer {
    pub fn new(device: &Device, seed: u64) -> Self {
        let device = device.clone().autodiff();
        let model = TransformerEncoderConfig::new(D_MODEL, 128, 4, 2)
            .with_dropout(0.0)
            .init(&device)
            .map(&mut HostInit::new(seed));
        Self {
            device,
            model: Some(model),
            optim: SgdConfig::new().init(),
            rng: Rng::new(seed),
        }
    }
}

impl Workload for Transformer {
    fn step(&mut self, _step: usize) -> f32 {
        // Padded to a bucket (16, 32 or 64), as a data loader does; the lengths under it vary.
        let batch = 2 * self.rng.range(1, 2);
        let longest = 16 << self.rng.range(0, 2);
        let mut lengths: Vec<usize> = (0..batch)
            .map(|_| self.rng.range(longest / 2, longest))
            .collect();
        lengths[0] = longest;
        let tokens = TensorData::new(
            self.rng.floats(batch * longest * D_MODEL),
            [batch, longest, D_MODEL],
        );
        let padding: Vec<bool> = lengths
            .iter()
            .flat_map(|&length| (0..longest).map(move |i| i >= length))
            .collect();
        let tokens = Tensor::<3>::from_data(tokens, &self.device);
        let padding =
            Tensor::<2, Bool>::from_data(TensorData::new(padding, [batch, longest]), &self.device);

        let model = self.model.take().expect("model");
        let output = model.forward(TransformerEncoderInput::new(tokens).mask_pad(padding));
        let loss = output.powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        self.model = Some(self.optim.step(0.01, model, grads));
        loss.into_scalar::<f32>()
    }
}
