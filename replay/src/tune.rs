//! `replay --tune`: which engine configuration suits a workload.
//!
//! A trace (one recorded from the user's own training with `BURN_CACHING_ALLOC_TRACE`, or a
//! built-in one) is replayed through `caching-stack`, the layering the CubeCL server runs,
//! once per configuration of a grid ([`tune_grid`]): the default rules, expandable segments,
//! `max_split_size_mb`, `roundup_power2_divisions`, and `garbage_collection_threshold`
//! (which, as in PyTorch, acts only under a memory fraction below 1, so the grid pairs it
//! with `per_process_memory_fraction` sized from the trace's live peak). Configurations the
//! engine does not accept (e.g. a key this build does not implement yet) are skipped and
//! reported, never silently dropped.
//!
//! Rows rank best first by: fewer failed requests, then lower peak reserved memory, then
//! fewer device calls; ties keep the grid's order (the default first, so a knob is
//! recommended only when it changes something). CPU time per operation is shown, not ranked
//! on: it moves by about 10 % between runs, the memory numbers do not move at all. Over
//! several traces (one grid for all, its memory fraction sized from the largest live peak)
//! the recommendation is the configuration with the fewest failed requests in total, then
//! the lowest mean of its peak reserved relative to the best peak on each trace.

use super::ReplayError;
use super::allocator::AllocatorKind;
use super::devices::ReplayDevice;
use super::program::Program;
use super::report::{config_label, mib};
use super::runner::{MeasureOptions, Measurement, measure_on};

/// Memory fractions the grid's garbage-collection rows use are multiples of this.
const FRACTION_STEP: f64 = 0.05;

/// Headroom over the trace's live peak that a garbage-collection row's memory fraction leaves.
const FRACTION_HEADROOM: f64 = 1.5;

/// The configurations `--tune` tries on a trace whose live requests peak at `peak_live`
/// bytes on a device of `capacity` bytes. The first is the default (`""`).
pub fn tune_grid(peak_live: u64, capacity: u64) -> Vec<String> {
    let mut grid = vec![String::new(), "expandable_segments:true".to_string()];
    for mb in [32, 128, 512] {
        grid.push(format!("max_split_size_mb:{mb}"));
    }
    for divisions in [2, 4, 8] {
        grid.push(format!("roundup_power2_divisions:{divisions}"));
    }
    let fraction = gc_fraction(peak_live, capacity);
    if fraction < 1.0 {
        for threshold in [0.6, 0.8] {
            grid.push(format!(
                "garbage_collection_threshold:{threshold},per_process_memory_fraction:{fraction}"
            ));
        }
    }
    grid.push("expandable_segments:true,roundup_power2_divisions:4".to_string());
    grid
}

/// The memory fraction of the garbage-collection rows: the live peak with headroom, rounded
/// up to a multiple of 0.05 (at least 0.05); 1.0 when that leaves no room below the device.
pub fn gc_fraction(peak_live: u64, capacity: u64) -> f64 {
    if capacity == 0 {
        return 1.0;
    }
    let wanted = peak_live as f64 * FRACTION_HEADROOM / capacity as f64;
    let steps = (wanted / FRACTION_STEP).ceil().max(1.0);
    let fraction = steps * FRACTION_STEP;
    if fraction >= 1.0 {
        1.0
    } else {
        // Two decimals, so the string reads as written.
        (fraction * 100.0).round() / 100.0
    }
}

/// One configuration's replay of one trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneRow {
    /// The configuration string (`""`: the default rules).
    pub config: String,
    pub measurement: Measurement,
}

impl TuneRow {
    /// Device allocations plus device frees.
    pub fn device_calls(&self) -> u64 {
        self.measurement.device_allocs + self.measurement.device_frees
    }

    fn rank_key(&self) -> (u64, u64, u64) {
        let m = &self.measurement;
        (m.ooms, m.peak_reserved, self.device_calls())
    }
}

/// The grid replayed on one trace, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneReport {
    pub trace: String,
    /// Best first.
    pub rows: Vec<TuneRow>,
    /// Configurations the engine rejected, with the reason.
    pub skipped: Vec<(String, String)>,
}

