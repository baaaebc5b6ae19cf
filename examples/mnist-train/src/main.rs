//! MNIST with burn-train on the caching allocator: the dashboard shows the loss, the accuracy
//! and the allocator's memory (allocated, reserved, and their peaks) for training and
//! validation.
//!
//! ```text
//! cargo run --release -p mnist-train                          # caching-cuda, else caching-wgpu
//! cargo run --release -p mnist-train -- --backend caching-wgpu --limit 6000 --test-limit 1000
//! cargo run --release -p mnist-train -- --headless --memory-viz memory.html --memory-stacks
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use mnist::BackendChoice;
use mnist::backend_choice::{cuda_device_present, unavailable_reason};
use mnist::cli::TrainingArgs;
use mnist::dataset::{MnistSet, Split, default_data_dir};
use mnist_train::{Dashboard, MemoryFiles, Outcome, RunError, TrainingConfig};

const MIB: u64 = 1 << 20;

/// Train `examples/mnist`'s model with burn-train on the caching allocator, its memory on the
/// dashboard.
#[derive(Debug, Parser)]
#[command(name = "mnist-train", version)]
struct Args {
    /// auto | caching-cuda | caching-wgpu (auto: caching-cuda where a CUDA device is).
    #[arg(long, default_value = "auto")]
    backend: BackendChoice,
    #[command(flatten)]
    training: TrainingArgs,
    /// burn-train's artifact folder (its metric logs and experiment.log).
    #[arg(long, default_value_os_t = std::env::temp_dir().join("mnist-train"))]
    artifact_dir: PathBuf,
    /// burn-train's plain-text renderer, even on a terminal (no dashboard).
    #[arg(long)]
    headless: bool,
    /// Keep the dashboard open at the end until you quit it ('q').
    #[arg(long)]
    keep_dashboard: bool,
    /// The unfused backends (`CachingWgpuUnfused`/`CachingCudaUnfused`): every operation
    /// allocates when it is called, so stacks name the model's `forward`.
    #[arg(long)]
    unfused: bool,
    /// Write a snapshot here at the end (`.json`: the crate's JSON; else PyTorch's pickle);
    /// may be given more than once.
    #[arg(long, value_name = "PATH")]
    memory_snapshot: Vec<PathBuf>,
    /// Write the offline HTML viewer here at the end.
    #[arg(long, value_name = "PATH.html")]
    memory_viz: Option<PathBuf>,
    /// With --memory-snapshot/--memory-viz: record a stack with every allocation.
    #[arg(long)]
    memory_stacks: bool,
}

