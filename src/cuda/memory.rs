//! [`CudaMemory`]: the engine's segments from `cuMemAlloc`, returned with `cuMemFree`, free and
//! total from `cuMemGetInfo`, stream events from an [`EventPool`].
//!
//! A driver out-of-memory becomes [`DeviceError::OutOfMemory`] (the engine frees cache and
//! retries); any other failure is a [`DeviceError::Driver`] naming the call and the CUDA error.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::result;
use cudarc::driver::sys;

use super::error::{device_error, driver_call, guarded};
use super::events::PREWARMED_EVENTS;
use super::events::{EventPool, PooledEvent};
use super::probe::open_context;
use super::streams::CudaStreams;
use super::virtual_memory::VirtualRanges;
use crate::device::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream, MemoryInfo};

/// [`DeviceMemory`] over one CUDA device. A segment's handle is its device pointer.
#[derive(Debug)]
pub struct CudaMemory {
    context: Arc<CudaContext>,
    streams: Arc<CudaStreams>,
    events: Arc<EventPool>,
    total_memory: u64,
    /// Address ranges and pages of expandable segments.
    virtual_ranges: VirtualRanges,
    release: ReleaseSync,
}

/// When freeing a segment must synchronise the context first: only when work was issued
/// since the last synchronisation. A release batch (`empty_cache`, the out-of-memory retry,
/// garbage collection) frees its segments with no work issued in between, so it synchronises
/// once, not once per segment.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ReleaseSync {
    /// The work counter read just before the last synchronisation.
    synced_at: Option<u64>,
}

impl ReleaseSync {
    /// Whether work issued up to counter `work` may still be running.
    pub(crate) fn needs_sync(&self, work: u64) -> bool {
        self.synced_at != Some(work)
    }

    /// The context was synchronised after the counter read `work`.
    pub(crate) fn synced(&mut self, work: u64) {
        self.synced_at = Some(work);
    }
}

impl CudaMemory {
    /// Opens the device with this ordinal (its primary context, which `cubecl-cuda` and
    /// anything else using the primary context share), with a stream table of its own.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        let context = open_context(ordinal)?;
        let streams = CudaStreams::new(context);
        Self::with_streams(streams)
    }

    /// Uses the context and the stream table of a server's driver, so that events the engine
    /// records on a [`DeviceStream`] land on the stream that the server issues that stream's work to.
    pub(crate) fn with_streams(streams: Arc<CudaStreams>) -> Result<Self, DeviceError> {
        let context = streams.context().clone();
        driver_call("cuCtxSetCurrent", || context.bind_to_thread())?;
        let (_, total) = driver_call("cuMemGetInfo", result::mem_get_info)?;
        let events = EventPool::new(context.clone(), PREWARMED_EVENTS)?;
        let virtual_ranges = VirtualRanges::new(&context);
        Ok(Self {
            virtual_ranges,
            context,
            streams,
            events,
            total_memory: total as u64,
            release: ReleaseSync::default(),
        })
    }

    /// CUDA events created so far for the engine's stream events (the prewarmed ones
    /// included): flat in steady state, since recorded events return to a pool.
    pub fn events_created(&self) -> u64 {
        self.events.created()
    }

    /// CUDA streams created so far, one per engine stream used.
    pub fn streams_created(&self) -> usize {
        self.streams.len()
    }

    /// The peers granted access to this device's expandable-segment pages.
    pub(crate) fn peer_access(&self) -> Arc<super::peer::PeerAccess> {
        self.virtual_ranges.peer_access()
    }

    /// Total device memory, as `cuMemGetInfo` reported it when the device was opened.
    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    fn bind(&self) -> Result<(), DeviceError> {
        driver_call("cuCtxSetCurrent", || self.context.bind_to_thread())
    }

    /// Waits for the device before memory goes back to the driver. Blocks are freed when their
    /// last handle drops, possibly while a kernel issued before still reads them, and neither
    /// `cuMemFree`'s implicit sync nor `cuMemUnmap` (which does not wait at all) is relied on.
    /// Once per release batch: the counter is read before the synchronisation, so work issued
    /// during it makes the next release synchronise again. Memory used on its own (no driver
    /// counting work) synchronises every time.
    fn sync_before_release(&mut self) -> Result<(), DeviceError> {
        let work = self.streams.work_issued();
        if work.is_none_or(|work| self.release.needs_sync(work)) {
            driver_call("cuCtxSynchronize", || self.context.synchronize())?;
            if let Some(work) = work {
                self.release.synced(work);
            }
        }
        Ok(())
    }
}

