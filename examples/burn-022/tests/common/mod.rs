//! MNIST for the integration tests: the gzipped IDX files the repository ships
//! (`examples/mnist/data/`), read with flate2; the images only as far as the first `n`.

#![allow(dead_code)]

use std::path::PathBuf;

/// Pixels per image (28 x 28).
pub const IMAGE_PIXELS: usize = 28 * 28;

/// The first `n` training images and their labels.
pub struct Mnist {
    /// `n * IMAGE_PIXELS` bytes, row-major, one image after another.
    pub images: Vec<u8>,
    /// `n` digits, 0 to 9.
    pub labels: Vec<u8>,
}

impl Mnist {
    /// Images `start..start + count` as `f32` in [0, 1], row-major `[count, IMAGE_PIXELS]`.
    pub fn images_f32(&self, start: usize, count: usize) -> Vec<f32> {
        self.images[start * IMAGE_PIXELS..(start + count) * IMAGE_PIXELS]
            .iter()
            .map(|&p| f32::from(p) / 255.0)
            .collect()
    }

    /// Labels `start..start + count` as `i64`.
    pub fn labels_i64(&self, start: usize, count: usize) -> Vec<i64> {
        self.labels[start..start + count]
            .iter()
            .map(|&l| i64::from(l))
            .collect()
    }
}

/// Where the gzipped IDX files are: `$MNIST_DATA_DIR`, else `examples/mnist/data/`.
pub fn data_dir() -> PathBuf {
    match std::env::var_os("MNIST_DATA_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../mnist/data"),
    }
}

/// The first `n` images and labels of MNIST's training set.
///
/// # Panics
///
/// When a file is missing, corrupt, or holds fewer than `n` items.
pub fn load_train(n: usize) -> Mnist {
    let dir = data_dir();
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()))
    };

    let labels_gz = read("train-labels-idx1-ubyte.gz");
    let labels = gunzip(&labels_gz, None).expect("train-labels-idx1-ubyte.gz");
    let labels = idx_u8(&labels, 0x0801, &[], n, "train-labels-idx1-ubyte.gz");

    let images_gz = read("train-images-idx3-ubyte.gz");
    let wanted = 16 + n * IMAGE_PIXELS;
    let images = gunzip(&images_gz, Some(wanted)).expect("train-images-idx3-ubyte.gz");
    let images = idx_u8(&images, 0x0803, &[28, 28], n, "train-images-idx3-ubyte.gz");

    assert!(labels.iter().all(|&l| l < 10), "a label outside 0..10");
    Mnist { images, labels }
}

/// The first `n` items of an IDX file of unsigned bytes whose magic is `magic` and whose
/// dimensions after the first are `item_dims`.
fn idx_u8(bytes: &[u8], magic: u32, item_dims: &[u32], n: usize, name: &str) -> Vec<u8> {
    let word = |i: usize| {
        let b = bytes
            .get(4 * i..4 * i + 4)
            .unwrap_or_else(|| panic!("{name}: header truncated"));
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    };
    assert_eq!(word(0), magic, "{name}: IDX magic");
    let count = word(1) as usize;
    assert!(count >= n, "{name}: {count} items, {n} wanted");
    for (i, &dim) in item_dims.iter().enumerate() {
        assert_eq!(word(2 + i), dim, "{name}: dimension {}", i + 1);
    }
    let header = 4 * (2 + item_dims.len());
    let item: usize = item_dims.iter().map(|&d| d as usize).product();
    let end = header + n * item;
    assert!(
        bytes.len() >= end,
        "{name}: {} bytes, {end} needed",
        bytes.len()
    );
    bytes[header..end].to_vec()
}

/// Decompresses a gzip file (flate2 checks its CRC-32 and length when read whole). With
/// `limit`, stops after the first `limit` bytes.
pub fn gunzip(gz: &[u8], limit: Option<usize>) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut decoder = flate2::read::GzDecoder::new(gz);
    let mut out = Vec::new();
    let read = match limit {
        Some(limit) => decoder.take(limit as u64).read_to_end(&mut out),
        None => decoder.read_to_end(&mut out),
    };
    read.map(|_| out).map_err(|err| err.to_string())
}
