//! [`DeviceStorage`]: CubeCL's `ComputeStorage` over any [`DeviceMemory`], so CubeCL's own
//! `MemoryManagement` runs against the same device as the engine: the simulated device (fake
//! addresses, a fixed capacity) or a real one such as CUDA.
//!
//! Every `alloc` is one device segment of exactly the requested size and every `dealloc`
//! returns it, like `cuMemAlloc`/`cuMemFree` behind cubecl-cuda's `GpuStorage`. CubeCL's
//! `MemoryManagement` has no `Drop` of its own, so dropping the storage returns the segments
//! it still holds: a manager dropped after a replay leaves nothing on a real device.

use std::collections::HashMap;
use std::sync::Arc;

use burn_caching_alloc::device::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream};
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};
use parking_lot::Mutex;

/// A device shared by the storages of several streams (one CubeCL manager per stream).
pub type SharedDevice<D> = Arc<Mutex<D>>;

/// Where a slice lives on the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceResource<H> {
    /// The device handle of the segment holding the slice.
    pub segment: H,
    /// The slice's device address (the segment's address plus `offset`).
    pub address: u64,
    /// Byte offset of the slice inside the segment.
    pub offset: u64,
    pub size: u64,
}

/// A `ComputeStorage` whose memory is segments of a device `D`, each one exactly what CubeCL
/// asked for.
pub struct DeviceStorage<D: DeviceMemory> {
    device: SharedDevice<D>,
    stream: DeviceStream,
    alignment: usize,
    segments: HashMap<StorageId, DeviceSegment<D::Handle>>,
    last_error: Option<DeviceError>,
}

impl<D: DeviceMemory> core::fmt::Debug for DeviceStorage<D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceStorage")
            .field("stream", &self.stream)
            .field("alignment", &self.alignment)
            .field("segments", &self.segments.len())
            .finish()
    }
}

impl<D: DeviceMemory> DeviceStorage<D> {
    /// A storage allocating on `device` for `stream`, reporting `alignment` to CubeCL.
    pub fn new(device: SharedDevice<D>, stream: DeviceStream, alignment: usize) -> Self {
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

impl<D: DeviceMemory> ComputeStorage for DeviceStorage<D> {
    type Resource = DeviceResource<D::Handle>;

    fn alignment(&self) -> usize {
        self.alignment
    }

    fn get(&mut self, handle: &StorageHandle) -> Self::Resource {
        // MemoryManagement resolves only slices of segments it allocated and has not freed.
        let segment = self.segments.get(&handle.id).unwrap_or_else(|| {
            panic!(
                "DeviceStorage: {} is not a live segment (CubeCL resolved freed memory)",
                handle.id
            )
        });
        DeviceResource {
            segment: segment.handle.clone(),
            address: segment.address + handle.offset(),
            offset: handle.offset(),
            size: handle.size(),
        }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let allocated = self.device.lock().allocate(size, self.stream);
        match allocated {
            Ok(segment) => {
                let id = StorageId::new();
                self.segments.insert(id, segment);
                Ok(StorageHandle::new(
                    id,
                    StorageUtilization { offset: 0, size },
                ))
            }
            Err(err) => {
                let io = burn_caching_alloc::runtime::device_io_error(err.clone());
                self.last_error = Some(err);
                Err(io)
            }
        }
    }

    fn dealloc(&mut self, id: StorageId) {
        let Some(segment) = self.segments.remove(&id) else {
            log::warn!("DeviceStorage: dealloc of unknown {id}");
            return;
        };
        // SAFETY: allocated by this storage's device and just taken out of its map, so freed
        // once; the replay queues no device work that could still use it.
        if let Err(err) = unsafe { self.device.lock().free(segment) } {
            log::error!("DeviceStorage: the device refused a free: {err}");
        }
    }

    fn flush(&mut self) {}
}

impl<D: DeviceMemory> Drop for DeviceStorage<D> {
    fn drop(&mut self) {
        if self.segments.is_empty() {
            return;
        }
        let mut device = self.device.lock();
        for (_, segment) in self.segments.drain() {
            // SAFETY: as in `dealloc`: each segment of the map once, no work queued on it.
            if let Err(err) = unsafe { device.free(segment) } {
                log::error!("DeviceStorage: the device refused a free on drop: {err}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn_caching_alloc::device::sim::SimDevice;

    use super::*;

    #[test]
    fn segments_are_exact_and_dropping_the_storage_frees_the_rest() {
        let sim = SimDevice::new(1 << 30);
        let mut storage =
            DeviceStorage::new(Arc::new(Mutex::new(sim.clone())), DeviceStream(0), 512);
        let a = storage.alloc(1000).expect("fits");
        let b = storage.alloc(3 << 20).expect("fits");
        assert_eq!(sim.bytes_in_use(), 1000 + (3 << 20));
        let resource = storage.get(&b);
        assert_eq!(resource.size, 3 << 20);
        assert_eq!(resource.offset, 0);
        assert_eq!(sim.live_segments()[1].0, resource.address);
        storage.dealloc(a.id);
        assert_eq!(storage.segments(), 1);
        assert_eq!(sim.counters().frees, 1);
        drop(storage);
        assert_eq!(sim.counters().frees, 2);
        assert_eq!(sim.bytes_in_use(), 0);
    }

    #[test]
    fn a_device_refusal_is_kept_for_the_caller() {
        let sim = SimDevice::new(1 << 20);
        let mut storage = DeviceStorage::new(Arc::new(Mutex::new(sim)), DeviceStream(0), 512);
        assert!(storage.alloc(2 << 20).is_err());
        assert!(matches!(
            storage.take_error(),
            Some(DeviceError::OutOfMemory { .. })
        ));
        assert_eq!(storage.take_error(), None);
    }
}
