//! The generic server over a driver that only records what it is asked to do, on the
//! simulated device behind `Metered`: no GPU needed. These tests pin what the CUDA driver
//! relies on the server for: launch metadata without a device allocation per launch, stream
//! ids on bounded slots, cross-stream waits only when a buffer is newer than the last sync,
//! memory another stream used handed out again only after that stream's event completed, and
//! one out-of-memory per failed request.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::DynFut;
use cubecl_common::profile::TimingMethod;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::{DeviceProperties, ElemType, HardwareProperties, MemoryDeviceProperties};
use cubecl_ir::{StorageType, UIntKind, VectorSize};
use cubecl_runtime::compiler::{CompilationError, Compiler, CubeTask};
use cubecl_runtime::id::KernelId;
use cubecl_runtime::kernel::{CompiledKernel, KernelDefinition, KernelMetadata};
use cubecl_runtime::server::{
    ComputeServer, CopyDescriptor, CubeCount, ExecutionMode, Handle, KernelArguments, LaunchError,
    MetadataBindingInfo, ServerError,
};
use parking_lot::Mutex;

use super::super::driver::{Driver, Launch, MetadataLayout, Resource};
use super::super::error::DriverError;
use super::CachingServer;
use crate::alloc::AllocatorConfig;
use crate::device::DeviceStream;
use crate::device::metered::{Meter, Metered};
use crate::device::sim::SimDevice;

/// What the recording driver saw.
#[derive(Debug, Default)]
pub(super) struct Seen {
    streams_created: Vec<DeviceStream>,
    /// Per launch: the inline info and the bytes of the metadata buffer at launch time.
    pub(super) launches: Vec<(Vec<u64>, Option<Vec<u8>>)>,
    events_recorded: usize,
    waits: usize,
    /// The stream of every wait, in order.
    wait_streams: Vec<DeviceStream>,
    /// The stream of every event recorded, by event id.
    event_streams: Vec<DeviceStream>,
    /// Events the test declared complete (the others are still running).
    completed: HashSet<u64>,
    /// `synchronize_event` calls (the host waited for an event).
    pub(super) event_syncs: usize,
    /// Recording an event on this stream fails.
    failing_records: Option<DeviceStream>,
    /// Device contents written so far, by (segment, offset).
    memory: HashMap<(u64, u64), Vec<u8>>,
    /// `Driver::memory` calls: how often the server opened the device memory.
    memory_opened: usize,
    /// Whether `peer_copies` answers yes (the device path of `comm`).
    pub(super) peer_copies: bool,
    /// Per `export`: the staging copy's source and destination locations.
    pub(super) exports: Vec<((u64, u64), (u64, u64))>,
    /// Per `import`: the destination location and the completion event's id.
    pub(super) imports: Vec<((u64, u64), u64)>,
    /// `import` fails (nothing copied).
    pub(super) failing_imports: bool,
}

/// Ids of the completion events `import` returns: apart from `record_event`'s, so that a test
/// can complete them on the source's recording (where the source's server asks).
pub(super) const PEER_EVENTS: u64 = 1 << 40;

/// What the recording driver's `export` hands the peer: the staging block's bytes.
pub(super) struct PeerBytes(Vec<u8>);

#[derive(Debug, Clone)]
pub(super) struct NoCompiler;

impl Compiler for NoCompiler {
    type Representation = String;
    type CompilationOptions = ();

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &(),
        _mode: ExecutionMode,
        _addr_type: StorageType,
    ) -> Result<String, CompilationError> {
        unreachable!("the recording driver compiles nothing")
    }

    fn elem_size(&self, _elem: ElemType) -> usize {
        4
    }

    fn extension(&self) -> &'static str {
        "none"
    }
}

struct NoKernel;

impl KernelMetadata for NoKernel {
    fn id(&self) -> KernelId {
        KernelId::new::<Self>()
    }

    fn address_type(&self) -> StorageType {
        StorageType::Scalar(ElemType::UInt(UIntKind::U32))
    }
}

impl CubeTask<NoCompiler> for NoKernel {
    fn compile(
        &self,
        _compiler: &mut NoCompiler,
        _options: &(),
        _mode: ExecutionMode,
        _address_type: StorageType,
    ) -> Result<CompiledKernel<NoCompiler>, CompilationError> {
        unreachable!("the recording driver compiles nothing")
    }
}

pub(super) struct Recording {
    memory: Option<Metered<SimDevice>>,
    layout: MetadataLayout,
    seen: Arc<Mutex<Seen>>,
}

std::thread_local! {
    /// The driver `Recording::open` hands out next on this thread (a test puts it there).
    static NEXT_OPENED: std::cell::RefCell<Option<Recording>> = const { std::cell::RefCell::new(None) };
}

impl Driver for Recording {
    const NAME: &'static str = "recording";
    type Memory = Metered<SimDevice>;
    type Compiler = NoCompiler;
    type Info = ();
    type Stream = DeviceStream;
    type Event = u64;
    type Kernel = ();
    type PeerBuffer = PeerBytes;

    fn open(_device: DeviceId) -> Result<Self, DriverError> {
        NEXT_OPENED
            .with(|next| next.borrow_mut().take())
            .ok_or_else(|| DriverError::NoDevice {
                api: "recording",
                reason: "no driver was put in NEXT_OPENED".into(),
                hint: "a test puts one there first",
            })
    }

    fn memory(&mut self) -> Metered<SimDevice> {
        // Counted, not refused (a test asserts the count): a second opening gets a device of
        // its own, as a second `CudaMemory` gets an event pool of its own.
        self.seen.lock().memory_opened += 1;
        self.memory
            .take()
            .unwrap_or_else(|| Metered::new(SimDevice::new(1 << 30)))
    }

    fn properties(&self) -> DeviceProperties {
        let hardware = HardwareProperties {
            load_width: 128,
            plane_size_min: 32,
            plane_size_max: 32,
            max_bindings: 32,
            max_shared_memory_size: 48 << 10,
            max_cube_count: (65535, 65535, 65535),
            max_units_per_cube: 1024,
            max_cube_dim: (1024, 1024, 64),
            num_streaming_multiprocessors: None,
            num_cpu_cores: None,
            num_tensor_cores: None,
            min_tensor_cores_dim: None,
            max_vector_size: VectorSize::MAX,
        };
        let memory = MemoryDeviceProperties {
            max_page_size: 1 << 30,
            alignment: 512,
        };
        DeviceProperties::new(Default::default(), memory, hardware, TimingMethod::System)
    }

    fn info(&self) {}

    fn metadata_layout(&self) -> MetadataLayout {
        self.layout
    }

    fn create_stream(&mut self, id: DeviceStream) -> DeviceStream {
        self.seen.lock().streams_created.push(id);
        id
    }

    fn compile(
        &mut self,
        _kernel: &dyn CubeTask<NoCompiler>,
        _mode: ExecutionMode,
        _args: &KernelArguments,
    ) -> Result<(), LaunchError> {
        Ok(())
    }

