//! A human-readable table of the statistics, like `torch.cuda.memory_summary()`, built from
//! the statistics' table in `stats.rs`: a new statistic there is a new row here.

use std::fmt;

use super::stats::{ARRAYS, COUNTERS, FreeSpace, MemoryStats, SINGLES, Stat, Unit};
use super::units::format_bytes;

/// The table's width, borders included.
const WIDTH: usize = 84;

/// The statistics as a table of current, peak, total allocated and total freed values.
pub struct Summary<'a>(pub &'a MemoryStats);

fn rule(f: &mut fmt::Formatter<'_>, c: char) -> fmt::Result {
    let line: String = std::iter::repeat_n(c, WIDTH - 2).collect();
    writeln!(f, "|{line}|")
}

fn row(f: &mut fmt::Formatter<'_>, label: &str, stat: &Stat, unit: Unit) -> fmt::Result {
    let show = |v: u64| match unit {
        Unit::Bytes => format_bytes(v),
        Unit::Count => v.to_string(),
    };
    let (current, peak, allocated, freed) = (
        show(stat.current),
        show(stat.peak),
        show(stat.allocated),
        show(stat.freed),
    );
    writeln!(
        f,
        "| {label:<25}| {current:>11} | {peak:>11} | {allocated:>11} | {freed:>11} |"
    )
}

/// The free memory's shape when the statistics were read: free bytes, the largest free block
/// and their fragmentation, per pool.
fn free_space(f: &mut fmt::Formatter<'_>, free: &FreeSpace) -> fmt::Result {
    rule(f, '-')?;
    writeln!(
        f,
        "| {:<25}| {:>11} | {:>11} | {:>11} | {:>11} |",
        "Free memory now", "Free", "Largest", "Fragmented", ""
    )?;
    for (label, pool) in [
        ("Free blocks", &free.all),
        ("      in large pool", &free.large_pool),
        ("      in small pool", &free.small_pool),
    ] {
        let fragmentation = format!("{:.1} %", pool.fragmentation() * 100.0);
        writeln!(
            f,
            "| {label:<25}| {:>11} | {:>11} | {fragmentation:>11} | {:>11} |",
            format_bytes(pool.free_bytes),
            format_bytes(pool.largest_free_block),
            ""
        )?;
    }
    Ok(())
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stats = self.0;
        rule(f, '=')?;
        writeln!(f, "| {:<81}|", "burn-caching-alloc memory summary")?;
        rule(f, '-')?;
        let counters: Vec<String> = COUNTERS
            .iter()
            .filter_map(|c| Some(format!("{}: {}", c.label?, (c.get)(stats))))
            .collect();
        for pair in counters.chunks(2) {
            let (left, right) = (&pair[0], pair.get(1).map_or("", String::as_str));
            writeln!(f, "| {left:<40}| {right:<39}|")?;
        }
        rule(f, '=')?;
        let (metric, current, peak, allocated, freed) = (
            "Metric",
            "Cur Usage",
            "Peak Usage",
            "Tot Alloc",
            "Tot Freed",
        );
        writeln!(
            f,
            "| {metric:<25}| {current:>11} | {peak:>11} | {allocated:>11} | {freed:>11} |"
        )?;
        rule(f, '-')?;
        for array in &ARRAYS {
            let values = (array.get)(stats);
            row(f, array.label, &values.all, array.unit)?;
            row(f, "      from large pool", &values.large_pool, array.unit)?;
            row(f, "      from small pool", &values.small_pool, array.unit)?;
            rule(f, '-')?;
        }
        for single in &SINGLES {
            row(f, single.label, (single.get)(stats), Unit::Count)?;
        }
        free_space(f, &stats.free_space)?;
        if !stats.scopes.is_empty() {
            rule(f, '-')?;
            writeln!(f, "| {:<81}|", "Allocated memory by scope")?;
            for (name, stat) in &stats.scopes {
                // A long name is cut so that the table keeps its width.
                let label: String = format!("  {name}").chars().take(25).collect();
                row(f, &label, stat, Unit::Bytes)?;
            }
        }
        rule(f, '=')
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::size::PoolKind;

    /// Every statistic a different value, so a row in the wrong place shows: the arrays in
    /// the table's order, then the single statistics and the counters.
    fn distinct_stats() -> MemoryStats {
        let mut stats = MemoryStats::default();
        let mut next = 1u64;
        for field in &ARRAYS {
            let array = (field.get_mut)(&mut stats);
            for (pool, times) in [(PoolKind::Large, 3), (PoolKind::Small, 1)] {
                array.increase(pool, next << 20);
                array.decrease(pool, (next << 20) / 2);
                for _ in 1..times {
                    array.increase(pool, next);
                }
                next += 1;
            }
        }
        stats.oversize_allocations.increase(5);
        stats.oversize_segments.increase(6);
        stats.oversize_segments.decrease(1);
        for (counter, value) in COUNTERS.iter().zip(7..) {
            *(counter.get_mut)(&mut stats) = value;
        }
        // 3 MiB free in the large pool, at most 2 MiB of it in one block (1/3 fragmented);
        // 1 MiB in the small pool, in one block.
        stats.free_space.add(PoolKind::Large, 2 << 20);
        stats.free_space.add(PoolKind::Large, 1 << 20);
        stats.free_space.add(PoolKind::Small, 1 << 20);
        stats
    }

    /// PyTorch's `memory_summary` layout: the text is pinned whole, so that building it from
    /// the statistics table cannot move a row, a label or a column.
    #[test]
    fn the_summary_text_is_pinned() {
        let text = Summary(&distinct_stats()).to_string();
        assert_eq!(text, EXPECTED);
    }

    /// The summary of `distinct_stats()`, as the code before the statistics table wrote it.
    const EXPECTED: &str = include_str!("summary.expected.txt");
}
