//! What every process prints: one JSON line per peer and one per device's memory, each after
//! [`PREFIX`], so that a script (or the loopback test) finds them among other output.

use burn_caching_alloc::backend::{self, CachingDevice};
use serde::{Deserialize, Serialize};

/// The start of every report line.
pub const PREFIX: &str = "REPORT ";

/// One peer's results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerReport {
    /// The process's rank (0 for the one-process run).
    pub rank: usize,
    /// The peer's id over all processes (rank * devices per process + local index).
    pub peer: usize,
    /// The device, as Burn prints it.
    pub device: String,
    /// The all-reduce check's result: the sum over peers of [`check_values`]; empty where no
    /// collective ran.
    pub all_reduce: Vec<f32>,
    /// The loss of this peer's shard at each step (of the whole batch for one process).
    pub losses: Vec<f32>,
    /// The parameters after the last step, in `ParamId` order.
    pub params: Vec<Vec<f32>>,
}

/// One device's memory, read with `burn_caching_alloc::backend::memory_stats` at the end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// The process's rank.
    pub rank: usize,
    /// The device, as Burn prints it.
    pub device: String,
    /// Peak bytes in live blocks.
    pub peak_allocated: u64,
    /// Peak bytes reserved from the device.
    pub peak_reserved: u64,
    /// Bytes reserved at the end.
    pub reserved: u64,
}

/// A line the process prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Report {
    /// A peer's results.
    Peer(PeerReport),
    /// A device's memory.
    Memory(MemoryReport),
}

/// The all-reduce check's input of peer `peer`: 24 small integers, so that their sum over any
/// number of peers is exact.
pub fn check_values(peer: usize) -> Vec<f32> {
    (0..24)
        .map(|i| ((i * (peer + 1)) % 7) as f32 - 3.0)
        .collect()
}

impl Report {
    /// The memory report of `device` now.
    pub fn memory<D: CachingDevice>(rank: usize, device: &D) -> Self {
        let stats = backend::memory_stats(device);
        Report::Memory(MemoryReport {
            rank,
            device: format!("{device:?}"),
            peak_allocated: stats.max_memory_allocated(),
            peak_reserved: stats.max_memory_reserved(),
            reserved: stats.memory_reserved(),
        })
    }

    /// Prints the report as one line.
    pub fn print(&self) {
        let json = serde_json::to_string(self).expect("reports serialise");
        println!("{PREFIX}{json}");
    }

    /// The report on `line`, if it is one.
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line.strip_prefix(PREFIX)?).ok()
    }
}
