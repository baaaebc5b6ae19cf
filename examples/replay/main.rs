//! Replays allocation traces through this crate's caching engine and CubeCL 0.10's own memory
//! management, over the same simulated device, and reports CPU time per operation, device
//! calls and peak memory.
//!
//! ```text
//! cargo run --release --no-default-features --example replay
//! cargo run --release --no-default-features --example replay -- benches/traces/*.json.gz \
//!     --runs 10 --json results.json --svg reserved.svg --allocators caching,cubecl-subslices
//! ```
//!
//! With no trace files it replays the built-in set (`burn_caching_alloc::replay::builtin`).

mod load;
mod svg;

use std::path::PathBuf;
use std::process::ExitCode;

use burn_caching_alloc::alloc::AllocatorConfig;
use burn_caching_alloc::replay::report::{json_rows, markdown_table};
use burn_caching_alloc::replay::runner::timer_overhead_ns;
use burn_caching_alloc::replay::{
    AllocatorKind, DEFAULT_DEVICE_CAPACITY, MeasureOptions, Measurement, NamedTrace, Program,
    builtin_traces, measure,
};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Replay allocation traces through the caching engine and CubeCL's pools")]
struct Args {
    /// Trace files (JSON, or gzipped JSON ending in .gz). None: the built-in set.
    traces: Vec<PathBuf>,
    /// Timed replays per trace and allocator (latencies are pooled over them).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Comma-separated allocators: caching, cubecl-subslices, cubecl-exclusive, caching-stack.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "caching,cubecl-subslices,cubecl-exclusive,caching-stack"
    )]
    allocators: Vec<String>,
    /// Capacity of the simulated device, in GiB (CubeCL's page size is a quarter of it).
    #[arg(long, default_value_t = DEFAULT_DEVICE_CAPACITY >> 30)]
    capacity_gib: u64,
    /// The engine's configuration for caching and caching-stack, in PyTorch's syntax
    /// (e.g. "roundup_power2_divisions:4,max_split_size_mb:128"). Default: the engine's default.
    #[arg(long, default_value = "")]
    caching_config: String,
    /// Write the results as a JSON array here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw reserved-over-time curves (one panel per trace) into this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
}

fn run(args: Args) -> Result<(), String> {
    let kinds = args
        .allocators
        .iter()
        .map(|name| AllocatorKind::parse(name))
        .collect::<Result<Vec<_>, _>>()?;
    if kinds.is_empty() {
        return Err("--allocators names no allocator".into());
    }
    let capacity = args
        .capacity_gib
        .checked_mul(1 << 30)
        .filter(|&c| c > 0)
        .ok_or_else(|| format!("--capacity-gib {} is out of range", args.capacity_gib))?;
    let traces: Vec<NamedTrace> = if args.traces.is_empty() {
        builtin_traces()
    } else {
        args.traces
            .iter()
            .map(|p| load::load_trace(p))
            .collect::<Result<_, _>>()?
    };
    let engine_config = AllocatorConfig::parse(&args.caching_config)
        .map_err(|e| format!("--caching-config {:?}: {e}", args.caching_config))?;
    let options = MeasureOptions {
        capacity,
        runs: args.runs,
        engine_config,
    };

    eprintln!(
        "device: simulated, {} GiB; {} timed run(s) per replay; clock overhead {} ns \
         (subtracted from every sample); engine configuration: {:?}",
        args.capacity_gib,
        args.runs,
        timer_overhead_ns(),
        args.caching_config
    );
    let mut measurements: Vec<Measurement> = Vec::new();
    let mut allocated_curves = Vec::new();
    for named in &traces {
        let program =
            Program::compile(&named.trace).map_err(|e| format!("trace {}: {e}", named.name))?;
        if program.skipped_events() > 0 || program.appended_frees() > 0 {
            eprintln!(
                "{}: skipped {} events of allocations the recording ring dropped; appended {} \
                 frees of allocations left live",
                named.name,
                program.skipped_events(),
                program.appended_frees()
            );
        }
        for &kind in &kinds {
            eprintln!(
                "replaying {} ({} ops) through {kind} ...",
                named.name,
                program.ops().len()
            );
            let m = measure(&named.name, &program, kind, &options)
                .map_err(|e| format!("trace {} through {kind}: {e}", named.name))?;
            if m.ooms > 0 {
                eprintln!("  {kind}: {} requests failed with out-of-memory", m.ooms);
            }
            measurements.push(m);
        }
        allocated_curves.push(program.allocated_curve());
    }

    print!("{}", markdown_table(&measurements));

    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&json_rows(&measurements))
            .map_err(|e| format!("cannot serialise the results: {e}"))?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.svg {
        let panels: Vec<svg::Panel<'_>> = traces
            .iter()
            .zip(allocated_curves)
            .map(|(named, allocated)| svg::Panel {
                trace: &named.name,
                allocated,
                measurements: measurements
                    .iter()
                    .filter(|m| m.trace == named.name)
                    .collect(),
            })
            .collect();
        svg::draw(path, &panels).map_err(|e| format!("cannot draw {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
