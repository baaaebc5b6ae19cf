//! A transformer-like training loop whose sequence length changes every step.
//!
//! This is the fragmentation case PyTorch users hit with variable-length batches: every step
//! allocates activations whose sizes depend on the sequence length `L` (and attention scores
//! on `L^2`), so blocks freed by one step rarely fit the next step's requests exactly.
//!
//! Shapes: batch 8, model width 512, 8 heads, feed-forward 2048, 4 layers, vocabulary 8192;
//! `L` is drawn each step uniformly from 128..=512 in steps of 8 (from the seed). Each block is
//! a chain: layer norm, QKV projection, attention scores, softmax, attention-weighted values,
//! output projection, residual add, layer norm, feed-forward up, GELU, feed-forward down,
//! residual add. Parameters and Adam moments as in [`super::training`].

use burn_caching_alloc::alloc::Trace;

use super::rng::SplitMix64;
use super::training::{Layer, TrainingModel, linear, relu, training_loop};

const BATCH: u64 = 8;
const WIDTH: u64 = 512;
const HEADS: u64 = 8;
const FFN: u64 = 2048;
const BLOCKS: usize = 4;
const VOCAB: u64 = 8192;
const MIN_LEN: u64 = 128;
const MAX_LEN: u64 = 512;

/// The model, with the sequence length of the step being generated.
#[derive(Clone, Debug)]
pub struct VarLenTransformer {
    rng: SplitMix64,
    len: u64,
    len_step: Option<usize>,
}

impl VarLenTransformer {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            len: MIN_LEN,
            len_step: None,
        }
    }

    /// The sequence length of `step`, drawn once per step.
    fn len(&mut self, step: usize) -> u64 {
        if self.len_step != Some(step) {
            self.len = self.rng.range(MIN_LEN / 8, MAX_LEN / 8) * 8;
            self.len_step = Some(step);
        }
        self.len
    }
}

/// Per block: ln1 (w, b), qkv (w, b), out (w, b), ln2 (w, b), ffn up (w, b), ffn down (w, b).
const PARAMS_PER_BLOCK: usize = 12;

fn layer_norm(elements: u64, rows: u64, params: [usize; 2]) -> Layer {
    Layer {
        input: elements,
        output: elements,
        params: params.to_vec(),
        forward_temps: vec![rows, elements],
        saved: vec![rows, rows],
        backward_temps: vec![elements, elements],
    }
}

fn elementwise(elements: u64, saved: Vec<u64>) -> Layer {
    Layer {
        saved,
        ..relu(elements)
    }
}

impl TrainingModel for VarLenTransformer {
    fn params(&self) -> Vec<u64> {
        let mut params = vec![VOCAB * WIDTH];
        for _ in 0..BLOCKS {
            params.extend([
                WIDTH,
                WIDTH,
                WIDTH * 3 * WIDTH,
                3 * WIDTH,
                WIDTH * WIDTH,
                WIDTH,
                WIDTH,
                WIDTH,
                WIDTH * FFN,
                FFN,
                FFN * WIDTH,
                WIDTH,
            ]);
        }
        params.extend([WIDTH, WIDTH, WIDTH * VOCAB, VOCAB]);
        params
    }

    fn batch(&mut self, step: usize) -> Vec<u64> {
        let tokens = BATCH * self.len(step);
        vec![tokens, tokens]
    }

    fn layers(&mut self, step: usize) -> Vec<Layer> {
        let len = self.len(step);
        let rows = BATCH * len;
        let hidden = rows * WIDTH;
        let scores = BATCH * HEADS * len * len;
        let mut layers = vec![Layer {
            input: rows,
            output: hidden,
            params: vec![0],
            forward_temps: vec![],
            saved: vec![],
            backward_temps: vec![hidden],
        }];
        for block in 0..BLOCKS {
            let p = 1 + block * PARAMS_PER_BLOCK;
            layers.push(layer_norm(hidden, rows, [p, p + 1]));
            layers.push(linear(rows, WIDTH, 3 * WIDTH, [p + 2, p + 3]));
            // Scores = Q K^T: the transposed K is a temporary; backward needs both again.
            layers.push(Layer {
                input: 3 * hidden,
                output: scores,
                params: vec![],
                forward_temps: vec![hidden],
                saved: vec![],
                backward_temps: vec![hidden, scores],
            });
            layers.push(elementwise(scores, vec![]));
            // Attention-weighted values, heads merged back.
            layers.push(Layer {
                input: scores,
                output: hidden,
                params: vec![],
                forward_temps: vec![hidden],
                saved: vec![],
                backward_temps: vec![scores, hidden],
            });
            layers.push(linear(rows, WIDTH, WIDTH, [p + 4, p + 5]));
            layers.push(elementwise(hidden, vec![]));
            layers.push(layer_norm(hidden, rows, [p + 6, p + 7]));
            layers.push(linear(rows, WIDTH, FFN, [p + 8, p + 9]));
            layers.push(elementwise(rows * FFN, vec![]));
            layers.push(linear(rows, FFN, WIDTH, [p + 10, p + 11]));
            layers.push(elementwise(hidden, vec![]));
        }
        let last = 1 + BLOCKS * PARAMS_PER_BLOCK;
        layers.push(layer_norm(hidden, rows, [last, last + 1]));
        layers.push(linear(rows, WIDTH, VOCAB, [last + 2, last + 3]));
        layers
    }

    fn loss_rows(&mut self, step: usize) -> u64 {
        BATCH * self.len(step)
    }
}

/// `steps` steps of the variable-length transformer, sequence lengths drawn from `seed`.
pub fn transformer_varlen(steps: usize, seed: u64) -> Trace {
    training_loop(&mut VarLenTransformer::new(seed), steps)
}
