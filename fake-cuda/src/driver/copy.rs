//! Memory copies: host to device, device to host, device to device and between peers, on a
//! stream or synchronous.

use std::ffi::c_void;

use super::{Guard, copy_stream};
use crate::codes::*;
use crate::memory::Piece;
use crate::state::{call, context_device};
use crate::streams::{Clock, Loc, Op, Touch, drive};

/// Resolves device memory for an access by `device`, as a violation when it cannot be.
pub(super) fn device_pieces(
    fake: &mut Guard,
    name: &str,
    address: u64,
    len: u64,
    device: usize,
) -> Result<Vec<Piece>, u32> {
    let peer_enabled = fake.peer_enabled.clone();
    let peer = move |a: usize, b: usize| a == b || peer_enabled.contains(&(a, b));
    match fake.memory.resolve(address, len, device, &peer) {
        Ok(resolved) => Ok(resolved.pieces),
        Err(what) => Err(fake.reject(name, INVALID_VALUE, what)),
    }
}

pub(super) fn phys_touches(pieces: &[Piece], write: bool) -> impl Iterator<Item = Touch> + '_ {
    pieces.iter().map(move |piece| Touch::Phys {
        piece: *piece,
        write,
    })
}

/// Queues a host-to-device copy: from pinned memory read when it runs, from pageable memory
/// staged now (as the driver does).
fn htod(
    fake: &mut Guard,
    name: &'static str,
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: u64,
    device: usize,
) -> u32 {
    if len == 0 {
        return SUCCESS;
    }
    if src.is_null() {
        return fake.reject(name, INVALID_VALUE, "a NULL host pointer");
    }
    let pieces = tri!(device_pieces(fake, name, dst, len as u64, device));
    let mut touches: Vec<Touch> = phys_touches(&pieces, true).collect();
    let op = if fake.memory.host_at(src as usize, len).is_some() {
        touches.push(Touch::Host {
            ptr: src as usize,
            len,
        });
        Op::Copy {
            dst: Loc::Device {
                address: dst,
                device,
            },
            src: Loc::Host(src as usize),
            len: len as u64,
        }
    } else {
        // SAFETY: the caller's buffer of `len` bytes.
        let data = unsafe { std::slice::from_raw_parts(src as *const u8, len) }.to_vec();
        Op::Staged { dst, device, data }
    };
    fake.enqueue(name, stream, op, touches);
    SUCCESS
}

/// Queues a device-to-host copy; to pageable memory it completes before the call returns (as
/// the driver does).
fn dtoh(
    fake: &mut Guard,
    name: &'static str,
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: u64,
    device: usize,
) -> u32 {
    if len == 0 {
        return SUCCESS;
    }
    if dst.is_null() {
        return fake.reject(name, INVALID_VALUE, "a NULL host pointer");
    }
    let pieces = tri!(device_pieces(fake, name, src, len as u64, device));
    let mut touches: Vec<Touch> = phys_touches(&pieces, false).collect();
    let pinned = fake.memory.host_at(dst as usize, len).is_some();
    if pinned {
        touches.push(Touch::Host {
            ptr: dst as usize,
            len,
        });
    }
    let op = Op::Copy {
        dst: Loc::Host(dst as usize),
        src: Loc::Device {
            address: src,
            device,
        },
        len: len as u64,
    };
    fake.enqueue(name, stream, op, touches);
    if !pinned {
        let seq = fake.streams[&stream].enqueued;
        let mut known = Clock::default();
        known.0.insert(stream, seq);
        return drive(fake, name, vec![(stream, seq)], known);
    }
    SUCCESS
}

fn dtod(
    fake: &mut Guard,
    name: &'static str,
    dst: (u64, usize),
    src: (u64, usize),
    len: usize,
    stream: u64,
) -> u32 {
    if len == 0 {
        return SUCCESS;
    }
    let dst_pieces = tri!(device_pieces(fake, name, dst.0, len as u64, dst.1));
    let src_pieces = tri!(device_pieces(fake, name, src.0, len as u64, src.1));
    let touches = phys_touches(&src_pieces, false)
        .chain(phys_touches(&dst_pieces, true))
        .collect();
    let op = Op::Copy {
        dst: Loc::Device {
            address: dst.0,
            device: dst.1,
        },
        src: Loc::Device {
            address: src.0,
            device: src.1,
        },
        len: len as u64,
    };
    fake.enqueue(name, stream, op, touches);
    SUCCESS
}

