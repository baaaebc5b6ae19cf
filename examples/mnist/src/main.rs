//! MNIST on the caching allocator: the main job of `burn-caching-alloc`.
//!
//! ```text
//! cargo run --release -p mnist                             # auto: caching-cuda, else caching-wgpu
//! cargo run --release -p mnist -- --compare --epochs 2
//! cargo run --release -p mnist --no-default-features --features wgpu -- --backend wgpu --limit 6000
//! ```
//!
//! Data: the four MNIST IDX files (plain or `.gz`) in `--data-dir`, by default this crate's
//! `data/` folder, where they ship with their `SHA256SUMS`. Whenever the folder has a
//! `SHA256SUMS`, every file it lists is checked before training; a corrupt file stops the run
//! with its name.
//!
//! With `BURN_CACHING_ALLOC_TRACE=PATH` (`.json`, or `.json.gz` to compress) a caching
//! backend records every tensor's reservation and release and writes the trace to PATH at the
//! end; the `replay` crate replays it (this is how its recorded traces were made).
//!
//! `--memory-snapshot PATH` writes a PyTorch-format snapshot (pytorch.org/memory_viz,
//! `_memory_viz.py`) and `--memory-viz PATH.html` the offline viewer at the end of a caching
//! run; either records the allocator's history from the start (`--memory-stacks`: with a
//! stack per allocation).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use mnist::backend_choice::{cuda_device_present, unavailable_reason};
use mnist::cli::TrainingArgs;
use mnist::dataset::{MnistSet, Split, default_data_dir};
use mnist::progress::EpochProgress;
use mnist::timeline::{TimelineRun, write_timeline_svg};
use mnist::{
    BackendChoice, Fusion, MemoryDumps, RunOutcome, TrainConfig, TrainReport, train_on_with,
};

/// Train a Burn model on MNIST and report what the allocator did.
#[derive(Debug, Parser)]
#[command(name = "mnist", version)]
struct Args {
    /// auto | caching-cuda | cuda | caching-wgpu | wgpu (cuda and wgpu are Burn's stock backends).
    #[arg(long, default_value = "auto")]
    backend: BackendChoice,
    #[command(flatten)]
    training: TrainingArgs,
    /// Write the JSON report here (with --compare: a JSON array of both reports).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Draw allocated/reserved bytes over training steps into this SVG.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Train on the stock backend, then on the caching one (same seed and
    /// batches), and print both side by side. Both are fused (Burn's default `Wgpu`/`Cuda`
    /// against `CachingWgpu`/`CachingCuda`) unless --unfused is given.
    #[arg(long)]
    compare: bool,
    /// Train on the unfused backends (the plain `CubeBackend`s: Burn's without its `fusion`
    /// feature, and `CachingWgpuUnfused`/`CachingCudaUnfused`); both sides of --compare.
    /// Builds without the `fusion` feature train unfused anyway.
    #[arg(long)]
    unfused: bool,
    /// Record the allocator's history and write a PyTorch-format snapshot here at the end
    /// (open it in pytorch.org/memory_viz or `python torch/cuda/_memory_viz.py`).
    #[arg(long, value_name = "PATH")]
    memory_snapshot: Option<PathBuf>,
    /// Record the allocator's history and write the offline HTML viewer here at the end.
    #[arg(long, value_name = "PATH.html")]
    memory_viz: Option<PathBuf>,
    /// With --memory-snapshot/--memory-viz: record a stack with every allocation.
    #[arg(long)]
    memory_stacks: bool,
}

