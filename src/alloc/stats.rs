//! Statistics with PyTorch's names and meanings.
//!
//! Each [`Stat`] keeps the current value, its peak since the last reset, and the cumulative
//! amounts added and removed. Each [`StatArray`] keeps one for all pools and one per pool.
//! [`MemoryStats::to_map`] gives the flat keys of `torch.cuda.memory_stats()`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::size::PoolKind;

/// One statistic: current, peak, and cumulative increases (`allocated`) and decreases (`freed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// The value now (PyTorch's `current`).
    pub current: u64,
    /// The highest value since the last peak reset (PyTorch's `peak`).
    pub peak: u64,
    /// The sum of all increases since accumulated stats were last reset (PyTorch's `allocated`).
    pub allocated: u64,
    /// The sum of all decreases since accumulated stats were last reset (PyTorch's `freed`).
    pub freed: u64,
}

impl Stat {
    /// Adds `amount` to the current value, raising the peak if needed.
    pub fn increase(&mut self, amount: u64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount;
    }

    /// Subtracts `amount` from the current value.
    pub fn decrease(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "statistic would go negative");
        self.current = self.current.saturating_sub(amount);
        self.freed += amount;
    }

    /// Applies a signed change as an increase or a decrease.
    pub fn change(&mut self, delta: i64) {
        if delta >= 0 {
            self.increase(delta as u64);
        } else {
            self.decrease(delta.unsigned_abs());
        }
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    fn insert_into(&self, map: &mut BTreeMap<String, i64>, prefix: &str) {
        map.insert(format!("{prefix}.current"), signed(self.current));
        map.insert(format!("{prefix}.peak"), signed(self.peak));
        map.insert(format!("{prefix}.allocated"), signed(self.allocated));
        map.insert(format!("{prefix}.freed"), signed(self.freed));
    }
}

/// A statistic for all pools together and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatArray {
    /// Both pools together (PyTorch's `all`).
    pub all: Stat,
    /// The small pool (PyTorch's `small_pool`).
    pub small_pool: Stat,
    /// The large pool (PyTorch's `large_pool`).
    pub large_pool: Stat,
}

impl StatArray {
    /// The statistic of one pool.
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    /// Increases `all` and `pool`'s statistic by `amount`.
    pub fn increase(&mut self, pool: PoolKind, amount: u64) {
        self.all.increase(amount);
        self.pool_mut(pool).increase(amount);
    }

    /// Decreases `all` and `pool`'s statistic by `amount`.
    pub fn decrease(&mut self, pool: PoolKind, amount: u64) {
        self.all.decrease(amount);
        self.pool_mut(pool).decrease(amount);
    }

    /// Applies a signed change to `all` and `pool`'s statistic.
    pub fn change(&mut self, pool: PoolKind, delta: i64) {
        self.all.change(delta);
        self.pool_mut(pool).change(delta);
    }

    fn each_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }

    fn insert_into(&self, map: &mut BTreeMap<String, i64>, name: &str) {
        self.all.insert_into(map, &format!("{name}.all"));
        self.small_pool
            .insert_into(map, &format!("{name}.small_pool"));
        self.large_pool
            .insert_into(map, &format!("{name}.large_pool"));
    }
}

/// Everything the allocator counts, named as in `torch.cuda.memory_stats()`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Live allocations (count).
    pub allocation: StatArray,
    /// Device segments held (count).
    pub segment: StatArray,
    /// Allocated blocks plus freed blocks still waiting on a stream event (count).
    pub active: StatArray,
    /// Free blocks inside segments that are split (count): fragmentation.
    pub inactive_split: StatArray,
    /// Bytes in live allocations (block sizes).
    pub allocated_bytes: StatArray,
    /// Bytes in device segments.
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for (before rounding).
    pub requested_bytes: StatArray,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Times the cache was flushed to retry a failed device allocation.
    pub num_alloc_retries: u64,
    /// Requests that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times pending stream events were all synchronized.
    pub num_sync_all_streams: u64,
    /// Segments allocated from the device.
    pub num_device_alloc: u64,
    /// Segments returned to the device.
    pub num_device_free: u64,
    /// The configured `max_split_size` in bytes, -1 when unlimited (PyTorch's int64 value).
    pub max_split_size: i64,
}

impl MemoryStats {
    /// Bytes held by live allocations: `torch.cuda.memory_allocated()`.
    pub fn memory_allocated(&self) -> u64 {
        self.allocated_bytes.all.current
    }

    /// Bytes held in device segments: `torch.cuda.memory_reserved()`.
    pub fn memory_reserved(&self) -> u64 {
        self.reserved_bytes.all.current
    }

    /// Peak of `memory_allocated` since the last peak reset.
    pub fn max_memory_allocated(&self) -> u64 {
        self.allocated_bytes.all.peak
    }

    /// Peak of `memory_reserved` since the last peak reset.
    pub fn max_memory_reserved(&self) -> u64 {
        self.reserved_bytes.all.peak
    }

    /// Reserved bytes that no live allocation uses.
    pub fn memory_cached(&self) -> u64 {
        self.memory_reserved() - self.memory_allocated()
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for array in self.arrays_mut() {
            for stat in array.each_mut() {
                stat.reset_peak();
            }
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Zeroes every cumulative amount and counter.
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            for stat in array.each_mut() {
                stat.reset_accumulated();
            }
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// PyTorch's flat keys and values (int64, as `torch.cuda.memory_stats()` gives them):
    /// `allocated_bytes.all.current`, `num_ooms`, ..., `max_split_size` (-1 when unlimited).
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        let arrays = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, array) in arrays {
            array.insert_into(&mut map, name);
        }
        self.oversize_allocations
            .insert_into(&mut map, "oversize_allocations");
        self.oversize_segments
            .insert_into(&mut map, "oversize_segments");
        map.insert("num_alloc_retries".into(), signed(self.num_alloc_retries));
        map.insert("num_ooms".into(), signed(self.num_ooms));
        map.insert(
            "num_sync_all_streams".into(),
            signed(self.num_sync_all_streams),
        );
        map.insert("num_device_alloc".into(), signed(self.num_device_alloc));
        map.insert("num_device_free".into(), signed(self.num_device_free));
        map.insert("max_split_size".into(), self.max_split_size);
        map
    }
}

/// A count or byte amount as PyTorch's int64 (amounts never come near `i64::MAX`).
pub(crate) fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
