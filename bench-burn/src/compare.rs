//! One workload on two backends, interleaved: step `i` runs on both sides before step `i + 1`
//! runs on either, and the side that goes first alternates, so that drift of the machine (other
//! processes, thermal state) falls on both sides alike and cancels in the ratios.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::reading::MemoryReading;
use crate::trainer::{Step, trainer};
use crate::workload::Workload;

/// How long and from what a comparison runs.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Training steps per side.
    pub steps: usize,
    /// Leading steps left out of the step-time statistics (kernel compilation, autotuning);
    /// their memory still counts.
    pub warmup: usize,
    /// Seeds the backends and the batches.
    pub seed: u64,
    /// The MNIST files (the showcase's `data/`).
    pub mnist_dir: PathBuf,
    /// Prints a line per side and step to standard error (step, sequence length, reserved
    /// bytes, seconds), so that a run cut short still says how far memory had grown.
    pub progress: bool,
    /// Reads memory after every step (the default), or only once after the last one: the
    /// control run. A reading hands CubeCL's free slices back to the engine, which can change
    /// where later tensors go; the control shows what a program that never reads gets.
    pub read_each_step: bool,
}

impl Default for CompareOptions {
    fn default() -> Self {
        Self {
            steps: 6,
            warmup: 2,
            seed: 42,
            mnist_dir: mnist::dataset::default_data_dir(),
            progress: false,
            read_each_step: true,
        }
    }
}

/// What one side did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SideResult {
    /// The backend's name.
    pub backend: String,
    /// Reserved bytes before the first step (after the previous workload's cache was freed).
    pub baseline_reserved: u64,
    /// Reserved bytes after every step beyond `baseline_reserved` (after the last step only,
    /// in a control run).
    pub reserved_after_step: Vec<u64>,
    /// The highest of `reserved_after_step`: the same sampling on both sides.
    pub peak_reserved_sampled: u64,
    /// The allocator's own peak beyond `baseline_reserved` (caching side only; CubeCL keeps
    /// none).
    pub exact_peak_reserved: Option<u64>,
    /// Seconds of every step (submission to loss on the host).
    pub step_seconds: Vec<f64>,
    /// Median of the steps after the warm-up.
    pub median_step_seconds: f64,
    /// The loss of every step (equal on both sides up to rounding: same seed, same batches).
    pub losses: Vec<f64>,
}

/// One workload on the caching and the stock backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadResult {
    /// The workload's name.
    pub workload: String,
    /// `fused` or `unfused`.
    pub fusion: String,
    /// The caching backend.
    pub caching: SideResult,
    /// Burn's stock backend of the same kind.
    pub stock: SideResult,
    /// Caching over stock sampled peak reserved.
    pub reserved_ratio: f64,
    /// Caching over stock median step time.
    pub time_ratio: f64,
    /// The noise of `time_ratio`: the 25th and 75th percentile of the per-step ratios
    /// (caching step `i` over stock step `i`, after the warm-up).
    pub time_ratio_iqr: [f64; 2],
}

struct Side<'a> {
    name: String,
    trainer: Box<dyn Step>,
    reading: &'a dyn MemoryReading,
    sync: Box<dyn Fn()>,
    result: SideResult,
}

impl Side<'_> {
    /// One step, then (when `read`) a reading of reserved memory.
    fn run(&mut self, batch: &crate::Batch, progress: bool, read: bool) -> Result<(), String> {
        let started = Instant::now();
        let loss = self
            .trainer
            .step(batch)
            .map_err(|e| format!("{}: {e}", self.name))?;
        self.result
            .step_seconds
            .push(started.elapsed().as_secs_f64());
        self.result.losses.push(loss);
        if !read {
            return Ok(());
        }
        // What this workload reserved: memory an earlier one left that no cleanup could release
        // (the stock side keeps a loader's gone workers' pools) is not the workload's.
        let reserved = self.reading.reserved();
        self.result
            .reserved_after_step
            .push(reserved.saturating_sub(self.result.baseline_reserved));
        if progress {
            let step = self.result.losses.len();
            let reserved = self.result.reserved_after_step.last().copied().unwrap_or(0);
            let seconds = self.result.step_seconds[step - 1];
            eprintln!(
                "{}: step {step}, shape {:?}, reserved {:.1} MiB, {seconds:.2} s",
                self.name,
                batch.shape,
                reserved as f64 / (1024.0 * 1024.0),
            );
        }
        Ok(())
    }
}

