//! The engine's events, the trace the replay reads: JSON in memory, and trace files on disk
//! (JSON, gzipped when the name ends in `.gz`; see `file.rs`).
//!
//! `Malloc`, `FreeRequested`, `RecordStream` and `EmptyCache` are the inputs a caller gave;
//! the other events are what the engine did about them. Replaying the inputs through any
//! allocator reproduces the workload (the `replay` crate of this workspace does).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::file::{self, MAX_TRACE_BYTES, TraceFileError};

/// One entry of the engine's history, like an entry of PyTorch's `device_traces`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[non_exhaustive]
pub enum TraceEvent {
    /// A request of `size` bytes served by a block of `block_size` bytes at `address`.
    Malloc {
        /// The allocation's id.
        id: u64,
        /// The requested size, in bytes.
        size: u64,
        /// The stream the request was made on.
        stream: u64,
        /// The size of the block that serves it, in bytes (after rounding).
        block_size: u64,
        /// The block's address.
        address: u64,
    },
    /// The owner freed allocation `id`.
    FreeRequested {
        /// The allocation's id.
        id: u64,
    },
    /// Allocation `id`'s block became reusable (at once, or once its events completed).
    FreeCompleted {
        /// The allocation's id.
        id: u64,
    },
    /// Allocation `id` was used on `stream`.
    RecordStream {
        /// The allocation's id.
        id: u64,
        /// The stream that used it.
        stream: u64,
    },
    /// The engine got a new segment from the device.
    SegmentAlloc {
        /// The segment's address.
        address: u64,
        /// The segment's size, in bytes.
        size: u64,
        /// The stream the segment was allocated for.
        stream: u64,
    },
    /// The engine returned a segment to the device.
    SegmentFree {
        /// The segment's address.
        address: u64,
        /// The segment's size, in bytes.
        size: u64,
    },
    /// Pages were mapped at `address` of an expandable segment (PyTorch's `segment_map`).
    SegmentMap {
        /// Where the mapped pages start.
        address: u64,
        /// The mapped bytes.
        size: u64,
        /// The segment's stream.
        stream: u64,
    },
    /// Pages at `address` of an expandable segment went back to the device
    /// (PyTorch's `segment_unmap`).
    SegmentUnmap {
        /// Where the unmapped pages start.
        address: u64,
        /// The unmapped bytes.
        size: u64,
        /// The segment's stream.
        stream: u64,
    },
    /// The caller asked to empty the cache.
    EmptyCache,
    /// A request of `size` bytes failed with out-of-memory.
    Oom {
        /// The requested size, in bytes.
        size: u64,
        /// The stream the request was made on.
        stream: u64,
        /// The block size the request rounds to, in bytes.
        #[serde(default)]
        rounded: u64,
        /// The device's free bytes when the request failed.
        #[serde(default)]
        device_free: u64,
    },
}

impl TraceEvent {
    /// Whether the event is an input (something a caller did) rather than an outcome.
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            TraceEvent::Malloc { .. }
                | TraceEvent::FreeRequested { .. }
                | TraceEvent::RecordStream { .. }
                | TraceEvent::EmptyCache
        )
    }
}

/// The recorded events. `dropped` counts events the ring overwrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// The events, oldest first.
    pub events: Vec<TraceEvent>,
    /// How many older events the ring overwrote before these.
    #[serde(default)]
    pub dropped: u64,
}

impl Trace {
    /// The inputs: mallocs, frees, stream records and cache flushes, in order.
    pub fn operations(&self) -> impl Iterator<Item = &TraceEvent> {
        self.events.iter().filter(|e| e.is_input())
    }

    /// The trace as a JSON string.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a trace always serialises")
    }

    /// Parses a trace from a JSON string.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Reads the trace in `path`: JSON, or gzipped JSON when the name ends in `.gz`; at most
    /// [`MAX_TRACE_BYTES`] of JSON.
    pub fn read_file(path: &Path) -> Result<Self, TraceFileError> {
        file::read(path, MAX_TRACE_BYTES)
    }

    /// Writes the trace to `path`: JSON, gzipped when the name ends in `.gz`. The file
    /// appears under its name only once complete (written beside it, then renamed).
    pub fn write_file(&self, path: &Path) -> Result<(), TraceFileError> {
        file::write(self, path)
    }

    /// Decodes a gzipped JSON trace held in memory (an embedded trace file).
    pub fn from_json_gz(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_reader(flate2::read::GzDecoder::new(bytes))
    }
}
