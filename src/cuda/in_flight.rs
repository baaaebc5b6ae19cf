//! Copies in flight: the staging buffers a stream still copies into or out of, held until the
//! event recorded after the copies completed ([`InFlight`], [`PendingWrites`]), or until the
//! stream was waited for when a copy path exits early ([`Unfenced`]). A buffer whose copy
//! cannot be known to be over (the driver failed to answer) is abandoned, never reused.
//!
//! Generic over the fence, the stream and the buffer, so that the rules run in tests without a
//! GPU; the CUDA types are [`PooledEvent`], [`RawStream`] and [`Staged`].

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::result;

use crate::device::DeviceError;
use crate::runtime::DriverError;

use super::events::{EventPool, PooledEvent};
use super::staging::Staged;

/// A point in a stream's work that copies wait for (a recorded CUDA event).
pub trait CopyFence {
    /// Whether the work before the fence has completed; `Err` when the driver cannot tell.
    fn query(&self) -> Result<bool, DeviceError>;
    /// Blocks until the work before the fence has completed.
    fn synchronize(&self) -> Result<(), DeviceError>;
}

impl CopyFence for PooledEvent {
    fn query(&self) -> Result<bool, DeviceError> {
        PooledEvent::query(self)
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        PooledEvent::synchronize(self)
    }
}

/// A buffer a copy may still use: returned to its pool when dropped, or abandoned.
pub trait CopyBuffer {
    /// Never returns the buffer to its pool nor frees it: after a failed wait a DMA may still
    /// be running into or out of it, and only the process's end makes that memory safe.
    fn abandon(self);
}

/// What a look at copies in flight found.
#[derive(Debug, PartialEq)]
pub enum Progress {
    /// The copies completed; their buffers can be reused.
    Done,
    /// Still running.
    Pending,
    /// The driver could not tell (`cuEventQuery` failed): the copies may still be running.
    Failed(DeviceError),
}

/// Staging buffers that a stream still copies into or out of, until the fence after the copy.
/// Dropping it waits for the fence, so a buffer never returns to the pool mid-copy; a buffer
/// whose copy cannot be known to be over (the driver failed to answer) never returns to it.
#[derive(Debug)]
pub struct InFlight<F: CopyFence = PooledEvent, B: CopyBuffer = Staged> {
    fence: Option<F>,
    staged: Vec<B>,
}

impl<F: CopyFence, B: CopyBuffer> InFlight<F, B> {
    /// `staged` is in use by the copies issued before `fence`.
    pub fn new(fence: F, staged: Vec<B>) -> Self {
        Self {
            fence: Some(fence),
            staged,
        }
    }

    /// Whether the copies have completed. An error is not completion: the caller abandons
    /// the buffers ([`InFlight::abandon`]).
    pub fn progress(&self) -> Progress {
        match self.fence.as_ref().map(|fence| fence.query()) {
            None | Some(Ok(true)) => Progress::Done,
            Some(Ok(false)) => Progress::Pending,
            Some(Err(err)) => Progress::Failed(err),
        }
    }

    /// Gives the buffers up without returning them to their pool (see [`CopyBuffer`]).
    pub fn abandon(mut self) {
        self.fence = None;
        for buffer in std::mem::take(&mut self.staged) {
            buffer.abandon();
        }
    }

    /// Waits for the copies and hands the buffers over; on a failed wait they are abandoned.
    pub fn wait(mut self) -> Result<Vec<B>, DriverError> {
        let waited = match self.fence.take() {
            Some(fence) => fence.synchronize().map_err(DriverError::from),
            None => Ok(()),
        };
        match waited {
            Ok(()) => Ok(std::mem::take(&mut self.staged)),
            Err(err) => {
                self.abandon();
                Err(err)
            }
        }
    }
}

impl<F: CopyFence, B: CopyBuffer> Drop for InFlight<F, B> {
    fn drop(&mut self) {
        if let Some(fence) = self.fence.take()
            && let Err(err) = fence.synchronize()
        {
            log::error!(
                "caching allocator: a staged copy could not be waited for ({err}); its pinned buffers are abandoned"
            );
            for buffer in std::mem::take(&mut self.staged) {
                buffer.abandon();
            }
        }
    }
}

/// A stream that copies were issued on, as far as waiting for them goes.
pub trait CopyStream {
    /// Blocks until every copy issued on the stream so far has completed.
    fn wait_idle(&self) -> Result<(), DeviceError>;
}

