//! The history of engine operations: a ring of events that serialises.
//!
//! `Malloc`, `FreeRequested`, `RecordStream` and `EmptyCache` are the inputs a caller gave;
//! the other events are what the engine did about them. Replaying the inputs through any
//! allocator reproduces the workload (the `replay` crate of this workspace does).

use std::collections::VecDeque;
use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

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

/// A recorded history. `dropped` counts events the ring overwrote.
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

    /// Writes the trace as JSON to `writer`.
    pub fn write_json(&self, writer: impl Write) -> Result<(), serde_json::Error> {
        serde_json::to_writer(writer, self)
    }

    /// Reads a JSON trace from `reader`.
    pub fn read_json(reader: impl Read) -> Result<Self, serde_json::Error> {
        serde_json::from_reader(reader)
    }
}

/// A bounded history: the newest `capacity` entries, oldest first.
#[derive(Debug)]
pub(crate) struct TraceRing<T> {
    entries: VecDeque<T>,
    capacity: usize,
    dropped: u64,
}

impl<T> TraceRing<T> {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
        }
    }

    pub fn push(&mut self, entry: T) {
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.entries.push_back(entry);
    }

    /// The entries, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.entries.iter()
    }

    /// How many older entries the ring overwrote.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}
