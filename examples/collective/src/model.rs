//! The small model: 4 inputs, 8 hidden units with ReLU, 2 outputs, trained on the squared
//! error.
//!
//! `GradientsParams::all_reduce` pairs the gradients of all peers by sorted `ParamId`, so every
//! process must build the same parameters with the same ids. Burn's initialisers draw random
//! ids and values; this model sets both: fixed ids (1 to 4) and small multiples of 1/8. A real
//! model gets the same effect by loading one record file on every process (records carry the
//! ids) or by building its parameters as here.

use burn::module::{Param, ParamId};
use burn::nn::{Linear, Relu};
use burn::prelude::*;

/// Inputs per example.
pub const INPUTS: usize = 4;
/// Hidden units.
pub const HIDDEN: usize = 8;
/// Outputs per example.
pub const OUTPUTS: usize = 2;

/// Two linear layers with a ReLU between them.
#[derive(Module, Debug)]
pub struct Model<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    relu: Relu,
}

/// `n` values, multiples of 1/8 in [-1/2, 1/2], from a fixed pattern.
fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 5 + seed * 3) % 9) as f32 - 4.0) / 8.0)
        .collect()
}

/// A parameter with a fixed id and values, tracked by autodiff.
fn param<B: Backend, const D: usize>(
    id: u64,
    shape: [usize; D],
    seed: usize,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    let n = shape.iter().product();
    let tensor = Tensor::from_data(TensorData::new(pattern(n, seed), shape), device);
    Param::initialized(ParamId::from(id), tensor.require_grad())
}

impl<B: Backend> Model<B> {
    /// The model on `device`, the same on every process.
    pub fn new(device: &B::Device) -> Self {
        Self {
            hidden: Linear {
                weight: param(1, [INPUTS, HIDDEN], 1, device),
                bias: Some(param(2, [HIDDEN], 2, device)),
            },
            output: Linear {
                weight: param(3, [HIDDEN, OUTPUTS], 3, device),
                bias: Some(param(4, [OUTPUTS], 4, device)),
            },
            relu: Relu::new(),
        }
    }

    /// Outputs `[batch, OUTPUTS]` of inputs `[batch, INPUTS]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.output
            .forward(self.relu.forward(self.hidden.forward(x)))
    }

    /// The mean squared error of the outputs against `targets`.
    pub fn loss(&self, x: Tensor<B, 2>, targets: Tensor<B, 2>) -> Tensor<B, 1> {
        let diff = self.forward(x) - targets;
        (diff.clone() * diff).mean()
    }

    /// Every parameter's values, in id order (the order the reports print them in).
    pub fn values(&self) -> Vec<Vec<f32>> {
        let read = |t: Tensor<B, 1>| t.into_data().to_vec::<f32>().expect("f32 parameters");
        let bias = |b: &Option<Param<Tensor<B, 1>>>| b.as_ref().expect("biased layers").val();
        vec![
            read(self.hidden.weight.val().flatten(0, 1)),
            read(bias(&self.hidden.bias)),
            read(self.output.weight.val().flatten(0, 1)),
            read(bias(&self.output.bias)),
        ]
    }
}
