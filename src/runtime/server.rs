//! `CachingServer`: a CubeCL `ComputeServer` whose device memory is the caching engine.
//!
//! The server translates CubeCL's calls and owns no placement logic. Per CubeCL stream it keeps
//! a [`StreamMemory`] (CubeCL's persistent `MemoryManagement` over the engine, with the
//! amortised reclaim policy), the driver's stream state and the stream's pending errors.
//!
//! Errors: `initialize_memory`, `write` and `launch` cannot return errors in CubeCL 0.10, so a
//! failure (out of memory after the reclaim, a kernel that does not compile, a handle that was
//! never bound because its allocation failed) is kept on the stream and returned by the next
//! `read`, `sync` or `flush` of that stream, which also clears it: the server keeps working.

use std::collections::HashMap;
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::{DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl_common::future::DynFut;
use cubecl_common::profile::ProfileDuration;
use cubecl_common::stream_id::StreamId as CubeStreamId;
use cubecl_core::zspace::{Shape, Strides};
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::allocator::ContiguousMemoryLayoutPolicy;
use cubecl_runtime::compiler::CubeTask;
use cubecl_runtime::id::KernelId;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    ManagedMemoryBinding, ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage,
};
use cubecl_runtime::server::{
    Binding, ComputeServer, CopyDescriptor, CubeCount, ExecutionMode, IoError, KernelArguments,
    ProfileError, ProfilingToken, ServerCommunication, ServerError, ServerUtilities,
};
use cubecl_runtime::storage::ManagedResource;
use cubecl_runtime::timestamp_profiler::TimestampProfiler;
use cubecl_runtime::validation::{validate_cube_dim, validate_units};
use parking_lot::Mutex;

use super::driver::{Driver, Launch, LaunchCount, Resource};
use super::reclaim::{ReclaimCounters, ReclaimPolicy, StreamMemory};
use super::registry::{self, CubeclLayerUsage, DeviceEntry};
use crate::alloc::{AllocatorConfig, CachingAllocator};
use crate::device::StreamId;

/// Environment variable naming a file the engine's trace is written to by
/// `backend::write_trace`; setting it also turns history recording on for every device opened,
/// and with it [`ReclaimPolicy::EveryReserve`], so the trace holds every tensor's reservation
/// and release.
pub const TRACE_ENV: &str = "BURN_CACHING_ALLOC_TRACE";

/// One CubeCL stream on the server.
struct ServerStream<D: Driver> {
    memory: StreamMemory<D::Memory>,
    driver: D::Stream,
    errors: Vec<ServerError>,
}

/// A CubeCL compute server over driver `D`, allocating through the caching engine.
pub struct CachingServer<D: Driver> {
    driver: D,
    device: DeviceId,
    allocator: Arc<CachingAllocator<D::Memory>>,
    memory_properties: MemoryDeviceProperties,
    max_binding_size: Option<u64>,
    streams: HashMap<CubeStreamId, ServerStream<D>>,
    kernels: HashMap<KernelId, Arc<D::Kernel>>,
    profiler: TimestampProfiler,
    cubecl_usage: Arc<Mutex<CubeclLayerUsage>>,
    utilities: Arc<ServerUtilities<Self>>,
}

impl<D: Driver> core::fmt::Debug for CachingServer<D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CachingServer")
            .field("device", &self.device)
            .field("streams", &self.streams.len())
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

/// The engine configuration every device starts with: `BURN_CACHING_ALLOC_CONF`, with history
/// recording on when `BURN_CACHING_ALLOC_TRACE` is set.
pub fn config_from_env() -> Result<AllocatorConfig, String> {
    let mut config = AllocatorConfig::from_env().map_err(|err| {
        format!("BURN_CACHING_ALLOC_CONF is not a valid allocator configuration: {err}")
    })?;
    if std::env::var_os(TRACE_ENV).is_some() {
        config.record_history = true;
    }
    Ok(config)
}

