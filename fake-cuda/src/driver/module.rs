//! Modules, functions and kernel launches (which do not run on the fake).

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::{check_out, out};
use crate::codes::*;
use crate::state::{FUNCTION_BASE, MODULE_BASE, call};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> u32 {
    call("cuModuleLoadData", |fake| {
        let d = tri!(fake.context("cuModuleLoadData"));
        tri!(check_out(fake, "cuModuleLoadData", module));
        if image.is_null() {
            return fake.reject("cuModuleLoadData", INVALID_VALUE, "no image");
        }
        let handle = fake.next_handle(MODULE_BASE);
        fake.modules.insert(handle, d);
        unsafe { out(module, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    _name: *const c_char,
) -> u32 {
    call("cuModuleGetFunction", |fake| {
        let _ = tri!(fake.context("cuModuleGetFunction"));
        tri!(check_out(fake, "cuModuleGetFunction", function));
        if !fake.modules.contains_key(&(module as u64)) {
            return fake.reject("cuModuleGetFunction", INVALID_HANDLE, "not a loaded module");
        }
        let handle = fake.next_handle(FUNCTION_BASE);
        fake.functions.insert(handle, module as u64);
        unsafe { out(function, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> u32 {
    call("cuModuleUnload", |fake| {
        let _ = tri!(fake.context("cuModuleUnload"));
        if fake.modules.remove(&(module as u64)).is_none() {
            return fake.reject("cuModuleUnload", INVALID_HANDLE, "not a loaded module");
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetAttribute(
    _function: *mut c_void,
    _attribute: c_int,
    _value: c_int,
) -> u32 {
    call("cuFuncSetAttribute", |fake| {
        let _ = tri!(fake.context("cuFuncSetAttribute"));
        SUCCESS
    })
}

/// Kernels do not run on the fake: `CUDA_ERROR_NOT_SUPPORTED` (not a violation).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    _f: *mut c_void,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> u32 {
    call("cuLaunchKernel", |fake| {
        let _ = tri!(fake.context("cuLaunchKernel"));
        NOT_SUPPORTED
    })
}
