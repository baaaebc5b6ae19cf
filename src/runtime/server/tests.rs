//! The generic server over a driver that only records what it is asked to do, on the
//! simulated device behind `Metered`: no GPU needed. These tests pin what the CUDA driver
//! relies on the server for: launch metadata without a device allocation per launch, stream
//! ids on bounded slots, and cross-stream waits only when a buffer is newer than the last
//! sync.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::DynFut;
use cubecl_common::profile::TimingMethod;
use cubecl_common::stream_id::StreamId as CubeStreamId;
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
use crate::device::StreamId;
use crate::device::metered::{Meter, Metered};
use crate::device::sim::SimDevice;

/// What the recording driver saw.
#[derive(Debug, Default)]
struct Seen {
    streams_created: Vec<StreamId>,
    /// Per launch: the inline info and the bytes of the metadata buffer at launch time.
    launches: Vec<(Vec<u64>, Option<Vec<u8>>)>,
    events_recorded: usize,
    waits: usize,
    /// Device contents written so far, by (segment, offset).
    memory: HashMap<(u64, u64), Vec<u8>>,
}

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

impl Driver for Recording {
    type Memory = Metered<SimDevice>;
    type Compiler = NoCompiler;
    type Info = ();
    type Stream = StreamId;
    type Event = ();
    type Kernel = ();

    fn open(_device: DeviceId) -> Result<Self, DriverError> {
        unreachable!("built by the tests")
    }

    fn memory(&mut self) -> Metered<SimDevice> {
        self.memory.take().expect("asked once")
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

    fn create_stream(&mut self, id: StreamId) -> StreamId {
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
        _stream: &mut StreamId,
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

    fn write(
        &mut self,
        _stream: &mut StreamId,
        dst: &Resource<Self>,
        data: &[u8],
    ) -> Result<(), ServerError> {
        self.seen
            .lock()
            .memory
            .insert((dst.segment, dst.offset), data.to_vec());
        Ok(())
    }

    fn read(
        &mut self,
        _stream: &mut StreamId,
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

    fn flush(&mut self, _stream: &mut StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn sync(&mut self, _stream: &mut StreamId) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }

    fn record_event(&mut self, _stream: &mut StreamId) -> Result<(), ServerError> {
        self.seen.lock().events_recorded += 1;
        Ok(())
    }

    fn wait_event(&mut self, _stream: &mut StreamId, _event: ()) -> Result<(), ServerError> {
        self.seen.lock().waits += 1;
        Ok(())
    }
}

pub(super) struct Harness {
    pub(super) server: CachingServer<Recording>,
    meter: Meter,
    seen: Arc<Mutex<Seen>>,
}

fn harness(layout: MetadataLayout, max_streams: usize) -> Harness {
    harness_of(layout, max_streams, 1 << 30)
}

/// A server over a simulated device of `capacity` bytes.
pub(super) fn harness_of(layout: MetadataLayout, max_streams: usize, capacity: u64) -> Harness {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let memory = Metered::new(SimDevice::new(capacity));
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
    let server = CachingServer::new(driver, device, AllocatorConfig::default())
        .with_max_streams(max_streams);
    Harness {
        server,
        meter,
        seen,
    }
}

pub(super) fn stream(value: u64) -> CubeStreamId {
    CubeStreamId { value }
}

impl Harness {
    pub(super) fn buffer(&mut self, size: u64, on: CubeStreamId) -> Handle {
        let handle = Handle::new(on, size);
        self.server
            .initialize_memory(handle.memory.clone(), size, on);
        handle
    }

    fn launch(&mut self, buffers: &[&Handle], info: MetadataBindingInfo, on: CubeStreamId) {
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
        self.server.flush(on).expect("the launch succeeded");
    }

    fn waits(&self) -> usize {
        let seen = self.seen.lock();
        assert_eq!(
            seen.events_recorded, seen.waits,
            "every event is waited for"
        );
        seen.waits
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
