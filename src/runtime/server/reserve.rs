//! Reserving a slice for a new tensor, with the out-of-memory path across streams: the stream's
//! own reservation already handed its free slices back to the engine and retried; if it still
//! fails, every other stream's free slices go back too (they are engine blocks), and the
//! reservation is tried once more before the error is reported.

use cubecl_common::backtrace::BackTrace;
use cubecl_common::stream_id::StreamId as CubeStreamId;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::server::ServerError;

use super::super::driver::Driver;
use super::checks;
use super::layer_usage::CubeclLayerUsage;
use super::streams::Streams;
use crate::alloc::format_bytes;

/// Reserves `size` bytes on `stream_id`, reclaiming other streams' free slices on failure.
pub(super) fn reserve<D: Driver>(
    driver: &mut D,
    streams: &mut Streams<D>,
    max_binding_size: Option<u64>,
    size: u64,
    stream_id: CubeStreamId,
) -> Result<ManagedMemoryHandle, ServerError> {
    checks::bindable(size, max_binding_size)?;
    let failure = match streams.get(driver, stream_id).memory.reserve(size) {
        Ok(handle) => return Ok(handle),
        Err(failure) => failure,
    };
    if streams.len() > 1 {
        for stream in streams.others(stream_id) {
            stream.memory.reclaim();
        }
        if let Ok(handle) = streams.get(driver, stream_id).memory.retry_reserve(size) {
            return Ok(handle);
        }
    }
    // What CubeCL's layer holds on top of the engine's numbers: its slices are engine blocks.
    let mut layer = CubeclLayerUsage::default();
    for stream in streams.all() {
        layer.add_stream(&stream.memory.usage(), stream.memory.counters());
    }
    Err(ServerError::Generic {
        reason: format!(
            "caching allocator: out of memory while reserving {size} bytes after returning \
             every free CubeCL slice to the allocator: {failure} CubeCL's layer holds {} in \
             {} live slices ({} of tensors, {} of alignment padding) and {} in free slices, \
             all counted as allocated by the engine.",
            format_bytes(layer.live_bytes + layer.padding_bytes),
            layer.live_slices,
            format_bytes(layer.live_bytes),
            format_bytes(layer.padding_bytes),
            format_bytes(layer.cached_bytes()),
        ),
        backtrace: BackTrace::capture(),
    })
}
