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
    /// Bytes of live tensors (what CubeCL calls `bytes_in_use`).
    pub tensor_bytes: u64,
    /// Alignment padding of live slices.
    pub padding_bytes: u64,
    /// Bytes of all slices, live or free (each one an engine block).
    pub slice_bytes: u64,
    /// What the streams' reservations did (reclaims, their work, ...), summed.
    pub reclaim: ReclaimCounters,
}

impl CubeclLayerUsage {
    /// Bytes in free slices: cached by CubeCL's exact-size reuse, allocated in the engine.
    pub fn cached_bytes(&self) -> u64 {
        self.slice_bytes
            .saturating_sub(self.tensor_bytes + self.padding_bytes)
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
        r.placement_reclaims += counters.placement_reclaims;
        r.productive_reclaims += counters.productive_reclaims;
        r.would_grow += counters.would_grow;
        r.reclaims += counters.reclaims;
        r.growth_reclaims += counters.growth_reclaims;
        r.skipped_reclaims += counters.skipped_reclaims;
        r.oom_reclaims += counters.oom_reclaims;
        r.idle_reclaims += counters.idle_reclaims;
        r.reclaim_work += counters.reclaim_work;
    }
}