    unsafe fn launch(
        &mut self,
        _stream: &mut DeviceStream,
        launch: Launch<'_, Self>,
    ) -> Result<(), ServerError> {
        let mut seen = self.seen.lock();
        let metadata = launch
            .metadata
            .as_ref()
            .map(|buffer| seen.memory[&(buffer.segment, buffer.offset)].clone());
        seen.launches.push((launch.info.to_vec(), metadata));
        Ok(())
    }

    unsafe fn write(
        &mut self,
        _stream: &mut DeviceStream,
        dst: &Resource<Self>,
        data: &[u8],
    ) -> Result<(), ServerError> {
        self.seen
            .lock()
            .memory
            .insert((dst.segment, dst.offset), data.to_vec());
        Ok(())
    }

    unsafe fn read(
        &mut self,
        _stream: &mut DeviceStream,
        sources: Vec<(Resource<Self>, usize)>,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        // What was written there (zeros where nothing was), `len` bytes of it.
        let memory = &self.seen.lock().memory;
        let bytes = sources
            .into_iter()
            .map(|(at, len)| {
                let mut data = memory
                    .get(&(at.segment, at.offset))
                    .cloned()
                    .unwrap_or_default();
                data.resize(len, 0);
                Bytes::from_bytes_vec(data)
            })
            .collect();
        Box::pin(async move { Ok(bytes) })
    }

    fn flush(&mut self, _stream: &mut DeviceStream) -> Result<(), ServerError> {
        Ok(())
    }

    fn sync(&mut self, _stream: &mut DeviceStream) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }

    fn record_event(&mut self, stream: &mut DeviceStream) -> Result<u64, ServerError> {
        let mut seen = self.seen.lock();
        if seen.failing_records == Some(*stream) {
            return Err(ServerError::Generic {
                reason: "injected: cannot record an event".into(),
                backtrace: cubecl_common::backtrace::BackTrace::capture(),
            });
        }
        seen.events_recorded += 1;
        seen.event_streams.push(*stream);
        Ok(seen.event_streams.len() as u64 - 1)
    }

    fn wait_event(&mut self, stream: &mut DeviceStream, _event: u64) -> Result<(), ServerError> {
        let mut seen = self.seen.lock();
        seen.waits += 1;
        seen.wait_streams.push(*stream);
        Ok(())
    }

    fn query_event(&mut self, event: &u64) -> Result<bool, ServerError> {
        Ok(self.seen.lock().completed.contains(event))
    }

    fn synchronize_event(&mut self, event: &u64) -> Result<(), ServerError> {
        let mut seen = self.seen.lock();
        seen.event_syncs += 1;
        seen.completed.insert(*event);
        Ok(())
    }

    fn peer_copies(&self) -> bool {
        self.seen.lock().peer_copies
    }

    unsafe fn export(
        &mut self,
        _stream: &mut DeviceStream,
        src: &Resource<Self>,
        staging: &Resource<Self>,
        len: usize,
    ) -> Result<PeerBytes, ServerError> {
        let mut seen = self.seen.lock();
        let mut bytes = seen
            .memory
            .get(&(src.segment, src.offset))
            .cloned()
            .unwrap_or_default();
        bytes.resize(len, 0);
        seen.memory
            .insert((staging.segment, staging.offset), bytes.clone());
        seen.exports
            .push(((src.segment, src.offset), (staging.segment, staging.offset)));
        Ok(PeerBytes(bytes))
    }

    unsafe fn import(
        &mut self,
        _stream: &mut DeviceStream,
        dst: &Resource<Self>,
        src: &PeerBytes,
    ) -> Result<u64, ServerError> {
        let mut seen = self.seen.lock();
        if seen.failing_imports {
            return Err(ServerError::Generic {
                reason: "injected: the peer copy fails".into(),
                backtrace: cubecl_common::backtrace::BackTrace::capture(),
            });
        }
        seen.memory.insert((dst.segment, dst.offset), src.0.clone());
        let event = PEER_EVENTS + seen.imports.len() as u64;
        seen.imports.push(((dst.segment, dst.offset), event));
        Ok(event)
    }
}

pub(super) struct Harness {
    pub(super) server: CachingServer<Recording>,
    meter: Meter,
    pub(super) seen: Arc<Mutex<Seen>>,
}

fn harness(layout: MetadataLayout, max_streams: usize) -> Harness {
    harness_on(SimDevice::new(1 << 30), layout, max_streams)
}

/// A server over a simulated device of `capacity` bytes.
pub(super) fn harness_of(layout: MetadataLayout, max_streams: usize, capacity: u64) -> Harness {
    harness_on(SimDevice::new(capacity), layout, max_streams)
}

pub(super) fn harness_on(device: SimDevice, layout: MetadataLayout, max_streams: usize) -> Harness {
    harness_configured(device, layout, max_streams, AllocatorConfig::default())
}

fn harness_configured(
    device: SimDevice,
    layout: MetadataLayout,
    max_streams: usize,
    config: AllocatorConfig,
) -> Harness {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let memory = Metered::new(device);
    let meter = memory.meter();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let driver = Recording {
        memory: Some(memory),
        layout,
        seen: seen.clone(),
    };
    // A device id of its own per test: the registry keeps one engine per device.
    let device = DeviceId {
        type_id: 0xCA11,
        index_id: NEXT.fetch_add(1, Ordering::Relaxed),
    };
    let mut server = CachingServer::new(driver, device, config)
        .expect("every device serves the configuration")
        .with_max_streams(max_streams);
    // The tests' stream ids are made up and may equal the ids of real threads of other tests,
    // whose exits would be read as theirs: the harness hears no thread exits unless a test
    // asks (`listen_to_thread_exits`).
    server.streams.ignore_thread_exits();
    Harness {
        server,
        meter,
        seen,
    }
}

pub(super) fn stream(value: u64) -> StreamId {
    StreamId { value }
}

impl Harness {
    pub(super) fn buffer(&mut self, size: u64, on: StreamId) -> Handle {
        let handle = Handle::new(on, size);
        self.server
            .initialize_memory(handle.memory.clone(), size, on);
        handle
    }

    fn launch(&mut self, buffers: &[&Handle], info: MetadataBindingInfo, on: StreamId) {
        self.issue_launch(buffers, info, on);
        self.server.flush(on).expect("the launch succeeded");
    }

    /// Issues a kernel over `buffers` on `on` without flushing: a failed launch stays queued
    /// on the stream as its error.
    pub(super) fn issue_launch(
        &mut self,
        buffers: &[&Handle],
        info: MetadataBindingInfo,
        on: StreamId,
    ) {
        let args = KernelArguments {
            buffers: buffers.iter().map(|h| (*h).clone().binding()).collect(),
            info,
            tensor_maps: Vec::new(),
        };
        // SAFETY: the recording driver runs nothing.
        unsafe {
            self.server.launch(
                Box::new(NoKernel),
                CubeCount::Static(1, 1, 1),
                args,
                ExecutionMode::Checked,
                on,
            )
        };
    }

    fn waits(&self) -> usize {
        self.seen.lock().waits
    }

