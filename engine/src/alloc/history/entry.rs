//! The history in PyTorch's terms: each recorded [`TraceEvent`](super::TraceEvent) as at most
//! one [`HistoryEntry`] (an element of `device_traces`): a timestamp, an action, an address,
//! a size and a stream, and the call stack where the options ask for one.

use serde::{Deserialize, Serialize};

use crate::alloc::stack::Stack;

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
    /// Alloc: the memory scope the request was made in (`alloc::Tag`), "" for none: PyTorch's
    /// `user_metadata` of a trace entry.
    #[serde(default)]
    pub user_metadata: String,
}

/// Whether a [`PhaseMark`] begins or ends its phase (PyTorch's `stage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PhaseStage {
    /// The phase begins (`"START"`).
    Start,
    /// The phase ends (`"END"`).
    End,
}

impl PhaseStage {
    /// PyTorch's name for the stage.
    pub fn name(self) -> &'static str {
        match self {
            PhaseStage::Start => "START",
            PhaseStage::End => "END",
        }
    }
}

/// One edge of a named phase of the program (`forward`, `backward`, ...), recorded while the
/// history is on: an entry of the PyTorch snapshot's `external_annotations`, which its
/// Active Memory Timeline draws as bands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PhaseMark {
    /// The phase's name.
    pub name: String,
    /// Whether the phase begins or ends here.
    pub stage: PhaseStage,
    /// Microseconds since the Unix epoch (the clock of [`HistoryEntry::time_us`]).
    pub time_us: u64,
}
