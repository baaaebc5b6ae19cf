//! `CachingServer`: a CubeCL `ComputeServer` whose device memory is the caching engine.
//!
//! The server translates CubeCL's calls and owns no placement logic. Its parts, one concern
//! each:
//! - `streams`: CubeCL stream ids mapped onto bounded slots (a new thread takes an idle slot,
//!   else `id % max_streams`), per slot a
//!   [`StreamMemory`](super::StreamMemory) (CubeCL's persistent `MemoryManagement` over the
//!   engine), the driver's stream state and the errors waiting to be reported;
//! - `reserve`: a new tensor's slice, with the out-of-memory path across streams;
//! - `failed`: the buffers whose reservation failed, which are never resolved: every later
//!   launch, write, read or copy of one returns the reservation's error, and touches no memory;
//! - `ordering`: cross-stream waits before a stream uses another stream's buffer, only when
//!   the buffer is newer than the two streams' last sync; and the other way, another stream's
//!   buffer held after a use until an event recorded after it completed (PyTorch's
//!   `recordStream`), so that no layer hands its memory to new work too early;
//! - `metadata`: kernel scalars and metadata as the driver takes them, uploaded into a
//!   per-stream scratch without a device allocation per launch;
//! - `checks`: what does not depend on the device API (layouts, sizes, empty launches), once
//!   for every backend;
//! - `kernels`: the kernel cache;
//! - `layer_usage`: CubeCL's layer in numbers, for `memory_stats`;
//! - `comm`: tensors moved to another device's server and all-reduce across devices, through
//!   host memory (CubeCL's `ServerCommunication`);
//! - `peer`: the same on the device where the driver can (CUDA's peer copies and NCCL), with
//!   the blocks another device reads held until its copy completed.
//! - `caller_stack`: the layout policy that captures the caller's stack of each reservation,
//!   and the per-stream queue the reservation takes it from.
//!
//! The device API itself is the [`Driver`]'s.

mod caller_stack;
mod checks;
mod comm;
#[cfg(test)]
mod comm_tests;
mod failed;
#[cfg(test)]
mod failed_tests;
mod host_reduce;
mod kernels;
mod layer_usage;
mod metadata;
mod ordering;
mod peer;
#[cfg(test)]
mod peer_tests;
mod post;
mod reserve;
mod streams;
#[cfg(test)]
mod tests;

pub use caller_stack::CallerStackPolicy;
pub(crate) use checks::is_contiguous;
pub use layer_usage::CubeclLayerUsage;

use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::{DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl_common::future::DynFut;
use cubecl_common::profile::ProfileDuration;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::compiler::CubeTask;
use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage};
use cubecl_runtime::server::{
    Binding, ComputeServer, CopyDescriptor, CubeCount, ExecutionMode, IoError, KernelArguments,
    ProfileError, ProfilingToken, ServerError, ServerUtilities,
};
use cubecl_runtime::storage::ManagedResource;
use cubecl_runtime::timestamp_profiler::TimestampProfiler;
use parking_lot::Mutex;

use super::driver::{Driver, Launch, LaunchCount, MetadataLayout, Resource};
use super::env::{oom_snapshot_path, sets_expandable_segments, startup_config};
use super::error::DriverError;
use super::registry::{self, DeviceEntry};
use super::stream_memory::FreeSlices;
use crate::alloc::{
    AllocatorConfig, CachedAbove, CachingAllocator, ConfigError, MemPoolId, ObserverThread, Stack,
    Tag,
};
use crate::device::DeviceMemory as _;
use caller_stack::CallerStacks;
use kernels::KernelCache;
use ordering::{
    BufferUse, ForeignUse, PendingUses, SliceKey, hold_until_done, note_rewrites, order_after,
    order_after_uses, release_completed, synchronize_uses,
};
use streams::Streams;