/// A synchronous copy: queued on the context's NULL stream and waited for.
pub(super) fn finish_sync(fake: &mut Guard, name: &'static str, stream: u64, code: u32) -> u32 {
    if code != SUCCESS {
        return code;
    }
    let seq = fake.streams[&stream].enqueued;
    let known = fake.stream_clock(stream);
    drive(fake, name, vec![(stream, seq)], known)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: *mut c_void,
) -> u32 {
    call("cuMemcpyHtoDAsync_v2", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyHtoDAsync_v2", stream));
        htod(fake, "cuMemcpyHtoDAsync_v2", dst, src, len, stream, device)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> u32 {
    call("cuMemcpyHtoD_v2", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyHtoD_v2", std::ptr::null_mut()));
        let code = htod(fake, "cuMemcpyHtoD_v2", dst, src, len, stream, device);
        finish_sync(fake, "cuMemcpyHtoD_v2", stream, code)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> u32 {
    call("cuMemcpyDtoHAsync_v2", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyDtoHAsync_v2", stream));
        dtoh(fake, "cuMemcpyDtoHAsync_v2", dst, src, len, stream, device)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> u32 {
    call("cuMemcpyDtoH_v2", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyDtoH_v2", std::ptr::null_mut()));
        let code = dtoh(fake, "cuMemcpyDtoH_v2", dst, src, len, stream, device);
        finish_sync(fake, "cuMemcpyDtoH_v2", stream, code)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> u32 {
    call("cuMemcpyDtoDAsync_v2", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyDtoDAsync_v2", stream));
        dtod(
            fake,
            "cuMemcpyDtoDAsync_v2",
            (dst, device),
            (src, device),
            len,
            stream,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> u32 {
    call("cuMemcpyDtoD_v2", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyDtoD_v2", std::ptr::null_mut()));
        let code = dtod(
            fake,
            "cuMemcpyDtoD_v2",
            (dst, device),
            (src, device),
            len,
            stream,
        );
        finish_sync(fake, "cuMemcpyDtoD_v2", stream, code)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: u64,
    dst_context: *mut c_void,
    src: u64,
    src_context: *mut c_void,
    len: usize,
    stream: *mut c_void,
) -> u32 {
    call("cuMemcpyPeerAsync", |fake| {
        let (stream, _) = tri!(copy_stream(fake, "cuMemcpyPeerAsync", stream));
        let n = fake.devices.len();
        let (Some(dst_device), Some(src_device)) = (
            context_device(dst_context as u64).filter(|d| *d < n),
            context_device(src_context as u64).filter(|d| *d < n),
        ) else {
            return fake.reject(
                "cuMemcpyPeerAsync",
                INVALID_CONTEXT,
                "a context argument is not a context",
            );
        };
        for d in [dst_device, src_device] {
            if fake.devices[d].retains == 0 {
                return fake.reject(
                    "cuMemcpyPeerAsync",
                    CONTEXT_IS_DESTROYED,
                    format!("device {d}'s primary context is not retained"),
                );
            }
        }
        dtod(
            fake,
            "cuMemcpyPeerAsync",
            (dst, dst_device),
            (src, src_device),
            len,
            stream,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync(dst: u64, src: u64, len: usize, stream: *mut c_void) -> u32 {
    call("cuMemcpyAsync", |fake| {
        let (stream, device) = tri!(copy_stream(fake, "cuMemcpyAsync", stream));
        let is_device = |fake: &Guard, p: u64| {
            fake.memory.allocation_at(p).is_some() || fake.memory.reservation_at(p).is_some()
        };
        match (is_device(fake, dst), is_device(fake, src)) {
            (true, true) => dtod(
                fake,
                "cuMemcpyAsync",
                (dst, device),
                (src, device),
                len,
                stream,
            ),
            (true, false) => htod(
                fake,
                "cuMemcpyAsync",
                dst,
                src as *const c_void,
                len,
                stream,
                device,
            ),
            (false, true) => dtoh(
                fake,
                "cuMemcpyAsync",
                dst as *mut c_void,
                src,
                len,
                stream,
                device,
            ),
            (false, false) => fake.reject(
                "cuMemcpyAsync",
                INVALID_VALUE,
                "host-to-host copies are not faked",
            ),
        }
    })
}
