//! Recording the engine's history the way PyTorch's `_record_memory_history` does.
//!
//! [`HistoryOptions`] mirrors its arguments: what is recorded (`enabled`: nothing, only the
//! state of live blocks, or the state and a ring of trace entries), which entries carry a
//! call stack (`context`), and how many entries the ring keeps (`max_entries`). Every
//! [`TraceEvent`] the engine records becomes, besides the event itself (the JSON trace the
//! replay reads), at most one [`HistoryEntry`] in PyTorch's terms: a timestamp, an action, an
//! address, a size and a stream. Frees name the block's address and requested size even when
//! the ring dropped the allocation, because the recorder remembers every live block.
//!
//! The ring keeps a suffix of one complete history, so the entries it keeps are always
//! explained by the snapshot taken with them (MEMORY_VIZ.md, "Consistency"); when recording
//! starts with blocks already live, the engine seeds the recorder with them.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::stack::Stack;
use super::trace::{Trace, TraceEvent, TraceRing};

/// What the history records (PyTorch's `enabled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordMode {
    /// Nothing (PyTorch's `None`).
    Off,
    /// Only the live blocks' stacks, for snapshots; no trace entries (`"state"`).
    State,
    /// The live blocks' stacks and a ring of trace entries (`"all"`).
    All,
}

/// Which records carry a call stack (PyTorch's `context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum StackContext {
    /// No stacks.
    Off,
    /// Live blocks and segments in snapshots (`"state"`).
    State,
    /// Also `alloc`, `segment_alloc` and `oom` trace entries (`"alloc"`).
    Alloc,
    /// Also `free_requested` entries: where each free came from (`"all"`).
    All,
}

/// How to record history, like the arguments of PyTorch's `_record_memory_history`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryOptions {
    /// What is recorded.
    pub enabled: RecordMode,
    /// Which records carry a call stack.
    pub context: StackContext,
    /// How many events the ring keeps (the oldest go first).
    pub max_entries: usize,
}

impl Default for HistoryOptions {
    /// PyTorch's defaults: everything, with stacks, up to 2^20 entries here (PyTorch's is
    /// unbounded).
    fn default() -> Self {
        Self {
            enabled: RecordMode::All,
            context: StackContext::All,
            max_entries: 1 << 20,
        }
    }
}

impl HistoryOptions {
    /// Recording off.
    pub fn off() -> Self {
        Self {
            enabled: RecordMode::Off,
            context: StackContext::Off,
            max_entries: 1 << 20,
        }
    }

    /// Trace entries without stacks (the cheapest recording that feeds the viewers).
    pub fn trace(max_entries: usize) -> Self {
        Self {
            enabled: RecordMode::All,
            context: StackContext::Off,
            max_entries,
        }
    }

    /// The same options with `enabled` saying what is recorded.
    pub fn with_enabled(mut self, enabled: RecordMode) -> Self {
        self.enabled = enabled;
        self
    }

    /// The same options with `context` for stacks.
    pub fn with_context(mut self, context: StackContext) -> Self {
        self.context = context;
        self
    }

    /// The same options with a ring of `max_entries` (at least 1).
    pub fn with_max_entries(mut self, max_entries: usize) -> Self {
        self.max_entries = max_entries.max(1);
        self
    }

    /// Whether requests should capture a stack.
    pub fn captures_stacks(&self) -> bool {
        self.enabled != RecordMode::Off && self.context != StackContext::Off
    }
}

/// What a [`HistoryEntry`] records (PyTorch's `action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// The owner freed a block (it may still wait on other streams).
    FreeRequested,
    /// The block became reusable.
    FreeCompleted,
    /// A segment came from the device.
    SegmentAlloc,
    /// A segment went back to the device.
    SegmentFree,
    /// A range was mapped into an expandable segment.
    SegmentMap,
    /// A range was unmapped from an expandable segment.
    SegmentUnmap,
    /// A request failed with out-of-memory.
    Oom,
}

impl TraceAction {
    /// PyTorch's name for the action.
    pub fn name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
        }
    }
}

/// One entry of the history in PyTorch's terms (an element of `device_traces`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct HistoryEntry {
    /// What happened.
    pub action: TraceAction,
    /// The block's address (alloc, frees), the segment's or range's (segment actions); 0 for oom.
    pub addr: u64,
    /// Alloc and frees: the requested size; segment actions: the segment's or range's size;
    /// oom: the rounded request.
    pub size: u64,
    /// Alloc and frees: the block's size (the request rounded); otherwise `size`.
    pub block_size: u64,
    /// The stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Oom: the device's free bytes.
    pub device_free: Option<u64>,
    /// Where the request came from, when stacks are recorded for this action (not in the
    /// JSON; PyTorch-format snapshots carry it resolved).
    #[serde(skip)]
    pub stack: Option<Stack>,
}

/// The ring's element: the engine's event and its entry in PyTorch's terms, if it has one.
#[derive(Debug)]
struct Recorded {
    event: TraceEvent,
    entry: Option<HistoryEntry>,
}

#[derive(Debug)]
struct LiveBlock {
    address: u64,
    requested: u64,
    size: u64,
    stream: u64,
    stack: Option<Stack>,
}

#[derive(Debug)]
struct LiveSegment {
    stream: u64,
    stack: Option<Stack>,
}

/// Microseconds since the Unix epoch.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The engine's recorder: the ring, and what it must remember about live blocks and segments.
#[derive(Debug)]
pub(crate) struct History {
    options: HistoryOptions,
    ring: Option<TraceRing<Recorded>>,
    live: HashMap<u64, LiveBlock>,
    segments: HashMap<u64, LiveSegment>,
    request_stack: Option<Stack>,
}

