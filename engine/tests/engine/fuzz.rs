//! Input fuzzing without nightly: property tests that feed arbitrary bytes and structured
//! hostile input to every reader of outside data in the library (the configuration string,
//! trace files plain and gzipped, snapshots read back, the viewer and pickle writers and the
//! memory report over them) and assert an error or a result, never a panic (issue 33).
//!
//! `PROPTEST_CASES` sets the cases per property (default 256). The host memory of the trace
//! reader is measured apart, in the `trace_memory` test binary (a counting allocator).

use std::io::Write;

use caching_alloc_engine::alloc::inspect::{ViewerLayer, torch_snapshot_pickle, viewer_html};
use caching_alloc_engine::alloc::{
    AllocatorConfig, CachingAllocator, MemoryPoint, MemoryReport, Snapshot, Trace, TraceEvent,
};
use caching_alloc_engine::device::sim::SimDevice;
use flate2::Compression;
use flate2::write::GzEncoder;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use serde_json::{Value, json};

use crate::common::{MIB, S0, allocator};

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

/// Keys the parser knows, some it refuses, and nonsense.
fn config_key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("max_split_size_mb".to_string()),
        Just("max_non_split_rounding_mb".to_string()),
        Just("garbage_collection_threshold".to_string()),
        Just("roundup_power2_divisions".to_string()),
        Just("per_process_memory_fraction".to_string()),
        Just("record_history".to_string()),
        Just("history_capacity".to_string()),
        Just("expandable_segments".to_string()),
        Just("segment_sizing".to_string()),
        Just("pool_borrowing".to_string()),
        Just("release_lock_on_cudamalloc".to_string()),
        "[a-z_]{0,12}",
    ]
}

/// Values at the edges: huge and negative numbers, subnormals, NaN, brackets, booleans.
fn config_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        Just("1e-320".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("18446744073709551616".to_string()),
        Just("True".to_string()),
        Just("False".to_string()),
        Just("grow".to_string()),
        prop::collection::vec(("[0-9>]{1,6}", "[0-9]{1,6}"), 0..5).prop_map(|pairs| {
            let items: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect();
            format!("[{}]", items.join(","))
        }),
        "[\\[\\]:,0-9a-z>. ]{0,16}",
    ]
}

fn config_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,64}",
        prop::collection::vec((config_key(), config_value()), 0..6).prop_map(|items| {
            items
                .iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect::<Vec<_>>()
                .join(",")
        }),
    ]
}

/// A value of any JSON type, numbers at their edges included.
fn json_scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{0,10}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An event: a real op (or not) with fields of the format's names, of any type or missing.
fn trace_event() -> impl Strategy<Value = Value> {
    let op = prop_oneof![
        Just("malloc"),
        Just("free_requested"),
        Just("free_completed"),
        Just("record_stream"),
        Just("segment_alloc"),
        Just("segment_free"),
        Just("segment_map"),
        Just("segment_unmap"),
        Just("empty_cache"),
        Just("oom"),
        Just("teleport"),
    ];
    let field = prop_oneof![
        Just("id"),
        Just("size"),
        Just("stream"),
        Just("block_size"),
        Just("address"),
        Just("rounded"),
        Just("device_free"),
        Just("junk"),
    ];
    let number = prop_oneof![
        3 => any::<u64>().prop_map(Value::from),
        1 => json_value(),
    ];
    (op, prop::collection::vec((field, number), 0..8)).prop_map(|(op, fields)| {
        let mut event = serde_json::Map::new();
        event.insert("op".into(), Value::from(op));
        for (name, value) in fields {
            event.insert(name.into(), value);
        }
        Value::Object(event)
    })
}

fn trace_json() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(trace_event(), 0..12),
        prop_oneof![any::<u64>().prop_map(Value::from), json_value()],
    )
        .prop_map(|(events, dropped)| json!({"events": events, "dropped": dropped}))
}

/// A snapshot of a real allocator, as JSON, with `edits` applied: any field path set to any
/// value (so allocated may exceed reserved, blocks may lie outside their segment, ...).
fn edited_snapshot(edits: &[(Vec<usize>, Value)]) -> Value {
    let (alloc, _device) = allocator(64 * MIB, "");
    let live: Vec<_> = [1000u64, 3 * MIB, 700]
        .iter()
        .map(|&size| alloc.malloc(size, S0).expect("fits"))
        .collect();
    let mut snapshot = serde_json::to_value(alloc.snapshot()).expect("serialises");
    for (path, value) in edits {
        let mut at = &mut snapshot;
        for &step in path {
            let len = match &*at {
                Value::Object(map) => map.len(),
                Value::Array(list) => list.len(),
                _ => 0,
            };
            if len == 0 {
                break;
            }
            at = match at {
                Value::Object(map) => map.values_mut().nth(step % len).expect("in range"),
                Value::Array(list) => &mut list[step % len],
                _ => unreachable!("only containers have a length"),
            };
        }
        *at = value.clone();
    }
    for block in live {
        alloc.free(block).expect("live");
    }
    snapshot
}

