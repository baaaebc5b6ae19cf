//! The report: every workload's result as a Markdown table and as JSON.

use serde::{Deserialize, Serialize};

use crate::compare::WorkloadResult;

/// Everything one run of the benchmark measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The device the backends ran on, as the command line named it.
    pub device: String,
    /// Steps per side and workload (a `varlen-...-s<steps>` row trains for its own count).
    pub steps: usize,
    /// Leading steps left out of the step-time statistics.
    pub warmup: usize,
    /// The seed of the backends and the batches.
    pub seed: u64,
    /// One row per workload and fusion setting, in run order.
    pub results: Vec<WorkloadResult>,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The Markdown table: one row per workload and fusion setting.
pub fn markdown_table(results: &[WorkloadResult]) -> String {
    let mut out = String::from(
        "| workload | fusion | caching reserved (sampled) | caching exact peak | stock reserved \
         (sampled) | reserved ratio | caching step | stock step | time ratio (IQR) |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in results {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | **{:.2}x** | {:.1} ms | {:.1} ms | {:.2}x ({:.2}-{:.2}) |\n",
            r.workload,
            r.fusion,
            mib(r.caching.peak_reserved_sampled),
            r.caching.exact_peak_reserved.map_or("-".into(), mib),
            mib(r.stock.peak_reserved_sampled),
            r.reserved_ratio,
            r.caching.median_step_seconds * 1e3,
            r.stock.median_step_seconds * 1e3,
            r.time_ratio,
            r.time_ratio_iqr[0],
            r.time_ratio_iqr[1],
        ));
    }
    out
}
