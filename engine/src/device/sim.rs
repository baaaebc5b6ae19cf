//! A simulated device: fake addresses, a fixed capacity, failure injection and call counters.
//!
//! Failures can be injected into every call the engine makes: allocations fail as out of
//! memory ([`SimDevice::fail_nth_allocation`], [`SimDevice::fail_allocations_over`]), and
//! allocations, frees, event records, event queries and synchronisations fail as driver errors
//! ([`SimDevice::fail_next`]), so that tests can check that the engine reports each error and
//! stays consistent. The same calls can also panic ([`SimDevice::panic_next`]), as a device
//! implementation's bug would, so that tests can check what the engine does after a panic it
//! did not see coming.
//!
//! It backs the engine's tests and the benchmarks, so it runs anywhere. Clones share one
//! device, so a test can keep a clone to inspect what the allocator did with the other.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{DeviceError, DeviceMemory, DeviceSegment, DeviceStream, MemoryInfo};

/// Where the first fake segment starts; segments are laid out upwards, 2 MiB aligned.
const BASE_ADDRESS: u64 = 0x7f00_0000_0000;
const ADDRESS_ALIGNMENT: u64 = 2 << 20;
/// The page granularity of the simulated virtual memory (CUDA's on current GPUs).
const PAGE: u64 = 2 << 20;

/// Calls the device has seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimCounters {
    /// Segments handed out, and page ranges mapped.
    pub allocs: u64,
    /// Segments taken back, and page ranges unmapped.
    pub frees: u64,
    /// Allocation and map calls refused (too large, out of memory, or injected failures).
    pub failed_allocs: u64,
    /// Address ranges reserved (virtual memory).
    pub ranges_reserved: u64,
    /// Address ranges given back.
    pub ranges_released: u64,
    /// `record_event` calls.
    pub events_recorded: u64,
    /// `query_event` calls.
    pub events_queried: u64,
    /// `synchronize_event` calls.
    pub events_synchronized: u64,
    /// `wait_event` calls that made a stream wait (see [`SimDevice::with_device_waits`]).
    pub events_waited: u64,
    /// `memory_info` calls.
    pub memory_info_calls: u64,
    /// Calls failed by [`SimDevice::fail_next`] (injected driver errors that fired).
    pub injected_failures: u64,
}

/// A device call that [`SimDevice::fail_next`] can make fail with a driver error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimCall {
    /// [`DeviceMemory::free`]: the segment stays allocated on the device.
    Free,
    /// [`DeviceMemory::record_event`].
    RecordEvent,
    /// [`DeviceMemory::query_event`].
    QueryEvent,
    /// [`DeviceMemory::synchronize_event`]: the event stays incomplete.
    SynchronizeEvent,
    /// [`DeviceMemory::allocate`]: nothing is allocated (a driver error, not out of memory).
    Allocate,
    /// [`DeviceMemory::unmap_range`], failing half-way as a `cuMemUnmap` of a later page
    /// would: when the range asked for holds more than one page (as mapped), its first page is
    /// unmapped and the failure is [`DeviceError::PartialUnmap`]; otherwise nothing changes.
    Unmap,
    /// [`DeviceMemory::memory_info`]: the device cannot say how much memory it has.
    MemoryInfo,
    /// [`DeviceMemory::wait_event`]: the stream does not wait.
    WaitEvent,
}

/// The number of [`SimCall`] kinds.
const SIM_CALLS: usize = 8;

impl SimCall {
    fn index(self) -> usize {
        match self {
            SimCall::Free => 0,
            SimCall::RecordEvent => 1,
            SimCall::QueryEvent => 2,
            SimCall::SynchronizeEvent => 3,
            SimCall::Allocate => 4,
            SimCall::Unmap => 5,
            SimCall::MemoryInfo => 6,
            SimCall::WaitEvent => 7,
        }
    }
}

/// The message of every injected driver error.
pub const INJECTED_FAILURE: &str = "injected failure";

/// The message of every injected panic.
pub const INJECTED_PANIC: &str = "injected panic";

