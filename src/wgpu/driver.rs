//! The wgpu [`Driver`]: WGSL kernels (CubeCL's `WgslCompiler`), compute passes, queue copies.
//!
//! wgpu gives a device one in-order queue. All CubeCL streams record into one command encoder
//! and submit to that queue, so work runs in the order it was issued whatever its stream, and
//! stream events are no-ops. `queue.write_buffer` runs at the next submit, *before* the command
//! buffers of that submit, so every write of tensor data first submits the commands recorded
//! so far.
//!
//! Launches are recorded as `cubecl-wgpu` records them: the launches of one submit share one
//! compute pass, and a launch's scalars and metadata go into an [`InfoArena`] at an offset of
//! their own (no buffer is created per launch). That ordering is what makes the arena safe:
//! the arena's writes for a batch run at its submit, before the batch's commands, and each
//! launch's bytes have their own offset; after the submit the arena starts again at offset 0,
//! and the next batch's writes run after this batch's commands, in queue order.

use std::borrow::Cow;
use std::num::NonZeroU64;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::{DynFut, block_on};
use cubecl_core::WgpuCompilationOptions;
use cubecl_ir::DeviceProperties;
use cubecl_runtime::compiler::{CompilationError, CubeTask};
use cubecl_runtime::server::{
    ExecutionMode, KernelArguments, LaunchError, ResourceLimitError, ServerError,
};
use cubecl_wgpu::WgslCompiler;

use super::memory::{WgpuMemory, host_memory_total};
use super::setup;
use crate::runtime::{Driver, DriverError, Launch, LaunchCount, Resource};

/// Launches recorded before the encoder is submitted.
const TASKS_PER_SUBMIT: usize = 32;
/// Queue writes before a submit that flushes wgpu's staging copies (cubecl-wgpu does the same:
/// many writes without a submit exhaust wgpu's staging buffers).
const WRITES_PER_SUBMIT: usize = 64;
// Every launch queues one metadata write before its submit, uncounted in `writes`: a submit's
// launches must stay within the bound on queue writes without a submit.
const _: () = assert!(TASKS_PER_SUBMIT <= WRITES_PER_SUBMIT);
/// Host memory assumed when `/proc/meminfo` cannot be read.
const FALLBACK_TOTAL: u64 = 8 << 30;
/// The info arena's first buffer, in bytes (a batch of small kernels' metadata).
const ARENA_START: u64 = 64 << 10;
/// The smallest metadata binding in bytes (shorter metadata are padded with zeros, as since
/// the driver's first version).
const MIN_INFO: usize = 32;

/// The metadata of the launches recorded since the last submit, each at its own offset of one
/// buffer (see the module documentation for why reuse after a submit is safe).
///
/// When a batch's metadata outgrow the buffer, a larger one replaces it for the rest of the
/// batch; the launches already recorded keep the old one alive through their bind groups
/// until their submit has run. The arena keeps one buffer, of the largest size a batch
/// needed, outside the engine, as `cubecl-wgpu`'s uniform pool is outside its main pool.
struct InfoArena {
    buffer: Option<wgpu::Buffer>,
    layout: ArenaLayout,
}

impl InfoArena {
    /// An empty arena whose offsets are multiples of `alignment`.
    fn new(alignment: u64) -> Self {
        Self {
            buffer: None,
            layout: ArenaLayout::new(alignment),
        }
    }

    /// Queues a write of `bytes` (a multiple of 4 bytes, not empty) at an offset no other
    /// launch of the batch uses; returns the buffer and the offset.
    fn push(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        bytes: &[u8],
    ) -> (wgpu::Buffer, u64) {
        let place = self.layout.place(bytes.len() as u64);
        if let Some(capacity) = place.new_buffer {
            self.buffer = Some(device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("burn-caching-alloc kernel metadata"),
                size: capacity,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let buffer = self
            .buffer
            .clone()
            .expect("the first placement makes the arena's buffer");
        queue.write_buffer(&buffer, place.offset, bytes);
        (buffer, place.offset)
    }

    /// The batch was submitted: its writes run before it, the next batch's after it.
    fn reset(&mut self) {
        self.layout.reset();
    }
}

/// Where one launch's metadata go in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Placement {
    offset: u64,
    /// The capacity of the buffer to make first, when the current one cannot hold them.
    new_buffer: Option<u64>,
}

/// The arena's offsets, without the device: a bump cursor over a buffer of `capacity` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ArenaLayout {
    capacity: u64,
    cursor: u64,
    alignment: u64,
}

