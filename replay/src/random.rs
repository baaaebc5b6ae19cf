//! Random sizes with random lifetimes: no structure for an allocator to exploit.
//!
//! Sizes are log-uniform between a minimum and a maximum (every octave equally likely);
//! each allocation lives for a geometric number of later mallocs, so the live set hovers
//! around `mean_lifetime` allocations.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use burn_caching_alloc::alloc::Trace;

use super::builder::TraceBuilder;
use super::rng::SplitMix64;

/// Parameters of [`random_lifetimes`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomTraceConfig {
    pub mallocs: usize,
    pub min_size: u64,
    pub max_size: u64,
    /// Mean lifetime, counted in later mallocs.
    pub mean_lifetime: f64,
}

impl Default for RandomTraceConfig {
    /// 50,000 mallocs of 512 B to 64 MiB, living 200 mallocs on average.
    fn default() -> Self {
        Self {
            mallocs: 50_000,
            min_size: 512,
            max_size: 64 << 20,
            mean_lifetime: 200.0,
        }
    }
}

/// A trace of log-uniform sizes with geometric lifetimes, from `seed`.
pub fn random_lifetimes(config: RandomTraceConfig, seed: u64) -> Trace {
    let mut rng = SplitMix64::new(seed);
    let mut t = TraceBuilder::new();
    let mut expiries = BinaryHeap::new();
    for i in 0..config.mallocs as u64 {
        while let Some(&Reverse((expiry, _, tensor))) = expiries.peek() {
            if expiry > i {
                break;
            }
            expiries.pop();
            t.free(tensor);
        }
        let size = rng.log_uniform(config.min_size, config.max_size);
        let tensor = t.malloc(size);
        let expiry = i + rng.geometric(config.mean_lifetime);
        expiries.push(Reverse((expiry, i, tensor)));
    }
    while let Some(Reverse((_, _, tensor))) = expiries.pop() {
        t.free(tensor);
    }
    t.finish()
}
