//! `ncclGetVersion` and the error strings.

use std::ffi::{c_char, c_int, c_void};

use super::NCCL_SUCCESS;
use crate::state::call as cuda_call;

/// NCCL 2.23.4, as `ncclGetVersion` encodes it.
pub const VERSION: c_int = 22304;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> u32 {
    cuda_call("ncclGetVersion", |_| {
        if !version.is_null() {
            unsafe { version.write(VERSION) };
        }
        NCCL_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetErrorString(result: u32) -> *const c_char {
    let text: &'static std::ffi::CStr = match result {
        0 => c"no error",
        1 => c"unhandled cuda error",
        2 => c"unhandled system error",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    text.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    c"".as_ptr()
}
