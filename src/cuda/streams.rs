//! The CUDA streams of one device, by engine [`StreamId`], shared by the device memory and the
//! server's driver so that an event the engine records on a stream lands on the stream the
//! server issues that stream's work to.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::result;
use cudarc::driver::sys;
use parking_lot::Mutex;

use super::error::driver_call;
use crate::device::{DeviceError, StreamId};

/// A raw stream handle that may cross threads (the table binds the context before using it).
#[derive(Clone, Copy, Debug)]
struct RawStream(sys::CUstream);

// SAFETY: a CUstream is a driver handle usable from any thread once its context is current.
unsafe impl Send for RawStream {}

/// Non-blocking CUDA streams created on first use of each [`StreamId`] and destroyed when the
/// last holder of the table is dropped (queued work still completes).
#[derive(Debug)]
pub struct CudaStreams {
    context: Arc<CudaContext>,
    streams: Mutex<HashMap<StreamId, RawStream>>,
}

impl CudaStreams {
    /// An empty table for the device of `context`.
    pub fn new(context: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Self {
            context,
            streams: Mutex::new(HashMap::new()),
        })
    }

    /// The device context the streams belong to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The stream of `id`, created (non-blocking) the first time the id is asked for.
    pub fn get_or_create(&self, id: StreamId) -> Result<sys::CUstream, DeviceError> {
        let mut streams = self.streams.lock();
        if let Some(stream) = streams.get(&id) {
            return Ok(stream.0);
        }
        driver_call("cuCtxSetCurrent", || self.context.bind_to_thread())?;
        let raw = driver_call("cuStreamCreate", || {
            result::stream::create(result::stream::StreamKind::NonBlocking)
        })?;
        streams.insert(id, RawStream(raw));
        Ok(raw)
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
        for (_, stream) in streams {
            // SAFETY: created by `get_or_create`, destroyed once, here.
            let _ = driver_call("cuStreamDestroy", || unsafe {
                result::stream::destroy(stream.0)
            });
        }
    }
}
