//! The offline viewer: one HTML page with its data, script and style inline.
//!
//! The data is computed here: the active-memory timeline (allocated and reserved bytes after
//! every history entry, replayed backwards from the snapshot's statistics so that its last
//! point is exactly `memory_stats`), the segments with every block, the stacks (each distinct
//! one once), and the summary numbers. `viewer.js` draws it as SVG and shows a block's stack
//! on hover or click.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::torch_format::{pool_name, state_name};
use crate::alloc::block::BlockState;
use crate::alloc::history::Snapshot;
use crate::alloc::history::{HistoryEntry, PhaseStage, TraceAction};
use crate::alloc::stack::{Stack, StackResolver};
use crate::alloc::stats::FreeSpace;

/// A cache above the engine (CubeCL's layer), shown with the engine's numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewerLayer {
    /// What the number is, e.g. "CubeCL layer: cached in free slices".
    pub name: String,
    /// Bytes.
    pub bytes: u64,
}

/// The most timeline points drawn; longer histories keep each bucket's highest values.
const MAX_POINTS: usize = 4000;

/// How allocated and reserved bytes change with one entry.
fn deltas(e: &HistoryEntry) -> (i128, i128) {
    let size = i128::from(e.size);
    let block = i128::from(e.block_size);
    match e.action {
        TraceAction::Alloc => (block, 0),
        TraceAction::FreeRequested => (-block, 0),
        TraceAction::SegmentAlloc | TraceAction::SegmentMap => (0, size),
        TraceAction::SegmentFree | TraceAction::SegmentUnmap => (0, -size),
        TraceAction::FreeCompleted | TraceAction::Oom => (0, 0),
    }
}

/// `[time_us, allocated, reserved]` after each entry, starting with the state before the first.
fn timeline(snapshot: &Snapshot) -> Vec<[u64; 3]> {
    let history = &snapshot.history;
    let end = (
        i128::from(snapshot.stats.allocated_bytes.all.current),
        i128::from(snapshot.stats.reserved_bytes.all.current),
    );
    let total = history
        .iter()
        .map(deltas)
        .fold((0, 0), |a, d| (a.0 + d.0, a.1 + d.1));
    let (mut allocated, mut reserved) = (end.0 - total.0, end.1 - total.1);
    let start_time = history.first().map_or(0, |e| e.time_us);
    let mut points = vec![[start_time, allocated.max(0) as u64, reserved.max(0) as u64]];
    for e in history {
        let (a, r) = deltas(e);
        allocated += a;
        reserved += r;
        points.push([e.time_us, allocated.max(0) as u64, reserved.max(0) as u64]);
    }
    if points.len() <= MAX_POINTS {
        return points;
    }
    let last = *points.last().expect("at least one point");
    let per = points.len().div_ceil(MAX_POINTS - 1);
    let mut kept: Vec<[u64; 3]> = points
        .chunks(per)
        .map(|c| {
            let a = c.iter().map(|p| p[1]).max().unwrap_or(0);
            let r = c.iter().map(|p| p[2]).max().unwrap_or(0);
            [c[0][0], a, r]
        })
        .collect();
    kept.push(last);
    kept
}

/// The phases as `[name, start_us, end_us]`, each START paired with the next END of its name
/// (a phase still open ends at the last history entry, or at its start when there is none).
fn phases(snapshot: &Snapshot) -> Vec<Value> {
    let last = snapshot.history.last().map(|e| e.time_us);
    let mut open: Vec<(&str, u64)> = Vec::new();
    let mut bands = Vec::new();
    for mark in &snapshot.phases {
        match mark.stage {
            PhaseStage::Start => open.push((&mark.name, mark.time_us)),
            PhaseStage::End => {
                if let Some(i) = open.iter().rposition(|(name, _)| *name == mark.name) {
                    let (name, start) = open.remove(i);
                    bands.push(json!([name, start, mark.time_us]));
                }
            }
        }
    }
    for (name, start) in open {
        bands.push(json!([name, start, last.unwrap_or(start).max(start)]));
    }
    bands
}

/// Distinct stacks, each resolved once, referred to by index.
struct Stacks {
    resolver: StackResolver,
    index: HashMap<Vec<String>, usize>,
    list: Vec<Vec<String>>,
}

impl Stacks {
    fn id(&mut self, stack: Option<&Stack>) -> Value {
        let Some(stack) = stack else {
            return Value::Null;
        };
        let frames: Vec<String> = self
            .resolver
            .frames(stack)
            .into_iter()
            .map(|f| {
                if f.line == 0 {
                    f.name
                } else {
                    format!("{}  ({}:{})", f.name, f.filename, f.line)
                }
            })
            .collect();
        let next = self.list.len();
        let id = *self.index.entry(frames.clone()).or_insert(next);
        if id == next {
            self.list.push(frames);
        }
        json!(id)
    }
}

