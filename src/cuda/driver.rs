//! The CUDA [`Driver`]: kernels from cubecl-cpp through NVRTC, one CUDA stream per CubeCL
//! stream, launches with the device pointers the server resolved, pinned staging for copies.
//!
//! Every call first makes the device's primary context current on the calling thread (CubeCL
//! may call the server from any thread). CUDA runs a stream's work in issue order, which is
//! the ordering contract of [`Driver`]; work is submitted when issued, so `flush` has nothing
//! to submit and only returns finished staging buffers to their pool.
//!
//! Kernel metadata is passed as `cubecl-cuda` passes it: from sm_70, scalars and static
//! metadata by value (`__grid_constant__`), the dynamic metadata, when a kernel has any, in the
//! stream's metadata scratch that the server fills ([`MetadataLayout::GridConstant`]); before
//! sm_70, all of it in that scratch ([`MetadataLayout::DeviceBuffer`]). No launch allocates.
//!
//! Every launch and copy is counted on the stream table once it is issued (failed or not), so
//! the device memory synchronises before freeing segments only when work was issued since its
//! last synchronisation (once per release batch). Counted before issuing, a release on another
//! thread could read the count, synchronise, and then see the work issued after its sync as
//! covered. Memory handed out through `get_resource` may be used by work the driver never
//! sees: from then on every release synchronises ([`CudaStreams::note_foreign_work`]).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Once};

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::DynFut;
use cubecl_ir::{DeviceProperties, ElemType};
use cubecl_runtime::compiler::CubeTask;
use cubecl_runtime::server::{
    ExecutionMode, KernelArguments, LaunchError, ReduceOperation, ServerError,
};
use cudarc::driver::CudaContext;
use cudarc::driver::result;
use cudarc::driver::sys;

use super::events::PREWARMED_EVENTS;
use super::events::{EventPool, PooledEvent};
use super::headers;
use super::in_flight::{self, PendingWrites, RawStream, Unfenced};
use super::kernel::{self, CudaCppCompiler, CudaKernel};
use super::memory::CudaMemory;
use super::nccl::{self, Group, Reduce};
use super::peer::{self, CudaPeerBuffer, PeerAccess};
use super::probe::open_context;
use super::properties::{self, CudaDeviceSetup};
use super::staging::{MAX_PINNED_TRANSFER, StagingPool};
use super::streams::CudaStreams;
use crate::alloc::PinnedHostConfig;
use crate::device::DeviceStream;
use crate::runtime::{
    Collective, Communication, DeviceReduce, Driver, DriverError, Launch, LaunchCount,
    MetadataLayout, PinnedHostPool, Resource, communication,
};

/// Writes up to this size copy from pageable memory, which the driver stages at once: pinned
/// staging pays off only for larger copies, and a launch's metadata is a few hundred bytes.
const MAX_INLINE_WRITE: usize = 64 << 10;

fn generic(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}

/// A failed CUDA call, typed, as CubeCL's error.
fn cuda_failure(call: &'static str, err: result::DriverError) -> ServerError {
    DriverError::call("CUDA", call, format!("{:?}", err.0)).into()
}

/// Driver state of a CubeCL stream: its CUDA stream.
#[derive(Debug)]
pub struct CudaStream {
    id: DeviceStream,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a driver handle usable from any thread with its context current; the
// stream table keeps it alive as long as the driver.
unsafe impl Send for CudaStream {}

impl CudaStream {
    /// The engine's name of the stream.
    pub fn id(&self) -> DeviceStream {
        self.id
    }
}

/// CUDA as the caching server drives it.
#[derive(Debug)]
pub struct CudaDriver {
    context: Arc<CudaContext>,
    streams: Arc<CudaStreams>,
    events: Arc<EventPool>,
    staging: Arc<StagingPool>,
    pending_writes: PendingWrites,
    memory: Option<CudaMemory>,
    setup: CudaDeviceSetup,
    /// NVRTC's `--include-path=` options for CUDA's headers, found when the device opened.
    include_options: Vec<String>,
    /// The peers' primary contexts, retained from `comm_init` on (copies name them).
    peers: HashMap<u16, Arc<CudaContext>>,
    /// The devices granted access to this device's expandable-segment pages.
    peer_access: Arc<PeerAccess>,
    /// The NCCL groups this device used, with its rank in each.
    groups: HashMap<Vec<DeviceId>, (Arc<Group>, usize)>,
}

// SAFETY: every raw handle inside is a driver handle usable from any thread once the context
// is current, and every method binds the context first.
unsafe impl Send for CudaDriver {}

impl CudaDriver {
    /// The device's compute capability, `major * 10 + minor`.
    pub fn arch(&self) -> u32 {
        self.setup.arch
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.setup.name
    }

