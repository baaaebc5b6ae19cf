//! One SGD step, the same for a peer and for the one-process reference: the only difference
//! is the gradients' all-reduce.

use burn::backend::wgpu::WgpuDevice;
use burn::collective::{CollectiveError, PeerId, ReduceOperation};
use burn::optim::{GradientsParams, Optimizer};

use crate::data::Batch;
use crate::model::Model;
use crate::{Backend, LEARNING_RATE, TrainBackend};

/// The model (on `device`) after one step on `batch`, and the batch's loss before it. With `peer`, the
/// gradients are averaged over every peer of the collective first (each peer must call this
/// with its own shard, at the same step).
pub fn step(
    model: Model<TrainBackend>,
    optim: &mut impl Optimizer<Model<TrainBackend>, TrainBackend>,
    batch: &Batch,
    device: &WgpuDevice,
    peer: Option<PeerId>,
) -> Result<(Model<TrainBackend>, f32), CollectiveError> {
    let (inputs, targets) = batch.tensors::<TrainBackend>(device);
    let loss = model.loss(inputs, targets);
    let value = loss.clone().into_scalar();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    if let Some(peer) = peer {
        // The inner backend: burn-collective all-reduces plain tensors, never autodiff ones.
        grads = grads.all_reduce::<Backend>(peer, ReduceOperation::Mean)?;
    }
    Ok((optim.step(LEARNING_RATE, model, grads), value))
}
