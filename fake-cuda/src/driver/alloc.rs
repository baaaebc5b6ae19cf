//! Device memory allocation and free (`cuMemAlloc`/`cuMemFree`), free/total memory and pinned
//! host memory.

use std::ffi::{c_uint, c_void};

use super::{Guard, check_out, out};
use crate::codes::*;
use crate::state::call;
use crate::streams::{Clock, Target, Touch, drive};

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
pub(super) fn settle_users(
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
