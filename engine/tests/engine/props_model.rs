//! The property test's reference model of PyTorch's rules (`props.rs` runs it): the block and
//! segment sizes, the free blocks per pool and stream with their pending events, and what a
//! request must, may or must not get, predicted from the snapshot before each step. Written
//! from PyTorch's `c10/cuda/CUDACachingAllocator.cpp`, never from the engine.

use std::collections::{BTreeMap, BTreeSet};

use caching_alloc_engine::alloc::{
    Allocation, AllocatorConfig, BlockState, MemoryStats, PoolKind, RecordMode, SegmentSizing,
    Snapshot,
};

use crate::common::*;

/// The simulated device's capacity in every case.
pub(crate) const CAPACITY: u64 = 256 * MIB;

/// PyTorch's `round_size` with one `roundup_power2_divisions` value for every size.
pub(crate) fn round_size(size: u64, divisions: u64) -> u64 {
    if size < 512 {
        512
    } else if divisions > 1 && size > 512 * divisions {
        // `roundup_power2_next_division`
        if size.is_power_of_two() {
            return size;
        }
        let floor = 1u64 << (63 - size.leading_zeros());
        let step = floor / divisions;
        let down = size & !(step - 1);
        if down == size { size } else { down + step }
    } else {
        size.div_ceil(512) * 512
    }
}

/// PyTorch's `get_allocation_size`, or with `grow` (`segment_sizing:grow`, the default) a
/// mid-size segment of an eighth of the large pool's reserved bytes, at least the request, or
/// twice the request when the large pool holds free bytes, each rounded up to 2 MiB, and at
/// most 20 MiB.
pub(crate) fn segment_size(rounded: u64, grow: bool, large_reserved: u64, large_free: u64) -> u64 {
    let two = |bytes: u64| bytes.div_ceil(2 * MIB) * 2 * MIB;
    let headroom = if large_free > 0 { 2 } else { 1 };
    if rounded <= MIB {
        2 * MIB
    } else if rounded < 10 * MIB && grow {
        two(rounded * headroom)
            .max(two(large_reserved / 8))
            .min(20 * MIB)
    } else if rounded < 10 * MIB {
        20 * MIB
    } else {
        two(rounded)
    }
}

