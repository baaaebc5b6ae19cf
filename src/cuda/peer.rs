//! Copies between CUDA devices without the host: peer access, the devices granted access to
//! this device's expandable-segment pages, and the buffer a peer copies from.
//!
//! `comm_init` of a group enables peer access from this device's context to each peer's where
//! `cuDeviceCanAccessPeer` allows it (already enabled is fine), and grants those peers access
//! to every page mapped for expandable segments, now and at every later map (PyTorch's
//! `ExpandableSegment::addPeer`): memory from `cuMemCreate` is reachable only by the devices
//! `cuMemSetAccess` names. Where peer access is not possible, `cuMemcpyPeerAsync` still copies
//! (the driver stages it).

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::error::{device_error, driver_call};
use super::events::PooledEvent;
use crate::device::DeviceError;

/// A block of a device made ready for a peer to copy from ([`Driver::export`]): the staging
/// copy's address and length, the context that owns it, and the event after the staging copy.
///
/// [`Driver::export`]: crate::runtime::Driver::export
#[derive(Debug)]
pub struct CudaPeerBuffer {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) context: Arc<CudaContext>,
    pub(super) ready: PooledEvent,
}

// SAFETY: driver handles usable from any thread with a context current (every use binds one).
unsafe impl Send for CudaPeerBuffer {}

/// The peers granted access to this device's mapped pages, and those pages.
#[derive(Debug, Default)]
pub(crate) struct PeerAccess {
    state: Mutex<PeerState>,
}

#[derive(Debug, Default)]
struct PeerState {
    peers: Vec<i32>,
    /// Mapped runs: address -> size.
    mapped: BTreeMap<sys::CUdeviceptr, u64>,
}

/// Read and write access for device `ordinal`.
pub(crate) fn access_for(ordinal: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: super::virtual_memory::device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn set_access(ptr: sys::CUdeviceptr, size: u64, peers: &[i32]) -> Result<(), DeviceError> {
    if peers.is_empty() {
        return Ok(());
    }
    let descs: Vec<sys::CUmemAccessDesc> = peers.iter().map(|p| access_for(*p)).collect();
    driver_call("cuMemSetAccess", || {
        // SAFETY: `[ptr, ptr + size)` is mapped (the caller's contract); `descs` is valid.
        unsafe { sys::cuMemSetAccess(ptr, size as usize, descs.as_ptr(), descs.len()) }.result()
    })
}

impl PeerAccess {
    /// Grants `peer` access to every mapped run, and to every run mapped later.
    pub(crate) fn add_peer(&self, peer: i32) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        if state.peers.contains(&peer) {
            return Ok(());
        }
        for (ptr, size) in &state.mapped {
            set_access(*ptr, *size, &[peer])?;
        }
        state.peers.push(peer);
        Ok(())
    }

    /// `[ptr, ptr + size)` was just mapped (and made accessible to its own device): the peers
    /// get access too, and the run is remembered for peers added later.
    pub(crate) fn mapped(&self, ptr: sys::CUdeviceptr, size: u64) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        set_access(ptr, size, &state.peers)?;
        state.mapped.insert(ptr, size);
        Ok(())
    }

    /// `[ptr, ptr + size)` is about to be unmapped: runs inside it are forgotten, and a run
    /// that only partly overlaps keeps its mapped remainder(s).
    pub(crate) fn unmapping(&self, ptr: sys::CUdeviceptr, size: u64) {
        let end = ptr + size;
        let mut state = self.state.lock();
        let overlapping: Vec<(u64, u64)> = state
            .mapped
            .range(..end)
            .filter(|(start, len)| **start + **len > ptr)
            .map(|(start, len)| (*start, *len))
            .collect();
        for (start, len) in overlapping {
            state.mapped.remove(&start);
            if start < ptr {
                state.mapped.insert(start, ptr - start);
            }
            if start + len > end {
                state.mapped.insert(end, start + len - end);
            }
        }
    }

    /// The peers granted access so far.
    #[cfg(test)]
    pub(crate) fn peers(&self) -> Vec<i32> {
        self.state.lock().peers.clone()
    }

    /// The mapped runs remembered, in address order.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> Vec<(u64, u64)> {
        self.state
            .lock()
            .mapped
            .iter()
            .map(|(a, b)| (*a, *b))
            .collect()
    }
}

/// Enables access from `context` (current on the calling thread) to `peer`'s memory, where
/// the devices allow it. `Ok(false)`: they do not (copies go through the driver's staging).
pub(crate) fn enable_peer_access(
    context: &CudaContext,
    peer: &CudaContext,
) -> Result<bool, DeviceError> {
    let mut can = 0;
    driver_call("cuDeviceCanAccessPeer", || {
        // SAFETY: `can` is valid for the write; both devices exist.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, context.cu_device(), peer.cu_device()) }
            .result()
    })?;
    if can == 0 {
        return Ok(false);
    }
    driver_call("cuCtxSetCurrent", || context.bind_to_thread())?;
    // SAFETY: `peer`'s context is live (held by the caller); this context is current.
    match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(true)
        }
        code => Err(device_error(
            "cuCtxEnablePeerAccess",
            cudarc::driver::result::DriverError(code),
            None,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmapping_keeps_the_mapped_remainders_of_a_run() {
        // No peer: nothing is called on the driver.
        let access = PeerAccess::default();
        access.mapped(0x10000, 0x8000).expect("no peer, no call");
        access.mapped(0x40000, 0x2000).expect("no peer, no call");
        access.unmapping(0x12000, 0x2000);
        assert_eq!(
            access.runs(),
            vec![(0x10000, 0x2000), (0x14000, 0x4000), (0x40000, 0x2000)]
        );
        access.unmapping(0x10000, 0x8000);
        assert_eq!(access.runs(), vec![(0x40000, 0x2000)]);
        assert!(access.peers().is_empty());
    }
}
