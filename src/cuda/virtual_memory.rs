//! CUDA virtual memory for expandable segments: address ranges from `cuMemAddressReserve`,
//! pages from `cuMemCreate` mapped with `cuMemMap` and made readable and writable with
//! `cuMemSetAccess`, returned with `cuMemUnmap` + `cuMemRelease`, ranges given back with
//! `cuMemAddressFree`.
//!
//! Each page gets a physical allocation of its own (PyTorch's `ExpandableSegment` does the
//! same): CUDA cannot unmap part of one mapping, and the engine gives back single pages. Access
//! is set once per mapped run, as PyTorch's `setAccess` does, not once per page; the peers
//! `comm_init` added ([`PeerAccess`]) get access to each run too.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::error::{device_error, driver_call, guarded};
use super::peer::PeerAccess;
use crate::device::DeviceError;

/// The ranges reserved on one device and the pages mapped in them.
#[derive(Debug)]
pub(crate) struct VirtualRanges {
    ordinal: i32,
    /// The allocation granularity; `None` when the device has no virtual memory management.
    granularity: Option<u64>,
    /// Per range base: its size and its mapped pages (offset -> physical handle and size).
    ranges: HashMap<sys::CUdeviceptr, (u64, BTreeMap<u64, Page>)>,
    /// Peer devices granted access to the mapped runs.
    peers: Arc<PeerAccess>,
}

/// One mapped page: its physical allocation and size.
#[derive(Debug, Clone, Copy)]
struct Page {
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
}