pub(crate) fn pool_of(rounded: u64) -> PoolKind {
    if rounded <= MIB {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// A free block as the allocator will see it once completed events are processed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FreeBlock {
    pub(crate) stream: u64,
    pub(crate) pool: PoolKind,
    pub(crate) address: u64,
    pub(crate) size: u64,
}

/// The reference model: what the test knows that the snapshot does not say.
pub(crate) struct Model {
    pub(crate) max_split: u64,
    pub(crate) max_non_split_rounding: u64,
    pub(crate) divisions: u64,
    /// `segment_sizing:grow`: mid-size segments grow with the large pool.
    pub(crate) grow_segments: bool,
    /// `pool_borrowing:true`: a miss borrows the other pool's free memory before new memory.
    pub(crate) pool_borrowing: bool,
    pub(crate) gc_threshold: bool,
    pub(crate) max_segment: Option<u64>,
    pub(crate) fraction: Option<f64>,
    /// Live allocations and the other streams each was recorded on.
    pub(crate) live: Vec<(Allocation<u64>, BTreeSet<u64>)>,
    /// Pending frees the model follows, by address: the streams whose events are not done.
    pub(crate) pending: BTreeMap<u64, BTreeSet<u64>>,
    /// An injected allocation failure waits for the next device allocation.
    pub(crate) alloc_failure_armed: bool,
    pub(crate) baseline: Baseline,
    /// Since the last cumulative reset: out-of-memory errors, larger-than-device errors and
    /// `empty_cache` calls.
    pub(crate) ooms: u64,
    pub(crate) too_large: u64,
    pub(crate) too_large_device: u64,
    pub(crate) empty_caches: u64,
    pub(crate) device_error_mallocs: u64,
    /// The highest current value seen of each statistic since the last peak reset.
    pub(crate) seen_peaks: BTreeMap<String, u64>,
    /// The last successful malloc while history is recorded.
    pub(crate) last_recorded_malloc: Option<(u64, u64)>,
    pub(crate) history: bool,
}

impl Model {
    pub(crate) fn new(config: &AllocatorConfig, max_segment: Option<u64>) -> Self {
        let divisions = config.roundup_power2_divisions.for_size(4 * MIB);
        Self {
            max_split: config.max_split_size.unwrap_or(u64::MAX),
            max_non_split_rounding: config.max_non_split_rounding,
            divisions,
            grow_segments: config.segment_sizing == SegmentSizing::Grow,
            pool_borrowing: config.pool_borrowing,
            gc_threshold: config.garbage_collection_threshold.is_some(),
            max_segment,
            fraction: config.memory_fraction,
            live: Vec::new(),
            pending: BTreeMap::new(),
            alloc_failure_armed: false,
            baseline: Baseline::default(),
            ooms: 0,
            too_large: 0,
            too_large_device: 0,
            empty_caches: 0,
            device_error_mallocs: 0,
            seen_peaks: BTreeMap::new(),
            last_recorded_malloc: None,
            history: config.history.enabled == RecordMode::All,
        }
    }

    pub(crate) fn limit(&self) -> u64 {
        self.fraction
            .map_or(CAPACITY, |f| ((f * CAPACITY as f64) as u64).min(CAPACITY))
    }

    /// Whether garbage collection may free segments on a miss: PyTorch's
    /// `garbage_collect_cached_blocks` runs only with a threshold **and** a memory fraction
    /// below 1.
    pub(crate) fn gc_may_run(&self) -> bool {
        self.gc_threshold && self.fraction.is_some_and(|f| f < 1.0)
    }

    /// Whether the block at `address` (pending in the snapshot) completes at the next
    /// `process_events`: `None` if the model does not follow it (a failed event record).
    pub(crate) fn completes(&self, address: u64) -> Option<bool> {
        self.pending.get(&address).map(BTreeSet::is_empty)
    }

    /// The free blocks after completed events are processed (`process_events`, then
    /// `free_block` merging each with its free neighbours), and the (stream, pool) pairs
    /// whose blocks the model cannot predict.
    pub(crate) fn settle(
        &self,
        snapshot: &Snapshot,
        all: bool,
    ) -> (Vec<FreeBlock>, BTreeSet<(u64, PoolKind)>) {
        let mut free = Vec::new();
        let mut unsure = BTreeSet::new();
        for segment in &snapshot.segments {
            let mut run: Option<FreeBlock> = None;
            for block in &segment.blocks {
                let is_free = match block.state {
                    BlockState::Inactive => true,
                    BlockState::ActiveAllocated => false,
                    BlockState::ActivePendingFree => match self.completes(block.address) {
                        Some(done) => done || all,
                        None => {
                            unsure.insert((segment.stream, segment.pool));
                            false
                        }
                    },
                };
                if is_free {
                    let r = run.get_or_insert(FreeBlock {
                        stream: segment.stream,
                        pool: segment.pool,
                        address: block.address,
                        size: 0,
                    });
                    r.size += block.size;
                } else if let Some(r) = run.take() {
                    free.push(r);
                }
            }
            free.extend(run);
        }
        (free, unsure)
    }

    /// PyTorch's `get_free_block`: the smallest free block of the stream and pool that fits
    /// (lowest address among equals), unless the `max_split_size` rules refuse it.
    pub(crate) fn best_fit(
        &self,
        free: &[FreeBlock],
        stream: u64,
        rounded: u64,
    ) -> Option<FreeBlock> {
        let pool = pool_of(rounded);
        let best = free
            .iter()
            .filter(|b| b.stream == stream && b.pool == pool && b.size >= rounded)
            .min_by_key(|b| (b.size, b.address))
            .copied()?;
        if rounded < self.max_split && best.size >= self.max_split {
            return None;
        }
        if rounded >= self.max_split
            && best.size >= rounded.saturating_add(self.max_non_split_rounding)
        {
            return None;
        }
        Some(best)
    }

    /// The sizes the allocated block may have when a block of `block` bytes serves a request
    /// of `rounded` bytes in its own pool: PyTorch's `should_split`: the large-pool test
    /// compares the *request* with `max_split_size`.
    pub(crate) fn allocated_sizes(&self, block: u64, rounded: u64) -> Vec<u64> {
        self.allocated_sizes_in(pool_of(rounded), block, rounded)
    }

    /// [`Self::allocated_sizes`] for a block of `pool` (a borrowed block splits by its pool's
    /// rule, not the request's).
    pub(crate) fn allocated_sizes_in(&self, pool: PoolKind, block: u64, rounded: u64) -> Vec<u64> {
        let remaining = block - rounded;
        let split = |max_split_test: u64| match pool {
            PoolKind::Small => remaining >= 512,
            PoolKind::Large => max_split_test < self.max_split && remaining > MIB,
        };
        let size = |split: bool| if split { rounded } else { block };
        vec![size(split(rounded))]
    }

    /// `pool_borrowing`: the other pool's free block a request that missed its own pool takes
    /// before new memory: for a large request of at most 2 MiB the best-fitting small-pool
    /// block, for a small one a wholly free large segment of exactly 2 MiB (lowest address
    /// among equals). Either way it ends up a small-pool block.
    pub(crate) fn borrow(
        &self,
        snapshot: &Snapshot,
        free: &[FreeBlock],
        stream: u64,
        rounded: u64,
    ) -> Option<FreeBlock> {
        let other = self.lender(rounded)?;
        let whole = |b: &FreeBlock| {
            snapshot
                .segments
                .iter()
                .any(|s| s.address == b.address && s.total_size == b.size)
        };
        let fits = |b: &FreeBlock| match other {
            PoolKind::Small => b.size >= rounded,
            PoolKind::Large => b.size == 2 * MIB && whole(b),
        };
        free.iter()
            .filter(|b| b.stream == stream && b.pool == other && fits(b))
            .min_by_key(|b| (b.size, b.address))
            .copied()
    }

    /// The pool a request of `rounded` bytes may borrow from: the small pool for a large
    /// request of at most 2 MiB, the large pool for a small one; `None` without
    /// `pool_borrowing` or for a larger request.
    pub(crate) fn lender(&self, rounded: u64) -> Option<PoolKind> {
        match pool_of(rounded) {
            _ if !self.pool_borrowing => None,
            PoolKind::Large if rounded <= 2 * MIB => Some(PoolKind::Small),
            PoolKind::Large => None,
            PoolKind::Small => Some(PoolKind::Large),
        }
    }

    /// Bytes of the snapshot's segments that a full release (`release_cached_blocks`,
    /// synchronising every event) keeps: at least those holding an allocated block, at most
    /// those also holding a pending free the model does not follow.
    pub(crate) fn kept_after_release(&self, snapshot: &Snapshot) -> (u64, u64) {
        let (mut at_least, mut at_most) = (0, 0);
        for segment in &snapshot.segments {
            let allocated = segment
                .blocks
                .iter()
                .any(|b| b.state == BlockState::ActiveAllocated);
            let unknown = segment.blocks.iter().any(|b| {
                b.state == BlockState::ActivePendingFree && !self.pending.contains_key(&b.address)
            });
            if allocated {
                at_least += segment.total_size;
            }
            if allocated || unknown {
                at_most += segment.total_size;
            }
        }
        (at_least, at_most)
    }

    pub(crate) fn stats_with_exact_peaks(stats: &MemoryStats) -> Vec<(String, u64, u64)> {
        let mut out = Vec::new();
        let arrays = [
            ("allocation", stats.allocation),
            ("segment", stats.segment),
            ("active", stats.active),
            ("allocated_bytes", stats.allocated_bytes),
            ("reserved_bytes", stats.reserved_bytes),
            ("active_bytes", stats.active_bytes),
            ("requested_bytes", stats.requested_bytes),
            // Several merges in one step may raise and lower these: peak >= seen only.
            ("~inactive_split", stats.inactive_split),
            ("~inactive_split_bytes", stats.inactive_split_bytes),
        ];
        for (name, array) in arrays {
            for (pool, stat) in [
                ("all", array.all),
                ("small", array.small_pool),
                ("large", array.large_pool),
            ] {
                out.push((format!("{name}.{pool}"), stat.current, stat.peak));
            }
        }
        out
    }

    /// Every step changes a peak-tracked statistic at most once upwards, so its peak is the
    /// highest value seen between steps since the last reset.
    pub(crate) fn check_peaks(&mut self, stats: &MemoryStats) {
        for (name, current, peak) in Self::stats_with_exact_peaks(stats) {
            let seen = self.seen_peaks.entry(name.clone()).or_insert(0);
            *seen = (*seen).max(current);
            if name.starts_with('~') {
                assert!(peak >= *seen, "{name}: peak {peak} below {seen} seen");
            } else {
                assert_eq!(peak, *seen, "{name}: peak is not the highest value seen");
            }
        }
    }
}

/// What the model predicts for a malloc.
#[derive(Debug)]
pub(crate) enum Expect {
    /// The cached block at this address serves it, with one of these sizes.
    Hit { address: u64, sizes: Vec<u64> },
    /// The other pool's free block at this address serves it as a small-pool block (not for
    /// a cache-only request), with one of these sizes.
    Borrow { address: u64, sizes: Vec<u64> },
    /// A new segment of this size, unless the device runs out: `must_fit` when even the
    /// worst case of a full release leaves room, `cannot_fit` when even the best case does not.
    Miss {
        segment: u64,
        must_fit: bool,
        cannot_fit: bool,
    },
    /// Larger than the device or its largest segment.
    TooLarge,
    /// The model cannot tell (a pending free it does not follow on this stream and pool).
    Unsure,
}

pub(crate) fn predict(model: &Model, snapshot: &Snapshot, size: u64, stream: u64) -> Expect {
    let rounded = round_size(size, model.divisions);
    if rounded > CAPACITY {
        return Expect::TooLarge;
    }
    if model.max_segment.is_some_and(|max| rounded > max) {
        return Expect::TooLarge;
    }
    let (free, unsure) = model.settle(snapshot, false);
    if unsure.contains(&(stream, pool_of(rounded))) {
        return Expect::Unsure;
    }
    // The engine sizes a new segment after its pending frees settle: free bytes of the large
    // pool on any stream count.
    let large_free: u64 = free
        .iter()
        .filter(|b| b.pool == PoolKind::Large)
        .map(|b| b.size)
        .sum();
    if large_free == 0 && unsure.iter().any(|&(_, pool)| pool == PoolKind::Large) {
        return Expect::Unsure;
    }
    let mut segment = segment_size(
        rounded,
        model.grow_segments,
        snapshot.stats.reserved_bytes.large_pool.current,
        large_free,
    );
    if let Some(max) = model.max_segment
        && segment > max
    {
        if rounded > max {
            return Expect::TooLarge;
        }
        segment = rounded;
    }
    if let Some(block) = model.best_fit(&free, stream, rounded) {
        return Expect::Hit {
            address: block.address,
            sizes: model.allocated_sizes(block.size, rounded),
        };
    }
    if let Some(other) = model.lender(rounded) {
        if unsure.contains(&(stream, other)) {
            return Expect::Unsure;
        }
        if let Some(block) = model.borrow(snapshot, &free, stream, rounded) {
            return Expect::Borrow {
                address: block.address,
                sizes: model.allocated_sizes_in(PoolKind::Small, block.size, rounded),
            };
        }
    }
    let (kept_min, kept_max) = model.kept_after_release(snapshot);
    let room = model.limit();
    Expect::Miss {
        segment,
        must_fit: kept_max + segment <= room,
        cannot_fit: kept_min + segment > room,
    }
}
