//! MNIST on Burn: the showcase of `burn-caching-alloc`. Trains a small classifier on any Burn
//! autodiff backend and reports what the allocator did.
//!
//! - [`idx`]: the IDX file reader (plain or gzip);
//! - [`dataset`]: the training and test sets in memory, checked against `SHA256SUMS`;
//! - [`model`]: the perceptron and the CNN;
//! - [`train`]: the loop, generic over the backend;
//! - [`probe`]: how the loop reads memory statistics each step;
//! - [`report`]: the JSON report; [`timeline`]: the SVG chart;
//! - [`progress`]: the per-epoch progress bar;
//! - [`backend_choice`]: which backend to run and whether it can run here;
//! - [`run`]: trains on a backend picked at run time (names the concrete types);
//! - [`headless`]: keeps the Wayland client library quiet on a machine without a display.
//!
//! `src/main.rs` is the command-line front end: `cargo run --release -p mnist` from the
//! repository root. The four MNIST files ship in this crate's `data/` folder
//! ([`dataset::default_data_dir`]).
#![warn(missing_docs)]

pub mod backend_choice;
pub mod cli;
pub mod dataset;
pub mod headless;
pub mod idx;
pub mod model;
pub mod probe;
pub mod progress;
pub mod report;
pub mod run;
pub mod timeline;
pub mod train;

pub use backend_choice::{BackendChoice, Fusion};
pub use dataset::{MnistSet, Split};
pub use model::ModelKind;
pub use probe::{AllocatorCounters, AllocatorProbe, MemoryPoint, MemoryProbe, MemoryTotals};
pub use report::{EpochReport, TrainReport};
pub use run::{MemoryDumps, RunError, RunOutcome, train_on, train_on_with};
pub use train::{TrainConfig, TrainError, TrainObserver, train};
