//! Memory scopes (`alloc::Tag`): the live bytes of each scope after every step, nesting, a
//! tag handed to a serving thread, re-tagging, the summary, the report, the snapshot (each
//! block's scope, the PyTorch pickle's `user_metadata` and `external_annotations`) and the
//! viewer.

use caching_alloc_engine::alloc::{
    HistoryOptions, MemoryPoint, MemoryReport, PhaseStage, Stat, Tag,
};

use crate::common::{MIB, S0, S1, allocator};
use crate::snapshot_pickle::{expected, python_check, scratch};
use crate::viewer_html::{attribute, rendered_dom};

/// The scope `name`'s (current, peak) live bytes.
fn scope(
    alloc: &caching_alloc_engine::alloc::CachingAllocator<
        impl caching_alloc_engine::device::DeviceMemory,
    >,
    name: &str,
) -> (u64, u64) {
    let stat: Stat = alloc.stats().scopes.get(name).copied().unwrap_or_default();
    (stat.current, stat.peak)
}

#[test]
fn a_scope_counts_its_live_blocks_after_each_step_and_the_innermost_scope_wins() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let untagged = alloc.malloc(4096, S0).expect("fits");
    let outer = Tag::new("outer").enter();
    // 1000 bytes round to a 1024-byte block.
    let a = alloc.malloc(1000, S0).expect("fits");
    assert_eq!(scope(&alloc, "outer"), (1024, 1024));
    let inner = Tag::new("inner").enter();
    // A large request: the innermost scope takes it, the outer one's count does not change.
    let b = alloc.malloc(3 * MIB, S0).expect("fits");
    assert_eq!(scope(&alloc, "inner"), (3 * MIB, 3 * MIB));
    assert_eq!(scope(&alloc, "outer"), (1024, 1024));
    drop(inner);
    // 600 bytes round to 1024.
    let c = alloc.malloc(600, S0).expect("fits");
    assert_eq!(scope(&alloc, "outer"), (2048, 2048));
    drop(outer);
    // Frees count wherever they happen, in or out of any scope.
    alloc.free(a).expect("live");
    assert_eq!(scope(&alloc, "outer"), (1024, 2048));
    alloc.free(b).expect("live");
    assert_eq!(scope(&alloc, "inner"), (0, 3 * MIB));
    let map = alloc.stats().to_map();
    assert_eq!(map["scope.outer.allocated_bytes.current"], 1024);
    assert_eq!(map["scope.outer.allocated_bytes.peak"], 2048);
    assert_eq!(map["scope.outer.allocated_bytes.allocated"], 2048);
    assert_eq!(map["scope.outer.allocated_bytes.freed"], 1024);
    assert_eq!(map["scope.inner.allocated_bytes.current"], 0);
    assert_eq!(map.keys().filter(|k| k.starts_with("scope.")).count(), 8);
    alloc.reset_peak_memory_stats();
    assert_eq!(scope(&alloc, "outer"), (1024, 1024));
    assert_eq!(scope(&alloc, "inner"), (0, 0));
    // The sum of the scopes plus the untagged block is what is allocated.
    assert_eq!(alloc.stats().memory_allocated(), 1024 + 4096);
    alloc.free(c).expect("live");
    alloc.free(untagged).expect("live");
    assert_eq!(scope(&alloc, "outer"), (0, 1024));
}

#[test]
fn a_free_waiting_on_another_stream_leaves_the_scope_at_once_like_allocated_bytes() {
    let (alloc, device) = allocator(64 * MIB, "");
    let pending =
        Tag::serving(Some(Tag::new("pending")), || alloc.malloc(5 * MIB, S0)).expect("fits");
    alloc.record_stream(&pending, S1).expect("live");
    alloc.free(pending).expect("live");
    // Pending on stream 1: still active, no longer allocated, and no longer the scope's.
    assert_eq!(scope(&alloc, "pending"), (0, 5 * MIB));
    assert_eq!(alloc.stats().active_bytes.all.current, 5 * MIB);
    device.complete_events(S1);
    let again = alloc.malloc(5 * MIB, S0).expect("fits");
    assert_eq!(
        scope(&alloc, "pending"),
        (0, 5 * MIB),
        "the reuse is not the scope's"
    );
    alloc.free(again).expect("live");
}

#[test]
fn a_tag_handed_to_a_serving_thread_wins_over_that_threads_scope() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let _own = Tag::new("device-thread").enter();
    let served = Tag::serving(Some(Tag::new("caller")), || alloc.malloc(2048, S0)).expect("fits");
    let own = alloc.malloc(512, S0).expect("fits");
    assert_eq!(scope(&alloc, "caller"), (2048, 2048));
    assert_eq!(scope(&alloc, "device-thread"), (512, 512));
    // A cache above the engine hands the live block to a request of another scope.
    alloc
        .retag(&served, Some(Tag::new("reused")))
        .expect("live");
    assert_eq!(scope(&alloc, "caller"), (0, 2048));
    assert_eq!(scope(&alloc, "reused"), (2048, 2048));
    alloc.retag(&served, None).expect("live");
    assert_eq!(scope(&alloc, "reused"), (0, 2048));
    alloc.free(served).expect("live");
    alloc.free(own).expect("live");
    assert_eq!(
        scope(&alloc, "reused"),
        (0, 2048),
        "a block under no scope leaves none"
    );
}

