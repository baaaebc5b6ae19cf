//! Trace files: a [`Trace`] as JSON on disk, gzipped when the file name ends in `.gz`.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;

use super::trace::Trace;

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

impl Trace {
    /// Reads the trace in `path`: JSON, or gzipped JSON when the name ends in `.gz`.
    pub fn read_file(path: &Path) -> Result<Self, TraceFileError> {
        let file = File::open(path).map_err(|source| TraceFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let reader: Box<dyn Read> = if gzipped(path) {
            Box::new(GzDecoder::new(BufReader::new(file)))
        } else {
            Box::new(BufReader::new(file))
        };
        Trace::read_json(reader).map_err(|source| TraceFileError::Json {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the trace to `path`: JSON, gzipped when the name ends in `.gz`.
    pub fn write_file(&self, path: &Path) -> Result<(), TraceFileError> {
        let io = |source| TraceFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let json = |source| TraceFileError::Json {
            path: path.to_path_buf(),
            source,
        };
        let file = BufWriter::new(File::create(path).map_err(io)?);
        let mut file = if gzipped(path) {
            let mut encoder = GzEncoder::new(file, Compression::best());
            self.write_json(&mut encoder).map_err(json)?;
            encoder.finish().map_err(io)?
        } else {
            let mut file = file;
            self.write_json(&mut file).map_err(json)?;
            file
        };
        file.flush().map_err(io)
    }

    /// Decodes a gzipped JSON trace held in memory (an embedded trace file).
    pub fn from_json_gz(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        Trace::read_json(GzDecoder::new(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::TraceEvent;

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
}
