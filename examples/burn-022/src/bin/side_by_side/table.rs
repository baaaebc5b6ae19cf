//! The Markdown table of the rows, and what each side holds at a row's end: the engine's
//! segments, the stock side's pools.

use std::collections::BTreeMap;
use std::fmt::Write;

use burn::tensor::SlicedPoolReport;
use burn_022_caching_hook::WgpuEngine;

use crate::measure::{Reads, Row};

pub fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 20) as f64)
}

fn ratio(hooked: u64, stock: u64) -> String {
    if stock == 0 {
        return "n/a".into();
    }
    format!("{:.2}", hooked as f64 / stock as f64)
}

pub fn markdown(rows: &[Row]) -> String {
    let mut out = String::new();
    out.push_str(
        "| workload | steps | stock peak | stock final | hooked peak | hooked final \
         | engine peak | engine final | CubeCL hooked final | peak h/s | final h/s \
         | median step h/s | rel. diff step 0 / max |\n",
    );
    out.push_str("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
    for row in rows {
        let (stock_peak, hooked_peak, peak_ratio) = match (&row.stock.peak, &row.hooked.peak) {
            (Some(stock), Some(hooked)) => (
                mib(stock.total),
                mib(hooked.total),
                ratio(hooked.total, stock.total),
            ),
            _ => (
                format!("≤ {} ¹", mib(row.stock_pages_peak)),
                "n/a".into(),
                "n/a".into(),
            ),
        };
        let name = match row.reads {
            Reads::EveryStep => row.name.clone(),
            Reads::AtEnd => format!("{} (control: read at end)", row.name),
        };
        let _ = writeln!(
            out,
            "| {name} | {} | {stock_peak} | {} | {hooked_peak} | {} | {} | {} | {} | {peak_ratio} | {} | {:.2} | {:.0e} / {:.0e} |",
            row.steps,
            mib(row.stock.last.total),
            mib(row.hooked.last.total),
            mib(row.engine_peak),
            mib(row.hooked.last.engine.unwrap_or(0)),
            mib(row.hooked.last.cubecl),
            ratio(row.hooked.last.total, row.stock.last.total),
            row.median_ratio(),
            row.disagreement().0,
            row.disagreement().1,
        );
    }
    out
}

/// The segments of one stream and pool, summed.
#[derive(Default)]
struct Group {
    count: usize,
    total: u64,
    allocated: u64,
    requested: u64,
    sizes: Vec<u64>,
}

/// The engine's segments now, per stream and pool (streams holding the same listed once):
/// what the hooked side reserves.
pub fn segments(engine: &WgpuEngine) -> String {
    let snapshot = engine.snapshot();
    let mut groups: BTreeMap<(u64, String), Group> = BTreeMap::new();
    for segment in &snapshot.segments {
        let group = groups
            .entry((segment.stream, format!("{:?}", segment.pool)))
            .or_default();
        group.count += 1;
        group.total += segment.total_size;
        group.allocated += segment.allocated_size;
        group.requested += segment.requested_size;
        group.sizes.push(segment.total_size);
    }
    // description -> streams
    let mut streams: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for ((stream, pool), group) in groups {
        let Group {
            count,
            total,
            allocated,
            requested,
            sizes,
        } = group;
        let sizes: Vec<String> = sizes.iter().map(|&size| mib(size)).collect();
        let description = format!(
            "{pool}: {count} segments, {} MiB reserved, {} MiB allocated, {} MiB requested; \
             sizes (MiB) {}",
            mib(total),
            mib(allocated),
            mib(requested),
            sizes.join(" ")
        );
        streams.entry(description).or_default().push(stream);
    }
    let mut out = String::new();
    for (description, streams) in streams {
        let which = match streams.as_slice() {
            [one] => format!("stream {one}"),
            many => format!("{} streams ({:?}), each", many.len(), many),
        };
        let _ = writeln!(out, "  {which} {description}");
    }
    out
}

/// The stock side's dynamic pools that hold pages now (every stream has its own), as Burn
/// reports them, counted by shape.
pub fn pools(pools: &[SlicedPoolReport]) -> String {
    // (pages, page size) -> pools
    let mut shapes: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for pool in pools.iter().filter(|pool| pool.pages > 0) {
        *shapes.entry((pool.pages, pool.page_size)).or_default() += 1;
    }
    let held: Vec<String> = shapes
        .iter()
        .map(|(&(pages, size), count)| format!("{count} x ({pages} x {} MiB)", mib(size)))
        .collect();
    format!("  stock pools holding pages: {}\n", held.join(", "))
}
