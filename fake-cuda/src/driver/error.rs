//! `cuGetErrorName` and `cuGetErrorString`.

use std::ffi::c_char;

use crate::codes::{self, *};

fn error_text(code: u32) -> &'static std::ffi::CStr {
    const_cstr(codes::name(code))
}

/// Interned NUL-terminated copies of the error names (leaked once each, a few dozen bytes).
fn const_cstr(name: &'static str) -> &'static std::ffi::CStr {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashMap<&'static str, &'static std::ffi::CStr>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    names.entry(name).or_insert_with(|| {
        Box::leak(
            std::ffi::CString::new(name)
                .expect("no NUL")
                .into_boxed_c_str(),
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: u32, text: *mut *const c_char) -> u32 {
    if !text.is_null() {
        unsafe { text.write(error_text(code).as_ptr()) };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: u32, text: *mut *const c_char) -> u32 {
    unsafe { cuGetErrorName(code, text) }
}
