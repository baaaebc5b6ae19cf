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
    /// The same perceptron, a step being an epoch of [`LOADER_EPOCH`] MNIST training images in
    /// batches of [`LOADER_BATCH`], each batch put on the device by one of [`LOADER_WORKERS`]
    /// worker threads started anew every epoch, as Burn's `MultiThreadDataLoader` does (issue
    /// 38: every epoch's batches come from new CubeCL streams).
    MnistLoader,
    /// `TransformerEncoder` (2 layers, 4 heads and feed-forward 4 x width unless the name says
    /// otherwise) of a given size on batches whose sequence length is drawn from a range at
    /// every step: the family of variable-length rows (issue 39), named
    /// `varlen-d<width>-b<batch>-l<min>-<max>[-h<heads>][-f<ff>][-s<steps>]`.
    Varlen(VarlenShape),
}

/// The size of a [`Workload::Varlen`] row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VarlenShape {
    /// `d_model` (a multiple of the heads).
    pub width: usize,
    /// Attention heads, 4 if not given.
    pub heads: Option<usize>,
    /// Width of the feed-forward layer, 4 x `width` if not given.
    pub ff: Option<usize>,
    /// Sequences per batch.
    pub batch: usize,
    /// Shortest sequence length drawn.
    pub min_len: usize,
    /// Longest sequence length drawn.
    pub max_len: usize,
    /// Steps this row trains for, overriding `--steps`, if given.
    pub steps: Option<usize>,
}

impl VarlenShape {
    /// The row's name: `varlen-d<width>-b<batch>-l<min>-<max>[-h<heads>][-f<ff>][-s<steps>]`.
    pub fn name(&self) -> String {
        let mut name = format!(
            "varlen-d{}-b{}-l{}-{}",
            self.width, self.batch, self.min_len, self.max_len
        );
        if let Some(heads) = self.heads {
            name.push_str(&format!("-h{heads}"));
        }
        if let Some(ff) = self.ff {
            name.push_str(&format!("-f{ff}"));
        }
        if let Some(steps) = self.steps {
            name.push_str(&format!("-s{steps}"));
        }
        name
    }

    /// Attention heads.
    pub fn heads(&self) -> usize {
        self.heads.unwrap_or(4)
    }

    /// Width of the feed-forward layer.
    pub fn ff(&self) -> usize {
        self.ff.unwrap_or(4 * self.width)
    }

    /// The shape a name made by [`VarlenShape::name`] describes, if it is one (widths a
    /// multiple of the heads, every number positive, `min <= max`, options in name order).
    pub fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix("varlen-d")?;
        let mut parts = rest.split('-').peekable();
        let width = parts.next()?.parse().ok()?;
        let batch = parts.next()?.strip_prefix('b')?.parse().ok()?;
        let min_len = parts.next()?.strip_prefix('l')?.parse().ok()?;
        let max_len = parts.next()?.parse().ok()?;
        let mut option = |prefix: char| -> Option<Option<usize>> {
            match parts.peek().and_then(|p| p.strip_prefix(prefix)) {
                Some(number) => {
                    let value = number.parse().ok()?;
                    parts.next();
                    Some(Some(value))
                }
                None => Some(None),
            }
        };
        let heads = option('h')?;
        let ff = option('f')?;
        let steps = option('s')?;
        let shape = Self {
            width,
            batch,
            heads,
            ff,
            min_len,
            max_len,
            steps,
        };
        let valid = parts.next().is_none()
            && width > 0
            && shape.heads() > 0
            && width % shape.heads() == 0
            && shape.ff() > 0
            && batch > 0
            && min_len > 0
            && min_len <= max_len
            && steps != Some(0);
        valid.then_some(shape)
    }
}

/// The variable-length rows the benchmark runs by default (`--models varlen`): widths 32 to
/// 128, batches 4 to 32, lengths from 4..32 to 32..256, the user's report of issue 39 among
/// them (`varlen-d64-b8-l8-192-s40`). Step counts are short enough that the family runs in
/// minutes on lavapipe in a debug build.
pub const VARLEN_FAMILY: [VarlenShape; 6] = [
    varlen(64, 8, 8, 192, 40),
    varlen(32, 4, 8, 64, 24),
    varlen(64, 32, 4, 32, 24),
    varlen(128, 8, 16, 128, 16),
    varlen(64, 16, 32, 256, 12),
    varlen(96, 4, 8, 320, 16),
];