impl TuneReport {
    /// The best configuration's row.
    pub fn best(&self) -> Option<&TuneRow> {
        self.rows.first()
    }

    /// The default configuration's row, if it was replayed.
    pub fn default_row(&self) -> Option<&TuneRow> {
        self.rows.iter().find(|row| row.config.is_empty())
    }
}

/// Replays `program` (named `trace`) through `caching-stack` on fresh devices from `device`
/// with every configuration of `grid`, `runs` timed passes each.
pub fn tune<R: ReplayDevice>(
    device: &R,
    trace: &str,
    program: &Program,
    grid: &[String],
    runs: usize,
) -> Result<TuneReport, ReplayError> {
    let base = MeasureOptions {
        capacity: device.capacity(),
        ..MeasureOptions::new(runs)
    };
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for config in grid {
        let options = match base.clone().with_config(config) {
            Ok(options) => options,
            Err(err) => {
                skipped.push((config.clone(), err.to_string()));
                continue;
            }
        };
        let measurement = measure_on(
            device,
            trace,
            program,
            AllocatorKind::CachingStack,
            &options,
        )?;
        rows.push(TuneRow {
            config: options.config_text,
            measurement,
        });
    }
    rows.sort_by_key(TuneRow::rank_key);
    Ok(TuneReport {
        trace: trace.to_string(),
        rows,
        skipped,
    })
}

/// Tunes every trace of `traces` (name, compiled trace) with one grid: [`tune_grid`] for the
/// largest live peak among them on `device`.
pub fn tune_traces<R: ReplayDevice>(
    device: &R,
    traces: &[(String, Program)],
    runs: usize,
) -> Result<Vec<TuneReport>, ReplayError> {
    let peak_live = traces
        .iter()
        .map(|(_, program)| program.peak_allocated())
        .max()
        .unwrap_or(0);
    let grid = tune_grid(peak_live, device.capacity());
    traces
        .iter()
        .map(|(name, program)| tune(device, name, program, &grid, runs))
        .collect()
}

/// Over several traces' reports: the configuration replayed on every trace with the fewest
/// failed requests in total, then the lowest mean of peak reserved over the trace's best
/// peak reserved. `None` if no configuration was replayed on every trace.
pub fn recommend(reports: &[TuneReport]) -> Option<String> {
    let first = reports.first()?;
    let mut scored: Vec<(u64, f64, String)> = Vec::new();
    'configs: for row in &first.rows {
        let mut ooms = 0;
        let mut relative = 0.0;
        for report in reports {
            let best = report
                .rows
                .iter()
                .map(|r| r.measurement.peak_reserved)
                .min()?;
            let Some(this) = report.rows.iter().find(|r| r.config == row.config) else {
                continue 'configs;
            };
            ooms += this.measurement.ooms;
            relative += this.measurement.peak_reserved as f64 / best.max(1) as f64;
        }
        scored.push((ooms, relative / reports.len() as f64, row.config.clone()));
    }
    scored.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    scored.into_iter().next().map(|(_, _, config)| config)
}

/// One trace's report as a Markdown table, best first.
pub fn tune_table(report: &TuneReport) -> String {
    let mut out = format!(
        "{}:\n\n| rank | configuration | peak reserved | reserved / live | device calls | \
         ns/op median | ns/malloc median | OOMs |\n|---:|---|---:|---:|---:|---:|---:|---:|\n",
        report.trace
    );
    for (rank, row) in report.rows.iter().enumerate() {
        let m = &row.measurement;
        out.push_str(&format!(
            "| {} | {} | {} | {:.3} | {} | {:.0} | {:.0} | {} |\n",
            rank + 1,
            config_label(Some(&row.config)),
            mib(m.peak_reserved),
            m.reserved_ratio(),
            row.device_calls(),
            m.ns_per_op_median,
            m.ns_per_malloc_median,
            m.ooms,
        ));
    }
    for (config, reason) in &report.skipped {
        out.push_str(&format!("\nskipped `{config}`: {reason}\n"));
    }
    out
}