/// A raw CUDA stream, waited for with `cuStreamSynchronize`.
#[derive(Clone, Copy, Debug)]
pub struct RawStream(pub cudarc::driver::sys::CUstream);

impl CopyStream for RawStream {
    fn wait_idle(&self) -> Result<(), DeviceError> {
        super::error::driver_call("cuStreamSynchronize", || {
            // SAFETY: the driver wraps only live streams of its context, bound on this thread.
            unsafe { result::stream::synchronize(self.0) }
        })
    }
}

/// The staging buffers of copies issued on a stream and not yet covered by a fence. Every
/// exit of the code that issues them goes through this: [`Unfenced::fence`] hands them to
/// an [`InFlight`] after the last copy; any other exit (an error part-way, a later copy that
/// fails) drops it, which waits for the stream before the buffers go back to their pool, and
/// abandons them if even that wait fails. So no buffer returns to the pool while a copy
/// issued before may still write it.
#[derive(Debug)]
pub struct Unfenced<S: CopyStream = RawStream, B: CopyBuffer = Staged> {
    stream: S,
    staged: Vec<B>,
}

impl<S: CopyStream, B: CopyBuffer> Unfenced<S, B> {
    /// No copies yet on `stream`.
    pub fn new(stream: S) -> Self {
        Self {
            stream,
            staged: Vec::new(),
        }
    }

    /// Adds the buffer of a copy about to be issued (or issued); returns its index.
    pub fn push(&mut self, buffer: B) -> usize {
        self.staged.push(buffer);
        self.staged.len() - 1
    }

    /// The buffers, for a fence recorded after their copies; nothing is waited for.
    pub fn into_buffers(mut self) -> Vec<B> {
        std::mem::take(&mut self.staged)
    }
}

impl<S: CopyStream, B: CopyBuffer> Drop for Unfenced<S, B> {
    fn drop(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        if let Err(err) = self.stream.wait_idle() {
            log::error!(
                "caching allocator: copies into staging buffers could not be waited for \
                 ({err}); their pinned buffers are abandoned"
            );
            for buffer in std::mem::take(&mut self.staged) {
                buffer.abandon();
            }
        }
    }
}

impl Unfenced {
    /// Records the fence after the copies and hands their buffers to an [`InFlight`] (see
    /// [`in_flight`] for a fence that cannot be recorded).
    ///
    /// # Safety
    /// The stream must be a live stream of the pool's context.
    pub unsafe fn fence(self, events: &Arc<EventPool>) -> Result<InFlight, DriverError> {
        let stream = self.stream.0;
        // SAFETY: forwarded from the caller.
        unsafe { in_flight(events, stream, self.into_buffers()) }
    }
}

/// Keeps the staging buffers of asynchronous writes until their copies completed.
#[derive(Debug)]
pub struct PendingWrites<F: CopyFence = PooledEvent, B: CopyBuffer = Staged> {
    in_flight: VecDeque<InFlight<F, B>>,
}

impl<F: CopyFence, B: CopyBuffer> Default for PendingWrites<F, B> {
    fn default() -> Self {
        Self {
            in_flight: VecDeque::new(),
        }
    }
}

impl<F: CopyFence, B: CopyBuffer> PendingWrites<F, B> {
    /// Remembers copies in flight.
    pub fn push(&mut self, in_flight: InFlight<F, B>) {
        self.in_flight.push_back(in_flight);
    }