/// A CubeCL compute server over driver `D`, allocating through the caching engine.
///
/// CubeCL creates one per device (`DeviceService::init`), taking then the configuration
/// `backend::configure` left for the device, else `BURN_CACHING_ALLOC_CONF`, and
/// `BURN_CACHING_ALLOC_TRACE`.
pub struct CachingServer<D: Driver> {
    driver: D,
    device: DeviceId,
    allocator: Arc<CachingAllocator<D::Memory>>,
    max_binding_size: Option<u64>,
    metadata_layout: MetadataLayout,
    streams: Streams<D>,
    /// Other streams' buffers used on a stream, held until the use completed.
    uses: PendingUses<D::Event>,
    kernels: KernelCache<D>,
    profiler: TimestampProfiler,
    cubecl_usage: Arc<Mutex<CubeclLayerUsage>>,
    caller_stacks: Arc<CallerStacks>,
    utilities: Arc<ServerUtilities<Self>>,
    comm: comm::CommState,
}

impl<D: Driver> core::fmt::Debug for CachingServer<D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CachingServer")
            .field("device", &self.device)
            .field("streams", &self.streams.len())
            .field("max_streams", &self.streams.max_streams())
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

impl<D: Driver> CachingServer<D> {
    /// A server over an opened driver, with an engine configured by `config` over the driver's
    /// device memory ([`Driver::memory`], asked once here). CubeCL stream ids map onto
    /// `streaming.max_streams` slots of CubeCL's configuration (128 by default), as on CubeCL's
    /// own servers; onto one on a driver with one queue ([`Driver::SINGLE_QUEUE`]). A
    /// configuration the device cannot serve is the engine's
    /// [`ConfigError::Unsupported`] (see [`CachingAllocator::new`]).
    pub fn new(driver: D, device: DeviceId, config: AllocatorConfig) -> Result<Self, ConfigError> {
        Self::with_device_defaults(driver, device, config, false)
    }

    /// [`CachingServer::new`], with `expandable_segments` turned on when
    /// `expandable_by_default` and the device supports virtual memory (CUDA devices with
    /// virtual memory management): the default when the configuration does not set the key.
    fn with_device_defaults(
        mut driver: D,
        device: DeviceId,
        mut config: AllocatorConfig,
        expandable_by_default: bool,
    ) -> Result<Self, ConfigError> {
        let properties = driver.properties();
        let memory_properties: MemoryDeviceProperties = properties.memory.clone();
        let memory = driver.memory();
        // Without caching every request is an allocation of its own: no expandable segments.
        if expandable_by_default
            && !config.no_cuda_memory_caching
            && memory.virtual_memory_granularity().is_some()
        {
            config.expandable_segments = true;
        }
        let host = driver.pinned_host_pool(&config.pinned);
        let allocator = Arc::new(CachingAllocator::new(memory, config)?);
        allocator.set_device_index(device.index_id);
        allocator.dump_snapshot_on_oom(oom_snapshot_path());
        // Requests run inside the server's task: observers run where they may call back into
        // the server (statistics, `empty_cache`) like any other thread.
        allocator.set_observer_thread(ObserverThread::Own);
        let cubecl_usage = Arc::new(Mutex::new(CubeclLayerUsage::default()));
        // The engine's own registry too: readers that know no Burn (the replay's tools, another
        // integration in the process) find it there, as long as this server lives.
        caching_alloc_engine::registry::register(
            caching_alloc_engine::registry::DeviceKey::new(D::NAME, u32::from(device.index_id)),
            &allocator,
        );
        registry::register(
            device,
            DeviceEntry {
                allocator: allocator.clone(),
                cubecl: cubecl_usage.clone(),
                host,
            },
        );
        let caller_stacks = Arc::new(CallerStacks::default());
        let layout = CallerStackPolicy::new(
            memory_properties.alignment as usize,
            allocator.clone(),
            caller_stacks.clone(),
        );
        let logger = Arc::new(ServerLogger::default());
        let utilities = ServerUtilities::new(properties, logger, driver.info(), layout);
        let max_streams = CubeClRuntimeConfig::get().streaming.max_streams as usize;
        Ok(Self {
            max_binding_size: driver.max_binding_size(),
            metadata_layout: driver.metadata_layout(),
            streams: Streams::new(allocator.clone(), memory_properties, max_streams),
            uses: PendingUses::default(),
            driver,
            device,
            allocator,
            kernels: KernelCache::new(),
            profiler: TimestampProfiler::default(),
            cubecl_usage,
            caller_stacks,
            utilities: Arc::new(utilities),
            comm: comm::CommState::default(),
        })
    }

