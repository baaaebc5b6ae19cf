//! `replay --tune` and the configuration each row carries: the grid, the ranking, the
//! recommendation, on built-in traces through `caching-stack`.

use burn_caching_alloc::alloc::AllocatorConfig;
use replay::report::{JsonRow, json_rows};
use replay::transformer::transformer_varlen;
use replay::tune::{TuneReport, gc_fraction, recommend, tune, tune_grid, tune_traces};
use replay::{
    AllocatorKind, BUILTIN_SEED, MeasureOptions, Program, SimReplayDevice, builtin_trace, measure,
};

const GIB: u64 = 1 << 30;
const CAPACITY: u64 = 24 * GIB;

fn program(name: &str) -> Program {
    Program::compile(&builtin_trace(name).expect("a built-in trace")).expect("compiles")
}

/// A 12-step variable-length transformer: the fragmentation case, small enough for a debug
/// build.
fn short_transformer() -> Program {
    Program::compile(&transformer_varlen(12, BUILTIN_SEED)).expect("compiles")
}

/// Every row is ranked no worse than the next: fewer OOMs, then lower peak reserved, then
/// fewer device calls.
fn assert_ranked(report: &TuneReport) {
    for pair in report.rows.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let key = |r: &replay::tune::TuneRow| {
            (
                r.measurement.ooms,
                r.measurement.peak_reserved,
                r.device_calls(),
            )
        };
        assert!(
            key(a) <= key(b),
            "{}: {:?} before {:?}",
            report.trace,
            a.config,
            b.config
        );
    }
}

#[test]
fn the_grid_covers_every_knob_with_the_default_first() {
    // 1 GiB live on 24 GiB: 1.5 GiB / 24 GiB = 0.0625, rounded up to 0.1.
    assert_eq!(gc_fraction(GIB, CAPACITY), 0.1);
    assert_eq!(gc_fraction(1, CAPACITY), 0.05, "at least one step");
    assert_eq!(
        gc_fraction(16 * GIB, CAPACITY),
        1.0,
        "no room below the device"
    );

    let grid = tune_grid(GIB, CAPACITY);
    assert_eq!(grid[0], "", "the default rules come first");
    for wanted in [
        "expandable_segments:true",
        "max_split_size_mb:128",
        "roundup_power2_divisions:4",
        "garbage_collection_threshold:0.8,per_process_memory_fraction:0.1",
    ] {
        assert!(
            grid.iter().any(|c| c == wanted),
            "{wanted} missing: {grid:?}"
        );
    }
    // Without room for a fraction below 1, PyTorch's garbage collection never runs: no rows.
    let grid = tune_grid(16 * GIB, CAPACITY);
    assert!(
        !grid.iter().any(|c| c.contains("garbage_collection")),
        "{grid:?}"
    );
}

#[test]
fn tuning_the_varlen_transformer_finds_a_configuration_that_beats_the_default() {
    let device = SimReplayDevice::new(CAPACITY);
    let program = short_transformer();
    let grid = tune_grid(program.peak_allocated(), CAPACITY);
    let report = tune(&device, "transformer-varlen-12", &program, &grid, 0).expect("tunes");

    assert_ranked(&report);
    // Every configuration is either replayed or skipped with the engine's reason.
    assert_eq!(report.rows.len() + report.skipped.len(), grid.len());
    for (config, reason) in &report.skipped {
        let err = AllocatorConfig::parse(config).expect_err("only rejected strings are skipped");
        assert_eq!(*reason, err.to_string());
    }
    for row in &report.rows {
        AllocatorConfig::parse(&row.config).expect("a replayed configuration parses");
        assert_eq!(row.measurement.allocator, AllocatorKind::CachingStack);
        assert_eq!(row.measurement.config.as_deref(), Some(row.config.as_str()));
        assert_eq!(row.measurement.peak_allocated, program.peak_allocated());
    }
    let default = report.default_row().expect("the default is replayed");
    let best = report.best().expect("rows");
    // Variable shapes fragment PyTorch's default segments; a rounding or collection rule
    // does better on this trace.
    assert!(
        best.measurement.peak_reserved < default.measurement.peak_reserved,
        "best {:?} {} vs default {}",
        best.config,
        best.measurement.peak_reserved,
        default.measurement.peak_reserved
    );
    assert_ne!(best.config, "");
    assert_eq!(
        recommend(std::slice::from_ref(&report)),
        Some(best.config.clone())
    );
}

