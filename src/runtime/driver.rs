//! The one trait a device API implements to run under [`CachingServer`](super::CachingServer).
//!
//! The server owns everything CubeCL-facing and everything about memory: per-stream
//! `MemoryManagement`s over the engine, handle binding and resolution, the kernel cache, errors,
//! profiling. A driver only does what needs the device API, on resources the server already
//! resolved: compile a kernel, launch it on a stream with its buffers, copy bytes to and from a
//! buffer, flush and synchronise a stream, and order one stream after another with an event.
//!
//! Ordering contract the server relies on (and a driver must keep):
//! - work on one driver stream runs in the order it was issued (launches, writes, reads);
//! - a `write` is ordered after every launch issued before it on the same stream;
//! - an event recorded on a stream completes only after the work issued there before it, and
//!   [`Driver::query_event`] / [`Driver::synchronize_event`] tell that on the host: the server
//!   hands a buffer that another stream used to new work only once an event recorded on that
//!   stream after the use has completed (PyTorch's `recordStream` rule, see the server's
//!   `ordering` module); memory is otherwise cached per stream slot.
//!
//! Between devices, a driver may do better than the server's host path (`server/comm.rs`):
//! copy a buffer from a peer device of the same API ([`Driver::export`], [`Driver::import`],
//! CUDA's peer copies) and reduce across a group on the device ([`Driver::all_reduce`],
//! NCCL). A driver without them (wgpu) keeps the defaults and everything goes through host
//! memory.

use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::DynFut;
use cubecl_common::profile::TimingMethod;
use cubecl_ir::{DeviceProperties, ElemType};
use cubecl_runtime::compiler::{Compiler, CubeTask};
use cubecl_runtime::server::{
    ExecutionMode, KernelArguments, LaunchError, ReduceOperation, ServerError,
};

use std::sync::Arc;

use super::comm_path::Communication;
use super::error::DriverError;
use super::pinned_host::PinnedHostPool;
use super::storage::EngineResource;
use crate::alloc::PinnedHostConfig;
use crate::device::{DeviceMemory, DeviceStream};

/// A buffer as a kernel or a copy sees it: segment handle, offset and size.
pub type Resource<D> = EngineResource<<<D as Driver>::Memory as DeviceMemory>::Handle>;

/// How many cubes a launch dispatches, with an indirect count already resolved.
pub enum LaunchCount<H> {
    /// A known count of cubes in x, y, z.
    Static(u32, u32, u32),
    /// Read `[x, y, z]` (three `u32`) from this buffer on the device.
    Dynamic(EngineResource<H>),
}

/// How a driver's kernels receive their scalars and metadata (CubeCL's `MetadataBindingInfo`:
/// scalars, then static metadata, then dynamic metadata from `dynamic_metadata_offset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataLayout {
    /// The driver binds the whole info itself: [`Launch::info`] holds all of it and
    /// [`Launch::metadata`] is `None` (wgpu: written into the driver's metadata arena and
    /// bound at its own offset).
    DriverBinding,
    /// The whole info in a device buffer the server fills: [`Launch::metadata`] holds it,
    /// [`Launch::info`] is empty (CUDA before sm_70: an `info` pointer after the buffers).
    DeviceBuffer,
    /// Scalars and static metadata by value (CUDA `__grid_constant__`, sm_70 on):
    /// [`Launch::info`] holds them; the dynamic metadata, when there is any, in a device buffer
    /// the server fills ([`Launch::metadata`]), passed before the info struct.
    GridConstant,
}

/// What [`Driver::all_reduce`] did with an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceReduce {
    /// Issued on the stream, on the device (NCCL): later work of the stream runs after it.
    Issued,
    /// Not for this driver, this element type or this configuration: the server's host path
    /// runs it. Every member of a group answers the same for the same call.
    Host,
}

