//! The benchmark suite's library: generators are deterministic and well formed, and every
//! allocator replays every built-in trace with the trace's own peak of live requests.

use burn_caching_alloc::alloc::{Trace, TraceEvent};
use burn_caching_alloc::replay::many_params::{ManyParamsConfig, many_params};
use burn_caching_alloc::replay::random::{RandomTraceConfig, random_lifetimes};
use burn_caching_alloc::replay::training::{cnn_mnist, mlp_mnist};
use burn_caching_alloc::replay::transformer::transformer_varlen;
use burn_caching_alloc::replay::{
    AllocatorKind, BUILTIN_NAMES, MeasureOptions, Program, TraceError, builtin_trace,
    builtin_traces, measure,
};
use std::collections::HashSet;

/// Walks a trace and checks it by hand (independently of `Program::compile`): every free
/// names a live malloc, no id is reused while live, sizes are positive, nothing is left live.
/// Returns (mallocs, peak live bytes).
fn check_well_formed(name: &str, trace: &Trace) -> (usize, u64) {
    let mut live = std::collections::HashMap::new();
    let (mut mallocs, mut current, mut peak) = (0usize, 0u64, 0u64);
    for (i, event) in trace.events.iter().enumerate() {
        match *event {
            TraceEvent::Malloc { id, size, .. } => {
                assert!(size > 0, "{name}: event {i} mallocs zero bytes");
                assert!(
                    live.insert(id, size).is_none(),
                    "{name}: event {i} reuses live id {id}"
                );
                mallocs += 1;
                current += size;
                peak = peak.max(current);
            }
            TraceEvent::FreeRequested { id } => {
                let size = live.remove(&id);
                assert!(
                    size.is_some(),
                    "{name}: event {i} frees {id}, which is not live"
                );
                current -= size.unwrap_or(0);
            }
            ref other => panic!("{name}: a generator emitted {other:?}"),
        }
    }
    assert!(
        live.is_empty(),
        "{name}: {} allocations left live",
        live.len()
    );
    (mallocs, peak)
}

#[test]
fn generators_are_deterministic() {
    for name in BUILTIN_NAMES {
        let first = builtin_trace(name).expect("a built-in name");
        let second = builtin_trace(name).expect("a built-in name");
        assert_eq!(first, second, "{name} differs between two generations");
    }
    assert_eq!(mlp_mnist(3), mlp_mnist(3));
    assert_eq!(cnn_mnist(3), cnn_mnist(3));
}

#[test]
fn seeds_change_the_random_generators() {
    assert_ne!(transformer_varlen(5, 1), transformer_varlen(5, 2));
    let random = RandomTraceConfig {
        mallocs: 500,
        ..RandomTraceConfig::default()
    };
    assert_ne!(random_lifetimes(random, 1), random_lifetimes(random, 2));
    let params = ManyParamsConfig {
        params: 100,
        steps: 3,
        ..ManyParamsConfig::default()
    };
    assert_ne!(many_params(params, 1), many_params(params, 2));
}

#[test]
fn generated_traces_are_well_formed() {
    for named in builtin_traces() {
        let (mallocs, peak) = check_well_formed(&named.name, &named.trace);
        let program = Program::compile(&named.trace).expect("a well-formed trace compiles");
        assert_eq!(program.mallocs(), mallocs, "{}", named.name);
        assert_eq!(program.peak_allocated(), peak, "{}", named.name);
        assert_eq!(program.appended_frees(), 0, "{}", named.name);
        assert_eq!(
            program.ops().len(),
            named.trace.events.len(),
            "{}",
            named.name
        );
        let curve = program.allocated_curve();
        assert_eq!(curve.iter().copied().max(), Some(peak), "{}", named.name);
        assert_eq!(curve[program.peak_op()], peak, "{}", named.name);
        assert_eq!(curve.last(), Some(&0), "{}", named.name);
    }
}

