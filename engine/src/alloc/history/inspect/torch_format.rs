//! A [`Snapshot`] as the dict `torch.cuda.memory._snapshot()` returns: `segments` with every
//! block, `device_traces` with the history, `allocator_settings` and `external_annotations`
//! (the keys and their order are those of PyTorch's `memory_snapshot.cpp`; MEMORY_VIZ.md).
//!
//! Memory scopes travel as PyTorch's `torch.cuda.memory._set_memory_metadata` strings do: in
//! the `user_metadata` of each `alloc` trace entry (PyTorch's blocks carry no metadata of
//! their own); phases as `external_annotations`.

use super::pickle::Py;
use crate::alloc::block::BlockState;
use crate::alloc::config::AllocatorConfig;
use crate::alloc::history::Snapshot;
use crate::alloc::history::{HistoryEntry, TraceAction};
use crate::alloc::size::PoolKind;
use crate::alloc::stack::{Frame, Stack, StackResolver};
use crate::alloc::units::MIB;

/// PyTorch's name for a block state.
pub(crate) fn state_name(state: BlockState) -> &'static str {
    match state {
        BlockState::ActiveAllocated => "active_allocated",
        BlockState::ActivePendingFree => "active_pending_free",
        BlockState::Inactive => "inactive",
    }
}

/// PyTorch's `segment_type`.
pub(crate) fn pool_name(pool: PoolKind) -> &'static str {
    match pool {
        PoolKind::Small => "small",
        PoolKind::Large => "large",
    }
}

fn frames(resolver: &mut StackResolver, stack: Option<&Stack>) -> Py {
    let frames: Vec<Frame> = stack.map(|s| resolver.frames(s)).unwrap_or_default();
    Py::List(
        frames
            .into_iter()
            .map(|f| {
                Py::dict([
                    ("name", Py::Str(f.name)),
                    ("filename", Py::Str(f.filename)),
                    ("line", Py::int(f.line)),
                ])
            })
            .collect(),
    )
}

fn entry(resolver: &mut StackResolver, e: &HistoryEntry) -> Py {
    let mut items: Vec<(String, Py)> = vec![("action".into(), Py::str(e.action.name()))];
    if e.action == TraceAction::Oom {
        items.push(("device_free".into(), Py::int(e.device_free.unwrap_or(0))));
    } else {
        items.push(("addr".into(), Py::int(e.addr)));
    }
    items.extend([
        ("size".into(), Py::int(e.size)),
        ("stream".into(), Py::int(e.stream)),
        ("time_us".into(), Py::int(e.time_us)),
        ("compile_context".into(), Py::str("")),
        ("user_metadata".into(), Py::Str(e.user_metadata.clone())),
    ]);
    if e.stack.is_some() {
        items.push(("frames".into(), frames(resolver, e.stack.as_ref())));
    }
    Py::Dict(items)
}

/// The configuration as a `PYTORCH_CUDA_ALLOC_CONF` string.
pub(crate) fn config_string(config: &AllocatorConfig) -> String {
    let mut items = Vec::new();
    if let Some(size) = config.max_split_size {
        items.push(format!("max_split_size_mb:{}", size / MIB));
    }
    if let Some(t) = config.garbage_collection_threshold {
        items.push(format!("garbage_collection_threshold:{t}"));
    }
    if let Some(f) = config.memory_fraction {
        items.push(format!("per_process_memory_fraction:{f}"));
    }
    if config.expandable_segments {
        items.push("expandable_segments:True".to_string());
    }
    items.join(",")
}

fn allocator_settings(config: &AllocatorConfig) -> Py {
    let buckets = (0..16)
        .map(|i| {
            let mb = 1u64 << i;
            let n = config.roundup_power2_divisions.for_size(mb * MIB);
            (mb.to_string(), Py::int(n))
        })
        .collect();
    Py::dict([
        ("PYTORCH_CUDA_ALLOC_CONF", Py::Str(config_string(config))),
        (
            "max_split_size",
            Py::Int(config.max_split_size.map_or(-1, i128::from)),
        ),
        (
            "garbage_collection_threshold",
            Py::Float(config.garbage_collection_threshold.unwrap_or(0.0)),
        ),
        ("expandable_segments", Py::Bool(config.expandable_segments)),
        ("pinned_num_register_threads", Py::int(1)),
        ("release_lock_on_cudamalloc", Py::Bool(false)),
        ("pinned_use_cuda_host_register", Py::Bool(false)),
        ("roundup_power2_divisions", Py::Dict(buckets)),
    ])
}

/// The phase marks as PyTorch's `external_annotations`: each a dict of the annotation's
/// metadata (`name`, and `stage` `START` or `END`, as `record_function`'s memory-history
/// callback records them), then `device` and `time_us` (`_memory_snapshot_pickled` in
/// PyTorch's `torch/csrc/cuda/memory_snapshot.cpp`).
fn external_annotations(snapshot: &Snapshot, device: u16) -> Py {
    Py::List(
        snapshot
            .phases
            .iter()
            .map(|mark| {
                Py::dict([
                    ("name", Py::Str(mark.name.clone())),
                    ("stage", Py::str(mark.stage.name())),
                    ("device", Py::int(device)),
                    ("time_us", Py::int(mark.time_us)),
                ])
            })
            .collect(),
    )
}

/// `snapshot` as PyTorch's snapshot dict for device index `device`, stacks resolved.
pub(crate) fn torch_snapshot(snapshot: &Snapshot, device: u16) -> Py {
    let mut resolver = StackResolver::new();
    let segments = snapshot
        .segments
        .iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    Py::dict([
                        ("address", Py::int(b.address)),
                        ("size", Py::int(b.size)),
                        ("requested_size", Py::int(b.requested_size)),
                        ("state", Py::str(state_name(b.state))),
                        ("frames", frames(&mut resolver, b.stack.as_ref())),
                    ])
                })
                .collect();
            Py::dict([
                ("device", Py::int(device)),
                ("address", Py::int(s.address)),
                ("total_size", Py::int(s.total_size)),
                ("allocated_size", Py::int(s.allocated_size)),
                ("active_size", Py::int(s.active_size)),
                ("requested_size", Py::int(s.requested_size)),
                ("stream", Py::int(s.stream)),
                ("segment_type", Py::str(pool_name(s.pool))),
                // PyTorch's user pools are (0, n); the allocator's own pools (0, 0).
                (
                    "segment_pool_id",
                    Py::Tuple(vec![Py::int(0), Py::int(s.mem_pool.unwrap_or(0))]),
                ),
                ("is_expandable", Py::Bool(s.is_expandable)),
                ("frames", frames(&mut resolver, s.stack.as_ref())),
                ("blocks", Py::List(blocks)),
            ])
        })
        .collect();
    let mut traces: Vec<Py> = (0..device).map(|_| Py::List(Vec::new())).collect();
    traces.push(Py::List(
        snapshot
            .history
            .iter()
            .map(|e| entry(&mut resolver, e))
            .collect(),
    ));
    Py::dict([
        ("segments", Py::List(segments)),
        ("device_traces", Py::List(traces)),
        ("allocator_settings", allocator_settings(&snapshot.config)),
        (
            "external_annotations",
            external_annotations(snapshot, device),
        ),
    ])
}
