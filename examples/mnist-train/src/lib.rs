//! MNIST trained the way Burn users train: burn-train's `SupervisedTraining`, on the caching
//! allocator's backends, with the allocator's memory on burn-train's dashboard.
//!
//! - [`data`]: `examples/mnist`'s data (its IDX reader and checksums) as a burn-train dataset
//!   and batcher;
//! - [`model`]: `examples/mnist`'s perceptron and CNN with burn-train's training and
//!   validation steps;
//! - [`run`]: the training, generic over the backend, and the memory files at the end.
//!
//! # The entry point: generic over the backend
//!
//! Burn 0.21's `Dispatch` backend chooses among a closed list of devices (Burn's own
//! backends), so a third-party backend cannot be one of them: [`run`] is generic over
//! `AutodiffBackend`, as Burn's own `run` is inside, and the caller names the caching
//! backend's type where `Dispatch` would go (`run::<Autodiff<CachingWgpu>>(..)`; the guide's
//! `docs/src/using.md` shows the call, compiled here as a doc test).
//!
//! `src/main.rs` is the command line: `cargo run --release -p mnist-train` from the
//! repository root.
#![warn(missing_docs)]

pub mod data;
pub mod model;
pub mod run;

pub use data::{MnistBatch, MnistBatcher, MnistIndices};
pub use model::Model;
pub use run::{
    Components, Dashboard, MemoryFiles, Outcome, RunError, TrainingConfig, run, run_with,
};

/// The guide's chapter on using the allocator (`docs/src/using.md`), its Rust blocks compiled
/// as doc tests here: one of them calls this crate's [`run`].
#[cfg(all(doctest, feature = "wgpu", feature = "cuda"))]
#[doc = include_str!("../../../docs/src/using.md")]
pub struct UsingGuideDoctests;
