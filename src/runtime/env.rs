//! The environment variables a caching server reads when CubeCL opens its device.
//!
//! - `BURN_CACHING_ALLOC_CONF`: the engine's configuration string (PyTorch's
//!   `PYTORCH_CUDA_ALLOC_CONF` keys), for every device opened;
//! - `BURN_CACHING_ALLOC_TRACE=path`: records the engine's history (and hands every freed CubeCL
//!   slice back to the engine before the next reservation, so the trace holds every tensor);
//!   `backend::write_trace` writes it to `path`.

use super::error::DriverError;
use crate::alloc::{AllocatorConfig, CONFIG_ENV};

/// The trace file variable (see the module docs).
pub(crate) const TRACE_ENV: &str = "BURN_CACHING_ALLOC_TRACE";

/// The engine configuration every device starts with: `BURN_CACHING_ALLOC_CONF`, with history
/// recording on when `BURN_CACHING_ALLOC_TRACE` is set.
pub(crate) fn config_from_env() -> Result<AllocatorConfig, DriverError> {
    let mut config = AllocatorConfig::from_env().map_err(|source| DriverError::Config {
        var: CONFIG_ENV,
        source,
    })?;
    if std::env::var_os(TRACE_ENV).is_some() {
        config.record_history = true;
    }
    Ok(config)
}