    fn bind(&self) -> Result<(), ServerError> {
        self.context
            .bind_to_thread()
            .map_err(|err| cuda_failure("cuCtxSetCurrent", err))
    }

    fn record(&self, stream: &CudaStream) -> Result<PooledEvent, ServerError> {
        // SAFETY: the stream is live for as long as the stream table, which the driver holds.
        unsafe { self.events.record(stream.raw) }.map_err(|err| DriverError::from(err).into())
    }

    /// Copies `bytes` bytes from the device to pageable host memory. Issued on `stream`; the
    /// driver returns only once the copy is done.
    fn read_pageable(
        &self,
        stream: &CudaStream,
        src: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<Vec<u8>, ServerError> {
        let mut host = vec![0u8; bytes];
        // SAFETY: `src` addresses at least `bytes` bytes of a live block (checked by the
        // caller); `host` holds `bytes` bytes.
        unsafe { result::memcpy_dtoh_async(&mut host, src, stream.raw) }
            .map_err(|err| cuda_failure("cuMemcpyDtoHAsync", err))?;
        // Pageable destinations are copied synchronously; synchronise anyway so the data is
        // complete whatever the driver version does.
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(stream.raw) }
            .map_err(|err| cuda_failure("cuStreamSynchronize", err))?;
        Ok(host)
    }

    /// Returns finished staging buffers to their pool; a copy whose completion the driver
    /// cannot report is an error (its buffers are abandoned, see `in_flight`).
    fn collect_writes(&mut self) -> Result<(), ServerError> {
        self.pending_writes
            .collect()
            .map_err(|err| DriverError::from(err).into())
    }
}

fn device_pointer(resource: &Resource<CudaDriver>) -> sys::CUdeviceptr {
    resource.segment + resource.offset
}

/// The pointer parameters of a launch, as cubecl-cpp compiles the kernel's signature: the
/// buffers in binding order, then the metadata buffer when there is one (all the info before
/// sm_70, the dynamic metadata from sm_70).
fn pointer_arguments(
    buffers: &[Resource<CudaDriver>],
    metadata: Option<&Resource<CudaDriver>>,
) -> Vec<sys::CUdeviceptr> {
    let mut arguments: Vec<sys::CUdeviceptr> = buffers.iter().map(device_pointer).collect();
    arguments.extend(metadata.map(device_pointer));
    arguments
}

/// `cuLaunchKernel`'s parameter array: a pointer to each pointer argument, then the info struct
/// by value (`__grid_constant__`) when the kernel has one, which is exactly when the inline
/// info (scalars and static metadata) is not empty.
fn kernel_params(arguments: &mut [sys::CUdeviceptr], info: &[u64]) -> Vec<*mut c_void> {
    let mut params: Vec<*mut c_void> = arguments
        .iter_mut()
        .map(|argument| argument as *mut sys::CUdeviceptr as *mut c_void)
        .collect();
    if !info.is_empty() {
        params.push(info.as_ptr() as *mut c_void);
    }
    params
}

impl Driver for CudaDriver {
    const NAME: &'static str = "cuda";
    type Memory = CudaMemory;
    type Compiler = CudaCppCompiler;
    type Info = ();
    type Stream = CudaStream;
    type Event = PooledEvent;
    type Kernel = CudaKernel;
    type PeerBuffer = CudaPeerBuffer;

