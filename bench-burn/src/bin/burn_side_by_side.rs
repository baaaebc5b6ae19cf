//! `burn-side-by-side`: trains real Burn models on the caching backend and on Burn's stock
//! backend of the same kind, interleaved, and prints reserved memory and step time side by side.
//!
//! ```sh
//! cargo run --release -p bench-burn -- --steps 6 --json side-by-side.json
//! ```
//!
//! With `BURN_CACHING_ALLOC_TRACE=FILE.json.gz` set and `--write-trace`, the caching device's
//! engine trace is written to that file at the end (record one workload per run: the trace
//! holds every workload the process ran).

use std::path::PathBuf;

use burn::backend::Autodiff;
use clap::{Parser, ValueEnum};

use bench_burn::{CompareOptions, MemoryReading, Report, Workload, WorkloadResult, markdown_table};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// wgpu's default adapter (lavapipe on a machine without a GPU).
    Wgpu,
    /// CUDA device 0.
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Fusion {
    /// Burn's kernel fusion on both sides (`CachingWgpu` vs `Wgpu`).
    Fused,
    /// No fusion on either side (`CachingWgpuUnfused` vs `CubeBackend<WgpuRuntime>`).
    Unfused,
    /// Both, fused first.
    Both,
}

#[derive(Debug, Parser)]
#[command(about = "Burn models on the caching backend and on Burn's stock backend, side by side")]
struct Args {
    /// Where the backends run.
    #[arg(long, value_enum, default_value = "wgpu")]
    device: DeviceKind,
    /// Workloads to run (comma-separated): transformer-varlen, conv, lstm, mnist-mlp,
    /// mnist-loader (a step is an epoch fed by four new loader threads), `varlen`
    /// (the variable-length family), or one transformer of any size,
    /// `varlen-d<width>-b<batch>-l<min>-<max>[-h<heads>][-f<ff>][-s<steps>]`. Run
    /// mnist-loader last: the stock side keeps memory in its gone workers' stream pools that
    /// the cleanup between workloads does not release, and every workload after it would read
    /// that memory as its own.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "transformer-varlen,conv,lstm,mnist-mlp,varlen,mnist-loader"
    )]
    models: Vec<String>,
    /// Fused, unfused or both.
    #[arg(long, value_enum, default_value = "both")]
    fusion: Fusion,
    /// Training steps per side and workload.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Leading steps left out of the step-time statistics (compilation, autotuning).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Seeds the backends and the batches.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Writes the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Writes the caching device's engine trace to `BURN_CACHING_ALLOC_TRACE` at the end.
    #[arg(long)]
    write_trace: bool,
    /// Prints each side's reserved memory and step time after every step (standard error).
    #[arg(long)]
    progress: bool,
    /// Reads memory only after the last step (a control run: every reading hands CubeCL's free
    /// slices back to the engine, which can move later tensors). The caching side's exact peak
    /// is still read then; stock's column is its final reserved memory.
    #[arg(long)]
    read_at_end: bool,
}

