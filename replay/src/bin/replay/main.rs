//! Replays allocation traces through burn-caching-alloc's caching engine and CubeCL 0.10's own
//! memory management, over the same device (simulated, or a real CUDA device), and reports CPU time
//! per operation, device calls and peak memory.
//!
//! ```text
//! cargo run --release -p replay
//! cargo run --release -p replay -- replay/traces/*.json.gz \
//!     --runs 10 --json results.json --svg reserved.svg --allocators caching,cubecl-subslices
//! cargo run --release -p replay --features cuda -- --device cuda
//! cargo run --release -p replay -- --tune my-training.json.gz
//! ```
//!
//! With no trace files it replays the built-in set (`replay::builtin`); a built-in trace's
//! name may stand for a file. `caching` and `caching-stack` run once per `--config` string
//! (default: the default rules, then `expandable_segments:true`; a string the engine rejects
//! is skipped with a note). `--tune TRACE...` replays a grid of configurations through
//! `caching-stack` instead (`replay::tune`) and ends with the string to put in
//! `BURN_CACHING_ALLOC_CONF`.
//! `--device sim` (the default) runs on a simulated device of `--capacity-gib` GiB;
//! `--device cuda` (feature `cuda`) runs on CUDA device 0, every pass on real device memory,
//! with CubeCL's pools sized from the device's total memory as cubecl-cuda sizes them. Without
//! CUDA it prints why and exits with status 1.

mod load;
mod svg;

use std::path::PathBuf;
use std::process::ExitCode;

use burn_caching_alloc::alloc::CONFIG_ENV;
use clap::{Parser, ValueEnum};
use replay::report::{config_label, json_rows, markdown_table};
use replay::runner::timer_overhead_ns;
use replay::tune::{recommend, tune_table, tune_traces};
use replay::{
    AllocatorKind, DEFAULT_DEVICE_CAPACITY, MeasureOptions, Measurement, NamedTrace, Program,
    ReplayDevice, SimReplayDevice, builtin_traces, measure_on,
};

/// The device the replays run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// A simulated device of --capacity-gib GiB.
    Sim,
    /// CUDA device 0 (needs the `cuda` feature and an NVIDIA GPU).
    Cuda,
}