    /// Returns the buffers of completed copies to their pool, oldest first, up to the first
    /// copy still running (a call costs one event query per finished copy, plus one). A copy
    /// whose completion the driver cannot report has its buffers abandoned, and its error is
    /// returned.
    pub fn collect(&mut self) -> Result<(), DeviceError> {
        while let Some(oldest) = self.in_flight.front() {
            match oldest.progress() {
                Progress::Done => drop(self.in_flight.pop_front()),
                Progress::Pending => return Ok(()),
                Progress::Failed(err) => {
                    log::error!(
                        "caching allocator: {err}; the copy's pinned buffers are abandoned"
                    );
                    if let Some(failed) = self.in_flight.pop_front() {
                        failed.abandon();
                    }
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// Copies still tracked.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.in_flight.len()
    }
}

/// Records an event on `stream` for copies that use `staged`. If no event can be recorded,
/// waits for the stream instead (or abandons the buffers if that fails too) and says why.
///
/// # Safety
/// `stream` must be a live stream of the pool's context.
pub unsafe fn in_flight(
    events: &Arc<EventPool>,
    stream: cudarc::driver::sys::CUstream,
    staged: Vec<Staged>,
) -> Result<InFlight, DriverError> {
    // SAFETY: forwarded from the caller.
    match unsafe { events.record(stream) } {
        Ok(event) => Ok(InFlight::new(event, staged)),
        Err(err) => {
            // Without an event, wait for the stream before the buffers go back to the pool;
            // if even that fails, a copy may still use them: abandoned.
            // SAFETY: forwarded from the caller.
            if unsafe { result::stream::synchronize(stream) }.is_err() {
                staged.into_iter().for_each(CopyBuffer::abandon);
            }
            Err(err.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;

    use super::*;

    struct Fence(Result<bool, DeviceError>);

    impl CopyFence for Fence {
        fn query(&self) -> Result<bool, DeviceError> {
            self.0.clone()
        }

        fn synchronize(&self) -> Result<(), DeviceError> {
            self.0.clone().map(|_| ())
        }
    }

    /// Says on drop whether it went back to its pool or was abandoned.
    struct Buffer(Arc<Mutex<Vec<&'static str>>>);

    impl CopyBuffer for Buffer {
        fn abandon(self) {
            self.0.lock().push("abandoned");
            std::mem::forget(self);
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            self.0.lock().push("returned");
        }
    }

    fn failure() -> DeviceError {
        DeviceError::Driver("cuEventQuery failed: CUDA_ERROR_LAUNCH_FAILED".into())
    }

    #[test]
    fn a_failed_event_query_is_not_completion_and_the_buffers_never_return() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut pending = PendingWrites::default();
        for answer in [Ok(true), Err(failure()), Ok(false), Ok(true)] {
            pending.push(InFlight::new(Fence(answer), vec![Buffer(log.clone())]));
        }
        assert_eq!(pending.collect(), Err(failure()));
        // The finished copy's buffer went back, the failed one's was abandoned.
        assert_eq!(*log.lock(), vec!["returned", "abandoned"]);
        assert_eq!(pending.len(), 2);
        // Collection stops at the first copy still running: the finished one behind waits.
        assert_eq!(pending.collect(), Ok(()));
        assert_eq!(pending.len(), 2);
        assert_eq!(log.lock().len(), 2);
    }

    #[test]
    fn a_failed_wait_abandons_the_buffers_instead_of_returning_them() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let in_flight = InFlight::new(Fence(Err(failure())), vec![Buffer(log.clone())]);
        assert!(in_flight.wait().is_err());
        assert_eq!(*log.lock(), vec!["abandoned"]);
        // Dropped without a wait: the same.
        drop(InFlight::new(
            Fence(Err(failure())),
            vec![Buffer(log.clone())],
        ));
        assert_eq!(*log.lock(), vec!["abandoned", "abandoned"]);
        // A wait that succeeds hands the buffers over.
        let buffers = InFlight::new(Fence(Ok(true)), vec![Buffer(log.clone())])
            .wait()
            .expect("waited");
        drop(buffers);
        assert_eq!(log.lock().last(), Some(&"returned"));
    }

    struct Stream(Result<(), DeviceError>);

    impl CopyStream for Stream {
        fn wait_idle(&self) -> Result<(), DeviceError> {
            self.0.clone()
        }
    }

    /// Issue 20 point 6: three error exits of the pinned read path dropped the buffers of
    /// copies already issued straight back to the pool. Through `Unfenced`, an error exit
    /// waits for the stream first, and abandons the buffers when that wait fails.
    #[test]
    fn an_error_exit_waits_for_the_stream_before_the_buffers_go_back() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut unfenced = Unfenced::new(Stream(Ok(())));
        assert_eq!(unfenced.push(Buffer(log.clone())), 0);
        assert_eq!(unfenced.push(Buffer(log.clone())), 1);
        drop(unfenced);
        assert_eq!(*log.lock(), vec!["returned", "returned"]);

        log.lock().clear();
        let mut unfenced = Unfenced::new(Stream(Err(failure())));
        unfenced.push(Buffer(log.clone()));
        drop(unfenced);
        assert_eq!(*log.lock(), vec!["abandoned"]);

        // Handed on to a fence: nothing is waited for or returned here.
        log.lock().clear();
        let mut unfenced = Unfenced::new(Stream(Err(failure())));
        unfenced.push(Buffer(log.clone()));
        let buffers = unfenced.into_buffers();
        assert!(log.lock().is_empty());
        drop(buffers);
        assert_eq!(*log.lock(), vec!["returned"]);
    }
}
