//! [`Metered`]: any [`DeviceMemory`] with a meter on its segments.
//!
//! The wrapper delegates every call to the device it wraps and counts, on the way, the
//! segments allocated and freed, the failed allocations, and the bytes in segments now and at
//! their peak. The counters sit behind a cheap cloneable [`Meter`], so whoever hands the
//! device to an allocator (which then owns it, often behind its lock) can still read them
//! after every operation: the replay benchmark does, on the simulated device and on CUDA alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream, MemoryInfo};

#[derive(Debug, Default)]
struct Counters {
    allocs: AtomicU64,
    frees: AtomicU64,
    failed_allocs: AtomicU64,
    bytes_in_use: AtomicU64,
    peak_bytes: AtomicU64,
}

/// What a [`Meter`] has counted, read at one point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MeterReading {
    /// Segments the device handed out.
    pub allocs: u64,
    /// Segments the device took back.
    pub frees: u64,
    /// Allocation calls the device refused (out of memory, too large, driver errors).
    pub failed_allocs: u64,
    /// Bytes in segments handed out and not yet taken back.
    pub bytes_in_use: u64,
    /// Most bytes in use at once since the device was wrapped (or the peak was reset).
    pub peak_bytes: u64,
}

/// A shared view of a [`Metered`] device's counters. Clones read the same counters.
#[derive(Clone, Debug, Default)]
pub struct Meter {
    counters: Arc<Counters>,
}

impl Meter {
    /// Segments the device handed out.
    pub fn allocs(&self) -> u64 {
        self.counters.allocs.load(Ordering::Relaxed)
    }

    /// Segments the device took back.
    pub fn frees(&self) -> u64 {
        self.counters.frees.load(Ordering::Relaxed)
    }

    /// Allocation calls the device refused.
    pub fn failed_allocs(&self) -> u64 {
        self.counters.failed_allocs.load(Ordering::Relaxed)
    }

    /// Bytes in segments handed out and not yet taken back.
    pub fn bytes_in_use(&self) -> u64 {
        self.counters.bytes_in_use.load(Ordering::Relaxed)
    }

    /// Most bytes in use at once since the device was wrapped (or the peak was reset).
    pub fn peak_bytes(&self) -> u64 {
        self.counters.peak_bytes.load(Ordering::Relaxed)
    }

    /// Every counter at once.
    pub fn reading(&self) -> MeterReading {
        MeterReading {
            allocs: self.allocs(),
            frees: self.frees(),
            failed_allocs: self.failed_allocs(),
            bytes_in_use: self.bytes_in_use(),
            peak_bytes: self.peak_bytes(),
        }
    }

    /// Restarts the peak from the bytes in use now.
    pub fn reset_peak(&self) {
        self.counters
            .peak_bytes
            .store(self.bytes_in_use(), Ordering::Relaxed);
    }

