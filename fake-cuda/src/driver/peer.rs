//! Peer access between devices: the query and enabling or disabling it for the current context.

use std::ffi::{c_int, c_uint, c_void};

use super::{check_out, initialized, out};
use crate::codes::*;
use crate::state::{call, context_device};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, device: c_int, peer: c_int) -> u32 {
    call("cuDeviceCanAccessPeer", |fake| {
        tri!(initialized(fake, "cuDeviceCanAccessPeer"));
        let a = tri!(fake.device_index("cuDeviceCanAccessPeer", device));
        let b = tri!(fake.device_index("cuDeviceCanAccessPeer", peer));
        tri!(check_out(fake, "cuDeviceCanAccessPeer", can));
        unsafe { out(can, fake.config.peer[a][b] as c_int) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: *mut c_void, flags: c_uint) -> u32 {
    call("cuCtxEnablePeerAccess", |fake| {
        let a = tri!(fake.context("cuCtxEnablePeerAccess"));
        let Some(b) = context_device(peer as u64).filter(|b| *b < fake.devices.len()) else {
            return fake.reject(
                "cuCtxEnablePeerAccess",
                INVALID_CONTEXT,
                format!("{:#x} is not a context", peer as u64),
            );
        };
        if flags != 0 {
            return fake.reject("cuCtxEnablePeerAccess", INVALID_VALUE, "flags must be 0");
        }
        if a == b {
            return fake.reject(
                "cuCtxEnablePeerAccess",
                INVALID_DEVICE,
                "peer access to the current context itself",
            );
        }
        if !fake.config.peer[a][b] {
            return fake.reject(
                "cuCtxEnablePeerAccess",
                PEER_ACCESS_UNSUPPORTED,
                format!("device {a} cannot access device {b} (cuDeviceCanAccessPeer says 0)"),
            );
        }
        if !fake.peer_enabled.insert((a, b)) {
            // Not a violation: callers may enable again and take this answer as success.
            return PEER_ACCESS_ALREADY_ENABLED;
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: *mut c_void) -> u32 {
    call("cuCtxDisablePeerAccess", |fake| {
        let a = tri!(fake.context("cuCtxDisablePeerAccess"));
        let Some(b) = context_device(peer as u64).filter(|b| *b < fake.devices.len()) else {
            return fake.reject(
                "cuCtxDisablePeerAccess",
                INVALID_CONTEXT,
                format!("{:#x} is not a context", peer as u64),
            );
        };
        if !fake.peer_enabled.remove(&(a, b)) {
            return fake.reject(
                "cuCtxDisablePeerAccess",
                PEER_ACCESS_NOT_ENABLED,
                format!("device {a} never enabled access to device {b}"),
            );
        }
        SUCCESS
    })
}
