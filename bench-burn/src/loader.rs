//! Epochs fed by new loader threads (`mnist-loader`, issue 38): each step of the comparison is
//! an epoch whose batches are put on the device by [`LOADER_WORKERS`] worker threads started
//! for that epoch and joined at its end, as Burn's `MultiThreadDataLoader` does at every
//! `iter()`. CubeCL names a stream after its thread, so every epoch's batches are allocated on
//! new streams; the main thread trains on them in batch order, the same order on both sides.

use std::collections::HashMap;
use std::sync::mpsc;

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::nets::Net;
use crate::trainer::{Step, Trainer, to_device};
use crate::workload::{Batch, LOADER_BATCH, LOADER_WORKERS};

/// Batches a worker may put on the device ahead of the training (Burn's `MAX_QUEUED_ITEMS`).
const QUEUED: usize = 100;

/// A batch as a worker sends it: its position in the epoch, its inputs and labels.
type Loaded<B> = (usize, Tensor<B, 3>, Tensor<B, 1, Int>);

/// Trains a model an epoch per step, its batches loaded by new threads every epoch.
pub struct EpochTrainer<B: AutodiffBackend, M: AutodiffModule<B>, O> {
    trainer: Trainer<B, M, O>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>, O> EpochTrainer<B, M, O> {
    /// Epochs of `trainer`'s model.
    pub fn new(trainer: Trainer<B, M, O>) -> Self {
        Self { trainer }
    }
}

impl<B, M, O> Step for EpochTrainer<B, M, O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Net<B>,
    O: Optimizer<M, B>,
{
    /// One epoch of `epoch`'s images (`[images, 1, pixels]`) in batches of [`LOADER_BATCH`]:
    /// the mean loss of its batches.
    fn step(&mut self, epoch: &Batch) -> Result<f64, String> {
        let [images, _, pixels] = epoch.shape;
        let batches = images / LOADER_BATCH;
        if batches == 0 {
            return Err(format!(
                "an epoch of {images} images holds no batch of {LOADER_BATCH}"
            ));
        }
        let (sender, receiver) = mpsc::sync_channel::<Loaded<B>>(QUEUED);
        let workers: Vec<_> = (0..LOADER_WORKERS)
            .map(|worker| {
                let sender = sender.clone();
                let device = self.trainer.device().clone();
                // Worker `w` loads batches w, w + workers, ...
                let assigned: Vec<(usize, Batch)> = (worker..batches)
                    .step_by(LOADER_WORKERS)
                    .map(|b| {
                        let images = b * LOADER_BATCH..(b + 1) * LOADER_BATCH;
                        let batch = Batch {
                            inputs: epoch.inputs[images.start * pixels..images.end * pixels]
                                .to_vec(),
                            shape: [LOADER_BATCH, 1, pixels],
                            labels: epoch.labels[images].to_vec(),
                        };
                        (b, batch)
                    })
                    .collect();
                std::thread::Builder::new()
                    .name(format!("loader-{worker}"))
                    .spawn(move || {
                        for (b, batch) in assigned {
                            let (inputs, labels) = to_device::<B>(&batch, &device);
                            if sender.send((b, inputs, labels)).is_err() {
                                return;
                            }
                        }
                    })
                    .map_err(|e| format!("starting a loader thread: {e}"))
            })
            .collect::<Result<_, _>>()?;
        drop(sender);
        let mut early: HashMap<usize, (Tensor<B, 3>, Tensor<B, 1, Int>)> = HashMap::new();
        let mut total = 0.0;
        for next in 0..batches {
            let (inputs, labels) = loop {
                if let Some(batch) = early.remove(&next) {
                    break batch;
                }
                let (b, inputs, labels) = receiver
                    .recv()
                    .map_err(|_| format!("the loader threads ended before batch {next}"))?;
                early.insert(b, (inputs, labels));
            };
            total += self.trainer.train(inputs, labels)?;
        }
        for worker in workers {
            worker
                .join()
                .map_err(|_| "a loader thread panicked".to_string())?;
        }
        Ok(total / batches as f64)
    }
}
