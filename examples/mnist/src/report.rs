//! The JSON report of one training run.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::probe::{MemoryPoint, MemoryTotals};

/// One epoch's results.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EpochReport {
    /// 1-based epoch number.
    pub epoch: usize,
    /// Mean training cross-entropy over the epoch's batches.
    pub loss: f64,
    /// Accuracy on the test set after the epoch, 0.0 to 1.0.
    pub accuracy: f64,
    /// Wall-clock seconds for the epoch's training steps, until the device
    /// finished them (the test-set evaluation is not included).
    pub seconds: f64,
}

/// What happened in one training run:
/// `{backend, model, epochs: [{epoch, loss, accuracy, seconds}], memory: {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainReport {
    /// Backend name, e.g. `caching-wgpu` or `wgpu`.
    pub backend: String,
    /// Model name, `mlp` or `cnn`.
    pub model: String,
    /// Per-epoch results.
    pub epochs: Vec<EpochReport>,
    /// The allocator's counters at the end; `null` where the backend keeps none.
    pub memory: MemoryTotals,
    /// Allocated/reserved bytes after each training step (for the timeline);
    /// empty when the backend reports no current bytes. Not written to JSON.
    #[serde(skip)]
    pub timeline: Vec<MemoryPoint>,
}

impl TrainReport {
    /// Accuracy after the last epoch, if any epoch ran.
    pub fn final_accuracy(&self) -> Option<f64> {
        self.epochs.last().map(|e| e.accuracy)
    }

    /// Total seconds over all epochs.
    pub fn total_seconds(&self) -> f64 {
        self.epochs.iter().map(|e| e.seconds).sum()
    }

    /// The report as pretty-printed JSON.
    pub fn to_json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }

    /// Writes the JSON report to `path`.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let json = self.to_json().map_err(std::io::Error::other)?;
        std::fs::write(path, json + "\n")
    }
}