    /// Counts an allocation call: `size` bytes handed out, or a refusal.
    fn count(&self, outcome: Result<u64, &DeviceError>) {
        match outcome {
            Ok(size) => self.allocated(size),
            Err(_) => {
                self.counters.failed_allocs.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn allocated(&self, size: u64) {
        let c = &self.counters;
        c.allocs.fetch_add(1, Ordering::Relaxed);
        let now = c.bytes_in_use.fetch_add(size, Ordering::Relaxed) + size;
        c.peak_bytes.fetch_max(now, Ordering::Relaxed);
    }

    fn freed(&self, size: u64) {
        let c = &self.counters;
        c.frees.fetch_add(1, Ordering::Relaxed);
        c.bytes_in_use.fetch_sub(size, Ordering::Relaxed);
    }
}

/// `D` with its segments metered; a [`DeviceMemory`] itself, with `D`'s handles and events.
#[derive(Debug)]
pub struct Metered<D> {
    device: D,
    meter: Meter,
}

impl<D: DeviceMemory> Metered<D> {
    /// Wraps `device`, with every counter at zero (segments it already handed out are not
    /// counted, and must not be freed through the wrapper).
    pub fn new(device: D) -> Self {
        Self {
            device,
            meter: Meter::default(),
        }
    }

    /// A handle on the counters, valid after the wrapper moved into an allocator or dropped.
    pub fn meter(&self) -> Meter {
        self.meter.clone()
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.device
    }

    /// The wrapped device, mutably (segments allocated or freed through it are not counted).
    pub fn inner_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// Unwraps the device.
    pub fn into_inner(self) -> D {
        self.device
    }
}

impl<D: DeviceMemory> DeviceMemory for Metered<D> {
    type Handle = D::Handle;
    type Event = D::Event;

    fn allocate(
        &mut self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<DeviceSegment<Self::Handle>, DeviceError> {
        let result = self.device.allocate(size, stream);
        self.meter
            .count(result.as_ref().map(|segment| segment.size));
        result
    }

    unsafe fn free(&mut self, segment: DeviceSegment<Self::Handle>) -> Result<(), DeviceError> {
        let size = segment.size;
        // SAFETY: the caller's contract, passed on to the device this wraps.
        unsafe { self.device.free(segment) }?;
        self.meter.freed(size);
        Ok(())
    }

    fn memory_info(&mut self) -> Result<MemoryInfo, DeviceError> {
        self.device.memory_info()
    }

    fn record_event(&mut self, stream: DeviceStream) -> Result<Self::Event, DeviceError> {
        self.device.record_event(stream)
    }

    fn query_event(&mut self, event: &Self::Event) -> Result<bool, DeviceError> {
        self.device.query_event(event)
    }

    fn synchronize_event(&mut self, event: &Self::Event) -> Result<(), DeviceError> {
        self.device.synchronize_event(event)
    }

    fn release_event(&mut self, event: Self::Event) {
        self.device.release_event(event)
    }

    fn wait_event(&mut self, stream: DeviceStream, event: &Self::Event) -> Result<(), DeviceError> {
        self.device.wait_event(stream, event)
    }

    fn waits_on_device(&self) -> bool {
        self.device.waits_on_device()
    }

    fn max_segment_size(&self) -> Option<u64> {
        self.device.max_segment_size()
    }

    fn virtual_memory_granularity(&self) -> Option<u64> {
        self.device.virtual_memory_granularity()
    }

    fn reserve_range(
        &mut self,
        size: u64,
        stream: DeviceStream,
    ) -> Result<DeviceSegment<Self::Handle>, DeviceError> {
        self.device.reserve_range(size, stream)
    }

    /// Counted as an allocation of the mapped bytes (a refused map as a failed one).
    unsafe fn map_range(
        &mut self,
        range: &DeviceSegment<Self::Handle>,
        offset: u64,
        size: u64,
        page: u64,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on to the device this wraps.
        let result = unsafe { self.device.map_range(range, offset, size, page) };
        self.meter.count(result.as_ref().map(|()| size));
        result
    }

    /// Counted as a free of the unmapped bytes.
    unsafe fn unmap_range(
        &mut self,
        range: &DeviceSegment<Self::Handle>,
        offset: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on to the device this wraps.
        unsafe { self.device.unmap_range(range, offset, size) }?;
        self.meter.freed(size);
        Ok(())
    }

    unsafe fn release_range(
        &mut self,
        range: DeviceSegment<Self::Handle>,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on to the device this wraps.
        unsafe { self.device.release_range(range) }
    }
}

#[cfg(test)]
mod tests {
    /// A call into the simulated device's raw-memory functions. SAFETY of each use: the
    /// simulated device's memory is bookkeeping on the host, and it refuses what the contract
    /// forbids (a forged or freed segment is an error there, which a test may check).
    macro_rules! sim_call {
        ($call:expr) => {
            unsafe { $call }
        };
    }

    use super::*;
    use crate::device::sim::SimDevice;

    const S: DeviceStream = DeviceStream(0);

    #[test]
    fn counts_allocs_frees_failures_and_bytes_like_the_device() {
        let sim = SimDevice::new(10 << 20);
        let mut device = Metered::new(sim.clone());
        let meter = device.meter();
        assert_eq!(meter.reading(), MeterReading::default());

        let a = device.allocate(4 << 20, S).expect("fits");
        let b = device.allocate(3 << 20, S).expect("fits");
        assert!(matches!(
            device.allocate(4 << 20, S),
            Err(DeviceError::OutOfMemory { .. })
        ));
        assert_eq!(
            meter.reading(),
            MeterReading {
                allocs: 2,
                frees: 0,
                failed_allocs: 1,
                bytes_in_use: 7 << 20,
                peak_bytes: 7 << 20,
            }
        );

        sim_call!(device.free(a)).expect("live");
        let c = device.allocate(1 << 20, S).expect("fits");
        assert_eq!(
            meter.reading(),
            MeterReading {
                allocs: 3,
                frees: 1,
                failed_allocs: 1,
                bytes_in_use: 4 << 20,
                peak_bytes: 7 << 20,
            }
        );
        meter.reset_peak();
        assert_eq!(meter.peak_bytes(), 4 << 20);

        sim_call!(device.free(b)).expect("live");
        sim_call!(device.free(c)).expect("live");
        let sim_counters = sim.counters();
        let reading = meter.reading();
        assert_eq!(reading.allocs, sim_counters.allocs);
        assert_eq!(reading.frees, sim_counters.frees);
        assert_eq!(reading.failed_allocs, sim_counters.failed_allocs);
        assert_eq!(reading.bytes_in_use, sim.bytes_in_use());
        assert_eq!(reading.bytes_in_use, 0);
        assert_eq!(reading.peak_bytes, 4 << 20);
    }

    #[test]
    fn virtual_memory_passes_through_and_maps_count_as_allocations() {
        let sim = SimDevice::new(64 << 20);
        let mut device = Metered::new(sim.clone());
        let meter = device.meter();
        assert_eq!(device.virtual_memory_granularity(), Some(2 << 20));
        let range = device.reserve_range(128 << 20, S).expect("address space");
        sim_call!(device.map_range(&range, 0, 40 << 20, 20 << 20)).expect("fits");
        let too_much = sim_call!(device.map_range(&range, 40 << 20, 40 << 20, 20 << 20));
        assert!(matches!(too_much, Err(DeviceError::OutOfMemory { .. })));
        sim_call!(device.unmap_range(&range, 0, 20 << 20)).expect("mapped");
        let reading = meter.reading();
        assert_eq!(
            (reading.allocs, reading.frees, reading.failed_allocs),
            (1, 1, 1)
        );
        assert_eq!(
            (reading.bytes_in_use, reading.peak_bytes),
            (20 << 20, 40 << 20)
        );
        assert_eq!(reading.bytes_in_use, sim.bytes_in_use());
        sim_call!(device.unmap_range(&range, 20 << 20, 20 << 20)).expect("mapped");
        sim_call!(device.release_range(range)).expect("nothing mapped");
        assert!(sim.reserved_ranges().is_empty());
    }

    #[test]
    fn a_refused_free_counts_nothing() {
        let mut device = Metered::new(SimDevice::new(1 << 20));
        let meter = device.meter();
        let a = device.allocate(1000, S).expect("fits");
        let forged = DeviceSegment {
            address: a.address + 4096,
            size: a.size,
            handle: a.handle,
        };
        assert!(sim_call!(device.free(forged)).is_err());
        assert_eq!(meter.frees(), 0);
        assert_eq!(meter.bytes_in_use(), 1000);
        sim_call!(device.free(a)).expect("live");
        assert_eq!(meter.frees(), 1);
        assert_eq!(meter.bytes_in_use(), 0);
    }

    #[test]
    fn the_meter_outlives_the_device_and_events_pass_through() {
        let sim = SimDevice::new(1 << 20);
        let mut bare = sim.clone();
        let mut metered = Metered::new(sim.clone());
        let meter = metered.meter();
        let event = metered.record_event(S).expect("records");
        assert!(!metered.query_event(&event).expect("queries"));
        metered.synchronize_event(&event).expect("waits");
        assert!(metered.query_event(&event).expect("queries"));
        metered.release_event(event);
        assert_eq!(sim.counters().events_recorded, 1);
        assert_eq!(metered.memory_info().expect("info").total, 1 << 20);
        let segment = metered.allocate(512, S).expect("fits");
        drop(metered);
        assert_eq!(meter.allocs(), 1);
        // Freed behind the meter's back (through the bare device): not counted.
        sim_call!(bare.free(segment)).expect("live");
        assert_eq!(meter.bytes_in_use(), 512);
        assert_eq!(sim.bytes_in_use(), 0);
    }
}
