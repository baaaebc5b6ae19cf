//! Traces recorded from real Burn training on `CachingWgpu`, embedded from `replay/traces/`.
//!
//! They were made with `BURN_CACHING_ALLOC_TRACE=FILE.json.gz`, by the MNIST showcase and by
//! `burn-side-by-side` (`bench-burn/`; the exact commands are in `replay/traces/README.md`). While recording, the runtime hands every
//! freed CubeCL slice back to the engine before the next reservation
//! ([`ReclaimPolicy::EveryReserve`](burn_caching_alloc::runtime::ReclaimPolicy::EveryReserve)),
//! so the trace holds every tensor Burn reserved and released, not only what missed CubeCL's
//! exact-size pool: a fair input for every allocator the replay compares.

use burn_caching_alloc::alloc::Trace;

/// Names of the recorded traces, in report order: the MNIST showcase's two (unfused
/// `CachingWgpu`, one epoch of 6,000 images), then `burn-side-by-side`'s four (fused
/// `CachingWgpu`, Burn's `nn` modules, 6 steps each).
pub const RECORDED_NAMES: [&str; 6] = [
    "mnist-mlp-wgpu",
    "mnist-cnn-wgpu",
    "burn-transformer-varlen-wgpu",
    "burn-conv-wgpu",
    "burn-lstm-wgpu",
    "burn-mnist-mlp-wgpu",
];

/// Every recorded trace's gzipped JSON, by name (the order of [`RECORDED_NAMES`]).
const RECORDED_FILES: [(&str, &[u8]); 6] = [
    (
        "mnist-mlp-wgpu",
        include_bytes!("../traces/mnist-mlp-wgpu.json.gz"),
    ),
    (
        "mnist-cnn-wgpu",
        include_bytes!("../traces/mnist-cnn-wgpu.json.gz"),
    ),
    (
        "burn-transformer-varlen-wgpu",
        include_bytes!("../traces/burn-transformer-varlen-wgpu.json.gz"),
    ),
    (
        "burn-conv-wgpu",
        include_bytes!("../traces/burn-conv-wgpu.json.gz"),
    ),
    (
        "burn-lstm-wgpu",
        include_bytes!("../traces/burn-lstm-wgpu.json.gz"),
    ),
    (
        "burn-mnist-mlp-wgpu",
        include_bytes!("../traces/burn-mnist-mlp-wgpu.json.gz"),
    ),
];

/// One recorded trace by name, or `None` for an unknown name.
pub fn recorded_trace(name: &str) -> Option<Trace> {
    let (_, bytes) = RECORDED_FILES.iter().find(|(file, _)| *file == name)?;
    // The files are part of the crate and checked by its tests: a broken one is a build defect.
    Some(Trace::from_json_gz(bytes).unwrap_or_else(|err| {
        panic!("replay/traces/{name}.json.gz is not a valid gzipped trace: {err}")
    }))
}

#[cfg(test)]
mod tests {
    use burn_caching_alloc::alloc::TraceEvent;

    use super::*;
    use crate::Program;

    /// (name, mallocs, frees) as `replay/traces/README.md` lists them.
    const LISTED: [(&str, usize, usize); 6] = [
        ("mnist-mlp-wgpu", 3_970, 3_955),
        ("mnist-cnn-wgpu", 8_502, 8_475),
        ("burn-transformer-varlen-wgpu", 2_322, 2_322),
        ("burn-conv-wgpu", 426, 426),
        ("burn-lstm-wgpu", 6_965, 6_965),
        ("burn-mnist-mlp-wgpu", 226, 226),
    ];

    #[test]
    fn every_recorded_trace_decodes_whole_and_matches_its_readme_row() {
        for (name, mallocs, frees) in LISTED {
            let trace = recorded_trace(name).expect("a recorded name");
            assert_eq!(
                trace.dropped, 0,
                "{name}: the ring overflowed while recording"
            );
            let count = |f: fn(&TraceEvent) -> bool| trace.events.iter().filter(|e| f(e)).count();
            assert_eq!(count(|e| matches!(e, TraceEvent::Malloc { .. })), mallocs);
            assert_eq!(
                count(|e| matches!(e, TraceEvent::FreeRequested { .. })),
                frees
            );
            let program = Program::compile(&trace).expect("compiles");
            assert_eq!(program.skipped_events(), 0, "{name}");
            assert_eq!(program.appended_frees(), mallocs - frees, "{name}");
        }
        assert_eq!(RECORDED_NAMES.len(), LISTED.len());
        for (name, (file, _)) in RECORDED_NAMES.iter().zip(&RECORDED_FILES) {
            assert_eq!(name, file);
        }
        assert!(recorded_trace("no-such-trace").is_none());
    }
}