/// One all-reduce as the server hands it to [`Driver::all_reduce`]: buffers resolved, the
/// group sorted (the rank is this device's position in it).
pub struct Collective<'a, D: Driver> {
    /// What this device contributes.
    pub src: &'a Resource<D>,
    /// Where the reduced values go (may be `src`'s memory).
    pub dst: &'a Resource<D>,
    /// Bytes to reduce, a whole number of `dtype`.
    pub len: usize,
    /// The element type.
    pub dtype: ElemType,
    /// The reduction.
    pub op: &'a ReduceOperation,
    /// Every device of the group, sorted.
    pub group: &'a [DeviceId],
    /// This device's position in `group`.
    pub rank: usize,
    /// The communication setting for this all-reduce, the same on every member (as the first
    /// member to reach it read it), or why it could not be read.
    pub path: &'a Result<Communication, String>,
}

fn no_peer_copies() -> ServerError {
    ServerError::Generic {
        reason: "caching allocator: this device API copies between devices through the host \
                 only"
            .into(),
        backtrace: cubecl_common::backtrace::BackTrace::capture(),
    }
}

/// What the server passes to [`Driver::launch`].
pub struct Launch<'a, D: Driver> {
    /// The compiled kernel, from [`Driver::compile`].
    pub kernel: &'a D::Kernel,
    /// The cube count.
    pub count: LaunchCount<<D::Memory as DeviceMemory>::Handle>,
    /// The kernel's buffers in binding order, resolved to segment + offset + size.
    pub buffers: Vec<Resource<D>>,
    /// Scalars and metadata, packed as CubeCL packs them (`MetadataBindingInfo::data`): all of
    /// it, its static part, or nothing, as the driver's [`MetadataLayout`] says.
    pub info: &'a [u64],
    /// The metadata the server uploaded to the device for this launch, as the driver's
    /// [`MetadataLayout`] says (`None` when there is none to pass). The buffer is the launching
    /// stream's scratch: it is rewritten by the next launch on the stream, after this one in
    /// stream order, so it needs no lifetime management by the driver.
    pub metadata: Option<Resource<D>>,
    /// Checked, validated or unchecked execution.
    pub mode: ExecutionMode,
}