    /// Where a buffer lives: its segment and offset.
    pub(super) fn location(&mut self, handle: &Handle) -> (u64, u64) {
        let on = handle.stream;
        let resource = self
            .server
            .get_resource(handle.clone().binding(), on)
            .expect("a live buffer");
        (resource.resource().segment, resource.resource().offset)
    }

    /// The events recorded on `stream` so far, by id.
    fn events_on(&self, stream: DeviceStream) -> Vec<u64> {
        let seen = self.seen.lock();
        (0..seen.event_streams.len() as u64)
            .filter(|id| seen.event_streams[*id as usize] == stream)
            .collect()
    }

    pub(super) fn complete(&self, events: &[u64]) {
        self.seen.lock().completed.extend(events.iter().copied());
    }
}

fn ne_bytes(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

#[test]
fn grid_constant_launches_allocate_nothing_on_the_device_in_steady_state() {
    let mut h = harness(MetadataLayout::GridConstant, 4);
    let out = h.buffer(4096, stream(0));
    // Scalars and static metadata [10, 11], dynamic metadata (shapes, strides) after them.
    h.launch(
        &[&out],
        MetadataBindingInfo::new(vec![10, 11, 1, 2], 2),
        stream(0),
    );
    let after_first = h.meter.reading();
    for i in 0..100 {
        h.launch(
            &[&out],
            MetadataBindingInfo::new(vec![10, 11, i, i + 1, i + 2], 2),
            stream(0),
        );
    }
    assert_eq!(
        h.meter.reading(),
        after_first,
        "a launch must not allocate or free device memory once the scratch exists"
    );
    // `empty_cache` (CubeCL's memory cleanup) leaves nothing allocated, scratch included.
    drop(out);
    h.server.memory_cleanup(stream(0));
    assert_eq!(h.server.allocator().stats().allocated_bytes.all.current, 0);
    assert_eq!(h.server.allocator().memory_reserved(), 0);
    let seen = h.seen.lock();
    assert_eq!(seen.launches.len(), 101);
    // The driver gets the static part inline and this launch's dynamic part on the device.
    assert_eq!(seen.launches[0], (vec![10, 11], Some(ne_bytes(&[1, 2]))));
    assert_eq!(
        seen.launches[100],
        (vec![10, 11], Some(ne_bytes(&[99, 100, 101])))
    );
}

#[test]
fn a_launch_without_dynamic_metadata_uploads_nothing() {
    let mut h = harness(MetadataLayout::GridConstant, 4);
    let out = h.buffer(4096, stream(0));
    let before = h.meter.reading();
    h.launch(&[&out], MetadataBindingInfo::new(vec![3, 4], 2), stream(0));
    assert_eq!(h.meter.reading(), before);
    assert_eq!(h.seen.lock().launches[0], (vec![3, 4], None));
}

#[test]
fn the_metadata_scratch_grows_rarely_and_through_the_engine() {
    let mut h = harness(MetadataLayout::DeviceBuffer, 4);
    let out = h.buffer(4096, stream(0));
    let reserved_before = h.server.allocator().memory_reserved();
    // Growing sizes: 8 bytes .. 8 KiB of metadata.
    for len in 1..=1024u64 {
        let data: Vec<u64> = (0..len).collect();
        h.launch(&[&out], MetadataBindingInfo::new(data, 0), stream(0));
    }
    let seen = h.seen.lock();
    assert_eq!(
        seen.launches[1023].1,
        Some(ne_bytes(&(0..1024).collect::<Vec<_>>()))
    );
    // The whole info goes through the device buffer in this layout.
    assert!(seen.launches.iter().all(|(inline, _)| inline.is_empty()));
    drop(seen);
    // The scratch is an engine block: what the engine reserved grew, the device saw few
    // allocations (the engine caches; the scratch grows in powers of two).
    assert!(h.server.allocator().memory_reserved() >= reserved_before);
    assert!(
        h.meter.allocs() <= 3,
        "1024 launches of growing metadata allocated {} device segments",
        h.meter.allocs()
    );
}

#[test]
fn threads_beyond_max_streams_share_slots_and_their_cached_memory() {
    let mut h = harness(MetadataLayout::DriverBinding, 4);
    // CubeCL's mapping alone (`id % max_streams`): no thread is given an idle slot.
    h.server.streams.never_reuse_slots();
    // 64 threads, each making and dropping a tensor of the same size.
    for value in 0..64 {
        let handle = h.buffer(1 << 20, stream(value));
        drop(handle);
    }
    assert_eq!(h.server.streams_in_use(), 4);
    assert_eq!(h.seen.lock().streams_created.len(), 4);
    // Memory one thread left cached is reused by the next thread of its slot.
    assert!(
        h.meter.allocs() <= 4,
        "64 threads on 4 slots allocated {} segments",
        h.meter.allocs()
    );
}

#[test]
fn cross_stream_waits_happen_once_per_newer_buffer_not_once_per_use() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let weights = h.buffer(4096, stream(1));
    let out = h.buffer(4096, stream(2));
    let info = || MetadataBindingInfo::new(Vec::new(), 0);

    // Stream 2 uses stream 1's buffer ten times: one wait.
    for _ in 0..10 {
        h.launch(&[&weights, &out], info(), stream(2));
    }
    assert_eq!(h.waits(), 1);

    // A buffer stream 1 made after that sync needs a new wait; the old one alone does not.
    let fresh = h.buffer(4096, stream(1));
    h.launch(&[&fresh, &out], info(), stream(2));
    assert_eq!(h.waits(), 2);
    h.launch(&[&weights, &out], info(), stream(2));
    let read = h.server.read(
        vec![CopyDescriptor::new(
            weights.clone().binding(),
            [1024].into(),
            [1].into(),
            4,
        )],
        stream(2),
    );
    cubecl_common::future::block_on(read).expect("read");
    assert_eq!(h.waits(), 2);

    // Another stream has never synced with stream 1: it waits once.
    h.launch(&[&weights], info(), stream(3));
    h.launch(&[&weights], info(), stream(3));
    assert_eq!(h.waits(), 3);

    // Ids that share a slot are one stream: no event between them.
    h.launch(&[&out], info(), stream(2 + 8));
    assert_eq!(h.waits(), 3);
}

#[test]
fn a_buffer_its_stream_rewrites_after_a_sync_is_waited_for_again() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    // A loader stream (1) makes two batches; the training stream (2) syncs while using the
    // first, after the second was already created.
    let first = h.buffer(4096, stream(1));
    let second = h.buffer(4096, stream(1));
    let out = h.buffer(4096, stream(2));
    h.launch(&[&first, &out], info(), stream(2));
    assert_eq!(h.waits(), 1);
    // The loader works on a fresh buffer only: the second batch is still covered.
    let scratch = h.buffer(4096, stream(1));
    h.launch(&[&scratch], info(), stream(1));
    h.launch(&[&second, &out], info(), stream(2));
    assert_eq!(h.waits(), 1);
    // The loader updates the second batch in place: the trainer must wait for that.
    h.launch(&[&second], info(), stream(1));
    h.launch(&[&second, &out], info(), stream(2));
    assert_eq!(h.waits(), 2);
    // Once waited for, further uses are free again.
    h.launch(&[&second, &out], info(), stream(2));
    assert_eq!(h.waits(), 2);
}

