//! Replaying a compiled trace through an allocator, and measuring it.
//!
//! A measurement runs on a [`ReplayDevice`]: the simulated device ([`measure`]) or any other,
//! CUDA included ([`measure_on`]). Every pass opens a fresh device, wraps it in [`Metered`]
//! and hands it to a fresh allocator; the meter, not the device, says what happened to
//! segments, so the numbers mean the same on every device. A measurement replays the trace
//! once instrumented, then `runs` times timed:
//!
//! - the instrumented pass reads the meter after every operation (reserved bytes over time,
//!   their peak), its segment counts at the end, and, at the operation where the trace's live
//!   requests peak, the allocator's own count of live bytes (so the reported peak allocated
//!   is the allocator's accounting, checked against the trace's);
//! - each timed pass starts from a fresh device and allocator and times every operation
//!   alone with `Instant`; the latencies of all passes are pooled for the median and the 99th
//!   percentile, and the clock's own cost (calibrated once, [`timer_overhead_ns`]) is taken
//!   off each sample. A CubeCL free only drops a handle; its cost shows in later reserves.
//!
//! After every pass the allocator is dropped, which returns every segment to the device (see
//! [`ReplayAllocator`]); a pass that leaves bytes on the device fails the measurement, so a
//! real device never carries one pass's memory into the next.

use std::sync::OnceLock;
use std::time::Instant;

use burn_caching_alloc::alloc::{AllocatorConfig, ConfigError};
use burn_caching_alloc::device::metered::{Meter, Metered};
use cubecl_runtime::memory_management::MemoryConfiguration;

use super::allocator::{
    AllocatorKind, CachingStackAllocator, CubeclAllocator, DEFAULT_DEVICE_CAPACITY,
    EngineAllocator, ReplayAllocator, ReplayError,
};
use super::devices::{ReplayDevice, SimReplayDevice};
use super::program::{Op, Program};

/// The most latency samples reserved before a measurement starts (128 MiB of `u64`).
const MAX_RESERVED_SAMPLES: usize = 1 << 24;

/// What a replay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayCounts {
    pub mallocs: u64,
    pub frees: u64,
    /// Mallocs that failed with out-of-memory (their frees are skipped).
    pub ooms: u64,
}

/// Observes a replay operation by operation.
pub trait Probe<A: ReplayAllocator> {
    fn before(&mut self) {}
    fn after(&mut self, _index: usize, _allocator: &A) {}
}

/// A probe that observes nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProbe;

impl<A: ReplayAllocator> Probe<A> for NoProbe {}

/// Replays `program` through `allocator`, calling `probe` around every operation.
///
/// If the replay stops on an error, the allocations still live are freed before it returns,
/// so that dropping the allocator can return every segment to the device.
pub fn replay_with<A: ReplayAllocator, P: Probe<A>>(
    allocator: &mut A,
    program: &Program,
    probe: &mut P,
) -> Result<ReplayCounts, ReplayError> {
    let mut handles: Vec<Option<A::Handle>> = Vec::with_capacity(program.slots());
    handles.resize_with(program.slots(), || None);
    let result = replay_ops(allocator, program, probe, &mut handles);
    if result.is_err() {
        for handle in handles.into_iter().flatten() {
            // Best effort: the replay's own error is the one to report.
            let _ = allocator.free(handle);
        }
    }
    result
}

fn replay_ops<A: ReplayAllocator, P: Probe<A>>(
    allocator: &mut A,
    program: &Program,
    probe: &mut P,
    handles: &mut [Option<A::Handle>],
) -> Result<ReplayCounts, ReplayError> {
    let mut counts = ReplayCounts::default();
    for (index, op) in program.ops().iter().enumerate() {
        probe.before();
        match *op {
            Op::Malloc {
                slot,
                size,
                stream,
                pool,
            } => match match pool {
                None => allocator.malloc(size, stream),
                Some(pool) => allocator.malloc_in(pool, size, stream),
            } {
                Ok(handle) => {
                    handles[slot as usize] = Some(handle);
                    counts.mallocs += 1;
                }
                Err(ReplayError::OutOfMemory(_)) => counts.ooms += 1,
                Err(err) => return Err(err),
            },
            Op::Free { slot } => {
                if let Some(handle) = handles[slot as usize].take() {
                    allocator.free(handle)?;
                    counts.frees += 1;
                }
            }
            Op::RecordStream { slot, stream } => {
                if let Some(handle) = &handles[slot as usize] {
                    allocator.record_stream(handle, stream)?;
                }
            }
            Op::EmptyCache => allocator.empty_cache()?,
            Op::PoolCreate { pool, options } => allocator.create_pool(pool, options)?,
            Op::PoolEmptyCache { pool } => allocator.pool_empty_cache(pool)?,
            Op::PoolRelease { pool } => allocator.release_pool(pool)?,
        }
        probe.after(index, allocator);
    }
    Ok(counts)
}

/// Replays `program` through `allocator` with no observation.
pub fn replay<A: ReplayAllocator>(
    allocator: &mut A,
    program: &Program,
) -> Result<ReplayCounts, ReplayError> {
    replay_with(allocator, program, &mut NoProbe)
}

