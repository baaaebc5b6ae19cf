//! The IDX reader, the MNIST loader and the checksum check on small files these tests write
//! themselves; and the shipped `data/` against its `SHA256SUMS`.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;
use mnist::dataset::{
    CHECKSUMS_FILE, Checksums, DatasetError, MnistSet, Split, default_data_dir, sha256_hex,
};
use mnist::idx::{IdxError, read_idx};

/// A fresh empty folder under the target dir, unique per test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("mnist_idx")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch folder");
    dir
}

/// IDX bytes of unsigned bytes with the given dimensions and data.
fn idx_bytes(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    bytes
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).expect("gzip in memory");
    enc.finish().expect("gzip in memory")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write test file");
    path
}

/// Three 2x2 "images" with distinct pixels.
fn small_images() -> (Vec<u32>, Vec<u8>) {
    (vec![3, 2, 2], (0u8..12).collect())
}

#[test]
fn reads_a_plain_file() {
    let dir = scratch("plain");
    let (dims, data) = small_images();
    let path = write(&dir, "images", &idx_bytes(&dims, &data));
    let array = read_idx(&path, None).expect("valid file");
    assert_eq!(array.dims, vec![3, 2, 2]);
    assert_eq!(array.data, data);
    assert_eq!(array.len(), 3);
    assert_eq!(array.item_size(), 4);
}

#[test]
fn reads_a_gzip_file_whatever_its_name() {
    let dir = scratch("gz");
    let (dims, data) = small_images();
    let gz = gzip(&idx_bytes(&dims, &data));
    for name in ["images.gz", "images-without-extension"] {
        let path = write(&dir, name, &gz);
        let array = read_idx(&path, None).expect("valid gzip file");
        assert_eq!(array.dims, vec![3, 2, 2], "{name}");
        assert_eq!(array.data, data, "{name}");
    }
}

#[test]
fn limit_keeps_the_first_items_only() {
    let dir = scratch("limit");
    let (dims, data) = small_images();
    let path = write(&dir, "images.gz", &gzip(&idx_bytes(&dims, &data)));
    let array = read_idx(&path, Some(2)).expect("valid file");
    assert_eq!(array.dims, vec![2, 2, 2]);
    assert_eq!(array.data, (0u8..8).collect::<Vec<_>>());
    // A limit above the count reads everything.
    let array = read_idx(&path, Some(100)).expect("valid file");
    assert_eq!(array.dims, vec![3, 2, 2]);
    assert_eq!(array.data.len(), 12);
}

