//! The engine's events, the trace the replay reads: JSON in memory, and trace files on disk
//! (JSON, gzipped when the name ends in `.gz`; see `file.rs`).
//!
//! `Malloc` (with the private pool it was routed to), `FreeRequested`, `RecordStream`,
//! `EmptyCache` and the `Pool*` events are the inputs a caller gave; the other events are what
//! the engine did about them. Replaying the inputs through any
//! allocator reproduces the workload (the `replay` crate of this workspace does).

use std::path::Path;

use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use super::file::{self, MAX_TRACE_BYTES, MAX_TRACE_EVENTS, TraceFileError};

/// One entry of the engine's history, like an entry of PyTorch's `device_traces`.
///
/// Read through a flat record of its fields (see `RawEvent`) rather than serde's internally
/// tagged enum, which buffers every field of an event, unknown ones included, before it looks
/// at the tag: a small file could then make the reader allocate many times its size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
        /// The private pool the request was routed to (its [`MemPoolId::get`]), 0 for the
        /// allocator's own pools. Omitted from the JSON when 0.
        ///
        /// [`MemPoolId::get`]: crate::alloc::MemPoolId::get
        #[serde(default, skip_serializing_if = "is_zero")]
        pool: u64,
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
    /// The caller made private pool `pool` with these options (or it was live when
    /// recording started).
    PoolCreate {
        /// The pool's number ([`MemPoolId::get`](crate::alloc::MemPoolId::get)).
        pool: u64,
        /// [`MemPoolOptions::no_split`](crate::alloc::MemPoolOptions::no_split).
        no_split: bool,
        /// [`MemPoolOptions::use_on_oom`](crate::alloc::MemPoolOptions::use_on_oom).
        use_on_oom: bool,
    },
    /// The caller asked private pool `pool` to return its wholly free segments.
    PoolEmptyCache {
        /// The pool's number.
        pool: u64,
    },
    /// The caller let private pool `pool` go.
    PoolRelease {
        /// The pool's number.
        pool: u64,
    },
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
                | TraceEvent::PoolCreate { .. }
                | TraceEvent::PoolEmptyCache { .. }
                | TraceEvent::PoolRelease { .. }
        )
    }
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// The names of [`TraceEvent`]'s variants, as its `op` field spells them.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    Malloc,
    FreeRequested,
    FreeCompleted,
    RecordStream,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    EmptyCache,
    Oom,
    PoolCreate,
    PoolEmptyCache,
    PoolRelease,
}

/// Every field a [`TraceEvent`] can have, read in one pass with no buffering: an unknown
/// field is skipped as it is read, so an event costs this record whatever its JSON holds.
#[derive(Deserialize)]
struct RawEvent {
    op: Op,
    id: Option<u64>,
    size: Option<u64>,
    stream: Option<u64>,
    block_size: Option<u64>,
    address: Option<u64>,
    rounded: Option<u64>,
    device_free: Option<u64>,
    pool: Option<u64>,
    no_split: Option<bool>,
    use_on_oom: Option<bool>,
}

impl<'de> Deserialize<'de> for TraceEvent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = RawEvent::deserialize(deserializer)?;
        let need = |value: Option<u64>, name: &'static str| {
            value.ok_or_else(|| D::Error::missing_field(name))
        };
        Ok(match raw.op {
            Op::Malloc => TraceEvent::Malloc {
                id: need(raw.id, "id")?,
                size: need(raw.size, "size")?,
                stream: need(raw.stream, "stream")?,
                block_size: need(raw.block_size, "block_size")?,
                address: need(raw.address, "address")?,
                pool: raw.pool.unwrap_or(0),
            },
            Op::FreeRequested => TraceEvent::FreeRequested {
                id: need(raw.id, "id")?,
            },
            Op::FreeCompleted => TraceEvent::FreeCompleted {
                id: need(raw.id, "id")?,
            },
            Op::RecordStream => TraceEvent::RecordStream {
                id: need(raw.id, "id")?,
                stream: need(raw.stream, "stream")?,
            },
            Op::SegmentAlloc => TraceEvent::SegmentAlloc {
                address: need(raw.address, "address")?,
                size: need(raw.size, "size")?,
                stream: need(raw.stream, "stream")?,
            },
            Op::SegmentFree => TraceEvent::SegmentFree {
                address: need(raw.address, "address")?,
                size: need(raw.size, "size")?,
            },
            Op::SegmentMap => TraceEvent::SegmentMap {
                address: need(raw.address, "address")?,
                size: need(raw.size, "size")?,
                stream: need(raw.stream, "stream")?,
            },
            Op::SegmentUnmap => TraceEvent::SegmentUnmap {
                address: need(raw.address, "address")?,
                size: need(raw.size, "size")?,
                stream: need(raw.stream, "stream")?,
            },
            Op::EmptyCache => TraceEvent::EmptyCache,
            Op::Oom => TraceEvent::Oom {
                size: need(raw.size, "size")?,
                stream: need(raw.stream, "stream")?,
                rounded: raw.rounded.unwrap_or(0),
                device_free: raw.device_free.unwrap_or(0),
            },
            Op::PoolCreate => TraceEvent::PoolCreate {
                pool: need(raw.pool, "pool")?,
                no_split: raw.no_split.unwrap_or(false),
                use_on_oom: raw.use_on_oom.unwrap_or(false),
            },
            Op::PoolEmptyCache => TraceEvent::PoolEmptyCache {
                pool: need(raw.pool, "pool")?,
            },
            Op::PoolRelease => TraceEvent::PoolRelease {
                pool: need(raw.pool, "pool")?,
            },
        })
    }
}

/// Reads the events of a trace, at most [`MAX_TRACE_EVENTS`] of them.
fn capped_events<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<TraceEvent>, D::Error> {
    struct Events;
    impl<'de> Visitor<'de> for Events {
        type Value = Vec<TraceEvent>;

        fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
            write!(f, "a list of at most {MAX_TRACE_EVENTS} trace events")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut events = Vec::new();
            while let Some(event) = seq.next_element()? {
                if events.len() as u64 >= MAX_TRACE_EVENTS {
                    return Err(A::Error::custom(format_args!(
                        "more than {MAX_TRACE_EVENTS} trace events"
                    )));
                }
                events.push(event);
            }
            Ok(events)
        }
    }
    deserializer.deserialize_seq(Events)
}

/// The recorded events. `dropped` counts events the ring overwrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// The events, oldest first (at most [`MAX_TRACE_EVENTS`] when read).
    #[serde(deserialize_with = "capped_events")]
    pub events: Vec<TraceEvent>,
    /// How many older events the ring overwrote before these.
    #[serde(default)]
    pub dropped: u64,
}

impl Trace {
    /// The inputs: mallocs, frees, stream records, cache flushes and what the caller did with
    /// private pools, in order.
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

    /// Decodes a gzipped JSON trace held in memory (an embedded trace file): at most
    /// [`MAX_TRACE_BYTES`] of JSON, like [`Trace::read_file`].
    pub fn from_json_gz(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        file::from_gz_slice(bytes, MAX_TRACE_BYTES)
    }
}
