//! Trace files: a [`Trace`] as JSON on disk, gzipped when the file name ends in `.gz`.
//!
//! Reading streams the JSON (decompressed on the fly) into the events, so the host holds
//! the events and not the file: a corrupt or truncated gzip stream is reported as such
//! ([`TraceFileError::Gzip`]) and not as JSON that does not parse, and reading stops at
//! [`MAX_TRACE_BYTES`] of JSON ([`TraceFileError::TooLarge`]) and [`MAX_TRACE_EVENTS`]
//! events: a small `.gz` file can expand to any size. Writing goes to a temporary file beside the target, renamed over it
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

/// How many times its own size a gzipped trace may decompress to: recorded traces compress
/// 11 to 16 times (the replay's), so 128 leaves room and refuses a small file that would expand
/// to gigabytes of events in memory.
pub const MAX_GZIP_RATIO: u64 = 128;

/// A gzipped trace may always decompress to this much, whatever its size (64 MiB of JSON).
const MIN_GZIP_LIMIT: u64 = 64 << 20;

/// The limit of JSON a gzipped trace of `compressed` bytes may hold: `limit`, or less for a
/// small file ([`MAX_GZIP_RATIO`] times its size, at least 64 MiB).
fn gzip_limit(compressed: u64, limit: u64) -> u64 {
    limit.min(
        compressed
            .saturating_mul(MAX_GZIP_RATIO)
            .max(MIN_GZIP_LIMIT),
    )
}

/// The most events a trace read may hold: 2^26 (about 3 GiB of events in memory), more than
/// [`MAX_TRACE_BYTES`] of JSON holds at its typical 100 bytes an event.
pub const MAX_TRACE_EVENTS: u64 = 1 << 26;

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
    /// The file holds (or decompresses to) more than `limit` bytes of JSON (for a gzipped
    /// file, at most [`MAX_GZIP_RATIO`] times its own size, at least 64 MiB).
    #[error("{} holds more than {limit} bytes of JSON: refused as a trace", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit: [`MAX_TRACE_BYTES`], or the gzip ratio's.
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

/// A reader that yields at most `limit` bytes of `inner` and then fails, remembering that it
/// did, when `inner` has more: the JSON parser then stops at once instead of reading on.
struct Capped<R> {
    inner: R,
    left: u64,
    exceeded: bool,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            let mut probe = [0u8; 1];
            if self.inner.read(&mut probe)? == 0 {
                return Ok(0);
            }
            self.exceeded = true;
            return Err(std::io::Error::other("the trace exceeds its byte limit"));
        }
        let room = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let read = self.inner.read(&mut buf[..room])?;
        self.left -= read as u64;
        Ok(read)
    }
}

/// How a streamed read of a trace failed.
enum ReadFailure {
    /// More than the limit of JSON.
    TooLarge,
    /// The reader failed (a gzip or I/O error).
    Io(std::io::Error),
    /// The bytes are not a trace.
    Json(serde_json::Error),
}

/// Parses the trace `reader` streams, at most `limit` bytes of JSON.
fn parse_capped(reader: impl Read, limit: u64) -> Result<Trace, ReadFailure> {
    let mut capped = Capped {
        inner: BufReader::new(reader),
        left: limit,
        exceeded: false,
    };
    let parsed = serde_json::from_reader::<_, Trace>(&mut capped);
    match parsed {
        _ if capped.exceeded => Err(ReadFailure::TooLarge),
        Ok(trace) => Ok(trace),
        Err(err) if err.is_io() => Err(ReadFailure::Io(err.into())),
        Err(err) => Err(ReadFailure::Json(err)),
    }
}

/// A gzipped trace held in memory ([`Trace::from_json_gz`]), at most `limit` bytes of JSON.
pub(super) fn from_gz_slice(bytes: &[u8], limit: u64) -> Result<Trace, serde_json::Error> {
    let limit = gzip_limit(bytes.len() as u64, limit);
    match parse_capped(GzDecoder::new(bytes), limit) {
        Ok(trace) => Ok(trace),
        Err(ReadFailure::TooLarge) => Err(serde_json::Error::io(std::io::Error::other(format!(
            "the trace holds more than {limit} bytes of JSON"
        )))),
        Err(ReadFailure::Io(err)) => Err(serde_json::Error::io(err)),
        Err(ReadFailure::Json(err)) => Err(err),
    }
}