impl History {
    /// A recorder with `options`; `None` when they record nothing.
    pub fn new(options: HistoryOptions) -> Option<Self> {
        (options.enabled != RecordMode::Off).then(|| Self {
            options,
            ring: (options.enabled == RecordMode::All).then(|| TraceRing::new(options.max_entries)),
            live: HashMap::new(),
            segments: HashMap::new(),
            request_stack: None,
        })
    }

    pub fn options(&self) -> HistoryOptions {
        self.options
    }

    /// The stack of the request being served (set before it, cleared after it).
    pub fn set_request_stack(&mut self, stack: Option<Stack>) {
        self.request_stack = stack;
    }

    /// Remembers a block that was live before recording started.
    pub fn seed_block(&mut self, id: u64, address: u64, requested: u64, size: u64, stream: u64) {
        self.live.insert(
            id,
            LiveBlock {
                address,
                requested,
                size,
                stream,
                stack: None,
            },
        );
    }

    /// Remembers a segment that existed before recording started.
    pub fn seed_segment(&mut self, address: u64, stream: u64) {
        self.segments.insert(
            address,
            LiveSegment {
                stream,
                stack: None,
            },
        );
    }

    fn stack_if(&self, context: StackContext) -> Option<Stack> {
        (self.options.context >= context)
            .then(|| self.request_stack.clone())
            .flatten()
    }

    /// Records `event`; one match arm per event kind turns it into PyTorch's entry.
    pub fn record(&mut self, event: TraceEvent) {
        let time_us = now_us();
        let entry = |action, addr, size, block_size, stream, stack| HistoryEntry {
            action,
            addr,
            size,
            block_size,
            stream,
            time_us,
            device_free: None,
            stack,
        };
        let converted = match event {
            TraceEvent::Malloc {
                id,
                size,
                stream,
                block_size,
                address,
            } => {
                let stack = self.stack_if(StackContext::State);
                self.live.insert(
                    id,
                    LiveBlock {
                        address,
                        requested: size,
                        size: block_size,
                        stream,
                        stack,
                    },
                );
                let stack = self.stack_if(StackContext::Alloc);
                Some(entry(
                    TraceAction::Alloc,
                    address,
                    size,
                    block_size,
                    stream,
                    stack,
                ))
            }
            TraceEvent::FreeRequested { id } => {
                let stack = self.stack_if(StackContext::All);
                self.live.get(&id).map(|b| {
                    entry(
                        TraceAction::FreeRequested,
                        b.address,
                        b.requested,
                        b.size,
                        b.stream,
                        stack,
                    )
                })
            }
            TraceEvent::FreeCompleted { id } => self.live.remove(&id).map(|b| {
                entry(
                    TraceAction::FreeCompleted,
                    b.address,
                    b.requested,
                    b.size,
                    b.stream,
                    None,
                )
            }),
            TraceEvent::SegmentAlloc {
                address,
                size,
                stream,
            } => {
                let stack = self.stack_if(StackContext::State);
                self.segments.insert(address, LiveSegment { stream, stack });
                let stack = self.stack_if(StackContext::Alloc);
                Some(entry(
                    TraceAction::SegmentAlloc,
                    address,
                    size,
                    size,
                    stream,
                    stack,
                ))
            }
            TraceEvent::SegmentFree { address, size } => {
                let stream = self.segments.remove(&address).map_or(0, |s| s.stream);
                Some(entry(
                    TraceAction::SegmentFree,
                    address,
                    size,
                    size,
                    stream,
                    None,
                ))
            }
            TraceEvent::SegmentMap {
                address,
                size,
                stream,
            } => {
                let stack = self.stack_if(StackContext::State);
                self.segments
                    .entry(address)
                    .or_insert(LiveSegment { stream, stack });
                let stack = self.stack_if(StackContext::Alloc);
                Some(entry(
                    TraceAction::SegmentMap,
                    address,
                    size,
                    size,
                    stream,
                    stack,
                ))
            }
            TraceEvent::SegmentUnmap {
                address,
                size,
                stream,
            } => {
                self.segments.remove(&address);
                Some(entry(
                    TraceAction::SegmentUnmap,
                    address,
                    size,
                    size,
                    stream,
                    None,
                ))
            }
            TraceEvent::Oom {
                stream,
                rounded,
                device_free,
                ..
            } => {
                let stack = self.stack_if(StackContext::Alloc);
                Some(HistoryEntry {
                    device_free: Some(device_free),
                    ..entry(TraceAction::Oom, 0, rounded, rounded, stream, stack)
                })
            }
            TraceEvent::RecordStream { .. } | TraceEvent::EmptyCache => None,
        };
        if let Some(ring) = &mut self.ring {
            ring.push(Recorded {
                event,
                entry: converted,
            });
        }
    }

    /// The engine's events (the JSON trace).
    pub fn to_trace(&self) -> Trace {
        let Some(ring) = &self.ring else {
            return Trace::default();
        };
        Trace {
            events: ring.iter().map(|r| r.event.clone()).collect(),
            dropped: ring.dropped(),
        }
    }

    /// The entries in PyTorch's terms, oldest first.
    pub fn entries(&self) -> Vec<HistoryEntry> {
        self.ring
            .iter()
            .flat_map(|ring| ring.iter())
            .filter_map(|r| r.entry.clone())
            .collect()
    }

    /// The stack recorded when live allocation `id` was made.
    pub fn block_stack(&self, id: u64) -> Option<Stack> {
        self.live.get(&id).and_then(|b| b.stack.clone())
    }

    /// The stack recorded when the segment at `address` was allocated.
    pub fn segment_stack(&self, address: u64) -> Option<Stack> {
        self.segments.get(&address).and_then(|s| s.stack.clone())
    }
}
