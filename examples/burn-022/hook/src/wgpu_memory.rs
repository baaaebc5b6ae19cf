//! wgpu 30 device memory for the engine (the wgpu Burn 0.22.1 / CubeCL 0.11 use): a segment is
//! one storage buffer, a block an offset in it.
//!
//! - Block offsets are multiples of 512 bytes, which covers any adapter's
//!   `min_storage_buffer_offset_alignment` (WebGPU caps it at 256).
//! - Buffer creation runs inside an out-of-memory error scope: a full device answers
//!   [`DeviceError::OutOfMemory`] and the engine frees cache and retries.
//! - wgpu has one in-order queue per device, so a stream event is complete once recorded for
//!   any work submitted after it.
//! - wgpu reports no memory size: `total` is what [`WgpuSegments::new`] is given (the host's
//!   RAM for a CPU adapter such as lavapipe); `free` is `total` minus the segments held.

use caching_alloc_engine::device::{
    DeviceError, DeviceMemory, DeviceSegment, DeviceStream, MemoryInfo,
};
use cubecl_environment::future::block_on;
use cubecl_wgpu::wgpu;

/// Distinct, 2 MiB aligned fake addresses for snapshots and traces.
const ADDRESS_BASE: u64 = 1 << 32;
const ADDRESS_ALIGN: u64 = 2 << 20;

/// The segments of one wgpu device.
pub struct WgpuSegments {
    device: wgpu::Device,
    usage: wgpu::BufferUsages,
    max_buffer_size: u64,
    total: u64,
    held: u64,
    next_address: u64,
}

impl WgpuSegments {
    /// Segments of `device` with `usage`, on a device of `total` bytes.
    pub fn new(device: wgpu::Device, usage: wgpu::BufferUsages, total: u64) -> Self {
        let max_buffer_size = device.limits().max_buffer_size;
        Self {
            device,
            usage,
            max_buffer_size,
            total,
            held: 0,
            next_address: ADDRESS_BASE,
        }
    }
}

/// The host's RAM in bytes (Linux `/proc/meminfo`), if it can be read.
pub fn host_memory_total() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl DeviceMemory for WgpuSegments {
    type Handle = wgpu::Buffer;
    type Event = ();

    fn allocate(
        &mut self,
        size: u64,
        _stream: DeviceStream,
    ) -> Result<DeviceSegment<wgpu::Buffer>, DeviceError> {
        if size > self.max_buffer_size {
            return Err(DeviceError::TooLarge {
                requested: size,
                max: self.max_buffer_size,
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("caching engine segment"),
            size,
            usage: self.usage,
            mapped_at_creation: false,
        });
        if let Some(error) = block_on(scope.pop()) {
            log::warn!("wgpu could not create a segment of {size} bytes: {error}");
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        let address = self.next_address;
        self.next_address += size.div_ceil(ADDRESS_ALIGN).max(1) * ADDRESS_ALIGN;
        self.held += size;
        Ok(DeviceSegment {
            address,
            size,
            handle: buffer,
        })
    }

    unsafe fn free(&mut self, segment: DeviceSegment<wgpu::Buffer>) -> Result<(), DeviceError> {
        // Dropped, not destroyed: wgpu keeps it while submitted work uses it.
        drop(segment.handle);
        self.held = self.held.saturating_sub(segment.size);
        Ok(())
    }

    fn memory_info(&mut self) -> Result<MemoryInfo, DeviceError> {
        Ok(MemoryInfo {
            free: self.total.saturating_sub(self.held),
            total: self.total,
        })
    }

    fn record_event(&mut self, _stream: DeviceStream) -> Result<(), DeviceError> {
        Ok(())
    }

    fn query_event(&mut self, _event: &()) -> Result<bool, DeviceError> {
        Ok(true)
    }

    fn synchronize_event(&mut self, _event: &()) -> Result<(), DeviceError> {
        Ok(())
    }

    fn release_event(&mut self, _event: ()) {}

    fn max_segment_size(&self) -> Option<u64> {
        Some(self.max_buffer_size)
    }
}
