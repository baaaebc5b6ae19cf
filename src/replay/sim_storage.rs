//! CubeCL's `ComputeStorage` over the simulated device, so CubeCL's own `MemoryManagement`
//! can run against the same fake address space, capacity and counters as the engine.
//!
//! Every `alloc` is one device segment of exactly the requested size and every `dealloc`
//! returns it, like `cuMemAlloc`/`cuMemFree` behind cubecl-cuda's `GpuStorage`.

use std::collections::HashMap;

use cubecl_common::backtrace::BackTrace;
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};

use crate::device::sim::SimDevice;
use crate::device::{DeviceError, DeviceMemory, DeviceSegment, StreamId};

/// Where a slice lives on the simulated device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimResource {
    /// The segment's handle on the device.
    pub segment: u64,
    /// The slice's device address.
    pub address: u64,
    pub size: u64,
}

/// A `ComputeStorage` whose memory is segments of a [`SimDevice`].
#[derive(Debug)]
pub struct SimStorage {
    device: SimDevice,
    stream: StreamId,
    alignment: usize,
    segments: HashMap<StorageId, DeviceSegment<u64>>,
    last_error: Option<DeviceError>,
}

impl SimStorage {
    /// A storage allocating on `device` for `stream`, reporting `alignment` to CubeCL.
    pub fn new(device: SimDevice, stream: StreamId, alignment: usize) -> Self {
        Self {
            device,
            stream,
            alignment,
            segments: HashMap::new(),
            last_error: None,
        }
    }

    /// The device error behind the last failed `alloc`, if any; clears it.
    pub fn take_error(&mut self) -> Option<DeviceError> {
        self.last_error.take()
    }

    /// Segments this storage holds.
    pub fn segments(&self) -> usize {
        self.segments.len()
    }
}

impl ComputeStorage for SimStorage {
    type Resource = SimResource;

    fn alignment(&self) -> usize {
        self.alignment
    }

    fn get(&mut self, handle: &StorageHandle) -> SimResource {
        // MemoryManagement resolves only slices of segments it allocated and has not freed.
        let segment = self.segments.get(&handle.id).unwrap_or_else(|| {
            panic!(
                "SimStorage: {} is not a live segment (CubeCL resolved freed memory)",
                handle.id
            )
        });
        SimResource {
            segment: segment.handle,
            address: segment.address + handle.offset(),
            size: handle.size(),
        }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        match self.device.allocate(size, self.stream) {
            Ok(segment) => {
                let id = StorageId::new();
                self.segments.insert(id, segment);
                Ok(StorageHandle::new(
                    id,
                    StorageUtilization { offset: 0, size },
                ))
            }
            Err(err) => {
                let io = match &err {
                    DeviceError::TooLarge { .. } => IoError::BufferTooBig {
                        size,
                        backtrace: BackTrace::capture(),
                    },
                    other => IoError::Unknown {
                        description: format!("simulated device: {other}"),
                        backtrace: BackTrace::capture(),
                    },
                };
                self.last_error = Some(err);
                Err(io)
            }
        }
    }

    fn dealloc(&mut self, id: StorageId) {
        let Some(segment) = self.segments.remove(&id) else {
            log::warn!("SimStorage: dealloc of unknown {id}");
            return;
        };
        if let Err(err) = self.device.free(segment) {
            log::error!("SimStorage: the simulated device refused a free: {err}");
        }
    }

    fn flush(&mut self) {}
}