/// One device API (wgpu, CUDA) as the caching server needs it.
pub trait Driver: Send + Sized + 'static {
    /// The API's name in the engine's process-wide registry (`"cuda"`, `"wgpu"`): a user reads
    /// the engine of device `n` there as `DeviceKey::new(NAME, n)`.
    const NAME: &'static str;
    /// Whether every stream of this API issues its work into one device queue, in one order
    /// (wgpu: one encoder, one submission order). Memory freed on one stream is then safe for
    /// any other at once, so the server maps every CubeCL stream onto one slot: one CubeCL pool
    /// and one engine stream serve every thread. `false` (CUDA) keeps a slot, and an engine
    /// stream, per CubeCL stream (up to `max_streams`), PyTorch's rule.
    const SINGLE_QUEUE: bool = false;
    /// The engine's device memory for this API: segments are this API's buffers.
    type Memory: DeviceMemory;
    /// The CubeCL compiler producing this API's kernels.
    type Compiler: Compiler;
    /// What `ComputeClient::info` reports (e.g. the wgpu backend).
    type Info: core::fmt::Debug + Send + Sync;
    /// Per-stream driver state (a CUDA stream, a command encoder, ...).
    type Stream: Send;
    /// A point in a stream's work that another stream can wait for.
    type Event: Send + 'static;
    /// A compiled, launchable kernel (a pipeline, a module + function).
    type Kernel: Send + Sync;
    /// A buffer of this device made ready for a peer device of the same API to copy from
    /// ([`Driver::export`]); `std::convert::Infallible` for a driver without peer copies.
    type PeerBuffer: Send + 'static;

    /// Opens the device with this CubeCL id. Errors say why (no adapter, no driver library)
    /// and what to do about it.
    fn open(device: DeviceId) -> Result<Self, DriverError>;

    /// The device memory the engine allocates segments through (called once per server).
    fn memory(&mut self) -> Self::Memory;

    /// The driver's pinned host pool (the buffers its copies between host and device are
    /// staged in), set up with `config`, the device's configuration (called once per server,
    /// when it opens the device), for the user API to read; `None` (the default) for a driver
    /// without one (wgpu).
    fn pinned_host_pool(&mut self, config: &PinnedHostConfig) -> Option<Arc<dyn PinnedHostPool>> {
        let _ = config;
        None
    }

    /// Device properties CubeCL and Burn plan kernels and layouts with.
    fn properties(&self) -> DeviceProperties;

    /// The runtime info returned to clients.
    fn info(&self) -> Self::Info;

    /// How profiling durations are measured. The server measures system time around a stream
    /// synchronisation, so drivers report [`TimingMethod::System`] unless they add more.
    fn timing_method(&self) -> TimingMethod {
        TimingMethod::System
    }

    /// The largest buffer a kernel can bind (e.g. wgpu's max storage binding size). A request
    /// above it is an error before anything is allocated.
    fn max_binding_size(&self) -> Option<u64> {
        None
    }

    /// How kernels receive their scalars and metadata; the compiler options must agree (e.g.
    /// CUDA's `grid_constants`). Fixed for the driver's lifetime.
    fn metadata_layout(&self) -> MetadataLayout {
        MetadataLayout::DriverBinding
    }

    /// Creates the driver state of a new CubeCL stream; `id` is the engine's name for it (the
    /// stream the engine records its events on). A driver that cannot create one logs why and
    /// falls back to a stream that is always valid (e.g. the device's default stream).
    fn create_stream(&mut self, id: DeviceStream) -> Self::Stream;

    /// Compiles `kernel` in `mode`; `args` tells the binding layout (buffers, metadata).
    fn compile(
        &mut self,
        kernel: &dyn CubeTask<Self::Compiler>,
        mode: ExecutionMode,
        args: &KernelArguments,
    ) -> Result<Self::Kernel, LaunchError>;

    /// Issues a kernel launch on `stream`. The server has already checked what does not depend
    /// on the API: a static count has no zero dimension, a dynamic count's buffer holds 12
    /// bytes.
    ///
    /// # Safety
    /// In [`ExecutionMode::Unchecked`] the kernel may access memory out of bounds.
    unsafe fn launch(
        &mut self,
        stream: &mut Self::Stream,
        launch: Launch<'_, Self>,
    ) -> Result<(), ServerError>;

    /// Copies `data` into `dst` on `stream`, after the work already issued there. The server
    /// has already checked that `data` is not empty and fits `dst`.
    ///
    /// # Safety
    /// `dst` names raw device memory: it must be a resource the server resolved from a live
    /// handle of this device (its bytes inside a block the engine holds), kept allocated until
    /// the copy has run on `stream`. A forged or freed resource writes over other memory.
    unsafe fn write(
        &mut self,
        stream: &mut Self::Stream,
        dst: &Resource<Self>,
        data: &[u8],
    ) -> Result<(), ServerError>;

    /// Copies each `(resource, bytes)` out of the device, after the work already issued on
    /// `stream`. The future yields one `Bytes` of exactly `bytes` length per entry.
    ///
    /// # Safety
    /// As [`Driver::write`]: each resource resolved from a live handle of this device and kept
    /// allocated until the future resolves.
    unsafe fn read(
        &mut self,
        stream: &mut Self::Stream,
        sources: Vec<(Resource<Self>, usize)>,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>>;

    /// Submits the work issued on `stream` so far.
    fn flush(&mut self, stream: &mut Self::Stream) -> Result<(), ServerError>;

    /// `resource` is handed to code outside the server (`ComputeServer::get_resource`), which
    /// may issue work on it that the driver never sees. Nothing by default; a driver whose
    /// device memory skips a synchronisation before freeing when it saw no work (CUDA) must
    /// stop trusting that.
    fn expose(&mut self, stream: &mut Self::Stream, resource: &Resource<Self>) {
        let _ = (stream, resource);
    }

    /// A future that completes when all the work issued on `stream` has completed.
    fn sync(&mut self, stream: &mut Self::Stream) -> DynFut<Result<(), ServerError>>;

    /// Records an event at the current point of `stream`.
    fn record_event(&mut self, stream: &mut Self::Stream) -> Result<Self::Event, ServerError>;

    /// Makes later work on `stream` wait for `event`.
    fn wait_event(
        &mut self,
        stream: &mut Self::Stream,
        event: Self::Event,
    ) -> Result<(), ServerError>;

    /// Whether the work issued before `event` has completed, without blocking (CUDA's
    /// `cuEventQuery`). The server polls the events of cross-stream uses with it.
    fn query_event(&mut self, event: &Self::Event) -> Result<bool, ServerError>;

    /// Blocks until the work issued before `event` has completed (CUDA's
    /// `cuEventSynchronize`): `empty_cache` and the out-of-memory path wait for cross-stream
    /// uses with it before they give memory back. `event` may come from another device's
    /// driver of the same API (the completion of a peer copy that read this device's memory).
    fn synchronize_event(&mut self, event: &Self::Event) -> Result<(), ServerError>;

    /// Whether `to_device` between two devices of this API copies device to device
    /// ([`Driver::export`] then [`Driver::import`]) instead of through host memory. Asked at
    /// every transfer, on both sides: the answer must not depend on the device.
    fn peer_copies(&self) -> bool {
        false
    }

    /// `comm_init` of a group: this device will exchange buffers with `peers` (CUDA: enables
    /// peer access where the devices allow it, and grants the peers access to the pages of
    /// expandable segments, now and at every later map).
    fn connect(&mut self, peers: &[DeviceId]) -> Result<(), ServerError> {
        let _ = peers;
        Ok(())
    }

    /// `send`'s device half: copies `len` bytes of `src` into `staging` (a block the server
    /// reserved for the transfer, which nothing else uses) on `stream`, after the work issued
    /// there, and returns `staging` for the peer with an event recorded after that copy.
    /// The staging copy, not `src`, is what the peer reads: work issued on `stream` later may
    /// write `src` in place (CubeCL's bindings do not keep a tensor from being mutated).
    ///
    /// # Safety
    /// As [`Driver::write`], for `src` and `staging`, `len` within both; `staging` kept
    /// allocated until the peer's import has completed.
    unsafe fn export(
        &mut self,
        stream: &mut Self::Stream,
        src: &Resource<Self>,
        staging: &Resource<Self>,
        len: usize,
    ) -> Result<Self::PeerBuffer, ServerError> {
        let _ = (stream, src, staging, len);
        Err(no_peer_copies())
    }

    /// `recv`'s device half: makes `stream` wait for `src`'s event, copies it into `dst` and
    /// returns an event recorded after the copy, which the source's server waits for before
    /// it reuses the staging block. An error means no copy is running (a driver that issued
    /// the copy but cannot record the event waits for the stream before it returns the error).
    ///
    /// # Safety
    /// As [`Driver::write`] for `dst`; `src` is what a peer's [`Driver::export`] returned, its
    /// staging block still allocated.
    unsafe fn import(
        &mut self,
        stream: &mut Self::Stream,
        dst: &Resource<Self>,
        src: &Self::PeerBuffer,
    ) -> Result<Self::Event, ServerError> {
        let _ = (stream, dst, src);
        Err(no_peer_copies())
    }

    /// An all-reduce on the device, issued on `stream` after the work issued there
    /// ([`DeviceReduce::Issued`]), or [`DeviceReduce::Host`] for the server's host path.
    ///
    /// # Safety
    /// As [`Driver::write`], for every resource of `collective`, each kept allocated until the
    /// collective has run.
    unsafe fn all_reduce(
        &mut self,
        stream: &mut Self::Stream,
        collective: Collective<'_, Self>,
    ) -> Result<DeviceReduce, ServerError> {
        let _ = (stream, collective);
        Ok(DeviceReduce::Host)
    }

    /// This device's part of an all-reduce of `group` failed before or while it was issued
    /// (`reason`): makes sure no other member waits for it on the device, and says which path
    /// the group takes for this all-reduce (`path`: the setting the members agreed on), as
    /// [`Driver::all_reduce`] would have answered:
    /// [`DeviceReduce::Host`] when the group reduces through host memory (the server then
    /// contributes the failure to the host round, where the others meet it), else
    /// [`DeviceReduce::Issued`] (the driver made the other members' collective end in an
    /// error, e.g. by breaking the NCCL group).
    fn abandon_all_reduce(
        &mut self,
        group: &[DeviceId],
        dtype: ElemType,
        op: &ReduceOperation,
        path: &Result<Communication, String>,
        reason: &ServerError,
    ) -> DeviceReduce {
        let _ = (group, dtype, op, path, reason);
        DeviceReduce::Host
    }
}
