//! PyTorch-format snapshots (`CachingAllocator::dump_snapshot`), read back by Python's own
//! `pickle` and checked against every rule of MEMORY_VIZ.md by `check_torch_snapshot.py`
//! (PyTorch's `_dump_snapshot` format, `_memory_viz.py stats`' identity, MemoryViz.js's
//! backward replay), and the history entries' PyTorch fields (`_record_memory_history`).

use std::path::{Path, PathBuf};
use std::process::Command;

use caching_alloc_engine::alloc::{
    AllocError, CachingAllocator, HistoryOptions, RecordMode, StackContext, TraceAction,
};
use caching_alloc_engine::device::sim::SimDevice;

use crate::ci::is_ci;
use crate::common::{MIB, S0, S1, allocator};

/// The function every allocation of the workload is made from: its name is in their stacks.
pub const WORKLOAD_FN: &str = "inspect_workload";

/// Small and large allocations, frees, a free that waits on another stream (left pending),
/// `empty_cache`, and one out-of-memory; returns the allocations still live.
#[inline(never)]
pub fn inspect_workload(
    alloc: &CachingAllocator<SimDevice>,
    device: &SimDevice,
) -> Vec<caching_alloc_engine::alloc::Allocation<u64>> {
    let mut live = Vec::new();
    for i in 0..40u64 {
        let size = if i % 3 == 0 {
            3 * MIB + i * 100_000
        } else {
            1000 + i * 377
        };
        live.push(alloc.malloc(size, S0).expect("fits"));
    }
    // Free every other one: splits and merges in both pools.
    let mut kept = Vec::new();
    for (i, a) in live.into_iter().enumerate() {
        if i % 2 == 0 {
            alloc.free(a).expect("live");
        } else {
            kept.push(a);
        }
    }
    // A free that waits on stream 1: completed later by an event.
    let shared = alloc.malloc(5 * MIB, S0).expect("fits");
    alloc.record_stream(&shared, S1).expect("live");
    alloc.free(shared).expect("live");
    device.complete_events(S1);
    let big = alloc.malloc(30 * MIB, S0).expect("fits");
    alloc.free(big).expect("live");
    alloc.empty_cache().expect("empty_cache");
    // 250 MiB beside what is live cannot fit in 256 MiB.
    let err = alloc.malloc(250 * MIB, S0).expect_err("too much");
    assert!(err.is_out_of_memory(), "{err}");
    for i in 0..10u64 {
        kept.push(alloc.malloc(2 * MIB + i * 4096, S0).expect("fits"));
    }
    // One free left waiting on stream 1 when the snapshot is taken.
    let pending = alloc.malloc(700_000, S0).expect("fits");
    alloc.record_stream(&pending, S1).expect("live");
    alloc.free(pending).expect("live");
    kept
}

pub(crate) fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("torch-snapshot-{}-{name}", std::process::id()))
}

/// Runs the checker on `snapshot`; `Ok(false)` when python3 is missing outside CI.
pub(crate) fn python_check(snapshot: &Path, expected: serde_json::Value) -> bool {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&python).arg("--version").output().is_err() {
        assert!(
            !is_ci(),
            "CI is set but {python} is missing: it reads the pickle"
        );
        println!("skipped: {python} is not installed (it reads the pickle with its own reader)");
        return false;
    }
    let expected_path = snapshot.with_extension("expected.json");
    std::fs::write(&expected_path, expected.to_string()).expect("written");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/engine/check_torch_snapshot.py");
    let output = Command::new(&python)
        .arg(script)
        .arg(snapshot)
        .arg(&expected_path)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.ends_with("OK\n"),
        "the checker rejected the snapshot:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let _ = std::fs::remove_file(expected_path);
    true
}

pub(crate) fn expected(
    alloc: &CachingAllocator<SimDevice>,
    at_least: serde_json::Value,
    stacks: bool,
) -> serde_json::Value {
    let stats = alloc.stats();
    serde_json::json!({
        "device": 0,
        "reserved": stats.reserved_bytes.all.current,
        "allocated": stats.allocated_bytes.all.current,
        "active": stats.active_bytes.all.current,
        "requested": stats.requested_bytes.all.current,
        "at_least": at_least,
        "stack_function": if stacks { WORKLOAD_FN } else { "" },
    })
}

