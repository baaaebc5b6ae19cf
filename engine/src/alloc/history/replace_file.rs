//! Writing a file whole: to a new temporary file beside the target, renamed over it once
//! complete. A failed or interrupted write never leaves a truncated file under the target's
//! name, and a symlink at the target or under the temporary name is never followed: the
//! temporary file is opened only if new (`O_CREAT | O_EXCL`), and the rename replaces the
//! target's directory entry, a symlink included, not what it points to.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes `path` with `body`, which gets the new temporary file and returns it once written
/// (synced here); `io` turns an I/O failure into the caller's error. On any failure the
/// temporary file is removed and `path` is what it was.
pub(super) fn replace_whole<E>(
    path: &Path,
    io: impl Fn(io::Error) -> E,
    body: impl FnOnce(File) -> Result<File, E>,
) -> Result<(), E> {
    let temporary = temporary_name(path);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temporary)
        .map_err(&io)
        .and_then(body)
        .and_then(|file| file.sync_all().map_err(&io));
    let renamed = written.and_then(|()| std::fs::rename(&temporary, path).map_err(&io));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    renamed
}

/// A name beside `path` unique per process and write, and not guessable ahead of time (the
/// clock's nanoseconds).
fn temporary_name(path: &Path) -> PathBuf {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let write = WRITES.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(
        ".{}-{write}-{nanos:08x}.partial",
        std::process::id()
    ));
    PathBuf::from(temporary)
}
