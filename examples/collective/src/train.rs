//! One SGD step, the same for a peer and for the one-process reference: the only difference
//! is how the gradients are averaged over the peers first.

use burn::backend::wgpu::WgpuDevice;
use burn::collective::{CollectiveError, PeerId, ReduceOperation};
use burn::optim::{GradientsParams, Optimizer};

use crate::data::Batch;
use crate::model::Model;
use crate::{Backend, LEARNING_RATE, TrainBackend, flat};

/// How a step averages its gradients over the peers of the collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradientSync {
    /// Not at all: one process, one device (the reference).
    None,
    /// Burn's `GradientsParams::all_reduce`: one burn-collective operation per parameter.
    /// Between the devices of one process only (see [`crate::node`]).
    PerParameter(PeerId),
    /// [`flat::all_reduce`]: one operation for all the gradients, what a registration across
    /// processes allows with burn-collective 0.21.0.
    Flattened(PeerId),
}

/// The model (on `device`) after one step on `batch`, and the batch's loss before it. Every
/// peer of the collective must call this with its own shard, at the same step, with the same
/// `sync`.
pub fn step(
    model: Model<TrainBackend>,
    optim: &mut impl Optimizer<Model<TrainBackend>, TrainBackend>,
    batch: &Batch,
    device: &WgpuDevice,
    sync: GradientSync,
) -> Result<(Model<TrainBackend>, f32), CollectiveError> {
    let (inputs, targets) = batch.tensors::<TrainBackend>(device);
    let loss = model.loss(inputs, targets);
    let value = loss.clone().into_scalar();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    // burn-collective reduces the inner backend's tensors, never autodiff ones.
    grads = match sync {
        GradientSync::None => grads,
        GradientSync::PerParameter(peer) => {
            grads.all_reduce::<Backend>(peer, ReduceOperation::Mean)?
        }
        GradientSync::Flattened(peer) => {
            flat::all_reduce::<TrainBackend, _>(grads, &model, peer, ReduceOperation::Mean)?
        }
    };
    Ok((optim.step(LEARNING_RATE, model, grads), value))
}
