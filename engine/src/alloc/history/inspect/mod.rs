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

use std::io::Write;
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

/// Writes `bytes` to `path` whole (a temporary file renamed over it): a symlink at `path` is
/// replaced, never followed, and a failed write leaves `path` as it was.
fn write(path: &Path, bytes: &[u8]) -> Result<(), InspectError> {
    let io = |source| InspectError {
        path: path.to_path_buf(),
        source,
    };
    super::replace_file::replace_whole(path, io, |mut file| {
        file.write_all(bytes).map_err(io)?;
        Ok(file)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot written where a symlink stands replaces the link and leaves its target
    /// alone (`std::fs::write` followed the link and overwrote the target).
    #[cfg(unix)]
    #[test]
    fn a_symlink_at_the_target_is_replaced_not_followed() {
        let dir = std::env::temp_dir().join(format!("inspect-symlink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let victim = dir.join("victim.txt");
        let link = dir.join("snapshot.pickle");
        std::fs::write(&victim, b"precious").expect("written");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&victim, &link).expect("planted");
        let alloc = crate::alloc::CachingAllocator::new(
            crate::device::sim::SimDevice::new(1 << 30),
            crate::alloc::AllocatorConfig::default(),
        )
        .expect("allocator");
        let snapshot = alloc.snapshot();
        write_torch_snapshot(&snapshot, 0, &link).expect("written");
        assert_eq!(std::fs::read(&victim).expect("read"), b"precious");
        assert!(!std::fs::symlink_metadata(&link).expect("stat").is_symlink());
        assert_eq!(
            std::fs::read(&link).expect("read"),
            torch_snapshot_pickle(&snapshot, 0)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
