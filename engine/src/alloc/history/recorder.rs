//! The recorder the engine feeds: one ring of events, each with its entry in PyTorch's terms,
//! and what it must remember about live blocks and segments so that frees name their block.
//!
//! Every [`TraceEvent`] the engine records becomes, besides the event itself (the JSON trace
//! the replay reads), at most one [`HistoryEntry`]. Frees name the block's address and
//! requested size even when the ring dropped the allocation, because the recorder remembers
//! every live block.
//!
//! The ring keeps a suffix of one complete history, so the entries it keeps are always
//! explained by the snapshot taken with them (MEMORY_VIZ.md, "Consistency"): recording starts
//! ([`Recorder::start`]) from the blocks and segments live at that moment ([`Live`]).

use std::collections::{HashMap, VecDeque};
use std::time::{SystemTime, UNIX_EPOCH};

use super::entry::{HistoryEntry, PhaseMark, PhaseStage, TraceAction};
use super::options::{HistoryOptions, RecordMode, StackContext};
use super::trace::{Trace, TraceEvent};
use crate::alloc::scope::Tag;
use crate::alloc::stack::Stack;

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

/// What was live when recording started: the recorder remembers it so that later frees
/// and unmaps name their block or segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Live {
    /// A mapped run of a segment (an ordinary segment is one run), as the snapshot shows it.
    Segment {
        /// Where the run starts.
        address: u64,
        /// The segment's stream.
        stream: u64,
    },
    /// An allocated or pending-free block.
    Block {
        /// Its allocation id.
        id: u64,
        /// Its address.
        address: u64,
        /// What its owner asked for.
        requested: u64,
        /// Its size.
        size: u64,
        /// Its segment's stream.
        stream: u64,
    },
    /// A private pool that can still be routed to: the ring begins with its `PoolCreate`, so
    /// that a replay of the trace makes it before its first request.
    Pool {
        /// The pool's number.
        pool: u64,
        /// Its `no_split` option.
        no_split: bool,
        /// Its `use_on_oom` option.
        use_on_oom: bool,
    },
}

/// The engine's recorder: the ring, and what it must remember about live blocks and segments.
#[derive(Debug)]
pub(crate) struct Recorder {
    options: HistoryOptions,
    ring: Option<Ring<Recorded>>,
    live: HashMap<u64, LiveBlock>,
    segments: HashMap<u64, LiveSegment>,
    request_stack: Option<Stack>,
    request_tag: Option<Tag>,
    /// The phase marks, newest `max_entries` (PyTorch keeps its own ring for them).
    phases: Ring<PhaseMark>,
}

impl Recorder {
    /// A recorder with `options` that knows what is `live` now; `None` when the options
    /// record nothing.
    pub fn start(options: HistoryOptions, live: impl IntoIterator<Item = Live>) -> Option<Self> {
        if options.enabled == RecordMode::Off {
            return None;
        }
        let mut recorder = Self {
            options,
            ring: (options.enabled == RecordMode::All).then(|| Ring::new(options.max_entries)),
            live: HashMap::new(),
            segments: HashMap::new(),
            request_stack: None,
            request_tag: None,
            phases: Ring::new(options.max_entries),
        };
        for item in live {
            match item {
                Live::Pool {
                    pool,
                    no_split,
                    use_on_oom,
                } => {
                    if let Some(ring) = &mut recorder.ring {
                        ring.push(Recorded {
                            event: TraceEvent::PoolCreate {
                                pool,
                                no_split,
                                use_on_oom,
                            },
                            entry: None,
                        });
                    }
                }
                Live::Segment { address, stream } => {
                    recorder.segments.insert(
                        address,
                        LiveSegment {
                            stream,
                            stack: None,
                        },
                    );
                }
                Live::Block {
                    id,
                    address,
                    requested,
                    size,
                    stream,
                } => {
                    recorder.live.insert(
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
            }
        }
        Some(recorder)
    }

    pub fn options(&self) -> HistoryOptions {
        self.options
    }

    /// The stack of the request being served (set before it, cleared after it).
    pub fn set_request_stack(&mut self, stack: Option<Stack>) {
        self.request_stack = stack;
    }

    /// The scope of the request being served (set before it, cleared after it).
    pub fn set_request_tag(&mut self, tag: Option<Tag>) {
        self.request_tag = tag;
    }

    /// Records that phase `name` begins or ends now.
    pub fn mark_phase(&mut self, name: &str, stage: PhaseStage) {
        self.phases.push(PhaseMark {
            name: name.to_owned(),
            stage,
            time_us: now_us(),
        });
    }

    /// The phase marks, oldest first.
    pub fn phases(&self) -> Vec<PhaseMark> {
        self.phases.iter().cloned().collect()
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
            user_metadata: String::new(),
        };
        let converted = match event {
            TraceEvent::Malloc {
                id,
                size,
                stream,
                block_size,
                address,
                ..
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
                Some(HistoryEntry {
                    user_metadata: self
                        .request_tag
                        .as_ref()
                        .map_or_else(String::new, |tag| tag.name().to_owned()),
                    ..entry(TraceAction::Alloc, address, size, block_size, stream, stack)
                })
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
            TraceEvent::RecordStream { .. }
            | TraceEvent::EmptyCache
            | TraceEvent::PoolCreate { .. }
            | TraceEvent::PoolEmptyCache { .. }
            | TraceEvent::PoolRelease { .. } => None,
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

/// A bounded history: the newest `capacity` entries, oldest first.
#[derive(Debug)]
struct Ring<T> {
    entries: VecDeque<T>,
    capacity: usize,
    dropped: u64,
}

impl<T> Ring<T> {
    fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
        }
    }

    fn push(&mut self, entry: T) {
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.entries.push_back(entry);
    }

    /// The entries, oldest first.
    fn iter(&self) -> impl Iterator<Item = &T> {
        self.entries.iter()
    }

    /// How many older entries the ring overwrote.
    fn dropped(&self) -> u64 {
        self.dropped
    }
}
