//! Trace files: a [`Trace`] as JSON on disk, gzipped when the file name ends in `.gz`.
//!
//! Reading decompresses into memory first, so that a corrupt or truncated gzip stream is
//! reported as such ([`TraceFileError::Gzip`]) and not as JSON that does not parse, and stops
//! at [`MAX_TRACE_BYTES`] of JSON ([`TraceFileError::TooLarge`]): a small `.gz` file can
//! expand to any size. Writing goes to a temporary file beside the target, renamed over it
//! once complete, so a failed or interrupted write never leaves a truncated trace under the
//! target's name.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;

use super::trace::Trace;

/// The largest trace read, in bytes of JSON (after decompression): 4 GiB, about 40 million
/// events.
pub const MAX_TRACE_BYTES: u64 = 4 << 30;

/// Why a trace file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceFileError {
    /// The file could not be opened, read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file's name ends in `.gz` but its contents are not a complete gzip stream
    /// (corrupt, truncated, or not gzip at all).
    #[error("{} is not a complete gzip stream (corrupt or truncated): {source}", path.display())]
    Gzip {
        /// The file.
        path: PathBuf,
        /// The decoder's error.
        source: std::io::Error,
    },
    /// The file holds (or decompresses to) more than `limit` bytes of JSON.
    #[error("{} holds more than {limit} bytes of JSON: refused as a trace", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit, [`MAX_TRACE_BYTES`].
        limit: u64,
    },
    /// The file's contents are not a trace, or the trace could not be serialised.
    #[error("{} is not a trace (JSON of trace events): {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The JSON error.
        source: serde_json::Error,
    },
}

/// Whether `path` names a gzipped file.
fn gzipped(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext == "gz")
}

/// Reads all of `reader`, at most `limit` bytes: `Ok(None)` when there is more.
fn read_capped(reader: impl Read, limit: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    reader
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= limit).then_some(bytes))
}