#[test]
fn the_summary_and_the_report_say_which_scopes_hold_memory_and_which_grew() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let weights = {
        let _scope = Tag::new("weights").enter();
        alloc.malloc(2 * MIB, S0).expect("fits")
    };
    let before = MemoryPoint::of_engine(alloc.snapshot());
    let batches: Vec<_> = {
        let _scope = Tag::new("batches").enter();
        (0..3)
            .map(|_| alloc.malloc(MIB, S0).expect("fits"))
            .collect()
    };
    let summary = alloc.summary();
    assert!(summary.contains("Allocated memory by scope"), "{summary}");
    let row = summary
        .lines()
        .find(|l| l.starts_with("|   batches"))
        .unwrap_or_else(|| panic!("no batches row:\n{summary}"));
    assert!(row.contains("3.00 MiB"), "{row}");
    let report = MemoryReport::between(&before, &MemoryPoint::of_engine(alloc.snapshot()));
    let grew: Vec<(&str, u64, u64)> = report
        .scopes
        .iter()
        .map(|s| (s.name.as_str(), s.before, s.now))
        .collect();
    assert_eq!(grew, [("batches", 0, 3 * MIB)], "weights did not change");
    let text = report.to_string();
    assert!(
        text.contains("by scope") && text.contains("batches: 0 B -> 3.00 MiB (+3.00 MiB)"),
        "{text}"
    );
    for b in batches {
        alloc.free(b).expect("live");
    }
    alloc.free(weights).expect("live");
}

#[test]
fn the_snapshot_carries_each_blocks_scope_and_pythons_pickle_reader_finds_tags_and_phases() {
    let (alloc, _device) = allocator(64 * MIB, "");
    alloc.record_memory_history(HistoryOptions::default());
    alloc.mark_phase("forward", PhaseStage::Start);
    let kept = {
        let _scope = Tag::new("activations").enter();
        vec![
            alloc.malloc(3000, S0).expect("fits"),
            alloc.malloc(3 * MIB, S0).expect("fits"),
        ]
    };
    alloc.mark_phase("forward", PhaseStage::End);
    let plain = alloc.malloc(700, S0).expect("fits");
    let snapshot = alloc.snapshot();
    let scopes: Vec<(u64, Option<&str>)> = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.allocation_id.is_some())
        .map(|b| (b.size, b.scope.as_deref()))
        .collect();
    let mut sorted = scopes.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            (1024, None),
            (3072, Some("activations")),
            (3 * MIB, Some("activations"))
        ]
    );
    let history = &snapshot.history;
    let metadata: Vec<&str> = history
        .iter()
        .filter(|e| e.action == caching_alloc_engine::alloc::TraceAction::Alloc)
        .map(|e| e.user_metadata.as_str())
        .collect();
    assert_eq!(metadata, ["activations", "activations", ""]);
    let marks: Vec<(&str, PhaseStage)> = snapshot
        .phases
        .iter()
        .map(|m| (m.name.as_str(), m.stage))
        .collect();
    assert_eq!(
        marks,
        [("forward", PhaseStage::Start), ("forward", PhaseStage::End)]
    );
    assert!(snapshot.phases[0].time_us <= history[0].time_us);

    let path = scratch("scopes.pickle");
    alloc.dump_snapshot(&path).expect("written");
    let mut want = expected(&alloc, serde_json::json!({ "alloc": 3 }), false);
    want["user_metadata"] = serde_json::json!({ "activations": 2 });
    want["annotations"] = serde_json::json!([["forward", "START"], ["forward", "END"]]);
    python_check(&path, want);
    let _ = std::fs::remove_file(path);
    for a in kept {
        alloc.free(a).expect("live");
    }
    alloc.free(plain).expect("live");
}

#[test]
fn phases_are_not_recorded_without_history() {
    let (alloc, _device) = allocator(64 * MIB, "");
    alloc.mark_phase("forward", PhaseStage::Start);
    assert!(alloc.snapshot().phases.is_empty());
}

#[test]
fn the_viewer_lists_the_scopes_and_draws_the_phases_in_chromium() {
    let (alloc, _device) = allocator(64 * MIB, "");
    alloc.record_memory_history(HistoryOptions::default());
    let mut live = Vec::new();
    for (phase, size) in [("forward", 4 * MIB), ("backward", 2 * MIB)] {
        alloc.mark_phase(phase, PhaseStage::Start);
        let _scope = Tag::new(phase).enter();
        live.push(alloc.malloc(size, S0).expect("fits"));
        // Temporaries, freed inside the phase: the timeline rises and falls.
        for i in 1..=3 {
            let t = alloc.malloc(i * size / 8, S0).expect("fits");
            alloc.free(t).expect("live");
        }
        live.push(alloc.malloc(size / 4, S0).expect("fits"));
        alloc.mark_phase(phase, PhaseStage::End);
    }
    let page = std::env::temp_dir().join(format!("viewer-scopes-{}.html", std::process::id()));
    alloc.dump_html(&page).expect("written");
    // The docs' picture: `SCOPES_VIEWER_OUT=/tmp/scopes.html`, then a screenshot in chromium.
    if let Ok(out) = std::env::var("SCOPES_VIEWER_OUT") {
        std::fs::copy(&page, out).expect("copied");
    }
    let Some(dom) = rendered_dom(&page) else {
        let _ = std::fs::remove_file(&page);
        return;
    };
    let _ = std::fs::remove_file(&page);
    assert_eq!(attribute(&dom, "<body", "data-rendered"), "ok", "{dom}");
    for (name, bytes) in [("forward", 5 * MIB), ("backward", 5 * MIB / 2)] {
        assert_eq!(
            attribute(
                &dom,
                &format!("data-scope=\"{name}\" data-bytes"),
                "data-bytes"
            ),
            bytes.to_string()
        );
        assert!(
            dom.contains(&format!("data-phase=\"{name}\"")),
            "no {name} band"
        );
    }
    assert_eq!(dom.matches("class=\"phase phase").count(), 2);
    for a in live {
        alloc.free(a).expect("live");
    }
}
