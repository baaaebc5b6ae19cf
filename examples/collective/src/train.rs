//! One SGD step, the same for a peer and for the one-process reference: the only difference
//! is how the gradients are averaged over the peers first.

use burn::backend::Autodiff;
use burn::collective::{CollectiveError, PeerId, ReduceOperation};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::data::Batch;
use crate::model::Model;
use crate::{LEARNING_RATE, flat};

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

/// The model (on `device`, of backend `B` under autodiff) after one step on `batch`, and the
/// batch's loss before it. Every peer of the collective must call this with its own shard, at
/// the same step, with the same `sync`.
///
/// # Errors
///
/// burn-collective's error.
pub fn step<B: Backend>(
    model: Model<Autodiff<B>>,
    optim: &mut impl Optimizer<Model<Autodiff<B>>, Autodiff<B>>,
    batch: &Batch,
    device: &B::Device,
    sync: GradientSync,
) -> Result<(Model<Autodiff<B>>, f32), CollectiveError>
where
    Autodiff<B>: AutodiffBackend<Device = B::Device>,
{
    let (inputs, targets) = batch.tensors::<Autodiff<B>>(device);
    let loss = model.loss(inputs, targets);
    let value = loss.clone().into_scalar().elem::<f32>();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    // burn-collective reduces the inner backend's tensors, never autodiff ones.
    grads = match sync {
        GradientSync::None => grads,
        GradientSync::PerParameter(peer) => grads.all_reduce::<B>(peer, ReduceOperation::Mean)?,
        GradientSync::Flattened(peer) => {
            flat::all_reduce::<Autodiff<B>, _>(grads, &model, peer, ReduceOperation::Mean)?
        }
    };
    Ok((optim.step(LEARNING_RATE, model, grads), value))
}
