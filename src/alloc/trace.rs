//! The history of engine operations: a ring of events that serialises and replays.
//!
//! `Malloc`, `FreeRequested`, `RecordStream` and `EmptyCache` are the inputs a caller gave;
//! the other events are what the engine did about them. Replaying the inputs through any
//! allocator reproduces the workload.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use super::allocator::{Allocation, CachingAllocator};
use super::error::AllocError;
use crate::device::{DeviceMemory, StreamId};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TraceEvent {
    /// A request of `size` bytes served by a block of `block_size` bytes at `address`.
    Malloc {
        id: u64,
        size: u64,
        stream: u64,
        block_size: u64,
        address: u64,
    },
    /// The owner freed allocation `id`.
    FreeRequested {
        id: u64,
    },
    /// Allocation `id`'s block became reusable (at once, or once its events completed).
    FreeCompleted {
        id: u64,
    },
    /// Allocation `id` was used on `stream`.
    RecordStream {
        id: u64,
        stream: u64,
    },
    SegmentAlloc {
        address: u64,
        size: u64,
        stream: u64,
    },
    SegmentFree {
        address: u64,
        size: u64,
    },
    EmptyCache,
    /// A request of `size` bytes failed with out-of-memory.
    Oom {
        size: u64,
        stream: u64,
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
    pub events: Vec<TraceEvent>,
    #[serde(default)]
    pub dropped: u64,
}

/// What a replay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    pub mallocs: u64,
    pub frees: u64,
    pub ooms: u64,
}

impl Trace {
    /// The inputs: mallocs, frees, stream records and cache flushes, in order.
    pub fn operations(&self) -> impl Iterator<Item = &TraceEvent> {
        self.events.iter().filter(|e| e.is_input())
    }

    /// Replays the inputs through `allocator`. A malloc that fails with out-of-memory is
    /// counted and its later free skipped; any other error stops the replay. Allocations still
    /// live at the end of the trace are freed.
    pub fn replay<D: DeviceMemory>(
        &self,
        allocator: &CachingAllocator<D>,
    ) -> Result<ReplayStats, AllocError> {
        let mut live: HashMap<u64, Allocation<D::Handle>> = HashMap::new();
        let mut stats = ReplayStats::default();
        for event in self.operations() {
            match *event {
                TraceEvent::Malloc {
                    id, size, stream, ..
                } => match allocator.malloc(size, StreamId(stream)) {
                    Ok(allocation) => {
                        stats.mallocs += 1;
                        live.insert(id, allocation);
                    }
                    Err(e) if e.is_out_of_memory() => stats.ooms += 1,
                    Err(e) => return Err(e),
                },
                TraceEvent::FreeRequested { id } => {
                    if let Some(allocation) = live.remove(&id) {
                        allocator.free(allocation)?;
                        stats.frees += 1;
                    }
                }
                TraceEvent::RecordStream { id, stream } => {
                    if let Some(allocation) = live.get(&id) {
                        allocator.record_stream(allocation, StreamId(stream))?;
                    }
                }
                TraceEvent::EmptyCache => {
                    allocator.empty_cache()?;
                }
                _ => {}
            }
        }
        for (_, allocation) in live {
            allocator.free(allocation)?;
            stats.frees += 1;
        }
        Ok(stats)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a trace always serialises")
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    pub fn write_json(&self, writer: impl Write) -> Result<(), serde_json::Error> {
        serde_json::to_writer(writer, self)
    }

    pub fn read_json(reader: impl Read) -> Result<Self, serde_json::Error> {
        serde_json::from_reader(reader)
    }
}

/// The engine's bounded history.
#[derive(Debug)]
pub(crate) struct TraceRing {
    events: VecDeque<TraceEvent>,
    capacity: usize,
    dropped: u64,
}

impl TraceRing {
    pub fn new(capacity: usize) -> Self {
        Self {
            events: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
        }
    }

    pub fn push(&mut self, event: TraceEvent) {
        if self.events.len() == self.capacity {
            self.events.pop_front();
            self.dropped += 1;
        }
        self.events.push_back(event);
    }

    pub fn to_trace(&self) -> Trace {
        Trace {
            events: self.events.iter().cloned().collect(),
            dropped: self.dropped,
        }
    }
}