fn data(snapshot: &Snapshot, title: &str, layers: &[ViewerLayer]) -> Value {
    let mut stacks = Stacks {
        resolver: StackResolver::new(),
        index: HashMap::new(),
        list: Vec::new(),
    };
    let segments: Vec<Value> = snapshot
        .segments
        .iter()
        .map(|s| {
            let blocks: Vec<Value> = s
                .blocks
                .iter()
                .map(|b| {
                    json!({
                        "address": b.address,
                        "size": b.size,
                        "requested": b.requested_size,
                        "state": state_name(b.state),
                        "stack": stacks.id(b.stack.as_ref()),
                        "scope": b.scope,
                    })
                })
                .collect();
            json!({
                "address": s.address,
                "size": s.total_size,
                "stream": s.stream,
                "pool": pool_name(s.pool),
                "mem_pool": s.mem_pool,
                "stack": stacks.id(s.stack.as_ref()),
                "blocks": blocks,
            })
        })
        .collect();
    let stats = &snapshot.stats;
    // The free memory's shape, from the segments (a snapshot read from a file has no
    // `free_space`; its segments are what it says).
    let mut free = FreeSpace::default();
    for segment in &snapshot.segments {
        for block in segment
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::Inactive)
        {
            free.add(segment.pool, block.size);
        }
    }
    let largest_free = free.all.largest_free_block;
    let fragmentation: Vec<_> = [
        ("all", "Fragmentation of the free memory", &free.all),
        ("large_pool", "      in the large pool", &free.large_pool),
        ("small_pool", "      in the small pool", &free.small_pool),
    ]
    .iter()
    .map(|(key, label, pool)| {
        json!([
            key,
            label,
            // Parts per million, an integer the page shows as a percentage.
            (pool.fragmentation() * 1e6).round() as u64,
            pool.free_bytes,
            pool.largest_free_block
        ])
    })
    .collect();
    let summary = json!([
        [
            "allocated",
            "Allocated (live blocks)",
            stats.allocated_bytes.all.current
        ],
        [
            "reserved",
            "Reserved (segments)",
            stats.reserved_bytes.all.current
        ],
        [
            "active",
            "Active (allocated + pending free)",
            stats.active_bytes.all.current
        ],
        [
            "requested",
            "Requested (before rounding)",
            stats.requested_bytes.all.current
        ],
        [
            "cached",
            "Cached in the engine (reserved - allocated)",
            // A snapshot read from a file may say anything: no subtraction may underflow.
            stats
                .reserved_bytes
                .all
                .current
                .saturating_sub(stats.allocated_bytes.all.current)
        ],
        ["largest_free", "Largest free block", largest_free],
        [
            "peak_allocated",
            "Peak allocated",
            stats.allocated_bytes.all.peak
        ],
        [
            "peak_reserved",
            "Peak reserved",
            stats.reserved_bytes.all.peak
        ],
    ]);
    let counts = json!([
        ["segments", "Segments", stats.segment.all.current],
        [
            "allocations",
            "Live allocations",
            stats.allocation.all.current
        ],
        [
            "num_alloc_retries",
            "Cache flushes and retries",
            stats.num_alloc_retries
        ],
        ["num_ooms", "Out-of-memory errors", stats.num_ooms],
        [
            "num_oom_rejections",
            "Requests rejected at the memory cap",
            stats.num_oom_rejections
        ],
        [
            "num_device_alloc",
            "Device allocations",
            stats.num_device_alloc
        ],
        ["num_device_free", "Device frees", stats.num_device_free],
        [
            "num_pool_borrows",
            "Misses served from the other pool",
            stats.num_pool_borrows
        ],
        [
            "num_stream_shares",
            "Misses served from another stream's cache",
            stats.num_stream_shares
        ],
        [
            "num_stream_lends",
            "Misses served by a block lent from another stream",
            stats.num_stream_lends
        ],
    ]);
    let history_stack_count = snapshot
        .history
        .iter()
        .filter(|e| e.stack.is_some())
        .count();
    json!({
        "title": title,
        "summary": summary,
        "counts": counts,
        "fragmentation": fragmentation,
        "layers": layers.iter().map(|l| json!([l.name, l.bytes])).collect::<Vec<_>>(),
        "timeline": timeline(snapshot),
        "entries": snapshot.history.len(),
        "dropped": snapshot.trace.as_ref().map_or(0, |t| t.dropped),
        "entries_with_stacks": history_stack_count,
        "segments": segments,
        "stacks": stacks.list,
        "scopes": stats
            .scopes
            .iter()
            .map(|(name, stat)| json!([name, stat.current, stat.peak]))
            .collect::<Vec<_>>(),
        "phases": phases(snapshot),
    })
}

/// The page: the data as JSON in a script element, then the viewer's script and style.
pub(super) fn render(snapshot: &Snapshot, title: &str, layers: &[ViewerLayer]) -> String {
    // Inside a script element, `</script` closes it and `<!--` opens an escaped state that
    // swallows the page's own script: no `<` may appear in the data. In JSON, `<` can only be
    // inside a string, where `\u003c` is the same character.
    let data = data(snapshot, title, layers)
        .to_string()
        .replace('<', "\\u003c");
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{title}</title>\n<style>\n{style}</style>\n</head>\n<body>\n\
         <h1>{title}</h1>\n<pre id=\"errors\"></pre>\n\
         <section><h2>Summary</h2><table id=\"summary\"></table></section>\n\
         <section><h2>Scopes</h2><table id=\"scopes\"></table></section>\n\
         <section><h2>Active memory timeline</h2><div id=\"timeline\"></div></section>\n\
         <section><h2>Segments</h2><p class=\"legend\" id=\"legend\"></p>\
         <div id=\"segments\"></div></section>\n\
         <section><h2>Block</h2><pre id=\"details\">Hover over or click a block.</pre></section>\n\
         <script type=\"application/json\" id=\"data\">{data}</script>\n\
         <script>\n{script}</script>\n</body>\n</html>\n",
        style = include_str!("viewer.css"),
        script = include_str!("viewer.js"),
    )
}