impl ArenaLayout {
    /// No buffer yet; offsets are multiples of `alignment` (the device's storage-binding
    /// offset alignment) and of wgpu's copy alignment.
    fn new(alignment: u64) -> Self {
        Self {
            capacity: 0,
            cursor: 0,
            alignment: alignment.max(wgpu::COPY_BUFFER_ALIGNMENT),
        }
    }

    /// Places `len` bytes after the batch's earlier ones, in a new buffer (twice the old
    /// capacity, at least [`ARENA_START`] and `len`) when they do not fit.
    fn place(&mut self, len: u64) -> Placement {
        let offset = self.cursor.next_multiple_of(self.alignment);
        if self.capacity > 0 && offset + len <= self.capacity {
            self.cursor = offset + len;
            return Placement {
                offset,
                new_buffer: None,
            };
        }
        let capacity = (self.capacity * 2)
            .max(ARENA_START)
            .max(len.next_power_of_two());
        self.capacity = capacity;
        self.cursor = len;
        Placement {
            offset: 0,
            new_buffer: Some(capacity),
        }
    }

    /// A new batch starts at offset 0 of the same buffer.
    fn reset(&mut self) {
        self.cursor = 0;
    }
}

/// A compiled WGSL kernel.
pub struct WgpuKernel {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

/// Driver state of a CubeCL stream: nothing, as all streams share the device's queue.
#[derive(Debug, Default)]
pub struct WgpuStream;

/// wgpu as the caching server drives it.
pub struct WgpuDriver {
    device: wgpu::Device,
    queue: wgpu::Queue,
    backend: wgpu::Backend,
    adapter_type: wgpu::DeviceType,
    properties: DeviceProperties,
    options: WgpuCompilationOptions,
    /// The compute pass the launches since the last submit (or copy) record into. Declared
    /// before `encoder`, so that it is dropped (ended) first.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    info: InfoArena,
    tasks: usize,
    writes: usize,
    max_binding_size: u64,
}

impl core::fmt::Debug for WgpuDriver {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("WgpuDriver")
            .field("backend", &self.backend)
            .field("adapter_type", &self.adapter_type)
            .finish()
    }
}

fn generic(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}

impl WgpuDriver {
    /// The encoder, for a command outside a compute pass: the open pass (if any) ends first.
    fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        let device = &self.device;
        self.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("burn-caching-alloc tasks"),
            })
        })
    }

    /// The compute pass launches record into, begun on the encoder if none is open.
    fn pass(&mut self) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let pass = self
                .encoder()
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                })
                // The pass is kept between launches; it is dropped (ended) before the encoder
                // is used for anything else or finished (`encoder`, `submit`), which wgpu
                // checks at run time.
                .forget_lifetime();
            self.pass = Some(pass);
        }
        self.pass.as_mut().expect("a compute pass was just begun")
    }

    /// Submits the recorded commands (and, with them, every pending queue write).
    fn submit(&mut self) -> Option<wgpu::SubmissionIndex> {
        self.pass = None;
        let encoder = self.encoder.take()?;
        self.tasks = 0;
        self.writes = 0;
        let index = self.queue.submit([encoder.finish()]);
        self.info.reset();
        Some(index)
    }

    fn wait(&self, index: Option<wgpu::SubmissionIndex>) -> Result<(), ServerError> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: index,
                timeout: None,
            })
            .map(|_| ())
            .map_err(|err| generic(format!("wgpu: waiting for the queue failed: {err}")))
    }

    fn binding(resource: &Resource<Self>) -> wgpu::BindingResource<'_> {
        // WebGPU binding sizes are multiples of 4; blocks are 512-byte multiples, so the
        // rounded range stays inside the block. Zero-sized tensors bind 4 bytes of their block.
        let size = resource.size.max(4).next_multiple_of(4);
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &resource.segment,
            offset: resource.offset,
            size: NonZeroU64::new(size),
        })
    }
}

