//! CUDA driver failures as the engine's [`DeviceError`].

use std::panic::{AssertUnwindSafe, catch_unwind};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;

use crate::device::DeviceError;

/// The name of a CUDA error code, e.g. `CUDA_ERROR_INVALID_VALUE`, without calling the driver.
pub(crate) fn error_name(code: CUresult) -> String {
    format!("{code:?}")
}

/// Turns a failed driver call into the engine's error. Out of memory while allocating
/// `requested` bytes enters the engine's miss path; anything else names the call and the code.
pub(crate) fn device_error(call: &str, err: DriverError, requested: Option<u64>) -> DeviceError {
    match (err.0, requested) {
        (CUresult::CUDA_ERROR_OUT_OF_MEMORY, Some(requested)) => {
            DeviceError::OutOfMemory { requested }
        }
        (code, _) => DeviceError::Driver(format!("{call} failed: {}", error_name(code))),
    }
}

/// Runs `f`, which calls into cudarc, turning a panic (cudarc panics when the driver library
/// or one of its symbols is missing) into an error instead of unwinding through the caller.
pub(crate) fn guarded<T>(
    call: &str,
    f: impl FnOnce() -> Result<T, DeviceError>,
) -> Result<T, DeviceError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(DeviceError::Driver(format!(
            "{call} failed: the CUDA driver library could not be used"
        )))
    })
}

/// `guarded` for a plain driver call: `call` names it in the error.
pub(crate) fn driver_call<T>(
    call: &str,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T, DeviceError> {
    guarded(call, || f().map_err(|err| device_error(call, err, None)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_while_allocating_enters_the_miss_path() {
        let err = device_error(
            "cuMemAlloc",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            Some(4096),
        );
        assert_eq!(err, DeviceError::OutOfMemory { requested: 4096 });
    }

    #[test]
    fn other_errors_name_the_call_and_the_code() {
        let err = device_error(
            "cuMemAlloc",
            DriverError(CUresult::CUDA_ERROR_INVALID_VALUE),
            Some(4096),
        );
        assert_eq!(
            err,
            DeviceError::Driver("cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE".to_string())
        );
    }

    #[test]
    fn out_of_memory_outside_an_allocation_is_a_driver_error() {
        let err = device_error(
            "cuEventCreate",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            None,
        );
        assert_eq!(
            err,
            DeviceError::Driver("cuEventCreate failed: CUDA_ERROR_OUT_OF_MEMORY".to_string())
        );
    }

    #[test]
    fn a_panicking_driver_call_becomes_an_error() {
        let result: Result<(), DeviceError> = guarded("cuMemAlloc", || panic!("no libcuda"));
        assert_eq!(
            result,
            Err(DeviceError::Driver(
                "cuMemAlloc failed: the CUDA driver library could not be used".to_string()
            ))
        );
    }

    #[test]
    fn driver_call_maps_failures_without_the_miss_path() {
        let result: Result<(), DeviceError> = driver_call("cuStreamCreate", || {
            Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        });
        assert_eq!(
            result,
            Err(DeviceError::Driver(
                "cuStreamCreate failed: CUDA_ERROR_OUT_OF_MEMORY".to_string()
            ))
        );
    }
}
