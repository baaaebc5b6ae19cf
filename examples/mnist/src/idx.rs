//! Reader for the IDX format that MNIST ships in, plain or gzip-compressed.
//!
//! An IDX file is a 4-byte magic number (`0x00 0x00 <type> <ndims>`), `ndims`
//! big-endian `u32` dimension sizes, then the data in row-major order. MNIST
//! uses type `0x08` (unsigned bytes) only, which is all this reader accepts.
//! A file that starts with the gzip magic (`1f 8b`) is decompressed on the fly,
//! whatever its name.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

/// The IDX type code for unsigned bytes.
const TYPE_U8: u8 = 0x08;
/// The two bytes every gzip stream starts with.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Why an IDX file could not be read. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum IdxError {
    /// The file does not exist or cannot be opened.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// Reading failed part-way (I/O error or corrupt gzip stream).
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The file ended before the header or the data it announces.
    #[error("{} is truncated: expected {expected} bytes of {part}, found {found}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Which part was cut short ("header", "dimensions" or "data").
        part: &'static str,
        /// Bytes the header announced for that part.
        expected: u64,
        /// Bytes actually present.
        found: u64,
    },
    /// The first two bytes are not zero: not an IDX file.
    #[error("{} is not an IDX file: magic bytes {found:02x?}, expected [00, 00, 08, ndims]", path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The four bytes found.
        found: [u8; 4],
    },
    /// An IDX element type other than unsigned bytes.
    #[error("{} holds IDX element type 0x{code:02x}; only unsigned bytes (0x08) are supported", path.display())]
    UnsupportedType {
        /// The file.
        path: PathBuf,
        /// The type code found.
        code: u8,
    },
    /// A valid IDX file whose shape is not what the caller needs.
    #[error("{} has shape {found:?}; expected {expected}", path.display())]
    Shape {
        /// The file.
        path: PathBuf,
        /// What the caller needed, in words.
        expected: String,
        /// The dimensions found.
        found: Vec<usize>,
    },
}

/// An IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimension sizes; the first is the number of items. When the array was
    /// read with a limit, the first dimension is the number of items kept.
    pub dims: Vec<usize>,
    /// The items, row-major.
    pub data: Vec<u8>,
}

impl IdxArray {
    /// Number of items (the first dimension).
    pub fn len(&self) -> usize {
        self.dims.first().copied().unwrap_or(0)
    }

    /// Whether the array holds no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per item (product of the dimensions after the first).
    pub fn item_size(&self) -> usize {
        self.dims.iter().skip(1).product()
    }
}

/// Reads an IDX file of unsigned bytes, plain or gzip-compressed.
///
/// With `limit = Some(n)`, only the first `n` items are read (the rest of the
/// file is not decompressed); the file must still hold those `n` items.
pub fn read_idx(path: &Path, limit: Option<usize>) -> Result<IdxArray, IdxError> {
    let file = File::open(path).map_err(|source| IdxError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let mut first = [0u8; 2];
    let got = read_up_to(&mut reader, &mut first, path)?;
    let prefix = io::Cursor::new(first[..got].to_vec());
    if got == 2 && first == GZIP_MAGIC {
        let stream = GzDecoder::new(prefix.chain(reader));
        read_idx_from(stream, path, limit)
    } else {
        read_idx_from(prefix.chain(reader), path, limit)
    }
}

/// Reads an IDX array from any byte stream; `path` only names it in errors.
pub fn read_idx_from<R: Read>(
    mut reader: R,
    path: &Path,
    limit: Option<usize>,
) -> Result<IdxArray, IdxError> {
    let mut magic = [0u8; 4];
    let got = read_up_to(&mut reader, &mut magic, path)?;
    if got >= 2 && (magic[0] != 0 || magic[1] != 0) {
        return Err(IdxError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
        });
    }
    if got < 4 {
        return Err(IdxError::Truncated {
            path: path.to_path_buf(),
            part: "header",
            expected: 4,
            found: got as u64,
        });
    }
    if magic[2] != TYPE_U8 {
        return Err(IdxError::UnsupportedType {
            path: path.to_path_buf(),
            code: magic[2],
        });
    }
    let ndims = usize::from(magic[3]);
    let mut raw_dims = vec![0u8; ndims * 4];
    let got = read_up_to(&mut reader, &mut raw_dims, path)?;
    if got < raw_dims.len() {
        return Err(IdxError::Truncated {
            path: path.to_path_buf(),
            part: "dimensions",
            expected: raw_dims.len() as u64,
            found: got as u64,
        });
    }
    let mut dims: Vec<usize> = raw_dims
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    if let (Some(n), Some(first)) = (limit, dims.first_mut()) {
        *first = (*first).min(n);
    }
    let total = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| IdxError::Shape {
            path: path.to_path_buf(),
            expected: "dimensions whose product fits in memory".into(),
            found: dims.clone(),
        })?;
    let mut data = Vec::new();
    let got = (&mut reader)
        .take(total as u64)
        .read_to_end(&mut data)
        .map_err(|source| IdxError::Read {
            path: path.to_path_buf(),
            source,
        })?;
    if got < total {
        return Err(IdxError::Truncated {
            path: path.to_path_buf(),
            part: "data",
            expected: total as u64,
            found: got as u64,
        });
    }
    Ok(IdxArray { dims, data })
}

/// Fills `buf` as far as the stream allows; returns how many bytes were read.
fn read_up_to<R: Read>(reader: &mut R, buf: &mut [u8], path: &Path) -> Result<usize, IdxError> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(IdxError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
    Ok(filled)
}
