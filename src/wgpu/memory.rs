//! wgpu device memory: a segment is one wgpu storage buffer, a block an offset in it.
//!
//! - Every block offset the engine hands out is a multiple of 512 bytes, which satisfies any
//!   adapter's `min_storage_buffer_offset_alignment` (WebGPU caps it at 256).
//! - A segment larger than the adapter's `max_buffer_size` is [`DeviceError::TooLarge`]
//!   (the runtime additionally refuses requests above the largest binding).
//! - Buffer creation runs inside an out-of-memory error scope, so a device that has no room
//!   answers [`DeviceError::OutOfMemory`] instead of aborting, and the engine frees cache and
//!   retries.
//! - wgpu has one in-order queue per device: work issued later always runs after work issued
//!   earlier, whatever CubeCL stream issued it. A stream event is therefore complete as soon as
//!   it is recorded, for any work issued after it, which is all the engine needs.
//! - wgpu reports no device memory size. The total this device reports is `total` from
//!   [`WgpuMemory::new`] (the runtime passes the host's RAM, exact for CPU adapters such as
//!   lavapipe); `free` is that total minus the segments this device holds.

use cubecl_common::future::block_on;

use crate::device::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream, MemoryInfo};

/// Usages every segment gets: bound as storage, copied to and from, used for indirect counts.
pub const SEGMENT_USAGES: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::INDIRECT);

/// First fake address handed out; segments get distinct, 2 MiB aligned addresses for
/// snapshots and traces.
const ADDRESS_BASE: u64 = 1 << 32;
const ADDRESS_ALIGN: u64 = 2 * 1024 * 1024;

/// Segments of one wgpu device.
pub struct WgpuMemory {
    device: wgpu::Device,
    max_buffer_size: u64,
    total: u64,
    held: u64,
    next_address: u64,
}

impl core::fmt::Debug for WgpuMemory {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("WgpuMemory")
            .field("max_buffer_size", &self.max_buffer_size)
            .field("total", &self.total)
            .field("held", &self.held)
            .finish()
    }
}

impl WgpuMemory {
    /// Segments of `device`, which reports `total` bytes of memory.
    pub fn new(device: wgpu::Device, total: u64) -> Self {
        let max_buffer_size = device.limits().max_buffer_size;
        Self {
            device,
            max_buffer_size,
            total,
            held: 0,
            next_address: ADDRESS_BASE,
        }
    }

    /// Bytes of the segments this device holds now.
    pub fn held(&self) -> u64 {
        self.held
    }
}

/// The host's RAM in bytes (Linux `/proc/meminfo`), if it can be read.
pub fn host_memory_total() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl DeviceMemory for WgpuMemory {
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
            label: Some("burn-caching-alloc segment"),
            size,
            usage: SEGMENT_USAGES,
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
        // Dropping (not destroying) the buffer: wgpu keeps it alive while recorded or submitted
        // work still uses it, and releases the memory afterwards.
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

    /// One queue: every stream's work already runs in one order.
    fn wait_event(&mut self, _stream: DeviceStream, _event: &()) -> Result<(), DeviceError> {
        Ok(())
    }

    fn waits_on_device(&self) -> bool {
        true
    }

    fn max_segment_size(&self) -> Option<u64> {
        Some(self.max_buffer_size)
    }
}