/// How to measure.
#[derive(Clone, Debug)]
pub struct MeasureOptions {
    /// Capacity of the simulated device [`measure`] runs on ([`measure_on`] takes the
    /// device's own capacity instead).
    pub capacity: u64,
    /// Timed passes (0: only the instrumented pass; latencies are then zero).
    pub runs: usize,
    /// The engine's configuration for `caching` and `caching-stack`.
    pub engine_config: AllocatorConfig,
    /// The string `engine_config` was parsed from (`""`: the default rules), which the
    /// measurements of `caching` and `caching-stack` carry.
    pub config_text: String,
}

impl MeasureOptions {
    /// The default device and engine configuration, with `runs` timed passes.
    pub fn new(runs: usize) -> Self {
        Self {
            capacity: DEFAULT_DEVICE_CAPACITY,
            runs,
            engine_config: AllocatorConfig::default(),
            config_text: String::new(),
        }
    }

    /// The same options with the engine configured by `text` (PyTorch's syntax, as in
    /// `BURN_CACHING_ALLOC_CONF`); an error if the engine does not accept it.
    pub fn with_config(mut self, text: &str) -> Result<Self, ConfigError> {
        self.engine_config = AllocatorConfig::parse(text)?;
        self.config_text = text.trim().to_string();
        Ok(self)
    }
}

/// The numbers of one trace replayed through one allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub trace: String,
    pub allocator: AllocatorKind,
    /// The engine's configuration string for `caching` and `caching-stack` (`""`: the
    /// default rules); `None` for CubeCL's pools, which the engine's rules do not touch.
    pub config: Option<String>,
    pub ops: usize,
    pub ns_per_op_median: f64,
    pub ns_per_op_p99: f64,
    pub ns_per_op_mean: f64,
    /// Median over mallocs only: a free of a CubeCL handle only drops it, so with half the
    /// operations frees the median over all operations sits where frees end and mallocs
    /// begin, and says little about either.
    pub ns_per_malloc_median: f64,
    /// Segments the allocator asked of the device, and returned, during the instrumented
    /// pass (what dropping the allocator returns afterwards is not counted).
    pub device_allocs: u64,
    pub device_frees: u64,
    /// Bytes of live requests at the trace's peak, as the allocator counted them.
    pub peak_allocated: u64,
    /// Most bytes the device had handed out at once.
    pub peak_reserved: u64,
    pub ooms: u64,
    /// Device bytes in use after each operation of the instrumented pass.
    pub reserved_curve: Vec<u64>,
}

impl Measurement {
    /// Peak reserved over peak allocated (1.0 = no overhead).
    pub fn reserved_ratio(&self) -> f64 {
        if self.peak_allocated == 0 {
            return f64::NAN;
        }
        self.peak_reserved as f64 / self.peak_allocated as f64
    }
}

struct Instrument {
    meter: Meter,
    peak_op: usize,
    curve: Vec<u64>,
    peak_reserved: u64,
    live_at_peak: u64,
}

impl<A: ReplayAllocator> Probe<A> for Instrument {
    fn after(&mut self, index: usize, allocator: &A) {
        let reserved = self.meter.bytes_in_use();
        self.peak_reserved = self.peak_reserved.max(reserved);
        self.curve.push(reserved);
        if index == self.peak_op {
            self.live_at_peak = allocator.live_bytes();
        }
    }
}

struct Stopwatch {
    start: Option<Instant>,
    samples: Vec<u32>,
}

impl<A: ReplayAllocator> Probe<A> for Stopwatch {
    fn before(&mut self) {
        self.start = Some(Instant::now());
    }

    fn after(&mut self, _: usize, _: &A) {
        if let Some(start) = self.start.take() {
            let ns = start.elapsed().as_nanos();
            self.samples.push(u32::try_from(ns).unwrap_or(u32::MAX));
        }
    }
}

/// The median cost of one `Instant::now()` + `elapsed()` pair on this machine, in ns.
pub fn timer_overhead_ns() -> u32 {
    static OVERHEAD: OnceLock<u32> = OnceLock::new();
    *OVERHEAD.get_or_init(|| {
        let mut samples: Vec<u32> = (0..100_000)
            .map(|_| {
                let start = Instant::now();
                u32::try_from(start.elapsed().as_nanos()).unwrap_or(u32::MAX)
            })
            .collect();
        samples.sort_unstable();
        samples[samples.len() / 2]
    })
}

/// The nearest-rank `p`-th quantile (`p` in [0, 1]) of sorted samples.
pub fn quantile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64
}

/// Measures `program` (named `trace`) through a fresh allocator of `kind` on fresh simulated
/// devices of `options.capacity` bytes.
pub fn measure(
    trace: &str,
    program: &Program,
    kind: AllocatorKind,
    options: &MeasureOptions,
) -> Result<Measurement, ReplayError> {
    measure_on(
        &SimReplayDevice::new(options.capacity),
        trace,
        program,
        kind,
        options,
    )
}