fn main() -> ExitCode {
    // SAFETY: first thing in `main`, before any thread starts (see `mnist::headless`).
    let _runtime_dir = unsafe { mnist::headless::ensure_xdg_runtime_dir() };
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let choice = args.backend.resolve(cuda_device_present());
    if !choice.is_caching() {
        return Err(format!(
            "backend {choice} has no caching allocator to show; mnist-train trains on \
             caching-cuda or caching-wgpu (examples/mnist compares the stock backends)"
        ));
    }
    if let Some(reason) = unavailable_reason(choice) {
        return Err(reason);
    }
    let data_dir = args
        .training
        .data_dir
        .clone()
        .unwrap_or_else(default_data_dir);
    let train =
        MnistSet::load(&data_dir, Split::Train, args.training.limit).map_err(|e| e.to_string())?;
    let valid = MnistSet::load(&data_dir, Split::Test, args.training.test_limit)
        .map_err(|e| e.to_string())?;
    let config = TrainingConfig {
        model: args.training.model,
        epochs: args.training.epochs,
        batch_size: args.training.batch_size,
        learning_rate: args.training.lr,
        seed: args.training.seed,
    };
    let files = MemoryFiles {
        snapshots: args.memory_snapshot.clone(),
        viewer: args.memory_viz.clone(),
        stacks: args.memory_stacks,
    };
    let dashboard = if args.headless {
        Dashboard::Text
    } else {
        Dashboard::Auto
    };
    std::fs::create_dir_all(&args.artifact_dir)
        .map_err(|e| format!("cannot create {}: {e}", args.artifact_dir.display()))?;
    println!(
        "MNIST {} on {}{}: {} training / {} validation images, {} epoch(s), batch {}; \
         burn-train's artifacts in {}",
        config.model,
        choice,
        if args.unfused { " (unfused)" } else { "" },
        train.len(),
        valid.len(),
        config.epochs,
        config.batch_size,
        args.artifact_dir.display()
    );
    let run = Run {
        train,
        valid,
        config,
        artifact_dir: args.artifact_dir.clone(),
        dashboard,
        files,
    };
    let mut outcome = match (choice, args.unfused) {
        (BackendChoice::CachingWgpu, false) => run.wgpu(false),
        (BackendChoice::CachingWgpu, true) => run.wgpu(true),
        (_, unfused) => run.cuda(unfused),
    }
    .map_err(|e| e.to_string())?;
    if args.keep_dashboard {
        outcome.renderer.manual_close();
    }
    let Outcome {
        files,
        stats,
        renderer,
    } = outcome;
    // The dashboard leaves the terminal's alternate screen here, so what follows stays.
    drop(renderer);
    println!(
        "memory at the end: allocated {:.1} MiB, reserved {:.1} MiB, peak reserved {:.1} MiB",
        stats.memory_allocated() as f64 / MIB as f64,
        stats.memory_reserved() as f64 / MIB as f64,
        stats.max_memory_reserved() as f64 / MIB as f64,
    );
    for path in files {
        println!("memory file written to {}", path.display());
    }
    Ok(())
}

/// One run's inputs, for the backend picked at run time.
struct Run {
    train: MnistSet,
    valid: MnistSet,
    config: TrainingConfig,
    artifact_dir: PathBuf,
    dashboard: Dashboard,
    files: MemoryFiles,
}

impl Run {
    /// `run::<B>` on the default device of `B`'s device type.
    fn on<B>(self, device: B::Device) -> Result<Outcome, RunError>
    where
        B: burn::tensor::backend::AutodiffBackend,
        B::Device: burn_caching_alloc::backend::CachingDevice,
    {
        mnist_train::run::<B>(
            device,
            self.train,
            self.valid,
            &self.config,
            &self.artifact_dir,
            self.dashboard,
            &self.files,
        )
    }

    #[cfg(feature = "wgpu")]
    fn wgpu(self, unfused: bool) -> Result<Outcome, RunError> {
        use burn::backend::Autodiff;
        use burn::backend::wgpu::WgpuDevice;
        use burn_caching_alloc::backend::{CachingWgpu, CachingWgpuUnfused};
        let device = WgpuDevice::DefaultDevice;
        if unfused {
            self.on::<Autodiff<CachingWgpuUnfused>>(device)
        } else {
            self.on::<Autodiff<CachingWgpu>>(device)
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(self, unfused: bool) -> Result<Outcome, RunError> {
        use burn::backend::Autodiff;
        use burn::backend::cuda::CudaDevice;
        use burn_caching_alloc::backend::{CachingCuda, CachingCudaUnfused};
        let device = CudaDevice::default();
        if unfused {
            self.on::<Autodiff<CachingCudaUnfused>>(device)
        } else {
            self.on::<Autodiff<CachingCuda>>(device)
        }
    }

    // A backend whose feature is off: `unavailable_reason` refused it before loading.
    #[cfg(not(feature = "wgpu"))]
    fn wgpu(self, _: bool) -> Result<Outcome, RunError> {
        Err(RunError::BadInput("this build has no wgpu backend".into()))
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(self, _: bool) -> Result<Outcome, RunError> {
        Err(RunError::BadInput("this build has no CUDA backend".into()))
    }
}
