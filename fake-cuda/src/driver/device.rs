//! Initialisation, the driver version and device queries (count, name, UUID, memory,
//! attributes).

use std::ffi::{c_char, c_int, c_uint};

use super::{check_out, initialized, out};
use crate::codes::*;
use crate::state::{Fake, call};

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

/// `CU_DEVICE_ATTRIBUTE_*` numbers the launch checks read.
pub(super) mod attr {
    use std::ffi::c_int;
    pub const MAX_THREADS_PER_BLOCK: c_int = 1;
    pub const MAX_BLOCK_DIM: [c_int; 3] = [2, 3, 4];
    pub const MAX_GRID_DIM: [c_int; 3] = [5, 6, 7];
    pub const MAX_SHARED_MEMORY_PER_BLOCK: c_int = 8;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
}

/// What the fake's device `d` reports for `attribute` (0 for attributes it does not model).
pub(super) fn attribute(fake: &Fake, attribute: c_int, d: usize) -> c_int {
    let (major, minor) = fake.config.compute_capability;
    match attribute {
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
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute_number: c_int,
    device: c_int,
) -> u32 {
    call("cuDeviceGetAttribute", |fake| {
        tri!(initialized(fake, "cuDeviceGetAttribute"));
        let d = tri!(fake.device_index("cuDeviceGetAttribute", device));
        tri!(check_out(fake, "cuDeviceGetAttribute", value));
        let v = attribute(fake, attribute_number, d);
        unsafe { out(value, v) };
        SUCCESS
    })
}