#[test]
fn tensor_maps_are_refused_with_a_launch_error() {
    // A launch that carries tensor maps is checked first in `launch_one`; building a real
    // `TensorMapMeta` needs a TMA-capable planner, so the check itself is what is tested here.
    let err = super::checks::no_tensor_maps(1).expect_err("refused");
    assert!(err.to_string().contains("tensor map"), "{err}");
    assert!(super::checks::no_tensor_maps(0).is_ok());
}

#[test]
fn a_buffer_another_stream_used_is_reused_only_after_that_streams_event_completed() {
    // PyTorch's `recordStream`, `insert_events` and `process_events`
    // (CUDACachingAllocator.cpp): a block used on another stream is handed out again only once
    // an event recorded there after the use has completed.
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let batch = h.buffer(4096, stream(1));
    let first = h.location(&batch);
    let out = h.buffer(4096, stream(2));
    // The consumer (2) uses the producer's (1) batch, then the batch's last handle goes.
    h.launch(&[&batch, &out], info(), stream(2));
    let consumer_events = h.events_on(DeviceStream(2));
    assert_eq!(consumer_events.len(), 1, "one event after the use");
    assert_eq!(h.server.pending_uses(), (1, 1));
    drop(batch);
    // The producer's next tensor of the same size would be CubeCL's exact-size reuse of the
    // freed slice: while the consumer may still read it, it gets other memory.
    let next = h.buffer(4096, stream(1));
    assert_ne!(
        h.location(&next),
        first,
        "reused while the consumer may still read it"
    );
    // Once the consumer's event completed, the memory is free for new work again.
    h.complete(&consumer_events);
    let later = h.buffer(4096, stream(1));
    assert_eq!(h.location(&later), first);
    assert_eq!(h.server.pending_uses(), (0, 0));
    assert_eq!(h.seen.lock().event_syncs, 0, "polled, never waited for");
}

#[test]
fn a_buffer_reused_on_its_own_stream_costs_no_event() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let batch = h.buffer(4096, stream(1));
    let first = h.location(&batch);
    let out = h.buffer(4096, stream(1));
    h.launch(&[&batch, &out], info(), stream(1));
    // Ids that share a slot are one stream.
    h.launch(&[&batch, &out], info(), stream(1 + 8));
    drop(batch);
    let next = h.buffer(4096, stream(1));
    assert_eq!(h.location(&next), first, "stream order protects the reuse");
    assert_eq!(h.seen.lock().events_recorded, 0);
    assert_eq!(h.server.pending_uses(), (0, 0));
}

#[test]
fn a_read_keeps_its_source_until_the_copy_completed_and_its_stream_until_its_event() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let read_of = |handle: &Handle| {
        vec![CopyDescriptor::new(
            handle.clone().binding(),
            [1024].into(),
            [1].into(),
            4,
        )]
    };
    // Same stream: the future holds the source until it has yielded the bytes.
    let source = h.buffer(4096, stream(1));
    let first = h.location(&source);
    let copy = h.server.read(read_of(&source), stream(1));
    drop(source);
    let next = h.buffer(4096, stream(1));
    assert_ne!(
        h.location(&next),
        first,
        "the copy's source was reused before it completed"
    );
    let bytes = cubecl_common::future::block_on(copy).expect("read");
    assert_eq!(bytes[0].len(), 4096);
    let after = h.buffer(4096, stream(1));
    assert_eq!(h.location(&after), first, "free once the copy completed");
    assert_eq!(
        h.seen.lock().events_recorded,
        0,
        "no event on the same stream"
    );

    // Another stream reads it: the source stays held until that stream's event completed,
    // even once the read's future is done.
    let first = h.location(&after);
    let copy = h.server.read(read_of(&after), stream(2));
    drop(after);
    cubecl_common::future::block_on(copy).expect("read");
    let next = h.buffer(4096, stream(1));
    assert_ne!(h.location(&next), first);
    h.complete(&h.events_on(DeviceStream(2)));
    let free_again = h.buffer(4096, stream(1));
    assert_eq!(h.location(&free_again), first);
}

#[test]
fn empty_cache_waits_for_other_streams_uses_and_then_returns_their_memory() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let batch = h.buffer(1 << 20, stream(1));
    h.launch(&[&batch], info(), stream(2));
    drop(batch);
    h.server.memory_cleanup(stream(1));
    // PyTorch's `empty_cache` synchronises pending events, then frees what they held.
    assert_eq!(h.seen.lock().event_syncs, 1);
    assert_eq!(h.server.pending_uses(), (0, 0));
    assert_eq!(h.server.allocator().stats().allocated_bytes.all.current, 0);
    assert_eq!(h.server.allocator().memory_reserved(), 0);
}

/// A server on an 80 MiB device with 4 stream slots, counting its out-of-memory observer's
/// calls and writing its first-OOM snapshot to a file of the test's own.
fn small_device(name: &str) -> (Harness, Arc<Mutex<Vec<String>>>, std::path::PathBuf) {
    let h = harness_on(SimDevice::new(80 * MIB), MetadataLayout::DriverBinding, 4);
    let observed = Arc::new(Mutex::new(Vec::new()));
    let seen = observed.clone();
    h.server
        .allocator()
        .on_out_of_memory(move |err| seen.lock().push(err.to_string()));
    let path = std::env::temp_dir().join(format!("{name}-{}.pickle", std::process::id()));
    let _ = std::fs::remove_file(&path);
    h.server
        .allocator()
        .dump_snapshot_on_oom(Some(path.clone()));
    (h, observed, path)
}

const MIB: u64 = 1 << 20;

#[test]
fn a_request_other_streams_caches_can_serve_is_no_out_of_memory() {
    // PyTorch counts `num_ooms` only when `malloc` really fails, after every cache was freed
    // (`release_cached_blocks`) and the allocation retried; here the caches include CubeCL's
    // free slices of every stream, given back before the engine's cache flush.
    let (mut h, observed, snapshot) = small_device("recovered-oom");
    // Stream 1 holds 24 MiB; streams 2 and 3 dropped 26 MiB and 20 MiB (each a segment of its
    // own), cached in their CubeCL pools.
    let _live = h.buffer(24 * MIB, stream(1));
    drop(h.buffer(26 * MIB, stream(2)));
    drop(h.buffer(20 * MIB, stream(3)));
    assert_eq!(h.server.allocator().memory_reserved(), 70 * MIB);
    // 30 MiB on stream 1: the device has 10 MiB left; only stream 2's cache can make room.
    let fits = h.buffer(30 * MIB, stream(1));
    h.server
        .flush(stream(1))
        .expect("served after the reclaim and the flush");
    let stats = h.server.allocator().stats();
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.num_alloc_retries, 1, "one flush and retry");
    assert_eq!(h.server.allocator().wait_for_oom_observers().failures, 0);
    assert!(observed.lock().is_empty());
    assert!(!snapshot.exists(), "no out-of-memory, no snapshot");
    assert_eq!(h.server.allocator().memory_reserved(), 54 * MIB);
    drop(fits);
}

