//! Trains on a backend picked at run time: the one place that names concrete
//! backend types and their memory probes.

use super::backend_choice::{BackendChoice, Fusion, cuda_device_present, unavailable_reason};
use super::dataset::MnistSet;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::probe::{AllocatorCounters, MemoryProbe};
use super::report::TrainReport;
use super::train::{TrainConfig, TrainError, TrainObserver};

/// A finished run: the report and the allocator's summary, if it has one.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The training report.
    pub report: TrainReport,
    /// The allocator's `memory_summary` (caching backends only).
    pub summary: Option<String>,
    /// Where the engine's trace was written (caching backends, when
    /// `BURN_CACHING_ALLOC_TRACE` is set).
    pub trace: Option<std::path::PathBuf>,
    /// The memory files written (caching backends, when [`MemoryDumps`] asked for them).
    pub dumps: Vec<std::path::PathBuf>,
}

/// Memory files to write at the end of a run on a caching backend; asking for either records
/// the allocator's history (PyTorch's `_record_memory_history`) from the start.
#[derive(Debug, Clone, Default)]
pub struct MemoryDumps {
    /// A PyTorch-format snapshot (`.pickle`) for `_memory_viz.py` or pytorch.org/memory_viz.
    pub snapshot: Option<std::path::PathBuf>,
    /// The offline HTML viewer.
    pub viz: Option<std::path::PathBuf>,
    /// Record a stack with every allocation (larger files; docs/src/seeing-memory.md says what
    /// they hold).
    pub stacks: bool,
}

impl MemoryDumps {
    fn any(&self) -> bool {
        self.snapshot.is_some() || self.viz.is_some()
    }
}

/// Why a run did not happen or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The backend cannot run here; the message says what to pick instead.
    #[error("{0}")]
    Unavailable(String),
    /// Training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// Training finished but the trace asked for could not be written.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    #[error(transparent)]
    Trace(#[from] burn_caching_alloc::backend::TraceError),
    /// Training finished but a memory snapshot or viewer could not be written.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    #[error(transparent)]
    Dump(#[from] burn_caching_alloc::alloc::inspect::InspectError),
}

/// Trains on `choice` (after resolving `auto`), fused when this build has the `fusion` feature
/// (see [`Fusion::default_for_build`]), and returns the report.
pub fn train_on(
    choice: BackendChoice,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
) -> Result<RunOutcome, RunError> {
    train_on_with(
        choice,
        Fusion::default_for_build(),
        train,
        test,
        config,
        observer,
        &MemoryDumps::default(),
    )
}

/// [`train_on`] with the fusion setting `fusion`, writing the memory files `dumps` asks for
/// (caching backends only; the stock backends have no allocator history and ignore it).
pub fn train_on_with(
    choice: BackendChoice,
    fusion: Fusion,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
    dumps: &MemoryDumps,
) -> Result<RunOutcome, RunError> {
    let choice = choice.resolve(cuda_device_present());
    if let Some(reason) = unavailable_reason(choice).or_else(|| fusion.unavailable_reason()) {
        return Err(RunError::Unavailable(reason));
    }
    let name = &fusion.run_name(choice);
    let fused = fusion == Fusion::Fused;
    match choice {
        BackendChoice::Wgpu => stock_wgpu(name, fused, train, test, config, observer),
        BackendChoice::Cuda => stock_cuda(name, fused, train, test, config, observer),
        BackendChoice::CachingWgpu => {
            caching_wgpu(name, fused, train, test, config, observer, dumps)
        }
        BackendChoice::CachingCuda => {
            caching_cuda(name, fused, train, test, config, observer, dumps)
        }
        BackendChoice::Auto => Err(RunError::Unavailable(
            "backend auto did not resolve to a concrete backend".into(),
        )),
    }
}

// Burn's stock backends: `Wgpu`/`Cuda` are fused exactly when Burn's `fusion` feature is on
// (this crate's `fusion` turns it on); the unfused ones are the plain `CubeBackend`s.

#[cfg(feature = "wgpu")]
fn stock_wgpu(
    name: &str,
    fused: bool,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
) -> Result<RunOutcome, RunError> {
    use burn::backend::Autodiff;
    use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
    let device = WgpuDevice::DefaultDevice;
    let mut probe = super::probe::CubeclUsageProbe::<WgpuRuntime>::new(device.clone());
    let report = if fused {
        super::train::train::<Autodiff<burn::backend::Wgpu>>(
            &device, name, train, test, config, &mut probe, observer,
        )?
    } else {
        super::train::train::<Autodiff<CubeBackend<WgpuRuntime, f32, i32, u32>>>(
            &device, name, train, test, config, &mut probe, observer,
        )?
    };
    Ok(RunOutcome {
        report,
        summary: None,
        trace: None,
        dumps: Vec::new(),
    })
}

#[cfg(feature = "cuda")]
fn stock_cuda(
    name: &str,
    fused: bool,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
) -> Result<RunOutcome, RunError> {
    use burn::backend::Autodiff;
    use burn::backend::cuda::CudaDevice;
    use cubecl_cuda::CudaRuntime;
    let device = CudaDevice::default();
    let mut probe = super::probe::CubeclUsageProbe::<CudaRuntime>::new(device.clone());
    let report = if fused {
        super::train::train::<Autodiff<burn::backend::Cuda>>(
            &device, name, train, test, config, &mut probe, observer,
        )?
    } else {
        super::train::train::<Autodiff<burn_cubecl::CubeBackend<CudaRuntime, f32, i32, u8>>>(
            &device, name, train, test, config, &mut probe, observer,
        )?
    };
    Ok(RunOutcome {
        report,
        summary: None,
        trace: None,
        dumps: Vec::new(),
    })
}

// The caching backends: `burn_caching_alloc::backend`'s aliases, read through
// `memory_stats` / `memory_summary` (the engine's counters).

#[cfg(feature = "wgpu")]
fn caching_wgpu(
    name: &str,
    fused: bool,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
    dumps: &MemoryDumps,
) -> Result<RunOutcome, RunError> {
    use burn::backend::Autodiff;
    use burn::backend::wgpu::WgpuDevice;

    use burn_caching_alloc::backend::{CachingWgpu, CachingWgpuUnfused};
    let device = WgpuDevice::DefaultDevice;
    if fused {
        caching_run::<Autodiff<CachingWgpu>>(device, name, train, test, config, observer, dumps)
    } else {
        caching_run::<Autodiff<CachingWgpuUnfused>>(
            device, name, train, test, config, observer, dumps,
        )
    }
}

#[cfg(feature = "cuda")]
fn caching_cuda(
    name: &str,
    fused: bool,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
    dumps: &MemoryDumps,
) -> Result<RunOutcome, RunError> {
    use burn::backend::Autodiff;
    use burn::backend::cuda::CudaDevice;

    use burn_caching_alloc::backend::{CachingCuda, CachingCudaUnfused};
    let device = CudaDevice::default();
    if fused {
        caching_run::<Autodiff<CachingCuda>>(device, name, train, test, config, observer, dumps)
    } else {
        caching_run::<Autodiff<CachingCudaUnfused>>(
            device, name, train, test, config, observer, dumps,
        )
    }
}

/// Trains on a caching backend, reading the allocator after every step.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn caching_run<B>(
    device: B::Device,
    name: &str,
    train: &MnistSet,
    test: &MnistSet,
    config: &TrainConfig,
    observer: &mut dyn TrainObserver,
    dumps: &MemoryDumps,
) -> Result<RunOutcome, RunError>
where
    B: burn::tensor::backend::AutodiffBackend,
    B::Device: burn_caching_alloc::backend::CachingDevice,
{
    use burn_caching_alloc::alloc::{HistoryOptions, StackContext};
    use burn_caching_alloc::backend::{
        TraceError, dump_html, dump_snapshot, memory_stats, memory_summary, record_memory_history,
        write_trace,
    };

    if dumps.any() {
        let context = if dumps.stacks {
            StackContext::Alloc
        } else {
            StackContext::Off
        };
        record_memory_history(&device, HistoryOptions::default().with_context(context));
    }

    let stats_device = device.clone();
    let summary_device = device.clone();
    let mut probe = super::probe::AllocatorProbe::new(
        move || AllocatorCounters::from(&memory_stats(&stats_device).engine),
        move || memory_summary(&summary_device),
    );
    let report =
        super::train::train::<B>(&device, name, train, test, config, &mut probe, observer)?;
    let summary = probe.summary();
    // `write_trace` reads BURN_CACHING_ALLOC_TRACE itself; unset means no trace was asked for.
    let trace = match write_trace(&device) {
        Ok(path) => Some(path),
        Err(TraceError::NoPath) => None,
        Err(err) => return Err(err.into()),
    };
    let mut written = Vec::new();
    if let Some(path) = &dumps.snapshot {
        dump_snapshot(&device, path)?;
        written.push(path.clone());
    }
    if let Some(path) = &dumps.viz {
        dump_html(&device, path)?;
        written.push(path.clone());
    }
    Ok(RunOutcome {
        report,
        summary,
        trace,
        dumps: written,
    })
}

