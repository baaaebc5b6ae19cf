//! A human-readable table of the statistics, like `torch.cuda.memory_summary()`, built from
//! the statistics' table in `stats.rs`: a new statistic there is a new row here.

use std::fmt;

use super::stats::{ARRAYS, COUNTERS, MemoryStats, SINGLES, Stat, Unit};
use super::units::format_bytes;

/// The table's width, borders included.
const WIDTH: usize = 84;

/// The statistics as a table of current, peak, total allocated and total freed values.
pub(crate) struct Summary<'a>(pub &'a MemoryStats);

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
        rule(f, '=')
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::size::PoolKind;
    use crate::alloc::stats::StatArray;

    /// Every statistic a different value, so a row in the wrong place shows.
    fn distinct_stats() -> MemoryStats {
        let mut stats = MemoryStats::default();
        let mut next = 1u64;
        let mut array = |array: &mut StatArray| {
            for (pool, times) in [(PoolKind::Large, 3), (PoolKind::Small, 1)] {
                array.increase(pool, next << 20);
                array.decrease(pool, (next << 20) / 2);
                for _ in 1..times {
                    array.increase(pool, next);
                }
                next += 1;
            }
        };
        array(&mut stats.allocated_bytes);
        array(&mut stats.active_bytes);
        array(&mut stats.requested_bytes);
        array(&mut stats.reserved_bytes);
        array(&mut stats.inactive_split_bytes);
        array(&mut stats.allocation);
        array(&mut stats.active);
        array(&mut stats.segment);
        array(&mut stats.inactive_split);
        stats.oversize_allocations.increase(5);
        stats.oversize_segments.increase(6);
        stats.oversize_segments.decrease(1);
        stats.num_ooms = 7;
        stats.num_alloc_retries = 8;
        stats.num_device_alloc = 9;
        stats.num_device_free = 10;
        stats.num_sync_all_streams = 11;
        stats
    }

    /// PyTorch's `memory_summary` layout: the text is pinned whole, so that building it from
    /// the statistics table cannot move a row, a label or a column.
    #[test]
    fn the_summary_text_is_pinned() {
        let text = Summary(&distinct_stats()).to_string();
        assert_eq!(text, EXPECTED);
    }

    const EXPECTED: &str = r#"|==================================================================================|
| burn-caching-alloc memory summary                                                |
|----------------------------------------------------------------------------------|
| Out-of-memory errors: 7                 | Device allocation retries: 8           |
| Device allocations: 9                   | Device frees: 10                       |
|==================================================================================|
| Metric                   |   Cur Usage |  Peak Usage |   Tot Alloc |   Tot Freed |
|----------------------------------------------------------------------------------|
| Allocated memory         |    1.50 MiB |    2.50 MiB |    3.00 MiB |    1.50 MiB |
|       from large pool    |  512.00 KiB |    1.00 MiB |    1.00 MiB |  512.00 KiB |
|       from small pool    |    1.00 MiB |    2.00 MiB |    2.00 MiB |    1.00 MiB |
|----------------------------------------------------------------------------------|
| Active memory            |    3.50 MiB |    5.50 MiB |    7.00 MiB |    3.50 MiB |
|       from large pool    |    1.50 MiB |    3.00 MiB |    3.00 MiB |    1.50 MiB |
|       from small pool    |    2.00 MiB |    4.00 MiB |    4.00 MiB |    2.00 MiB |
|----------------------------------------------------------------------------------|
| Requested memory         |    5.50 MiB |    8.50 MiB |   11.00 MiB |    5.50 MiB |
|       from large pool    |    2.50 MiB |    5.00 MiB |    5.00 MiB |    2.50 MiB |
|       from small pool    |    3.00 MiB |    6.00 MiB |    6.00 MiB |    3.00 MiB |
|----------------------------------------------------------------------------------|
| Reserved memory          |    7.50 MiB |   11.50 MiB |   15.00 MiB |    7.50 MiB |
|       from large pool    |    3.50 MiB |    7.00 MiB |    7.00 MiB |    3.50 MiB |
|       from small pool    |    4.00 MiB |    8.00 MiB |    8.00 MiB |    4.00 MiB |
|----------------------------------------------------------------------------------|
| Non-releasable memory    |    9.50 MiB |   14.50 MiB |   19.00 MiB |    9.50 MiB |
|       from large pool    |    4.50 MiB |    9.00 MiB |    9.00 MiB |    4.50 MiB |
|       from small pool    |    5.00 MiB |   10.00 MiB |   10.00 MiB |    5.00 MiB |
|----------------------------------------------------------------------------------|
| Allocations              |    12058646 |    18350102 |    24117270 |    12058624 |
|       from large pool    |     5767190 |    11534336 |    11534358 |     5767168 |
|       from small pool    |     6291456 |    12582912 |    12582912 |     6291456 |
|----------------------------------------------------------------------------------|
| Active allocs            |    14155802 |    21495834 |    28311578 |    14155776 |
|       from large pool    |     6815770 |    13631488 |    13631514 |     6815744 |
|       from small pool    |     7340032 |    14680064 |    14680064 |     7340032 |
|----------------------------------------------------------------------------------|
| Reserved segments        |    16252958 |    24641566 |    32505886 |    16252928 |
|       from large pool    |     7864350 |    15728640 |    15728670 |     7864320 |
|       from small pool    |     8388608 |    16777216 |    16777216 |     8388608 |
|----------------------------------------------------------------------------------|
| Non-releasable allocs    |    18350114 |    27787298 |    36700194 |    18350080 |
|       from large pool    |     8912930 |    17825792 |    17825826 |     8912896 |
|       from small pool    |     9437184 |    18874368 |    18874368 |     9437184 |
|----------------------------------------------------------------------------------|
| Oversize allocations     |           5 |           5 |           5 |           0 |
| Oversize segments        |           5 |           6 |           6 |           1 |
|==================================================================================|
"#;
}
