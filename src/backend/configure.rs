//! Configuration in code: `configure(&device, config)` before the device's first use.
//!
//! Precedence when a device opens: the configuration given to [`configure`] for that device,
//! else `BURN_CACHING_ALLOC_CONF`, else the defaults. `BURN_CACHING_ALLOC_TRACE` turns history
//! recording on in every case, and `BURN_CACHING_ALLOC_OOM_SNAPSHOT` applies in every case.
//! `configure` gives the configuration a device opens with (its first tensor, or any call of
//! this module's API): a later `configure` is an error, never a silent ignore. An open
//! device's settings change with `backend::set_allocator_settings`.

use crate::alloc::{AllocatorConfig, ConfigError};
use crate::runtime::registry;

use super::CachingDevice;

/// Why [`configure`] refused a configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigureError {
    /// The device is already open (or opening): its configuration was fixed then.
    #[error(
        "{device} is already open: configure gives the configuration a device opens with; call \
         it before the device's first use, or change the open device's settings with \
         backend::set_allocator_settings"
    )]
    AlreadyOpen {
        /// The device, as `Debug` prints it.
        device: String,
    },
    /// The configuration itself is not valid (or not for this device type).
    #[error("invalid allocator configuration for {device}: {source}")]
    Invalid {
        /// The device, as `Debug` prints it.
        device: String,
        /// What is wrong with it.
        source: ConfigError,
    },
}

/// Gives `device` the engine configuration `config`, used when the device opens instead of
/// `BURN_CACHING_ALLOC_CONF`. Call it before the device's first use; each device (CUDA or
/// wgpu, any index) takes its own. Calling it again before the device opens replaces the
/// configuration.
///
/// ```no_run
/// use burn_caching_alloc::alloc::AllocatorConfig;
/// use burn_caching_alloc::backend;
/// # fn example<D: backend::CachingDevice>(device: D) -> Result<(), Box<dyn std::error::Error>> {
///
/// backend::configure(&device, AllocatorConfig::parse("max_split_size_mb:64")?)?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`ConfigureError::AlreadyOpen`] when the device was already opened;
/// [`ConfigureError::Invalid`] when a memory fraction or collection threshold is out of
/// range, or the device type cannot serve the configuration (expandable segments on wgpu).
pub fn configure<Dev: CachingDevice>(
    device: &Dev,
    config: AllocatorConfig,
) -> Result<(), ConfigureError> {
    let invalid = |source| ConfigureError::Invalid {
        device: format!("{device:?}"),
        source,
    };
    validate(&config).map_err(invalid)?;
    Dev::check_config(&config).map_err(invalid)?;
    if registry::configure::<Dev::Memory>(device.to_id(), config) {
        Ok(())
    } else {
        Err(ConfigureError::AlreadyOpen {
            device: format!("{device:?}"),
        })
    }
}

/// The ranges `AllocatorConfig::parse` enforces, for a configuration built in code.
fn validate(config: &AllocatorConfig) -> Result<(), ConfigError> {
    let fraction = |key: &str, value: f64, one_allowed: bool| {
        let ok = value > 0.0 && (value < 1.0 || (one_allowed && value == 1.0));
        let range = if one_allowed { "(0, 1]" } else { "(0, 1)" };
        match ok {
            true => Ok(()),
            false => Err(ConfigError::InvalidValue {
                key: key.into(),
                value: value.to_string(),
                expected: format!("a number in {range}"),
            }),
        }
    };
    if let Some(value) = config.memory_fraction {
        fraction("per_process_memory_fraction", value, true)?;
    }
    if let Some(value) = config.garbage_collection_threshold {
        fraction("garbage_collection_threshold", value, false)?;
    }
    Ok(())
}
