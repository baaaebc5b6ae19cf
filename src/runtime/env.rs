//! The environment variables a caching server reads when CubeCL opens its device.
//!
//! - `BURN_CACHING_ALLOC_CONF`: the engine's configuration string (PyTorch's
//!   `PYTORCH_CUDA_ALLOC_CONF` keys), for every device opened without a configuration given in
//!   code (`backend::configure`, which takes precedence);
//! - `BURN_CACHING_ALLOC_TRACE=path`: records the engine's history (and hands every freed CubeCL
//!   slice back to the engine before the next reservation, so the trace holds every tensor);
//!   `backend::write_trace` writes it to `path`. Set but empty, it names no file: a warning,
//!   and the slow diagnostic mode stays off;
//! - `BURN_CACHING_ALLOC_OOM_SNAPSHOT=path`: writes a PyTorch-format snapshot to `path` at
//!   the device's first out-of-memory (with the history and stacks when they are recorded).
//!
//! PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING` is not read; set without the configuration key
//! `no_cuda_memory_caching`, it is warned about.

use super::error::DriverError;
use crate::alloc::{AllocatorConfig, CONFIG_ENV, RecordMode};

/// PyTorch's switch for its uncached mode. Not read as a setting: the crate's settings are its
/// own variables, so that a process running PyTorch beside Burn does not change both
/// allocators with one variable. Set without `no_cuda_memory_caching`, it is warned about.
const PYTORCH_NO_CACHING_ENV: &str = "PYTORCH_NO_CUDA_MEMORY_CACHING";

/// The trace file variable (see the module docs).
pub const TRACE_ENV: &str = "BURN_CACHING_ALLOC_TRACE";

/// The out-of-memory snapshot variable (see the module docs).
pub const OOM_SNAPSHOT_ENV: &str = "BURN_CACHING_ALLOC_OOM_SNAPSHOT";

/// The path `BURN_CACHING_ALLOC_OOM_SNAPSHOT` names, if set and not empty.
pub(crate) fn oom_snapshot_path() -> Option<std::path::PathBuf> {
    std::env::var_os(OOM_SNAPSHOT_ENV)
        .filter(|p| !p.is_empty())
        .map(Into::into)
}

/// The path `BURN_CACHING_ALLOC_TRACE` names, if set and not empty (see the module docs).
pub(crate) fn trace_path() -> Option<std::path::PathBuf> {
    trace_path_from(std::env::var_os(TRACE_ENV))
}

/// Whether `BURN_CACHING_ALLOC_TRACE` names a path ([`trace_path`] without its warning about an
/// empty value, which [`startup_config`] gives once per device).
pub(crate) fn traces_every_tensor() -> bool {
    std::env::var_os(TRACE_ENV).is_some_and(|value| !value.is_empty())
}

/// [`trace_path`] for the variable's value `value`; an empty one is warned about.
fn trace_path_from(value: Option<std::ffi::OsString>) -> Option<std::path::PathBuf> {
    match value {
        Some(value) if value.is_empty() => {
            log::warn!(
                "caching allocator: {TRACE_ENV} is set but empty, which names no file: history \
                 is not recorded (set it to a path to record a trace)"
            );
            None
        }
        value => value.map(Into::into),
    }
}

/// Whether `BURN_CACHING_ALLOC_CONF` sets `expandable_segments` itself (to either value). When it
/// does not, and no configuration was given in code, a device with virtual memory (CUDA with
/// virtual memory management) starts with expandable segments on: in the replay of the
/// generated `transformer-varlen` trace they reserve 0.52x of CubeCL's pools where the default
/// rules reserve 1.46x, and `tests/cuda_fake` runs their map, grow and unmap path against the
/// fake driver's contracts. `expandable_segments:False` is PyTorch's default, one key away.
pub(crate) fn sets_expandable_segments() -> bool {
    std::env::var(CONFIG_ENV).is_ok_and(|text| names_key(&text, "expandable_segments"))
}

/// Whether the configuration string `text` has an item with key `key`.
fn names_key(text: &str, key: &str) -> bool {
    text.split(',')
        .filter_map(|item| item.split_once(':'))
        .any(|(k, _)| k.trim() == key)
}

/// The engine configuration a device starts with: `configured` (given in code before the device
/// opened) if any, else `BURN_CACHING_ALLOC_CONF` (not read at all when `configured` is given);
/// either way with history recording on when `BURN_CACHING_ALLOC_TRACE` names a path.
pub(crate) fn startup_config(
    configured: Option<AllocatorConfig>,
) -> Result<AllocatorConfig, DriverError> {
    let mut config = match configured {
        Some(config) => config,
        None => AllocatorConfig::from_env().map_err(|source| DriverError::Config {
            var: CONFIG_ENV,
            source,
        })?,
    };
    if trace_path().is_some() {
        config.history = config.history.with_enabled(RecordMode::All);
    }
    if std::env::var_os(PYTORCH_NO_CACHING_ENV).is_some() && !config.no_cuda_memory_caching {
        log::warn!(
            "caching allocator: {PYTORCH_NO_CACHING_ENV} is set, but this allocator reads \
             {CONFIG_ENV} only: set {CONFIG_ENV}=no_cuda_memory_caching:True to cache nothing"
        );
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::{names_key, trace_path_from};

    #[test]
    fn the_expandable_key_is_found_whatever_its_value_and_only_as_a_key() {
        assert!(names_key(
            "expandable_segments:False",
            "expandable_segments"
        ));
        assert!(names_key(
            "max_split_size_mb:64, expandable_segments:true",
            "expandable_segments"
        ));
        assert!(!names_key("max_split_size_mb:64", "expandable_segments"));
        assert!(!names_key("", "expandable_segments"));
        assert!(!names_key(
            "roundup_power2_divisions:[1:2,>:4]",
            "expandable_segments"
        ));
    }

    /// Issue 20 point 6: `BURN_CACHING_ALLOC_TRACE=""` switched the slow diagnostic mode on
    /// (every reservation reclaims) for a trace that could never be written.
    #[test]
    fn an_empty_trace_variable_names_no_path() {
        assert_eq!(trace_path_from(Some("".into())), None);
        assert_eq!(trace_path_from(None), None);
        assert_eq!(
            trace_path_from(Some("run.json.gz".into())),
            Some("run.json.gz".into())
        );
    }
}