/// Pinned device memory on device `ordinal`, the properties every page is created with.
fn page_properties(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all zeroes is valid (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = device_location(ordinal);
    prop
}

/// The location of device `ordinal`. The device id is the `int` right after the location type
/// in every CUDA version (a union member from CUDA 13.2 on, a plain field before), so it is
/// written there whichever layout cudarc was built with.
pub(crate) fn device_location(ordinal: i32) -> sys::CUmemLocation {
    // SAFETY: all zeroes is a valid location; the id is written at its C offset, inside the
    // struct (it is at least a type and an int), with the int's alignment.
    unsafe {
        let mut location: sys::CUmemLocation = std::mem::zeroed();
        location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let id = (&raw mut location)
            .cast::<u8>()
            .add(size_of::<sys::CUmemLocationType>())
            .cast::<i32>();
        id.write(ordinal);
        location
    }
}

fn check(call: &str, code: sys::CUresult, requested: Option<u64>) -> Result<(), DeviceError> {
    code.result()
        .map_err(|err: DriverError| device_error(call, err, requested))
}

impl VirtualRanges {
    /// The virtual memory of the context's device: its granularity if the device supports
    /// virtual memory management (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`).
    pub(crate) fn new(context: &CudaContext) -> Self {
        let ordinal = context.ordinal() as i32;
        let granularity = guarded("cuMemGetAllocationGranularity", || {
            // SAFETY: a query of the current device's attribute.
            let supported = unsafe {
                result::device::get_attribute(
                    context.cu_device(),
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                )
            }
            .map_err(|err| device_error("cuDeviceGetAttribute", err, None))?;
            if supported == 0 {
                return Ok(None);
            }
            let prop = page_properties(ordinal);
            let mut granularity = 0usize;
            // SAFETY: both pointers are valid for the call.
            let code = unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            };
            check("cuMemGetAllocationGranularity", code, None)?;
            Ok(Some(granularity as u64))
        })
        .unwrap_or_else(|err| {
            log::warn!("CUDA virtual memory unavailable: {err}");
            None
        });
        Self {
            ordinal,
            granularity,
            ranges: HashMap::new(),
            peers: Arc::default(),
        }
    }

    /// The peers granted access to this device's mapped runs (shared with the driver, whose
    /// `comm_init` adds them).
    pub(crate) fn peer_access(&self) -> Arc<PeerAccess> {
        self.peers.clone()
    }

    /// The page granularity, if the device has virtual memory.
    pub(crate) fn granularity(&self) -> Option<u64> {
        self.granularity
    }

    /// Reserves `size` bytes of address space (a multiple of the granularity).
    pub(crate) fn reserve(&mut self, size: u64) -> Result<sys::CUdeviceptr, DeviceError> {
        let Some(granularity) = self.granularity else {
            return Err(DeviceError::Unsupported(
                "CUDA virtual memory on this device",
            ));
        };
        let mut base: sys::CUdeviceptr = 0;
        driver_call("cuMemAddressReserve", || {
            // SAFETY: `base` is valid for the write; no fixed address is asked for.
            unsafe {
                sys::cuMemAddressReserve(&mut base, size as usize, granularity as usize, 0, 0)
            }
            .result()
        })?;
        self.ranges.insert(base, (size, BTreeMap::new()));
        Ok(base)
    }

    /// Maps `size` bytes at `offset` of the range at `base`, one physical allocation per
    /// `page` bytes, then makes the whole run readable and writable with one `cuMemSetAccess`
    /// (PyTorch's `ExpandableSegment::map` then `setAccess` over the range). Out of memory
    /// from any of the three calls enters the engine's miss path (it frees cache and
    /// retries); on any failure nothing this call mapped stays mapped.
    pub(crate) fn map(
        &mut self,
        base: sys::CUdeviceptr,
        offset: u64,
        size: u64,
        page: u64,
    ) -> Result<(), DeviceError> {
        let prop = page_properties(self.ordinal);
        let access = sys::CUmemAccessDesc {
            location: device_location(self.ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut mapped = Vec::new();
        let mut at = offset;
        let result = guarded("cuMemMap", || {
            while at < offset + size {
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: valid pointers; the page is a multiple of the granularity.
                let code = unsafe { sys::cuMemCreate(&mut handle, page as usize, &prop, 0) };
                check("cuMemCreate", code, Some(size))?;
                let ptr = base + at;
                // SAFETY: `ptr..ptr + page` lies in a range this object reserved and is not
                // mapped (the engine maps only unmapped pages).
                let code = unsafe { sys::cuMemMap(ptr, page as usize, 0, handle, 0) };
                if let Err(err) = check("cuMemMap", code, Some(size)) {
                    // SAFETY: the handle was created above and is mapped nowhere.
                    unsafe { sys::cuMemRelease(handle) };
                    return Err(err);
                }
                mapped.push((at, Page { handle, size: page }));
                at += page;
            }
            // SAFETY: `[offset, offset + size)` of the range was just mapped; `access` is
            // valid for the call.
            let code = unsafe { sys::cuMemSetAccess(base + offset, size as usize, &access, 1) };
            check("cuMemSetAccess", code, Some(size))?;
            self.peers.mapped(base + offset, size)
        });
        match result {
            Ok(()) => {
                let pages = &mut self.ranges.get_mut(&base).expect("a reserved range").1;
                pages.extend(mapped);
                Ok(())
            }
            Err(err) => {
                for (at, p) in mapped {
                    // SAFETY: undoing this call's own mappings, which nothing uses yet.
                    unsafe {
                        sys::cuMemUnmap(base + at, p.size as usize);
                        sys::cuMemRelease(p.handle);
                    }
                }
                Err(err)
            }
        }
    }

    /// Unmaps and releases the pages in `[offset, offset + size)` of the range at `base`, in
    /// address order. The caller has made sure the device no longer uses them. A failure after
    /// the first page is [`DeviceError::PartialUnmap`] with the bytes unmapped before it, so
    /// the engine can split its block there. A page unmapped whose physical handle could not
    /// be released counts as unmapped (its handle is leaked, and said so).
    pub(crate) fn unmap(
        &mut self,
        base: sys::CUdeviceptr,
        offset: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        let pages = &mut self
            .ranges
            .get_mut(&base)
            .ok_or_else(|| DeviceError::Driver(format!("unknown address range {base:#x}")))?
            .1;
        let inside: Vec<(u64, Page)> = pages
            .range(offset..offset + size)
            .map(|(at, p)| (*at, *p))
            .collect();
        let partial = |at: u64, err: DeviceError| match err {
            DeviceError::Driver(reason) if at > offset => DeviceError::PartialUnmap {
                unmapped: at - offset,
                reason,
            },
            other => other,
        };
        for (at, p) in inside {
            self.peers.unmapping(base + at, p.size);
            driver_call("cuMemUnmap", || {
                // SAFETY: the page is mapped here and idle.
                unsafe { sys::cuMemUnmap(base + at, p.size as usize) }.result()
            })
            .map_err(|err| partial(at, err))?;
            pages.remove(&at);
            driver_call("cuMemRelease", || {
                // SAFETY: the handle's only mapping was just removed.
                unsafe { sys::cuMemRelease(p.handle) }.result()
            })
            .map_err(|err| {
                log::error!("caching allocator: a page's physical memory is leaked: {err}");
                partial(at + p.size, err)
            })?;
        }
        Ok(())
    }

    /// Gives back the range at `base`, which has nothing mapped.
    pub(crate) fn release(&mut self, base: sys::CUdeviceptr) -> Result<(), DeviceError> {
        let Some((size, pages)) = self.ranges.remove(&base) else {
            return Err(DeviceError::Driver(format!(
                "unknown address range {base:#x}"
            )));
        };
        debug_assert!(pages.is_empty(), "a range is released with nothing mapped");
        driver_call("cuMemAddressFree", || {
            // SAFETY: the range was reserved here with this size and has no mapping left.
            unsafe { sys::cuMemAddressFree(base, size as usize) }.result()
        })
    }
}
