//! CubeCL's layer of a device in numbers: what the persistent pools of all streams hold, and
//! what their reservations did. The server sums it at every `memory_usage`; `memory_stats`
//! reports it beside the engine's statistics.

use super::super::stream_memory::ReclaimCounters;

/// CubeCL's layer of a device, summed over its streams: the persistent pools' slices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CubeclLayerUsage {
    /// Streams with a memory manager.
    pub streams: u64,
    /// New threads given the idle slot of an earlier thread (its stream, its CubeCL pool and
    /// its engine cache) instead of a slot of their own, so far.
    pub slot_reuses: u64,
    /// Slices held by live tensors.
    pub live_slices: u64,
    /// Bytes of live tensors' slices (what CubeCL calls `bytes_in_use`: each tensor's size
    /// padded to CubeCL's alignment, as the streams reserve them).
    pub tensor_bytes: u64,
    /// Alignment padding CubeCL adds to live slices (0: the streams reserve padded sizes).
    pub padding_bytes: u64,
    /// Bytes of all slices, live or free (each one an engine block).
    pub slice_bytes: u64,
    /// Free slices a reading found (their blocks read as cache, not allocated).
    pub free_slices: u64,
    /// Their engine blocks' bytes.
    pub free_slice_bytes: u64,
    /// What the streams' reservations did (reclaims, their work, ...), summed.
    pub reclaim: ReclaimCounters,
}

impl CubeclLayerUsage {
    /// Bytes of the engine blocks of the free slices a reading found: cached by CubeCL's
    /// exact-size reuse, live blocks to the engine, read as cache. 0 in a layer not taken by
    /// a reading.
    pub fn cached_bytes(&self) -> u64 {
        self.free_slice_bytes
    }

    /// Adds one stream's pool usage and counters.
    pub(super) fn add_stream(
        &mut self,
        usage: &cubecl_runtime::memory_management::MemoryUsage,
        counters: ReclaimCounters,
    ) {
        self.streams += 1;
        self.live_slices += usage.number_allocs;
        self.tensor_bytes += usage.bytes_in_use;
        self.padding_bytes += usage.bytes_padding;
        self.slice_bytes += usage.bytes_reserved;
        let r = &mut self.reclaim;
        r.reserves += counters.reserves;
        r.pool_hits += counters.pool_hits;
        r.reclaims += counters.reclaims;
        r.reclaim_work += counters.reclaim_work;
    }
}