    fn open(device: DeviceId) -> Result<Self, DriverError> {
        let ordinal = device.index_id as usize;
        // Without CUDA's headers no kernel compiles: say so now, naming CUDA_PATH.
        let include_options = headers::include_dirs()?
            .into_iter()
            .map(|dir| format!("--include-path={}", dir.display()))
            .collect();
        let context = open_context(ordinal)?;
        let streams = CudaStreams::counted(context.clone());
        let memory = CudaMemory::with_streams(streams.clone())?;
        let peer_access = memory.peer_access();
        let setup = properties::probe(&context, memory.total_memory())?;
        let events = EventPool::new(context.clone(), PREWARMED_EVENTS)?;
        Ok(Self {
            staging: StagingPool::new(context.clone()),
            context,
            streams,
            events,
            pending_writes: PendingWrites::default(),
            memory: Some(memory),
            setup,
            include_options,
            peers: HashMap::new(),
            peer_access,
            groups: HashMap::new(),
        })
    }

    fn memory(&mut self) -> CudaMemory {
        match self.memory.take() {
            Some(memory) => memory,
            // The server asks once; a second server over the same driver gets its own pool of
            // events over the same streams.
            None => CudaMemory::with_streams(self.streams.clone())
                .unwrap_or_else(|err| panic!("caching allocator: CUDA device memory: {err}")),
        }
    }

    fn pinned_host_pool(&mut self, config: &PinnedHostConfig) -> Option<Arc<dyn PinnedHostPool>> {
        // Asked when the server opens the device, before any copy: the pool starts over with
        // the configured limits (and its reservation).
        self.staging = StagingPool::with_config(self.context.clone(), config);
        Some(self.staging.clone())
    }

    fn properties(&self) -> DeviceProperties {
        self.setup.properties.clone()
    }

    fn info(&self) {}

    fn metadata_layout(&self) -> MetadataLayout {
        if self.setup.options.supports_features.grid_constants {
            MetadataLayout::GridConstant
        } else {
            MetadataLayout::DeviceBuffer
        }
    }

    fn create_stream(&mut self, id: DeviceStream) -> CudaStream {
        // The stream table decides, for the driver and the device memory alike, which stream
        // `id` is: the device's default one if it could not create one (see `get_or_create`).
        match self.streams.get_or_create(id) {
            Ok(raw) => CudaStream { id, raw },
            Err(err) => {
                log::error!(
                    "caching allocator: cannot make the context current for {id}'s stream \
                     ({err}); using the device's default stream"
                );
                CudaStream {
                    id,
                    raw: result::stream::null(),
                }
            }
        }
    }

    fn compile(
        &mut self,
        kernel: &dyn CubeTask<CudaCppCompiler>,
        mode: ExecutionMode,
        _args: &KernelArguments,
    ) -> Result<CudaKernel, LaunchError> {
        self.bind().map_err(|err| LaunchError::Unknown {
            reason: err.to_string(),
            backtrace: BackTrace::capture(),
        })?;
        kernel::compile(
            kernel,
            &self.setup.options,
            mode,
            self.setup.arch,
            self.setup.properties.hardware.max_shared_memory_size,
            &self.include_options,
        )
    }

    unsafe fn launch(
        &mut self,
        stream: &mut CudaStream,
        launch: Launch<'_, Self>,
    ) -> Result<(), ServerError> {
        self.bind()?;
        let count = match &launch.count {
            LaunchCount::Static(x, y, z) => (*x, *y, *z),
            LaunchCount::Dynamic(resource) => {
                // The server checked that the buffer holds the 12 bytes.
                let bytes = self.read_pageable(stream, device_pointer(resource), 12)?;
                let value = |i: usize| {
                    u32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
                };
                (value(0), value(4), value(8))
            }
        };
        if count.0 == 0 || count.1 == 0 || count.2 == 0 {
            // A dynamic count read as empty: nothing to run, and CUDA rejects empty grids (the
            // server skips static ones).
            return Ok(());
        }

        let mut arguments = pointer_arguments(&launch.buffers, launch.metadata.as_ref());
        // cuLaunchKernel copies every parameter (the info struct's bytes included) before it
        // returns.
        let mut params = kernel_params(&mut arguments, launch.info);
        let kernel = launch.kernel;
        let cube_dim = kernel.cube_dim();
        // SAFETY: a loaded function of this context, arguments matching its signature (buffers
        // then metadata, as compiled), a live stream; bounds are the caller's contract.
        let launched = unsafe {
            result::launch_kernel(
                kernel.function(),
                count,
                (cube_dim.x, cube_dim.y, cube_dim.z),
                kernel.shared_memory(),
                stream.raw,
                &mut params,
            )
        };
        // Counted once issued (see the module docs), failed or not.
        self.streams.note_work();
        launched.map_err(|err| {
            generic(format!(
                "CUDA: launching kernel `{}` with {count:?} cubes of {cube_dim:?} failed: {:?}",
                kernel.name(),
                err.0
            ))
        })
    }

