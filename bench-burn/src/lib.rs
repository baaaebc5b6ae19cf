//! Side by side: real Burn 0.21 `nn` models trained on the caching backend and on Burn's stock
//! backend of the same kind, in one process, with the same seed and the same batches,
//! interleaved step by step so that machine drift cancels in the ratios.
//!
//! - [`workload`]: the models to train ([`Workload`]) and their batches, made on the CPU once;
//! - [`nets`]: the networks (`TransformerEncoder`, a conv net, an LSTM, the MNIST MLP);
//! - [`trainer`]: one Adam step on any autodiff backend;
//! - [`loader`]: an epoch per step, its batches loaded by new threads every epoch;
//! - [`reading`]: how each side's reserved memory is read after every step;
//! - [`compare`]: the interleaved run of one workload on two backends;
//! - [`report`]: the Markdown table and the JSON.
//!
//! `src/bin/burn_side_by_side.rs` is the command line:
//! `cargo run --release -p bench-burn -- --help`.
#![warn(missing_docs)]

pub mod compare;
pub mod loader;
pub mod nets;
pub mod reading;
pub mod report;
pub mod trainer;
pub mod workload;

pub use compare::{CompareOptions, SideResult, WorkloadResult, compare};
pub use reading::{CachingReading, MemoryReading, StockReading};
pub use report::{Report, markdown_table};
pub use workload::{Batch, Workload};
