//! What `memory_stats(&device)` returns: PyTorch's statistics plus CubeCL's layer.

use std::collections::BTreeMap;

use crate::alloc::MemoryStats;
use crate::device::MemoryInfo;
use crate::runtime::{CubeclLayerUsage, PinnedHostStats};

/// Memory statistics of one device, with PyTorch's meanings.
///
/// Two layers hold memory (see the guide, `docs/src/using.md`): CubeCL's persistent pool
/// keeps freed slices for the next tensor of the same size, and the engine owns the device
/// segments. The engine's statistics ([`Self::engine`]) are read with CubeCL's free slices
/// counted as cache (they stay where they are, so reading changes nothing), so they are
/// PyTorch's: "allocated" is what live tensors hold.
///
/// ```no_run
/// # use burn_caching_alloc::backend::{self, CachingDevice};
/// # fn example<D: CachingDevice>(device: D) {
/// let stats = backend::memory_stats(&device);
/// println!("allocated {} (peak {}), reserved {} (peak {})", stats.memory_allocated(),
///     stats.max_memory_allocated(), stats.memory_reserved(), stats.max_memory_reserved());
/// println!("live tensors asked for {} B; cached: {} B in CubeCL, {} B in the engine",
///     stats.tensor_bytes(), stats.cached_in_cubecl(), stats.cached_in_engine());
/// for (key, value) in stats.to_map() {
///     println!("{key}: {value}"); // torch.cuda.memory_stats()'s keys, then ours
/// }
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct CachingMemoryStats {
    /// PyTorch's full statistics (allocation, segment, active, ..., each current, peak,
    /// allocated, freed, for all/small/large pools), as the engine keeps them, with the blocks
    /// of CubeCL's free slices read as cache: `allocated_bytes.*.current` and
    /// `active_bytes.*.current` are the live tensors' blocks, `requested_bytes.*.current` the
    /// bytes they asked for; the accumulated amounts are what reached the engine. Peaks are the engine's: between two reads they may include slices
    /// CubeCL had cached (an upper bound of the live tensors' peak).
    pub engine: MemoryStats,
    /// CubeCL's persistent pools, summed over streams, when the call was made
    /// ([`CubeclLayerUsage::cached_bytes`]: what CubeCL caches in free slices).
    pub cubecl: CubeclLayerUsage,
    /// Free and total bytes as the device reports them.
    pub device: MemoryInfo,
    /// The pinned host pool that stages uploads and reads (PyTorch's
    /// `torch.cuda.host_memory_stats()`), on a backend that has one (CUDA); `None` on wgpu.
    pub host: Option<PinnedHostStats>,
    /// Live bytes by component of a training loop (parameters, gradients, optimizer state,
    /// activations, other), when a [`Components`](super::Components) helper tracked a module
    /// or opened a scope on this device; `None` otherwise.
    pub components: Option<super::ComponentBytes>,
}

impl CachingMemoryStats {
    /// Bytes of live tensors' blocks (PyTorch's `memory_allocated`, the same number as
    /// `allocated_bytes.all.current`).
    pub fn memory_allocated(&self) -> u64 {
        self.engine.memory_allocated()
    }

    /// Peak of [`Self::memory_allocated`] since the last `reset_peak_memory_stats` (PyTorch's
    /// `max_memory_allocated`; see [`Self::engine`] for what the peak covers).
    pub fn max_memory_allocated(&self) -> u64 {
        self.engine.max_memory_allocated()
    }

    /// Bytes of the engine's device segments (PyTorch's `memory_reserved`).
    pub fn memory_reserved(&self) -> u64 {
        self.engine.memory_reserved()
    }

    /// Peak of [`Self::memory_reserved`] since the last `reset_peak_memory_stats`.
    pub fn max_memory_reserved(&self) -> u64 {
        self.engine.max_memory_reserved()
    }

    /// Bytes of the live tensors' slices (each tensor's size padded to CubeCL's alignment,
    /// before the engine's 512-byte rounding).
    pub fn tensor_bytes(&self) -> u64 {
        self.cubecl.tensor_bytes
    }

    /// Bytes CubeCL holds in free slices (kept for the next tensor of exactly the same size),
    /// in engine blocks: reserved, neither allocated nor free in the engine.
    pub fn cached_in_cubecl(&self) -> u64 {
        self.cubecl.cached_bytes()
    }

    /// Bytes of free engine blocks, placed by PyTorch's rules for any later request:
    /// `memory_reserved = memory_allocated + cached_in_cubecl + cached_in_engine`.
    pub fn cached_in_engine(&self) -> u64 {
        self.engine
            .memory_reserved()
            .saturating_sub(self.engine.memory_allocated())
            .saturating_sub(self.cached_in_cubecl())
    }

    /// Every number by name: PyTorch's names (`allocated_bytes.all.current`, ...), then
    /// `scope.<name>.allocated_bytes.*` per memory scope, `component_bytes.*` when components
    /// are tracked, `cubecl.*` (CubeCL's layer), `device.*`, the layer
    /// totals, and on
    /// CUDA the pinned host pool's `host_*` keys ([`PinnedHostStats::insert_into`]).
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = self.engine.to_map();
        if let Some(host) = &self.host {
            host.insert_into(&mut map);
        }
        if let Some(components) = &self.components {
            for (key, value) in components.entries() {
                map.insert(key.to_string(), crate::alloc::signed(value));
            }
        }
        let c = &self.cubecl;
        for (key, value) in [
            ("cubecl.streams", c.streams),
            ("cubecl.slot_reuses", c.slot_reuses),
            ("cubecl.live_slices", c.live_slices),
            ("cubecl.tensor_bytes", c.tensor_bytes),
            ("cubecl.padding_bytes", c.padding_bytes),
            ("cubecl.slice_bytes", c.slice_bytes),
            ("cubecl.cached_bytes", c.cached_bytes()),
            ("cubecl.free_slices", c.free_slices),
            ("cubecl.reserves", c.reclaim.reserves),
            ("cubecl.pool_hits", c.reclaim.pool_hits),
            ("cubecl.reclaims", c.reclaim.reclaims),
            ("cubecl.reclaim_work", c.reclaim.reclaim_work),
            ("device.free", self.device.free),
            ("device.total", self.device.total),
            ("memory_allocated", self.memory_allocated()),
            ("max_memory_allocated", self.max_memory_allocated()),
            ("memory_reserved", self.memory_reserved()),
            ("max_memory_reserved", self.max_memory_reserved()),
            ("tensor_bytes", self.tensor_bytes()),
            ("cached_in_cubecl", self.cached_in_cubecl()),
            ("cached_in_engine", self.cached_in_engine()),
        ] {
            map.insert(key.to_string(), crate::alloc::signed(value));
        }
        map
    }
}
