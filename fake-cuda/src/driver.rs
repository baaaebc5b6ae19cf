//! The driver API functions the fake implements, exported under their C names (the versioned
//! names cudarc loads: `cuMemAlloc_v2`, ...).
//!
//! Every function runs under the fake's lock through [`call`], which counts it for fault
//! injection. Contract checks answer what the real driver answers and log a violation.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::codes::{self, *};
use crate::memory::{Mapping, NotWholeMappings, Piece};
use crate::state::{
    EVENT_BASE, FUNCTION_BASE, Fake, MODULE_BASE, STREAM_BASE, call, context_device,
    context_handle, current_device, set_current_device,
};
use crate::streams::{Clock, Event, Loc, Op, Stream, Target, Touch, drive};

type Guard = std::sync::MutexGuard<'static, Fake>;

/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE`.
const ALLOCATION_PINNED: u32 = 1;
const LOCATION_DEVICE: u32 = 1;

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

// --- initialisation and devices --------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> u32 {
    call("cuInit", |fake| {
        if flags != 0 {
            return fake.reject("cuInit", INVALID_VALUE, "flags must be 0");
        }
        fake.initialized = true;
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> u32 {
    call("cuDriverGetVersion", |fake| {
        tri!(check_out(fake, "cuDriverGetVersion", version));
        unsafe { out(version, 12080) };
        SUCCESS
    })
}

fn initialized(fake: &mut Guard, name: &str) -> Result<(), u32> {
    if !fake.initialized {
        return Err(fake.reject(name, NOT_INITIALIZED, "called before cuInit"));
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> u32 {
    call("cuDeviceGetCount", |fake| {
        tri!(initialized(fake, "cuDeviceGetCount"));
        tri!(check_out(fake, "cuDeviceGetCount", count));
        unsafe { out(count, fake.devices.len() as c_int) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> u32 {
    call("cuDeviceGet", |fake| {
        tri!(initialized(fake, "cuDeviceGet"));
        tri!(check_out(fake, "cuDeviceGet", device));
        let d = tri!(fake.device_index("cuDeviceGet", ordinal));
        unsafe { out(device, d as c_int) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> u32 {
    call("cuDeviceGetName", |fake| {
        tri!(initialized(fake, "cuDeviceGetName"));
        let d = tri!(fake.device_index("cuDeviceGetName", device));
        if name.is_null() || len <= 0 {
            return fake.reject("cuDeviceGetName", INVALID_VALUE, "no buffer");
        }
        let text = format!("Fake CUDA Device {d}");
        let bytes = text.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, name, n);
            name.add(n).write(0);
        }
        SUCCESS
    })
}

fn uuid(name: &'static str, uuid: *mut [u8; 16], device: c_int) -> u32 {
    call(name, |fake| {
        tri!(initialized(fake, name));
        let d = tri!(fake.device_index(name, device));
        tri!(check_out(fake, name, uuid));
        let mut bytes = *b"fake-cuda-dev-\0\0";
        bytes[14] = (d >> 8) as u8;
        bytes[15] = d as u8;
        unsafe { out(uuid, bytes) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(id: *mut [u8; 16], device: c_int) -> u32 {
    uuid("cuDeviceGetUuid", id, device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(id: *mut [u8; 16], device: c_int) -> u32 {
    uuid("cuDeviceGetUuid_v2", id, device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> u32 {
    call("cuDeviceTotalMem_v2", |fake| {
        tri!(initialized(fake, "cuDeviceTotalMem_v2"));
        let d = tri!(fake.device_index("cuDeviceTotalMem_v2", device));
        tri!(check_out(fake, "cuDeviceTotalMem_v2", bytes));
        unsafe { out(bytes, fake.config.memory[d] as usize) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    device: c_int,
) -> u32 {
    call("cuDeviceGetAttribute", |fake| {
        tri!(initialized(fake, "cuDeviceGetAttribute"));
        let d = tri!(fake.device_index("cuDeviceGetAttribute", device));
        tri!(check_out(fake, "cuDeviceGetAttribute", value));
        let (major, minor) = fake.config.compute_capability;
        let v = match attribute {
            1 => 1024,            // max threads per block
            2 | 3 => 1024,        // max block dim x, y
            4 => 64,              // max block dim z
            5 => i32::MAX,        // max grid dim x
            6 | 7 => 65535,       // max grid dim y, z
            8 => 48 << 10,        // shared memory per block
            9 => 64 << 10,        // constant memory
            10 => 32,             // warp size
            12 => 65536,          // registers per block
            13 => 1_500_000,      // clock rate (kHz)
            16 => 8,              // multiprocessors
            33 => d as c_int + 1, // PCI bus id
            36 => 1_000_000,      // memory clock rate
            37 => 256,            // memory bus width
            38 => 4 << 20,        // L2 cache
            39 => 2048,           // threads per multiprocessor
            41 => 1,              // unified addressing
            75 => major,
            76 => minor,
            97 => 96 << 10, // shared memory per block, opt-in
            102 => fake.config.vmm[d] as c_int,
            115 => 0, // memory pools (stream-ordered allocation): not faked
            _ => 0,
        };
        unsafe { out(value, v) };
        SUCCESS
    })
}

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

// --- contexts --------------------------------------------------------------------------------

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

// --- memory ----------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> u32 {
    call("cuMemGetInfo_v2", |fake| {
        let d = tri!(fake.context("cuMemGetInfo_v2"));
        let capacity = fake.config.memory[d];
        let used = fake.memory.used(d);
        unsafe {
            out(free, capacity.saturating_sub(used) as usize);
            out(total, capacity as usize);
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, size: usize) -> u32 {
    call("cuMemAlloc_v2", |fake| {
        let d = tri!(fake.context("cuMemAlloc_v2"));
        tri!(check_out(fake, "cuMemAlloc_v2", ptr));
        if size == 0 {
            return fake.reject("cuMemAlloc_v2", INVALID_VALUE, "0 bytes");
        }
        if fake.memory.used(d) + size as u64 > fake.config.memory[d] {
            return OUT_OF_MEMORY;
        }
        let base = fake.memory.alloc(d, size as u64);
        unsafe { out(ptr, base) };
        SUCCESS
    })
}

/// Work queued or not known complete that touches physical memory `phys` (in `range` if
/// given): a free or unmap of it is a violation; the work is run to completion first so that the
/// model stays consistent.
fn settle_users(
    fake: &mut Guard,
    name: &'static str,
    what: &str,
    phys: &[(u64, Option<(u64, u64)>)],
    host: Option<(usize, usize)>,
) {
    let touches_it = |touch: &Touch| match *touch {
        Touch::Phys { piece, .. } => phys.iter().any(|(p, range)| {
            *p == piece.phys
                && range.is_none_or(|(offset, len)| {
                    piece.offset < offset + len && offset < piece.offset + piece.len
                })
        }),
        Touch::Host { ptr, len } => host.is_some_and(|(h, hlen)| ptr < h + hlen && h < ptr + len),
    };
    let mut target: Target = Vec::new();
    let mut users = Vec::new();
    for (handle, stream) in &fake.streams {
        if let Some(last) = stream
            .queue
            .iter()
            .rev()
            .find(|w| w.touches.iter().any(touches_it))
        {
            target.push((*handle, last.seq));
            users.push(format!("{} queued on stream {handle:#x}", last.call));
        }
    }
    // Work that ran but that the host never waited for: on a real device it may still run.
    let host_clock = fake.host_clock.clone();
    for access in &fake.accesses {
        if host_clock.get(access.stream) < access.seq
            && phys.iter().any(|(p, range)| {
                *p == access.piece.phys
                    && range.is_none_or(|(offset, len)| {
                        access.piece.offset < offset + len
                            && offset < access.piece.offset + access.piece.len
                    })
            })
            && !target.iter().any(|(s, _)| *s == access.stream)
        {
            users.push(format!(
                "{} on stream {:#x}, never synchronised",
                access.call, access.stream
            ));
            target.push((access.stream, access.seq));
        }
    }
    if target.is_empty() {
        return;
    }
    users.sort();
    users.dedup();
    fake.violation(
        name,
        format!("{what} while work may still use it: {}", users.join("; ")),
    );
    let known = Clock::default();
    let _ = drive(fake, name, target, known);
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(ptr: u64) -> u32 {
    call("cuMemFree_v2", |fake| {
        let _d = tri!(fake.context("cuMemFree_v2"));
        if ptr == 0 {
            return SUCCESS;
        }
        let Some(phys) = fake.memory.allocations.get(&ptr).map(|a| a.phys) else {
            return fake.reject(
                "cuMemFree_v2",
                INVALID_VALUE,
                format!(
                    "{ptr:#x} is not a live cuMemAlloc allocation (double free, or not its base)"
                ),
            );
        };
        settle_users(
            fake,
            "cuMemFree_v2",
            &format!("freeing {ptr:#x}"),
            &[(phys, None)],
            None,
        );
        fake.memory.free(ptr);
        SUCCESS
    })
}

fn host_alloc(name: &'static str, ptr: *mut *mut c_void, size: usize) -> u32 {
    call(name, |fake| {
        let _d = tri!(fake.context(name));
        tri!(check_out(fake, name, ptr));
        if size == 0 {
            return fake.reject(name, INVALID_VALUE, "0 bytes");
        }
        let Ok(layout) = std::alloc::Layout::from_size_align(size, 4096) else {
            return OUT_OF_MEMORY;
        };
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return OUT_OF_MEMORY;
        }
        fake.memory
            .host
            .insert(p as usize, crate::memory::HostAllocation { size, layout });
        unsafe { out(ptr, p as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(ptr: *mut *mut c_void, size: usize, _flags: c_uint) -> u32 {
    host_alloc("cuMemHostAlloc", ptr, size)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(ptr: *mut *mut c_void, size: usize) -> u32 {
    host_alloc("cuMemAllocHost_v2", ptr, size)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> u32 {
    call("cuMemFreeHost", |fake| {
        let _d = tri!(fake.context("cuMemFreeHost"));
        let Some(size) = fake.memory.host.get(&(ptr as usize)).map(|h| h.size) else {
            return fake.reject(
                "cuMemFreeHost",
                INVALID_VALUE,
                format!(
                    "{:#x} is not a live cuMemHostAlloc allocation",
                    ptr as usize
                ),
            );
        };
        settle_users(
            fake,
            "cuMemFreeHost",
            &format!("freeing pinned {:#x}", ptr as usize),
            &[],
            Some((ptr as usize, size)),
        );
        let host = fake.memory.host.remove(&(ptr as usize)).expect("checked");
        // SAFETY: allocated above with this layout, freed once.
        unsafe { std::alloc::dealloc(ptr as *mut u8, host.layout) };
        SUCCESS
    })
}

// --- copies and memset -----------------------------------------------------------------------

/// Resolves device memory for an access by `device`, as a violation when it cannot be.
fn device_pieces(
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

fn phys_touches(pieces: &[Piece], write: bool) -> impl Iterator<Item = Touch> + '_ {
    pieces.iter().map(move |piece| Touch::Phys {
        piece: *piece,
        write,
    })
}

/// The stream a copy goes to, and its device.
fn copy_stream(fake: &mut Guard, name: &str, stream: *mut c_void) -> Result<(u64, usize), u32> {
    let current = fake.context(name)?;
    let handle = fake.stream(name, stream as u64, current)?;
    let device = fake.streams[&handle].device;
    Ok((handle, device))
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
fn finish_sync(fake: &mut Guard, name: &'static str, stream: u64, code: u32) -> u32 {
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

fn memset(
    name: &'static str,
    dst: u64,
    pattern: Vec<u8>,
    count: usize,
    stream: Option<*mut c_void>,
) -> u32 {
    call(name, |fake| {
        let (handle, device) = tri!(copy_stream(
            fake,
            name,
            stream.unwrap_or(std::ptr::null_mut())
        ));
        let len = (count * pattern.len()) as u64;
        if len == 0 {
            return SUCCESS;
        }
        if !dst.is_multiple_of(pattern.len() as u64) {
            return fake.reject(
                name,
                INVALID_VALUE,
                format!("{dst:#x} is not aligned to {} bytes", pattern.len()),
            );
        }
        let pieces = tri!(device_pieces(fake, name, dst, len, device));
        let touches = phys_touches(&pieces, true).collect();
        fake.enqueue(
            name,
            handle,
            Op::Memset {
                dst,
                device,
                pattern,
                len,
            },
            touches,
        );
        if stream.is_none() {
            return finish_sync(fake, name, handle, SUCCESS);
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: u64,
    value: u8,
    count: usize,
    stream: *mut c_void,
) -> u32 {
    memset("cuMemsetD8Async", dst, vec![value], count, Some(stream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD16Async(
    dst: u64,
    value: u16,
    count: usize,
    stream: *mut c_void,
) -> u32 {
    memset(
        "cuMemsetD16Async",
        dst,
        value.to_ne_bytes().to_vec(),
        count,
        Some(stream),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32Async(
    dst: u64,
    value: u32,
    count: usize,
    stream: *mut c_void,
) -> u32 {
    memset(
        "cuMemsetD32Async",
        dst,
        value.to_ne_bytes().to_vec(),
        count,
        Some(stream),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, count: usize) -> u32 {
    memset("cuMemsetD8_v2", dst, vec![value], count, None)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: u64, value: u32, count: usize) -> u32 {
    memset(
        "cuMemsetD32_v2",
        dst,
        value.to_ne_bytes().to_vec(),
        count,
        None,
    )
}

// --- streams and events ----------------------------------------------------------------------

fn stream_create(name: &'static str, ptr: *mut *mut c_void) -> u32 {
    call(name, |fake| {
        let d = tri!(fake.context(name));
        tri!(check_out(fake, name, ptr));
        let handle = fake.next_handle(STREAM_BASE);
        fake.streams.insert(handle, Stream::new(d, false));
        unsafe { out(ptr, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(ptr: *mut *mut c_void, _flags: c_uint) -> u32 {
    stream_create("cuStreamCreate", ptr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ptr: *mut *mut c_void,
    _flags: c_uint,
    _priority: c_int,
) -> u32 {
    stream_create("cuStreamCreateWithPriority", ptr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> u32 {
    call("cuStreamDestroy_v2", |fake| {
        let d = tri!(fake.context("cuStreamDestroy_v2"));
        if (stream as u64) <= 2 {
            return fake.reject(
                "cuStreamDestroy_v2",
                INVALID_HANDLE,
                "the default stream cannot be destroyed",
            );
        }
        let handle = tri!(fake.stream("cuStreamDestroy_v2", stream as u64, d));
        // Queued work still completes (the real driver lets it).
        fake.streams.get_mut(&handle).expect("checked").alive = false;
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> u32 {
    call("cuStreamSynchronize", |fake| {
        let (handle, _) = tri!(copy_stream(fake, "cuStreamSynchronize", stream));
        let seq = fake.streams[&handle].enqueued;
        let known = fake.stream_clock(handle);
        drive(fake, "cuStreamSynchronize", vec![(handle, seq)], known)
    })
}

/// A query: done now, or NOT_READY; the scheduler decides how much runs on the way, and a
/// query that answers NOT_READY makes sure the next one finds the work done (progress).
fn query(fake: &mut Guard, _name: &'static str, target: Target, known: Clock) -> u32 {
    if !fake.satisfied(&target) {
        let schedule = fake.schedule;
        match schedule {
            crate::config::Schedule::Eager => fake.run_all_ready(),
            crate::config::Schedule::Random if fake.random().is_multiple_of(2) => {
                fake.run_all_ready()
            }
            _ => {}
        }
    }
    if fake.satisfied(&target) {
        fake.host_clock.join(&known);
        let error = fake.target_error(&target);
        return if error != 0 { error } else { SUCCESS };
    }
    // Not done: let the work needed run now without blocking, so that polling ends.
    fake.progress_without_waiting(&target);
    NOT_READY
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> u32 {
    call("cuStreamQuery", |fake| {
        let (handle, _) = tri!(copy_stream(fake, "cuStreamQuery", stream));
        let seq = fake.streams[&handle].enqueued;
        let known = fake.stream_clock(handle);
        query(fake, "cuStreamQuery", vec![(handle, seq)], known)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: c_uint,
) -> u32 {
    call("cuStreamWaitEvent", |fake| {
        let (handle, _) = tri!(copy_stream(fake, "cuStreamWaitEvent", stream));
        let event = tri!(fake.event("cuStreamWaitEvent", event as u64));
        if flags != 0 {
            return fake.reject(
                "cuStreamWaitEvent",
                INVALID_VALUE,
                "flags must be 0 (CU_EVENT_WAIT_DEFAULT)",
            );
        }
        let Some((other, seq, clock)) = fake.events[&event].recorded.clone() else {
            // Never recorded: nothing to wait for.
            return SUCCESS;
        };
        fake.streams
            .get_mut(&handle)
            .expect("checked")
            .clock
            .join(&clock);
        fake.enqueue(
            "cuStreamWaitEvent",
            handle,
            Op::Wait { stream: other, seq },
            Vec::new(),
        );
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(ptr: *mut *mut c_void, _flags: c_uint) -> u32 {
    call("cuEventCreate", |fake| {
        let d = tri!(fake.context("cuEventCreate"));
        tri!(check_out(fake, "cuEventCreate", ptr));
        let handle = fake.next_handle(EVENT_BASE);
        fake.events.insert(
            handle,
            Event {
                device: d,
                alive: true,
                recorded: None,
            },
        );
        unsafe { out(ptr, handle as *mut c_void) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> u32 {
    call("cuEventRecord", |fake| {
        let (handle, device) = tri!(copy_stream(fake, "cuEventRecord", stream));
        let event = tri!(fake.event("cuEventRecord", event as u64));
        if fake.events[&event].device != device {
            let other = fake.events[&event].device;
            return fake.reject(
                "cuEventRecord",
                INVALID_HANDLE,
                format!("an event of device {other} recorded on a stream of device {device}"),
            );
        }
        let s = &fake.streams[&handle];
        let recorded = (handle, s.enqueued, s.clock.clone());
        fake.events.get_mut(&event).expect("checked").recorded = Some(recorded);
        SUCCESS
    })
}

fn event_target(fake: &Fake, event: u64) -> (Target, Clock) {
    match &fake.events[&event].recorded {
        Some((stream, seq, clock)) => (vec![(*stream, *seq)], clock.clone()),
        None => (Vec::new(), Clock::default()),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(event: *mut c_void) -> u32 {
    call("cuEventQuery", |fake| {
        let _ = tri!(fake.context("cuEventQuery"));
        let event = tri!(fake.event("cuEventQuery", event as u64));
        let (target, known) = event_target(fake, event);
        query(fake, "cuEventQuery", target, known)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: *mut c_void) -> u32 {
    call("cuEventSynchronize", |fake| {
        let _ = tri!(fake.context("cuEventSynchronize"));
        let event = tri!(fake.event("cuEventSynchronize", event as u64));
        let (target, known) = event_target(fake, event);
        drive(fake, "cuEventSynchronize", target, known)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> u32 {
    call("cuEventDestroy_v2", |fake| {
        let _ = tri!(fake.context("cuEventDestroy_v2"));
        let event = tri!(fake.event("cuEventDestroy_v2", event as u64));
        fake.events.get_mut(&event).expect("checked").alive = false;
        SUCCESS
    })
}

// --- virtual memory --------------------------------------------------------------------------

/// The device of an allocation property (`CUmemAllocationProp`: type, handle types, then the
/// location's type and id), checked: pinned memory on a device with virtual memory.
unsafe fn prop_device(fake: &mut Guard, name: &str, prop: *const c_void) -> Result<usize, u32> {
    if prop.is_null() {
        return Err(fake.reject(name, INVALID_VALUE, "a NULL allocation property"));
    }
    let words = prop as *const u32;
    let (kind, location, id) = unsafe {
        (
            words.read(),
            words.add(2).read(),
            (words.add(3) as *const i32).read(),
        )
    };
    if kind != ALLOCATION_PINNED {
        return Err(fake.reject(
            name,
            INVALID_VALUE,
            format!("allocation type {kind}, not CU_MEM_ALLOCATION_TYPE_PINNED"),
        ));
    }
    if location != LOCATION_DEVICE {
        return Err(fake.reject(
            name,
            INVALID_VALUE,
            format!("location type {location}, not CU_MEM_LOCATION_TYPE_DEVICE"),
        ));
    }
    let d = fake.device_index(name, id)?;
    if !fake.config.vmm[d] {
        return Err(fake.reject(
            name,
            NOT_SUPPORTED,
            format!("device {d} has no virtual memory management"),
        ));
    }
    Ok(d)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const c_void,
    _option: c_int,
) -> u32 {
    call("cuMemGetAllocationGranularity", |fake| {
        tri!(initialized(fake, "cuMemGetAllocationGranularity"));
        tri!(check_out(
            fake,
            "cuMemGetAllocationGranularity",
            granularity
        ));
        let _d = tri!(unsafe { prop_device(fake, "cuMemGetAllocationGranularity", prop) });
        unsafe { out(granularity, fake.config.granularity as usize) };
        SUCCESS
    })
}

fn aligned(fake: &mut Guard, name: &str, what: &str, value: u64) -> Result<(), u32> {
    let granularity = fake.config.granularity;
    if !value.is_multiple_of(granularity) {
        return Err(fake.reject(
            name,
            INVALID_VALUE,
            format!("{what} {value:#x} is not a multiple of the granularity {granularity:#x}"),
        ));
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    size: usize,
    alignment: usize,
    _addr: u64,
    flags: u64,
) -> u32 {
    call("cuMemAddressReserve", |fake| {
        let _ = tri!(fake.context("cuMemAddressReserve"));
        tri!(check_out(fake, "cuMemAddressReserve", ptr));
        if size == 0 || flags != 0 {
            return fake.reject("cuMemAddressReserve", INVALID_VALUE, "0 bytes or flags");
        }
        tri!(aligned(fake, "cuMemAddressReserve", "size", size as u64));
        if alignment != 0 && !alignment.is_power_of_two() {
            return fake.reject(
                "cuMemAddressReserve",
                INVALID_VALUE,
                format!("alignment {alignment} is not a power of two"),
            );
        }
        let alignment = (alignment as u64).max(fake.config.granularity);
        let base = fake.memory.reserve(size as u64, alignment);
        unsafe { out(ptr, base) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> u32 {
    call("cuMemAddressFree", |fake| {
        let _ = tri!(fake.context("cuMemAddressFree"));
        let Some(reservation) = fake.memory.reservations.get(&ptr) else {
            return fake.reject(
                "cuMemAddressFree",
                INVALID_VALUE,
                format!("{ptr:#x} is not a reserved range"),
            );
        };
        if reservation.size != size as u64 {
            let reserved = reservation.size;
            return fake.reject(
                "cuMemAddressFree",
                INVALID_VALUE,
                format!("{size} bytes given back of a range of {reserved}"),
            );
        }
        if !reservation.mappings.is_empty() {
            let n = reservation.mappings.len();
            return fake.reject(
                "cuMemAddressFree",
                INVALID_VALUE,
                format!("the range at {ptr:#x} still has {n} mappings"),
            );
        }
        fake.memory.reservations.remove(&ptr);
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const c_void,
    flags: u64,
) -> u32 {
    call("cuMemCreate", |fake| {
        let _ = tri!(fake.context("cuMemCreate"));
        tri!(check_out(fake, "cuMemCreate", handle));
        let d = tri!(unsafe { prop_device(fake, "cuMemCreate", prop) });
        if size == 0 || flags != 0 {
            return fake.reject("cuMemCreate", INVALID_VALUE, "0 bytes or flags");
        }
        tri!(aligned(fake, "cuMemCreate", "size", size as u64));
        if fake.memory.used(d) + size as u64 > fake.config.memory[d] {
            return OUT_OF_MEMORY;
        }
        let id = fake.memory.create(d, size as u64);
        unsafe { out(handle, id) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> u32 {
    call("cuMemRelease", |fake| {
        let _ = tri!(fake.context("cuMemRelease"));
        match fake.memory.phys.get(&handle) {
            Some(phys) if phys.created && !phys.released => {}
            _ => {
                return fake.reject(
                    "cuMemRelease",
                    INVALID_VALUE,
                    format!("{handle:#x} is not a live cuMemCreate handle"),
                );
            }
        }
        fake.memory.release(handle);
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: u64,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> u32 {
    call("cuMemMap", |fake| {
        let _ = tri!(fake.context("cuMemMap"));
        if flags != 0 || offset != 0 {
            return fake.reject("cuMemMap", INVALID_VALUE, "flags and offset must be 0");
        }
        let phys_size = match fake.memory.phys.get(&handle) {
            Some(phys) if phys.created && !phys.released => phys.data.len() as u64,
            _ => {
                return fake.reject(
                    "cuMemMap",
                    INVALID_VALUE,
                    format!("{handle:#x} is not a live cuMemCreate handle"),
                );
            }
        };
        if size as u64 != phys_size {
            return fake.reject(
                "cuMemMap",
                INVALID_VALUE,
                format!("maps {size} bytes of an allocation of {phys_size}"),
            );
        }
        let Some((base, reservation)) = fake.memory.reservation_at(ptr) else {
            return fake.reject(
                "cuMemMap",
                INVALID_VALUE,
                format!("{ptr:#x} is not in a reserved range"),
            );
        };
        let at = ptr - base;
        let range_size = reservation.size;
        let overlaps = reservation
            .mappings
            .iter()
            .any(|(o, m)| *o < at + size as u64 && at < o + m.size);
        tri!(aligned(fake, "cuMemMap", "offset in the range", at));
        if at + size as u64 > range_size {
            return fake.reject(
                "cuMemMap",
                INVALID_VALUE,
                format!("maps past the end of the range at {base:#x}"),
            );
        }
        if overlaps {
            return fake.reject(
                "cuMemMap",
                INVALID_VALUE,
                format!("{ptr:#x}: part of the range is already mapped"),
            );
        }
        let (_, reservation) = fake.memory.reservation_at_mut(ptr).expect("checked");
        reservation.mappings.insert(
            at,
            Mapping {
                size: size as u64,
                phys: handle,
                access: Default::default(),
            },
        );
        fake.memory.phys.get_mut(&handle).expect("checked").mappings += 1;
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: u64,
    size: usize,
    desc: *const c_void,
    count: usize,
) -> u32 {
    call("cuMemSetAccess", |fake| {
        let _ = tri!(fake.context("cuMemSetAccess"));
        if desc.is_null() || count == 0 {
            return fake.reject("cuMemSetAccess", INVALID_VALUE, "no access descriptor");
        }
        let Some((base, reservation)) = fake.memory.reservation_at(ptr) else {
            return fake.reject(
                "cuMemSetAccess",
                INVALID_VALUE,
                format!("{ptr:#x} is not in a reserved range"),
            );
        };
        let at = ptr - base;
        // Every byte mapped, and whole mappings only.
        let offsets: Vec<u64> = match reservation.whole_mappings(at, at + size as u64) {
            Ok(found) => found.into_iter().map(|(offset, _)| offset).collect(),
            Err(NotWholeMappings::PartOfAMapping) => {
                return fake.reject(
                    "cuMemSetAccess",
                    INVALID_VALUE,
                    format!("[{ptr:#x}, +{size:#x}) is not exactly a run of whole mappings"),
                );
            }
            Err(NotWholeMappings::NotAllMapped) => {
                return fake.reject(
                    "cuMemSetAccess",
                    INVALID_VALUE,
                    format!("[{ptr:#x}, +{size:#x}) is not all mapped"),
                );
            }
        };
        let mut grants = Vec::new();
        for i in 0..count {
            // CUmemAccessDesc: location type, location id, flags (12 bytes).
            let words = unsafe { (desc as *const u32).add(i * 3) };
            let (location, id, flags) = unsafe {
                (
                    words.read(),
                    (words.add(1) as *const i32).read(),
                    words.add(2).read(),
                )
            };
            if location != LOCATION_DEVICE {
                return fake.reject(
                    "cuMemSetAccess",
                    INVALID_VALUE,
                    format!("location type {location}"),
                );
            }
            let d = tri!(fake.device_index("cuMemSetAccess", id));
            grants.push((d, flags));
        }
        let (_, reservation) = fake.memory.reservation_at_mut(ptr).expect("checked");
        for offset in offsets {
            let mapping = reservation.mappings.get_mut(&offset).expect("found above");
            for (d, flags) in &grants {
                // CU_MEM_ACCESS_FLAGS_PROT_READWRITE is 3; NONE (0) revokes; READ (1) is treated as none
                // for writes, which the fake does not tell apart: it counts as access.
                if *flags == 0 {
                    mapping.access.remove(d);
                } else {
                    mapping.access.insert(*d);
                }
            }
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> u32 {
    call("cuMemUnmap", |fake| {
        let _ = tri!(fake.context("cuMemUnmap"));
        let Some((base, reservation)) = fake.memory.reservation_at(ptr) else {
            return fake.reject(
                "cuMemUnmap",
                INVALID_VALUE,
                format!("{ptr:#x} is not in a reserved range"),
            );
        };
        let at = ptr - base;
        let found = match reservation.whole_mappings(at, at + size as u64) {
            Ok(found) if !found.is_empty() => found,
            Err(NotWholeMappings::PartOfAMapping) => {
                return fake.reject(
                    "cuMemUnmap",
                    INVALID_VALUE,
                    format!("[{ptr:#x}, +{size:#x}) unmaps part of a mapping"),
                );
            }
            Ok(_) | Err(NotWholeMappings::NotAllMapped) => {
                return fake.reject(
                    "cuMemUnmap",
                    INVALID_VALUE,
                    format!("[{ptr:#x}, +{size:#x}) is not all mapped"),
                );
            }
        };
        let users: Vec<(u64, Option<(u64, u64)>)> =
            found.iter().map(|(_, phys)| (*phys, None)).collect();
        settle_users(
            fake,
            "cuMemUnmap",
            &format!("unmapping [{ptr:#x}, +{size:#x})"),
            &users,
            None,
        );
        for (offset, _) in found {
            fake.memory.unmap(base, offset);
        }
        SUCCESS
    })
}

// --- modules and kernels ---------------------------------------------------------------------

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

// --- errors ----------------------------------------------------------------------------------

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
