//! The training data: a fixed linear map to learn, batches built from the step number, and
//! each peer's shard of a batch.
//!
//! Inputs are small integers and the targets integer combinations of them, so every sum the
//! training makes (matmuls, the loss's mean, the all-reduce's mean over a power-of-two number
//! of peers) is exact in f32: the step of N peers equals the one-process step bit for bit.

use burn::prelude::*;

use crate::model::{INPUTS, OUTPUTS};

/// Examples per step, over all peers together.
pub const GLOBAL_BATCH: usize = 8;

/// One step's examples: inputs `[rows, INPUTS]` and targets `[rows, OUTPUTS]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Row-major inputs.
    pub inputs: Vec<f32>,
    /// Row-major targets.
    pub targets: Vec<f32>,
    /// Number of examples.
    pub rows: usize,
}

/// Why a number of peers cannot share the batch.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error(
    "{peers} peers cannot share a batch of {GLOBAL_BATCH} examples: the number of peers (processes \
     times devices) must be a power of two that divides {GLOBAL_BATCH}"
)]
pub struct ShardError {
    /// The number of peers asked for.
    pub peers: usize,
}

/// Checks that `peers` peers can share every batch equally (and exactly: a power of two).
pub fn check_peers(peers: usize) -> Result<(), ShardError> {
    if peers == 0 || !peers.is_power_of_two() || !GLOBAL_BATCH.is_multiple_of(peers) {
        return Err(ShardError { peers });
    }
    Ok(())
}

/// The map the model learns: target k = sum over j of x_j * A[j][k], A in {-1, 0, 1}.
fn target(x: &[f32], k: usize) -> f32 {
    x.iter()
        .enumerate()
        .map(|(j, v)| v * (((j + 2 * k) % 3) as f32 - 1.0))
        .sum()
}

/// The whole batch of step `step`.
pub fn batch(step: usize) -> Batch {
    let mut inputs = Vec::with_capacity(GLOBAL_BATCH * INPUTS);
    let mut targets = Vec::with_capacity(GLOBAL_BATCH * OUTPUTS);
    for row in 0..GLOBAL_BATCH {
        let x: Vec<f32> = (0..INPUTS)
            .map(|j| ((row * 3 + j * 5 + step * 7) % 5) as f32 - 2.0)
            .collect();
        targets.extend((0..OUTPUTS).map(|k| target(&x, k)));
        inputs.extend(x);
    }
    Batch {
        inputs,
        targets,
        rows: GLOBAL_BATCH,
    }
}

/// Peer `peer`'s shard (of `peers`) of step `step`'s batch: consecutive rows.
pub fn shard(step: usize, peer: usize, peers: usize) -> Result<Batch, ShardError> {
    check_peers(peers)?;
    let whole = batch(step);
    let rows = GLOBAL_BATCH / peers;
    let first = peer * rows;
    Ok(Batch {
        inputs: whole.inputs[first * INPUTS..(first + rows) * INPUTS].to_vec(),
        targets: whole.targets[first * OUTPUTS..(first + rows) * OUTPUTS].to_vec(),
        rows,
    })
}

impl Batch {
    /// The inputs and targets as tensors on `device`.
    pub fn tensors<B: Backend>(&self, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let inputs = TensorData::new(self.inputs.clone(), [self.rows, INPUTS]);
        let targets = TensorData::new(self.targets.clone(), [self.rows, OUTPUTS]);
        (
            Tensor::from_data(inputs, device),
            Tensor::from_data(targets, device),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_consecutive_rows_of_the_batch() {
        let whole = batch(3);
        let mut joined = Vec::new();
        for peer in 0..4 {
            let part = shard(3, peer, 4).unwrap();
            assert_eq!(part.rows, 2);
            joined.extend(part.inputs);
        }
        assert_eq!(joined, whole.inputs);
    }

    #[test]
    fn peers_that_cannot_share_the_batch_exactly_are_an_error() {
        for peers in [0, 3, 6, 16] {
            assert_eq!(shard(0, 0, peers), Err(ShardError { peers }));
        }
        for peers in [1, 2, 4, 8] {
            assert!(check_peers(peers).is_ok());
        }
    }
}