/// A simulated stream event: done once its stream was completed past it.
#[derive(Debug)]
pub struct SimEvent {
    stream: DeviceStream,
    sequence: u64,
    /// Per stream, the newest event sequence whose work comes before this event (its own
    /// stream's, and what that stream had waited for): a vector clock.
    clock: BTreeMap<DeviceStream, u64>,
}

#[derive(Debug)]
struct SimState {
    capacity: u64,
    max_segment_size: Option<u64>,
    /// Whether the device reserves address ranges and maps pages (virtual memory).
    virtual_memory: bool,
    next_address: u64,
    next_handle: u64,
    /// Live segments: address -> (size, handle).
    live: BTreeMap<u64, (u64, u64)>,
    /// Reserved address ranges: address -> (size, handle, mapped pages as offset -> size).
    ranges: BTreeMap<u64, (u64, u64, BTreeMap<u64, u64>)>,
    /// The page each range was last mapped with (a half-way unmap unmaps one of them).
    range_pages: BTreeMap<u64, u64>,
    bytes_in_use: u64,
    counters: SimCounters,
    /// Allocation calls to fail, counted from 1 at the next call.
    fail_calls: Vec<u64>,
    fail_over: Option<u64>,
    /// What the next half-way unmap failure reports as unmapped, instead of the truth.
    misreported_unmap: Option<u64>,
    /// Per [`SimCall`]: the calls made so far, and the call numbers that are to fail or panic.
    calls: [u64; SIM_CALLS],
    armed: [Vec<u64>; SIM_CALLS],
    armed_panics: [Vec<u64>; SIM_CALLS],
    /// Per stream: the last event sequence recorded and the last completed.
    recorded: BTreeMap<DeviceStream, u64>,
    completed: BTreeMap<DeviceStream, u64>,
    /// Whether streams can wait for each other's events on the device.
    device_waits: bool,
    /// Per stream, the newest event sequence of each other stream its work comes after (by
    /// waits, directly or through a stream that waited): a vector clock.
    clocks: BTreeMap<DeviceStream, BTreeMap<DeviceStream, u64>>,
    /// Per stream, the clock of its newest recorded event, and of its newest completed one.
    recorded_clocks: BTreeMap<DeviceStream, BTreeMap<DeviceStream, u64>>,
    completed_clocks: BTreeMap<DeviceStream, BTreeMap<DeviceStream, u64>>,
}

impl SimState {
    /// Takes `size` bytes of capacity for an allocation or a map, or fails as out of memory
    /// (injected failures included): one device call either way.
    fn take_memory(&mut self, size: u64) -> Result<(), DeviceError> {
        let call = self.counters.allocs + self.counters.failed_allocs + 1;
        let injected = if let Some(pos) = self.fail_calls.iter().position(|&c| c == call) {
            self.fail_calls.swap_remove(pos);
            true
        } else {
            self.fail_over.is_some_and(|over| size > over)
        };
        if injected || size == 0 || self.bytes_in_use + size > self.capacity {
            self.counters.failed_allocs += 1;
            return Err(DeviceError::OutOfMemory { requested: size });
        }
        self.bytes_in_use += size;
        self.counters.allocs += 1;
        Ok(())
    }

    /// The reserved range of `handle` at `address`, or a driver error naming it.
    fn range_mut(
        &mut self,
        range: &DeviceSegment<u64>,
    ) -> Result<&mut (u64, u64, BTreeMap<u64, u64>), DeviceError> {
        match self.ranges.get_mut(&range.address) {
            Some(r) if r.1 == range.handle => Ok(r),
            _ => Err(DeviceError::Driver(format!(
                "unknown address range at {:#x}",
                range.address
            ))),
        }
    }
}

/// A device that exists only in memory. `Handle` is the segment's id.
#[derive(Clone, Debug)]
pub struct SimDevice {
    state: Arc<Mutex<SimState>>,
}

