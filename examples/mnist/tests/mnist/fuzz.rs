//! The IDX reader fed arbitrary bytes and hostile headers, plain and gzipped (issue 33):
//! an error or an array whose size matches its header, never a panic. `PROPTEST_CASES` sets
//! the cases per property (default 256).

use std::io::Write;
use std::path::Path;

use flate2::Compression;
use flate2::write::GzEncoder;
use mnist::idx::{read_idx, read_idx_from};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    encoder.write_all(bytes).expect("in memory");
    encoder.finish().expect("in memory")
}

/// A header with any type code and dimension count, dimensions at the edges of u32, and a
/// body shorter or longer than they say.
fn hostile_idx() -> impl Strategy<Value = Vec<u8>> {
    let dim = prop_oneof![0u32..4, Just(u32::MAX), Just(1 << 31), any::<u32>()];
    (
        prop_oneof![Just(8u8), any::<u8>()],
        prop::collection::vec(dim, 0..5),
        prop::collection::vec(any::<u8>(), 0..64),
        any::<bool>(),
    )
        .prop_map(|(code, dims, body, zero_magic)| {
            let mut bytes = vec![if zero_magic { 0 } else { 1 }, 0, code, dims.len() as u8];
            for d in dims {
                bytes.extend_from_slice(&d.to_be_bytes());
            }
            bytes.extend_from_slice(&body);
            bytes
        })
}

/// Reads `bytes` every way the crate reads a file, and checks what comes back.
fn read_every_way(bytes: &[u8], limit: Option<usize>) {
    let name = Path::new("fuzz.idx");
    for stream in [bytes.to_vec(), gzip(bytes)] {
        if let Ok(array) = read_idx_from(stream.as_slice(), name, limit)
            && stream == bytes
        {
            assert_eq!(array.data.len(), array.dims.iter().product::<usize>());
        }
    }
    let dir = std::env::temp_dir().join(format!("mnist-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch");
    let id = std::thread::current().id();
    for (suffix, contents) in [("plain", bytes.to_vec()), ("gz", gzip(bytes))] {
        let path = dir.join(format!("{id:?}-{suffix}"));
        std::fs::write(&path, contents).expect("written");
        if let Ok(array) = read_idx(&path, limit) {
            assert_eq!(array.data.len(), array.dims.iter().product::<usize>());
        }
        let _ = std::fs::remove_file(&path);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_bytes_are_an_error_or_an_array(bytes in prop::collection::vec(any::<u8>(), 0..256), limit in prop::option::of(0usize..8)) {
        read_every_way(&bytes, limit);
    }

    #[test]
    fn hostile_headers_are_an_error_or_an_array_of_their_size(bytes in hostile_idx(), limit in prop::option::of(0usize..8)) {
        read_every_way(&bytes, limit);
    }
}
