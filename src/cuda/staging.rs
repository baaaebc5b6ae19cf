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

use super::events::{EventPool, PooledEvent};

/// Transfers up to this size go through pinned staging; larger ones copy from or to pageable
/// memory directly (pinning that much memory costs more than it saves).
pub const MAX_PINNED_TRANSFER: usize = 64 << 20;
/// Idle pinned bytes kept for reuse.
pub const MAX_IDLE_BYTES: usize = 256 << 20;
/// Smallest pinned buffer allocated.
const MIN_BUFFER: usize = 64 << 10;

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
            None => self.allocate(len.next_power_of_two().max(MIN_BUFFER))?,
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

/// Staging buffers that a stream still copies into or out of, until the event after the copy.
/// Dropping it waits for the event, so a buffer never returns to the pool mid-copy.
#[derive(Debug)]
pub struct InFlight {
    event: Option<PooledEvent>,
    staged: Vec<Staged>,
}

impl InFlight {
    /// `staged` is in use by the copies issued before `event`.
    pub fn new(event: PooledEvent, staged: Vec<Staged>) -> Self {
        Self {
            event: Some(event),
            staged,
        }
    }

    /// Whether the copies have completed (an error counts as completed: the copy is over).
    pub fn is_done(&self) -> bool {
        self.event
            .as_ref()
            .is_none_or(|event| event.query().unwrap_or(true))
    }

    /// Waits for the copies and hands the buffers over.
    pub fn wait(mut self) -> Result<Vec<Staged>, DriverError> {
        let waited = match self.event.take() {
            Some(event) => event.synchronize().map_err(DriverError::from),
            None => Ok(()),
        };
        let staged = std::mem::take(&mut self.staged);
        waited.map(|()| staged)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let _ = event.synchronize();
        }
    }
}

/// Keeps the staging buffers of asynchronous writes until their copies completed.
#[derive(Debug, Default)]
pub struct PendingWrites {
    in_flight: Vec<InFlight>,
}

impl PendingWrites {
    /// Remembers copies in flight.
    pub fn push(&mut self, in_flight: InFlight) {
        self.in_flight.push(in_flight);
    }

    /// Returns the buffers of completed copies to their pool.
    pub fn collect(&mut self) {
        self.in_flight.retain(|entry| !entry.is_done());
    }
}

/// Records an event on `stream` for copies that use `staged`.
///
/// # Safety
/// `stream` must be a live stream of the pool's context.
pub unsafe fn in_flight(
    events: &Arc<EventPool>,
    stream: cudarc::driver::sys::CUstream,
    staged: Vec<Staged>,
) -> Result<InFlight, DriverError> {
    // SAFETY: forwarded from the caller.
    let event = unsafe { events.record(stream) }?;
    Ok(InFlight::new(event, staged))
}
