//! Why a backend could not open a device or finish a driver call: one typed error for both
//! backends, each variant saying what failed and what to do. CubeCL's `ServerError` keeps the
//! message at its boundary (see the `From` impl).

use cubecl_common::backtrace::BackTrace;
use cubecl_runtime::server::ServerError;

use crate::alloc::ConfigError;
use crate::device::DeviceError;

/// What went wrong below the server: opening a device, a driver call, the configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// No usable device of this API is here (no driver library, no adapter, no GPU).
    #[error("no {api} device: {reason} ({hint})")]
    NoDevice {
        /// `"CUDA"` or `"wgpu"`.
        api: &'static str,
        /// What the probe found.
        reason: String,
        /// What to install or set to get one.
        hint: &'static str,
    },
    /// A call into the device API failed.
    #[error("{api}: {call} failed: {reason}")]
    Call {
        /// `"CUDA"`, `"NVRTC"` or `"wgpu"`.
        api: &'static str,
        /// The function or step that failed (`cuMemcpyDtoHAsync`, `request_device`, ...).
        call: &'static str,
        /// The API's own words (an error code or message).
        reason: String,
    },
    /// The device reported something the backend cannot work with.
    #[error("{api}: unsupported device: {reason}")]
    Unsupported {
        /// `"CUDA"` or `"wgpu"`.
        api: &'static str,
        /// What is missing or out of range.
        reason: String,
    },
    /// `BURN_CACHING_ALLOC_CONF` does not parse.
    #[error(
        "{var} is not a valid allocator configuration: {source} (unset it, or see the \
         README's configuration table)"
    )]
    Config {
        /// The environment variable read.
        var: &'static str,
        /// Why it was refused.
        source: ConfigError,
    },
    /// The device memory layer failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

impl DriverError {
    /// A failed call of `api`'s `call`, with the API's reason.
    pub(crate) fn call(api: &'static str, call: &'static str, reason: impl ToString) -> Self {
        Self::Call {
            api,
            call,
            reason: reason.to_string(),
        }
    }
}

impl From<DriverError> for ServerError {
    fn from(err: DriverError) -> Self {
        ServerError::Generic {
            reason: err.to_string(),
            backtrace: BackTrace::capture(),
        }
    }
}
