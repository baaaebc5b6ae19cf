//! Virtual memory management: address ranges (`cuMemAddressReserve`/`Free`), physical
//! allocations (`cuMemCreate`/`Release`), mapping, access and unmapping.

use std::ffi::{c_int, c_void};

use super::alloc::settle_users;
use super::{Guard, check_out, initialized, out};
use crate::codes::*;
use crate::memory::{Mapping, NotWholeMappings};
use crate::state::call;

/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE`.
const ALLOCATION_PINNED: u32 = 1;
const LOCATION_DEVICE: u32 = 1;

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
