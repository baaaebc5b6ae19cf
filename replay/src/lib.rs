//! Trace replay: the benchmark that compares burn-caching-alloc's engine with CubeCL 0.10's own
//! memory management, library side.
//!
//! - trace generators, deterministic from a seed: fixed-shape training loops of the MNIST MLP
//!   and CNN ([`training`]), a transformer-like loop whose sequence length changes every step
//!   ([`transformer`]), log-uniform random sizes with random lifetimes ([`random`]), and many
//!   live parameters with small activations churning around them ([`many_params`]);
//! - [`recorded`]: traces recorded from Burn training on `CachingWgpu` (`replay/traces/`);
//! - [`builtin`]: the built-in set (generated, then recorded);
//! - [`program`]: a trace checked and compiled for replay;
//! - [`device_storage`]: CubeCL's `ComputeStorage` over any device, so CubeCL's own
//!   `MemoryManagement` runs on the same device as the engine;
//! - [`allocator`]: the allocators compared (`caching`, `cubecl-subslices`,
//!   `cubecl-exclusive`, `caching-stack`), each generic over its device;
//! - [`devices`]: the devices a replay runs on, a fresh one per pass (the simulated device;
//!   CUDA with the `cuda` feature);
//! - [`runner`]: replays and measurements (latency, device calls, peaks), read from a
//!   [`Metered`](burn_caching_alloc::device::metered::Metered) device;
//! - [`report`]: Markdown and JSON output;
//! - [`tune`]: `replay --tune`, a grid of engine configurations replayed through
//!   `caching-stack`, ranked.
//!
//! The `replay` binary (`cargo run --release -p replay`, `--device sim|cuda`) and the criterion
//! bench (`cargo bench -p replay`, simulated device) are the front ends.

pub mod allocator;
pub mod builder;
pub mod builtin;
pub mod device_storage;
pub mod devices;
pub mod many_params;
pub mod program;
pub mod random;
pub mod recorded;
pub mod report;
pub mod rng;
pub mod runner;
pub mod training;
pub mod transformer;
pub mod tune;

pub use allocator::{AllocatorKind, DEFAULT_DEVICE_CAPACITY, ReplayAllocator, ReplayError};
pub use builtin::{
    BUILTIN_NAMES, BUILTIN_SEED, GENERATED_NAMES, NamedTrace, builtin_trace, builtin_traces,
};
pub use devices::{ReplayDevice, SimReplayDevice};
pub use program::{Op, Program, TraceError};
pub use runner::{MeasureOptions, Measurement, measure, measure_on, replay};
