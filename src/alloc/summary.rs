//! A human-readable table of the statistics, like `torch.cuda.memory_summary()`.

use std::fmt::Write;

use super::stats::{MemoryStats, Stat, StatArray};
use super::units::format_bytes;

const WIDTH: usize = 84;

fn rule(out: &mut String, c: char) {
    out.push('|');
    out.extend(std::iter::repeat_n(c, WIDTH - 2));
    out.push_str("|\n");
}

fn row(out: &mut String, label: &str, stat: &Stat, bytes: bool) {
    let fmt = |v: u64| {
        if bytes {
            format_bytes(v)
        } else {
            v.to_string()
        }
    };
    let _ = writeln!(
        out,
        "| {label:<25}| {:>11} | {:>11} | {:>11} | {:>11} |",
        fmt(stat.current),
        fmt(stat.peak),
        fmt(stat.allocated),
        fmt(stat.freed)
    );
}

fn section(out: &mut String, label: &str, array: &StatArray, bytes: bool) {
    row(out, label, &array.all, bytes);
    row(out, "      from large pool", &array.large_pool, bytes);
    row(out, "      from small pool", &array.small_pool, bytes);
    rule(out, '-');
}

/// The statistics as a table of current, peak, total allocated and total freed values.
pub fn summary(stats: &MemoryStats) -> String {
    let mut out = String::new();
    rule(&mut out, '=');
    let _ = writeln!(out, "| {:<81}|", "burn-caching-alloc memory summary");
    rule(&mut out, '-');
    let _ = writeln!(
        out,
        "| {:<40}| {:<39}|",
        format!("Out-of-memory errors: {}", stats.num_ooms),
        format!("Device allocation retries: {}", stats.num_alloc_retries)
    );
    let _ = writeln!(
        out,
        "| {:<40}| {:<39}|",
        format!("Device allocations: {}", stats.num_device_alloc),
        format!("Device frees: {}", stats.num_device_free)
    );
    rule(&mut out, '=');
    let _ = writeln!(
        out,
        "| {:<25}| {:>11} | {:>11} | {:>11} | {:>11} |",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    rule(&mut out, '-');
    section(&mut out, "Allocated memory", &stats.allocated_bytes, true);
    section(&mut out, "Active memory", &stats.active_bytes, true);
    section(&mut out, "Requested memory", &stats.requested_bytes, true);
    section(&mut out, "Reserved memory", &stats.reserved_bytes, true);
    section(
        &mut out,
        "Non-releasable memory",
        &stats.inactive_split_bytes,
        true,
    );
    section(&mut out, "Allocations", &stats.allocation, false);
    section(&mut out, "Active allocs", &stats.active, false);
    section(&mut out, "Reserved segments", &stats.segment, false);
    section(
        &mut out,
        "Non-releasable allocs",
        &stats.inactive_split,
        false,
    );
    row(
        &mut out,
        "Oversize allocations",
        &stats.oversize_allocations,
        false,
    );
    row(
        &mut out,
        "Oversize segments",
        &stats.oversize_segments,
        false,
    );
    rule(&mut out, '=');
    out
}
