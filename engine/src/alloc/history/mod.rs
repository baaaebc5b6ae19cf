//! The engine's history, in one place: what to record, the recorder, what it records, the
//! snapshot that explains it, and the files they are written to.
//!
//! Recording is switched on, changed and off in one way, [`HistoryOptions`] given to
//! `CachingAllocator::record_memory_history` (PyTorch's `_record_memory_history(enabled,
//! context, max_entries)`), or from the start by the configuration (`record_history`,
//! `history_capacity`, which set [`AllocatorConfig::history`]).
//!
//! - `options`: [`HistoryOptions`], [`RecordMode`], [`StackContext`];
//! - `recorder`: the ring the engine feeds and the live blocks it remembers;
//! - `trace`: [`Trace`] and [`TraceEvent`], the engine's events, the trace the replay reads;
//! - `entry`: [`HistoryEntry`] and [`TraceAction`], the same events in PyTorch's terms;
//! - `file`: trace files (JSON, gzipped when the name ends in `.gz`);
//! - `snapshot`: [`Snapshot`], every segment and block with the statistics and the history;
//! - [`inspect`]: snapshots as PyTorch-format pickles and as an offline HTML viewer.
//!
//! [`AllocatorConfig::history`]: crate::alloc::AllocatorConfig::history

mod entry;
mod file;
pub mod inspect;
mod options;
mod recorder;
mod replace_file;
mod snapshot;
mod trace;

pub use entry::{HistoryEntry, PhaseMark, PhaseStage, TraceAction};
pub use file::{MAX_GZIP_RATIO, MAX_TRACE_BYTES, MAX_TRACE_EVENTS, TraceFileError};
pub use options::{HistoryOptions, RecordMode, StackContext};
pub(crate) use recorder::{Live, Recorder};
pub use snapshot::{BlockSnapshot, SegmentSnapshot, Snapshot};
pub use trace::{Trace, TraceEvent};
