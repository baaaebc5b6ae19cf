//! Reporting measurements: a Markdown table and JSON rows.

use serde::{Deserialize, Serialize};

use super::runner::Measurement;

/// One row of the `--json` output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JsonRow {
    pub trace: String,
    pub allocator: String,
    /// The engine's configuration string (`""`: default rules); `null` for CubeCL's pools.
    pub config: Option<String>,
    pub ns_per_op_median: f64,
    pub ns_per_op_p99: f64,
    pub device_allocs: u64,
    pub device_frees: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// Beyond the required keys: mean latency, median over mallocs, operations,
    /// reserved/allocated, OOMs.
    pub ns_per_op_mean: f64,
    pub ns_per_malloc_median: f64,
    pub ops: usize,
    pub peak_reserved_over_allocated: f64,
    pub ooms: u64,
}

impl From<&Measurement> for JsonRow {
    fn from(m: &Measurement) -> Self {
        Self {
            trace: m.trace.clone(),
            allocator: m.allocator.name().to_string(),
            config: m.config.clone(),
            ns_per_op_median: m.ns_per_op_median,
            ns_per_op_p99: m.ns_per_op_p99,
            device_allocs: m.device_allocs,
            device_frees: m.device_frees,
            peak_allocated: m.peak_allocated,
            peak_reserved: m.peak_reserved,
            ns_per_op_mean: m.ns_per_op_mean,
            ns_per_malloc_median: m.ns_per_malloc_median,
            ops: m.ops,
            peak_reserved_over_allocated: m.reserved_ratio(),
            ooms: m.ooms,
        }
    }
}

/// The measurements as JSON rows (an array of objects).
pub fn json_rows(measurements: &[Measurement]) -> Vec<JsonRow> {
    measurements.iter().map(JsonRow::from).collect()
}

/// Bytes as MiB with two decimals.
pub fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// How a table shows a measurement's configuration: `-` for CubeCL's pools, `default` for
/// the default rules, else the string itself.
pub fn config_label(config: Option<&str>) -> &str {
    match config {
        None => "-",
        Some("") => "default",
        Some(text) => text,
    }
}

/// The measurements as a Markdown table, one row per trace, allocator and configuration.
pub fn markdown_table(measurements: &[Measurement]) -> String {
    let mut out = String::from(
        "| trace | allocator | config | ops | ns/op median | ns/op p99 | ns/op mean | ns/malloc median | device allocs | \
         device frees | peak allocated | peak reserved | reserved / allocated | OOMs |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for m in measurements {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {:.3} | {} |\n",
            m.trace,
            m.allocator,
            config_label(m.config.as_deref()),
            m.ops,
            m.ns_per_op_median,
            m.ns_per_op_p99,
            m.ns_per_op_mean,
            m.ns_per_malloc_median,
            m.device_allocs,
            m.device_frees,
            mib(m.peak_allocated),
            mib(m.peak_reserved),
            m.reserved_ratio(),
            m.ooms,
        ));
    }
    out
}