impl SimDevice {
    /// A device of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        Self {
            state: Arc::new(Mutex::new(SimState {
                capacity,
                max_segment_size: None,
                virtual_memory: true,
                next_address: BASE_ADDRESS,
                next_handle: 1,
                live: BTreeMap::new(),
                ranges: BTreeMap::new(),
                range_pages: BTreeMap::new(),
                bytes_in_use: 0,
                counters: SimCounters::default(),
                fail_calls: Vec::new(),
                fail_over: None,
                misreported_unmap: None,
                calls: [0; SIM_CALLS],
                armed: Default::default(),
                armed_panics: Default::default(),
                recorded: BTreeMap::new(),
                completed: BTreeMap::new(),
                device_waits: false,
                clocks: BTreeMap::new(),
                recorded_clocks: BTreeMap::new(),
                completed_clocks: BTreeMap::new(),
            })),
        }
    }

    /// A device without virtual memory, like wgpu: no granularity, and every range call is
    /// [`DeviceError::Unsupported`].
    pub fn without_virtual_memory(self) -> Self {
        self.state.lock().virtual_memory = false;
        self
    }

    /// A device whose streams can wait for each other's events on the device, like CUDA's
    /// (`wait_event` is then `Ok`; otherwise it is [`DeviceError::Unsupported`]).
    pub fn with_device_waits(self) -> Self {
        self.state.lock().device_waits = true;
        self
    }

    /// The sequence of the last event recorded on `stream` (0 before the first): an event of
    /// a later sequence comes after everything `stream` did so far.
    pub fn last_recorded(&self, stream: DeviceStream) -> u64 {
        self.state
            .lock()
            .recorded
            .get(&stream)
            .copied()
            .unwrap_or(0)
    }

    /// The newest event sequence of `stream` that `waiter`'s work from now on comes after (0
    /// if none), by device waits: directly, or through streams that waited (a vector clock).
    pub fn waited_for(&self, waiter: DeviceStream, stream: DeviceStream) -> u64 {
        let state = self.state.lock();
        state
            .clocks
            .get(&waiter)
            .and_then(|clock| clock.get(&stream))
            .copied()
            .unwrap_or(0)
    }

    /// Limits the size of one segment, like a backend with a maximum buffer size.
    pub fn with_max_segment_size(self, max: u64) -> Self {
        self.state.lock().max_segment_size = Some(max);
        self
    }

    /// Makes the `n`-th allocation call from now (1 = the next one) fail as out of memory.
    pub fn fail_nth_allocation(&self, n: u64) {
        let mut state = self.state.lock();
        let at = state.counters.allocs + state.counters.failed_allocs + n;
        state.fail_calls.push(at);
    }

    /// Makes every allocation of more than `bytes` fail as out of memory (`None` lifts it).
    pub fn fail_allocations_over(&self, bytes: Option<u64>) {
        self.state.lock().fail_over = bytes;
    }

    /// Makes the next half-way failure of [`SimCall::Unmap`] (armed with [`Self::fail_next`])
    /// report `unmapped` bytes as unmapped instead of the page it did unmap: a device whose
    /// report cannot be true (no bytes, more than was asked, not whole pages).
    pub fn misreport_partial_unmap(&self, unmapped: u64) {
        self.state.lock().misreported_unmap = Some(unmapped);
    }

    /// Makes the next call of kind `call` fail with a driver error. The failed call changes
    /// nothing on the device.
    pub fn fail_next(&self, call: SimCall) {
        self.fail_nth(call, 1);
    }

    /// Makes the `n`-th call of kind `call` from now (1 = the next one) fail with a driver
    /// error, e.g. the second event record of a free that records two.
    pub fn fail_nth(&self, call: SimCall, n: u64) {
        let mut state = self.state.lock();
        let at = state.calls[call.index()] + n;
        state.armed[call.index()].push(at);
    }

    /// Makes the next call of kind `call` panic (with [`INJECTED_PANIC`]) before it changes
    /// anything on the device, as a buggy device implementation would.
    pub fn panic_next(&self, call: SimCall) {
        let mut state = self.state.lock();
        let at = state.calls[call.index()] + 1;
        state.armed_panics[call.index()].push(at);
    }

    /// Failures armed by [`SimDevice::fail_next`] or [`SimDevice::fail_nth`] that are still
    /// to fire.
    pub fn armed_failures(&self, call: SimCall) -> u64 {
        self.state.lock().armed[call.index()].len() as u64
    }

    /// Changes the capacity (already live segments stay).
    pub fn set_capacity(&self, capacity: u64) {
        self.state.lock().capacity = capacity;
    }

    /// Marks every event recorded so far on `stream` as completed.
    pub fn complete_events(&self, stream: DeviceStream) {
        let mut state = self.state.lock();
        let last = state.recorded.get(&stream).copied().unwrap_or(0);
        state.completed.insert(stream, last);
        if let Some(clock) = state.recorded_clocks.get(&stream).cloned() {
            state.completed_clocks.insert(stream, clock);
        }
    }

    /// The newest event sequence of `stream` whose work is known complete: its own completed
    /// events, or through a completed event of another stream whose work waited for it (a
    /// vector clock: a stream's completion covers what it waited for on the device).
    pub fn completed_through(&self, stream: DeviceStream) -> u64 {
        let state = self.state.lock();
        let own = state.completed.get(&stream).copied().unwrap_or(0);
        state
            .completed_clocks
            .values()
            .filter_map(|clock| clock.get(&stream).copied())
            .fold(own, u64::max)
    }

    /// Marks every event on every stream as completed.
    pub fn complete_all_events(&self) {
        let mut state = self.state.lock();
        let recorded = state.recorded.clone();
        state.completed.extend(recorded);
        let clocks = state.recorded_clocks.clone();
        state.completed_clocks.extend(clocks);
    }

    /// The calls counted so far.
    pub fn counters(&self) -> SimCounters {
        self.state.lock().counters
    }

    /// Live segments as (address, size), by address.
    pub fn live_segments(&self) -> Vec<(u64, u64)> {
        let state = self.state.lock();
        state.live.iter().map(|(a, (s, _))| (*a, *s)).collect()
    }

    /// Mapped page runs of reserved ranges as (address, size), by address.
    pub fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let state = self.state.lock();
        state
            .ranges
            .iter()
            .flat_map(|(base, (_, _, mapped))| {
                mapped.iter().map(move |(at, len)| (base + at, *len))
            })
            .collect()
    }

    /// Reserved address ranges as (address, size), by address.
    pub fn reserved_ranges(&self) -> Vec<(u64, u64)> {
        let state = self.state.lock();
        state.ranges.iter().map(|(a, (s, _, _))| (*a, *s)).collect()
    }

    /// Bytes in live segments and mapped pages.
    pub fn bytes_in_use(&self) -> u64 {
        self.state.lock().bytes_in_use
    }

    /// The device's capacity, in bytes.
    pub fn capacity(&self) -> u64 {
        self.state.lock().capacity
    }
}