    /// What CubeCL's `DeviceService::init` does, with the reason as an error: the configuration
    /// given in code (`backend::configure`) if any, else `BURN_CACHING_ALLOC_CONF`; the driver
    /// opened; the server over it ([`CachingServer::new`]), with expandable segments on where
    /// the device has virtual memory and the configuration did not choose.
    pub(crate) fn open(device_id: DeviceId) -> Result<Self, DriverError> {
        let configured = registry::take_config::<D::Memory>(device_id);
        let source = if configured.is_some() {
            "backend::configure"
        } else {
            crate::alloc::CONFIG_ENV
        };
        // Expandable segments are the default where the device has virtual memory, unless the
        // configuration chose (see `env::sets_expandable_segments`).
        let chosen = configured.is_some() || sets_expandable_segments();
        let config = startup_config(configured)?;
        let driver = D::open(device_id)?;
        Self::with_device_defaults(driver, device_id, config, !chosen).map_err(|source_err| {
            DriverError::Config {
                var: source,
                source: source_err,
            }
        })
    }

    /// The same server with CubeCL stream ids mapped onto `max_streams` slots (at least one):
    /// threads whose ids share a slot share its driver stream and its cached memory. Only
    /// before the server's first use; afterwards the bound stays. A driver with one queue
    /// ([`Driver::SINGLE_QUEUE`]) keeps one slot whatever is asked.
    pub fn with_max_streams(mut self, max_streams: usize) -> Self {
        if !self.streams.set_max_streams(max_streams) {
            log::warn!("caching allocator: max_streams is fixed once a stream was used");
        }
        self
    }

    /// How many slots CubeCL stream ids map onto.
    pub fn max_streams(&self) -> usize {
        self.streams.max_streams()
    }

    /// How many stream slots have been used (each one a driver stream and an engine stream).
    pub fn streams_in_use(&self) -> usize {
        self.streams.len()
    }

    /// The engine this server allocates through.
    pub fn allocator(&self) -> &Arc<CachingAllocator<D::Memory>> {
        &self.allocator
    }

    /// The driver and a stream's driver state, borrowed together.
    fn split(&mut self, id: StreamId) -> (&mut D, &mut D::Stream) {
        let stream = self.streams.get(&mut self.driver, id);
        (&mut self.driver, &mut stream.driver)
    }

    fn push_error(&mut self, stream: StreamId, error: ServerError) {
        self.streams.push_error(&mut self.driver, stream, error);
    }

    fn take_errors(&mut self, stream: StreamId) -> Result<(), ServerError> {
        self.streams.take_errors(&mut self.driver, stream)
    }

    /// Orders later work on `consumer` after the producers of the buffers in `uses`, and its
    /// work on its own buffers after other streams' uses of them not completed yet.
    fn order_after(&mut self, consumer: StreamId, uses: &[BufferUse]) -> Result<(), ServerError> {
        order_after(&mut self.driver, &mut self.streams, consumer, uses)?;
        order_after_uses(
            &mut self.driver,
            &mut self.streams,
            &mut self.uses,
            consumer,
            uses,
        )
    }

    /// Counts one more operation issued on `stream`'s slot; returns the new cursor.
    fn advance(&mut self, stream: StreamId) -> u64 {
        let stream = self.streams.get(&mut self.driver, stream);
        stream.cursor += 1;
        stream.cursor
    }

    /// Counts the block behind `memory`, just reserved on `stream`, under `scope`.
    fn retag_reserved(
        &mut self,
        memory: ManagedMemoryHandle,
        stream: StreamId,
        scope: Option<Tag>,
    ) {
        let manager = self.streams.get(&mut self.driver, stream).memory.manager();
        match manager.get_storage(memory.binding()) {
            Ok(storage) => manager.storage().retag(storage.id, scope),
            Err(err) => log::warn!("caching allocator: a reservation has no slice: {err}"),
        }
    }

