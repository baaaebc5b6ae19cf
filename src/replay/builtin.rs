//! The built-in trace set the benchmarks replay when given no trace files.

use super::many_params::{ManyParamsConfig, many_params};
use super::random::{RandomTraceConfig, random_lifetimes};
use super::training::{cnn_mnist, mlp_mnist};
use super::transformer::transformer_varlen;
use crate::alloc::Trace;

/// The seed of every built-in generator: fixed, so the set is the same everywhere.
pub const BUILTIN_SEED: u64 = 0x5eed_2026;

/// A trace with the name the reports show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedTrace {
    pub name: String,
    pub trace: Trace,
}

/// Names of the built-in traces, in report order.
pub const BUILTIN_NAMES: [&str; 5] = [
    "mlp-mnist",
    "cnn-mnist",
    "transformer-varlen",
    "random-loguniform",
    "many-params",
];

/// One built-in trace by name, or `None` for an unknown name.
pub fn builtin_trace(name: &str) -> Option<Trace> {
    Some(match name {
        "mlp-mnist" => mlp_mnist(300),
        "cnn-mnist" => cnn_mnist(300),
        "transformer-varlen" => transformer_varlen(100, BUILTIN_SEED),
        "random-loguniform" => random_lifetimes(RandomTraceConfig::default(), BUILTIN_SEED),
        "many-params" => many_params(ManyParamsConfig::default(), BUILTIN_SEED),
        _ => return None,
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
