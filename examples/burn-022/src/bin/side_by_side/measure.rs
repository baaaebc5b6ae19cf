//! Runs one workload on both sides, step by step, and collects what a row of the table needs.

use std::time::{Duration, Instant};

use burn::tensor::Device;

use crate::pair::{Pair, Reading, Side};

/// One workload on one device. Both sides build it from the same seed, so they see the same
/// shapes and data.
pub trait Workload {
    /// Runs step `step` and ends with a read, so the step's time covers the device's work.
    /// Answers a value both sides should agree on (a loss, a sum).
    fn step(&mut self, step: usize) -> f32;
}

/// How a row reads memory.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// After every step (a read syncs the device, which can change what it reserves).
    EveryStep,
    /// Once, after the last step: the control.
    AtEnd,
}

/// What one side did over a row.
#[derive(Default)]
pub struct SideResult {
    /// The largest reading (`None` when read only at the end).
    pub peak: Option<Reading>,
    pub last: Reading,
    pub times: Vec<Duration>,
    pub values: Vec<f32>,
}

pub struct Row {
    pub name: String,
    pub steps: usize,
    pub reads: Reads,
    pub stock: SideResult,
    pub hooked: SideResult,
    /// The engine's own peak of reserved bytes over the row (it needs no reads).
    pub engine_peak: u64,
    /// The stock side's dynamic pools at their peaks (pages_peak x page size, summed): an upper
    /// bound of the stock peak that needs no reads either.
    pub stock_pages_peak: u64,
    /// The engine's segments at the end of the row (see [`crate::table::segments`]).
    pub segments: String,
    /// The stock side's dynamic pools at the end of the row (see [`crate::table::pools`]).
    pub stock_pools: String,
}

impl Row {
    pub fn median_ratio(&self) -> f64 {
        median(&self.hooked.times).as_secs_f64() / median(&self.stock.times).as_secs_f64()
    }

    /// The two sides' step values (losses, sums): how far apart they are, relative to the value,
    /// at step 0 (same weights and data?) and at worst.
    pub fn disagreement(&self) -> (f32, f32) {
        let relative: Vec<f32> = self
            .stock
            .values
            .iter()
            .zip(&self.hooked.values)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1e-6))
            .collect();
        let first = relative.first().copied().unwrap_or(0.0);
        (first, relative.into_iter().fold(0.0, f32::max))
    }

    /// Each side's first step (CubeCL compiles and autotunes then) and median step.
    pub fn timing(&self) -> String {
        let side = |result: &SideResult| {
            format!(
                "first {:.1} s, median {:.0} ms",
                result
                    .times
                    .first()
                    .copied()
                    .unwrap_or_default()
                    .as_secs_f64(),
                median(&result.times).as_secs_f64() * 1e3
            )
        };
        format!("stock {}; hooked {}", side(&self.stock), side(&self.hooked))
    }
}

/// Runs `steps` steps of the workload `build` makes, alternating sides within each step (the
/// side that goes first alternates too, so neither always meets a cold kernel cache).
pub fn run(
    pair: &Pair,
    name: &str,
    steps: usize,
    reads: Reads,
    build: &dyn Fn(&Device) -> Box<dyn Workload>,
) -> Row {
    pair.reset();
    let mut stock = build(pair.enter(Side::Stock));
    let mut hooked = build(pair.enter(Side::Hooked));
    let mut results = [SideResult::default(), SideResult::default()];

    for step in 0..steps {
        let order = if step % 2 == 0 {
            [Side::Stock, Side::Hooked]
        } else {
            [Side::Hooked, Side::Stock]
        };
        for side in order {
            let (workload, result) = match side {
                Side::Stock => (&mut stock, &mut results[0]),
                Side::Hooked => (&mut hooked, &mut results[1]),
            };
            pair.enter(side);
            let start = Instant::now();
            let value = workload.step(step);
            result.times.push(start.elapsed());
            result.values.push(value);
            if reads == Reads::EveryStep {
                let reading = pair.read(side);
                let peak = result.peak.get_or_insert(reading);
                if reading.total > peak.total {
                    *peak = reading;
                }
            }
        }
    }

    let stock_pools = pair.stock.memory_pool_report().unwrap_or_default();
    let stock_pages_peak = stock_pools.iter().map(|p| p.pages_peak * p.page_size).sum();
    let [mut stock_result, mut hooked_result] = results;
    stock_result.last = pair.read(Side::Stock);
    hooked_result.last = pair.read(Side::Hooked);
    let row = Row {
        name: name.into(),
        steps,
        reads,
        stock: stock_result,
        hooked: hooked_result,
        engine_peak: pair.engine().stats().max_memory_reserved(),
        stock_pages_peak,
        segments: crate::table::segments(pair.engine()),
        stock_pools: crate::table::pools(&stock_pools),
    };
    drop((stock, hooked));
    row
}

pub fn median(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}
