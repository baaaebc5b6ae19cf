//! Seeing memory: snapshots PyTorch's viewers open, and an offline HTML viewer of our own.
//!
//! - [`torch_snapshot_pickle`] and [`write_torch_snapshot`]: a [`Snapshot`] in the format of
//!   `torch.cuda.memory._snapshot()`, pickled, which `torch/cuda/_memory_viz.py` and
//!   <https://pytorch.org/memory_viz> open;
//! - [`viewer_html`] and [`write_viewer_html`]: one self-contained HTML file (no network)
//!   with the active-memory timeline, the segment map, every block's stack and a summary.
//!
//! Stacks are resolved here, when the file is written, never while recording.

mod html;
mod pickle;
mod torch_format;

use std::path::{Path, PathBuf};

pub use html::ViewerLayer;

use super::snapshot::Snapshot;

/// Why a snapshot or viewer file could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}: {source}", path.display())]
pub struct InspectError {
    /// The file.
    pub path: PathBuf,
    /// The I/O error.
    pub source: std::io::Error,
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), InspectError> {
    std::fs::write(path, bytes).map_err(|source| InspectError {
        path: path.to_path_buf(),
        source,
    })
}

/// `snapshot` pickled in the format of `torch.cuda.memory._snapshot()`, for device index
/// `device` (`device_traces` has `device + 1` lists; the history goes in the last). The index
/// is CubeCL's (a `u16`), which bounds those lists: at most 65,536, about 128 KiB of pickle.
pub fn torch_snapshot_pickle(snapshot: &Snapshot, device: u16) -> Vec<u8> {
    pickle::to_pickle(&torch_format::torch_snapshot(snapshot, device))
}

/// Writes [`torch_snapshot_pickle`] to `path` (PyTorch's `_dump_snapshot`).
pub fn write_torch_snapshot(
    snapshot: &Snapshot,
    device: u16,
    path: &Path,
) -> Result<(), InspectError> {
    write(path, &torch_snapshot_pickle(snapshot, device))
}

/// The offline viewer of `snapshot` as one HTML page; `layers` are caches above the engine
/// (CubeCL's) shown beside its numbers.
pub fn viewer_html(snapshot: &Snapshot, title: &str, layers: &[ViewerLayer]) -> String {
    html::render(snapshot, title, layers)
}

/// Writes [`viewer_html`] to `path`.
pub fn write_viewer_html(
    snapshot: &Snapshot,
    title: &str,
    layers: &[ViewerLayer],
    path: &Path,
) -> Result<(), InspectError> {
    write(path, viewer_html(snapshot, title, layers).as_bytes())
}