#[test]
fn a_request_that_fails_is_one_out_of_memory_with_one_observer_call_and_one_snapshot() {
    let (mut h, observed, snapshot) = small_device("one-oom");
    let _live = h.buffer(24 * MIB, stream(1));
    drop(h.buffer(26 * MIB, stream(2)));
    drop(h.buffer(8 * MIB, stream(3)));
    let _too_much = h.buffer(60 * MIB, stream(1));
    let err = h
        .server
        .flush(stream(1))
        .expect_err("60 MiB beside 24 MiB in 80 MiB");
    assert!(err.to_string().contains("out of memory"), "{err}");
    let stats = h.server.allocator().stats();
    assert_eq!(stats.num_ooms, 1, "one failed request, one out-of-memory");
    assert_eq!(stats.num_alloc_retries, 1);
    // Every layer gave back its cache before the failure: only the live tensor stays.
    assert_eq!(h.server.allocator().memory_reserved(), 24 * MIB);
    for slot in 1..4 {
        let counters = h
            .server
            .streams
            .get(&mut h.server.driver, stream(slot))
            .memory
            .counters();
        assert_eq!(counters.oom_reclaims, 1, "stream {slot} reclaimed once");
    }
    let report = h.server.allocator().wait_for_oom_observers();
    assert_eq!((report.failures, report.ran, report.panicked), (1, 1, 0));
    assert_eq!(observed.lock().len(), 1);
    assert!(observed.lock()[0].contains("out of memory"));
    let pickle = std::fs::read(&snapshot).expect("the snapshot of the first out-of-memory");
    assert_eq!(&pickle[..2], &[0x80, 2], "a pickle");
    std::fs::remove_file(&snapshot).expect("removed");
    // The server goes on: what fits is served.
    let fits = h.buffer(40 * MIB, stream(1));
    h.server
        .flush(stream(1))
        .expect("40 MiB beside 24 MiB fits");
    drop(fits);
}

#[test]
fn a_request_that_can_never_fit_is_a_clear_error_at_once() {
    let (mut h, observed, snapshot) = small_device("too-large");
    // Stream 1's slot exists before stream 2 caches anything: a new slot makes idle slots
    // hand their free slices back, which is not what this test is about.
    h.server.flush(stream(1)).expect("nothing issued yet");
    drop(h.buffer(8 * MIB, stream(2)));
    let cached_before = h
        .server
        .streams
        .get(&mut h.server.driver, stream(2))
        .memory
        .usage();
    let _never = h.buffer(200 * MIB, stream(1));
    let err = h
        .server
        .flush(stream(1))
        .expect_err("200 MiB on an 80 MiB device");
    let message = err.to_string();
    assert!(
        message.contains("larger than the largest segment"),
        "{message}"
    );
    assert!(
        !message.contains("after returning every free CubeCL slice"),
        "{message}"
    );
    // No stream's cache was walked for it, the engine did not flush.
    let other = h
        .server
        .streams
        .get(&mut h.server.driver, stream(2))
        .memory
        .counters();
    assert_eq!(other.oom_reclaims, 0);
    assert_eq!(
        h.server
            .streams
            .get(&mut h.server.driver, stream(2))
            .memory
            .usage(),
        cached_before
    );
    let stats = h.server.allocator().stats();
    assert_eq!(
        stats.num_ooms, 1,
        "counted as PyTorch counts a failed cudaMalloc"
    );
    assert_eq!(stats.num_alloc_retries, 0);
    // An out-of-memory for the observers and the snapshot too.
    assert_eq!(h.server.allocator().wait_for_oom_observers().failures, 1);
    assert!(observed.lock()[0].contains("larger than the largest segment"));
    assert!(snapshot.exists());
    std::fs::remove_file(&snapshot).expect("removed");
}

#[test]
fn a_use_whose_event_cannot_be_recorded_holds_its_buffer_until_the_stream_is_synced() {
    // PyTorch's `insert_events` raises when an event cannot be recorded and leaves the block
    // alone: never freed early.
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let batch = h.buffer(4096, stream(1));
    let first = h.location(&batch);
    h.seen.lock().failing_records = Some(DeviceStream(2));
    let args = KernelArguments {
        buffers: vec![batch.clone().binding()],
        info: MetadataBindingInfo::new(Vec::new(), 0),
        tensor_maps: Vec::new(),
    };
    // SAFETY: the recording driver runs nothing.
    unsafe {
        h.server.launch(
            Box::new(NoKernel),
            CubeCount::Static(1, 1, 1),
            args,
            ExecutionMode::Checked,
            stream(2),
        )
    };
    let err = h
        .server
        .flush(stream(2))
        .expect_err("the failed record is reported");
    assert!(err.to_string().contains("cannot record an event"), "{err}");
    assert_eq!(
        h.seen.lock().launches.len(),
        1,
        "the launch itself was issued"
    );
    assert_eq!(h.server.pending_uses(), (0, 1), "held without an event");
    drop(batch);
    let next = h.buffer(4096, stream(1));
    assert_ne!(
        h.location(&next),
        first,
        "reused although its use was never proven done"
    );
    // `empty_cache` synchronises the stream itself, then lets the buffer go.
    drop(next);
    h.server.memory_cleanup(stream(1));
    assert_eq!(h.server.pending_uses(), (0, 0));
    assert_eq!(h.server.allocator().stats().allocated_bytes.all.current, 0);
}

/// A device id of its own for a test that opens a server the way CubeCL does
/// (`DeviceService::init`): the registry keeps one engine and one configuration per device.
fn opened_device() -> DeviceId {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    DeviceId {
        type_id: 0xCA12,
        index_id: NEXT.fetch_add(1, Ordering::Relaxed),
    }
}

/// A recording driver over `device` for `Recording::open` to hand out on this thread.
fn next_opened(device: SimDevice) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let driver = Recording {
        memory: Some(Metered::new(device)),
        layout: MetadataLayout::DriverBinding,
        seen: seen.clone(),
    };
    NEXT_OPENED.with(|next| *next.borrow_mut() = Some(driver));
    seen
}

/// Issue 19 item 3: `init` opened the device memory once to read the virtual-memory
/// granularity and again for the engine (on CUDA a second `CudaMemory`, with an event pool
/// of its own), against `Driver::memory`'s "called once per server".
#[test]
fn opening_a_device_opens_its_memory_once() {
    let device = opened_device();
    let seen = next_opened(SimDevice::new(1 << 30));
    let server = CachingServer::<Recording>::open(device).expect("the device opens");
    assert_eq!(seen.lock().memory_opened, 1);
    assert_eq!(server.allocator().memory_reserved(), 0);

    // A configuration given in code that asks for expandable segments, on a device with
    // virtual memory: still one opening.
    let device = opened_device();
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    assert!(super::registry::configure::<Metered<SimDevice>>(
        device,
        expandable.clone()
    ));
    let seen = next_opened(SimDevice::new(1 << 30));
    let server = CachingServer::<Recording>::open(device).expect("the device opens");
    assert_eq!(seen.lock().memory_opened, 1);
    assert_eq!(server.allocator().config(), expandable);
}