/// The trace in `path` ([`Trace::read_file`]), at most `limit` bytes of JSON.
pub(super) fn read(path: &Path, limit: u64) -> Result<Trace, TraceFileError> {
    let path_buf = || path.to_path_buf();
    let file = File::open(path).map_err(|source| TraceFileError::Io {
        path: path_buf(),
        source,
    })?;
    let bytes = if gzipped(path) {
        read_capped(GzDecoder::new(BufReader::new(file)), limit).map_err(|source| {
            TraceFileError::Gzip {
                path: path_buf(),
                source,
            }
        })?
    } else {
        read_capped(BufReader::new(file), limit).map_err(|source| TraceFileError::Io {
            path: path_buf(),
            source,
        })?
    };
    let bytes = bytes.ok_or_else(|| TraceFileError::TooLarge {
        path: path_buf(),
        limit,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| TraceFileError::Json {
        path: path_buf(),
        source,
    })
}

/// Writes `trace` to `path` ([`Trace::write_file`]): to a temporary file beside it, renamed
/// over it once complete.
pub(super) fn write(trace: &Trace, path: &Path) -> Result<(), TraceFileError> {
    let io = |source| TraceFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    // Unique per process and write, so that two writes of one path do not share it.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".{}-{write}.partial", std::process::id()));
    let temporary = PathBuf::from(temporary);
    let written = write_whole(trace, path, &temporary);
    let renamed = written.and_then(|()| std::fs::rename(&temporary, path).map_err(io));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    renamed
}

/// Writes `trace` to `temporary` as `path` names its format, synced to the disk.
fn write_whole(trace: &Trace, path: &Path, temporary: &Path) -> Result<(), TraceFileError> {
    let io = |source| TraceFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let json = |source| TraceFileError::Json {
        path: path.to_path_buf(),
        source,
    };
    let file = BufWriter::new(File::create(temporary).map_err(io)?);
    let mut file = if gzipped(path) {
        let mut encoder = GzEncoder::new(file, Compression::best());
        serde_json::to_writer(&mut encoder, trace).map_err(json)?;
        encoder.finish().map_err(io)?
    } else {
        let mut file = file;
        serde_json::to_writer(&mut file, trace).map_err(json)?;
        file
    };
    file.flush().map_err(io)?;
    let file = file.into_inner().map_err(|err| io(err.into_error()))?;
    file.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::history::TraceEvent;

    fn sample() -> Trace {
        Trace {
            events: vec![
                TraceEvent::Malloc {
                    id: 1,
                    size: 1000,
                    stream: 0,
                    block_size: 1024,
                    address: 4096,
                },
                TraceEvent::FreeRequested { id: 1 },
                TraceEvent::EmptyCache,
            ],
            dropped: 3,
        }
    }

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("trace-file-{}-{name}", std::process::id()))
    }

    #[test]
    fn json_and_gzipped_json_round_trip() {
        for name in ["plain.json", "packed.json.gz"] {
            let path = scratch(name);
            sample().write_file(&path).expect("written");
            let bytes = std::fs::read(&path).expect("read back");
            // A gzip stream starts with 1f 8b; plain JSON with '{'.
            assert_eq!(bytes.starts_with(&[0x1f, 0x8b]), name.ends_with(".gz"));
            assert_eq!(Trace::read_file(&path).expect("parsed"), sample());
            if name.ends_with(".gz") {
                assert_eq!(Trace::from_json_gz(&bytes).expect("decoded"), sample());
            }
            let _ = std::fs::remove_file(&path);
        }
    }

    #[test]
    fn a_missing_file_and_a_file_that_is_no_trace_name_the_path() {
        let missing = scratch("missing.json");
        match Trace::read_file(&missing) {
            Err(err @ TraceFileError::Io { .. }) => {
                assert!(err.to_string().contains("missing.json"), "{err}")
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
        let wrong = scratch("wrong.json");
        std::fs::write(&wrong, b"{\"not\": \"a trace\"}").expect("written");
        match Trace::read_file(&wrong) {
            Err(err @ TraceFileError::Json { .. }) => {
                assert!(err.to_string().contains("is not a trace"), "{err}")
            }
            other => panic!("expected a JSON error, got {other:?}"),
        }
        let _ = std::fs::remove_file(&wrong);
    }

    /// Issue 20 point 6: a corrupt or truncated gzip stream used to be reported as "not a
    /// trace" (a JSON error); it is a gzip error now, naming the file.
    #[test]
    fn a_truncated_or_corrupt_gzip_file_is_a_gzip_error() {
        let path = scratch("whole.json.gz");
        sample().write_file(&path).expect("written");
        let bytes = std::fs::read(&path).expect("read back");
        let truncated = scratch("truncated.json.gz");
        std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("written");
        let corrupt = scratch("corrupt.json.gz");
        let mut flipped = bytes.clone();
        flipped[bytes.len() - 6] ^= 0xff; // inside the CRC-32 trailer
        std::fs::write(&corrupt, &flipped).expect("written");
        let not_gzip = scratch("plain-text.json.gz");
        std::fs::write(&not_gzip, b"{\"events\": []}").expect("written");
        for file in [&truncated, &corrupt, &not_gzip] {
            match Trace::read_file(file) {
                Err(err @ TraceFileError::Gzip { .. }) => {
                    assert!(
                        err.to_string().contains("not a complete gzip stream"),
                        "{err}"
                    );
                    assert!(
                        err.to_string()
                            .contains(&*file.file_name().unwrap().to_string_lossy()),
                        "{err}"
                    );
                }
                other => panic!("{}: expected a gzip error, got {other:?}", file.display()),
            }
            let _ = std::fs::remove_file(file);
        }
        let _ = std::fs::remove_file(&path);
    }

    /// Issue 20 point 6: no size cap; a small `.gz` can expand to any size.
    #[test]
    fn a_trace_beyond_the_cap_is_refused_before_it_is_parsed() {
        let path = scratch("capped.json.gz");
        sample().write_file(&path).expect("written");
        let json_len = serde_json::to_vec(&sample()).unwrap().len() as u64;
        assert_eq!(read(&path, json_len).expect("at the cap"), sample());
        match read(&path, json_len - 1) {
            Err(err @ TraceFileError::TooLarge { .. }) => {
                assert!(
                    err.to_string().contains(&format!("{}", json_len - 1)),
                    "{err}"
                )
            }
            other => panic!("expected too large, got {other:?}"),
        }
        let _ = std::fs::remove_file(&path);
    }

    /// Issue 20 point 6: writes were not atomic. A write that fails (here: the trace's
    /// directory is a file) leaves no partial file behind, and a rewrite replaces the old
    /// trace whole.
    #[test]
    fn writes_replace_the_file_whole_and_leave_nothing_when_they_fail() {
        let path = scratch("atomic.json");
        std::fs::write(&path, b"old contents").expect("written");
        sample().write_file(&path).expect("written");
        assert_eq!(Trace::read_file(&path).expect("parsed"), sample());
        let dir = path.parent().unwrap();
        let leftovers = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with(&*path.file_name().unwrap().to_string_lossy())
                    && name.ends_with(".partial")
            })
            .count();
        assert_eq!(leftovers, 0);
        let inside_a_file = path.join("trace.json");
        assert!(matches!(
            sample().write_file(&inside_a_file),
            Err(TraceFileError::Io { .. })
        ));
        assert_eq!(Trace::read_file(&path).expect("untouched"), sample());
        let _ = std::fs::remove_file(&path);
    }
}
