//! `cuLaunchKernel`: checked and queued on its stream like any other work. A kernel computes
//! nothing on the fake (no byte changes); what it stands for is its accesses.
//!
//! At the call the fake checks the function (alive, of a loaded module of the current context),
//! the stream (alive, of the current context), the grid and the block (not empty, within what
//! `cuDeviceGetAttribute` reports, the block within the entry's `__launch_bounds__`), the
//! dynamic shared memory (within 48 KiB, or what `cuFuncSetAttribute` allowed), and every
//! pointer parameter: the value in `kernelParams` must be device memory the launching device
//! may access, live, for the whole range the kernel may touch. A pointer that is not is a
//! violation at once; the launch is still queued (the real driver cannot see it either) and,
//! when it runs, leaves its stream the sticky `CUDA_ERROR_ILLEGAL_ADDRESS` a device fault does.
//!
//! # The bytes each access covers
//!
//! Each pointer parameter is, for the race detector and for frees with work queued, a write of
//! its range (a read only when it is declared pointer-to-const, which the kernel cannot write
//! through), the range being what the kernel may touch, no more:
//!
//! - not its whole allocation: the caching allocator places many tensors in one segment, and
//!   neighbouring tensors used on different streams are not ordered with each other (nor need
//!   to be), so whole allocations would report races that are not there;
//! - for CubeCL's kernels, each buffer's own length, read at the launch from the info structure
//!   CubeCL passes by value (its `static_meta` holds every buffer's length in elements; see
//!   `nvrtc/metadata.rs`), times the size of the pointed-at type: exactly the tensor's bytes,
//!   so a missing wait on any of them is seen and a tensor overrunning its block is not missed;
//! - where the length cannot be known (another source, a type the fake cannot size), one
//!   element at the pointer: still inside the tensor, so still no false race, and still a
//!   check that the pointer is live and an ordering of the tensor's first bytes.
//!
//! A range of zero bytes (an empty tensor) touches nothing and is not checked.

use std::ffi::{c_uint, c_void};

use super::Guard;
use super::device::attr;
use crate::codes::*;
use crate::memory::Piece;
use crate::nvrtc::image::{Access, Count, Entry, Param};
use crate::state::call;
use crate::streams::{Op, Touch};

const NAME: &str = "cuLaunchKernel";

/// Reads the unsigned integer of `width` bytes at `offset` of the by-value parameter whose
/// bytes start at `value`.
///
/// # Safety
/// `value` points to at least `offset + width` bytes (the image checked the field lies within
/// the parameter's size, which the caller passes).
unsafe fn field(value: *const u8, offset: u64, width: u64) -> u64 {
    let mut bytes = [0u8; 8];
    unsafe {
        std::ptr::copy_nonoverlapping(
            value.add(offset as usize),
            bytes.as_mut_ptr(),
            width as usize,
        )
    };
    u64::from_le_bytes(bytes)
}

/// The bytes from a pointer parameter the kernel may touch (`None` when they overflow).
///
/// # Safety
/// `params` holds a valid pointer per parameter of the entry `count` belongs to (whose image
/// checked that each field lies within its by-value parameter).
unsafe fn range(params: *mut *mut c_void, elem: u64, count: &Count) -> Option<u64> {
    let elements = match count {
        Count::One => 1,
        Count::Fields { factor, fields } => {
            let mut sum = 0u64;
            for f in fields {
                let value = unsafe { params.add(f.param).read() } as *const u8;
                sum = sum.checked_add(unsafe { field(value, f.offset, f.width) })?;
            }
            sum.checked_mul(*factor)?
        }
    };
    elements.checked_mul(elem.max(1))
}

