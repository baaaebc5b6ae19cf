//! A pool of CUDA events, so that recording an event normally creates none.
//!
//! Events are created without timing (cheaper to record). A [`PooledEvent`] goes back to its
//! pool when dropped; re-recording an event replaces its previous capture, and a stream that
//! was told to wait for it keeps waiting for the capture it saw, so reuse is safe at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaContext;
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys::{self, CUresult};
use parking_lot::Mutex;

use super::error::{device_error, driver_call, guarded};
use crate::device::DeviceError;

/// Events a pool creates when its device opens, so that recording one normally creates none:
/// the driver's pool (syncs, reads, cross-stream waits) and the device memory's (the engine's
/// cross-stream frees) each start with this many.
pub(super) const PREWARMED_EVENTS: usize = 32;

#[derive(Debug)]
struct RawEvent(sys::CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread once its context is current.
unsafe impl Send for RawEvent {}

/// Idle CUDA events of one context.
#[derive(Debug)]
pub struct EventPool {
    context: Arc<CudaContext>,
    idle: Mutex<Vec<RawEvent>>,
    created: AtomicU64,
}

impl EventPool {
    /// A pool for `context`, with `prewarm` events created now.
    pub fn new(context: Arc<CudaContext>, prewarm: usize) -> Result<Arc<Self>, DeviceError> {
        let pool = Arc::new(Self {
            context,
            idle: Mutex::new(Vec::with_capacity(prewarm)),
            created: AtomicU64::new(0),
        });
        pool.bind()?;
        for _ in 0..prewarm {
            let event = pool.create()?;
            pool.idle.lock().push(event);
        }
        Ok(pool)
    }

    /// Events created since the pool was made (the prewarmed ones included).
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Records an event at the current point of `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this pool's context.
    pub unsafe fn record(
        self: &Arc<Self>,
        stream: sys::CUstream,
    ) -> Result<PooledEvent, DeviceError> {
        self.bind()?;
        let popped = self.idle.lock().pop();
        let raw = match popped {
            Some(event) => event,
            None => self.create()?,
        };
        // SAFETY: `raw` is a live event of this context; the caller vouches for `stream`.
        let event = PooledEvent {
            raw: Some(raw),
            pool: self.clone(),
        };
        driver_call("cuEventRecord", || unsafe {
            result::event::record(event.raw(), stream)
        })?;
        Ok(event)
    }

    fn bind(&self) -> Result<(), DeviceError> {
        driver_call("cuCtxSetCurrent", || self.context.bind_to_thread())
    }

    fn create(&self) -> Result<RawEvent, DeviceError> {
        let raw = driver_call("cuEventCreate", || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        })?;
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok(RawEvent(raw))
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let idle = std::mem::take(&mut *self.idle.lock());
        if idle.is_empty() || self.bind().is_err() {
            return;
        }
        for event in idle {
            // SAFETY: created by this pool, destroyed once, here.
            let _ = driver_call("cuEventDestroy", || unsafe {
                result::event::destroy(event.0)
            });
        }
    }
}

/// A recorded event; back to its pool when dropped.
#[derive(Debug)]
pub struct PooledEvent {
    raw: Option<RawEvent>,
    pool: Arc<EventPool>,
}

impl PooledEvent {
    /// The driver handle, e.g. for `cuStreamWaitEvent`. Owned by the pool.
    pub fn raw(&self) -> sys::CUevent {
        self.raw
            .as_ref()
            .map(|event| event.0)
            .unwrap_or(std::ptr::null_mut())
    }

    /// Whether the work before the event has completed.
    pub fn query(&self) -> Result<bool, DeviceError> {
        self.pool.bind()?;
        // SAFETY: the event is live while this value exists.
        guarded("cuEventQuery", || {
            match unsafe { result::event::query(self.raw()) } {
                Ok(()) => Ok(true),
                Err(DriverError(CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
                Err(err) => Err(device_error("cuEventQuery", err, None)),
            }
        })
    }

    /// Blocks until the work before the event has completed.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.pool.bind()?;
        // SAFETY: the event is live while this value exists.
        driver_call("cuEventSynchronize", || unsafe {
            result::event::synchronize(self.raw())
        })
    }

    /// Makes later work on `stream` wait for this event.
    ///
    /// # Safety
    /// `stream` must be a live stream of the pool's context.
    pub unsafe fn wait_on(&self, stream: sys::CUstream) -> Result<(), DeviceError> {
        self.pool.bind()?;
        // SAFETY: the event is live; the caller vouches for `stream`.
        driver_call("cuStreamWaitEvent", || unsafe {
            result::stream::wait_event(
                stream,
                self.raw(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        })
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.pool.idle.lock().push(raw);
        }
    }
}