impl Driver for WgpuDriver {
    const NAME: &'static str = "wgpu";
    const SINGLE_QUEUE: bool = true;
    type Memory = WgpuMemory;
    type Compiler = WgslCompiler;
    type Info = wgpu::Backend;
    type Stream = WgpuStream;
    type Event = ();
    type Kernel = WgpuKernel;
    type PeerBuffer = std::convert::Infallible;

    fn open(id: DeviceId) -> Result<Self, DriverError> {
        let setup = setup::open(id)?;
        let (mut properties, options) = setup::probe_properties(id)?;
        let limits = setup.device.limits();
        // Slices and packed tensors must start where a storage binding may start.
        properties.memory.alignment = properties
            .memory
            .alignment
            .max(limits.min_storage_buffer_offset_alignment as u64);
        properties.timing_method = cubecl_common::profile::TimingMethod::System;
        Ok(Self {
            adapter_type: setup.adapter.get_info().device_type,
            device: setup.device,
            queue: setup.queue,
            backend: setup.backend,
            properties,
            options,
            pass: None,
            encoder: None,
            info: InfoArena::new(limits.min_storage_buffer_offset_alignment as u64),
            tasks: 0,
            writes: 0,
            max_binding_size: limits.max_storage_buffer_binding_size,
        })
    }

    fn memory(&mut self) -> WgpuMemory {
        WgpuMemory::new(
            self.device.clone(),
            host_memory_total().unwrap_or(FALLBACK_TOTAL),
        )
    }

    fn properties(&self) -> DeviceProperties {
        self.properties.clone()
    }

    fn info(&self) -> wgpu::Backend {
        self.backend
    }

    fn max_binding_size(&self) -> Option<u64> {
        Some(self.max_binding_size)
    }

    fn create_stream(&mut self, _id: crate::device::DeviceStream) -> WgpuStream {
        WgpuStream
    }

