//! Many live parameters with small activations churning around them.
//!
//! A model of `params` parameter tensors (log-uniform sizes) is allocated first and stays live;
//! then every step allocates `activations_per_step` small activations, each freed after a
//! random number (1 to 8) of later allocations of its step, all freed by the end of the step.
//! The case where an allocator's cost grows with the number of live blocks shows here.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use burn_caching_alloc::alloc::Trace;

use super::builder::TraceBuilder;
use super::rng::SplitMix64;

/// Parameters of [`many_params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManyParamsConfig {
    pub params: usize,
    pub param_min: u64,
    pub param_max: u64,
    pub steps: usize,
    pub activations_per_step: usize,
    pub activation_min: u64,
    pub activation_max: u64,
}

impl Default for ManyParamsConfig {
    /// 10,000 parameters of 512 B to 256 KiB; 200 steps of 50 activations of 4 KiB to 1 MiB.
    fn default() -> Self {
        Self {
            params: 10_000,
            param_min: 512,
            param_max: 256 << 10,
            steps: 200,
            activations_per_step: 50,
            activation_min: 4 << 10,
            activation_max: 1 << 20,
        }
    }
}

/// The trace of [`ManyParamsConfig`], from `seed`.
pub fn many_params(config: ManyParamsConfig, seed: u64) -> Trace {
    let mut rng = SplitMix64::new(seed);
    let mut t = TraceBuilder::new();
    for _ in 0..config.params {
        t.malloc(rng.log_uniform(config.param_min, config.param_max));
    }
    for _ in 0..config.steps {
        let mut expiries = BinaryHeap::new();
        for i in 0..config.activations_per_step as u64 {
            while let Some(&Reverse((expiry, _, tensor))) = expiries.peek() {
                if expiry > i {
                    break;
                }
                expiries.pop();
                t.free(tensor);
            }
            let tensor = t.malloc(rng.log_uniform(config.activation_min, config.activation_max));
            expiries.push(Reverse((i + rng.range(1, 8), i, tensor)));
        }
        while let Some(Reverse((_, _, tensor))) = expiries.pop() {
            t.free(tensor);
        }
    }
    t.finish()
}
