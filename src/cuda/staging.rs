//! Pinned (page-locked) host buffers for copies between host and device.
//!
//! Copies from pinned memory run asynchronously on a stream and at full bus speed. Buffers are
//! pooled: a copy takes the smallest idle buffer that fits, and a [`Staged`] buffer goes back
//! to the pool when dropped. Idle buffers beyond [`MAX_IDLE_BYTES`] are freed.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::result;
use parking_lot::Mutex;

use crate::runtime::DriverError;

use super::in_flight::CopyBuffer;

/// Writes up to this size go through pooled pinned staging; larger ones copy from pageable
/// memory directly (the driver stages them without waiting for the device). Reads of any size
/// are staged in pinned memory, so that no read waits for the device on the server's thread;
/// above this size the buffer is sized to the read rather than pooled.
pub const MAX_PINNED_TRANSFER: usize = 64 << 20;
/// Idle pinned bytes kept for reuse.
pub const MAX_IDLE_BYTES: usize = 256 << 20;
/// Smallest pinned buffer allocated.
const MIN_BUFFER: usize = 64 << 10;

/// The capacity allocated for a copy of `len` bytes: a power of two up to
/// [`MAX_PINNED_TRANSFER`] (pooled sizes), above it `len` rounded up to 2 MiB (a large read,
/// whose buffer is freed again unless it fits the idle bound).
pub fn buffer_capacity(len: usize) -> usize {
    if len <= MAX_PINNED_TRANSFER {
        len.next_power_of_two().max(MIN_BUFFER)
    } else {
        len.next_multiple_of(2 << 20)
    }
}

#[derive(Debug)]
struct PinnedBuffer {
    ptr: *mut u8,
    capacity: usize,
}

// SAFETY: page-locked host memory is ordinary memory to every thread; the pool hands each
// buffer to one owner at a time.
unsafe impl Send for PinnedBuffer {}

#[derive(Debug, Default)]
struct Idle {
    buffers: Vec<PinnedBuffer>,
    bytes: usize,
}

/// A pool of pinned host buffers of one CUDA context.
#[derive(Debug)]
pub struct StagingPool {
    context: Arc<CudaContext>,
    idle: Mutex<Idle>,
}

impl StagingPool {
    /// An empty pool.
    pub fn new(context: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Self {
            context,
            idle: Mutex::new(Idle::default()),
        })
    }

    /// A pinned buffer of at least `len` bytes.
    pub fn take(self: &Arc<Self>, len: usize) -> Result<Staged, DriverError> {
        let reused = {
            let mut idle = self.idle.lock();
            let best = idle
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, buffer)| buffer.capacity >= len)
                .min_by_key(|(_, buffer)| buffer.capacity)
                .map(|(index, _)| index);
            best.map(|index| {
                let buffer = idle.buffers.swap_remove(index);
                idle.bytes -= buffer.capacity;
                buffer
            })
        };
        let buffer = match reused {
            Some(buffer) => buffer,
            None => self.allocate(buffer_capacity(len))?,
        };
        Ok(Staged {
            buffer: Some(buffer),
            len,
            pool: self.clone(),
        })
    }

    fn allocate(&self, capacity: usize) -> Result<PinnedBuffer, DriverError> {
        self.context
            .bind_to_thread()
            .map_err(|err| DriverError::call("CUDA", "cuCtxSetCurrent", format!("{:?}", err.0)))?;
        // SAFETY: a plain page-locked allocation, freed once by `release`.
        let ptr = unsafe { result::malloc_host(capacity, 0) }.map_err(|err| {
            DriverError::call(
                "CUDA",
                "cuMemHostAlloc",
                format!("{capacity} bytes: {:?}", err.0),
            )
        })?;
        Ok(PinnedBuffer {
            ptr: ptr as *mut u8,
            capacity,
        })
    }

    fn release(&self, buffer: PinnedBuffer) {
        // SAFETY: allocated by `allocate`, freed once, here.
        let _ = unsafe { result::free_host(buffer.ptr as *mut _) };
    }

    fn give_back(&self, buffer: PinnedBuffer) {
        let mut idle = self.idle.lock();
        if idle.bytes + buffer.capacity <= MAX_IDLE_BYTES {
            idle.bytes += buffer.capacity;
            idle.buffers.push(buffer);
        } else {
            drop(idle);
            if self.context.bind_to_thread().is_ok() {
                self.release(buffer);
            }
        }
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        let idle = std::mem::take(&mut *self.idle.lock());
        if idle.buffers.is_empty() || self.context.bind_to_thread().is_err() {
            return;
        }
        for buffer in idle.buffers {
            self.release(buffer);
        }
    }
}

/// A pinned buffer in use, `len` bytes of it; back to the pool when dropped.
#[derive(Debug)]
pub struct Staged {
    buffer: Option<PinnedBuffer>,
    len: usize,
    pool: Arc<StagingPool>,
}

impl Staged {
    /// The host address of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.buffer
            .as_ref()
            .map(|buffer| buffer.ptr)
            .unwrap_or(std::ptr::null_mut())
    }

    /// The bytes in use, to fill or read. Only while no copy into or out of it is running.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &self.buffer {
            // SAFETY: the buffer holds `capacity >= len` bytes and has one owner (`self`).
            Some(buffer) => unsafe { std::slice::from_raw_parts_mut(buffer.ptr, self.len) },
            None => &mut [],
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.give_back(buffer);
        }
    }
}

impl CopyBuffer for Staged {
    fn abandon(mut self) {
        // Dropping the `PinnedBuffer` value frees nothing: the pinned memory is leaked.
        self.buffer.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_reads_get_a_buffer_of_their_size_not_the_next_power_of_two() {
        assert_eq!(buffer_capacity(1), 64 << 10);
        assert_eq!(buffer_capacity(MAX_PINNED_TRANSFER), MAX_PINNED_TRANSFER);
        assert_eq!(
            buffer_capacity(MAX_PINNED_TRANSFER + 1),
            MAX_PINNED_TRANSFER + (2 << 20)
        );
        assert_eq!(buffer_capacity(300 << 20), 300 << 20);
    }
}
