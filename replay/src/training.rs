//! Training-loop traces: the allocation pattern of eager autodiff training.
//!
//! A model is a chain of layers. Parameters are allocated first and live for the whole run.
//! Each step uploads a batch, runs the layers forward (each allocates its output, keeps it and
//! any saved tensors for backward, and frees its temporaries), computes a loss, runs backward
//! in reverse (each layer allocates its gradients and frees the incoming gradient and its saved
//! activations), and applies Adam: per parameter, the moments are replaced by new tensors
//! (the first step creates them) through a few parameter-sized temporaries, then the gradient
//! is freed. Sizes are float32 (4 bytes) unless said otherwise.
//!
//! [`mlp_mnist`] and [`cnn_mnist`] use the shapes of the MNIST showcase's models
//! (`examples/mnist/src/model.rs`) with batch 64: every step has the same shapes.

use burn_caching_alloc::alloc::Trace;

use super::builder::{TensorId, TraceBuilder};

/// One layer of a chain, in elements (4 bytes each).
#[derive(Clone, Debug, Default)]
pub struct Layer {
    /// Elements of the layer's input (the previous layer's output).
    pub input: u64,
    /// Elements of the layer's output, kept until backward.
    pub output: u64,
    /// Indices of the parameters the layer uses (into the model's parameter list).
    pub params: Vec<usize>,
    /// Forward temporaries, freed once the output exists (e.g. im2col, a matmul before bias).
    pub forward_temps: Vec<u64>,
    /// Extra tensors saved for backward (e.g. max-pool indices), freed in backward.
    pub saved: Vec<u64>,
    /// Backward temporaries, freed once the gradients exist.
    pub backward_temps: Vec<u64>,
}

/// A model: parameter sizes (elements) and, per step, the layers and the batch inputs.
pub trait TrainingModel {
    fn params(&self) -> Vec<u64>;
    /// Elements of the batch tensors uploaded at `step` (the first is the first layer's input).
    fn batch(&mut self, step: usize) -> Vec<u64>;
    /// The layers of `step`; the last layer's output is the logits.
    fn layers(&mut self, step: usize) -> Vec<Layer>;
    /// Elements of the logits' rows (batch x positions), for the loss.
    fn loss_rows(&mut self, step: usize) -> u64;
}

/// Temporaries of one Adam update of a parameter of `n` elements: g*(1-b1), g*g,
/// g*g*(1-b2), sqrt(v)+eps, and the update m/(sqrt(v)+eps).
const ADAM_TEMPORARIES: usize = 5;

/// The trace of `steps` training steps of `model`.
pub fn training_loop(model: &mut impl TrainingModel, steps: usize) -> Trace {
    let mut t = TraceBuilder::new();
    let param_sizes = model.params();
    // Parameters live for the whole run; `finish` frees them (and the moments) at the end.
    for &n in &param_sizes {
        t.tensor(n);
    }
    let mut moments: Vec<Option<(TensorId, TensorId)>> = vec![None; param_sizes.len()];

    for step in 0..steps {
        let batch: Vec<TensorId> = model.batch(step).into_iter().map(|n| t.tensor(n)).collect();
        let layers = model.layers(step);

        // Forward: outputs and saved tensors stay until backward.
        let mut kept: Vec<(TensorId, Vec<TensorId>)> = Vec::with_capacity(layers.len());
        for layer in &layers {
            let temps: Vec<TensorId> = layer.forward_temps.iter().map(|&n| t.tensor(n)).collect();
            let output = t.tensor(layer.output);
            let saved: Vec<TensorId> = layer.saved.iter().map(|&n| t.tensor(n)).collect();
            t.free_all(temps);
            kept.push((output, saved));
        }

        // Loss: log-softmax over the logits (max, exp, sum as temporaries), gather, mean.
        let rows = model.loss_rows(step);
        let logits = layers.last().map_or(0, |l| l.output);
        let max = t.tensor(rows);
        let exp = t.tensor(logits);
        let sum = t.tensor(rows);
        let log_probs = t.tensor(logits);
        t.free_all([max, exp, sum]);
        let picked = t.tensor(rows);
        let loss = t.tensor(1);

        // Backward of the loss: d(mean), d(gather), d(log-softmax).
        let d_loss = t.tensor(1);
        let d_picked = t.tensor(rows);
        t.free_all([loss, d_loss, picked]);
        let d_log_probs = t.tensor(logits);
        t.free(d_picked);
        let softmax = t.tensor(logits);
        let mut grad = t.tensor(logits);
        t.free_all([softmax, d_log_probs, log_probs]);

        // Backward through the layers, last first.
        let mut param_grads: Vec<(usize, TensorId)> = Vec::new();
        for (index, layer) in layers.iter().enumerate().rev() {
            let temps: Vec<TensorId> = layer.backward_temps.iter().map(|&n| t.tensor(n)).collect();
            for &p in &layer.params {
                param_grads.push((p, t.tensor(param_sizes[p])));
            }
            let input_grad = (index > 0).then(|| t.tensor(layer.input));
            t.free_all(temps);
            t.free(grad);
            let (output, saved) = kept.pop().expect("one kept entry per layer");
            t.free_all(saved);
            t.free(output);
            match input_grad {
                Some(g) => grad = g,
                None => break,
            }
        }
        t.free_all(batch);

        // Adam, parameter by parameter in the order gradients arrived.
        for (p, g) in param_grads {
            let n = param_sizes[p];
            let temps: Vec<TensorId> = (0..ADAM_TEMPORARIES).map(|_| t.tensor(n)).collect();
            let m = t.tensor(n);
            let v = t.tensor(n);
            if let Some((old_m, old_v)) = moments[p].replace((m, v)) {
                t.free_all([old_m, old_v]);
            }
            t.free_all(temps);
            t.free(g);
        }
    }
    t.finish()
}