    unsafe fn write(
        &mut self,
        stream: &mut CudaStream,
        dst: &Resource<Self>,
        data: &[u8],
    ) -> Result<(), ServerError> {
        // The server checked that `data` is not empty and fits `dst`.
        self.bind()?;
        self.collect_writes()?;
        let dst_ptr = device_pointer(dst);
        if data.len() <= MAX_INLINE_WRITE || data.len() > MAX_PINNED_TRANSFER {
            // A pageable source is staged by the driver before the call returns, without
            // waiting for the device. Small writes (every launch's metadata) take this path:
            // no pinned buffer held per launch in flight, no event to record and poll.
            // SAFETY: `dst_ptr` addresses at least `data.len()` bytes of a live block.
            let copied = unsafe { result::memcpy_htod_async(dst_ptr, data, stream.raw) };
            self.streams.note_work();
            return copied.map_err(|err| cuda_failure("cuMemcpyHtoDAsync", err));
        }
        let mut staged = self.staging.take(data.len())?;
        staged.fill_from(data);
        // SAFETY: the staged buffer holds `data.len()` pinned bytes and stays out of the pool
        // until the event after this copy completed; `dst_ptr` addresses enough bytes.
        let copied = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst_ptr,
                staged.as_ptr() as *const c_void,
                data.len(),
                stream.raw,
            )
            .result()
        };
        self.streams.note_work();
        // A copy that failed to issue does not use the buffer: it goes back to the pool.
        copied.map_err(|err| cuda_failure("cuMemcpyHtoDAsync", err))?;
        // Without an event, `in_flight` waits for the stream before the buffer goes back.
        // SAFETY: a live stream of this context.
        let in_flight = unsafe { in_flight::in_flight(&self.events, stream.raw, vec![staged]) }?;
        self.pending_writes.push(in_flight);
        Ok(())
    }

    unsafe fn read(
        &mut self,
        stream: &mut CudaStream,
        sources: Vec<(Resource<Self>, usize)>,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        enum Part {
            Pinned(usize),
            Ready(Vec<u8>),
        }
        let issued = (|| {
            self.bind()?;
            // A broken NCCL group may have cancelled the collective that wrote these buffers:
            // its error, never the bytes it left.
            self.poll_groups()?;
            // Every size is checked before any copy is issued, so that no check fails with
            // copies already running.
            for (resource, bytes) in &sources {
                if *bytes as u64 > resource.size {
                    return Err(generic(format!(
                        "read of {bytes} bytes from a buffer of {} bytes",
                        resource.size
                    )));
                }
            }
            let mut parts = Vec::with_capacity(sources.len());
            // Every exit below before the fence, error or not, goes through `staged`: its drop
            // waits for the stream before buffers of issued copies go back to the pool.
            let mut staged = Unfenced::new(RawStream(stream.raw));
            for (resource, bytes) in &sources {
                let bytes = *bytes;
                if bytes == 0 {
                    parts.push(Part::Ready(Vec::new()));
                } else {
                    // Pinned at every size: the copy runs asynchronously and the future, not
                    // the server's thread, waits for it. A large read gets a buffer of its
                    // size (see `staging::buffer_capacity`).
                    let buffer = match self.staging.take(bytes) {
                        Ok(buffer) => buffer,
                        Err(err) if bytes > MAX_PINNED_TRANSFER => {
                            // Pinning that much failed: copy to pageable memory, which waits
                            // for the device here.
                            log::warn!(
                                "caching allocator: {err}; reading {bytes} bytes through \
                                 pageable memory"
                            );
                            let host =
                                self.read_pageable(stream, device_pointer(resource), bytes)?;
                            parts.push(Part::Ready(host));
                            continue;
                        }
                        Err(err) => return Err(err.into()),
                    };
                    // SAFETY: `buffer` holds `bytes` pinned bytes and is only read after the
                    // event below completed; the source addresses enough bytes.
                    let copied = unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            buffer.as_ptr() as *mut c_void,
                            device_pointer(resource),
                            bytes,
                            stream.raw,
                        )
                        .result()
                    };
                    self.streams.note_work();
                    // Kept with the others even on error: an issued copy may still be running.
                    parts.push(Part::Pinned(staged.push(buffer)));
                    copied.map_err(|err| cuda_failure("cuMemcpyDtoHAsync", err))?;
                }
            }
            // SAFETY: a live stream of this context.
            let in_flight = unsafe { staged.fence(&self.events) }?;
            Ok((parts, in_flight))
        })();

        let groups = self.group_checks();
        Box::pin(async move {
            let (parts, in_flight) = issued?;
            let staged = in_flight.wait()?;
            // A collective of these buffers cancelled while this waited: its error.
            groups()?;
            Ok(parts
                .into_iter()
                .map(|part| match part {
                    Part::Ready(bytes) => Bytes::from_bytes_vec(bytes),
                    Part::Pinned(index) => Bytes::from_bytes_vec(staged[index].to_vec_after_copy()),
                })
                .collect())
        })
    }

    fn flush(&mut self, _stream: &mut CudaStream) -> Result<(), ServerError> {
        // CUDA submits work as it is issued.
        self.collect_writes()
    }

    fn expose(&mut self, _stream: &mut CudaStream, _resource: &Resource<Self>) {
        // The caller may launch its own kernels on the pointer: every later free or unmap
        // synchronises the context first.
        self.streams.note_foreign_work();
    }

    fn sync(&mut self, stream: &mut CudaStream) -> DynFut<Result<(), ServerError>> {
        let recorded = self
            .bind()
            .and_then(|()| self.poll_groups())
            .and_then(|()| self.collect_writes())
            .and_then(|()| self.record(stream));
        let groups = self.group_checks();
        Box::pin(async move {
            recorded?
                .synchronize()
                .map_err(|err| ServerError::from(DriverError::from(err)))?;
            // A collective cancelled while this waited (its group broke) ends like one that
            // ran: its error, not a success.
            groups()
        })
    }

    fn record_event(&mut self, stream: &mut CudaStream) -> Result<PooledEvent, ServerError> {
        self.bind()?;
        self.record(stream)
    }

    fn wait_event(
        &mut self,
        stream: &mut CudaStream,
        event: PooledEvent,
    ) -> Result<(), ServerError> {
        // SAFETY: a live stream of this context.
        unsafe { event.wait_on(stream.raw) }.map_err(|err| DriverError::from(err).into())
    }

    fn query_event(&mut self, event: &PooledEvent) -> Result<bool, ServerError> {
        event.query().map_err(|err| DriverError::from(err).into())
    }

    fn synchronize_event(&mut self, event: &PooledEvent) -> Result<(), ServerError> {
        event
            .synchronize()
            .map_err(|err| DriverError::from(err).into())
    }

    fn peer_copies(&self) -> bool {
        // An unreadable setting is reported by the collectives; copies stay on the device.
        !matches!(communication(), Ok(Communication::Host))
    }

    fn connect(&mut self, peers: &[DeviceId]) -> Result<(), ServerError> {
        let own = self.context.ordinal();
        let mut failures = Vec::new();
        for peer in peers {
            let ordinal = usize::from(peer.index_id);
            if ordinal == own || self.peers.contains_key(&peer.index_id) {
                continue;
            }
            let reached = open_context(ordinal).and_then(|context| {
                let direct = peer::enable_peer_access(&self.context, &context)?;
                if direct {
                    self.peer_access.add_peer(ordinal as i32)?;
                } else {
                    log::info!(
                        "caching allocator: CUDA devices {own} and {ordinal} have no peer \
                         access; copies between them are staged by the driver"
                    );
                }
                self.peers.insert(peer.index_id, context);
                Ok(())
            });
            if let Err(err) = reached {
                failures.push(format!("device {ordinal}: {err}"));
            }
        }
        self.bind()?;
        match failures.is_empty() {
            true => Ok(()),
            false => Err(generic(failures.join("; "))),
        }
    }

    unsafe fn export(
        &mut self,
        stream: &mut CudaStream,
        src: &Resource<Self>,
        staging: &Resource<Self>,
        len: usize,
    ) -> Result<CudaPeerBuffer, ServerError> {
        self.bind()?;
        if len as u64 > src.size || len as u64 > staging.size {
            return Err(generic(format!(
                "CUDA: a peer copy of {len} bytes from a buffer of {} into a staging block of {}",
                src.size, staging.size
            )));
        }
        let ptr = device_pointer(staging);
        // SAFETY: both address at least `len` bytes of live blocks of this context; the
        // staging block is used by nothing else.
        let copied =
            unsafe { sys::cuMemcpyDtoDAsync_v2(ptr, device_pointer(src), len, stream.raw) };
        self.streams.note_work();
        copied
            .result()
            .map_err(|err| cuda_failure("cuMemcpyDtoDAsync", err))?;
        let ready = self.record(stream)?;
        Ok(CudaPeerBuffer {
            ptr,
            len,
            context: self.context.clone(),
            ready,
        })
    }

    unsafe fn import(
        &mut self,
        stream: &mut CudaStream,
        dst: &Resource<Self>,
        src: &CudaPeerBuffer,
    ) -> Result<PooledEvent, ServerError> {
        self.bind()?;
        if src.len as u64 > dst.size {
            return Err(generic(format!(
                "CUDA: received {} bytes for a buffer of {} bytes",
                src.len, dst.size
            )));
        }
        // SAFETY: a live stream of this context; the event is live while `src` is. Waiting
        // for another context's event is allowed (`cuStreamWaitEvent`).
        unsafe {
            sys::cuStreamWaitEvent(
                stream.raw,
                src.ready.raw(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as u32,
            )
        }
        .result()
        .map_err(|err| cuda_failure("cuStreamWaitEvent", err))?;
        let dst_ptr = device_pointer(dst);
        let same_context = src.context.cu_ctx() == self.context.cu_ctx();
        // SAFETY: `dst_ptr` addresses at least `src.len` bytes of a live block of this
        // context; the source is a staging block its server holds until the event recorded
        // below has completed.
        let copied = unsafe {
            if same_context {
                sys::cuMemcpyDtoDAsync_v2(dst_ptr, src.ptr, src.len, stream.raw)
            } else {
                sys::cuMemcpyPeerAsync(
                    dst_ptr,
                    self.context.cu_ctx(),
                    src.ptr,
                    src.context.cu_ctx(),
                    src.len,
                    stream.raw,
                )
            }
        };
        self.streams.note_work();
        let call = if same_context {
            "cuMemcpyDtoDAsync"
        } else {
            "cuMemcpyPeerAsync"
        };
        copied.result().map_err(|err| cuda_failure(call, err))?;
        self.record(stream).inspect_err(|_| {
            // The copy runs, and no event tells when it ends: wait for it here, so that the
            // source may reuse its block once this returns.
            // SAFETY: a live stream.
            let _ = unsafe { result::stream::synchronize(stream.raw) };
        })
    }

    unsafe fn all_reduce(
        &mut self,
        stream: &mut CudaStream,
        collective: Collective<'_, Self>,
    ) -> Result<DeviceReduce, ServerError> {
        let Some(NcclPath {
            lib,
            data_type,
            size,
            op,
        }) = nccl_path(collective.path, collective.dtype, collective.op)?
        else {
            return Ok(DeviceReduce::Host);
        };
        if !collective.len.is_multiple_of(size) {
            return Err(generic(format!(
                "caching allocator: all_reduce of {} bytes is not a whole number of {:?}",
                collective.len, collective.dtype
            )));
        }
        self.bind()?;
        let (group, rank) = self
            .groups
            .entry(collective.group.to_vec())
            .or_insert_with(|| {
                // Each device's context stays retained while NCCL makes its communicator.
                let held = std::cell::RefCell::new(Vec::new());
                let bind = |ordinal: usize| {
                    open_context(ordinal)
                        .map(|context| held.borrow_mut().push(context))
                        .map_err(|err| err.to_string())
                };
                (Group::join(lib, collective.group, &bind), collective.rank)
            })
            .clone();
        // Making the communicator binds every member's context in turn: this device's again,
        // as NCCL's call on this device's stream needs it current.
        self.bind()?;
        let reduce = Reduce {
            src: device_pointer(collective.src),
            dst: device_pointer(collective.dst),
            count: collective.len / size,
            data_type,
            op,
            stream: stream.raw as *mut c_void,
        };
        let issued = group.all_reduce(rank, &reduce);
        self.streams.note_work();
        self.bind()?;
        issued.map_err(generic)?;
        Ok(DeviceReduce::Issued)
    }

    fn abandon_all_reduce(
        &mut self,
        group: &[DeviceId],
        dtype: ElemType,
        op: &ReduceOperation,
        path: &Result<Communication, String>,
        reason: &ServerError,
    ) -> DeviceReduce {
        match nccl_path(path, dtype, op) {
            Ok(None) => DeviceReduce::Host,
            Ok(Some(path)) => {
                // The other members may have queued their collective already: breaking the
                // group aborts their communicators, which ends it.
                nccl::Group::abandon(path.lib, group, &reason.to_string());
                DeviceReduce::Issued
            }
            // Every member reads the same setting and library, and fails the same way.
            Err(_) => DeviceReduce::Issued,
        }
    }
}