impl<D: Driver> CachingServer<D> {
    /// A server over an opened driver, with an engine configured by `config`.
    pub fn new(mut driver: D, device: DeviceId, config: AllocatorConfig) -> Self {
        let properties = driver.properties();
        let memory_properties = properties.memory.clone();
        let allocator = Arc::new(CachingAllocator::new(driver.memory(), config));
        let cubecl_usage = Arc::new(Mutex::new(CubeclLayerUsage::default()));
        registry::register(
            device,
            DeviceEntry {
                allocator: allocator.clone(),
                cubecl: cubecl_usage.clone(),
            },
        );
        let layout = ContiguousMemoryLayoutPolicy::new(memory_properties.alignment as usize);
        let logger = Arc::new(ServerLogger::default());
        let utilities = ServerUtilities::new(properties, logger, driver.info(), layout);
        Self {
            max_binding_size: driver.max_binding_size(),
            driver,
            device,
            allocator,
            memory_properties,
            streams: HashMap::new(),
            kernels: HashMap::new(),
            profiler: TimestampProfiler::default(),
            cubecl_usage,
            utilities: Arc::new(utilities),
        }
    }

    /// The engine this server allocates through.
    pub fn allocator(&self) -> &Arc<CachingAllocator<D::Memory>> {
        &self.allocator
    }

    fn stream(&mut self, id: CubeStreamId) -> &mut ServerStream<D> {
        if !self.streams.contains_key(&id) {
            // A recording engine sees every tensor: see `ReclaimPolicy::EveryReserve`.
            let policy = if self.allocator.config().record_history {
                ReclaimPolicy::EveryReserve
            } else {
                ReclaimPolicy::Amortised
            };
            let stream = ServerStream {
                memory: StreamMemory::new(
                    self.allocator.clone(),
                    StreamId(id.value),
                    &self.memory_properties,
                )
                .with_policy(policy),
                driver: self.driver.create_stream(StreamId(id.value)),
                errors: Vec::new(),
            };
            self.streams.insert(id, stream);
        }
        self.streams
            .get_mut(&id)
            .expect("the stream was inserted just above")
    }

    /// The driver and a stream's state, borrowed together.
    fn split(&mut self, id: CubeStreamId) -> (&mut D, &mut D::Stream) {
        self.stream(id);
        let stream = self
            .streams
            .get_mut(&id)
            .expect("the stream was created just above");
        (&mut self.driver, &mut stream.driver)
    }

    fn push_error(&mut self, stream: CubeStreamId, error: ServerError) {
        self.stream(stream).errors.push(error);
    }

