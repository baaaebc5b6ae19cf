//! The workloads and their batches. Every batch is made once on the CPU from a seed, so both
//! sides of a comparison train on exactly the same numbers.

use std::path::Path;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// One model to train, with the batch shapes it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// `TransformerEncoder` (2 layers, d_model 64, 4 heads) on batches of 8 sequences whose
    /// length is drawn from 16..=128 at every step: a new set of tensor sizes each step.
    TransformerVarlen,
    /// Two 3x3 convolutions (3 -> 16 -> 32), max pooling, adaptive average pooling and a
    /// linear layer, on batches of 16 RGB images of 32 x 32.
    Conv,
    /// An LSTM (input 32, hidden 64) over 24 steps, its last output through a linear layer, on
    /// batches of 16 sequences.
    Lstm,
    /// The MNIST showcase's 784-128-10 perceptron on batches of 64 MNIST training images.
    MnistMlp,
}

/// Sequence lengths of [`Workload::TransformerVarlen`].
pub const VARLEN_RANGE: std::ops::RangeInclusive<usize> = 16..=128;
/// Width of the transformer's and the LSTM's input features.
pub const TRANSFORMER_D_MODEL: usize = 64;
/// Features per LSTM input step.
pub const LSTM_D_INPUT: usize = 32;
/// LSTM sequence length.
pub const LSTM_SEQ: usize = 24;
/// Side of the conv net's images.
pub const CONV_SIDE: usize = 32;
/// Classes every model predicts.
pub const CLASSES: usize = 10;

impl Workload {
    /// Every workload, in report order.
    pub const ALL: [Workload; 4] = [
        Workload::TransformerVarlen,
        Workload::Conv,
        Workload::Lstm,
        Workload::MnistMlp,
    ];

    /// Name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::TransformerVarlen => "transformer-varlen",
            Workload::Conv => "conv",
            Workload::Lstm => "lstm",
            Workload::MnistMlp => "mnist-mlp",
        }
    }

    /// The workload called `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.name() == name)
    }

    /// Items per batch.
    pub fn batch_size(self) -> usize {
        match self {
            Workload::TransformerVarlen => 8,
            Workload::Conv | Workload::Lstm => 16,
            Workload::MnistMlp => 64,
        }
    }

    /// `steps` batches from `seed`. MNIST batches come from the training set in
    /// `mnist_dir` (the showcase's `data/`), in the order the seed shuffles.
    pub fn batches(self, steps: usize, seed: u64, mnist_dir: &Path) -> Result<Vec<Batch>, String> {
        let mut rng = SmallRng::seed_from_u64(seed ^ (self as u64).wrapping_mul(0x9e37_79b9));
        let n = self.batch_size();
        let random = |rng: &mut SmallRng, shape: [usize; 3]| -> Batch {
            let len = shape.iter().product();
            Batch {
                inputs: (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
                shape,
                labels: (0..shape[0])
                    .map(|_| rng.random_range(0..CLASSES as i64))
                    .collect(),
            }
        };
        match self {
            Workload::TransformerVarlen => Ok((0..steps)
                .map(|_| {
                    let seq = rng.random_range(VARLEN_RANGE);
                    random(&mut rng, [n, seq, TRANSFORMER_D_MODEL])
                })
                .collect()),
            Workload::Conv => Ok((0..steps)
                .map(|_| random(&mut rng, [n, 3 * CONV_SIDE, CONV_SIDE]))
                .collect()),
            Workload::Lstm => Ok((0..steps)
                .map(|_| random(&mut rng, [n, LSTM_SEQ, LSTM_D_INPUT]))
                .collect()),
            Workload::MnistMlp => {
                use mnist::dataset::{IMAGE_PIXELS, MnistSet, Split};
                let set = MnistSet::load(mnist_dir, Split::Train, Some(steps * n))
                    .map_err(|e| format!("MNIST training set in {}: {e}", mnist_dir.display()))?;
                let order = mnist::train::batch_order(set.len(), seed, 1);
                Ok(order
                    .chunks_exact(n)
                    .take(steps)
                    .map(|indices| Batch {
                        inputs: set.normalized_pixels(indices),
                        shape: [n, 1, IMAGE_PIXELS],
                        labels: set.labels_of(indices),
                    })
                    .collect())
            }
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One batch on the CPU: inputs of rank 3 (each network reshapes them) and class labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Row-major input values.
    pub inputs: Vec<f32>,
    /// `[batch, a, b]`.
    pub shape: [usize; 3],
    /// One class per item.
    pub labels: Vec<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varlen_batches_vary_in_length_and_repeat_with_the_seed() {
        let dir = mnist::dataset::default_data_dir();
        let a = Workload::TransformerVarlen.batches(8, 3, &dir).unwrap();
        let b = Workload::TransformerVarlen.batches(8, 3, &dir).unwrap();
        assert_eq!(a, b);
        let mut lengths: Vec<usize> = a.iter().map(|b| b.shape[1]).collect();
        assert!(lengths.iter().all(|l| VARLEN_RANGE.contains(l)));
        lengths.dedup();
        assert!(lengths.len() > 1, "every step had the same length");
        for batch in &a {
            assert_eq!(batch.inputs.len(), batch.shape.iter().product::<usize>());
            assert_eq!(batch.labels.len(), 8);
        }
    }

    #[test]
    fn names_round_trip() {
        for w in Workload::ALL {
            assert_eq!(Workload::from_name(w.name()), Some(w));
        }
        assert_eq!(Workload::from_name("resnet"), None);
    }
}