/// Issue 19 item 3: one policy for a missing capability. The server refused expandable
/// segments on a device without virtual memory (a panic at `init`) while the engine warned and
/// served ordinary segments; both now refuse with the engine's `ConfigError::Unsupported`.
#[test]
fn expandable_segments_without_virtual_memory_are_refused_by_the_engine_and_the_server() {
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let engine_err = crate::alloc::CachingAllocator::new(
        SimDevice::new(1 << 30).without_virtual_memory(),
        expandable.clone(),
    )
    .err()
    .expect("refused");
    assert!(
        matches!(&engine_err, crate::alloc::ConfigError::Unsupported { key, .. } if key == "expandable_segments"),
        "{engine_err:?}"
    );

    // The server over such a device: the same error, from one opening of its memory.
    let device = opened_device();
    assert!(super::registry::configure::<Metered<SimDevice>>(
        device, expandable
    ));
    let seen = next_opened(SimDevice::new(1 << 30).without_virtual_memory());
    let err = CachingServer::<Recording>::open(device).expect_err("refused");
    assert_eq!(
        err,
        DriverError::Config {
            var: "backend::configure",
            source: engine_err,
        }
    );
    assert_eq!(seen.lock().memory_opened, 1);

    // The same device serves every configuration that needs no virtual memory.
    let device = opened_device();
    next_opened(SimDevice::new(1 << 30).without_virtual_memory());
    assert!(CachingServer::<Recording>::open(device).is_ok());
}

/// Issue 33: a device that could not open panicked on CubeCL's device thread, and the caller
/// saw only `RecvError`. `open::ensure_open` (behind `Runtime::client` and `backend::open`)
/// opens on the caller's thread and returns the reason, the same one on every later call
/// without trying again; a device that opens is then served by CubeCL's device thread.
#[test]
fn a_device_that_cannot_open_tells_the_caller_why_on_every_try() {
    use super::super::open::ensure_open;
    use super::super::registry::{self, OpenState};
    use cubecl_common::device_handle::DeviceHandle;

    let device = opened_device();
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    assert!(registry::configure::<Metered<SimDevice>>(
        device, expandable
    ));
    next_opened(SimDevice::new(1 << 30).without_virtual_memory());
    let err = ensure_open::<Recording>(device).expect_err("refused");
    assert!(
        matches!(
            &err,
            DriverError::Config { var: "backend::configure", source }
                if source.to_string().contains("expandable_segments")
        ),
        "{err:?}"
    );
    // Again: the same error, and the device is not opened a second time (the driver left for
    // a second opening stays where it was put).
    let second = next_opened(SimDevice::new(1 << 30));
    assert_eq!(ensure_open::<Recording>(device), Err(err.clone()));
    assert_eq!(
        registry::open_state::<Metered<SimDevice>>(device),
        OpenState::Failed(err)
    );
    assert_eq!(second.lock().memory_opened, 0);

    // A device that opens (with the driver left above): registered, and its server is the one
    // CubeCL's device thread runs.
    let device = opened_device();
    ensure_open::<Recording>(device).expect("the device opens");
    assert_eq!(second.lock().memory_opened, 1);
    assert_eq!(
        registry::open_state::<Metered<SimDevice>>(device),
        OpenState::Opened
    );
    let handle = DeviceHandle::<CachingServer<Recording>>::new(device);
    let engine = handle
        .submit_blocking(|server| Arc::as_ptr(server.allocator()) as usize)
        .expect("the device thread answers");
    let registered = registry::lookup::<Metered<SimDevice>>(device).expect("registered");
    assert_eq!(engine, Arc::as_ptr(&registered.allocator) as usize);
    // Opening an open device does nothing.
    assert_eq!(ensure_open::<Recording>(device), Ok(()));
}

/// Issue 33: CubeCL's `StorageHandle::offset_start`/`offset_end` subtract unchecked, so a
/// handle offset past its slice used to resolve outside the block (in a release build, 1 MiB
/// past a 1 KiB block with a size near 2^64; in a debug build, a panic inside CubeCL). The
/// server refuses it with an error; offsets inside the slice still resolve.
#[test]
fn handle_offsets_past_the_slice_are_an_error_not_a_resource_outside_the_block() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let on = stream(1);
    let small = h.buffer(1024, on);
    for (start, end) in [
        (Some(1u64 << 20), None),
        (None, Some(1025)),
        (Some(512), Some(513)),
    ] {
        let mut handle = small.clone();
        if let Some(start) = start {
            handle = handle.offset_start(start);
        }
        if let Some(end) = end {
            handle = handle.offset_end(end);
        }
        let err = h
            .server
            .get_resource(handle.binding(), on)
            .expect_err("offsets past the slice are refused");
        match err {
            ServerError::Io(cubecl_runtime::server::IoError::Unknown { description, .. }) => {
                assert!(
                    description.contains("outside its 1024-byte slice"),
                    "{description}"
                )
            }
            other => panic!("expected the offsets' error, got {other}"),
        }
    }
    let inside = h
        .server
        .get_resource(
            small.clone().offset_start(512).offset_end(256).binding(),
            on,
        )
        .expect("offsets inside the slice resolve");
    assert_eq!(inside.resource().size, 256);
    let whole = h.location(&small);
    assert_eq!(inside.resource().offset, whole.1 + 512);
}

/// Issue 33: `Streams::get_slot` asked the engine for its history options (taking the
/// engine's lock) on every stream lookup, which every operation makes. A lookup of an
/// existing stream now proceeds while another thread holds the engine's lock; only creating
/// a stream asks (its reclaim policy follows the recording).
#[test]
fn looking_up_an_existing_stream_takes_no_engine_lock() {
    let mut h = harness(MetadataLayout::DriverBinding, 8);
    let buffer = h.buffer(4096, stream(1));
    let allocator = h.server.allocator().clone();
    let held = allocator.hold_engine_lock();
    let (sender, received) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let server = &mut h.server;
        let cursor = server.streams.get(&mut server.driver, stream(1)).cursor;
        sender.send(cursor).expect("the test waits");
        h
    });
    let looked_up = received.recv_timeout(std::time::Duration::from_secs(20));
    drop(held);
    let h = worker
        .join()
        .expect("the lookup returns once the lock is free");
    assert!(looked_up.is_ok(), "the lookup waited for the engine's lock");
    drop(buffer);
    drop(h);
}

