//! The recording driver: a `Driver` that runs nothing and records what the server asks of it,
//! on the simulated device behind `Metered`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::DynFut;
use cubecl_common::profile::TimingMethod;
use cubecl_ir::{DeviceProperties, ElemType, HardwareProperties, MemoryDeviceProperties};
use cubecl_ir::{StorageType, UIntKind, VectorSize};
use cubecl_runtime::compiler::{CompilationError, Compiler, CubeTask};
use cubecl_runtime::id::KernelId;
use cubecl_runtime::kernel::{CompiledKernel, KernelDefinition, KernelMetadata};
use cubecl_runtime::server::{ExecutionMode, KernelArguments, LaunchError, ServerError};
use parking_lot::Mutex;

use super::super::super::driver::{Driver, Launch, MetadataLayout, Resource};
use super::super::super::error::DriverError;
use crate::device::DeviceStream;
use crate::device::metered::Metered;
use crate::device::sim::SimDevice;

/// What the recording driver saw.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    pub(super) streams_created: Vec<DeviceStream>,
    /// Per launch: the inline info and the bytes of the metadata buffer at launch time.
    pub(crate) launches: Vec<(Vec<u64>, Option<Vec<u8>>)>,
    pub(super) events_recorded: usize,
    pub(super) waits: usize,
    /// The stream of every wait, in order.
    pub(super) wait_streams: Vec<DeviceStream>,
    /// The stream of every event recorded, by event id.
    pub(super) event_streams: Vec<DeviceStream>,
    /// Events the test declared complete (the others are still running).
    pub(super) completed: HashSet<u64>,
    /// `synchronize_event` calls (the host waited for an event).
    pub(crate) event_syncs: usize,
    /// Recording an event on this stream fails.
    pub(super) failing_records: Option<DeviceStream>,
    /// Device contents written so far, by (segment, offset).
    memory: HashMap<(u64, u64), Vec<u8>>,
    /// `Driver::memory` calls: how often the server opened the device memory.
    pub(super) memory_opened: usize,
    /// Whether `peer_copies` answers yes (the device path of `comm`).
    pub(crate) peer_copies: bool,
    /// Per `export`: the staging copy's source and destination locations.
    pub(crate) exports: Vec<((u64, u64), (u64, u64))>,
    /// Per `import`: the destination location and the completion event's id.
    pub(crate) imports: Vec<((u64, u64), u64)>,
    /// `import` fails (nothing copied).
    pub(crate) failing_imports: bool,
}

/// Ids of the completion events `import` returns: apart from `record_event`'s, so that a test
/// can complete them on the source's recording (where the source's server asks).
pub(crate) const PEER_EVENTS: u64 = 1 << 40;

/// What the recording driver's `export` hands the peer: the staging block's bytes.
pub(crate) struct PeerBytes(Vec<u8>);

#[derive(Debug, Clone)]
pub(crate) struct NoCompiler;

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

pub(super) struct NoKernel;

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

pub(crate) struct Recording {
    pub(super) memory: Option<Metered<SimDevice>>,
    pub(super) layout: MetadataLayout,
    pub(super) seen: Arc<Mutex<Seen>>,
}

std::thread_local! {
    /// The driver `Recording::open` hands out next on this thread (a test puts it there).
    pub(super) static NEXT_OPENED: std::cell::RefCell<Option<Recording>> = const { std::cell::RefCell::new(None) };
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