impl DeviceMemory for CudaMemory {
    type Handle = sys::CUdeviceptr;
    type Event = PooledEvent;

    fn allocate(
        &mut self,
        size: u64,
        _stream: DeviceStream,
    ) -> Result<DeviceSegment<Self::Handle>, DeviceError> {
        let bytes = usize::try_from(size).map_err(|_| DeviceError::TooLarge {
            requested: size,
            max: usize::MAX as u64,
        })?;
        self.bind()?;
        // SAFETY: a plain allocation; its contents are uninitialised, which nothing reads
        // before a kernel or a copy writes them.
        let ptr = guarded("cuMemAlloc", || {
            unsafe { result::malloc_sync(bytes) }
                .map_err(|err| device_error("cuMemAlloc", err, Some(size)))
        })?;
        Ok(DeviceSegment {
            address: ptr,
            size,
            handle: ptr,
        })
    }

    unsafe fn free(&mut self, segment: DeviceSegment<Self::Handle>) -> Result<(), DeviceError> {
        self.bind()?;
        self.sync_before_release()?;
        // SAFETY: the engine frees each segment it allocated exactly once, after every block in
        // it was freed, and no work is pending on the device.
        driver_call("cuMemFree", || unsafe { result::free_sync(segment.handle) })
    }

    fn memory_info(&mut self) -> Result<MemoryInfo, DeviceError> {
        self.bind()?;
        let (free, total) = driver_call("cuMemGetInfo", result::mem_get_info)?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn record_event(&mut self, stream: DeviceStream) -> Result<Self::Event, DeviceError> {
        let raw = self.streams.get_or_create(stream)?;
        // SAFETY: `raw` is a live stream of this context, kept alive by the stream table.
        unsafe { self.events.record(raw) }
    }

    fn query_event(&mut self, event: &Self::Event) -> Result<bool, DeviceError> {
        event.query()
    }

    fn synchronize_event(&mut self, event: &Self::Event) -> Result<(), DeviceError> {
        event.synchronize()
    }

    fn release_event(&mut self, event: Self::Event) {
        // Dropping a pooled event puts it back in the pool.
        drop(event);
    }

    fn wait_event(&mut self, stream: DeviceStream, event: &Self::Event) -> Result<(), DeviceError> {
        let raw = self.streams.get_or_create(stream)?;
        // SAFETY: `raw` is a live stream of this context, kept alive by the stream table.
        unsafe { event.wait_on(raw) }
    }

    fn waits_on_device(&self) -> bool {
        true
    }

    fn virtual_memory_granularity(&self) -> Option<u64> {
        self.virtual_ranges.granularity()
    }

    fn reserve_range(
        &mut self,
        size: u64,
        _stream: DeviceStream,
    ) -> Result<DeviceSegment<Self::Handle>, DeviceError> {
        self.bind()?;
        let base = self.virtual_ranges.reserve(size)?;
        Ok(DeviceSegment {
            address: base,
            size,
            handle: base,
        })
    }

    unsafe fn map_range(
        &mut self,
        range: &DeviceSegment<Self::Handle>,
        offset: u64,
        size: u64,
        page: u64,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        self.virtual_ranges.map(range.handle, offset, size, page)
    }

    unsafe fn unmap_range(
        &mut self,
        range: &DeviceSegment<Self::Handle>,
        offset: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        // PyTorch synchronises the range's stream before `cuMemUnmap`; this waits for the
        // device, once per release batch, as `free` does.
        self.sync_before_release()?;
        self.virtual_ranges.unmap(range.handle, offset, size)
    }

    unsafe fn release_range(
        &mut self,
        range: DeviceSegment<Self::Handle>,
    ) -> Result<(), DeviceError> {
        self.bind()?;
        self.virtual_ranges.release(range.handle)
    }
}

#[cfg(test)]
mod tests {
    use super::ReleaseSync;

    #[test]
    fn a_release_batch_synchronises_once_and_new_work_makes_it_sync_again() {
        let mut release = ReleaseSync::default();
        // Never synchronised: the first free waits.
        assert!(release.needs_sync(0));
        release.synced(7);
        // More segments of the same batch: no work issued since.
        assert!(!release.needs_sync(7));
        assert!(!release.needs_sync(7));
        // A launch or a copy since: the next free waits again.
        assert!(release.needs_sync(8));
    }
}