#[test]
fn rounds_of_new_threads_reuse_the_memory_of_the_threads_that_are_gone() {
    // A data loader's workers, epoch after epoch: every round's threads are new CubeCL
    // streams. The slots of the previous round hand their free slices back when a new slot
    // appears, and the engine gives their whole free segments to the new streams once each
    // old stream's fence has completed (here the test completes them, as a GPU would have by
    // the time a new thread starts).
    // Every thread gets a slot of its own here (see
    // `new_threads_take_the_idle_slots_of_threads_that_are_gone` for the slots themselves
    // reused).
    let device = SimDevice::new(1 << 30);
    let mut h = harness_on(device.clone(), MetadataLayout::DriverBinding, 128);
    h.server.streams.never_reuse_slots();
    let sizes: Vec<u64> = (0..30u64).map(|i| 1024 + i * 41 * 1024).collect();
    let mut reserved = Vec::new();
    let mut next_thread = 0;
    for _round in 0..4 {
        let threads: Vec<u64> = (next_thread..next_thread + 6).collect();
        next_thread += 6;
        // The round's first operation makes its slot: the idle slots give their slices back
        // and record their fences, which complete before the round allocates.
        h.server.flush(stream(threads[0])).expect("flush");
        device.complete_all_events();
        for &thread in &threads {
            let handles: Vec<Handle> = sizes.iter().map(|&s| h.buffer(s, stream(thread))).collect();
            drop(handles);
        }
        reserved.push(h.server.allocator().memory_reserved());
    }
    assert!(
        reserved.iter().all(|&r| r == reserved[0]),
        "reserved after each round: {reserved:?}"
    );
    assert!(h.server.allocator().stats().num_stream_shares > 0);
    // The test's threads run one after another, so each new slot finds every earlier one
    // idle: each of the 24 slots but the last was handed back exactly once (an idle slot is
    // not walked again before an operation touches it).
    let last = h.server.streams.slot(stream(next_thread - 1));
    for slot in 0..next_thread as usize {
        let idle = h
            .server
            .streams
            .get_slot(&mut h.server.driver, slot)
            .memory
            .counters()
            .idle_reclaims;
        assert_eq!(idle, u64::from(slot != last), "slot {slot}");
    }
}

#[test]
fn new_threads_take_the_idle_slots_of_threads_that_are_gone() {
    // The same rounds of threads, one after another, with slot reuse: a new thread is given
    // the least recently used slot that no operation touched for `REUSE_AFTER` operations,
    // with its stream, its CubeCL pool and its engine cache. Each thread here makes 30
    // reservations, so when a thread starts the slot of the thread before it was touched
    // just now and the one before that long ago: two slots serve all 24 threads, and the
    // memory is the two slots' own (no segment changes stream).
    let device = SimDevice::new(1 << 30);
    let mut h = harness_on(device.clone(), MetadataLayout::DriverBinding, 128);
    let sizes: Vec<u64> = (0..30u64).map(|i| 1024 + i * 41 * 1024).collect();
    let mut reserved = Vec::new();
    for round in 0..4u64 {
        for thread in round * 6..round * 6 + 6 {
            let handles: Vec<Handle> = sizes.iter().map(|&s| h.buffer(s, stream(thread))).collect();
            drop(handles);
        }
        reserved.push(h.server.allocator().memory_reserved());
    }
    assert!(
        reserved.iter().all(|&r| r == reserved[0]),
        "reserved after each round: {reserved:?}"
    );
    assert_eq!(h.server.streams_in_use(), 2);
    assert_eq!(h.server.streams.reuses(), 22);
    assert_eq!(h.server.allocator().stats().num_stream_shares, 0);
    // A thread keeps its slot: thread 2 was given thread 0's slot and still has it.
    assert_eq!(
        h.server.streams.slot(stream(2)),
        h.server.streams.slot(stream(0))
    );
    assert_ne!(
        h.server.streams.slot(stream(1)),
        h.server.streams.slot(stream(0))
    );
}

/// A thread that opened a client (so reports its exit) and waits until the sender is dropped:
/// its stream id, the sender, and the thread.
fn spawn_watched() -> (
    StreamId,
    std::sync::mpsc::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    use crate::runtime::thread_exit::watch_current_thread;
    use std::sync::mpsc;
    let (id_tx, id_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        watch_current_thread();
        id_tx.send(StreamId::current()).expect("send");
        let _ = go_rx.recv();
    });
    (id_rx.recv().expect("id"), go_tx, thread)
}

#[test]
fn a_thread_that_reported_its_exit_gives_its_slot_to_the_next_new_thread_at_once() {
    // Threads that opened a client report their exit (`runtime::thread_exit`): the next new
    // thread takes the slot of a thread that has gone even when it was touched a moment ago,
    // where silence alone would take `REUSE_AFTER` operations.
    use super::streams::slot;
    let (gone, gone_go, gone_thread) = spawn_watched();
    let (alive, alive_go, alive_thread) = spawn_watched();
    let (queued, queued_go, queued_thread) = spawn_watched();
    let mut h = harness(MetadataLayout::DriverBinding, 128);
    h.server.streams.listen_to_thread_exits();
    // New threads' ids whose own slots (CubeCL's `id % 128`) are neither thread's.
    let fresh: Vec<StreamId> = (1_000_000..)
        .map(stream)
        .filter(|id| {
            [gone, alive, queued]
                .iter()
                .all(|g| slot(*id, 128) != slot(*g, 128))
        })
        .take(5)
        .collect();
    for id in [gone, alive] {
        drop(h.buffer(4096, id));
    }
    // A new thread while both are alive and were just touched: a slot of its own.
    let early = fresh[0];
    drop(h.buffer(4096, early));
    assert_eq!(h.server.streams.reuses(), 0);
    assert_eq!(h.server.streams_in_use(), 3);
    // One of them exits; the next new thread, one operation later, gets its slot.
    drop(gone_go);
    gone_thread.join().expect("join");
    let late = fresh[1];
    drop(h.buffer(4096, late));
    assert_eq!(h.server.streams.reuses(), 1);
    assert_eq!(h.server.streams.slot(late), h.server.streams.slot(gone));
    assert_eq!(h.server.streams_in_use(), 3);
    // The slot is the new thread's now: another new thread does not share it.
    let third = fresh[2];
    drop(h.buffer(4096, third));
    assert_ne!(h.server.streams.slot(third), h.server.streams.slot(gone));
    assert_eq!(h.server.streams.reuses(), 1);
    // A thread whose exit is read before its first operation arrives (its work was still
    // queued): its slot is free for the next new thread all the same.
    drop(queued_go);
    queued_thread.join().expect("join");
    drop(h.buffer(4096, fresh[3]));
    drop(h.buffer(4096, queued));
    assert_eq!(h.server.streams.reuses(), 1);
    drop(h.buffer(4096, fresh[4]));
    assert_eq!(h.server.streams.reuses(), 2);
    assert_eq!(
        h.server.streams.slot(fresh[4]),
        h.server.streams.slot(queued)
    );
    // The thread that is still there never lent its slot.
    assert!(
        fresh
            .iter()
            .all(|id| h.server.streams.slot(*id) != h.server.streams.slot(alive))
    );
    drop(alive_go);
    alive_thread.join().expect("join");
}