    /// Takes the pending errors of `stream` as one error, if there are any.
    fn take_errors(&mut self, stream: CubeStreamId) -> Result<(), ServerError> {
        let errors = core::mem::take(&mut self.stream(stream).errors);
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.into_iter().next().expect("one error")),
            _ => Err(ServerError::ServerUnhealthy {
                errors,
                backtrace: BackTrace::capture(),
            }),
        }
    }

    /// Resolves a binding through the manager of the stream that created it.
    fn resolve(
        &mut self,
        memory: ManagedMemoryBinding,
        stream: CubeStreamId,
        offset_start: Option<u64>,
        offset_end: Option<u64>,
    ) -> Result<Resource<D>, IoError> {
        self.stream(stream)
            .memory
            .manager()
            .get_resource(memory, offset_start, offset_end)
    }

    fn resolve_binding(&mut self, binding: Binding) -> Result<Resource<D>, IoError> {
        self.resolve(
            binding.memory,
            binding.stream,
            binding.offset_start,
            binding.offset_end,
        )
    }

    /// Orders later work on `consumer` after the work issued so far on each of `producers`.
    fn order_after(
        &mut self,
        consumer: CubeStreamId,
        producers: &[CubeStreamId],
    ) -> Result<(), ServerError> {
        for &producer in producers {
            if producer == consumer {
                continue;
            }
            let (driver, stream) = self.split(producer);
            let event = driver.record_event(stream)?;
            let (driver, stream) = self.split(consumer);
            driver.wait_event(stream, event)?;
        }
        Ok(())
    }

    fn reserve(
        &mut self,
        size: u64,
        stream_id: CubeStreamId,
    ) -> Result<ManagedMemoryHandle, ServerError> {
        if let Some(max) = self.max_binding_size
            && size > max
        {
            return Err(ServerError::Generic {
                reason: format!(
                    "caching allocator: a buffer of {size} bytes is larger than the largest \
                     buffer a kernel can bind on this device ({max} bytes)"
                ),
                backtrace: BackTrace::capture(),
            });
        }
        let first = self.stream(stream_id).memory.reserve(size);
        let failure = match first {
            Ok(handle) => return Ok(handle),
            Err(failure) => failure,
        };
        if self.streams.len() > 1 {
            // The stream already reclaimed its own free slices; other streams' free slices
            // are engine blocks too: hand them back and try once more.
            for (id, stream) in self.streams.iter_mut() {
                if *id != stream_id {
                    stream.memory.reclaim();
                }
            }
            if let Ok(handle) = self.stream(stream_id).memory.retry_reserve(size) {
                return Ok(handle);
            }
        }
        Err(ServerError::Generic {
            reason: format!(
                "caching allocator: out of memory while reserving {size} bytes after \
                 returning every free CubeCL slice to the allocator: {failure}"
            ),
            backtrace: BackTrace::capture(),
        })
    }

    /// Sums CubeCL's view over all streams and refreshes the registry's copy.
    fn cubecl_layer(&mut self) -> CubeclLayerUsage {
        let mut layer = CubeclLayerUsage::default();
        for stream in self.streams.values() {
            let usage = stream.memory.usage();
            let counters = stream.memory.counters();
            layer.streams += 1;
            layer.live_slices += usage.number_allocs;
            layer.live_bytes += usage.bytes_in_use;
            layer.padding_bytes += usage.bytes_padding;
            layer.slice_bytes += usage.bytes_reserved;
            layer.reclaim = add_counters(layer.reclaim, counters);
        }
        *self.cubecl_usage.lock() = layer;
        layer
    }
}

fn add_counters(a: ReclaimCounters, b: ReclaimCounters) -> ReclaimCounters {
    ReclaimCounters {
        reserves: a.reserves + b.reserves,
        would_grow: a.would_grow + b.would_grow,
        reclaims: a.reclaims + b.reclaims,
        growth_reclaims: a.growth_reclaims + b.growth_reclaims,
        skipped_reclaims: a.skipped_reclaims + b.skipped_reclaims,
        oom_reclaims: a.oom_reclaims + b.oom_reclaims,
        reclaim_work: a.reclaim_work + b.reclaim_work,
    }
}

/// Whether a tensor is laid out row-major without gaps: the only layout the server copies.
pub(crate) fn is_contiguous(shape: &Shape, strides: &Strides) -> bool {
    let mut expected = 1usize;
    for (dim, stride) in shape.iter().zip(strides.iter()).rev() {
        if *dim > 1 && *stride != expected {
            return false;
        }
        expected *= *dim;
    }
    true
}

fn ready<T: Send + 'static>(value: T) -> DynFut<T> {
    Box::pin(async move { value })
}

impl<D: Driver> ServerCommunication for CachingServer<D> {
    const SERVER_COMM_ENABLED: bool = false;
}

