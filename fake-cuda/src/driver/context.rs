//! Primary contexts, the current context and `cuCtxSynchronize`.

use std::ffi::{c_int, c_void};

use super::{check_out, initialized, out};
use crate::codes::*;
use crate::state::{
    Fake, call, context_device, context_handle, current_device, set_current_device,
};
use crate::streams::{Clock, Target, drive};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(context: *mut *mut c_void, device: c_int) -> u32 {
    call("cuDevicePrimaryCtxRetain", |fake| {
        tri!(initialized(fake, "cuDevicePrimaryCtxRetain"));
        let d = tri!(fake.device_index("cuDevicePrimaryCtxRetain", device));
        tri!(check_out(fake, "cuDevicePrimaryCtxRetain", context));
        fake.devices[d].retains += 1;
        unsafe { out(context, context_handle(d) as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(device: c_int) -> u32 {
    call("cuDevicePrimaryCtxRelease_v2", |fake| {
        tri!(initialized(fake, "cuDevicePrimaryCtxRelease_v2"));
        let d = tri!(fake.device_index("cuDevicePrimaryCtxRelease_v2", device));
        if fake.devices[d].retains == 0 {
            return fake.reject(
                "cuDevicePrimaryCtxRelease_v2",
                INVALID_CONTEXT,
                format!("device {d}'s primary context released more often than retained"),
            );
        }
        fake.devices[d].retains -= 1;
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(context: *mut c_void) -> u32 {
    call("cuCtxSetCurrent", |fake| {
        tri!(initialized(fake, "cuCtxSetCurrent"));
        if context.is_null() {
            set_current_device(None);
            return SUCCESS;
        }
        match context_device(context as u64) {
            Some(d) if d < fake.devices.len() && fake.devices[d].retains > 0 => {
                set_current_device(Some(d));
                SUCCESS
            }
            Some(d) if d < fake.devices.len() => fake.reject(
                "cuCtxSetCurrent",
                CONTEXT_IS_DESTROYED,
                format!("device {d}'s primary context is not retained"),
            ),
            _ => fake.reject(
                "cuCtxSetCurrent",
                INVALID_CONTEXT,
                format!("{:#x} is not a context", context as u64),
            ),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut *mut c_void) -> u32 {
    call("cuCtxGetCurrent", |fake| {
        tri!(initialized(fake, "cuCtxGetCurrent"));
        tri!(check_out(fake, "cuCtxGetCurrent", context));
        let handle = current_device().map(context_handle).unwrap_or(0);
        unsafe { out(context, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> u32 {
    call("cuCtxGetDevice", |fake| {
        let d = tri!(fake.context("cuCtxGetDevice"));
        tri!(check_out(fake, "cuCtxGetDevice", device));
        unsafe { out(device, d as c_int) };
        SUCCESS
    })
}

/// Everything queued on `device`'s streams, and what knowing it done tells the host.
fn device_target(fake: &Fake, device: usize) -> (Target, Clock) {
    let mut target = Vec::new();
    let mut known = Clock::default();
    for (handle, stream) in &fake.streams {
        if stream.device == device {
            target.push((*handle, stream.enqueued));
            known.join(&stream.clock);
        }
    }
    (target, known)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> u32 {
    call("cuCtxSynchronize", |fake| {
        let d = tri!(fake.context("cuCtxSynchronize"));
        let (target, known) = device_target(fake, d);
        drive(fake, "cuCtxSynchronize", target, known)
    })
}
