//! What `memory_stats(&device)` returns: the engine's PyTorch statistics plus CubeCL's layer.

use std::collections::BTreeMap;

use crate::alloc::MemoryStats;
use crate::device::MemoryInfo;
use crate::runtime::CubeclLayerUsage;

/// Memory statistics of one device, with PyTorch's meanings.
///
/// Two layers hold memory (see the crate README): CubeCL's persistent pool keeps freed slices
/// for the next tensor of the same size, and the engine owns the device segments. Each layer's
/// cache is reported under its own name.
#[derive(Clone, Debug)]
pub struct CachingMemoryStats {
    /// The engine's full PyTorch statistics (allocation, segment, active, ..., each current,
    /// peak, allocated, freed, for all/small/large pools). The engine's "allocated" includes the
    /// slices CubeCL keeps cached.
    pub engine: MemoryStats,
    /// CubeCL's persistent pools, summed over streams.
    pub cubecl: CubeclLayerUsage,
    /// Free and total bytes as the device reports them.
    pub device: MemoryInfo,
}

impl CachingMemoryStats {
    /// Bytes of live tensors (PyTorch's `memory_allocated`).
    pub fn memory_allocated(&self) -> u64 {
        self.cubecl.live_bytes
    }

    /// Bytes of the engine's device segments (PyTorch's `memory_reserved`).
    pub fn memory_reserved(&self) -> u64 {
        self.engine.memory_reserved()
    }

    /// Peak of [`Self::memory_reserved`] since the last `reset_peak_memory_stats`.
    pub fn max_memory_reserved(&self) -> u64 {
        self.engine.max_memory_reserved()
    }

    /// Bytes in free CubeCL slices: kept for the next tensor of exactly the same size.
    pub fn cached_in_cubecl(&self) -> u64 {
        self.cubecl.cached_bytes()
    }

    /// Bytes in free engine blocks: placed by PyTorch's rules for any later request.
    pub fn cached_in_engine(&self) -> u64 {
        self.engine
            .memory_reserved()
            .saturating_sub(self.engine.memory_allocated())
    }

    /// Every number by name: the engine's PyTorch names (`allocated_bytes.all.current`, ...),
    /// then `cubecl.*`, `device.*` and the layer totals.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = self.engine.to_map();
        let c = &self.cubecl;
        for (key, value) in [
            ("cubecl.streams", c.streams),
            ("cubecl.live_slices", c.live_slices),
            ("cubecl.live_bytes", c.live_bytes),
            ("cubecl.padding_bytes", c.padding_bytes),
            ("cubecl.slice_bytes", c.slice_bytes),
            ("cubecl.cached_bytes", c.cached_bytes()),
            ("cubecl.reserves", c.reclaim.reserves),
            ("cubecl.would_grow", c.reclaim.would_grow),
            ("cubecl.pool_hits", c.reclaim.pool_hits),
            ("cubecl.placement_reclaims", c.reclaim.placement_reclaims),
            ("cubecl.productive_reclaims", c.reclaim.productive_reclaims),
            ("cubecl.reclaims", c.reclaim.reclaims),
            ("cubecl.growth_reclaims", c.reclaim.growth_reclaims),
            ("cubecl.skipped_reclaims", c.reclaim.skipped_reclaims),
            ("cubecl.oom_reclaims", c.reclaim.oom_reclaims),
            ("cubecl.reclaim_work", c.reclaim.reclaim_work),
            ("device.free", self.device.free),
            ("device.total", self.device.total),
            ("memory_allocated", self.memory_allocated()),
            ("memory_reserved", self.memory_reserved()),
            ("cached_in_cubecl", self.cached_in_cubecl()),
            ("cached_in_engine", self.cached_in_engine()),
        ] {
            map.insert(key.to_string(), crate::alloc::signed(value));
        }
        map
    }
}