#[test]
fn a_fixed_shape_loop_keeps_the_default_and_the_recommendation_spans_traces() {
    let device = SimReplayDevice::new(CAPACITY);
    let traces = vec![
        ("mlp-mnist".to_string(), program("mlp-mnist")),
        ("transformer-varlen-12".to_string(), short_transformer()),
    ];
    let reports = tune_traces(&device, &traces, 0).expect("tunes");
    assert_eq!(reports.len(), 2);
    let mlp = &reports[0];
    assert_ranked(mlp);
    // Nothing beats the default on a fixed-shape loop, and ties keep the grid's order.
    assert_eq!(mlp.best().map(|r| r.config.as_str()), Some(""));
    // One grid for all traces: the same configurations on both.
    let configs = |r: &TuneReport| {
        let mut c: Vec<String> = r.rows.iter().map(|row| row.config.clone()).collect();
        c.sort();
        c
    };
    assert_eq!(configs(&reports[0]), configs(&reports[1]));

    // The recommendation minimises the mean relative peak over both traces.
    let recommended = recommend(&reports).expect("a recommendation");
    let score = |config: &str| -> f64 {
        reports
            .iter()
            .map(|r| {
                let best = r
                    .rows
                    .iter()
                    .map(|x| x.measurement.peak_reserved)
                    .min()
                    .unwrap();
                let this = r.rows.iter().find(|x| x.config == config).unwrap();
                this.measurement.peak_reserved as f64 / best as f64
            })
            .sum()
    };
    for row in &reports[0].rows {
        assert!(
            score(&recommended) <= score(&row.config),
            "{recommended:?} recommended over {:?}",
            row.config
        );
    }
}

#[test]
fn every_row_carries_its_configuration_string() {
    let program = program("mlp-mnist");
    let options = MeasureOptions::new(0)
        .with_config(" roundup_power2_divisions:4 ")
        .expect("parses");
    let stack = measure("mlp-mnist", &program, AllocatorKind::CachingStack, &options).unwrap();
    let engine = measure("mlp-mnist", &program, AllocatorKind::Caching, &options).unwrap();
    let cubecl = measure(
        "mlp-mnist",
        &program,
        AllocatorKind::CubeclSubslices,
        &options,
    )
    .unwrap();
    assert_eq!(stack.config.as_deref(), Some("roundup_power2_divisions:4"));
    assert_eq!(engine.config.as_deref(), Some("roundup_power2_divisions:4"));
    assert_eq!(
        cubecl.config, None,
        "the engine's rules do not apply to CubeCL's pools"
    );

    let rows = json_rows(&[stack, cubecl]);
    let text = serde_json::to_string(&rows).unwrap();
    assert!(
        text.contains(r#""config":"roundup_power2_divisions:4""#),
        "{text}"
    );
    assert!(text.contains(r#""config":null"#), "{text}");
    let back: Vec<JsonRow> = serde_json::from_str(&text).unwrap();
    assert_eq!(back, rows);

    // A string the engine rejects is an error, not a silent default.
    assert!(
        MeasureOptions::new(0)
            .with_config("max_split_size_mb:x")
            .is_err()
    );
}

#[test]
fn the_tables_have_one_cell_per_header() {
    let program = program("mlp-mnist");
    let options = MeasureOptions::new(0);
    let rows: Vec<_> = [AllocatorKind::Caching, AllocatorKind::CubeclSubslices]
        .into_iter()
        .map(|kind| measure("mlp-mnist", &program, kind, &options).unwrap())
        .collect();
    let device = SimReplayDevice::new(CAPACITY);
    let grid = vec![String::new(), "roundup_power2_divisions:4".to_string()];
    let report = tune(&device, "mlp-mnist", &program, &grid, 0).unwrap();
    for table in [
        replay::report::markdown_table(&rows),
        replay::tune::tune_table(&report),
    ] {
        let lines: Vec<&str> = table.lines().filter(|l| l.starts_with('|')).collect();
        assert!(lines.len() >= 4, "{table}");
        let cells = |line: &str| line.matches('|').count();
        for line in &lines {
            assert_eq!(cells(line), cells(lines[0]), "{table}");
        }
    }
}
