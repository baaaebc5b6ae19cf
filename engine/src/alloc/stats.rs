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

    /// Sets the peak to the current value (`reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Zeroes the cumulative counts (`reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    /// Writes the four values under `prefix` (`prefix.current`, `.peak`, `.allocated`,
    /// `.freed`), as PyTorch's `memory_stats()` keys.
    pub fn insert_into(&self, map: &mut BTreeMap<String, i64>, prefix: &str) {
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

    pub(crate) fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    /// Increases `all` and `pool`'s statistic by `amount`.
    pub(crate) fn increase(&mut self, pool: PoolKind, amount: u64) {
        self.all.increase(amount);
        self.pool_mut(pool).increase(amount);
    }

    /// Decreases `all` and `pool`'s statistic by `amount`.
    pub(crate) fn decrease(&mut self, pool: PoolKind, amount: u64) {
        self.all.decrease(amount);
        self.pool_mut(pool).decrease(amount);
    }

    /// Moves `amount` from pool `from` to pool `to`; `all` does not change (a segment that
    /// changes pools is neither new nor returned device memory).
    pub(crate) fn transfer(&mut self, from: PoolKind, to: PoolKind, amount: u64) {
        self.pool_mut(from).decrease(amount);
        self.pool_mut(to).increase(amount);
    }

    /// Applies a signed change to `all` and `pool`'s statistic.
    pub(crate) fn change(&mut self, pool: PoolKind, delta: i64) {
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
    /// Misses served from the other pool's free memory instead of a device allocation
    /// (`pool_borrowing`; not a PyTorch statistic).
    #[serde(default)]
    pub num_pool_borrows: u64,
    /// Misses served from a wholly free segment another stream cached, instead of a device
    /// allocation (`cross_stream_reuse`; not a PyTorch statistic).
    #[serde(default)]
    pub num_stream_shares: u64,
    /// Misses served from a free block another stream cached, lent without moving its
    /// segment (`cross_stream_reuse`; not a PyTorch statistic).
    #[serde(default)]
    pub num_stream_lends: u64,
    /// Requests refused at once, without flushing the cache, because their new device memory
    /// would take reserved memory over the memory fraction's cap (`throw_on_cudamalloc_oom`;
    /// PyTorch's `num_oom_rejections`). Not counted in `num_ooms`.
    #[serde(default)]
    pub num_oom_rejections: u64,
    /// The configured `max_split_size` in bytes, -1 when unlimited (PyTorch's int64 value).
    pub max_split_size: i64,
    /// Bytes of live allocations per memory scope (`alloc::Tag`), by the scope's name: the
    /// block sizes of the allocations made inside it (the innermost scope's, when scopes nest)
    /// and not yet freed. A scope stays listed once it allocated (its peak matters).
    /// `to_map` names them `scope.<name>.allocated_bytes.{current,peak,allocated,freed}`.
    /// Not a PyTorch statistic.
    #[serde(default)]
    pub scopes: BTreeMap<String, Stat>,
    /// The free memory's shape when the statistics were read: per pool, the free bytes and
    /// the largest free block, from which [`PoolFree::fragmentation`]. A reading, not a
    /// running count (RMM's and XLA's fragmentation measure; not a PyTorch statistic).
    #[serde(default)]
    pub free_space: FreeSpace,
}

/// Free memory of one pool (or of both): what the engine could hand out without new device
/// memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolFree {
    /// Bytes in free blocks (unmapped address space of expandable segments left out; freed
    /// blocks still waiting for another stream's event are not free yet).
    pub free_bytes: u64,
    /// The largest free block.
    pub largest_free_block: u64,
}

impl PoolFree {
    /// `1 - largest free block / free bytes`: 0 when all free memory is one block (or there
    /// is none), near 1 when it is scattered in many small ones. A request larger than the
    /// largest free block needs new device memory whatever the free bytes are.
    pub fn fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block as f64 / self.free_bytes as f64
        }
    }

    /// Counts a free block of `size` bytes.
    pub(crate) fn add(&mut self, size: u64) {
        self.free_bytes += size;
        self.largest_free_block = self.largest_free_block.max(size);
    }
}

/// [`PoolFree`] of both pools together and of each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeSpace {
    /// Both pools.
    pub all: PoolFree,
    /// The small pool.
    pub small_pool: PoolFree,
    /// The large pool.
    pub large_pool: PoolFree,
}

impl FreeSpace {
    /// Counts a free block of `size` bytes of `pool`.
    pub(crate) fn add(&mut self, pool: PoolKind, size: u64) {
        self.all.add(size);
        match pool {
            PoolKind::Small => self.small_pool.add(size),
            PoolKind::Large => self.large_pool.add(size),
        }
    }

    fn insert_into(&self, map: &mut BTreeMap<String, i64>) {
        for (name, pool) in [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ] {
            map.insert(format!("free_bytes.{name}"), signed(pool.free_bytes));
            map.insert(
                format!("largest_free_block.{name}"),
                signed(pool.largest_free_block),
            );
        }
    }
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

    /// Reserved bytes that no live allocation uses (`memory_reserved - memory_allocated`).
    /// Not PyTorch's deprecated `memory_cached`, which meant reserved bytes. Saturating: stats
    /// read back from a file may say anything.
    pub fn cached_in_engine(&self) -> u64 {
        self.memory_reserved()
            .saturating_sub(self.memory_allocated())
    }