/// How NCCL takes an all-reduce: the library, NCCL's data type and its size, NCCL's
/// reduction.
struct NcclPath {
    lib: &'static nccl::Nccl,
    data_type: c_int,
    size: usize,
    op: c_int,
}

/// The path an all-reduce of `dtype` with `op` takes under the members' agreed setting `path`:
/// NCCL, `None` for the host path, or the error of `BURN_CACHING_ALLOC_COMM=nccl` without the
/// library. The same answer on every member of a group: it depends only on the agreed
/// setting, the process's library and the call.
fn nccl_path(
    path: &Result<Communication, String>,
    dtype: ElemType,
    op: &ReduceOperation,
) -> Result<Option<NcclPath>, ServerError> {
    let path = path.clone().map_err(generic)?;
    if path == Communication::Host {
        return Ok(None);
    }
    let lib = match nccl::nccl() {
        Ok(lib) => lib,
        Err(missing) if path == Communication::Nccl => {
            return Err(generic(format!(
                "caching allocator: {} asks for NCCL and {missing}. Install NCCL (Debian/Ubuntu: \
                 libnccl2; pip: nvidia-nccl-cu12) where the loader finds it (LD_LIBRARY_PATH), \
                 or set {}=auto to reduce through host memory",
                crate::runtime::COMM_ENV,
                crate::runtime::COMM_ENV
            )));
        }
        Err(missing) => {
            warn_host_path(missing);
            return Ok(None);
        }
    };
    let (Some((data_type, size)), Some(op)) = (lib.data_type(dtype), lib.operation(op)) else {
        return Ok(None);
    };
    Ok(Some(NcclPath {
        lib,
        data_type,
        size,
        op,
    }))
}

