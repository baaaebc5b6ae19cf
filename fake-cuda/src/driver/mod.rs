//! The driver API functions the fake implements, exported under their C names (the versioned
//! names cudarc loads: `cuMemAlloc_v2`, ...).
//!
//! Every function runs under the fake's lock through [`call`], which counts it for fault
//! injection. Contract checks answer what the real driver answers and log a violation.
//!
//! The functions, by what they do: `device` (initialisation and device queries), `context`,
//! `peer` (peer access), `alloc` (device and pinned host memory), `virtual_memory`, `copy`,
//! `memset`, `stream`, `event`, `module` (modules and functions), `launch` (kernel launches)
//! and `error` (error names).
//!
//! [`call`]: crate::state::call

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::c_void;

use crate::codes::*;
use crate::state::Fake;

type Guard = std::sync::MutexGuard<'static, Fake>;

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(value) => value,
            Err(code) => return code,
        }
    };
}

unsafe fn out<T>(ptr: *mut T, value: T) {
    if !ptr.is_null() {
        unsafe { ptr.write(value) };
    }
}

fn check_out<T>(fake: &mut Guard, name: &str, ptr: *const T) -> Result<(), u32> {
    if ptr.is_null() {
        return Err(fake.reject(name, INVALID_VALUE, "a NULL output pointer"));
    }
    Ok(())
}

fn initialized(fake: &mut Guard, name: &str) -> Result<(), u32> {
    if !fake.initialized {
        return Err(fake.reject(name, NOT_INITIALIZED, "called before cuInit"));
    }
    Ok(())
}

/// The stream a copy goes to, and its device.
fn copy_stream(fake: &mut Guard, name: &str, stream: *mut c_void) -> Result<(u64, usize), u32> {
    let current = fake.context(name)?;
    let handle = fake.stream(name, stream as u64, current)?;
    let device = fake.streams[&handle].device;
    Ok((handle, device))
}

mod alloc;
mod context;
mod copy;
mod device;
mod error;
mod event;
mod launch;
mod memset;
mod module;
mod peer;
mod stream;
mod virtual_memory;
