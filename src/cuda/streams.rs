//! The CUDA streams of one device, by engine [`DeviceStream`], shared by the device memory and the
//! server's driver so that an event the engine records on a stream lands on the stream the
//! server issues that stream's work to.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaContext;
use cudarc::driver::result;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::error::driver_call;
use crate::device::{DeviceError, DeviceStream};

/// A raw stream handle that may cross threads (the table binds the context before using it).
#[derive(Clone, Copy, Debug)]
struct RawStream(sys::CUstream);

// SAFETY: a CUstream is a driver handle usable from any thread once its context is current.
unsafe impl Send for RawStream {}

/// Non-blocking CUDA streams created on first use of each [`DeviceStream`] and destroyed when the
/// last holder of the table is dropped (queued work still completes).
#[derive(Debug)]
pub struct CudaStreams {
    context: Arc<CudaContext>,
    streams: Mutex<HashMap<DeviceStream, RawStream>>,
    /// Operations issued to the device so far (launches, copies), by anyone sharing the table:
    /// the device memory synchronises before freeing a segment only when work was issued
    /// since its last synchronisation.
    work: AtomicU64,
    /// Whether every operation on the device goes through a driver that counts it.
    counted: bool,
    /// Whether memory was handed to code outside the driver (`get_resource`), whose work the
    /// counter cannot see.
    foreign: std::sync::atomic::AtomicBool,
}

impl CudaStreams {
    /// An empty table for the device of `context`, for device memory used on its own: work
    /// issued by others is not counted ([`CudaStreams::work_issued`] is `None`).
    pub fn new(context: Arc<CudaContext>) -> Arc<Self> {
        Self::with_counting(context, false)
    }

    /// An empty table whose user (the server's driver) counts every operation it issues.
    pub fn counted(context: Arc<CudaContext>) -> Arc<Self> {
        Self::with_counting(context, true)
    }

    fn with_counting(context: Arc<CudaContext>, counted: bool) -> Arc<Self> {
        Arc::new(Self {
            context,
            streams: Mutex::new(HashMap::new()),
            work: AtomicU64::new(0),
            counted,
            foreign: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The device context the streams belong to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The stream of `id`, created (non-blocking) the first time the id is asked for. The
    /// table is the one source of truth for every user of `id` (the server's driver issues the
    /// stream's work on it, the device memory records and waits for the engine's events on it):
    /// if `cuStreamCreate` fails, `id` is the device's default stream from then on, for all of
    /// them, and the failure is logged once. Otherwise the work would run on one stream and the
    /// events that order it be recorded on another, created by a later call that succeeded.
    /// An error only when the context cannot be made current (nothing is recorded for `id`).
    pub fn get_or_create(&self, id: DeviceStream) -> Result<sys::CUstream, DeviceError> {
        let mut streams = self.streams.lock();
        if let Some(stream) = streams.get(&id) {
            return Ok(stream.0);
        }
        driver_call("cuCtxSetCurrent", || self.context.bind_to_thread())?;
        let raw = match driver_call("cuStreamCreate", || {
            result::stream::create(result::stream::StreamKind::NonBlocking)
        }) {
            Ok(raw) => raw,
            Err(err) => {
                log::error!(
                    "caching allocator: cannot create a CUDA stream for {id} ({err}); its work \
                     and its events use the device's default stream"
                );
                result::stream::null()
            }
        };
        streams.insert(id, RawStream(raw));
        Ok(raw)
    }

    /// Counts one operation just issued on the device; call right after issuing it. (Counted
    /// before, a release that read the count and synchronised in between would take the work
    /// as covered by its synchronisation.)
    pub fn note_work(&self) {
        self.work.fetch_add(1, Ordering::SeqCst);
    }

    /// Memory was handed to code outside the driver (CubeCL's `get_resource`), which may issue
    /// work on it that is never counted: from now on every release synchronises.
    pub fn note_foreign_work(&self) {
        self.foreign.store(true, Ordering::SeqCst);
    }

    /// Operations issued so far (see [`CudaStreams::note_work`]), or `None` when they are not
    /// all counted: the table's user does not count them, or memory was handed out through
    /// `get_resource` ([`CudaStreams::note_foreign_work`]).
    pub fn work_issued(&self) -> Option<u64> {
        (self.counted && !self.foreign.load(Ordering::SeqCst))
            .then(|| self.work.load(Ordering::SeqCst))
    }

    /// How many streams exist.
    pub fn len(&self) -> usize {
        self.streams.lock().len()
    }
}

impl Drop for CudaStreams {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut *self.streams.lock());
        if streams.is_empty()
            || driver_call("cuCtxSetCurrent", || self.context.bind_to_thread()).is_err()
        {
            return;
        }
        // The default stream of a failed creation is the driver's, never destroyed.
        for (_, stream) in streams.into_iter().filter(|(_, s)| !s.0.is_null()) {
            // SAFETY: created by `get_or_create`, destroyed once, here.
            let _ = driver_call("cuStreamDestroy", || unsafe {
                result::stream::destroy(stream.0)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CudaStreams;

    /// Issue 20 point 6: memory handed out through `get_resource` was never synchronised
    /// before a free or an unmap, since the work counter could not see what the caller ran on
    /// it. Once memory was handed out, the count is no longer trusted (`None`: every release
    /// synchronises).
    #[test]
    #[ignore = "needs a CUDA device"]
    fn memory_handed_out_makes_every_later_release_synchronise() {
        if let Err(reason) = crate::cuda::cuda_available() {
            eprintln!("skipping: {reason}");
            return;
        }
        let context = super::super::probe::open_context(0).expect("device 0 opens");
        let streams = CudaStreams::counted(context.clone());
        assert_eq!(streams.work_issued(), Some(0));
        streams.note_work();
        assert_eq!(streams.work_issued(), Some(1));
        streams.note_foreign_work();
        assert_eq!(streams.work_issued(), None);
        streams.note_work();
        assert_eq!(streams.work_issued(), None, "for good");
        // A table whose user does not count work never trusts a count.
        assert_eq!(CudaStreams::new(context).work_issued(), None);
    }
}
