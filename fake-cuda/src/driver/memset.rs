//! `cuMemsetD*`: filling device memory with an 8-, 16- or 32-bit pattern, on a stream or
//! synchronous.

use std::ffi::c_void;

use super::copy::{device_pieces, finish_sync, phys_touches};
use super::copy_stream;
use crate::codes::*;
use crate::state::call;
use crate::streams::Op;

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
