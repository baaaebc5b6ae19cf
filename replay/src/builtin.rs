//! The built-in trace set the benchmarks replay when given no trace files: the generated
//! traces, then the ones recorded from Burn training ([`super::recorded`]).

use burn_caching_alloc::alloc::Trace;

use super::many_params::{ManyParamsConfig, many_params};
use super::random::{RandomTraceConfig, random_lifetimes};
use super::recorded::{RECORDED_NAMES, recorded_trace};
use super::training::{cnn_mnist, mlp_mnist};
use super::transformer::transformer_varlen;

/// The seed of every built-in generator: fixed, so the set is the same everywhere.
pub const BUILTIN_SEED: u64 = 0x5eed_2026;

/// A trace with the name the reports show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedTrace {
    pub name: String,
    pub trace: Trace,
}

/// Names of the generated traces, in report order.
pub const GENERATED_NAMES: [&str; 5] = [
    "mlp-mnist",
    "cnn-mnist",
    "transformer-varlen",
    "random-loguniform",
    "many-params",
];

/// Names of the whole built-in set (generated, then recorded), in report order.
pub const BUILTIN_NAMES: [&str; 11] = [
    GENERATED_NAMES[0],
    GENERATED_NAMES[1],
    GENERATED_NAMES[2],
    GENERATED_NAMES[3],
    GENERATED_NAMES[4],
    RECORDED_NAMES[0],
    RECORDED_NAMES[1],
    RECORDED_NAMES[2],
    RECORDED_NAMES[3],
    RECORDED_NAMES[4],
    RECORDED_NAMES[5],
];

/// One built-in trace by name, or `None` for an unknown name.
pub fn builtin_trace(name: &str) -> Option<Trace> {
    Some(match name {
        "mlp-mnist" => mlp_mnist(300),
        "cnn-mnist" => cnn_mnist(300),
        "transformer-varlen" => transformer_varlen(100, BUILTIN_SEED),
        "random-loguniform" => random_lifetimes(RandomTraceConfig::default(), BUILTIN_SEED),
        "many-params" => many_params(ManyParamsConfig::default(), BUILTIN_SEED),
        other => return recorded_trace(other),
    })
}

/// The whole built-in set, in report order.
pub fn builtin_traces() -> Vec<NamedTrace> {
    BUILTIN_NAMES
        .iter()
        .filter_map(|&name| {
            builtin_trace(name).map(|trace| NamedTrace {
                name: name.to_string(),
                trace,
            })
        })
        .collect()
}
