//! How each side's memory is read. Both sides are sampled the same way, after every step (once
//! the step's loss is on the host and the backend is synced): the caching side through
//! [`backend::memory_stats`] (the engine's reserved bytes: every device buffer it holds), the
//! stock side through CubeCL's `memory_usage().bytes_reserved` on the runtime's client, summed
//! over every stream slot (every page of CubeCL's pools: each slot has pools of its own, and
//! `memory_usage` reads only the calling thread's). The caching side also reports its exact
//! peak, the engine's `max_memory_reserved`, which no sampling can miss.

use burn_caching_alloc::backend::{self, CachingDevice};
use cubecl_common::stream_id::StreamId;
use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_runtime::runtime::Runtime;

/// Reads one backend's device memory.
pub trait MemoryReading {
    /// Bytes reserved from the device now.
    fn reserved(&self) -> u64;
    /// The exact highest reserved bytes since [`MemoryReading::release_and_reset`], where the
    /// allocator keeps one.
    fn exact_peak(&self) -> Option<u64>;
    /// Returns every cached byte to the device and starts a new peak (between workloads, so
    /// each starts from an empty pool).
    fn release_and_reset(&self);
}

/// The caching allocator on `device`.
#[derive(Debug, Clone)]
pub struct CachingReading<Dev: CachingDevice> {
    device: Dev,
}

impl<Dev: CachingDevice> CachingReading<Dev> {
    /// Reads the caching allocator of `device`.
    pub fn new(device: Dev) -> Self {
        Self { device }
    }
}

impl<Dev: CachingDevice> MemoryReading for CachingReading<Dev> {
    fn reserved(&self) -> u64 {
        backend::memory_stats(&self.device).memory_reserved()
    }
    fn exact_peak(&self) -> Option<u64> {
        Some(backend::memory_stats(&self.device).max_memory_reserved())
    }
    fn release_and_reset(&self) {
        backend::empty_cache(&self.device);
        backend::reset_peak_memory_stats(&self.device);
    }
}

/// A stock CubeCL runtime's client on `device`.
#[derive(Debug, Clone)]
pub struct StockReading<R: Runtime> {
    device: R::Device,
}

impl<R: Runtime> StockReading<R> {
    /// Reads CubeCL's memory management of `R` on `device`.
    pub fn new(device: R::Device) -> Self {
        Self { device }
    }
}

/// Every stream slot a thread may have used so far: CubeCL gives each thread the next stream id
/// at its first use and maps id `i` to slot `i % max_streams`.
fn used_slots() -> impl Iterator<Item = StreamId> {
    let next = std::thread::spawn(|| StreamId::current().value)
        .join()
        .expect("a thread that reads its stream id");
    let max_streams = CubeClRuntimeConfig::get().streaming.max_streams as u64;
    (0..next.min(max_streams)).map(|value| StreamId { value })
}

impl<R: Runtime> MemoryReading for StockReading<R> {
    fn reserved(&self) -> u64 {
        let client = R::client(&self.device);
        used_slots()
            .map(|slot| {
                slot.executes(|| {
                    client
                        .memory_usage()
                        .map(|usage| usage.bytes_reserved)
                        .unwrap_or(0)
                })
            })
            .sum()
    }
    fn exact_peak(&self) -> Option<u64> {
        // CubeCL 0.10 keeps no peak.
        None
    }
    fn release_and_reset(&self) {
        let client = R::client(&self.device);
        for slot in used_slots() {
            slot.executes(|| {
                // An explicit cleanup frees every free page of the slot's pools.
                client.memory_cleanup();
                // A blocking round trip: the cleanup has run.
                let _ = client.memory_usage();
            });
        }
    }
}