const fn varlen(
    width: usize,
    batch: usize,
    min_len: usize,
    max_len: usize,
    steps: usize,
) -> VarlenShape {
    VarlenShape {
        width,
        batch,
        heads: None,
        ff: None,
        min_len,
        max_len,
        steps: Some(steps),
    }
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
/// Images in an epoch of [`Workload::MnistLoader`].
pub const LOADER_EPOCH: usize = 320;
/// Images per batch of [`Workload::MnistLoader`].
pub const LOADER_BATCH: usize = 32;
/// Worker threads [`Workload::MnistLoader`] starts every epoch.
pub const LOADER_WORKERS: usize = 4;

impl Workload {
    /// Every workload, in report order.
    pub const ALL: [Workload; 5] = [
        Workload::TransformerVarlen,
        Workload::Conv,
        Workload::Lstm,
        Workload::MnistMlp,
        Workload::MnistLoader,
    ];

    /// Name on the command line and in reports.
    pub fn name(self) -> String {
        match self {
            Workload::TransformerVarlen => "transformer-varlen".into(),
            Workload::Conv => "conv".into(),
            Workload::Lstm => "lstm".into(),
            Workload::MnistMlp => "mnist-mlp".into(),
            Workload::MnistLoader => "mnist-loader".into(),
            Workload::Varlen(shape) => shape.name(),
        }
    }

    /// The workload called `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|w| w.name() == name)
            .or_else(|| VarlenShape::parse(name).map(Workload::Varlen))
    }

    /// The workloads a command-line name stands for: one, or for `varlen` every row of
    /// [`VARLEN_FAMILY`].
    pub fn expand(name: &str) -> Option<Vec<Self>> {
        if name == "varlen" {
            return Some(VARLEN_FAMILY.into_iter().map(Workload::Varlen).collect());
        }
        Self::from_name(name).map(|w| vec![w])
    }

    /// The steps this workload trains for when the command line gives `steps`.
    pub fn steps(self, steps: usize) -> usize {
        match self {
            Workload::Varlen(shape) => shape.steps.unwrap_or(steps),
            _ => steps,
        }
    }

    /// Items per batch.
    pub fn batch_size(self) -> usize {
        match self {
            Workload::TransformerVarlen => 8,
            Workload::Conv | Workload::Lstm => 16,
            Workload::MnistMlp => 64,
            Workload::MnistLoader => LOADER_EPOCH,
            Workload::Varlen(shape) => shape.batch,
        }
    }

    /// `steps` batches from `seed` (for [`Workload::MnistLoader`], `steps` epochs). MNIST
    /// batches come from the training set in `mnist_dir` (the showcase's `data/`), in the order
    /// the seed shuffles.
    pub fn batches(self, steps: usize, seed: u64, mnist_dir: &Path) -> Result<Vec<Batch>, String> {
        let mut rng = SmallRng::seed_from_u64(seed ^ self.seed_salt().wrapping_mul(0x9e37_79b9));
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
            Workload::Varlen(shape) => Ok((0..steps)
                .map(|_| {
                    let seq = rng.random_range(shape.min_len..=shape.max_len);
                    random(&mut rng, [n, seq, shape.width])
                })
                .collect()),
            Workload::Conv => Ok((0..steps)
                .map(|_| random(&mut rng, [n, 3 * CONV_SIDE, CONV_SIDE]))
                .collect()),
            Workload::Lstm => Ok((0..steps)
                .map(|_| random(&mut rng, [n, LSTM_SEQ, LSTM_D_INPUT]))
                .collect()),
            Workload::MnistMlp | Workload::MnistLoader => {
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

impl Workload {
    /// Mixed into the batches' seed: the fixed workloads' discriminants as before, a hash of
    /// the shape's numbers for a variable-length row.
    fn seed_salt(self) -> u64 {
        match self {
            Workload::TransformerVarlen => 0,
            Workload::Conv => 1,
            Workload::Lstm => 2,
            Workload::MnistMlp => 3,
            Workload::MnistLoader => 5,
            Workload::Varlen(s) => [s.width, s.batch, s.min_len, s.max_len]
                .iter()
                .fold(4u64, |h, &x| h.wrapping_mul(31).wrapping_add(x as u64)),
        }
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
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
            assert_eq!(Workload::from_name(&w.name()), Some(w));
        }
        assert_eq!(Workload::from_name("resnet"), None);
        for shape in VARLEN_FAMILY {
            assert_eq!(
                Workload::from_name(&shape.name()),
                Some(Workload::Varlen(shape))
            );
        }
        assert_eq!(
            Workload::from_name("varlen-d64-b8-l8-192"),
            Some(Workload::Varlen(VarlenShape {
                steps: None,
                ..varlen(64, 8, 8, 192, 1)
            }))
        );
        for bad in [
            "varlen-d63-b8-l8-192",
            "varlen-d64-b0-l8-192",
            "varlen-d64-b8-l9-8",
            "varlen-d64-b8-l8-192-s0",
            "varlen-d64-b8-l8-192-s4-x",
            "varlen-d64-b8-l8-192-h3",
            "varlen-d64-b8-l8-192-f0",
            "varlen-d64-b8-l8-192-s4-h8",
            "varlen-d64-b8-l8",
        ] {
            assert_eq!(Workload::from_name(bad), None, "{bad}");
        }
        let wide = Workload::from_name("varlen-d64-b8-l8-192-h8-f128-s10");
        assert_eq!(
            wide,
            Some(Workload::Varlen(VarlenShape {
                heads: Some(8),
                ff: Some(128),
                ..varlen(64, 8, 8, 192, 10)
            }))
        );
        assert_eq!(wide.unwrap().name(), "varlen-d64-b8-l8-192-h8-f128-s10");
        assert_eq!(
            Workload::expand("varlen").unwrap().len(),
            VARLEN_FAMILY.len()
        );
    }

    #[test]
    fn varlen_rows_draw_lengths_from_their_range_at_their_width() {
        let dir = mnist::dataset::default_data_dir();
        let shape = varlen(32, 4, 8, 64, 10);
        let batches = Workload::Varlen(shape).batches(10, 1, &dir).unwrap();
        assert_eq!(batches.len(), 10);
        for b in &batches {
            assert_eq!(b.shape[0], 4);
            assert!((8..=64).contains(&b.shape[1]));
            assert_eq!(b.shape[2], 32);
        }
        assert_eq!(Workload::Varlen(shape).steps(3), 10);
        assert_eq!(Workload::Conv.steps(3), 3);
    }
}
