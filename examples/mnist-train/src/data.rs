//! `examples/mnist`'s data as burn-train reads it: a [`Dataset`] of image indices and a
//! [`Batcher`] that turns a list of indices into tensors on the training device.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::prelude::*;
use mnist::MnistSet;
use mnist::dataset::IMAGE_PIXELS;

/// The images of one split, by index: item `i` is `i` (the [`MnistBatcher`] reads the pixels).
#[derive(Debug, Clone)]
pub struct MnistIndices {
    len: usize,
}

impl MnistIndices {
    /// Every image of `set`.
    pub fn of(set: &MnistSet) -> Self {
        Self { len: set.len() }
    }
}

impl Dataset<usize> for MnistIndices {
    fn get(&self, index: usize) -> Option<usize> {
        (index < self.len).then_some(index)
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A batch: normalised, flattened images `[batch, 784]` and their labels `[batch]`.
#[derive(Debug, Clone)]
pub struct MnistBatch<B: Backend> {
    /// The images, as `examples/mnist` normalises them.
    pub images: Tensor<B, 2>,
    /// The digits, 0 to 9.
    pub targets: Tensor<B, 1, Int>,
}

/// Builds [`MnistBatch`]es from one split held in memory.
#[derive(Debug, Clone)]
pub struct MnistBatcher {
    set: Arc<MnistSet>,
}

impl MnistBatcher {
    /// A batcher of the images of `set`.
    pub fn new(set: Arc<MnistSet>) -> Self {
        Self { set }
    }
}

impl<B: Backend> Batcher<B, usize, MnistBatch<B>> for MnistBatcher {
    fn batch(&self, items: Vec<usize>, device: &B::Device) -> MnistBatch<B> {
        let pixels = self.set.normalized_pixels(&items);
        let images =
            Tensor::from_data(TensorData::new(pixels, [items.len(), IMAGE_PIXELS]), device);
        let labels = self.set.labels_of(&items);
        let targets = Tensor::from_data(TensorData::new(labels, [items.len()]), device);
        MnistBatch { images, targets }
    }
}
