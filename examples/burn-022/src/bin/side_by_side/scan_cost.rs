//! The cost of `Dedicated` mode's scans of its slices. Under the hook CubeCL reserves in
//! `Dedicated` mode: every reservation runs a periodic cleanup that sums and walks every slice
//! the stream holds (`DirectPool::reclaim`), and recounts the slices (`pages_peak`). So a
//! reservation costs time in proportion to the live tensors. Measured as the time per small
//! allocation + drop with few and with many small tensors live, on both sides, the sides
//! taking turns so that the machine's load falls on both alike.

use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor, TensorData};

use crate::measure::median;
use crate::pair::{Pair, Side};

/// Floats per small tensor (256 B).
const SMALL: usize = 64;
const ALLOCATIONS: usize = 1_000;
const REPEATS: usize = 7;

pub struct ScanCost {
    pub live: usize,
    /// Median over the repeats of the time per allocation + drop, stock then hooked.
    pub per_allocation: [Duration; 2],
}

pub fn measure(pair: &Pair, live_counts: &[usize]) -> Vec<ScanCost> {
    let sides = [Side::Stock, Side::Hooked];
    live_counts
        .iter()
        .map(|&live| {
            pair.reset();
            let held: Vec<Vec<Tensor<1>>> = sides
                .iter()
                .map(|&side| {
                    let device = pair.enter(side);
                    let held = (0..live).map(|_| small(device)).collect();
                    device.sync().expect("sync");
                    held
                })
                .collect();
            let mut times = [Vec::new(), Vec::new()];
            // A first round warms both sides (caches, the engine's first segment) untimed.
            for &side in &sides {
                allocations(pair.enter(side));
            }
            for _ in 0..REPEATS {
                for (index, &side) in sides.iter().enumerate() {
                    times[index].push(allocations(pair.enter(side)));
                }
            }
            drop(held);
            ScanCost {
                live,
                per_allocation: times.map(|times| median(&times)),
            }
        })
        .collect()
}

/// The time per allocation + drop over `ALLOCATIONS` of them.
fn allocations(device: &Device) -> Duration {
    let start = Instant::now();
    for _ in 0..ALLOCATIONS {
        drop(small(device));
    }
    device.sync().expect("sync");
    start.elapsed() / ALLOCATIONS as u32
}

/// One small tensor, uploaded at once (a reservation on the device's stream).
fn small(device: &Device) -> Tensor<1> {
    Tensor::<1>::from_data(TensorData::new(vec![0.5f32; SMALL], [SMALL]), device)
}