impl SimState {
    /// Counts a call of kind `call`, panics if it was armed to panic, and fails it if it was
    /// armed to fail.
    fn injected(&mut self, call: SimCall) -> Result<(), DeviceError> {
        if self.fires(call) {
            Err(DeviceError::Driver(format!(
                "{INJECTED_FAILURE} of {call:?}"
            )))
        } else {
            Ok(())
        }
    }

    /// Counts a call of kind `call`, panics if it was armed to panic; whether it was armed to
    /// fail (counted as an injected failure).
    fn fires(&mut self, call: SimCall) -> bool {
        let i = call.index();
        self.calls[i] += 1;
        let current = self.calls[i];
        let panics = &mut self.armed_panics[i];
        if panics.contains(&current) {
            panics.retain(|&at| at > current);
            // parking_lot does not poison: the device's state stays usable after the unwind.
            panic!("{INJECTED_PANIC} in {call:?}");
        }
        let armed = &mut self.armed[i];
        let fires = armed.contains(&current);
        armed.retain(|&at| at > current);
        if fires {
            self.counters.injected_failures += 1;
        }
        fires
    }
}

impl DeviceMemory for SimDevice {
    type Handle = u64;
    type Event = SimEvent;

    fn allocate(
        &mut self,
        size: u64,
        _stream: DeviceStream,
    ) -> Result<DeviceSegment<u64>, DeviceError> {
        let mut state = self.state.lock();
        if let Err(err) = state.injected(SimCall::Allocate) {
            state.counters.failed_allocs += 1;
            return Err(err);
        }
        if let Some(max) = state.max_segment_size
            && size > max
        {
            state.counters.failed_allocs += 1;
            return Err(DeviceError::TooLarge {
                requested: size,
                max,
            });
        }
        state.take_memory(size)?;
        let address = state.next_address;
        state.next_address = (address + size).next_multiple_of(ADDRESS_ALIGNMENT);
        let handle = state.next_handle;
        state.next_handle += 1;
        state.live.insert(address, (size, handle));
        Ok(DeviceSegment {
            address,
            size,
            handle,
        })
    }