fn main() {
    let args = Args::parse();
    // SAFETY: no other thread runs yet (the backends start later); see `mnist::headless`.
    let _runtime_dir = unsafe { mnist::headless::ensure_xdg_runtime_dir() };
    if let Err(err) = run(&args) {
        eprintln!("burn-side-by-side: {err}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), String> {
    let workloads = args
        .models
        .iter()
        .map(|name| Workload::expand(name).ok_or_else(|| format!("no workload {name:?}")))
        .collect::<Result<Vec<_>, _>>()?
        .concat();
    let options = CompareOptions {
        steps: args.steps,
        warmup: args.warmup,
        seed: args.seed,
        progress: args.progress,
        read_each_step: !args.read_at_end,
        ..CompareOptions::default()
    };
    let fusions: &[&str] = match args.fusion {
        Fusion::Fused => &["fused"],
        Fusion::Unfused => &["unfused"],
        Fusion::Both => &["fused", "unfused"],
    };
    let mut results = Vec::new();
    for &workload in &workloads {
        for &fusion in fusions {
            let result = match args.device {
                DeviceKind::Wgpu => wgpu(workload, fusion, &options)?,
                DeviceKind::Cuda => cuda(workload, fusion, &options)?,
            };
            eprintln!(
                "{workload} {fusion}: reserved {:.2}x, time {:.2}x",
                result.reserved_ratio, result.time_ratio
            );
            results.push(result);
        }
    }
    println!("{}", markdown_table(&results));
    let report = Report {
        device: format!("{:?}", args.device).to_lowercase(),
        steps: args.steps,
        warmup: args.warmup,
        seed: args.seed,
        results,
    };
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if args.write_trace {
        let path = match args.device {
            DeviceKind::Wgpu => write_trace_wgpu()?,
            DeviceKind::Cuda => write_trace_cuda()?,
        };
        eprintln!("trace written to {}", path.display());
    }
    Ok(())
}

#[cfg(feature = "wgpu")]
fn wgpu(
    workload: Workload,
    fusion: &str,
    options: &CompareOptions,
) -> Result<WorkloadResult, String> {
    use burn::backend::Wgpu;
    use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
    use burn_caching_alloc::backend::{CachingWgpu, CachingWgpuUnfused};
    let device = WgpuDevice::DefaultDevice;
    let caching = bench_burn::CachingReading::new(device.clone());
    let stock = bench_burn::StockReading::<WgpuRuntime>::new(device.clone());
    let (c, s): (&dyn MemoryReading, &dyn MemoryReading) = (&caching, &stock);
    if fusion == "fused" {
        bench_burn::compare::<Autodiff<CachingWgpu>, Autodiff<Wgpu>>(
            workload,
            fusion,
            options,
            ("CachingWgpu", &device, c),
            ("Wgpu", &device, s),
        )
    } else {
        bench_burn::compare::<
            Autodiff<CachingWgpuUnfused>,
            Autodiff<CubeBackend<WgpuRuntime, f32, i32, u32>>,
        >(
            workload,
            fusion,
            options,
            ("CachingWgpuUnfused", &device, c),
            ("CubeBackend<WgpuRuntime>", &device, s),
        )
    }
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: Workload, _: &str, _: &CompareOptions) -> Result<WorkloadResult, String> {
    Err("built without the wgpu feature".into())
}

#[cfg(feature = "cuda")]
fn cuda(
    workload: Workload,
    fusion: &str,
    options: &CompareOptions,
) -> Result<WorkloadResult, String> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    use burn_caching_alloc::backend::{CachingCuda, CachingCudaUnfused};
    use cubecl_cuda::CudaRuntime;
    let device = CudaDevice::default();
    let caching = bench_burn::CachingReading::new(device.clone());
    let stock = bench_burn::StockReading::<CudaRuntime>::new(device.clone());
    let (c, s): (&dyn MemoryReading, &dyn MemoryReading) = (&caching, &stock);
    if fusion == "fused" {
        bench_burn::compare::<Autodiff<CachingCuda>, Autodiff<Cuda>>(
            workload,
            fusion,
            options,
            ("CachingCuda", &device, c),
            ("Cuda", &device, s),
        )
    } else {
        bench_burn::compare::<
            Autodiff<CachingCudaUnfused>,
            Autodiff<burn_cubecl::CubeBackend<CudaRuntime, f32, i32, u8>>,
        >(
            workload,
            fusion,
            options,
            ("CachingCudaUnfused", &device, c),
            ("CubeBackend<CudaRuntime>", &device, s),
        )
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: Workload, _: &str, _: &CompareOptions) -> Result<WorkloadResult, String> {
    Err("built without the cuda feature".into())
}

#[cfg(feature = "wgpu")]
fn write_trace_wgpu() -> Result<PathBuf, String> {
    burn_caching_alloc::backend::write_trace(&burn::backend::wgpu::WgpuDevice::DefaultDevice)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "wgpu"))]
fn write_trace_wgpu() -> Result<PathBuf, String> {
    Err("built without the wgpu feature".into())
}

#[cfg(feature = "cuda")]
fn write_trace_cuda() -> Result<PathBuf, String> {
    burn_caching_alloc::backend::write_trace(&burn::backend::cuda::CudaDevice::default())
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn write_trace_cuda() -> Result<PathBuf, String> {
    Err("built without the cuda feature".into())
}