    /// Calls `f` on every [`Stat`]: each pool's of every array, and the single ones.
    fn for_each_stat(&mut self, f: impl Fn(&mut Stat)) {
        for array in &ARRAYS {
            (array.get_mut)(self).each_mut().into_iter().for_each(&f);
        }
        for single in &SINGLES {
            f((single.get_mut)(self));
        }
        self.scopes.values_mut().for_each(&f);
    }

    /// Sets every peak to its current value.
    pub(crate) fn reset_peak(&mut self) {
        self.for_each_stat(Stat::reset_peak);
    }

    /// Zeroes every cumulative amount and counter.
    pub(crate) fn reset_accumulated(&mut self) {
        self.for_each_stat(Stat::reset_accumulated);
        for counter in &COUNTERS {
            *(counter.get_mut)(self) = 0;
        }
    }

    /// PyTorch's flat keys and values (int64, as `torch.cuda.memory_stats()` gives them):
    /// `allocated_bytes.all.current`, `num_ooms`, ..., `max_split_size` (-1 when unlimited).
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        for array in &ARRAYS {
            (array.get)(self).insert_into(&mut map, array.key);
        }
        for single in &SINGLES {
            (single.get)(self).insert_into(&mut map, single.key);
        }
        for counter in &COUNTERS {
            map.insert(counter.key.into(), signed(*(counter.get)(self)));
        }
        map.insert("max_split_size".into(), self.max_split_size);
        for (name, stat) in &self.scopes {
            stat.insert_into(&mut map, &format!("scope.{name}.allocated_bytes"));
        }
        self.free_space.insert_into(&mut map);
        map
    }
}

/// Whether a statistic counts bytes or things (the summary shows bytes as `1.50 MiB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    Bytes,
    Count,
}

/// A [`StatArray`] of [`MemoryStats`]: its key in `torch.cuda.memory_stats()`, its row in
/// the summary, and where it is.
pub(crate) struct ArrayField {
    pub key: &'static str,
    pub label: &'static str,
    pub unit: Unit,
    pub get: fn(&MemoryStats) -> &StatArray,
    pub get_mut: fn(&mut MemoryStats) -> &mut StatArray,
}

/// A single [`Stat`] of [`MemoryStats`] (no per-pool values).
pub(crate) struct SingleField {
    pub key: &'static str,
    pub label: &'static str,
    pub get: fn(&MemoryStats) -> &Stat,
    get_mut: fn(&mut MemoryStats) -> &mut Stat,
}

/// A counter of [`MemoryStats`]; `label` names it in the summary's header, if it is there.
pub(crate) struct Counter {
    pub key: &'static str,
    pub label: Option<&'static str>,
    pub get: fn(&MemoryStats) -> &u64,
    pub get_mut: fn(&mut MemoryStats) -> &mut u64,
}

/// A row of [`ARRAYS`], [`SINGLES`] or [`COUNTERS`]: the field's name is its key.
macro_rules! field {
    ($row:ident $field:ident $(, $name:ident: $value:expr)*) => {
        $row {
            key: stringify!($field),
            $($name: $value,)*
            get: |s| &s.$field,
            get_mut: |s| &mut s.$field,
        }
    };
}

/// Every statistic array, in the summary's order (a new statistic is a new row).
pub(crate) const ARRAYS: [ArrayField; 9] = [
    field!(ArrayField allocated_bytes, label: "Allocated memory", unit: Unit::Bytes),
    field!(ArrayField active_bytes, label: "Active memory", unit: Unit::Bytes),
    field!(ArrayField requested_bytes, label: "Requested memory", unit: Unit::Bytes),
    field!(ArrayField reserved_bytes, label: "Reserved memory", unit: Unit::Bytes),
    field!(ArrayField inactive_split_bytes, label: "Non-releasable memory", unit: Unit::Bytes),
    field!(ArrayField allocation, label: "Allocations", unit: Unit::Count),
    field!(ArrayField active, label: "Active allocs", unit: Unit::Count),
    field!(ArrayField segment, label: "Reserved segments", unit: Unit::Count),
    field!(ArrayField inactive_split, label: "Non-releasable allocs", unit: Unit::Count),
];

/// Every single statistic (counts), in the summary's order.
pub(crate) const SINGLES: [SingleField; 2] = [
    field!(SingleField oversize_allocations, label: "Oversize allocations"),
    field!(SingleField oversize_segments, label: "Oversize segments"),
];

/// Every counter; the labelled ones in the summary's order, two to a line.
pub(crate) const COUNTERS: [Counter; 9] = [
    field!(Counter num_ooms, label: Some("Out-of-memory errors")),
    field!(Counter num_alloc_retries, label: Some("Device allocation retries")),
    field!(Counter num_device_alloc, label: Some("Device allocations")),
    field!(Counter num_device_free, label: Some("Device frees")),
    field!(Counter num_sync_all_streams, label: None),
    field!(Counter num_pool_borrows, label: None),
    field!(Counter num_stream_shares, label: None),
    field!(Counter num_stream_lends, label: None),
    field!(Counter num_oom_rejections, label: None),
];

/// A count or byte amount as PyTorch's int64 (amounts never come near `i64::MAX`).
pub fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