    /// Sends `stream`'s next reservations to private pool `pool` (`None`: the allocator's own).
    fn route_to_pool(&mut self, stream: StreamId, pool: Option<MemPoolId>) {
        let memory = &mut self.streams.get(&mut self.driver, stream).memory;
        memory.manager().storage().set_mem_pool(pool);
    }

    /// `memory`'s reservation of `size` bytes on `stream` failed with `error`: if it is still
    /// unbound, every later use of it returns `error` (see `failed`).
    fn keep_failure(
        &mut self,
        memory: &ManagedMemoryHandle,
        size: u64,
        stream: StreamId,
        error: &ServerError,
    ) {
        let stream = self.streams.get(&mut self.driver, stream);
        if !stream.memory.is_bound(memory) {
            stream.failed.record(memory.clone(), size, error.clone());
        }
    }

    /// Resolves a binding through the manager of the stream that created it. A buffer whose
    /// reservation failed has no memory: refused with that failure's error.
    fn resolve(&mut self, binding: Binding) -> Result<Resource<D>, ServerError> {
        self.resolve_slice(binding).map(|(resource, _)| resource)
    }

    /// [`resolve`](Self::resolve), with the slice the binding is bound to.
    fn resolve_slice(&mut self, binding: Binding) -> Result<(Resource<D>, SliceKey), ServerError> {
        let Binding {
            memory,
            offset_start,
            offset_end,
            stream,
            size,
        } = binding;
        let slot = self.streams.get(&mut self.driver, stream);
        let Some(slice) = slot.memory.bound_slice(&memory)? else {
            return Err(slot.failed.error_for(size));
        };
        let manager = slot.memory.manager();
        let key = SliceKey::of(&slice);
        // The stream reserves sizes padded to CubeCL's alignment (`StreamMemory`, "Padded
        // sizes"): the handle covers the bytes it asked for, its binding's size, not the
        // padding after them.
        let slice = slice.size();
        let offset_end = match slice.checked_sub(size) {
            Some(padding) if padding > 0 => Some(offset_end.unwrap_or(0).saturating_add(padding)),
            _ => offset_end,
        };
        // CubeCL's `StorageHandle::offset_start`/`offset_end` subtract unchecked: offsets past
        // the slice would wrap its size and resolve outside the block. Refused here.
        let inside = offset_start
            .unwrap_or(0)
            .checked_add(offset_end.unwrap_or(0))
            .is_some_and(|cut| cut <= slice);
        if !inside {
            return Err(ServerError::Io(IoError::Unknown {
                description: format!(
                    "caching allocator: handle offsets (start {offset_start:?}, end \
                     {offset_end:?}) fall outside its {slice}-byte slice"
                ),
                backtrace: BackTrace::capture(),
            }));
        }
        Ok((manager.get_resource(memory, offset_start, offset_end)?, key))
    }

    /// Resolves a binding that work on `consumer` uses and tells which stream produced it, and
    /// when; for a buffer of another stream slot, also a clone of the binding, to hold until
    /// the use has completed ([`PendingUses`]).
    fn resolve_use(
        &mut self,
        binding: Binding,
        consumer: StreamId,
    ) -> Result<(Resource<D>, BufferUse, Option<ForeignUse>), ServerError> {
        let stream = binding.stream;
        let memory = binding.memory.clone();
        // First: a buffer whose reservation failed is refused before anything reads its slice.
        let (resource, slice) = self.resolve_slice(binding)?;
        let cursor = self
            .streams
            .peek(&mut self.driver, stream)
            .memory
            .manager()
            .get_cursor(memory.clone())?;
        // The consumer's slot as assigned (a new thread gets its slot here, not CubeCL's).
        let consumer_slot = self.streams.assign_slot(consumer);
        let foreign = (self.streams.slot(stream) != consumer_slot).then_some(ForeignUse {
            binding: memory,
            slice,
        });
        let used = BufferUse {
            stream,
            cursor,
            slice,
        };
        Ok((resource, used, foreign))
    }