impl CudaDriver {
    /// A check of this device's NCCL groups' breaks that a future runs after its wait (no
    /// NCCL call: any thread may run it).
    fn group_checks(&self) -> impl FnOnce() -> Result<(), ServerError> + Send + 'static {
        let groups: Vec<Arc<Group>> = self.groups.values().map(|(g, _)| g.clone()).collect();
        move || {
            groups
                .iter()
                .try_for_each(|group| group.check().map_err(generic))
        }
    }

    /// The asynchronous errors of this device's NCCL groups, as the stream's error.
    fn poll_groups(&self) -> Result<(), ServerError> {
        for (group, rank) in self.groups.values() {
            group.poll(*rank).map_err(generic)?;
        }
        Ok(())
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        // Each member destroys its own communicator (aborts it when its group broke).
        if self.bind().is_ok() {
            for (group, rank) in self.groups.values() {
                group.release(*rank);
            }
        }
    }
}

/// `auto` without NCCL: all-reduces go through host memory; said once per process.
fn warn_host_path(missing: &nccl::NcclMissing) {
    static WARNED: Once = Once::new();
    WARNED.call_once(|| {
        log::warn!(
            "caching allocator: {missing}. all_reduce on CUDA devices goes through host memory \
             instead: each call waits for the stream, copies the whole buffer to the host and \
             back and reduces on one CPU core, hundreds of times slower than NCCL for large \
             gradients. Install NCCL (libnccl2, or pip's nvidia-nccl-cu12) to use it, or set \
             {}=host to choose the host path without this warning",
            crate::runtime::COMM_ENV
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::EngineResource;

    /// The peer branch of `import` (`cuMemcpyPeerAsync` between two contexts) on one GPU: a
    /// second, non-primary context of device 0 plays the peer.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_peer_copy_from_another_context_of_device_0_arrives_exact() {
        if let Err(reason) = super::super::probe::cuda_available() {
            eprintln!("skipping: {reason}");
            return;
        }
        let mut driver = match CudaDriver::open(DeviceId {
            type_id: 0,
            index_id: 0,
        }) {
            Ok(driver) => driver,
            Err(err) => {
                eprintln!("skipping: {err}");
                return;
            }
        };
        let len = 3 << 20;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // The other context, its block written from the host, its event after the write.
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `raw` is valid for the write; device 0 exists.
        unsafe {
            sys::cuCtxCreate_v4(
                &mut raw,
                std::ptr::null_mut(),
                0,
                driver.context.cu_device(),
            )
        }
        .result()
        .expect("a second context on device 0");
        // SAFETY: the context just created, current on this thread.
        let other = unsafe { CudaContext::from_raw_context(0, driver.context.cu_device(), raw) }
            .expect("wrapped");
        other.bind_to_thread().expect("bind");
        // SAFETY: plain allocation and copy in the current context.
        let src = unsafe { result::malloc_sync(len) }.expect("cuMemAlloc");
        unsafe { result::memcpy_htod_sync(src, &data) }.expect("cuMemcpyHtoD");
        let events = EventPool::new(other.clone(), 1).expect("events");
        // SAFETY: the legacy default stream of the current context.
        let ready = unsafe { events.record(std::ptr::null_mut()) }.expect("event");
        let buffer = CudaPeerBuffer {
            ptr: src,
            len,
            context: other.clone(),
            ready,
        };

        let mut stream = driver.create_stream(DeviceStream(0));
        let dst = driver
            .context
            .bind_to_thread()
            .and_then(|()| unsafe { result::malloc_sync(len) });
        let dst = dst.expect("cuMemAlloc");
        let resource = EngineResource {
            segment: dst,
            offset: 0,
            size: len as u64,
        };
        // SAFETY: `resource` is the `len` bytes just allocated, freed below after the copy
        // completed; `buffer` is the peer's staging copy, alive until then.
        let done = unsafe { driver.import(&mut stream, &resource, &buffer) }
            .expect("the peer copy is issued");
        done.synchronize().expect("the copy completes");
        let mut back = vec![0u8; len];
        driver.context.bind_to_thread().expect("bind");
        // SAFETY: `dst` holds `len` bytes.
        unsafe { result::memcpy_dtoh_sync(&mut back, dst) }.expect("cuMemcpyDtoH");
        assert_eq!(back, data);
        // SAFETY: both blocks are idle (synchronised) and freed once.
        unsafe {
            result::free_sync(dst).expect("free");
            other.bind_to_thread().expect("bind");
            result::free_sync(src).expect("free");
        }
    }

    fn buffer(segment: u64, offset: u64) -> Resource<CudaDriver> {
        EngineResource {
            segment,
            offset,
            size: 512,
        }
    }

    #[test]
    fn parameters_are_buffers_then_dynamic_metadata_then_the_info_struct_by_value() {
        // What cubecl-cpp compiles with grid constants: `buffer_0, buffer_1, dynamic_meta,
        // info_st info`.
        let mut arguments = pointer_arguments(
            &[buffer(0x1000, 512), buffer(0x2000, 0)],
            Some(&buffer(0x3000, 0)),
        );
        assert_eq!(arguments, vec![0x1200, 0x2000, 0x3000]);
        let info = [7u64, 8];
        let params = kernel_params(&mut arguments, &info);
        assert_eq!(params.len(), 4);
        for (param, argument) in params.iter().zip(&arguments) {
            // SAFETY: each parameter points at a live argument.
            assert_eq!(unsafe { *(*param as *const sys::CUdeviceptr) }, *argument);
        }
        assert_eq!(params[3] as *const u64, info.as_ptr());
        // No scalars or static metadata: no info parameter.
        assert_eq!(kernel_params(&mut arguments, &[]).len(), 3);
        // Before sm_70 (or without dynamic metadata): buffers, then the metadata buffer if any.
        assert_eq!(pointer_arguments(&[buffer(0x1000, 0)], None), vec![0x1000]);
    }
}