impl<D: Driver> DeviceService for CachingServer<D> {
    fn init(device_id: DeviceId) -> Self {
        // CubeCL opens devices lazily and gives this call no way to fail: a device that cannot
        // be opened, or a configuration that does not parse, stops here with the reason.
        let config = config_from_env().unwrap_or_else(|err| panic!("{err}"));
        let driver = D::open(device_id)
            .unwrap_or_else(|err| panic!("caching allocator: cannot open {device_id}: {err}"));
        Self::new(driver, device_id, config)
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl<D: Driver> ComputeServer for CachingServer<D> {
    type Kernel = Box<dyn CubeTask<D::Compiler>>;
    type Info = D::Info;
    type MemoryLayoutPolicy = ContiguousMemoryLayoutPolicy;
    type Storage = super::storage::EngineStorage<D::Memory>;

    fn initialize_memory(
        &mut self,
        memory: ManagedMemoryHandle,
        size: u64,
        stream_id: CubeStreamId,
    ) {
        match self.reserve(size, stream_id) {
            Ok(reserved) => {
                let bound = self
                    .stream(stream_id)
                    .memory
                    .manager()
                    .bind(reserved, memory, 0);
                if let Err(err) = bound {
                    self.push_error(stream_id, ServerError::Io(err));
                }
            }
            Err(err) => self.push_error(stream_id, err),
        }
    }

    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: CubeStreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        if let Err(err) = self.take_errors(stream_id) {
            return ready(Err(err));
        }
        let mut sources = Vec::with_capacity(descriptors.len());
        let mut producers = Vec::new();
        for desc in descriptors {
            if !is_contiguous(&desc.shape, &desc.strides) {
                return ready(Err(IoError::UnsupportedStrides {
                    backtrace: BackTrace::capture(),
                }
                .into()));
            }
            let bytes = desc.shape.iter().product::<usize>() * desc.elem_size;
            if !producers.contains(&desc.handle.stream) {
                producers.push(desc.handle.stream);
            }
            match self.resolve_binding(desc.handle) {
                Ok(resource) => sources.push((resource, bytes)),
                Err(err) => return ready(Err(err.into())),
            }
        }
        if let Err(err) = self.order_after(stream_id, &producers) {
            return ready(Err(err));
        }
        let (driver, driver_stream) = self.split(stream_id);
        driver.read(driver_stream, sources)
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, stream_id: CubeStreamId) {
        for (desc, data) in descriptors {
            if !is_contiguous(&desc.shape, &desc.strides) {
                let err = IoError::UnsupportedStrides {
                    backtrace: BackTrace::capture(),
                };
                self.push_error(stream_id, err.into());
                continue;
            }
            let producer = desc.handle.stream;
            let resource = match self.resolve_binding(desc.handle) {
                Ok(resource) => resource,
                Err(err) => {
                    self.push_error(stream_id, err.into());
                    continue;
                }
            };
            if let Err(err) = self.order_after(stream_id, &[producer]) {
                self.push_error(stream_id, err);
                continue;
            }
            let (driver, driver_stream) = self.split(stream_id);
            if let Err(err) = driver.write(driver_stream, &resource, &data) {
                self.push_error(stream_id, err);
            }
        }
    }

    fn sync(&mut self, stream_id: CubeStreamId) -> DynFut<Result<(), ServerError>> {
        if let Err(err) = self.take_errors(stream_id) {
            return ready(Err(err));
        }
        let (driver, driver_stream) = self.split(stream_id);
        driver.sync(driver_stream)
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        stream_id: CubeStreamId,
    ) -> Result<ManagedResource<Resource<D>>, ServerError> {
        let producer = binding.stream;
        let memory = binding.memory.clone();
        let resource = self.resolve_binding(binding)?;
        self.order_after(stream_id, &[producer])?;
        let (driver, driver_stream) = self.split(stream_id);
        driver.flush(driver_stream)?;
        Ok(ManagedResource::new(memory, resource))
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
        stream_id: CubeStreamId,
    ) {
        let mut kernel_id = kernel.id();
        kernel_id.mode(mode);
        let compiled = match self.kernels.get(&kernel_id) {
            Some(compiled) => compiled.clone(),
            None => {
                let properties = &self.utilities.properties;
                let compiled = validate_cube_dim(properties, &kernel_id)
                    .and_then(|_| validate_units(properties, &kernel_id))
                    .and_then(|_| self.driver.compile(kernel.as_ref(), mode, &args));
                match compiled {
                    Ok(compiled) => {
                        let compiled = Arc::new(compiled);
                        self.kernels.insert(kernel_id, compiled.clone());
                        compiled
                    }
                    Err(err) => {
                        self.push_error(stream_id, ServerError::Launch(err));
                        return;
                    }
                }
            }
        };

        let mut producers = Vec::new();
        let mut buffers = Vec::with_capacity(args.buffers.len());
        for binding in args.buffers {
            if !producers.contains(&binding.stream) {
                producers.push(binding.stream);
            }
            match self.resolve_binding(binding) {
                Ok(resource) => buffers.push(resource),
                Err(err) => {
                    self.push_error(stream_id, err.into());
                    return;
                }
            }
        }
        let count = match count {
            CubeCount::Static(x, y, z) => LaunchCount::Static(x, y, z),
            CubeCount::Dynamic(binding) => {
                if !producers.contains(&binding.stream) {
                    producers.push(binding.stream);
                }
                match self.resolve_binding(binding) {
                    Ok(resource) => LaunchCount::Dynamic(resource),
                    Err(err) => {
                        self.push_error(stream_id, err.into());
                        return;
                    }
                }
            }
        };
        if let Err(err) = self.order_after(stream_id, &producers) {
            self.push_error(stream_id, err);
            return;
        }

        let launch = Launch {
            kernel: compiled.as_ref(),
            count,
            buffers,
            info: &args.info.data,
            mode,
        };
        let (driver, driver_stream) = self.split(stream_id);
        // SAFETY: the caller of `ComputeServer::launch` upholds the kernel's safety contract.
        let launched = unsafe { driver.launch(driver_stream, launch) };
        if let Err(err) = launched {
            self.push_error(stream_id, err);
        }
    }

    fn flush(&mut self, stream_id: CubeStreamId) -> Result<(), ServerError> {
        let (driver, driver_stream) = self.split(stream_id);
        let flushed = driver.flush(driver_stream);
        self.take_errors(stream_id)?;
        flushed
    }

    fn memory_usage(&mut self, _stream_id: CubeStreamId) -> Result<MemoryUsage, ServerError> {
        // PyTorch's meanings, device-wide: in use = bytes of live tensors (all streams),
        // reserved = the engine's segments.
        let layer = self.cubecl_layer();
        let stats = self.allocator.stats();
        Ok(MemoryUsage {
            number_allocs: layer.live_slices,
            bytes_in_use: layer.live_bytes,
            bytes_padding: layer.padding_bytes,
            bytes_reserved: stats.memory_reserved(),
        })
    }

    fn memory_cleanup(&mut self, _stream_id: CubeStreamId) {
        let ids: Vec<CubeStreamId> = self.streams.keys().copied().collect();
        for id in ids {
            let (driver, driver_stream) = self.split(id);
            if let Err(err) = driver.flush(driver_stream) {
                self.push_error(id, err);
            }
            self.stream(id).memory.reclaim();
        }
        if let Err(err) = self.allocator.empty_cache() {
            log::error!("caching allocator: empty_cache failed: {err}");
        }
        self.cubecl_layer();
    }

    fn start_profile(&mut self, stream_id: CubeStreamId) -> Result<ProfilingToken, ServerError> {
        cubecl_common::future::block_on(self.sync(stream_id))?;
        Ok(self.profiler.start())
    }

    fn end_profile(
        &mut self,
        stream_id: CubeStreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        if let Err(err) = cubecl_common::future::block_on(self.sync(stream_id)) {
            self.profiler.error(ProfileError::Server(Box::new(err)));
        }
        self.profiler.stop(token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, _stream_id: CubeStreamId) {
        // Every stream stays persistent: it is what routes each reservation to the engine.
        log::trace!("caching allocator: ignoring allocation mode {mode:?} (always persistent)");
    }
}
