//! The MNIST training and test sets, loaded from the four IDX files.

use std::path::{Path, PathBuf};

use super::idx::{IdxError, read_idx};

/// Pixels per image (28 x 28).
pub const IMAGE_PIXELS: usize = 28 * 28;
/// Side of an image in pixels.
pub const IMAGE_SIDE: usize = 28;
/// Number of classes (digits 0 to 9).
pub const NUM_CLASSES: usize = 10;

/// Which half of MNIST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// 60,000 training images.
    Train,
    /// 10,000 test images.
    Test,
}

impl Split {
    /// File names without `.gz`, images then labels.
    pub fn file_stems(self) -> (&'static str, &'static str) {
        match self {
            Split::Train => ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            Split::Test => ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        }
    }
}

/// Why MNIST could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// Neither `stem` nor `stem.gz` exists in the folder.
    #[error("MNIST file {stem} (or {stem}.gz) not found in {}", dir.display())]
    Missing {
        /// The folder searched.
        dir: PathBuf,
        /// The file name searched for.
        stem: &'static str,
    },
    /// A file's SHA-256 differs from the one its folder's `SHA256SUMS` lists.
    #[error("{} is corrupt: its SHA-256 is {found}, but {} lists {expected}", path.display(), sums.display())]
    ChecksumMismatch {
        /// The data file.
        path: PathBuf,
        /// The checksum listed.
        expected: String,
        /// The checksum of the file's bytes.
        found: String,
        /// The checksum file.
        sums: PathBuf,
    },
    /// A line of `SHA256SUMS` that is not `<sha256>  <file name>`.
    #[error("{} line {line}: {reason}", path.display())]
    BadChecksumLine {
        /// The checksum file.
        path: PathBuf,
        /// Line number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A checksum or data file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A file exists but is not a readable IDX file of the right shape.
    #[error(transparent)]
    Idx(#[from] IdxError),
    /// The images and labels files disagree on the number of items.
    #[error("{} holds {images} images but {} holds {labels} labels", images_path.display(), labels_path.display())]
    CountMismatch {
        /// The images file.
        images_path: PathBuf,
        /// Number of images.
        images: usize,
        /// The labels file.
        labels_path: PathBuf,
        /// Number of labels.
        labels: usize,
    },
    /// A label outside 0..=9.
    #[error("{} holds label {label} at index {index}; MNIST labels are 0 to 9", path.display())]
    BadLabel {
        /// The labels file.
        path: PathBuf,
        /// Position of the bad label.
        index: usize,
        /// The value found.
        label: u8,
    },
}

/// One split of MNIST held in memory: raw pixels (0 to 255) and labels.
#[derive(Debug, Clone)]
pub struct MnistSet {
    /// `len() * IMAGE_PIXELS` bytes, one image after another.
    pub images: Vec<u8>,
    /// One label (0 to 9) per image.
    pub labels: Vec<u8>,
}

impl MnistSet {
    /// Loads a split from `dir`, which holds the IDX files plain or `.gz`.
    /// With `limit = Some(n)` only the first `n` items are read.
    ///
    /// When `dir` has a `SHA256SUMS` file (the shipped [`default_data_dir`] does), every file
    /// it lists is checked before use, whole, whatever the limit: a mismatch is
    /// [`DatasetError::ChecksumMismatch`], naming the file.
    pub fn load(dir: &Path, split: Split, limit: Option<usize>) -> Result<Self, DatasetError> {
        let (image_stem, label_stem) = split.file_stems();
        let images_path = find_file(dir, image_stem)?;
        let labels_path = find_file(dir, label_stem)?;
        let checksums = Checksums::read(dir)?;
        checksums.verify(&images_path)?;
        checksums.verify(&labels_path)?;
        let images = read_idx(&images_path, limit)?;
        if images.dims.len() != 3 || images.dims[1] != IMAGE_SIDE || images.dims[2] != IMAGE_SIDE {
            return Err(IdxError::Shape {
                path: images_path,
                expected: format!("[n, {IMAGE_SIDE}, {IMAGE_SIDE}]"),
                found: images.dims,
            }
            .into());
        }
        let labels = read_idx(&labels_path, limit)?;
        if labels.dims.len() != 1 {
            return Err(IdxError::Shape {
                path: labels_path,
                expected: "[n]".into(),
                found: labels.dims,
            }
            .into());
        }
        if labels.len() != images.len() {
            return Err(DatasetError::CountMismatch {
                images_path,
                images: images.len(),
                labels_path,
                labels: labels.len(),
            });
        }
        if let Some((index, &label)) = labels
            .data
            .iter()
            .enumerate()
            .find(|(_, l)| usize::from(**l) >= NUM_CLASSES)
        {
            return Err(DatasetError::BadLabel {
                path: labels_path,
                index,
                label,
            });
        }
        Ok(Self {
            images: images.data,
            labels: labels.data,
        })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Normalised pixels of the given items, `indices.len() * IMAGE_PIXELS`
    /// values, with MNIST's usual mean 0.1307 and standard deviation 0.3081.
    pub fn normalized_pixels(&self, indices: &[usize]) -> Vec<f32> {
        let mut out = Vec::with_capacity(indices.len() * IMAGE_PIXELS);
        for &i in indices {
            let image = &self.images[i * IMAGE_PIXELS..(i + 1) * IMAGE_PIXELS];
            out.extend(
                image
                    .iter()
                    .map(|&p| (f32::from(p) / 255.0 - 0.1307) / 0.3081),
            );
        }
        out
    }

    /// Labels of the given items.
    pub fn labels_of(&self, indices: &[usize]) -> Vec<i64> {
        indices.iter().map(|&i| i64::from(self.labels[i])).collect()
    }
}

/// `dir/stem` if it exists, else `dir/stem.gz`.
fn find_file(dir: &Path, stem: &'static str) -> Result<PathBuf, DatasetError> {
    let plain = dir.join(stem);
    if plain.is_file() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{stem}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(DatasetError::Missing {
        dir: dir.to_path_buf(),
        stem,
    })
}

/// The folder the four MNIST files ship in: this crate's `data/`, with their `SHA256SUMS`.
pub fn default_data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data")
}

/// The checksum file [`MnistSet::load`] checks files against when the folder has one.
pub const CHECKSUMS_FILE: &str = "SHA256SUMS";

/// The `SHA256SUMS` of a folder, as `sha256sum` writes it: one `<64 hex digits>  <name>` a
/// line (a `*` before the name, binary mode, is accepted too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checksums {
    /// The checksum file read; `None` when the folder has none.
    pub path: Option<PathBuf>,
    /// File name and expected SHA-256 (lower-case hex), in file order.
    pub entries: Vec<(String, String)>,
}