/// Measures `program` (named `trace`) through a fresh allocator of `kind` on fresh devices
/// from `device` (whose capacity sizes CubeCL's pools; `options.capacity` is not used).
pub fn measure_on<R: ReplayDevice>(
    device: &R,
    trace: &str,
    program: &Program,
    kind: AllocatorKind,
    options: &MeasureOptions,
) -> Result<Measurement, ReplayError> {
    let config = &options.engine_config;
    let capacity = device.capacity();
    match kind {
        AllocatorKind::Caching => measure_with(device, trace, program, kind, options, |memory| {
            EngineAllocator::with_config(memory, config.clone())
        }),
        AllocatorKind::CubeclSubslices => {
            measure_with(device, trace, program, kind, options, |memory| {
                CubeclAllocator::new(memory, capacity, MemoryConfiguration::SubSlices)
            })
        }
        AllocatorKind::CubeclExclusive => {
            measure_with(device, trace, program, kind, options, |memory| {
                CubeclAllocator::new(memory, capacity, MemoryConfiguration::ExclusivePages)
            })
        }
        AllocatorKind::CachingStack => {
            measure_with(device, trace, program, kind, options, |memory| {
                CachingStackAllocator::with_capacity(memory, capacity, config.clone())
            })
        }
    }
}

/// One pass's device, metered, and the meter to read it by.
fn open_metered<R: ReplayDevice>(device: &R) -> Result<(Metered<R::Memory>, Meter), ReplayError> {
    let memory = device
        .open()
        .map_err(|err| ReplayError::Failed(format!("cannot open the device: {err}")))?;
    let metered = Metered::new(memory);
    let meter = metered.meter();
    Ok((metered, meter))
}

/// Fails if a dropped allocator left segments on the device.
fn check_returned(meter: &Meter, kind: AllocatorKind) -> Result<(), ReplayError> {
    let left = meter.bytes_in_use();
    if left == 0 {
        return Ok(());
    }
    Err(ReplayError::Failed(format!(
        "{kind} left {left} bytes in {} segment(s) on the device after being dropped",
        meter.allocs().saturating_sub(meter.frees())
    )))
}

/// Measures `program` through allocators made by `make`, each over a fresh device from
/// `device` wrapped in [`Metered`].
pub fn measure_with<R: ReplayDevice, A: ReplayAllocator>(
    device: &R,
    trace: &str,
    program: &Program,
    kind: AllocatorKind,
    options: &MeasureOptions,
    make: impl Fn(Metered<R::Memory>) -> A,
) -> Result<Measurement, ReplayError> {
    let (memory, meter) = open_metered(device)?;
    let mut allocator = make(memory);
    let mut instrument = Instrument {
        meter: meter.clone(),
        peak_op: program.peak_op(),
        curve: Vec::with_capacity(program.ops().len()),
        peak_reserved: 0,
        live_at_peak: 0,
    };
    let replayed = replay_with(&mut allocator, program, &mut instrument);
    let reading = meter.reading();
    drop(allocator);
    let counts = replayed?;
    check_returned(&meter, kind)?;

    let overhead = timer_overhead_ns();
    let mut stopwatch = Stopwatch {
        start: None,
        // Reserved up front for the usual run counts; a huge `runs` grows as it goes instead
        // of overflowing the product.
        samples: Vec::with_capacity(
            program
                .ops()
                .len()
                .saturating_mul(options.runs)
                .min(MAX_RESERVED_SAMPLES),
        ),
    };
    for _ in 0..options.runs {
        let (memory, meter) = open_metered(device)?;
        let mut allocator = make(memory);
        let replayed = replay_with(&mut allocator, program, &mut stopwatch);
        drop(allocator);
        replayed?;
        check_returned(&meter, kind)?;
    }
    let mut samples = stopwatch.samples;
    for sample in &mut samples {
        *sample = sample.saturating_sub(overhead);
    }
    // Every pass times every operation, in order: sample j is operation j mod ops.
    let ops = program.ops();
    let mut malloc_samples: Vec<u32> = samples
        .iter()
        .enumerate()
        .filter(|(j, _)| matches!(ops[j % ops.len()], Op::Malloc { .. }))
        .map(|(_, &ns)| ns)
        .collect();
    malloc_samples.sort_unstable();
    samples.sort_unstable();
    let mean = if samples.is_empty() {
        0.0
    } else {
        samples.iter().map(|&s| s as f64).sum::<f64>() / samples.len() as f64
    };

    let config = match kind {
        AllocatorKind::Caching | AllocatorKind::CachingStack => Some(options.config_text.clone()),
        AllocatorKind::CubeclSubslices | AllocatorKind::CubeclExclusive => None,
    };
    Ok(Measurement {
        trace: trace.to_string(),
        allocator: kind,
        config,
        ops: program.ops().len(),
        ns_per_op_median: quantile(&samples, 0.5),
        ns_per_op_p99: quantile(&samples, 0.99),
        ns_per_op_mean: mean,
        ns_per_malloc_median: quantile(&malloc_samples, 0.5),
        device_allocs: reading.allocs,
        device_frees: reading.frees,
        peak_allocated: instrument.live_at_peak,
        peak_reserved: instrument.peak_reserved,
        ooms: counts.ooms,
        reserved_curve: instrument.curve,
    })
}
