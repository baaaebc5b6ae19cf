//! Whether CUDA is usable here, and opening a device without panicking.

use std::panic::catch_unwind;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::driver::sys;

use super::error::{device_error, guarded};
use crate::device::DeviceError;
use crate::runtime::DriverError;

const NO_LIBCUDA: &str = "no CUDA driver library (libcuda) found on this machine";

/// What to do when there is no CUDA device.
const NO_CUDA_HINT: &str =
    "needs an NVIDIA GPU and its driver; without one, use the wgpu backend (CachingWgpu)";

/// Whether CUDA can be used here: `libcuda` loads and device 0 opens.
///
/// `Err` says why not, in one line: GPU tests print it when they skip, and the examples print
/// it with a hint to use the wgpu backend. The probe runs once per process. A missing
/// `libcuda` makes cudarc panic; that panic is caught here (the default hook may still print
/// its message once).
pub fn cuda_available() -> Result<(), DriverError> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    let probed = PROBE.get_or_init(|| {
        // SAFETY: only tries to load the library by name; calls no symbol.
        if !unsafe { sys::is_culib_present() } {
            return Err(NO_LIBCUDA.to_string());
        }
        match catch_unwind(|| CudaContext::new(0)) {
            Ok(Ok(_context)) => Ok(()),
            Ok(Err(err)) => Err(format!(
                "CUDA device 0 could not be opened: {}",
                super::error::error_name(err.0)
            )),
            Err(_) => Err("the CUDA driver library could not be loaded".to_string()),
        }
    });
    probed.clone().map_err(|reason| DriverError::NoDevice {
        api: "CUDA",
        reason,
        hint: NO_CUDA_HINT,
    })
}

/// How many CUDA devices this machine has (`cuDeviceGetCount`).
pub fn device_count() -> Result<i32, DriverError> {
    cuda_available()?;
    guarded("cuDeviceGetCount", || {
        cudarc::driver::result::device::get_count()
            .map_err(|err| device_error("cuDeviceGetCount", err, None))
    })
    .map_err(|err| DriverError::NoDevice {
        api: "CUDA",
        reason: err.to_string(),
        hint: NO_CUDA_HINT,
    })
}

/// Opens (retains) the primary context of the device with this ordinal and makes it current
/// on the calling thread. Errors instead of panicking when `libcuda` is missing.
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, DeviceError> {
    // SAFETY: only tries to load the library by name; calls no symbol.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Driver(NO_LIBCUDA.to_string()));
    }
    guarded("opening the CUDA device", || {
        // An ordinal past the last device is the caller's mistake, said as such (and never
        // handed to `cuDeviceGet`, whose answer names no count).
        let count = CudaContext::device_count()
            .map_err(|err| device_error("counting CUDA devices", err, None))?;
        if i64::try_from(ordinal).map_or(true, |ordinal| ordinal >= i64::from(count)) {
            return Err(DeviceError::Driver(format!(
                "there is no CUDA device {ordinal}: this machine has {count} \
                 (ordinals 0 to {})",
                i64::from(count) - 1
            )));
        }
        CudaContext::new(ordinal)
            .map_err(|err| device_error(&format!("opening CUDA device {ordinal}"), err, None))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_cuda_opening_a_device_is_an_error_with_the_probe_reason() {
        // With CUDA this test has nothing to check: `cuda_available` is Ok there.
        if let Err(reason) = cuda_available() {
            assert!(!reason.to_string().is_empty());
            assert!(matches!(open_context(0), Err(DeviceError::Driver(_))));
        }
    }
}