#[test]
fn python_reads_the_pickle_and_every_memory_viz_rule_holds_with_stacks() {
    let (alloc, device) = allocator(256 * MIB, "");
    alloc.record_memory_history(HistoryOptions::default());
    let live = inspect_workload(&alloc, &device);
    let path = scratch("full.pickle");
    alloc.dump_snapshot(&path).expect("written");
    let at_least = serde_json::json!({
        "alloc": 52, "free_requested": 22, "free_completed": 21,
        "segment_alloc": 2, "segment_free": 1, "oom": 1,
    });
    python_check(&path, expected(&alloc, at_least, true));
    let _ = std::fs::remove_file(path);
    for a in live {
        alloc.free(a).expect("live");
    }
}

#[test]
fn a_ring_that_dropped_old_entries_and_started_mid_run_stays_consistent() {
    let (alloc, device) = allocator(256 * MIB, "");
    // Blocks and segments live before recording starts: their frees must still name them.
    let early: Vec<_> = (0..6u64)
        .map(|i| {
            alloc
                .malloc(if i % 2 == 0 { 4 * MIB } else { 4096 }, S0)
                .expect("fits")
        })
        .collect();
    alloc.record_memory_history(HistoryOptions::trace(60));
    let live = inspect_workload(&alloc, &device);
    let early_addresses: Vec<(u64, u64)> = early
        .iter()
        .map(|a| (a.address(), a.requested_size()))
        .collect();
    for a in early {
        alloc.free(a).expect("live");
    }
    // Their frees name them although their allocations were never recorded.
    let history = alloc.snapshot().history;
    for (address, size) in early_addresses {
        assert!(
            history
                .iter()
                .any(|e| e.action == TraceAction::FreeRequested
                    && (e.addr, e.size) == (address, size)),
            "no free_requested for the block at {address:#x} allocated before recording"
        );
    }
    let trace = alloc.trace();
    assert!(trace.dropped > 0, "the ring of 60 dropped old entries");
    assert_eq!(trace.events.len(), 60);
    let path = scratch("ring.pickle");
    alloc.dump_snapshot(&path).expect("written");
    let at_least = serde_json::json!({ "free_requested": 6 });
    python_check(&path, expected(&alloc, at_least, false));
    let _ = std::fs::remove_file(path);
    for a in live {
        alloc.free(a).expect("live");
    }
}

