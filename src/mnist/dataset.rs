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
    pub fn load(dir: &Path, split: Split, limit: Option<usize>) -> Result<Self, DatasetError> {
        let (image_stem, label_stem) = split.file_stems();
        let images_path = find_file(dir, image_stem)?;
        let labels_path = find_file(dir, label_stem)?;
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

/// The shared MNIST folder beside a checkout: `<manifest dir>/../shared/data/mnist`,
/// if it exists.
pub fn default_data_dir(manifest_dir: &Path) -> Option<PathBuf> {
    let dir = manifest_dir
        .join("..")
        .join("shared")
        .join("data")
        .join("mnist");
    dir.is_dir().then_some(dir)
}
