//! Raw device memory: the one trait the engine allocates segments through, and its
//! implementations that need no GPU (a simulated device; the CUDA and wgpu ones live with the
//! integrations that drive those devices), plus
//! [`metered::Metered`], which counts the segments of any of them.

pub mod metered;
pub mod sim;

use serde::{Deserialize, Serialize};

/// A stream of work on a device. Blocks are cached per stream: a block freed on one stream is
/// only reused on that stream, and a block `record_stream` marked as used on other streams only
/// once an event recorded on each of them at free time has completed. Under the runtimes the
/// server applies the same rule one layer up: a buffer another stream used is held until that
/// stream's event completed, so it reaches neither CubeCL's cache nor the engine's early.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct DeviceStream(pub u64);

impl core::fmt::Display for DeviceStream {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "stream {}", self.0)
    }
}

/// Free and total bytes of a device, as its driver reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Free bytes on the device.
    pub free: u64,
    /// Total bytes on the device.
    pub total: u64,
}

/// Why a device could not do what the engine asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device has no room for this segment now. The engine frees cache and retries.
    #[error("the device is out of memory (requested {requested} bytes)")]
    OutOfMemory {
        /// The segment size requested, in bytes.
        requested: u64,
    },
    /// No single segment this large can exist on the device. Never retried.
    #[error("the device cannot hold a single buffer of {requested} bytes (largest is {max} bytes)")]
    TooLarge {
        /// The segment size requested, in bytes.
        requested: u64,
        /// The largest segment the device can hold, in bytes.
        max: u64,
    },
    /// Any other driver failure.
    #[error("device driver error: {0}")]
    Driver(String),
    /// An unmap failed part-way: the first `unmapped` bytes of the range asked for (whole
    /// pages, as mapped) went back to the device, the rest is still mapped.
    #[error("device driver error after unmapping the first {unmapped} bytes: {reason}")]
    PartialUnmap {
        /// Bytes unmapped from the start of the range asked for.
        unmapped: u64,
        /// The driver's failure.
        reason: String,
    },
    /// The device cannot do this at all (e.g. virtual memory on wgpu).
    #[error("the device does not support {0}")]
    Unsupported(&'static str),
}

/// A segment as the device hands it out: where it lives and how kernels reach it.
#[derive(Clone, Debug)]
pub struct DeviceSegment<H> {
    /// The segment's start address (a fake but distinct one where the device has none).
    pub address: u64,
    /// The segment's size, in bytes.
    pub size: u64,
    /// How kernels reach the segment.
    pub handle: H,
}

