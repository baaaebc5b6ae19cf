//! Pinned (page-locked) host buffers for copies between host and device.
//!
//! Copies from pinned memory run asynchronously on a stream and at full bus speed. Buffers are
//! pooled: a copy takes the smallest idle buffer that fits, and a [`Staged`] buffer goes back
//! to the pool when dropped. The pool's limits are the configuration's `pinned_*` keys
//! ([`PinnedHostConfig`]): idle buffers beyond `pinned_max_idle_mb` (256 MiB by default) are
//! freed, and so is every buffer larger than `pinned_max_cached_size_mb` when it comes back
//! (PyTorch's rule, `CachingHostAllocator`); with `pinned_reserve_segment_size_mb`, one pinned
//! allocation made when the device opens serves buffers before the driver is asked, and its
//! buffers always stay in the pool (PyTorch's `PinnedReserveSegment`).
//!
//! The pool counts what it does ([`PinnedHostStats`], PyTorch's `host_memory_stats`): buffers
//! and bytes handed out, pinned allocations and bytes held, and the time spent in
//! `cuMemHostAlloc` and `cuMemFreeHost`; `memory_stats` shows them under `host_*` keys.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;
use cudarc::driver::result;
use parking_lot::Mutex;

use crate::alloc::PinnedHostConfig;
use crate::runtime::{DriverError, PinnedHostPool, PinnedHostStats};

use super::in_flight::CopyBuffer;

/// Writes up to this size go through pooled pinned staging; larger ones copy from pageable
/// memory directly (the driver stages them without waiting for the device). Reads of any size
/// are staged in pinned memory, so that no read waits for the device on the server's thread;
/// above this size the buffer is sized to the read rather than pooled.
pub const MAX_PINNED_TRANSFER: usize = 64 << 20;
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
    /// Carved from the reservation: never freed on its own.
    reserved: bool,
}

// SAFETY: page-locked host memory is ordinary memory to every thread; the pool hands each
// buffer to one owner at a time.
unsafe impl Send for PinnedBuffer {}

/// The up-front reservation: buffers are carved from its start on, never given back to it.
#[derive(Debug)]
struct Reserve {
    base: *mut u8,
    size: usize,
    carved: usize,
    /// A buffer carved from it was abandoned with a copy that may still use it: the
    /// reservation is never freed.
    leaked: bool,
}

// SAFETY: as for `PinnedBuffer`; the pool's lock guards the carving.
unsafe impl Send for Reserve {}

#[derive(Debug, Default)]
struct State {
    idle: Vec<PinnedBuffer>,
    /// Idle bytes of buffers allocated on their own (what `max_idle` bounds).
    idle_bytes: usize,
    reserve: Option<Reserve>,
    stats: PinnedHostStats,
}

/// A pool of pinned host buffers of one CUDA context.
#[derive(Debug)]
pub struct StagingPool {
    context: Arc<CudaContext>,
    limits: PinnedHostConfig,
    state: Mutex<State>,
}

impl StagingPool {
    /// An empty pool with the default limits.
    pub fn new(context: Arc<CudaContext>) -> Arc<Self> {
        Self::with_config(context, &PinnedHostConfig::default())
    }

    /// A pool with `config`'s limits, its reservation allocated now. A reservation the driver
    /// refuses is logged and the pool works without it.
    pub fn with_config(context: Arc<CudaContext>, config: &PinnedHostConfig) -> Arc<Self> {
        let pool = Self {
            context,
            limits: *config,
            state: Mutex::new(State::default()),
        };
        let size = usize::try_from(config.reserve_segment).unwrap_or(usize::MAX);
        if size > 0 {
            match pool.allocate(size) {
                Ok(buffer) => {
                    let mut state = pool.state.lock();
                    state.stats.reserve_segment_bytes = size as u64;
                    state.reserve = Some(Reserve {
                        base: buffer.ptr,
                        size,
                        carved: 0,
                        leaked: false,
                    });
                }
                Err(err) => log::warn!(
                    "caching allocator: the pinned reservation \
                     (pinned_reserve_segment_size_mb) failed, going on without it: {err}"
                ),
            }
        }
        Arc::new(pool)
    }

    /// A pinned buffer of at least `len` bytes: the smallest idle one that fits, else one
    /// carved from the reservation, else a new one.
    pub fn take(self: &Arc<Self>, len: usize) -> Result<Staged, DriverError> {
        let capacity = buffer_capacity(len);
        let found = {
            let mut state = self.state.lock();
            let best = state
                .idle
                .iter()
                .enumerate()
                .filter(|(_, buffer)| buffer.capacity >= len)
                .min_by_key(|(_, buffer)| buffer.capacity)
                .map(|(index, _)| index);
            let found = match best {
                Some(index) => {
                    let buffer = state.idle.swap_remove(index);
                    if !buffer.reserved {
                        state.idle_bytes -= buffer.capacity;
                    }
                    Some(buffer)
                }
                None => state.reserve.as_mut().and_then(|reserve| {
                    (reserve.size - reserve.carved >= capacity).then(|| {
                        // SAFETY: inside the reservation (checked just above).
                        let ptr = unsafe { reserve.base.add(reserve.carved) };
                        reserve.carved += capacity;
                        PinnedBuffer {
                            ptr,
                            capacity,
                            reserved: true,
                        }
                    })
                }),
            };
            if let Some(buffer) = &found {
                state.stats.allocation.increase(1);
                state.stats.allocated_bytes.increase(buffer.capacity as u64);
            }
            found
        };
        let buffer = match found {
            Some(buffer) => buffer,
            None => {
                let buffer = self.allocate(capacity)?;
                let mut state = self.state.lock();
                state.stats.allocation.increase(1);
                state.stats.allocated_bytes.increase(capacity as u64);
                buffer
            }
        };
        Ok(Staged {
            buffer: Some(buffer),
            len,
            pool: self.clone(),
        })
    }