impl Checksums {
    /// Reads `dir/SHA256SUMS`; a folder without one gives an empty list (nothing to check).
    pub fn read(dir: &Path) -> Result<Self, DatasetError> {
        let path = dir.join(CHECKSUMS_FILE);
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|source| DatasetError::Read {
            path: path.clone(),
            source,
        })?;
        let mut entries = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim_end();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: &str| DatasetError::BadChecksumLine {
                path: path.clone(),
                line: index + 1,
                reason: reason.to_string(),
            };
            let (digest, name) = line
                .split_once(char::is_whitespace)
                .ok_or_else(|| bad("expected `<sha256>  <file name>`"))?;
            if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad("the checksum is not 64 hexadecimal digits"));
            }
            let name = name.trim_start();
            let name = name.strip_prefix('*').unwrap_or(name);
            if name.is_empty() {
                return Err(bad("no file name after the checksum"));
            }
            entries.push((name.to_string(), digest.to_ascii_lowercase()));
        }
        Ok(Self {
            path: Some(path),
            entries,
        })
    }

    /// The expected SHA-256 of the file called `name`, if listed.
    pub fn expected(&self, name: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, d)| d.as_str())
    }

    /// Checks `file` against its line, if it has one; a file the list does not name passes
    /// (a folder may hold files the checksums do not cover, such as decompressed copies).
    pub fn verify(&self, file: &Path) -> Result<(), DatasetError> {
        let (Some(sums), Some(name)) = (&self.path, file.file_name().and_then(|n| n.to_str()))
        else {
            return Ok(());
        };
        let Some(expected) = self.expected(name) else {
            return Ok(());
        };
        let found = sha256_hex(file)?;
        if found == expected {
            Ok(())
        } else {
            Err(DatasetError::ChecksumMismatch {
                path: file.to_path_buf(),
                expected: expected.to_string(),
                found,
                sums: sums.clone(),
            })
        }
    }
}

/// The SHA-256 of a file's bytes, as lower-case hex.
pub fn sha256_hex(path: &Path) -> Result<String, DatasetError> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let read_error = |source| DatasetError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_error)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_error(e)),
        };
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