#[derive(Parser, Debug)]
#[command(about = "Replay allocation traces through the caching engine and CubeCL's pools")]
struct Args {
    /// Trace files (JSON, or gzipped JSON ending in .gz), or built-in trace names. None: the
    /// built-in set.
    traces: Vec<PathBuf>,
    /// Replay a grid of engine configurations through caching-stack on the traces, rank them
    /// and print the configuration string for BURN_CACHING_ALLOC_CONF.
    #[arg(long)]
    tune: bool,
    /// The device to replay on: simulated, or CUDA device 0 (built with the `cuda` feature).
    #[arg(long, value_enum, default_value_t = DeviceArg::Sim)]
    device: DeviceArg,
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
    /// Capacity of the simulated device in GiB, 24 by default (CubeCL's page size is a quarter
    /// of it). `--device sim` only: on CUDA the capacity is the device's total memory.
    #[arg(long, value_name = "GIB")]
    capacity_gib: Option<u64>,
    /// An engine configuration for caching and caching-stack, in PyTorch's syntax (e.g.
    /// "roundup_power2_divisions:4,max_split_size_mb:128"; "" is the default rules). Repeat
    /// for one row per configuration; one the engine rejects is skipped with a note.
    #[arg(long = "config", value_name = "STR", default_values_t = default_configs())]
    configs: Vec<String>,
    /// Write the results as a JSON array here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw reserved-over-time curves (one panel per trace) into this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// The configurations every trace runs with by default: the default rules, and expandable
/// segments (skipped with a note while the engine does not accept the key).
fn default_configs() -> Vec<String> {
    vec![String::new(), "expandable_segments:true".to_string()]
}

/// The options of every configuration the engine accepts, in order; a note for each other.
fn accepted_configs(base: &MeasureOptions, configs: &[String]) -> Vec<MeasureOptions> {
    configs
        .iter()
        .filter_map(|text| match base.clone().with_config(text) {
            Ok(options) => Some(options),
            Err(err) => {
                eprintln!("note: skipping configuration {text:?}: {err}");
                None
            }
        })
        .collect()
}

/// The most timed runs `--runs` accepts (each replays every trace once per allocator).
const MAX_RUNS: usize = 10_000;

fn run(args: Args) -> Result<(), String> {
    if !(1..=MAX_RUNS).contains(&args.runs) {
        return Err(format!(
            "--runs {} is out of range: between 1 and {MAX_RUNS}",
            args.runs
        ));
    }
    let kinds = args
        .allocators
        .iter()
        .map(|name| AllocatorKind::parse(name))
        .collect::<Result<Vec<_>, _>>()?;
    if kinds.is_empty() {
        return Err("--allocators names no allocator".into());
    }
    let traces: Vec<NamedTrace> = if args.traces.is_empty() {
        builtin_traces()
    } else {
        args.traces
            .iter()
            .map(|p| load::load_trace(p))
            .collect::<Result<_, _>>()?
    };
    match args.device {
        DeviceArg::Sim => {
            let gib = args.capacity_gib.unwrap_or(DEFAULT_DEVICE_CAPACITY >> 30);
            let capacity = gib
                .checked_mul(1 << 30)
                .filter(|&c| c > 0)
                .ok_or_else(|| format!("--capacity-gib {gib} is out of range"))?;
            let options = MeasureOptions {
                capacity,
                ..MeasureOptions::new(args.runs)
            };
            replay_all(
                &SimReplayDevice::new(capacity),
                &args,
                &kinds,
                &traces,
                &options,
            )
        }
        DeviceArg::Cuda => run_cuda(&args, &kinds, &traces),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &Args, kinds: &[AllocatorKind], traces: &[NamedTrace]) -> Result<(), String> {
    use burn_caching_alloc::cuda::cuda_available;
    use replay::devices::CudaReplayDevice;

    if args.capacity_gib.is_some() {
        eprintln!(
            "note: --capacity-gib applies to the simulated device only; ignored with --device cuda"
        );
    }
    cuda_available().map_err(|reason| format!("CUDA is not available: {reason}"))?;
    let device =
        CudaReplayDevice::new(0).map_err(|reason| format!("CUDA is not available: {reason}"))?;
    let options = MeasureOptions {
        capacity: device.capacity(),
        ..MeasureOptions::new(args.runs)
    };
    replay_all(&device, args, kinds, traces, &options)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &Args, _: &[AllocatorKind], _: &[NamedTrace]) -> Result<(), String> {
    Err(
        "--device cuda: this binary was built without the cuda feature \
         (cargo run --release -p replay --features cuda -- --device cuda)"
            .into(),
    )
}

/// Replays every trace through every allocator on `device`, and writes the reports.
fn replay_all<R: ReplayDevice>(
    device: &R,
    args: &Args,
    kinds: &[AllocatorKind],
    traces: &[NamedTrace],
    options: &MeasureOptions,
) -> Result<(), String> {
    if args.tune {
        return tune_all(device, args, traces);
    }
    let configs = accepted_configs(options, &args.configs);
    eprintln!(
        "device: {}; {} timed run(s) per replay; clock overhead {} ns \
         (subtracted from every sample); engine configurations: {}",
        device.describe(),
        args.runs,
        timer_overhead_ns(),
        configs
            .iter()
            .map(|o| format!("{:?}", o.config_text))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut measurements: Vec<Measurement> = Vec::new();
    let mut allocated_curves = Vec::new();
    for named in traces {
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
        for &kind in kinds {
            let engine_rules = matches!(kind, AllocatorKind::Caching | AllocatorKind::CachingStack);
            let runs: &[MeasureOptions] = if engine_rules {
                &configs
            } else {
                std::slice::from_ref(options)
            };
            for options in runs {
                let label = if engine_rules {
                    config_label(Some(&options.config_text))
                } else {
                    "-"
                };
                eprintln!(
                    "replaying {} ({} ops) through {kind} ({label}) ...",
                    named.name,
                    program.ops().len()
                );
                let m = measure_on(device, &named.name, &program, kind, options)
                    .map_err(|e| format!("trace {} through {kind} ({label}): {e}", named.name))?;
                if m.ooms > 0 {
                    eprintln!("  {kind}: {} requests failed with out-of-memory", m.ooms);
                }
                measurements.push(m);
            }
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

/// `--tune`: the grid on every trace, each ranked, then the recommendation.
fn tune_all<R: ReplayDevice>(device: &R, args: &Args, traces: &[NamedTrace]) -> Result<(), String> {
    eprintln!(
        "tuning on {}; {} timed run(s) per configuration",
        device.describe(),
        args.runs
    );
    let programs = traces
        .iter()
        .map(|named| {
            Program::compile(&named.trace)
                .map(|program| (named.name.clone(), program))
                .map_err(|e| format!("trace {}: {e}", named.name))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let reports = tune_traces(device, &programs, args.runs).map_err(|e| e.to_string())?;
    for report in &reports {
        println!("{}", tune_table(report));
    }
    let best = recommend(&reports).ok_or("no configuration was replayed on every trace")?;
    if best.is_empty() {
        println!("Best: the default rules (leave {CONFIG_ENV} unset):\n\n{CONFIG_ENV}=");
    } else {
        println!(
            "Best configuration:\n\n{CONFIG_ENV}={best}\n\nor, on a device already open:\n\n\
             burn_caching_alloc::backend::set_allocator_settings(&device, \"{best}\")?;"
        );
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