const BATCH: u64 = 64;
const PIXELS: u64 = 28 * 28;
const CLASSES: u64 = 10;

/// The MNIST MLP: 784 -> 128 (ReLU) -> 10, batch 64.
#[derive(Clone, Debug, Default)]
pub struct MlpMnist;

impl TrainingModel for MlpMnist {
    fn params(&self) -> Vec<u64> {
        vec![PIXELS * 128, 128, 128 * CLASSES, CLASSES]
    }

    fn batch(&mut self, _step: usize) -> Vec<u64> {
        vec![BATCH * PIXELS, BATCH]
    }

    fn layers(&mut self, _step: usize) -> Vec<Layer> {
        vec![
            linear(BATCH, PIXELS, 128, [0, 1]),
            relu(BATCH * 128),
            linear(BATCH, 128, CLASSES, [2, 3]),
        ]
    }

    fn loss_rows(&mut self, _step: usize) -> u64 {
        BATCH
    }
}

/// The MNIST CNN: conv 3x3 (8) -> ReLU -> max pool 2 -> conv 3x3 (16) -> ReLU -> max pool 2
/// -> 400 -> 64 (ReLU) -> 10, batch 64; convolutions as im2col + matmul.
#[derive(Clone, Debug, Default)]
pub struct CnnMnist;

impl TrainingModel for CnnMnist {
    fn params(&self) -> Vec<u64> {
        vec![
            8 * 9,
            8,
            16 * 8 * 9,
            16,
            400 * 64,
            64,
            64 * CLASSES,
            CLASSES,
        ]
    }

    fn batch(&mut self, _step: usize) -> Vec<u64> {
        vec![BATCH * PIXELS, BATCH]
    }

    fn layers(&mut self, _step: usize) -> Vec<Layer> {
        vec![
            conv3x3(BATCH, 1, 8, 28, [0, 1]),
            relu(BATCH * 8 * 26 * 26),
            max_pool2(BATCH * 8, 26),
            conv3x3(BATCH, 8, 16, 13, [2, 3]),
            relu(BATCH * 16 * 11 * 11),
            max_pool2(BATCH * 16, 11),
            linear(BATCH, 400, 64, [4, 5]),
            relu(BATCH * 64),
            linear(BATCH, 64, CLASSES, [6, 7]),
        ]
    }

    fn loss_rows(&mut self, _step: usize) -> u64 {
        BATCH
    }
}

/// `rows x inputs -> rows x outputs` with weight and bias: the matmul result is a temporary
/// before the bias add; backward transposes the input and the weight.
pub fn linear(rows: u64, inputs: u64, outputs: u64, params: [usize; 2]) -> Layer {
    Layer {
        input: rows * inputs,
        output: rows * outputs,
        params: params.to_vec(),
        forward_temps: vec![rows * outputs],
        saved: vec![],
        backward_temps: vec![rows * inputs, inputs * outputs],
    }
}

/// An elementwise activation; backward builds a mask.
pub fn relu(elements: u64) -> Layer {
    Layer {
        input: elements,
        output: elements,
        params: vec![],
        forward_temps: vec![],
        saved: vec![],
        backward_temps: vec![elements],
    }
}

/// A 3x3 valid convolution of `side x side` images, as im2col + matmul + bias.
pub fn conv3x3(batch: u64, c_in: u64, c_out: u64, side: u64, params: [usize; 2]) -> Layer {
    let out_side = side - 2;
    let columns = batch * out_side * out_side * c_in * 9;
    Layer {
        input: batch * c_in * side * side,
        output: batch * c_out * out_side * out_side,
        params: params.to_vec(),
        forward_temps: vec![columns, batch * c_out * out_side * out_side],
        saved: vec![],
        backward_temps: vec![columns, columns],
    }
}

/// A 2x2 max pool of `planes` planes of `side x side`; it saves the argmax indices.
pub fn max_pool2(planes: u64, side: u64) -> Layer {
    let out = planes * (side / 2) * (side / 2);
    Layer {
        input: planes * side * side,
        output: out,
        params: vec![],
        forward_temps: vec![],
        saved: vec![out],
        backward_temps: vec![],
    }
}

/// `steps` training steps of the MNIST MLP.
pub fn mlp_mnist(steps: usize) -> Trace {
    training_loop(&mut MlpMnist, steps)
}

/// `steps` training steps of the MNIST CNN.
pub fn cnn_mnist(steps: usize) -> Trace {
    training_loop(&mut CnnMnist, steps)
}