fn main() -> ExitCode {
    // SAFETY: first thing in `main`, before any thread (Burn's, wgpu's, the progress bar's)
    // starts. Without it a headless machine's first output is libwayland's complaint about
    // XDG_RUNTIME_DIR, printed by Mesa's Vulkan device-select layer (see `headless`).
    let _runtime_dir = unsafe { mnist::headless::ensure_xdg_runtime_dir() };
    let args = Args::parse();
    if !cfg!(any(feature = "cuda", feature = "wgpu")) {
        eprintln!(
            "error: no backend is compiled into this build: rebuild with the default features, \
             or `--features wgpu` and/or `--features cuda`"
        );
        return ExitCode::FAILURE;
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let cuda_present = cuda_device_present();
    let choices = if args.compare {
        let resolved = args.backend.resolve(cuda_present);
        vec![resolved.stock_counterpart(), resolved.caching_counterpart()]
    } else {
        vec![args.backend.resolve(cuda_present)]
    };
    let fusion = if args.unfused {
        Fusion::Unfused
    } else {
        Fusion::default_for_build()
    };
    // Refuse a backend that cannot run here before loading anything.
    if let Some(reason) = choices
        .iter()
        .find_map(|&c| unavailable_reason(c))
        .or_else(|| fusion.unavailable_reason())
    {
        return Err(reason);
    }
    if (args.memory_snapshot.is_some() || args.memory_viz.is_some())
        && !choices.iter().any(|c| c.is_caching())
    {
        return Err(format!(
            "--memory-snapshot and --memory-viz read the caching allocator's history; backend {} \
             has none (pick caching-cuda or caching-wgpu)",
            choices[0]
        ));
    }
    let data_dir = data_dir(args.training.data_dir.as_deref())?;
    let train =
        MnistSet::load(&data_dir, Split::Train, args.training.limit).map_err(|e| e.to_string())?;
    let test = MnistSet::load(&data_dir, Split::Test, args.training.test_limit)
        .map_err(|e| e.to_string())?;
    let config = TrainConfig {
        model: args.training.model,
        epochs: args.training.epochs,
        batch_size: args.training.batch_size,
        learning_rate: args.training.lr,
        seed: args.training.seed,
        ..TrainConfig::default()
    };
    println!(
        "MNIST {} ({}): {} training / {} test images from {}, {} epoch(s), batch {}, lr {}, seed {}",
        config.model,
        match fusion {
            Fusion::Fused => "fused",
            Fusion::Unfused => "unfused",
        },
        train.len(),
        test.len(),
        data_dir.display(),
        config.epochs,
        config.batch_size,
        config.learning_rate,
        config.seed
    );

    let dumps = MemoryDumps {
        snapshot: args.memory_snapshot.clone(),
        viz: args.memory_viz.clone(),
        stacks: args.memory_stacks,
    };
    let mut outcomes = Vec::new();
    for choice in choices {
        let name = fusion.run_name(choice);
        let mut progress = EpochProgress::new(&name);
        let outcome = train_on_with(
            choice,
            fusion,
            &train,
            &test,
            &config,
            &mut progress,
            &dumps,
        )
        .map_err(|e| e.to_string())?;
        print_memory(&outcome);
        outcomes.push(outcome);
    }
    if outcomes.len() == 2 {
        print_comparison(&outcomes[0].report, &outcomes[1].report);
    }

    if let Some(path) = &args.report {
        let reports: Vec<&TrainReport> = outcomes.iter().map(|o| &o.report).collect();
        let json = if let [single] = reports.as_slice() {
            serde_json::to_string_pretty(single)
        } else {
            serde_json::to_string_pretty(&reports)
        }
        .map_err(|e| format!("cannot encode the report: {e}"))?;
        std::fs::write(path, json + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("report written to {}", path.display());
    }
    if let Some(path) = &args.timeline {
        let runs: Vec<TimelineRun<'_>> = outcomes
            .iter()
            .map(|o| TimelineRun {
                name: &o.report.backend,
                points: &o.report.timeline,
            })
            .collect();
        write_timeline_svg(path, &runs).map_err(|e| e.to_string())?;
        println!("timeline written to {}", path.display());
    }
    Ok(())
}

/// `--data-dir`, else this crate's `data/` folder, else an error that says how to get the
/// files (the binary was moved away from its source tree).
fn data_dir(given: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(dir) = given {
        return if dir.is_dir() {
            Ok(dir.to_path_buf())
        } else {
            Err(format!("--data-dir {} is not a folder", dir.display()))
        };
    }
    let dir = default_data_dir();
    if dir.is_dir() {
        return Ok(dir);
    }
    Err(format!(
        "no MNIST data: {} (where the files ship) is gone; pass --data-dir DIR with \
         train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and \
         t10k-labels-idx1-ubyte (plain or .gz; e.g. from \
         https://storage.googleapis.com/cvdf-datasets/mnist/)",
        dir.display()
    ))
}

fn print_memory(outcome: &RunOutcome) {
    let report = &outcome.report;
    let m = &report.memory;
    println!("{} memory:", report.backend);
    match (m.peak_allocated, m.peak_reserved) {
        (Some(a), Some(r)) => println!("  peak allocated {}, peak reserved {}", mib(a), mib(r)),
        _ => println!("  peaks: not reported (CubeCL's default pool keeps no peaks)"),
    }
    if let (Some(alloc), Some(free), Some(retries), Some(ooms)) = (
        m.num_device_alloc,
        m.num_device_free,
        m.num_alloc_retries,
        m.num_ooms,
    ) {
        println!(
            "  device allocations {alloc}, device frees {free}, alloc retries {retries}, OOMs {ooms}"
        );
    }
    if let Some(max) = report.timeline.iter().map(|p| p.reserved).max() {
        println!("  reserved after steps: max {}", mib(max));
    }
    if let Some(summary) = &outcome.summary {
        println!("{summary}");
    }
    for path in &outcome.dumps {
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        println!(
            "  memory file written to {} ({})",
            path.display(),
            mib(size)
        );
    }
    if let Some(path) = &outcome.trace {
        println!("  allocator trace written to {}", path.display());
    }
}

fn print_comparison(stock: &TrainReport, caching: &TrainReport) {
    let w = 26;
    println!();
    println!("{:<w$} {:>16} {:>16}", "", stock.backend, caching.backend);
    for (s, c) in stock.epochs.iter().zip(&caching.epochs) {
        println!(
            "{:<w$} {:>16} {:>16}",
            format!("epoch {} seconds", s.epoch),
            format!("{:.2}", s.seconds),
            format!("{:.2}", c.seconds)
        );
        println!(
            "{:<w$} {:>16} {:>16}",
            format!("epoch {} test accuracy", s.epoch),
            format!("{:.2}%", s.accuracy * 100.0),
            format!("{:.2}%", c.accuracy * 100.0)
        );
        println!(
            "{:<w$} {:>16} {:>16}",
            format!("epoch {} loss", s.epoch),
            format!("{:.4}", s.loss),
            format!("{:.4}", c.loss)
        );
    }
    let seconds = |r: &TrainReport| r.epochs.iter().map(|e| e.seconds).sum::<f64>();
    println!(
        "{:<w$} {:>33}",
        "epoch time caching/stock",
        format!("{:.2}x", seconds(caching) / seconds(stock))
    );
    let opt = |v: Option<u64>, f: fn(u64) -> String| v.map(f).unwrap_or_else(|| "n/a".into());
    let count = |v: u64| v.to_string();
    let rows: [(&str, String, String); 5] = [
        (
            "peak reserved",
            opt(stock.memory.peak_reserved, mib),
            opt(caching.memory.peak_reserved, mib),
        ),
        (
            "peak allocated",
            opt(stock.memory.peak_allocated, mib),
            opt(caching.memory.peak_allocated, mib),
        ),
        (
            "device allocations",
            opt(stock.memory.num_device_alloc, count),
            opt(caching.memory.num_device_alloc, count),
        ),
        (
            "device frees",
            opt(stock.memory.num_device_free, count),
            opt(caching.memory.num_device_free, count),
        ),
        (
            "max reserved after a step",
            opt(stock.timeline.iter().map(|p| p.reserved).max(), mib),
            opt(caching.timeline.iter().map(|p| p.reserved).max(), mib),
        ),
    ];
    for (name, s, c) in rows {
        println!("{name:<w$} {s:>16} {c:>16}");
    }
    println!("(n/a: CubeCL's default pool keeps no such counter)");
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