    /// Work on `consumer` that used the foreign buffers `foreign` was issued: holds them until
    /// an event recorded now on `consumer` has completed.
    fn hold_until_done(
        &mut self,
        consumer: StreamId,
        foreign: Vec<ForeignUse>,
    ) -> Result<(), ServerError> {
        hold_until_done(
            &mut self.driver,
            &mut self.streams,
            &mut self.uses,
            consumer,
            foreign,
        )
    }

    /// How many events of cross-stream uses are pending, and how many buffers they hold.
    #[cfg(test)]
    fn pending_uses(&self) -> (usize, usize) {
        (self.uses.events(), self.uses.held())
    }

    /// Hands every free CubeCL slice of every stream back to the engine (and the streams'
    /// metadata scratch, which the next launch that needs one reserves again), so that the
    /// engine's allocated blocks are exactly the live tensors' slices: what the user API
    /// reports as PyTorch's "allocated". Returns CubeCL's layer as it was just before, so that
    /// what CubeCL had cached can still be reported. Nothing goes back to the device: the
    /// slices become free engine blocks, reserved and cached by the engine.
    pub fn hand_back_free_slices(&mut self) -> CubeclLayerUsage {
        // Buffers held for other streams or peers whose work has completed are free too (a
        // staging block once the peer's copy is done): a reading counts what is still in use.
        if let Err(err) = release_completed(&mut self.driver, &mut self.uses) {
            log::error!("caching allocator: polling cross-stream uses failed: {err}");
        }
        let before = self.cubecl_layer();
        for id in self.streams.ids() {
            // As for `memory_cleanup`: the work submitted so far is issued before its slices
            // may serve other tensors. A reading touches no slot: it says nothing of whether
            // the slot's threads are still there.
            let stream = self.streams.peek(&mut self.driver, id);
            if let Err(err) = self.driver.flush(&mut stream.driver) {
                stream.push_error(err);
            }
            stream.metadata = None;
            // Outside the reclaim policy: a reading neither counts as the workload's reclaim
            // work nor moves the marks the policy decides the next walks by.
            stream.memory.hand_back();
        }
        self.cubecl_layer();
        before
    }

    /// CubeCL's layer now, with the engine blocks of every stream's free slices named in the
    /// returned [`CachedAbove`], for a reading: nothing is handed back, flushed or polled, so
    /// every later decision is the one a run without the reading makes (see "Readings" in
    /// `runtime/stream_memory/mod.rs`).
    pub fn free_slices(&mut self) -> (CubeclLayerUsage, CachedAbove) {
        let mut cached = CachedAbove::default();
        let mut found = FreeSlices::default();
        // Staging blocks whose peer copy is done: the next reservation's poll releases them.
        let driver = &mut self.driver;
        let finished = self
            .uses
            .finished_peer_blocks(|event| matches!(driver.query_event(event), Ok(true)));
        for block in finished {
            if let Some(stream) = self.streams.existing(block.stream) {
                stream.memory.name_cached(&block.memory, &mut cached);
            }
        }
        for stream in self.streams.all_mut() {
            // The launches' metadata scratch is the server's, no tensor's: cache too.
            if let Some(scratch) = &stream.metadata {
                stream
                    .memory
                    .name_cached(&scratch.handle.memory, &mut cached);
            }
            let more = stream.memory.free_slices(&mut cached);
            found.listed += more.listed;
            found.bytes += more.bytes;
            found.unlisted += more.unlisted;
        }
        if found.unlisted > 0 {
            log::warn!(
                "caching allocator: {} free CubeCL slices could not be named; their blocks read \
                 as allocated",
                found.unlisted
            );
        }
        let mut layer = self.cubecl_layer();
        layer.free_slices = found.listed;
        layer.free_slice_bytes = found.bytes;
        *self.cubecl_usage.lock() = layer;
        (layer, cached)
    }

