//! The numbers of a driver's pinned host pool (the CUDA backend's staging buffers for uploads
//! and reads), for `memory_stats` (its `host_*` keys) and `memory_summary`.
//!
//! They are PyTorch's `torch.cuda.host_memory_stats()` (`HostStats`, in
//! ATen/core/CachingHostAllocator.h): buffers handed out (`allocation`, `allocated_bytes`),
//! pinned allocations held (`segment`, `reserved_bytes`), and the time spent allocating and
//! freeing pinned memory (`host_alloc_time`, `host_free_time`). A driver without a pinned pool
//! (wgpu) has none of them.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::alloc::{Stat, signed};

/// Calls of one driver function and the time they took (PyTorch's `DurationStat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallTime {
    /// The time of every call together.
    pub total: Duration,
    /// The longest call.
    pub max: Duration,
    /// The shortest call (zero before the first).
    pub min: Duration,
    /// How many calls.
    pub count: u64,
}

impl CallTime {
    // Used by CUDA's pinned staging pool only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// Counts a call that took `took`.
    pub(crate) fn add(&mut self, took: Duration) {
        self.min = if self.count == 0 {
            took
        } else {
            self.min.min(took)
        };
        self.max = self.max.max(took);
        self.total += took;
        self.count += 1;
    }

    /// PyTorch's keys, in microseconds: `{prefix}.total`, `.max`, `.min`, `.count`, `.avg`.
    fn insert_into(&self, map: &mut BTreeMap<String, i64>, prefix: &str) {
        let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
        let avg = self
            .total
            .checked_div(self.count as u32)
            .unwrap_or_default();
        map.insert(format!("{prefix}.total"), micros(self.total));
        map.insert(format!("{prefix}.max"), micros(self.max));
        map.insert(format!("{prefix}.min"), micros(self.min));
        map.insert(format!("{prefix}.count"), signed(self.count));
        map.insert(format!("{prefix}.avg"), micros(avg));
    }
}

/// A pinned host pool's statistics, with PyTorch's `HostStats` meanings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PinnedHostStats {
    /// Buffers handed out to copies and not given back yet (PyTorch's `allocation`).
    pub allocation: Stat,
    /// Pinned allocations held: `cuMemHostAlloc` calls not freed yet, the up-front reservation
    /// included (PyTorch's `segment`).
    pub segment: Stat,
    /// Bytes of the buffers handed out, each counted at its capacity (PyTorch's
    /// `allocated_bytes`).
    pub allocated_bytes: Stat,
    /// Pinned bytes held: in use, idle, and the reservation (PyTorch's `reserved_bytes`).
    pub reserved_bytes: Stat,
    /// Bytes of the up-front reservation (`pinned_reserve_segment_size_mb`; 0 without one).
    pub reserve_segment_bytes: u64,
    /// Time spent in `cuMemHostAlloc` (PyTorch's `host_alloc_time`).
    pub host_alloc_time: CallTime,
    /// Time spent in `cuMemFreeHost` (PyTorch's `host_free_time`).
    pub host_free_time: CallTime,
}

impl PinnedHostStats {
    /// Pinned bytes held and not in use: idle buffers and what is left of the reservation.
    pub fn cached_bytes(&self) -> u64 {
        self.reserved_bytes
            .current
            .saturating_sub(self.allocated_bytes.current)
    }

    /// `cuMemHostAlloc` calls (PyTorch's `num_host_alloc`).
    pub fn num_host_alloc(&self) -> u64 {
        self.segment.allocated
    }

    /// `cuMemFreeHost` calls (PyTorch's `num_host_free`).
    pub fn num_host_free(&self) -> u64 {
        self.segment.freed
    }

    // Used by CUDA's pinned staging pool only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// Every peak to its current value.
    pub(crate) fn reset_peaks(&mut self) {
        for stat in self.stats_mut() {
            stat.reset_peak();
        }
    }

    // Used by CUDA's pinned staging pool only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// Every cumulative amount and timing to zero.
    pub(crate) fn reset_accumulated(&mut self) {
        for stat in self.stats_mut() {
            stat.reset_accumulated();
        }
        self.host_alloc_time = CallTime::default();
        self.host_free_time = CallTime::default();
    }

    // Used by CUDA's pinned staging pool only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn stats_mut(&mut self) -> [&mut Stat; 4] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
        ]
    }

    /// The `host_*` keys of `memory_stats`: PyTorch's `host_memory_stats()` names behind
    /// `host_` (`host_allocation.current`, `host_reserved_bytes.peak`, ...), its timings
    /// (`host_alloc_time.*`, `host_free_time.*`, microseconds), `num_host_alloc`,
    /// `num_host_free`, and ours: `host_cached_bytes`, `host_reserve_segment_bytes`.
    pub fn insert_into(&self, map: &mut BTreeMap<String, i64>) {
        self.allocation.insert_into(map, "host_allocation");
        self.segment.insert_into(map, "host_segment");
        self.allocated_bytes
            .insert_into(map, "host_allocated_bytes");
        self.reserved_bytes.insert_into(map, "host_reserved_bytes");
        self.host_alloc_time.insert_into(map, "host_alloc_time");
        self.host_free_time.insert_into(map, "host_free_time");
        for (key, value) in [
            ("num_host_alloc", self.num_host_alloc()),
            ("num_host_free", self.num_host_free()),
            ("host_cached_bytes", self.cached_bytes()),
            ("host_reserve_segment_bytes", self.reserve_segment_bytes),
        ] {
            map.insert(key.to_string(), signed(value));
        }
    }
}

/// A driver's pinned host pool as the user API reads it, from any thread.
pub trait PinnedHostPool: Send + Sync + core::fmt::Debug {
    /// The statistics now.
    fn stats(&self) -> PinnedHostStats;
    /// Sets every peak to its current value (`reset_peak_memory_stats`).
    fn reset_peak_stats(&self);
    /// Zeroes every cumulative amount and timing (`reset_accumulated_memory_stats`).
    fn reset_accumulated_stats(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_times_keep_min_max_total_and_count() {
        let mut time = CallTime::default();
        time.add(Duration::from_micros(30));
        time.add(Duration::from_micros(10));
        time.add(Duration::from_micros(20));
        assert_eq!(time.min, Duration::from_micros(10));
        assert_eq!(time.max, Duration::from_micros(30));
        assert_eq!(time.total, Duration::from_micros(60));
        assert_eq!(time.count, 3);
        let mut map = BTreeMap::new();
        time.insert_into(&mut map, "t");
        assert_eq!(map["t.avg"], 20);
        assert_eq!(map["t.total"], 60);
    }
}