/// Everything the library does with a snapshot read from outside: the viewer, PyTorch's
/// pickle, the memory report and its text, JSON back.
fn use_snapshot(snapshot: Snapshot) {
    let layers = [ViewerLayer {
        name: "<!--<script>".into(),
        bytes: u64::MAX,
    }];
    let page = viewer_html(&snapshot, "</script><!--", &layers);
    assert!(page.ends_with("</html>\n"));
    let pickle = torch_snapshot_pickle(&snapshot, 3);
    assert!(!pickle.is_empty());
    let _ = snapshot.to_json_pretty();
    let _ = snapshot.stats.cached_in_engine();
    let _ = snapshot.stats.to_map();
    let edge = MemoryPoint::with_layer_above(snapshot.clone(), u64::MAX, u64::MAX);
    let _ = edge.cached_in_engine();
    let engine = MemoryPoint::of_engine(snapshot);
    for (before, now) in [(&edge, &engine), (&engine, &edge), (&engine, &engine)] {
        let report = MemoryReport::between(before, now);
        let _ = report.to_string();
        let _ = report.verdict();
    }
    let _ = MemoryReport::at(&edge).to_string();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    /// The configuration string: an error or a configuration the allocator starts with.
    #[test]
    fn any_configuration_string_is_an_error_or_a_configuration_that_starts(text in config_text()) {
        if let Ok(config) = AllocatorConfig::parse(&text) {
            prop_assert!(config.validate().is_ok(), "{text}: parsed but invalid");
            // A device without virtual memory may refuse expandable segments: an error.
            let _ = CachingAllocator::new(SimDevice::new(64 * MIB), config);
        }
    }

    /// Arbitrary bytes as a trace: plain JSON, gzipped in memory, and files of both kinds.
    #[test]
    fn any_bytes_are_an_error_or_a_trace(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Trace::from_json(&String::from_utf8_lossy(&bytes));
        let _ = Trace::from_json_gz(&bytes);
        let _ = Trace::from_json_gz(&gzip(&bytes));
        let dir = std::env::temp_dir().join(format!("fuzz-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch");
        let id = std::thread::current().id();
        for (name, contents) in [("t.json", bytes.clone()), ("t.json.gz", bytes.clone()), ("z.json.gz", gzip(&bytes))] {
            let path = dir.join(format!("{id:?}-{name}"));
            std::fs::write(&path, &contents).expect("written");
            let _ = Trace::read_file(&path);
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Structured hostile traces: real ops with fields missing, of the wrong type, at the
    /// edges of u64. Whatever parses writes back and reads back as itself.
    #[test]
    fn hostile_traces_are_an_error_or_a_trace_that_round_trips(json in trace_json()) {
        let text = json.to_string();
        let plain = Trace::from_json(&text);
        let packed = Trace::from_json_gz(&gzip(text.as_bytes()));
        prop_assert_eq!(plain.is_ok(), packed.is_ok());
        if let (Ok(plain), Ok(packed)) = (plain, packed) {
            prop_assert_eq!(&plain, &packed);
            let back = Trace::from_json(&plain.to_json()).expect("what parsed writes back");
            prop_assert_eq!(&back, &plain);
            let _ = plain.operations().filter(|e| matches!(e, TraceEvent::Malloc { .. })).count();
        }
    }

    /// Snapshots read back: arbitrary JSON, and real snapshots with any field changed, go
    /// through the viewer, the pickle writer and the report without a panic.
    #[test]
    fn hostile_snapshots_are_an_error_or_render(
        json in json_value(),
        edits in prop::collection::vec((prop::collection::vec(any::<usize>(), 0..6), json_scalar()), 1..4),
    ) {
        if let Ok(snapshot) = serde_json::from_value::<Snapshot>(json) {
            use_snapshot(snapshot);
        }
        let edited = edited_snapshot(&edits);
        if let Ok(snapshot) = serde_json::from_value::<Snapshot>(edited) {
            use_snapshot(snapshot);
        }
    }
}

/// One fixed hostile snapshot (the finding of issue 33): allocated beyond reserved, which the
/// viewer subtracted unchecked (a panic in a debug build).
#[test]
fn a_snapshot_with_more_allocated_than_reserved_renders() {
    let mut json = edited_snapshot(&[]);
    json["stats"]["allocated_bytes"]["all"]["current"] = json!(u64::MAX);
    json["stats"]["reserved_bytes"]["all"]["current"] = json!(0);
    let snapshot: Snapshot = serde_json::from_value(json).expect("a snapshot");
    use_snapshot(snapshot);
}
