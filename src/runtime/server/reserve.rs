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
use super::streams::Streams;

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
    Err(ServerError::Generic {
        reason: format!(
            "caching allocator: out of memory while reserving {size} bytes after returning \
             every free CubeCL slice to the allocator: {failure}"
        ),
        backtrace: BackTrace::capture(),
    })
}