/// Raw device memory for the caching engine: segments and stream events.
///
/// The engine calls every method with its own lock held, so implementations need no locking
/// of their own for the engine's sake.
pub trait DeviceMemory: Send + 'static {
    /// How kernels reach a segment: a device pointer, a buffer, a fake id.
    type Handle: Clone + Send + Sync + core::fmt::Debug + 'static;
    /// A recorded stream event. Implementations should pool them.
    type Event: Send + 'static;

    /// Allocates one segment of exactly `size` bytes for `stream`.
    fn allocate(
        &mut self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<DeviceSegment<Self::Handle>, DeviceError>;
    /// Returns a segment to the device.
    ///
    /// # Safety
    /// `segment` must be one this device's [`allocate`](Self::allocate) returned and not freed
    /// since, with no work queued on the device still using it (the engine frees a segment
    /// only once the events of its blocks completed). A segment is raw device memory: freeing
    /// one that is still in use lets the device hand its bytes to someone else.
    unsafe fn free(&mut self, segment: DeviceSegment<Self::Handle>) -> Result<(), DeviceError>;
    /// Free and total bytes of the device.
    fn memory_info(&mut self) -> Result<MemoryInfo, DeviceError>;
    /// Records an event on `stream` at the current point of its work.
    fn record_event(&mut self, stream: DeviceStream) -> Result<Self::Event, DeviceError>;
    /// Whether the work before `event` has completed.
    fn query_event(&mut self, event: &Self::Event) -> Result<bool, DeviceError>;
    /// Blocks until the work before `event` has completed.
    fn synchronize_event(&mut self, event: &Self::Event) -> Result<(), DeviceError>;
    /// Hands an event back once the engine no longer needs it.
    fn release_event(&mut self, event: Self::Event);
    /// Makes the work `stream` issues from now on wait, on the device, for the work before
    /// `event` (CUDA's `cuStreamWaitEvent`), without blocking the host. The engine uses it to
    /// hand `stream` memory another stream's queued work may still use. The default is
    /// [`DeviceError::Unsupported`]: the engine then waits for such memory's events to
    /// complete instead. A device with one queue, where every stream's work runs in one order
    /// anyway, returns `Ok`.
    fn wait_event(&mut self, stream: DeviceStream, event: &Self::Event) -> Result<(), DeviceError> {
        let _ = (stream, event);
        Err(DeviceError::Unsupported(
            "device-side waits between streams",
        ))
    }
    /// Whether [`wait_event`](Self::wait_event) makes streams wait on the device (`false`, the
    /// default, where it is unsupported). Asked by the engine before it picks memory whose
    /// handing over would need such a wait.
    fn waits_on_device(&self) -> bool {
        false
    }
    /// The largest single segment the device can hold, if it has such a limit. A property of
    /// the device: the engine asks once, when it is created.
    fn max_segment_size(&self) -> Option<u64> {
        None
    }

    /// The page granularity of virtual memory if the device can reserve address ranges and
    /// back them with physical pages later (CUDA's virtual memory management); `None` (the
    /// default) if it cannot. Expandable segments need it.
    fn virtual_memory_granularity(&self) -> Option<u64> {
        None
    }

    /// Reserves `size` bytes of address space for `stream`, with no memory behind it yet.
    fn reserve_range(
        &mut self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<DeviceSegment<Self::Handle>, DeviceError> {
        let _ = (size, stream);
        Err(DeviceError::Unsupported("virtual memory"))
    }

    /// Backs `[offset, offset + size)` of a reserved range with physical pages of `page`
    /// bytes each (offset and size multiples of `page`, `page` a multiple of the
    /// granularity), so that any of them can be unmapped alone later; `OutOfMemory` (with
    /// nothing mapped) when the device has no pages left.
    ///
    /// # Safety
    /// `range` must be one this device's [`reserve_range`](Self::reserve_range) returned and
    /// not released since, and `[offset, offset + size)` unmapped in it.
    unsafe fn map_range(
        &mut self,
        range: &DeviceSegment<Self::Handle>,
        offset: u64,
        size: u64,
        page: u64,
    ) -> Result<(), DeviceError> {
        let _ = (range, offset, size, page);
        Err(DeviceError::Unsupported("virtual memory"))
    }

    /// Returns the pages behind `[offset, offset + size)` of a reserved range (whole pages as
    /// mapped) to the device, once the work queued on the device has finished with them. A
    /// failure after some pages went back is [`DeviceError::PartialUnmap`], saying how many
    /// bytes from `offset` on are unmapped (pages are unmapped in address order); any other
    /// error means nothing was unmapped.
    ///
    /// # Safety
    /// `range` as for [`map_range`](Self::map_range), `[offset, offset + size)` mapped by it, and
    /// nothing in that span still in use by anyone but the queued work this call waits for.
    unsafe fn unmap_range(
        &mut self,
        range: &DeviceSegment<Self::Handle>,
        offset: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        let _ = (range, offset, size);
        Err(DeviceError::Unsupported("virtual memory"))
    }

    /// Gives back a reserved range that has nothing mapped.
    ///
    /// # Safety
    /// `range` must be one this device's [`reserve_range`](Self::reserve_range) returned and
    /// not released since, with nothing mapped in it.
    unsafe fn release_range(
        &mut self,
        range: DeviceSegment<Self::Handle>,
    ) -> Result<(), DeviceError> {
        let _ = range;
        Err(DeviceError::Unsupported("virtual memory"))
    }
}