#[test]
fn a_silent_thread_keeps_its_slot_while_it_is_watched_and_alive() {
    // Silence (`REUSE_AFTER` operations of the device without one of the slot's own) gives a
    // slot away only when one of its threads will never report its exit. A watched thread
    // waiting on a barrier or a channel is silent but alive: giving its slot to a new thread
    // made two working threads share one stream, whose cache then followed how they
    // interleaved (the runtime's soak grew a segment in a later round in 4 of 15 runs on a
    // loaded machine; none once watched threads kept their slots).
    use super::streams::{REUSE_AFTER, slot};
    use crate::runtime::thread_exit::is_watched;
    let (waiting, go_tx, waiting_thread) = spawn_watched();
    assert!(is_watched(waiting.value));
    let mut h = harness(MetadataLayout::DriverBinding, 128);
    h.server.streams.listen_to_thread_exits();
    // Ids of threads that never opened a client (never watched), on slots of their own.
    let fresh: Vec<StreamId> = (1_000_000..)
        .map(stream)
        .filter(|id| slot(*id, 128) != slot(waiting, 128))
        .take(5)
        .collect();
    let (unwatched, busy) = (fresh[0], fresh[1]);
    drop(h.buffer(4096, waiting));
    drop(h.buffer(4096, unwatched));
    for _ in 0..REUSE_AFTER {
        drop(h.buffer(4096, busy));
    }
    assert_eq!(h.server.streams_in_use(), 3);
    // Both slots have been silent for `REUSE_AFTER` operations: the new thread is given the
    // unwatched thread's, never the waiting one's.
    drop(h.buffer(4096, fresh[2]));
    assert_eq!(h.server.streams.reuses(), 1);
    assert_eq!(
        h.server.streams.slot(fresh[2]),
        h.server.streams.slot(unwatched)
    );
    for _ in 0..REUSE_AFTER {
        drop(h.buffer(4096, busy));
    }
    drop(h.buffer(4096, fresh[3]));
    assert_eq!(h.server.streams.reuses(), 2);
    assert_ne!(
        h.server.streams.slot(fresh[3]),
        h.server.streams.slot(waiting)
    );
    // Once the waiting thread has exited, its slot goes to the next new thread.
    drop(go_tx);
    waiting_thread.join().expect("join");
    assert!(!is_watched(waiting.value));
    drop(h.buffer(4096, fresh[4]));
    assert_eq!(h.server.streams.reuses(), 3);
    assert_eq!(
        h.server.streams.slot(fresh[4]),
        h.server.streams.slot(waiting)
    );
    assert_eq!(h.server.streams_in_use(), 3);
}

#[test]
fn without_cross_stream_reuse_each_round_of_threads_reserves_anew() {
    // The same rounds under PyTorch's per-stream rule: the new streams cannot use what the
    // old ones cached, so reserved memory grows with every round.
    let device = SimDevice::new(1 << 30);
    let config = AllocatorConfig::parse("cross_stream_reuse:false").expect("a valid key");
    let mut h = harness_configured(device.clone(), MetadataLayout::DriverBinding, 128, config);
    let sizes: Vec<u64> = (0..30u64).map(|i| 1024 + i * 41 * 1024).collect();
    let mut reserved = Vec::new();
    for round in 0..3u64 {
        for thread in round * 6..round * 6 + 6 {
            let handles: Vec<Handle> = sizes.iter().map(|&s| h.buffer(s, stream(thread))).collect();
            drop(handles);
        }
        device.complete_all_events();
        reserved.push(h.server.allocator().memory_reserved());
    }
    assert!(
        reserved[2] > reserved[1] && reserved[1] > reserved[0],
        "{reserved:?}"
    );
}

/// `no_cuda_memory_caching` through the server (PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING`,
/// `forceUncachedAllocator`): CubeCL's exact-size reuse is bypassed as well, so a dropped
/// tensor's memory is neither handed to the next tensor of its size nor returned to the
/// device before an event on its stream, recorded at its free, has completed.
#[test]
fn without_caching_a_dropped_tensor_goes_back_to_the_device_only_after_its_stream() {
    let sim = SimDevice::new(1 << 30);
    let config = AllocatorConfig::parse("no_cuda_memory_caching:True").expect("parses");
    let mut h = harness_configured(sim.clone(), MetadataLayout::DriverBinding, 8, config);
    let info = || MetadataBindingInfo::new(Vec::new(), 0);
    let a = h.buffer(4096, stream(1));
    let first = h.location(&a);
    h.launch(&[&a], info(), stream(1));
    assert_eq!(h.meter.allocs(), 1);
    drop(a);
    // The next tensor of the same size: a device allocation of its own. The dropped one went
    // to the engine at this reservation; its stream's event has not completed.
    let b = h.buffer(4096, stream(1));
    assert_ne!(h.location(&b), first);
    assert_eq!((h.meter.allocs(), h.meter.frees()), (2, 0));
    let stats = h.server.allocator().stats();
    assert_eq!(stats.allocated_bytes.all.current, 4096);
    assert_eq!(
        stats.active_bytes.all.current,
        2 * 4096,
        "pending until its stream is done"
    );
    assert_eq!(stats.reserved_bytes.all.current, 2 * 4096);
    // Its stream's work done: the next request returns it.
    sim.complete_events(DeviceStream(1));
    let c = h.buffer(512, stream(1));
    assert_eq!((h.meter.allocs(), h.meter.frees()), (3, 1));
    let stats = h.server.allocator().stats();
    assert_eq!(stats.reserved_bytes.all.current, 4096 + 512);
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(
        sim.counters().events_synchronized,
        0,
        "nothing waited on the host"
    );
    drop((b, c));
}

/// A thread whose first operation on the device uses another thread's buffer (here a launch
/// reading it) is given a gone thread's slot; the wait that orders its work after the buffer's
/// producer goes to that slot's stream, where the work runs. Decided before the slot was
/// assigned, the wait went to CubeCL's slot of the id, and the launch ran unordered with the
/// producer (`ordering::order_after` now assigns first).
#[test]
fn a_new_threads_first_use_of_anothers_buffer_waits_on_the_slot_it_is_given() {
    use super::streams::{REUSE_AFTER, slot};
    let mut h = harness(MetadataLayout::DriverBinding, 128);
    // Three ids on three distinct CubeCL slots: a producer, a thread that goes silent (never
    // watched, so silence frees its slot), and the new thread.
    let mut ids = (3_000_000..).map(stream);
    let producer = ids.next().expect("id");
    let gone = ids
        .by_ref()
        .find(|id| slot(*id, 128) != slot(producer, 128))
        .expect("id");
    let new = ids
        .find(|id| slot(*id, 128) != slot(producer, 128) && slot(*id, 128) != slot(gone, 128))
        .expect("id");
    drop(h.buffer(4096, gone));
    let produced = h.buffer(4096, producer);
    for _ in 0..REUSE_AFTER {
        drop(h.buffer(4096, producer));
    }
    let before = h.seen.lock().wait_streams.len();
    h.launch(&[&produced], MetadataBindingInfo::new(vec![1], 0), new);
    let given = h.server.streams.slot(new);
    assert_eq!(given, h.server.streams.slot(gone), "the gone thread's slot");
    assert_eq!(
        h.seen.lock().wait_streams[before..],
        [DeviceStream(given as u64)],
        "one wait, on the stream of the slot the work runs on"
    );
}