fn side<'a, B: AutodiffBackend>(
    name: &str,
    workload: Workload,
    device: &B::Device,
    reading: &'a dyn MemoryReading,
    seed: u64,
) -> Side<'a>
where
    B::Device: 'static,
{
    let sync_device = device.clone();
    reading.release_and_reset();
    let baseline = reading.reserved();
    Side {
        name: name.to_string(),
        trainer: trainer::<B>(workload, device, seed),
        reading,
        sync: Box::new(move || {
            let _ = B::sync(&sync_device);
            B::memory_cleanup(&sync_device);
        }),
        result: SideResult {
            backend: name.to_string(),
            baseline_reserved: baseline,
            reserved_after_step: Vec::new(),
            peak_reserved_sampled: 0,
            exact_peak_reserved: None,
            step_seconds: Vec::new(),
            median_step_seconds: f64::NAN,
            losses: Vec::new(),
        },
    }
}

/// Trains `workload` on the caching backend `Bc` and the stock backend `Bs`, interleaved, and
/// measures both. Each side starts from an empty pool (its reading's `release_and_reset`).
#[allow(clippy::too_many_arguments)]
pub fn compare<Bc, Bs>(
    workload: Workload,
    fusion: &str,
    options: &CompareOptions,
    caching: (&str, &Bc::Device, &dyn MemoryReading),
    stock: (&str, &Bs::Device, &dyn MemoryReading),
) -> Result<WorkloadResult, String>
where
    Bc: AutodiffBackend,
    Bs: AutodiffBackend,
    Bc::Device: 'static,
    Bs::Device: 'static,
{
    let steps = workload.steps(options.steps);
    if steps <= options.warmup {
        return Err(format!(
            "{workload}: {steps} steps leave nothing after a warm-up of {}",
            options.warmup
        ));
    }
    let batches = workload.batches(steps, options.seed, &options.mnist_dir)?;
    if batches.len() < steps {
        return Err(format!(
            "{workload}: only {} batches for {steps} steps",
            batches.len(),
        ));
    }
    let mut c = side::<Bc>(caching.0, workload, caching.1, caching.2, options.seed);
    let mut s = side::<Bs>(stock.0, workload, stock.1, stock.2, options.seed);
    for (i, batch) in batches.iter().enumerate() {
        let read = options.read_each_step || i + 1 == batches.len();
        if i % 2 == 0 {
            c.run(batch, options.progress, read)?;
            s.run(batch, options.progress, read)?;
        } else {
            s.run(batch, options.progress, read)?;
            c.run(batch, options.progress, read)?;
        }
    }
    c.result.exact_peak_reserved = c
        .reading
        .exact_peak()
        .map(|peak| peak.saturating_sub(c.result.baseline_reserved));
    let results = [c, s].map(|mut side| {
        side.result.peak_reserved_sampled = side
            .result
            .reserved_after_step
            .iter()
            .copied()
            .max()
            .unwrap_or(0);
        side.result.median_step_seconds = median(&side.result.step_seconds[options.warmup..]);
        // Drop the model and the optimizer state before the next workload frees the cache.
        drop(side.trainer);
        (side.sync)();
        side.result
    });
    let ratios: Vec<f64> = results[0].step_seconds[options.warmup..]
        .iter()
        .zip(&results[1].step_seconds[options.warmup..])
        .map(|(c, s)| c / s)
        .collect();
    let [caching, stock] = results;
    Ok(WorkloadResult {
        workload: workload.name(),
        fusion: fusion.to_string(),
        reserved_ratio: caching.peak_reserved_sampled as f64 / stock.peak_reserved_sampled as f64,
        time_ratio: caching.median_step_seconds / stock.median_step_seconds,
        time_ratio_iqr: [quantile(&ratios, 0.25), quantile(&ratios, 0.75)],
        caching,
        stock,
    })
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    quantile(values, 0.5)
}

/// The `q` quantile of `values` by linear interpolation between order statistics.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let position = q * (sorted.len() - 1) as f64;
    let low = position.floor() as usize;
    let high = position.ceil() as usize;
    sorted[low] + (sorted[high] - sorted[low]) * (position - low as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_order_statistics() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.25), 2.0);
        assert!(median(&[]).is_nan());
    }
}