#[test]
fn the_fixed_shape_loops_repeat_the_same_step() {
    // Steps after the first (which creates the Adam moments) are identical in sizes.
    let sizes = |trace: &Trace| -> Vec<u64> {
        trace
            .events
            .iter()
            .filter_map(|e| match e {
                TraceEvent::Malloc { size, .. } => Some(*size),
                _ => None,
            })
            .collect()
    };
    let (two, three) = (sizes(&mlp_mnist(2)), sizes(&mlp_mnist(3)));
    let step = three.len() - two.len();
    assert_eq!(three[three.len() - step..], two[two.len() - step..]);
}

/// A malloc input as the generators write it (no outcome fields).
fn malloc(id: u64, size: u64) -> TraceEvent {
    TraceEvent::Malloc {
        id,
        size,
        stream: 0,
        block_size: 0,
        address: 0,
    }
}

#[test]
fn malformed_traces_are_rejected() {
    let trace = |events| Trace { events, dropped: 0 };
    assert_eq!(
        Program::compile(&trace(vec![
            malloc(1, 10),
            TraceEvent::FreeRequested { id: 2 }
        ]))
        .unwrap_err(),
        TraceError::FreeOfDeadAllocation { index: 1, id: 2 }
    );
    assert_eq!(
        Program::compile(&trace(vec![malloc(1, 10), malloc(1, 10)])).unwrap_err(),
        TraceError::DuplicateAllocation { index: 1, id: 1 }
    );
    assert_eq!(
        Program::compile(&trace(vec![malloc(1, 0)])).unwrap_err(),
        TraceError::ZeroSize { index: 0, id: 1 }
    );
    assert_eq!(
        Program::compile(&trace(vec![])).unwrap_err(),
        TraceError::Empty
    );
    // A recorded ring that dropped events may free what it no longer shows.
    let ring = Trace {
        events: vec![TraceEvent::FreeRequested { id: 9 }, malloc(1, 10)],
        dropped: 5,
    };
    let program = Program::compile(&ring).expect("lenient on a truncated ring");
    assert_eq!(program.skipped_events(), 1);
    assert_eq!(program.appended_frees(), 1);
}

#[test]
fn every_allocator_replays_every_builtin_trace() {
    let options = MeasureOptions::new(0);
    for named in builtin_traces() {
        let program = Program::compile(&named.trace).expect("built-in traces compile");
        let mut seen = HashSet::new();
        for kind in AllocatorKind::ALL {
            let m = measure(&named.name, &program, kind, &options)
                .unwrap_or_else(|e| panic!("{} through {kind}: {e}", named.name));
            assert_eq!(m.ooms, 0, "{} through {kind}", named.name);
            assert_eq!(
                m.peak_allocated,
                program.peak_allocated(),
                "{} through {kind}: the allocator's live bytes at the trace's peak",
                named.name
            );
            assert!(
                m.peak_reserved >= m.peak_allocated,
                "{} through {kind}: reserved {} below allocated {}",
                named.name,
                m.peak_reserved,
                m.peak_allocated
            );
            assert!(m.device_allocs > 0, "{} through {kind}", named.name);
            assert_eq!(m.reserved_curve.len(), program.ops().len());
            assert_eq!(m.reserved_curve.iter().max(), Some(&m.peak_reserved));
            seen.insert(m.peak_allocated);
        }
        assert_eq!(seen.len(), 1, "{}: peak allocated differs", named.name);
    }
}

#[test]
fn engine_frees_segments_on_empty_cache_in_a_trace() {
    let trace = Trace {
        events: vec![
            malloc(1, 3 << 20),
            malloc(2, 1000),
            TraceEvent::FreeRequested { id: 1 },
            TraceEvent::FreeRequested { id: 2 },
            TraceEvent::EmptyCache,
        ],
        dropped: 0,
    };
    let program = Program::compile(&trace).expect("well formed");
    let options = MeasureOptions {
        capacity: 1 << 30,
        ..MeasureOptions::new(1)
    };
    for kind in AllocatorKind::ALL {
        let m = measure("t", &program, kind, &options).expect("replays");
        assert_eq!(m.peak_allocated, (3 << 20) + 1000, "{kind}");
        assert_eq!(
            m.device_allocs, m.device_frees,
            "{kind}: empty_cache returns everything"
        );
        assert_eq!(m.reserved_curve.last(), Some(&0), "{kind}");
    }
}
