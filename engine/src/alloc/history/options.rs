//! What to record: the arguments of PyTorch's `torch.cuda.memory._record_memory_history`
//! (`enabled`, `context`, `max_entries`), the one way recording is switched on, changed or off.

use serde::{Deserialize, Serialize};

/// What the history records (PyTorch's `enabled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordMode {
    /// Nothing (PyTorch's `None`).
    Off,
    /// Only the live blocks' stacks, for snapshots; no trace entries (`"state"`).
    State,
    /// The live blocks' stacks and a ring of trace entries (`"all"`).
    All,
}

/// Which records carry a call stack (PyTorch's `context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
