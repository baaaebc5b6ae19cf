//! Reserving a slice for a new tensor, with the out-of-memory path across streams, in
//! PyTorch's order and with PyTorch's one count.
//!
//! 1. The stream's own reservation (`StreamMemory::reserve_before_flush`): CubeCL's exact-size
//!    reuse, the engine's cache, the stream's reclaim policy, new device memory, and the
//!    engine's release of oversize blocks; everything but the engine's cache flush. A request
//!    that can never fit (`TooLarge`: beyond the device or its largest buffer) fails here at
//!    once, with its own error, without visiting any other stream.
//! 2. If only a flush could help, every layer above the engine gives back what it holds: the
//!    buffers held for other streams' uses once their events complete (the server waits for
//!    them, as PyTorch's `release_cached_blocks` synchronises pending events), then every
//!    stream's free CubeCL slices (they are engine blocks).
//! 3. One last reservation with the engine's full path (`StreamMemory::reserve_last_resort`):
//!    its flush of every cached segment and retry (`num_alloc_retries`), then, only if that
//!    fails, the one user-visible out-of-memory: `num_ooms` once, the observers and the
//!    first-OOM snapshot once.

use cubecl_common::backtrace::BackTrace;
use cubecl_common::stream_id::StreamId;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::server::ServerError;

use super::super::driver::Driver;
use super::super::stream_memory::ReserveError;
use super::checks;
use super::layer_usage::CubeclLayerUsage;
use super::ordering::{PendingUses, synchronize_uses};
use super::streams::Streams;
use crate::alloc::{AllocError, format_bytes};

/// Reserves `size` bytes on `stream_id`; when only the engine's cache flush could help, first
/// takes back what every stream holds above the engine.
pub(super) fn reserve<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    pending: &mut PendingUses<D::Event>,
    max_binding_size: Option<u64>,
    size: u64,
    stream_id: StreamId,
) -> Result<ManagedMemoryHandle, ServerError> {
    checks::bindable(size, max_binding_size)?;
    streams.hand_back_idle(driver, stream_id);
    match streams
        .get(driver, stream_id)
        .memory
        .reserve_before_flush(size)
    {
        Ok(Some(handle)) => return Ok(handle),
        Ok(None) => {}
        Err(failure) => return Err(reserve_error(streams, size, failure)),
    }
    if let Err(err) = synchronize_uses(driver, streams, pending) {
        log::error!(
            "caching allocator: out of memory, and waiting for other streams' uses failed \
             (their buffers stay held): {err}"
        );
    }
    for id in streams.ids() {
        let stream = streams.get(driver, id);
        stream.memory.reclaim_for_oom();
    }
    streams
        .get(driver, stream_id)
        .memory
        .reserve_last_resort(size)
        .map_err(|failure| reserve_error(streams, size, failure))
}

/// The error a failed reservation reaches CubeCL with: the engine's own message for a request
/// that can never fit, and for an out-of-memory the engine's numbers with CubeCL's layer.
fn reserve_error<D: Driver>(streams: &Streams<D>, size: u64, failure: ReserveError) -> ServerError {
    match &failure.engine {
        // Refused before anything was given back (`throw_on_cudamalloc_oom`): its own words.
        Some(err @ (AllocError::TooLarge { .. } | AllocError::Rejected { .. })) => {
            return ServerError::Generic {
                reason: format!("caching allocator: {err}"),
                backtrace: BackTrace::capture(),
            };
        }
        // Not a lack of memory (a device error): said as it is.
        Some(err) if !err.is_out_of_memory() => {
            return ServerError::Generic {
                reason: format!("caching allocator: reserving {size} bytes failed: {err}"),
                backtrace: BackTrace::capture(),
            };
        }
        _ => {}
    }
    // What CubeCL's layer holds on top of the engine's numbers: its slices are engine blocks.
    let mut layer = CubeclLayerUsage::default();
    for stream in streams.all() {
        layer.add_stream(&stream.memory.usage(), stream.memory.counters());
    }
    ServerError::Generic {
        reason: format!(
            "caching allocator: out of memory while reserving {size} bytes after returning \
             every free CubeCL slice to the allocator: {failure} CubeCL's layer holds {} in \
             {} live slices ({} of tensors, {} of alignment padding) and {} in free slices, \
             all counted as allocated by the engine.",
            format_bytes(layer.tensor_bytes + layer.padding_bytes),
            layer.live_slices,
            format_bytes(layer.tensor_bytes),
            format_bytes(layer.padding_bytes),
            format_bytes(layer.cached_bytes()),
        ),
        backtrace: BackTrace::capture(),
    }
}