    fn compile(
        &mut self,
        kernel: &dyn CubeTask<WgslCompiler>,
        mode: ExecutionMode,
        args: &KernelArguments,
    ) -> Result<WgpuKernel, LaunchError> {
        let mut compiler = WgslCompiler::default();
        let compiled = kernel.compile(&mut compiler, &self.options, mode, kernel.address_type())?;
        if let Some(repr) = &compiled.repr {
            let shared = repr.shared_memory_bytes();
            let max = self.properties.hardware.max_shared_memory_size;
            if shared > max {
                return Err(ResourceLimitError::SharedMemory {
                    requested: shared,
                    max,
                    backtrace: BackTrace::capture(),
                }
                .into());
            }
        }

        let name = compiled.entrypoint_name.as_str();
        let checks = wgpu::ShaderRuntimeChecks {
            // CubeCL checks bounds itself in checked mode.
            bounds_checks: false,
            force_loop_bounding: mode == ExecutionMode::Checked,
            ..wgpu::ShaderRuntimeChecks::unchecked()
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        // SAFETY: CubeCL guarantees in-bounds accesses in checked mode; unchecked launches are
        // `unsafe` for their caller.
        let module = unsafe {
            self.device.create_shader_module_trusted(
                wgpu::ShaderModuleDescriptor {
                    label: Some(name),
                    source: wgpu::ShaderSource::Wgsl(Cow::Borrowed(&compiled.source)),
                },
                checks,
            )
        };
        if let Some(err) = block_on(scope.pop()) {
            return Err(CompilationError::Generic {
                reason: format!("WGSL compilation failed for kernel `{name}`: {err}"),
                backtrace: BackTrace::capture(),
            }
            .into());
        }

        // Every buffer read-write (slices can be shared), then the metadata read-only.
        let storage = |read_only| wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        };
        let with_info = !args.info.data.is_empty();
        let entries: Vec<wgpu::BindGroupLayoutEntry> = (0..args.buffers.len())
            .map(|_| storage(false))
            .chain(with_info.then(|| storage(true)))
            .enumerate()
            .map(|(i, ty)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty,
                count: None,
            })
            .collect();
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(name),
                entries: &entries,
            });
        let pipeline_layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(name),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(name),
                compilation_options: wgpu::PipelineCompilationOptions {
                    zero_initialize_workgroup_memory: false,
                    ..Default::default()
                },
                cache: None,
            });
        Ok(WgpuKernel { pipeline, layout })
    }

    unsafe fn launch(
        &mut self,
        _stream: &mut WgpuStream,
        launch: Launch<'_, Self>,
    ) -> Result<(), ServerError> {
        let info = (!launch.info.is_empty()).then(|| {
            let mut bytes: Vec<u8> = launch.info.iter().flat_map(|v| v.to_le_bytes()).collect();
            bytes.resize(bytes.len().max(MIN_INFO), 0);
            let len = bytes.len() as u64;
            let (buffer, offset) = self.info.push(&self.device, &self.queue, &bytes);
            (buffer, offset, len)
        });
        let mut entries: Vec<wgpu::BindGroupEntry> = launch
            .buffers
            .iter()
            .enumerate()
            .map(|(i, r)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: Self::binding(r),
            })
            .collect();
        if let Some((buffer, offset, len)) = &info {
            entries.push(wgpu::BindGroupEntry {
                binding: entries.len() as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: *offset,
                    size: NonZeroU64::new(*len),
                }),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &launch.kernel.layout,
            entries: &entries,
        });
        let pass = self.pass();
        pass.set_pipeline(&launch.kernel.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        match &launch.count {
            LaunchCount::Static(x, y, z) => pass.dispatch_workgroups(*x, *y, *z),
            LaunchCount::Dynamic(r) => pass.dispatch_workgroups_indirect(&r.segment, r.offset),
        }
        self.tasks += 1;
        if self.tasks >= TASKS_PER_SUBMIT {
            self.submit();
        }
        Ok(())
    }

    unsafe fn write(
        &mut self,
        _stream: &mut WgpuStream,
        dst: &Resource<Self>,
        data: &[u8],
    ) -> Result<(), ServerError> {
        // The server checked that `data` is not empty and fits `dst`. Order the write after the commands recorded so far.
        self.submit();
        if data.len().is_multiple_of(4) {
            self.queue.write_buffer(&dst.segment, dst.offset, data);
        } else {
            let mut padded = data.to_vec();
            padded.resize(data.len().next_multiple_of(4), 0);
            self.queue.write_buffer(&dst.segment, dst.offset, &padded);
        }
        self.writes += 1;
        if self.writes >= WRITES_PER_SUBMIT {
            self.writes = 0;
            let index = self.queue.submit([]);
            self.wait(Some(index))?;
        }
        Ok(())
    }

    unsafe fn read(
        &mut self,
        _stream: &mut WgpuStream,
        sources: Vec<(Resource<Self>, usize)>,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        let result = (|| {
            let mut staging = Vec::with_capacity(sources.len());
            for (resource, bytes) in &sources {
                let bytes = *bytes as u64;
                if bytes > resource.size {
                    return Err(generic(format!(
                        "read of {bytes} bytes from a buffer of {} bytes",
                        resource.size
                    )));
                }
                if bytes == 0 {
                    staging.push(None);
                    continue;
                }
                let len = bytes.next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
                let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("burn-caching-alloc readback"),
                    size: len,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                self.encoder().copy_buffer_to_buffer(
                    &resource.segment,
                    resource.offset,
                    &buffer,
                    0,
                    len,
                );
                staging.push(Some((buffer, bytes as usize)));
            }
            let index = self.submit();
            let (sender, receiver) = std::sync::mpsc::channel();
            for (buffer, _) in staging.iter().flatten() {
                let sender = sender.clone();
                buffer
                    .slice(..)
                    .map_async(wgpu::MapMode::Read, move |result| {
                        let _ = sender.send(result);
                    });
            }
            drop(sender);
            self.wait(index)?;
            for result in receiver.iter() {
                result.map_err(|err| generic(format!("wgpu: mapping a readback failed: {err}")))?;
            }
            Ok(staging
                .into_iter()
                .map(|entry| match entry {
                    Some((buffer, bytes)) => {
                        let data = buffer.slice(..).get_mapped_range()[..bytes].to_vec();
                        buffer.unmap();
                        Bytes::from_bytes_vec(data)
                    }
                    None => Bytes::from_bytes_vec(Vec::new()),
                })
                .collect())
        })();
        Box::pin(async move { result })
    }

    fn flush(&mut self, _stream: &mut WgpuStream) -> Result<(), ServerError> {
        self.submit();
        Ok(())
    }

    fn sync(&mut self, _stream: &mut WgpuStream) -> DynFut<Result<(), ServerError>> {
        let index = self.submit();
        let result = self.wait(index);
        Box::pin(async move { result })
    }

    fn record_event(&mut self, _stream: &mut WgpuStream) -> Result<(), ServerError> {
        Ok(())
    }

    fn wait_event(&mut self, _stream: &mut WgpuStream, _event: ()) -> Result<(), ServerError> {
        Ok(())
    }

    // One queue and one encoder for every stream: work is never reordered across streams, so
    // an event is complete for reuse as soon as it is recorded.
    fn query_event(&mut self, _event: &()) -> Result<bool, ServerError> {
        Ok(true)
    }

    fn synchronize_event(&mut self, _event: &()) -> Result<(), ServerError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Placements in one batch never overlap and respect the alignment; the first one makes
    /// the buffer; one that does not fit makes a buffer twice as large and starts it at 0.
    #[test]
    fn a_batch_gets_disjoint_aligned_offsets_and_grows_by_doubling() {
        let mut layout = ArenaLayout::new(256);
        assert_eq!(
            layout.place(40),
            Placement {
                offset: 0,
                new_buffer: Some(ARENA_START)
            }
        );
        assert_eq!(
            layout.place(40),
            Placement {
                offset: 256,
                new_buffer: None
            }
        );
        assert_eq!(
            layout.place(300),
            Placement {
                offset: 512,
                new_buffer: None
            }
        );
        // 812 bytes used; the next 256-aligned offset is 1024. Fill up to the last byte.
        let rest = ARENA_START - 1024;
        assert_eq!(
            layout.place(rest),
            Placement {
                offset: 1024,
                new_buffer: None
            }
        );
        assert_eq!(
            layout.place(8),
            Placement {
                offset: 0,
                new_buffer: Some(2 * ARENA_START)
            }
        );
        assert_eq!(layout.cursor, 8);
    }

    /// Metadata larger than twice the buffer get a buffer of their own size (a power of two).
    #[test]
    fn oversized_metadata_get_a_buffer_that_holds_them() {
        let mut layout = ArenaLayout::new(16);
        let big = 5 * ARENA_START + 8;
        assert_eq!(
            layout.place(big),
            Placement {
                offset: 0,
                new_buffer: Some(big.next_power_of_two())
            }
        );
        assert_eq!(layout.capacity, 8 * ARENA_START);
    }

    /// After a submit the next batch reuses the buffer from offset 0; no new buffer is made.
    #[test]
    fn a_submit_restarts_the_batch_in_the_same_buffer() {
        let mut layout = ArenaLayout::new(64);
        layout.place(100);
        layout.place(100);
        layout.reset();
        assert_eq!(
            layout.place(100),
            Placement {
                offset: 0,
                new_buffer: None
            }
        );
        assert_eq!(layout.capacity, ARENA_START);
    }

    /// An alignment below wgpu's copy alignment is raised to it (`write_buffer` offsets are
    /// multiples of 4).
    #[test]
    fn offsets_are_multiples_of_the_copy_alignment() {
        let mut layout = ArenaLayout::new(1);
        layout.place(6);
        assert_eq!(layout.place(4).offset, 8);
    }
}
