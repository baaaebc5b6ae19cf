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
//! Burn's own `examples/mnist` calls `training::run::<Dispatch>(DispatchDevice::autodiff(..))`.
//! Burn 0.21's `Dispatch` backend chooses among a closed list of devices (Burn's own
//! backends), so a third-party backend cannot be one of them. Write the training generic over
//! `AutodiffBackend`, as Burn's `run` is inside, and name the caching backend's type where
//! `Dispatch` would go:
//!
//! ```ignore
//! use burn::backend::Autodiff;
//! use burn::backend::wgpu::WgpuDevice;
//! use burn_caching_alloc::backend::CachingWgpu;
//! use mnist_train::{Dashboard, MemoryFiles, TrainingConfig, run};
//!
//! let outcome = run::<Autodiff<CachingWgpu>>(
//!     WgpuDevice::DefaultDevice,
//!     train,
//!     valid,
//!     &TrainingConfig::default(),
//!     "/tmp/mnist-train".as_ref(),
//!     Dashboard::Auto,
//!     &MemoryFiles::default(),
//! )?;
//! ```
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
