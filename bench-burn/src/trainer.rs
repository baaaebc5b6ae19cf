//! One training step (forward, cross-entropy, backward, Adam) on any autodiff backend, behind
//! an object-safe trait so that the comparison holds two backends' trainers side by side.

use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;

use crate::nets::{ConvNet, LstmNet, MnistMlpNet, Net, TransformerNet};
use crate::workload::{Batch, Workload};

/// Adam's learning rate.
pub const LEARNING_RATE: f64 = 1e-3;

/// A model and its optimizer on one backend.
pub trait Step {
    /// Trains on `batch` and returns the loss, read back to the host (so the step has run).
    fn step(&mut self, batch: &Batch) -> Result<f64, String>;
}

/// `workload`'s network on `B`. Before step `i` the backend is seeded with `seed + i`: Burn
/// initialises parameters lazily (at the first forward pass) and the backends' RNG is one
/// process-wide stream, so seeding per step is what gives both sides of an interleaved run the
/// same initial weights and the same dropout masks.
pub fn trainer<B: AutodiffBackend>(
    workload: Workload,
    device: &B::Device,
    seed: u64,
) -> Box<dyn Step>
where
    B::Device: 'static,
{
    match workload {
        Workload::TransformerVarlen => boxed::<B, _>(TransformerNet::new(device), device, seed),
        Workload::Conv => boxed::<B, _>(ConvNet::new(device), device, seed),
        Workload::Lstm => boxed::<B, _>(LstmNet::new(device), device, seed),
        Workload::MnistMlp => boxed::<B, _>(MnistMlpNet::new(device), device, seed),
        Workload::MnistLoader => Box::new(crate::loader::EpochTrainer::new(trainer_of::<B, _>(
            MnistMlpNet::new(device),
            device,
            seed,
        ))),
        Workload::Varlen(shape) => boxed::<B, _>(
            TransformerNet::sized(shape.width, shape.ff(), shape.heads(), device),
            device,
            seed,
        ),
    }
}

/// `batch` on `device`: its inputs (rank 3) and its class labels.
pub fn to_device<B: Backend>(
    batch: &Batch,
    device: &B::Device,
) -> (Tensor<B, 3>, Tensor<B, 1, Int>) {
    let inputs = Tensor::from_data(TensorData::new(batch.inputs.clone(), batch.shape), device);
    let labels = Tensor::from_data(
        TensorData::new(batch.labels.clone(), [batch.shape[0]]),
        device,
    );
    (inputs, labels)
}

/// A model and its Adam optimizer on `B`, trained batch by batch ([`Trainer::train`]).
pub struct Trainer<B: AutodiffBackend, M: AutodiffModule<B>, O> {
    model: Option<M>,
    optimizer: O,
    device: B::Device,
    seed: u64,
    steps: u64,
}

fn boxed<B, M>(model: M, device: &B::Device, seed: u64) -> Box<dyn Step>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Net<B> + 'static,
{
    Box::new(trainer_of::<B, M>(model, device, seed))
}

/// `model` with a fresh Adam optimizer on `device`.
pub fn trainer_of<B, M>(
    model: M,
    device: &B::Device,
    seed: u64,
) -> Trainer<B, M, impl Optimizer<M, B> + use<B, M>>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Net<B> + 'static,
{
    Trainer {
        model: Some(model),
        optimizer: AdamConfig::new().init::<B, M>(),
        device: device.clone(),
        seed,
        steps: 0,
    }
}

impl<B, M, O> Trainer<B, M, O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Net<B>,
    O: Optimizer<M, B>,
{
    /// The device the model lives on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// One Adam step on `inputs` (rank 3) and their class `labels`, already on the device;
    /// returns the loss, read back to the host.
    pub fn train(
        &mut self,
        inputs: Tensor<B, 3>,
        labels: Tensor<B, 1, Int>,
    ) -> Result<f64, String> {
        let model = self.model.take().ok_or("an earlier step failed")?;
        B::seed(&self.device, self.seed.wrapping_add(self.steps));
        self.steps += 1;
        let loss = CrossEntropyLossConfig::new()
            .init::<B>(&self.device)
            .forward(model.logits(inputs), labels);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        self.model = Some(self.optimizer.step(LEARNING_RATE, model, grads));
        let value = loss
            .inner()
            .try_into_scalar()
            .map_err(|e| format!("reading the loss: {e:?}"))?;
        B::sync(&self.device).map_err(|e| format!("sync: {e:?}"))?;
        Ok(value.elem::<f64>())
    }
}

impl<B, M, O> Step for Trainer<B, M, O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Net<B>,
    O: Optimizer<M, B>,
{
    fn step(&mut self, batch: &Batch) -> Result<f64, String> {
        let (inputs, labels) = to_device::<B>(batch, &self.device);
        self.train(inputs, labels)
    }
}
