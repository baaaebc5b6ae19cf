//! Stock CubeCL's reserved bytes on a device, read as the side-by-side benchmark reads them
//! (`bench-burn/src/reading.rs`): CubeCL's `memory_usage` reports the calling thread's stream
//! only, and every thread has a stream slot with pools of its own, so the sum runs over every
//! slot a thread may have used.

use cubecl_common::stream_id::StreamId;
use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_runtime::runtime::Runtime;

/// The bytes `R`'s stock memory management reserves on `device`, over every stream slot: CubeCL
/// gives each thread the next stream id at its first use and maps id `i` to slot
/// `i % max_streams`.
pub fn stock_reserved<R: Runtime>(device: &R::Device) -> u64 {
    let client = R::client(device);
    let next = std::thread::spawn(|| StreamId::current().value)
        .join()
        .expect("a thread that reads its stream id");
    let max_streams = CubeClRuntimeConfig::get().streaming.max_streams as u64;
    (0..next.min(max_streams))
        .map(|value| {
            StreamId { value }.executes(|| {
                client
                    .memory_usage()
                    .map(|usage| usage.bytes_reserved)
                    .unwrap_or(0)
            })
        })
        .sum()
}