/// The trace in `path` ([`Trace::read_file`]), at most `limit` bytes of JSON.
pub(super) fn read(path: &Path, limit: u64) -> Result<Trace, TraceFileError> {
    let path_buf = || path.to_path_buf();
    let file = File::open(path).map_err(|source| TraceFileError::Io {
        path: path_buf(),
        source,
    })?;
    let gzip = gzipped(path);
    let limit = match file.metadata() {
        Ok(meta) if gzip => gzip_limit(meta.len(), limit),
        _ => limit,
    };
    let parsed = if gzip {
        parse_capped(GzDecoder::new(BufReader::new(file)), limit)
    } else {
        parse_capped(file, limit)
    };
    parsed.map_err(|failure| match failure {
        ReadFailure::TooLarge => TraceFileError::TooLarge {
            path: path_buf(),
            limit,
        },
        ReadFailure::Io(source) if gzip => TraceFileError::Gzip {
            path: path_buf(),
            source,
        },
        ReadFailure::Io(source) => TraceFileError::Io {
            path: path_buf(),
            source,
        },
        ReadFailure::Json(source) => TraceFileError::Json {
            path: path_buf(),
            source,
        },
    })
}

/// Writes `trace` to `path` ([`Trace::write_file`]): to a temporary file beside it, renamed
/// over it once complete.
pub(super) fn write(trace: &Trace, path: &Path) -> Result<(), TraceFileError> {
    let io = |source| TraceFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let json = |source| TraceFileError::Json {
        path: path.to_path_buf(),
        source,
    };
    super::replace_file::replace_whole(path, io, |file| {
        let file = BufWriter::new(file);
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
        file.into_inner().map_err(|err| io(err.into_error()))
    })
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
                    pool: 0,
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

    /// A small gzipped file that would expand far beyond what recorded traces do (here 2 KiB
    /// of gzip for 80 MiB of JSON whitespace) is refused at 128 times its size (at least 64
    /// MiB), before gigabytes of events could be held; before, only the 4 GiB cap applied.
    #[test]
    fn a_small_gzip_that_expands_a_thousandfold_is_refused() {
        let path = scratch("bomb.json.gz");
        let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
        encoder.write_all(b"{\"events\": [").unwrap();
        let spaces = vec![b' '; 1 << 20];
        for _ in 0..80 {
            encoder.write_all(&spaces).unwrap();
        }
        encoder.write_all(b"]}").unwrap();
        let bytes = encoder.finish().unwrap();
        std::fs::write(&path, &bytes).expect("written");
        match read(&path, MAX_TRACE_BYTES) {
            Err(TraceFileError::TooLarge { limit, .. }) => assert_eq!(limit, 64 << 20),
            other => panic!("expected too large, got {other:?}"),
        }
        assert!(from_gz_slice(&bytes, MAX_TRACE_BYTES).is_err());
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

    /// Issue 33: the temporary file was a predictable name (`<path>.<pid>-<n>.partial`)
    /// opened with `File::create`, which follows a symlink planted under it and truncates
    /// its target. Symlinks planted under every name the old scheme could pick stay
    /// untouched, and so do their targets.
    #[cfg(unix)]
    #[test]
    fn a_symlink_planted_under_the_temporary_name_is_never_followed() {
        let path = scratch("planted.json");
        let victim = scratch("victim.txt");
        std::fs::write(&victim, b"precious").expect("written");
        let mut planted = Vec::new();
        for n in 0..256 {
            let mut name = path.as_os_str().to_owned();
            name.push(format!(".{}-{n}.partial", std::process::id()));
            let name = PathBuf::from(name);
            let _ = std::fs::remove_file(&name);
            std::os::unix::fs::symlink(&victim, &name).expect("planted");
            planted.push(name);
        }
        sample().write_file(&path).expect("written");
        assert_eq!(std::fs::read(&victim).expect("read"), b"precious");
        assert_eq!(Trace::read_file(&path).expect("parsed"), sample());
        for name in planted {
            let _ = std::fs::remove_file(name);
        }
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&victim);
    }

    /// Issue 33: serde's internally tagged enum buffered every field of an event before
    /// reading its tag, unknown ones included; an event read now skips what it does not know
    /// as it reads it, and still reads every event of the format, and refuses a malformed
    /// one with a JSON error.
    #[test]
    fn events_read_with_unknown_fields_skipped_and_missing_ones_refused() {
        let text = r#"{"events": [
            {"extra": [[1, 2], {"a": "b"}], "op": "malloc", "id": 1, "size": 10, "stream": 0,
             "block_size": 512, "address": 4096},
            {"op": "oom", "size": 3, "stream": 1},
            {"op": "empty_cache", "id": 7}
        ], "dropped": 2, "later": {"x": [1]}}"#;
        let trace = Trace::from_json(text).expect("parses");
        assert_eq!(trace.dropped, 2);
        assert_eq!(
            trace.events,
            vec![
                TraceEvent::Malloc {
                    id: 1,
                    size: 10,
                    stream: 0,
                    block_size: 512,
                    address: 4096,
                    pool: 0,
                },
                TraceEvent::Oom {
                    size: 3,
                    stream: 1,
                    rounded: 0,
                    device_free: 0
                },
                TraceEvent::EmptyCache,
            ]
        );
        for bad in [
            r#"{"events": [{"op": "malloc", "id": 1}]}"#,
            r#"{"events": [{"op": "teleport"}]}"#,
            r#"{"events": [{"id": 1}]}"#,
            r#"{"events": [{"op": "free_requested", "id": -1}]}"#,
            r#"{"events": [{"op": "free_requested", "id": 1, "id": 2}]}"#,
        ] {
            assert!(Trace::from_json(bad).is_err(), "{bad}");
        }
        // Every event the engine writes reads back as itself.
        let all = Trace {
            events: vec![
                TraceEvent::Malloc {
                    id: 1,
                    size: 2,
                    stream: 3,
                    block_size: 512,
                    address: 8,
                    pool: 5,
                },
                TraceEvent::FreeRequested { id: 1 },
                TraceEvent::FreeCompleted { id: 1 },
                TraceEvent::RecordStream { id: 1, stream: 4 },
                TraceEvent::SegmentAlloc {
                    address: 8,
                    size: 9,
                    stream: 3,
                },
                TraceEvent::SegmentFree {
                    address: 8,
                    size: 9,
                },
                TraceEvent::SegmentMap {
                    address: 8,
                    size: 9,
                    stream: 3,
                },
                TraceEvent::SegmentUnmap {
                    address: 8,
                    size: 9,
                    stream: 3,
                },
                TraceEvent::EmptyCache,
                TraceEvent::Oom {
                    size: 5,
                    stream: 3,
                    rounded: 512,
                    device_free: 7,
                },
                TraceEvent::PoolCreate {
                    pool: 5,
                    no_split: true,
                    use_on_oom: false,
                },
                TraceEvent::PoolEmptyCache { pool: 5 },
                TraceEvent::PoolRelease { pool: 5 },
            ],
            dropped: 0,
        };
        assert_eq!(Trace::from_json(&all.to_json()).expect("parses"), all);
        // A malloc of the allocator's own pools writes no `pool` (traces recorded before
        // private pools read the same), and reads back with pool 0.
        let own = Trace {
            events: vec![TraceEvent::Malloc {
                id: 1,
                size: 2,
                stream: 0,
                block_size: 512,
                address: 8,
                pool: 0,
            }],
            dropped: 0,
        };
        assert!(!own.to_json().contains("pool"), "{}", own.to_json());
        assert_eq!(Trace::from_json(&own.to_json()).expect("parses"), own);
        assert!(Trace::from_json(r#"{"events": [{"op": "pool_release"}]}"#).is_err());
    }

    /// Issue 33: `Trace::from_json_gz` had no cap at all; it stops at the byte cap now.
    #[test]
    fn an_in_memory_gzipped_trace_is_capped_too() {
        let path = scratch("in-memory.json.gz");
        sample().write_file(&path).expect("written");
        let bytes = std::fs::read(&path).expect("read");
        let json_len = serde_json::to_vec(&sample()).unwrap().len() as u64;
        assert_eq!(
            from_gz_slice(&bytes, json_len).expect("at the cap"),
            sample()
        );
        let err = from_gz_slice(&bytes, json_len - 1).expect_err("past the cap");
        assert!(err.to_string().contains("more than"), "{err}");
        let _ = std::fs::remove_file(&path);
    }
}