// Backends whose feature is off: `unavailable_reason` already refused them,
// so these only keep the match total.

#[cfg(not(feature = "wgpu"))]
fn stock_wgpu(
    _: &str,
    _: bool,
    _: &MnistSet,
    _: &MnistSet,
    _: &TrainConfig,
    _: &mut dyn TrainObserver,
) -> Result<RunOutcome, RunError> {
    Err(RunError::Unavailable(not_compiled(BackendChoice::Wgpu)))
}

#[cfg(not(feature = "wgpu"))]
fn caching_wgpu(
    _: &str,
    _: bool,
    _: &MnistSet,
    _: &MnistSet,
    _: &TrainConfig,
    _: &mut dyn TrainObserver,
    _: &MemoryDumps,
) -> Result<RunOutcome, RunError> {
    Err(RunError::Unavailable(not_compiled(
        BackendChoice::CachingWgpu,
    )))
}

#[cfg(not(feature = "cuda"))]
fn stock_cuda(
    _: &str,
    _: bool,
    _: &MnistSet,
    _: &MnistSet,
    _: &TrainConfig,
    _: &mut dyn TrainObserver,
) -> Result<RunOutcome, RunError> {
    Err(RunError::Unavailable(not_compiled(BackendChoice::Cuda)))
}

#[cfg(not(feature = "cuda"))]
fn caching_cuda(
    _: &str,
    _: bool,
    _: &MnistSet,
    _: &MnistSet,
    _: &TrainConfig,
    _: &mut dyn TrainObserver,
    _: &MemoryDumps,
) -> Result<RunOutcome, RunError> {
    Err(RunError::Unavailable(not_compiled(
        BackendChoice::CachingCuda,
    )))
}

#[cfg(not(all(feature = "wgpu", feature = "cuda")))]
fn not_compiled(choice: BackendChoice) -> String {
    unavailable_reason(choice)
        .unwrap_or_else(|| format!("backend {choice} is not compiled into this build"))
}