    /// A new pinned allocation of `capacity` bytes, counted (a segment held, its bytes
    /// reserved, the call's time).
    fn allocate(&self, capacity: usize) -> Result<PinnedBuffer, DriverError> {
        self.context
            .bind_to_thread()
            .map_err(|err| DriverError::call("CUDA", "cuCtxSetCurrent", format!("{:?}", err.0)))?;
        let start = Instant::now();
        // SAFETY: a plain page-locked allocation, freed once by `release`.
        let ptr = unsafe { result::malloc_host(capacity, 0) }.map_err(|err| {
            DriverError::call(
                "CUDA",
                "cuMemHostAlloc",
                format!("{capacity} bytes: {:?}", err.0),
            )
        })?;
        let took = start.elapsed();
        let mut state = self.state.lock();
        state.stats.host_alloc_time.add(took);
        state.stats.segment.increase(1);
        state.stats.reserved_bytes.increase(capacity as u64);
        Ok(PinnedBuffer {
            ptr: ptr as *mut u8,
            capacity,
            reserved: false,
        })
    }

    /// Frees a pinned allocation (with the context bound), counted.
    fn release(&self, ptr: *mut u8, capacity: usize) {
        let start = Instant::now();
        if free_pinned(ptr) {
            let took = start.elapsed();
            let mut state = self.state.lock();
            state.stats.host_free_time.add(took);
            state.stats.segment.decrease(1);
            state.stats.reserved_bytes.decrease(capacity as u64);
        }
    }

    fn give_back(&self, buffer: PinnedBuffer) {
        let mut state = self.state.lock();
        state.stats.allocation.decrease(1);
        state.stats.allocated_bytes.decrease(buffer.capacity as u64);
        let capacity = buffer.capacity;
        let too_large = self
            .limits
            .max_cached_size
            .is_some_and(|max| capacity as u64 > max);
        let fits = state.idle_bytes as u64 + capacity as u64 <= self.limits.max_idle;
        if buffer.reserved {
            state.idle.push(buffer);
        } else if fits && !too_large {
            state.idle_bytes += capacity;
            state.idle.push(buffer);
        } else {
            drop(state);
            if self.context.bind_to_thread().is_ok() {
                self.release(buffer.ptr, capacity);
            }
        }
    }

    /// A buffer left to a copy that may still run: never reused, never freed. One of the
    /// reservation keeps the whole reservation from being freed.
    fn abandon(&self, buffer: PinnedBuffer) {
        if buffer.reserved
            && let Some(reserve) = self.state.lock().reserve.as_mut()
        {
            reserve.leaked = true;
        }
    }
}

impl PinnedHostPool for StagingPool {
    fn stats(&self) -> PinnedHostStats {
        self.state.lock().stats
    }

    fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peaks();
    }

    fn reset_accumulated_stats(&self) {
        self.state.lock().stats.reset_accumulated();
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        let state = std::mem::take(&mut *self.state.lock());
        let own: Vec<_> = state.idle.iter().filter(|b| !b.reserved).collect();
        let reserve = state.reserve.as_ref().filter(|reserve| !reserve.leaked);
        if (own.is_empty() && reserve.is_none()) || self.context.bind_to_thread().is_err() {
            return;
        }
        for buffer in own {
            free_pinned(buffer.ptr);
        }
        if let Some(reserve) = reserve {
            free_pinned(reserve.base);
        }
    }
}

/// `cuMemFreeHost` of an allocation the pool made (the context bound); whether it succeeded.
fn free_pinned(ptr: *mut u8) -> bool {
    // SAFETY: allocated by `StagingPool::allocate`, freed once: by the pool when it is not
    // kept, or at the pool's drop.
    match unsafe { result::free_host(ptr as *mut _) } {
        Ok(()) => true,
        Err(err) => {
            log::warn!("caching allocator: cuMemFreeHost of a pinned buffer failed: {err:?}");
            false
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

    /// Fills the bytes in use with `data` (exactly `len` bytes). Only while no copy into or
    /// out of the buffer is running. Copied through the raw pointer: pinned memory fresh from
    /// `cuMemHostAlloc` is uninitialised, and no `&mut [u8]` may be made over it.
    pub fn fill_from(&mut self, data: &[u8]) {
        assert_eq!(data.len(), self.len, "a staged buffer is filled whole");
        if let Some(buffer) = &self.buffer {
            // SAFETY: the buffer holds `capacity >= len` bytes, has one owner (`self`), and
            // does not overlap `data` (host memory of the caller's).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buffer.ptr, self.len) };
        }
    }

    /// The bytes in use, copied out, once a copy from the device into all of them completed
    /// (which initialised them).
    pub fn to_vec_after_copy(&self) -> Vec<u8> {
        match &self.buffer {
            // SAFETY: the buffer holds `capacity >= len` bytes, one owner, and the completed
            // device copy wrote every one of the `len` bytes.
            Some(buffer) => unsafe { std::slice::from_raw_parts(buffer.ptr, self.len) }.to_vec(),
            None => Vec::new(),
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
        // The pinned memory is leaked: still counted as in use.
        if let Some(buffer) = self.buffer.take() {
            self.pool.abandon(buffer);
        }
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
