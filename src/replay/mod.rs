//! Trace replay: the benchmark suite's library side.
//!
//! - trace generators, deterministic from a seed: fixed-shape training loops of the MNIST MLP
//!   and CNN ([`training`]), a transformer-like loop whose sequence length changes every step
//!   ([`transformer`]), log-uniform random sizes with random lifetimes ([`random`]), and many
//!   live parameters with small activations churning around them ([`many_params`]); the
//!   built-in set of them ([`builtin`]);
//! - [`program`]: a trace checked and compiled for replay;
//! - [`sim_storage`]: CubeCL's `ComputeStorage` over the simulated device, so CubeCL's own
//!   `MemoryManagement` runs on the same device as the engine;
//! - [`allocator`]: the allocators compared (`caching`, `cubecl-subslices`,
//!   `cubecl-exclusive`, `caching-stack`);
//! - [`runner`]: replays and measurements (latency, device calls, peaks);
//! - [`report`]: Markdown and JSON output.
//!
//! `examples/replay.rs` and `benches/replay.rs` are the front ends.

pub mod allocator;
pub mod builder;
pub mod builtin;
pub mod many_params;
pub mod program;
pub mod random;
pub mod report;
pub mod rng;
pub mod runner;
pub mod sim_storage;
pub mod training;
pub mod transformer;

pub use allocator::{AllocatorKind, DEFAULT_DEVICE_CAPACITY, ReplayAllocator, ReplayError};
pub use builtin::{BUILTIN_NAMES, BUILTIN_SEED, NamedTrace, builtin_trace, builtin_traces};
pub use program::{Op, Program, TraceError};
pub use runner::{MeasureOptions, Measurement, measure, replay};