#[test]
fn history_entries_carry_pytorchs_fields() {
    let (alloc, device) = allocator(256 * MIB, "");
    alloc.record_memory_history(HistoryOptions::default().with_context(StackContext::Alloc));
    let a = alloc.malloc(1000, S0).expect("fits");
    let (address, block_size) = (a.address(), a.size());
    // The whole device beside a live block in a 2 MiB segment cannot fit.
    let err = alloc.malloc(256 * MIB, S0).expect_err("too much");
    alloc.free(a).expect("live");
    let AllocError::OutOfMemory {
        device_free,
        diagnosis,
        ..
    } = err
    else {
        panic!("expected out-of-memory, got {err}");
    };
    let rounded = diagnosis.rounded;
    let history = alloc.snapshot().history;
    let actions: Vec<TraceAction> = history.iter().map(|e| e.action).collect();
    assert_eq!(
        actions,
        [
            TraceAction::SegmentAlloc,
            TraceAction::Alloc,
            TraceAction::Oom,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted,
        ]
    );
    // Frees name the block's address and requested size (PyTorch matches them by address).
    for e in [&history[1], &history[3], &history[4]] {
        assert_eq!(
            (e.addr, e.size, e.block_size),
            (address, 1000, block_size),
            "{e:?}"
        );
    }
    // The OOM entry: the rounded request and the device's free bytes.
    let oom = &history[2];
    assert_eq!((oom.size, oom.device_free), (rounded, Some(device_free)));
    assert_eq!((rounded, device_free), (256 * MIB, 254 * MIB));
    // `context="alloc"`: stacks on alloc, segment_alloc and oom, none on frees.
    let with_stack: Vec<bool> = history.iter().map(|e| e.stack.is_some()).collect();
    assert_eq!(with_stack, [true, true, true, false, false]);
    assert!(history.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    drop(device);
}

#[test]
fn state_only_recording_keeps_block_stacks_and_no_trace() {
    let (alloc, _device) = allocator(256 * MIB, "");
    alloc.record_memory_history(
        HistoryOptions::default()
            .with_enabled(RecordMode::State)
            .with_context(StackContext::State),
    );
    let a = alloc.malloc(4096, S0).expect("fits");
    let snapshot = alloc.snapshot();
    assert!(snapshot.history.is_empty());
    let block = snapshot.segments[0]
        .blocks
        .iter()
        .find(|b| b.address == a.address());
    assert!(
        block.expect("the block").stack.is_some(),
        "live blocks keep their stack"
    );
    alloc.record_memory_history(HistoryOptions::off());
    assert!(alloc.snapshot().segments[0].blocks[0].stack.is_none());
    alloc.free(a).expect("live");
}

/// With expandable segments the snapshot shows one segment per mapped run (`is_expandable`)
/// and the history holds `segment_map` / `segment_unmap`; every MEMORY_VIZ rule still holds.
#[test]
fn expandable_segments_snapshot_and_history_pass_the_checker() {
    let (alloc, device) = allocator(256 * MIB, "expandable_segments:True");
    alloc.record_memory_history(HistoryOptions::default());
    let live = inspect_workload(&alloc, &device);
    let snapshot = alloc.snapshot();
    assert!(snapshot.segments.iter().all(|s| s.is_expandable));
    let path = scratch("expandable.pickle");
    alloc.dump_snapshot(&path).expect("written");
    let at_least = serde_json::json!({
        "alloc": 52, "free_requested": 22, "free_completed": 21,
        "segment_map": 2, "segment_unmap": 1, "oom": 1,
    });
    let mut expected = expected(&alloc, at_least, true);
    expected["expandable"] = serde_json::json!(true);
    python_check(&path, expected);
    let _ = std::fs::remove_file(path);
    for a in live {
        alloc.free(a).expect("live");
    }
}

/// Private pools (PyTorch's `MemPool`): each pool segment carries `segment_pool_id` (0, n) as
/// PyTorch's user pools do, the allocator's own (0, 0); every MEMORY_VIZ rule still holds.
#[test]
fn private_pool_segments_carry_their_pool_id() {
    use caching_alloc_engine::alloc::MemPoolOptions;
    let (alloc, device) = allocator(256 * MIB, "");
    alloc.record_memory_history(HistoryOptions::default());
    let first = alloc.create_pool(MemPoolOptions::default()).expect("pool");
    let second = alloc.create_pool(MemPoolOptions::default()).expect("pool");
    let mut live = inspect_workload(&alloc, &device);
    live.push(alloc.malloc_in(first, 1000, S0).expect("fits"));
    live.push(alloc.malloc_in(first, 3 * MIB, S0).expect("fits"));
    live.push(alloc.malloc_in(second, 5 * MIB, S0).expect("fits"));
    let path = scratch("pools.pickle");
    alloc.dump_snapshot(&path).expect("written");
    let mut expected = expected(&alloc, serde_json::json!({ "alloc": 55 }), false);
    expected["pool_segments"] = serde_json::json!({ "1": 2, "2": 1 });
    python_check(&path, expected);
    let _ = std::fs::remove_file(path);
    for a in live {
        alloc.free(a).expect("live");
    }
}

/// Issue 33: `torch_snapshot_pickle(&snapshot, u32::MAX)` built four billion empty
/// `device_traces` lists (one per device index up to the given one, as PyTorch's
/// `_snapshot` lists one per device). The index is now CubeCL's `u16`: the largest one
/// gives 65,536 lists and a pickle well under a MiB, the history in the last list.
#[test]
fn the_largest_device_index_gives_a_bounded_pickle() {
    use caching_alloc_engine::alloc::inspect::torch_snapshot_pickle;
    let (alloc, _device) = allocator(64 * MIB, "");
    let kept = alloc.malloc(MIB, S0).expect("fits");
    let snapshot = alloc.snapshot();
    let small = torch_snapshot_pickle(&snapshot, 0).len();
    let largest = torch_snapshot_pickle(&snapshot, u16::MAX).len();
    // Each extra empty list is a couple of opcodes: the pickle grows by a few bytes per device.
    assert!(
        largest > small + usize::from(u16::MAX),
        "{small} -> {largest}"
    );
    assert!(
        largest < small + 8 * (usize::from(u16::MAX) + 1),
        "{small} -> {largest}"
    );
    alloc.free(kept).expect("live");
}