/// Checks the launch shape against the device's limits and the entry's launch bounds.
fn check_shape(
    fake: &mut Guard,
    device: usize,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    entry: &Entry,
) -> Result<(), u32> {
    if grid.contains(&0) || block.contains(&0) {
        return Err(fake.reject(
            NAME,
            INVALID_VALUE,
            format!("an empty grid {grid:?} or block {block:?}"),
        ));
    }
    for axis in 0..3 {
        let most_grid = super::device::attribute(fake, attr::MAX_GRID_DIM[axis], device) as u32;
        let most_block = super::device::attribute(fake, attr::MAX_BLOCK_DIM[axis], device) as u32;
        if grid[axis] > most_grid || block[axis] > most_block {
            return Err(fake.reject(
                NAME,
                INVALID_VALUE,
                format!(
                    "grid {grid:?} or block {block:?} over the device's limits ({most_grid} and {most_block} along axis {axis})"
                ),
            ));
        }
    }
    let threads = block.iter().map(|b| *b as u64).product::<u64>();
    let most = super::device::attribute(fake, attr::MAX_THREADS_PER_BLOCK, device) as u64;
    if threads > most {
        return Err(fake.reject(
            NAME,
            INVALID_VALUE,
            format!("{threads} threads per block, over the device's {most}"),
        ));
    }
    if let Some(bound) = entry.max_threads
        && threads > bound as u64
    {
        return Err(fake.reject(
            NAME,
            LAUNCH_OUT_OF_RESOURCES,
            format!(
                "{threads} threads per block, over `{}`'s __launch_bounds__({bound})",
                entry.name
            ),
        ));
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    call(NAME, |fake| {
        let d = tri!(fake.context(NAME));
        let Some(function) = fake.functions.get(&(f as u64)) else {
            return fake.reject(
                NAME,
                INVALID_HANDLE,
                format!("{:#x} is not a function", f as u64),
            );
        };
        let (entry, label, max_shared) = (
            function.entry.clone(),
            function.label,
            function.max_dynamic_shared,
        );
        match fake.modules.get(&function.module) {
            None => {
                return fake.reject(
                    NAME,
                    INVALID_HANDLE,
                    format!("`{}` is a function of an unloaded module", entry.name),
                );
            }
            Some(module) if module.device != d => {
                let owner = module.device;
                return fake.reject(
                    NAME,
                    INVALID_CONTEXT,
                    format!(
                        "`{}` is of device {owner}'s context, launched in device {d}'s",
                        entry.name
                    ),
                );
            }
            Some(_) => {}
        }
        let handle = tri!(fake.stream(NAME, stream as u64, d));
        let owner = fake.streams[&handle].device;
        if owner != d {
            return fake.reject(
                NAME,
                INVALID_HANDLE,
                format!("stream {handle:#x} of device {owner} used in device {d}'s context"),
            );
        }
        tri!(check_shape(fake, d, [gx, gy, gz], [bx, by, bz], &entry));
        if shared > max_shared {
            return fake.reject(
                NAME,
                INVALID_VALUE,
                format!(
                    "{shared} bytes of dynamic shared memory for `{}`, which may use {max_shared} (cuFuncSetAttribute raises it)",
                    entry.name
                ),
            );
        }
        if !extra.is_null() {
            return fake.reject(
                NAME,
                if params.is_null() {
                    NOT_SUPPORTED
                } else {
                    INVALID_VALUE
                },
                "parameters through `extra` are not faked (and never with kernelParams)",
            );
        }
        if !entry.params.is_empty() && params.is_null() {
            return fake.reject(
                NAME,
                INVALID_VALUE,
                format!(
                    "`{}` takes {} parameters, kernelParams is NULL",
                    entry.name,
                    entry.params.len()
                ),
            );
        }
        for i in 0..entry.params.len() {
            if unsafe { params.add(i).read() }.is_null() {
                return fake.reject(
                    NAME,
                    INVALID_VALUE,
                    format!("kernelParams[{i}] of `{}` is NULL", entry.name),
                );
            }
        }
        let peer_enabled = fake.peer_enabled.clone();
        let peer = move |a: usize, b: usize| a == b || peer_enabled.contains(&(a, b));
        let mut touches = Vec::new();
        let mut faulty = false;
        for (i, param) in entry.params.iter().enumerate() {
            let Param::Pointer {
                name,
                access,
                elem,
                count,
            } = param
            else {
                continue;
            };
            // SAFETY: checked non-NULL; a pointer parameter's slot holds a device pointer.
            let address = unsafe { (params.add(i).read() as *const u64).read_unaligned() };
            let problem = match unsafe { range(params, *elem, count) } {
                Some(0) => continue,
                None => "its length read from the kernel's metadata overflows".to_string(),
                Some(len) => match fake.memory.resolve(address, len, d, &peer) {
                    Ok(resolved) => {
                        let write = *access == Access::ReadWrite;
                        touches.extend(
                            resolved
                                .pieces
                                .into_iter()
                                .map(|piece: Piece| Touch::Phys { piece, write }),
                        );
                        continue;
                    }
                    Err(what) => format!("{len} bytes at {address:#x}: {what}"),
                },
            };
            fake.violation(
                label,
                format!(
                    "parameter {i} (`{name}`) of `{}` is not device memory the kernel may use: {problem}",
                    entry.name
                ),
            );
            faulty = true;
        }
        fake.enqueue(label, handle, Op::Kernel { faulty }, touches);
        SUCCESS
    })
}