    unsafe fn free(&mut self, segment: DeviceSegment<u64>) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        state.injected(SimCall::Free)?;
        match state.live.get(&segment.address) {
            Some(&(size, handle)) if size == segment.size && handle == segment.handle => {
                state.live.remove(&segment.address);
                state.bytes_in_use -= size;
                state.counters.frees += 1;
                Ok(())
            }
            _ => Err(DeviceError::Driver(format!(
                "free of unknown segment at {:#x} ({} bytes)",
                segment.address, segment.size
            ))),
        }
    }

    fn memory_info(&mut self) -> Result<MemoryInfo, DeviceError> {
        let mut state = self.state.lock();
        state.counters.memory_info_calls += 1;
        state.injected(SimCall::MemoryInfo)?;
        Ok(MemoryInfo {
            free: state.capacity.saturating_sub(state.bytes_in_use),
            total: state.capacity,
        })
    }

    fn record_event(&mut self, stream: DeviceStream) -> Result<SimEvent, DeviceError> {
        let mut state = self.state.lock();
        state.injected(SimCall::RecordEvent)?;
        state.counters.events_recorded += 1;
        let sequence = state.recorded.get(&stream).copied().unwrap_or(0) + 1;
        state.recorded.insert(stream, sequence);
        let clock = state.clocks.entry(stream).or_default();
        clock.insert(stream, sequence);
        let clock = clock.clone();
        state.recorded_clocks.insert(stream, clock.clone());
        Ok(SimEvent {
            stream,
            sequence,
            clock,
        })
    }

    fn query_event(&mut self, event: &SimEvent) -> Result<bool, DeviceError> {
        let mut state = self.state.lock();
        state.injected(SimCall::QueryEvent)?;
        state.counters.events_queried += 1;
        Ok(state.completed.get(&event.stream).copied().unwrap_or(0) >= event.sequence)
    }

    fn synchronize_event(&mut self, event: &SimEvent) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        state.injected(SimCall::SynchronizeEvent)?;
        state.counters.events_synchronized += 1;
        let done = state.completed.entry(event.stream).or_insert(0);
        *done = (*done).max(event.sequence);
        let completed = state.completed_clocks.entry(event.stream).or_default();
        for (&other, &sequence) in &event.clock {
            let known = completed.entry(other).or_insert(0);
            *known = (*known).max(sequence);
        }
        Ok(())
    }

    fn release_event(&mut self, _event: SimEvent) {}

    fn wait_event(&mut self, stream: DeviceStream, event: &SimEvent) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        if !state.device_waits {
            return Err(DeviceError::Unsupported(
                "device-side waits between streams",
            ));
        }
        state.injected(SimCall::WaitEvent)?;
        state.counters.events_waited += 1;
        let clock = state.clocks.entry(stream).or_default();
        for (&other, &sequence) in &event.clock {
            let known = clock.entry(other).or_insert(0);
            *known = (*known).max(sequence);
        }
        Ok(())
    }

    fn waits_on_device(&self) -> bool {
        self.state.lock().device_waits
    }

    fn max_segment_size(&self) -> Option<u64> {
        self.state.lock().max_segment_size
    }

    fn virtual_memory_granularity(&self) -> Option<u64> {
        self.state.lock().virtual_memory.then_some(PAGE)
    }

    fn reserve_range(
        &mut self,
        size: u64,
        _stream: DeviceStream,
    ) -> Result<DeviceSegment<u64>, DeviceError> {
        let mut state = self.state.lock();
        if !state.virtual_memory {
            return Err(DeviceError::Unsupported("virtual memory"));
        }
        let size = size.next_multiple_of(PAGE);
        let address = state.next_address;
        state.next_address = (address + size).next_multiple_of(ADDRESS_ALIGNMENT);
        let handle = state.next_handle;
        state.next_handle += 1;
        state
            .ranges
            .insert(address, (size, handle, BTreeMap::new()));
        state.counters.ranges_reserved += 1;
        Ok(DeviceSegment {
            address,
            size,
            handle,
        })
    }

    unsafe fn map_range(
        &mut self,
        range: &DeviceSegment<u64>,
        offset: u64,
        size: u64,
        page: u64,
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        let (range_size, _, mapped) = state.range_mut(range)?;
        let overlaps = mapped
            .range(..offset + size)
            .next_back()
            .is_some_and(|(at, len)| at + len > offset);
        if !page.is_multiple_of(PAGE)
            || !offset.is_multiple_of(page)
            || !size.is_multiple_of(page)
            || offset + size > *range_size
            || overlaps
        {
            return Err(DeviceError::Driver(format!(
                "bad map of {size} bytes at offset {offset} of range {:#x}",
                range.address
            )));
        }
        state.take_memory(size)?;
        state.range_mut(range)?.2.insert(offset, size);
        state.range_pages.insert(range.address, page);
        Ok(())
    }

    unsafe fn unmap_range(
        &mut self,
        range: &DeviceSegment<u64>,
        offset: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        let page = state
            .range_pages
            .get(&range.address)
            .copied()
            .unwrap_or(PAGE);
        let half_way = state.fires(SimCall::Unmap);
        if half_way && size <= page {
            return Err(DeviceError::Driver(format!(
                "{INJECTED_FAILURE} of {:?}",
                SimCall::Unmap
            )));
        }
        let mapped = &mut state.range_mut(range)?.2;
        // Unmapping may cover several mapped runs, and parts of them, as CUDA allows.
        let requested = size;
        let size = if half_way { page } else { size };
        let end = offset + size;
        let runs: Vec<(u64, u64)> = mapped
            .range(..end)
            .filter(|(at, len)| *at + *len > offset)
            .map(|(a, l)| (*a, *l))
            .collect();
        let covered: u64 = runs
            .iter()
            .map(|(at, len)| (at + len).min(end) - (*at).max(offset))
            .sum();
        if covered != size {
            return Err(DeviceError::Driver(format!(
                "unmap of {requested} bytes at offset {offset} of range {:#x} covers unmapped \
                 pages",
                range.address
            )));
        }
        for (at, len) in runs {
            mapped.remove(&at);
            if at < offset {
                mapped.insert(at, offset - at);
            }
            if at + len > end {
                mapped.insert(end, at + len - end);
            }
        }
        state.bytes_in_use -= size;
        state.counters.frees += 1;
        if half_way {
            return Err(DeviceError::PartialUnmap {
                unmapped: state.misreported_unmap.take().unwrap_or(size),
                reason: format!("{INJECTED_FAILURE} of {:?}", SimCall::Unmap),
            });
        }
        Ok(())
    }

    unsafe fn release_range(&mut self, range: DeviceSegment<u64>) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        if !state.range_mut(&range)?.2.is_empty() {
            return Err(DeviceError::Driver(format!(
                "release of range {:#x} with pages still mapped",
                range.address
            )));
        }
        state.ranges.remove(&range.address);
        state.range_pages.remove(&range.address);
        state.counters.ranges_released += 1;
        Ok(())
    }
}