    /// Sums CubeCL's view over all streams and refreshes the registry's copy.
    fn cubecl_layer(&mut self) -> CubeclLayerUsage {
        let mut layer = CubeclLayerUsage::default();
        for stream in self.streams.all() {
            layer.add_stream(&stream.memory.usage(), stream.memory.counters());
        }
        layer.slot_reuses = self.streams.reuses();
        *self.cubecl_usage.lock() = layer;
        layer
    }
}

fn ready<T: Send + 'static>(value: T) -> DynFut<T> {
    Box::pin(async move { value })
}

impl<D: Driver> DeviceService for CachingServer<D> {
    fn init(device_id: DeviceId) -> Self {
        // Reached only when a device is opened without `open::ensure_open` (which builds the
        // server on the caller's thread and returns why it cannot open): CubeCL gives this
        // call no way to fail, so a device that cannot be opened stops here with the reason.
        Self::open(device_id)
            .unwrap_or_else(|err| panic!("caching allocator: cannot open {device_id}: {err}"))
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl<D: Driver> ComputeServer for CachingServer<D> {
    type Kernel = Box<dyn CubeTask<D::Compiler>>;
    type Info = D::Info;
    type MemoryLayoutPolicy = CallerStackPolicy<D::Memory>;
    type Storage = super::storage::EngineStorage<D::Memory>;

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, stream_id: StreamId) {
        // The stack the policy captured on the caller's thread for this reservation (taken
        // even if the reservation fails, so the next one pairs with its own).
        let caller = self.caller_stacks.take(stream_id, size).unwrap_or_default();
        // The caller's private pool, for this reservation only (see `backend::use_mem_pool`).
        let pool = caller.pool.filter(|&pool| {
            let live = self.allocator.pool_options(pool).is_ok();
            if !live {
                log::warn!(
                    "caching allocator: a reservation of {size} bytes routed to {pool}, which \
                     is released: it goes to the allocator's own pools"
                );
            }
            live
        });
        let retag = Tag::ever_used().then(|| memory.clone());
        let failed = memory.clone();
        // Only a routed reservation touches the stream's storage here: every other one finds
        // it on the allocator's own pools already, and a lookup counts as an operation of the
        // stream (its idle-slot bookkeeping).
        if pool.is_some() {
            self.route_to_pool(stream_id, pool);
        }
        let bound = Tag::serving(caller.scope.clone(), || {
            Stack::serving(caller.stack, || self.reserve_bound(memory, size, stream_id))
        });
        if pool.is_some() {
            self.route_to_pool(stream_id, None);
        }
        match bound {
            // The handle stays unbound: every later use of it returns this error, and the next
            // `read`, `sync` or `flush` of the stream reports it.
            Err(err) => {
                self.keep_failure(&failed, size, stream_id, &err);
                self.push_error(stream_id, err);
            }
            // CubeCL may have handed the caller a slice another request left free: its block
            // is counted under this request's scope from now on.
            Ok(()) => {
                if let Some(memory) = retag {
                    self.retag_reserved(memory, stream_id, caller.scope);
                }
            }
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
        stream_id: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        if let Err(err) = self.take_errors(stream_id) {
            return ready(Err(err));
        }
        let mut sources = Vec::with_capacity(descriptors.len());
        let mut uses = Vec::with_capacity(descriptors.len());
        let mut foreign = Vec::new();
        // The sources stay alive until their copies completed (as stock cubecl-cuda keeps
        // them): the future holds their bindings, so no layer hands their memory out before.
        let mut keep = Vec::with_capacity(descriptors.len());
        for desc in descriptors {
            if let Err(err) = checks::contiguous(&desc.shape, &desc.strides) {
                return ready(Err(err));
            }
            let bytes = match checks::tensor_bytes(&desc.shape, desc.elem_size) {
                Ok(bytes) => bytes,
                Err(err) => return ready(Err(err)),
            };
            keep.push(desc.handle.memory.clone());
            match self.resolve_use(desc.handle, stream_id) {
                Ok((resource, used, other)) => {
                    sources.push((resource, bytes));
                    uses.push(used);
                    foreign.extend(other);
                }
                Err(err) => return ready(Err(err)),
            }
        }
        if let Err(err) = self.order_after(stream_id, &uses) {
            return ready(Err(err));
        }
        let (driver, driver_stream) = self.split(stream_id);
        // SAFETY: every source was resolved from a live handle above, and `keep` holds their
        // bindings in the future, so no layer hands their memory out before the copy completed.
        let copied = unsafe { driver.read(driver_stream, sources) };
        // Another stream's buffer read here is held until an event after the copy completed,
        // even if the future is dropped unawaited.
        if let Err(err) = self.hold_until_done(stream_id, foreign) {
            self.push_error(stream_id, err);
        }
        Box::pin(async move {
            let bytes = copied.await;
            drop(keep);
            bytes
        })
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, stream_id: StreamId) {
        for (desc, data) in descriptors {
            if let Err(err) = self.write_one(desc, &data, stream_id) {
                self.push_error(stream_id, err);
            }
        }
    }

    fn sync(&mut self, stream_id: StreamId) -> DynFut<Result<(), ServerError>> {
        if let Err(err) = self.take_errors(stream_id) {
            return ready(Err(err));
        }
        let (driver, driver_stream) = self.split(stream_id);
        driver.sync(driver_stream)
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        stream_id: StreamId,
    ) -> Result<ManagedResource<Resource<D>>, ServerError> {
        let memory = binding.memory.clone();
        let (resource, used, foreign) = self.resolve_use(binding, stream_id)?;
        self.order_after(stream_id, &[used])?;
        // The caller may write the buffer: as a launch would.
        note_rewrites(&mut self.streams, stream_id, &[used]);
        self.advance(stream_id);
        let (driver, driver_stream) = self.split(stream_id);
        driver.expose(driver_stream, &resource);
        driver.flush(driver_stream)?;
        // What the caller issues with the raw resource later is its own to order (as with
        // PyTorch's `data_ptr`); the work on this stream so far is covered.
        self.hold_until_done(stream_id, foreign.into_iter().collect())?;
        Ok(ManagedResource::new(memory, resource))
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) {
        // SAFETY: the caller of `ComputeServer::launch` upholds the kernel's safety contract.
        let launched = unsafe { self.launch_one(kernel, count, args, mode, stream_id) };
        if let Err(err) = launched {
            self.push_error(stream_id, err);
        }
    }

    fn flush(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        let (driver, driver_stream) = self.split(stream_id);
        let flushed = driver.flush(driver_stream);
        self.take_errors(stream_id)?;
        flushed
    }

    fn memory_usage(&mut self, _stream_id: StreamId) -> Result<MemoryUsage, ServerError> {
        // Buffers other streams have finished with are no longer in use.
        if let Err(err) = release_completed(&mut self.driver, &mut self.uses) {
            log::error!("caching allocator: polling cross-stream uses failed: {err}");
        }
        // PyTorch's meanings, device-wide: in use = bytes of live tensors (all streams),
        // reserved = the engine's segments.
        let layer = self.cubecl_layer();
        Ok(MemoryUsage {
            number_allocs: layer.live_slices,
            bytes_in_use: layer.tensor_bytes,
            bytes_padding: layer.padding_bytes,
            bytes_reserved: self.allocator.memory_reserved(),
        })
    }

    fn memory_cleanup(&mut self, _stream_id: StreamId) {
        // PyTorch's `empty_cache` synchronises every pending event first: memory other
        // streams used comes back too once they are done with it.
        if let Err(err) = synchronize_uses(&mut self.driver, &mut self.streams, &mut self.uses) {
            log::error!("caching allocator: waiting for cross-stream uses failed: {err}");
        }
        // Every free slice and the metadata scratch go back to the engine: after `empty_cache`
        // nothing is allocated but live tensors.
        self.hand_back_free_slices();
        if let Err(err) = self.allocator.empty_cache() {
            log::error!("caching allocator: empty_cache failed: {err}");
        }
        self.cubecl_layer();
    }

    fn start_profile(&mut self, stream_id: StreamId) -> Result<ProfilingToken, ServerError> {
        cubecl_common::future::block_on(self.sync(stream_id))?;
        Ok(self.profiler.start())
    }

    fn end_profile(
        &mut self,
        stream_id: StreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        if let Err(err) = cubecl_common::future::block_on(self.sync(stream_id)) {
            self.profiler.error(ProfileError::Server(Box::new(err)));
        }
        self.profiler.stop(token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, _stream_id: StreamId) {
        // Every stream stays persistent: it is what routes each reservation to the engine.
        log::trace!("caching allocator: ignoring allocation mode {mode:?} (always persistent)");
    }
}

impl<D: Driver> CachingServer<D> {
    /// One copy into the device: checked, ordered after the buffer's producer, issued.
    fn write_one(
        &mut self,
        desc: CopyDescriptor,
        data: &[u8],
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        checks::contiguous(&desc.shape, &desc.strides)?;
        let (resource, used, foreign) = self.resolve_use(desc.handle, stream_id)?;
        if data.is_empty() {
            return Ok(());
        }
        checks::write_fits(data.len(), resource.size)?;
        self.order_after(stream_id, &[used])?;
        note_rewrites(&mut self.streams, stream_id, &[used]);
        self.advance(stream_id);
        let (driver, driver_stream) = self.split(stream_id);
        // SAFETY: `resource` was resolved from a live handle above and `data` fits it (checked);
        // the handle's binding outlives this call, and the server frees nothing before the
        // stream's work that uses it has run.
        let written = unsafe { driver.write(driver_stream, &resource, data) };
        self.hold_until_done(stream_id, foreign.into_iter().collect())?;
        written
    }

    /// One launch: the kernel from the cache, its buffers resolved and ordered after their
    /// producers, its metadata split as the driver takes it, then issued unless it runs
    /// nothing.
    ///
    /// # Safety
    /// As [`ComputeServer::launch`]: in unchecked mode the kernel may access memory out of
    /// bounds.
    unsafe fn launch_one(
        &mut self,
        kernel: Box<dyn CubeTask<D::Compiler>>,
        count: CubeCount,
        args: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        checks::no_tensor_maps(args.tensor_maps.len())?;
        let compiled = self
            .kernels
            .get(
                &mut self.driver,
                &self.utilities.properties,
                kernel.as_ref(),
                mode,
                &args,
            )
            .map_err(ServerError::Launch)?;

        let mut uses = Vec::with_capacity(args.buffers.len() + 1);
        let mut buffers = Vec::with_capacity(args.buffers.len());
        let mut foreign = Vec::new();
        for binding in args.buffers {
            let (resource, used, other) = self.resolve_use(binding, stream_id)?;
            buffers.push(resource);
            uses.push(used);
            foreign.extend(other);
        }
        let count = match count {
            CubeCount::Static(x, y, z) => LaunchCount::Static(x, y, z),
            CubeCount::Dynamic(binding) => {
                let (resource, used, other) = self.resolve_use(binding, stream_id)?;
                uses.push(used);
                foreign.extend(other);
                checks::dynamic_count(&resource)?;
                LaunchCount::Dynamic(resource)
            }
        };
        if checks::runs_nothing(&count) {
            return Ok(());
        }
        self.order_after(stream_id, &uses)?;
        // Any buffer of a launch may be written (CubeCL does not say which).
        note_rewrites(&mut self.streams, stream_id, &uses);

        let info = metadata::split(
            self.metadata_layout,
            &args.info.data,
            args.info.dynamic_metadata_offset,
        );
        let uploaded = match info.upload {
            Some(values) => Some(metadata::upload(
                &mut self.driver,
                &mut self.streams,
                &mut self.uses,
                self.max_binding_size,
                stream_id,
                values,
            )?),
            None => None,
        };
        self.advance(stream_id);
        let launch = Launch {
            kernel: compiled.as_ref(),
            count,
            buffers,
            info: info.inline,
            metadata: uploaded,
            mode,
        };
        let (driver, driver_stream) = self.split(stream_id);
        // SAFETY: forwarded from this function's contract.
        let launched = unsafe { driver.launch(driver_stream, launch) };
        self.hold_until_done(stream_id, foreign)?;
        launched
    }
}
