//! `nvrtcVersion` and `nvrtcGetErrorString`.

use std::ffi::{CStr, c_char, c_int};

use super::{NVRTC_ERROR_INVALID_INPUT, NVRTC_SUCCESS, nvrtc_call, nvrtc_reject};

/// NVRTC 12.8, the CUDA version the fake driver reports (`cuDriverGetVersion`: 12080).
pub const VERSION: (c_int, c_int) = (12, 8);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> u32 {
    nvrtc_call("nvrtcVersion", |fake| {
        if major.is_null() || minor.is_null() {
            return nvrtc_reject(
                fake,
                "nvrtcVersion",
                NVRTC_ERROR_INVALID_INPUT,
                "a NULL output",
            );
        }
        unsafe {
            major.write(VERSION.0);
            minor.write(VERSION.1);
        }
        NVRTC_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvrtcGetErrorString(result: u32) -> *const c_char {
    let text: &'static CStr = match result {
        0 => c"NVRTC_SUCCESS",
        1 => c"NVRTC_ERROR_OUT_OF_MEMORY",
        2 => c"NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
        3 => c"NVRTC_ERROR_INVALID_INPUT",
        4 => c"NVRTC_ERROR_INVALID_PROGRAM",
        5 => c"NVRTC_ERROR_INVALID_OPTION",
        6 => c"NVRTC_ERROR_COMPILATION",
        7 => c"NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
        8 => c"NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
        9 => c"NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
        10 => c"NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
        11 => c"NVRTC_ERROR_INTERNAL_ERROR",
        _ => c"NVRTC_ERROR unknown",
    };
    text.as_ptr()
}
