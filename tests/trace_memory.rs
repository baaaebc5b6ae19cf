//! The host memory a trace read takes, measured by a counting global allocator (a binary of
//! its own, so that no other test's allocations count): hostile files cost about what their
//! JSON holds, never a multiple of it.
//!
//! Issue 33: serde's internally tagged `TraceEvent` buffered every field of an event before it
//! read the tag (an unknown field holding an array of zeros cost ~32 bytes a value, 16 times
//! its JSON), `Trace::read_file` held the whole decompressed file besides, and
//! `Trace::from_json_gz` had no cap: a 4 MiB `.json.gz` could make the host allocate 64 GiB.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn_caching_alloc::alloc::Trace;
use flate2::Compression;
use flate2::write::GzEncoder;

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's layout; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as given.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as given.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One measurement at a time (libtest runs tests on several threads).
static TURN: Mutex<()> = Mutex::new(());

/// The peak of live host bytes above what was live before, while `work` runs.
fn peak_during<T>(work: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = work();
    (out, PEAK.load(Ordering::Relaxed) - base)
}

fn gzip(json: &[u8]) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::best());
    encoder.write_all(json).expect("in memory");
    encoder.finish().expect("in memory")
}

/// A malloc event with an unknown field holding `zeros` zeros: `2 * zeros` bytes of JSON.
fn hostile_event(zeros: usize) -> Vec<u8> {
    let mut json = Vec::with_capacity(2 * zeros + 200);
    json.extend_from_slice(br#"{"events": [{"junk": ["#);
    for i in 0..zeros {
        if i > 0 {
            json.push(b',');
        }
        json.push(b'0');
    }
    json.extend_from_slice(
        br#"], "op": "malloc", "id": 1, "size": 1, "stream": 0, "block_size": 512, "address": 0}]}"#,
    );
    json
}

const MIB: usize = 1 << 20;

#[test]
fn an_unknown_field_of_millions_of_values_costs_no_more_than_the_event() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let zeros = 8 << 20;
    let json = hostile_event(zeros);
    let gz = gzip(&json);
    drop(json);
    // 16 MiB of JSON in a few KiB of gzip; before, reading it buffered 8 Mi values of 32 B.
    assert!(gz.len() < 64 * 1024, "{} bytes of gzip", gz.len());
    let (trace, peak) = peak_during(|| Trace::from_json_gz(&gz));
    let trace = trace.expect("a valid trace with an unknown field");
    assert_eq!(trace.events.len(), 1);
    assert!(peak < MIB, "from_json_gz peaked at {peak} bytes");

    let dir = std::env::temp_dir().join(format!("trace-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch");
    let path = dir.join("hostile.json.gz");
    std::fs::write(&path, &gz).expect("written");
    let (trace, peak) = peak_during(|| Trace::read_file(&path));
    assert_eq!(trace.expect("valid").events.len(), 1);
    assert!(peak < MIB, "read_file peaked at {peak} bytes");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn deep_nesting_long_keys_and_many_events_cost_at_most_a_few_times_their_json() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    // An unknown field nested a million deep (serde_json skips it with one byte a level).
    let depth = 1 << 20;
    let mut nested = br#"{"events": [], "junk": "#.to_vec();
    nested.extend(std::iter::repeat_n(b'[', depth));
    nested.extend(std::iter::repeat_n(b']', depth));
    nested.push(b'}');
    cases.push(("nested", nested));
    // A 4 MiB unknown key.
    let mut key = br#"{"events": [], ""#.to_vec();
    key.extend(std::iter::repeat_n(b'k', 4 * MIB));
    key.extend_from_slice(br#"": 1}"#);
    cases.push(("long key", key));
    // The shortest events there are, a million of them.
    let mut many = br#"{"events": ["#.to_vec();
    for i in 0..(1 << 20) {
        if i > 0 {
            many.push(b',');
        }
        many.extend_from_slice(br#"{"op":"empty_cache"}"#);
    }
    many.extend_from_slice(b"]}");
    cases.push(("many events", many));
    for (name, json) in cases {
        let gz = gzip(&json);
        let (_result, peak) = peak_during(|| Trace::from_json_gz(&gz));
        assert!(
            peak <= 6 * json.len() + MIB,
            "{name}: {peak} bytes for {} bytes of JSON",
            json.len()
        );
    }
}