#[test]
fn truncated_data_names_the_file_and_the_sizes() {
    let dir = scratch("truncated");
    let (dims, data) = small_images();
    let path = write(&dir, "images", &idx_bytes(&dims, &data[..10]));
    let err = read_idx(&path, None).expect_err("truncated file");
    match &err {
        IdxError::Truncated {
            path: p,
            part,
            expected,
            found,
        } => {
            assert_eq!(p, &path);
            assert_eq!(*part, "data");
            assert_eq!((*expected, *found), (12, 10));
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
}

#[test]
fn truncated_header_and_dimensions_are_reported() {
    let dir = scratch("truncated_header");
    let path = write(&dir, "short", &[0, 0, 8]);
    assert!(matches!(
        read_idx(&path, None),
        Err(IdxError::Truncated {
            part: "header",
            expected: 4,
            found: 3,
            ..
        })
    ));
    // Announces 3 dimensions but holds one and a half.
    let path = write(&dir, "dims", &[0, 0, 8, 3, 0, 0, 0, 3, 0, 0]);
    assert!(matches!(
        read_idx(&path, None),
        Err(IdxError::Truncated {
            part: "dimensions",
            expected: 12,
            found: 6,
            ..
        })
    ));
    // An empty file.
    let path = write(&dir, "empty", &[]);
    assert!(matches!(
        read_idx(&path, None),
        Err(IdxError::Truncated {
            part: "header",
            found: 0,
            ..
        })
    ));
}

#[test]
fn truncated_gzip_stream_is_an_error_naming_the_file() {
    let dir = scratch("truncated_gz");
    let (dims, data) = small_images();
    let gz = gzip(&idx_bytes(&dims, &data));
    let path = write(&dir, "images.gz", &gz[..gz.len() / 2]);
    let err = read_idx(&path, None).expect_err("truncated gzip");
    assert!(
        matches!(err, IdxError::Truncated { .. } | IdxError::Read { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
}

#[test]
fn wrong_magic_is_rejected() {
    let dir = scratch("magic");
    let path = write(&dir, "not-idx", b"PK\x03\x04 this is a zip file");
    let err = read_idx(&path, None).expect_err("not an IDX file");
    match &err {
        IdxError::BadMagic { path: p, found } => {
            assert_eq!(p, &path);
            assert_eq!(found, b"PK\x03\x04");
        }
        other => panic!("expected BadMagic, got {other:?}"),
    }
    assert!(err.to_string().contains("not-idx"), "{err}");
}

#[test]
fn other_element_types_are_rejected() {
    let dir = scratch("dtype");
    // 0x0D = float32.
    let path = write(&dir, "floats", &[0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0]);
    assert!(matches!(
        read_idx(&path, None),
        Err(IdxError::UnsupportedType { code: 0x0d, .. })
    ));
}

#[test]
fn missing_file_names_the_file() {
    let dir = scratch("missing");
    let path = dir.join("nothing-here");
    let err = read_idx(&path, None).expect_err("missing file");
    assert!(matches!(err, IdxError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("nothing-here"), "{err}");
}

/// Writes a tiny MNIST split (28x28 images) into `dir`.
fn write_split(dir: &Path, split: Split, images: usize, labels: &[u8], gz: bool) {
    let (image_stem, label_stem) = split.file_stems();
    let pixels: Vec<u8> = (0..images * 784).map(|i| (i % 256) as u8).collect();
    let image_file = idx_bytes(&[images as u32, 28, 28], &pixels);
    let label_file = idx_bytes(&[labels.len() as u32], labels);
    if gz {
        write(dir, &format!("{image_stem}.gz"), &gzip(&image_file));
        write(dir, &format!("{label_stem}.gz"), &gzip(&label_file));
    } else {
        write(dir, image_stem, &image_file);
        write(dir, label_stem, &label_file);
    }
}

#[test]
fn loads_a_split_plain_or_gz() {
    for gz in [false, true] {
        let dir = scratch(if gz { "split_gz" } else { "split_plain" });
        write_split(&dir, Split::Test, 3, &[7, 2, 1], gz);
        let set = MnistSet::load(&dir, Split::Test, None).expect("valid split");
        assert_eq!(set.len(), 3);
        assert_eq!(set.labels, vec![7, 2, 1]);
        assert_eq!(set.images.len(), 3 * 784);
        let limited = MnistSet::load(&dir, Split::Test, Some(2)).expect("valid split");
        assert_eq!(limited.labels, vec![7, 2]);
        assert_eq!(limited.images, set.images[..2 * 784].to_vec());
    }
}

#[test]
fn normalized_pixels_use_mnist_mean_and_std() {
    let dir = scratch("normalize");
    write_split(&dir, Split::Test, 2, &[0, 9], false);
    let set = MnistSet::load(&dir, Split::Test, None).expect("valid split");
    let pixels = set.normalized_pixels(&[1]);
    assert_eq!(pixels.len(), 784);
    // Image 1 starts at byte 784 of the pattern: 784 % 256 = 16.
    let expected = (16.0 / 255.0 - 0.1307) / 0.3081;
    assert!((pixels[0] - expected).abs() < 1e-6, "{}", pixels[0]);
    assert_eq!(set.labels_of(&[1, 0]), vec![9, 0]);
}

#[test]
fn split_errors_name_the_files() {
    let dir = scratch("split_errors");
    match MnistSet::load(&dir, Split::Train, None) {
        Err(DatasetError::Missing { stem, .. }) => assert_eq!(stem, "train-images-idx3-ubyte"),
        other => panic!("expected Missing, got {other:?}"),
    }
    // Counts disagree.
    write_split(&dir, Split::Train, 3, &[1, 2], false);
    let err = MnistSet::load(&dir, Split::Train, None).expect_err("count mismatch");
    assert!(
        matches!(
            err,
            DatasetError::CountMismatch {
                images: 3,
                labels: 2,
                ..
            }
        ),
        "{err:?}"
    );
    // A label of 10.
    write_split(&dir, Split::Train, 2, &[1, 10], false);
    let err = MnistSet::load(&dir, Split::Train, None).expect_err("bad label");
    assert!(
        matches!(
            err,
            DatasetError::BadLabel {
                index: 1,
                label: 10,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("train-labels-idx1-ubyte"), "{err}");
    // Images that are not 28x28.
    let (image_stem, _) = Split::Train.file_stems();
    write(&dir, image_stem, &idx_bytes(&[2, 2, 2], &[0; 8]));
    let err = MnistSet::load(&dir, Split::Train, None).expect_err("wrong shape");
    assert!(
        matches!(err, DatasetError::Idx(IdxError::Shape { .. })),
        "{err:?}"
    );
}

/// `SHA256SUMS` text for the given files of `dir`, as `sha256sum` writes it.
fn sums_of(dir: &Path, names: &[&str]) -> String {
    names
        .iter()
        .map(|name| {
            let digest = sha256_hex(&dir.join(name)).expect("hash test file");
            format!("{digest}  {name}\n")
        })
        .collect()
}

#[test]
fn sha256_matches_known_digests() {
    let dir = scratch("sha256");
    let empty = write(&dir, "empty", b"");
    assert_eq!(
        sha256_hex(&empty).unwrap(),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    let abc = write(&dir, "abc", b"abc");
    assert_eq!(
        sha256_hex(&abc).unwrap(),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn loads_when_the_checksums_match() {
    let dir = scratch("sums_match");
    write_split(&dir, Split::Test, 3, &[7, 2, 1], true);
    let (images, labels) = Split::Test.file_stems();
    let (images, labels) = (format!("{images}.gz"), format!("{labels}.gz"));
    // A binary-mode marker and upper-case digits are accepted, as `sha256sum -c` accepts them.
    let images_digest = sha256_hex(&dir.join(&images)).unwrap();
    let labels_digest = sha256_hex(&dir.join(&labels)).unwrap().to_uppercase();
    let sums = format!("{images_digest} *{images}\n{labels_digest}  {labels}\n");
    write(&dir, CHECKSUMS_FILE, sums.as_bytes());
    let checksums = Checksums::read(&dir).expect("valid SHA256SUMS");
    assert_eq!(checksums.entries.len(), 2);
    let set = MnistSet::load(&dir, Split::Test, Some(2)).expect("checksums match");
    assert_eq!(set.labels, vec![7, 2]);
}

#[test]
fn a_checksum_mismatch_is_an_error_naming_the_file() {
    let dir = scratch("sums_mismatch");
    write_split(&dir, Split::Test, 3, &[7, 2, 1], true);
    let (images, labels) = Split::Test.file_stems();
    let (images, labels) = (format!("{images}.gz"), format!("{labels}.gz"));
    write(
        &dir,
        CHECKSUMS_FILE,
        sums_of(&dir, &[&images, &labels]).as_bytes(),
    );
    // The labels file changes after its checksum was taken: 7, 2, 1 becomes 7, 2, 3.
    write_split(&dir, Split::Test, 3, &[7, 2, 3], true);
    let err = MnistSet::load(&dir, Split::Test, None).expect_err("labels changed");
    match &err {
        DatasetError::ChecksumMismatch {
            path,
            expected,
            found,
            sums,
        } => {
            assert_eq!(path, &dir.join(&labels));
            assert_ne!(expected, found);
            assert_eq!(sums, &dir.join(CHECKSUMS_FILE));
        }
        other => panic!("expected ChecksumMismatch, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains(&labels), "{message}");
    assert!(message.contains(CHECKSUMS_FILE), "{message}");
    // Without the checksum file the same folder loads: the check is the file's, not the loader's.
    std::fs::remove_file(dir.join(CHECKSUMS_FILE)).unwrap();
    let set = MnistSet::load(&dir, Split::Test, None).expect("no checksums to check");
    assert_eq!(set.labels, vec![7, 2, 3]);
}

#[test]
fn files_the_checksums_do_not_list_load_unchecked() {
    let dir = scratch("sums_unlisted");
    write_split(&dir, Split::Test, 2, &[4, 5], false);
    write(
        &dir,
        CHECKSUMS_FILE,
        format!("{}  some-other-file\n", "0".repeat(64)).as_bytes(),
    );
    let set = MnistSet::load(&dir, Split::Test, None).expect("unlisted files are not checked");
    assert_eq!(set.labels, vec![4, 5]);
}

#[test]
fn malformed_checksum_lines_name_the_line() {
    let dir = scratch("sums_malformed");
    write_split(&dir, Split::Test, 2, &[4, 5], false);
    for (text, line) in [
        ("not-a-checksum\n", 1),
        ("# comment\n\nabc123  t10k-images-idx3-ubyte\n", 3),
        (&format!("{}  \n", "a".repeat(64)) as &str, 1),
    ] {
        write(&dir, CHECKSUMS_FILE, text.as_bytes());
        let err = MnistSet::load(&dir, Split::Test, None).expect_err("malformed SHA256SUMS");
        match &err {
            DatasetError::BadChecksumLine { path, line: l, .. } => {
                assert_eq!(path, &dir.join(CHECKSUMS_FILE));
                assert_eq!(*l, line, "{text:?}");
            }
            other => panic!("expected BadChecksumLine for {text:?}, got {other:?}"),
        }
        assert!(err.to_string().contains(CHECKSUMS_FILE), "{err}");
    }
}

/// The four files that ship in `data/` match their `SHA256SUMS`, and the loader reads both
/// splits from there (checked, with the full counts).
#[test]
fn shipped_data_matches_its_checksums() {
    let dir = default_data_dir();
    assert!(dir.ends_with("data"), "{}", dir.display());
    let checksums = Checksums::read(&dir).expect("data/SHA256SUMS is valid");
    assert_eq!(checksums.path, Some(dir.join(CHECKSUMS_FILE)));
    let mut listed: Vec<&str> = checksums.entries.iter().map(|(n, _)| n.as_str()).collect();
    listed.sort_unstable();
    assert_eq!(
        listed,
        [
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
            "train-images-idx3-ubyte.gz",
            "train-labels-idx1-ubyte.gz",
        ]
    );
    for (name, _) in &checksums.entries {
        checksums
            .verify(&dir.join(name))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let train = MnistSet::load(&dir, Split::Train, None).expect("shipped training set");
    let test = MnistSet::load(&dir, Split::Test, None).expect("shipped test set");
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
}
