//! How a request becomes a block size, which pool serves it and how large a new segment is.
//!
//! These are PyTorch's numbers: 512-byte granularity, a small pool for requests of at most
//! 1 MiB carved out of 2 MiB segments, and a large pool whose segments are 20 MiB for requests
//! under 10 MiB and otherwise the request rounded up to 2 MiB. Small requests share 2 MiB
//! segments so that thousands of tiny tensors cost a few device calls; mid-size ones share
//! 20 MiB segments so that a layer's worth of activations fits one device allocation; big
//! ones get a segment of their own size, because rounding a 1 GiB request up to a fixed
//! bucket would waste more than any reuse could win back.
//!
//! One rule differs by default ([`SegmentSizing::Grow`]): a mid-size request's segment grows
//! with the large pool instead of starting at 20 MiB. It is an eighth of what the large pool
//! already reserves (rounded up to 2 MiB), at most 20 MiB, and at least the request rounded up
//! to 2 MiB, or **twice** the request when the large pool holds free memory that could not
//! serve it. So a new segment never costs more than an eighth of the pool beyond the request
//! (or one request more), where PyTorch's costs up to 20 MiB whatever the pool: a model whose
//! activations fit in a few MiB (Burn's small convolutional network: 3.95 MiB live at its
//! peak, 1.5 MiB im2col buffers) no longer reserves 20 MiB for its first mid-size tensor,
//! which made it reserve 3.2 times what CubeCL's own pool does on wgpu. Segments reach
//! PyTorch's 20 MiB once the large pool holds 160 MiB.
//!
//! The doubling is for shapes that change from step to step. A miss while the pool has free
//! memory means the cached blocks are the wrong sizes: a variable-length transformer whose
//! sequence lengths climb over its first steps missed at every step, and with segments cut to
//! the request each held one block that the next, longer step could not use, so the pool
//! reserved a second working set beside the first (issue 39: 112 MiB against Burn's 97.6 on
//! one seed). A segment with one request of headroom serves the next longer shape, or two
//! shorter ones. A pool that misses with nothing free (a model's first pass, a working set
//! that only grows) still gets segments cut to the request. `docs/src/benchmarks.md` has the
//! shares and factors measured on the replay's traces. `segment_sizing:pytorch` restores
//! PyTorch's `get_allocation_size` exactly.

use serde::{Deserialize, Serialize};

use super::config::{DIVISION_BUCKETS, RoundupDivisions};

use super::units::MIB;

/// Every block is a multiple of this, and no block is smaller.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests up to this size go to the small pool.
pub const SMALL_SIZE: u64 = MIB;
/// The segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Large requests under this size get a `LARGE_BUFFER` segment (PyTorch), or one that grows
/// with the pool up to it (`SegmentSizing::Grow`).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// The shared segment size of mid-size large requests.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// Other large segments are rounded up to a multiple of this.
pub const ROUND_LARGE: u64 = 2 * MIB;
/// Under `SegmentSizing::Grow`, a new mid-size segment is at least the large pool's reserved
/// bytes over this.
pub const GROWTH_SHARE: u64 = 8;
/// Under `SegmentSizing::Grow`, a new mid-size segment made while the large pool holds free
/// memory is at least this many times the request.
pub const MISS_HEADROOM: u64 = 2;

/// The two pools: they never share a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// The pool of requests of at most 1 MiB, carved out of 2 MiB segments. With pool
    /// borrowing (`AllocatorConfig::pool_borrowing`, the default) a large request of at most
    /// 2 MiB may also take a free block of this pool, so its blocks can exceed 1 MiB.
    Small,
    /// The pool of requests larger than 1 MiB; with pool borrowing, a wholly free 2 MiB
    /// segment of it may serve a small request.
    Large,
}

impl PoolKind {
    /// The pool that serves a block of `rounded` bytes.
    pub fn for_size(rounded: u64) -> Self {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// PyTorch's name for the pool in statistic keys.
    pub fn stat_name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }
}

impl RoundupDivisions {
    /// The bucket of a request of `size` bytes (PyTorch's `roundup_power2_divisions(size)`):
    /// 0 below 2 MiB, then one per power of two, the last from 32 GiB up.
    fn bucket(size: u64) -> usize {
        let log_size = 63 - size.max(1).leading_zeros() as usize;
        let first = MIB.trailing_zeros() as usize;
        log_size.saturating_sub(first).min(DIVISION_BUCKETS - 1)
    }

    /// The division count for a request of `size` bytes (0 when none is configured).
    pub fn for_size(&self, size: u64) -> u64 {
        self.buckets[Self::bucket(size)]
    }
}

/// The block size a request of `size` bytes takes (`size` > 0; saturates at `u64::MAX`).
///
/// With power-of-two divisions configured for this size, the size is rounded up to the next
/// of N equal steps between the two powers of two around it, as long as a step is at least
/// `MIN_BLOCK_SIZE` (so every block stays a multiple of 512 bytes and every offset stays
/// aligned); otherwise it is rounded up to a multiple of 512 bytes.
pub fn round_size(size: u64, divisions: &RoundupDivisions) -> u64 {
    if size <= MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let n = divisions.for_size(size);
    if n > 1
        && MIN_BLOCK_SIZE
            .checked_mul(n)
            .is_some_and(|limit| size > limit)
    {
        return round_to_power2_division(size, n);
    }
    size.div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
}

/// Rounds `size` up to the next of `divisions` equal steps between its enclosing powers of two.
fn round_to_power2_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor / divisions;
    if step == 0 {
        return floor << 1;
    }
    size.div_ceil(step).saturating_mul(step)
}

/// How large a new segment for a mid-size request (over 1 MiB, under 10 MiB) is: the config
/// key `segment_sizing`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentSizing {
    /// The default: an eighth of what the large pool already reserves, and at least the
    /// request, or twice the request when the large pool holds free memory (each rounded up
    /// to 2 MiB); at most 20 MiB.
    #[default]
    Grow,
    /// PyTorch's `get_allocation_size`: always 20 MiB.
    Pytorch,
}

impl SegmentSizing {
    /// The config string's name of the rule.
    pub fn name(self) -> &'static str {
        match self {
            SegmentSizing::Grow => "grow",
            SegmentSizing::Pytorch => "pytorch",
        }
    }
}

/// The size of a new segment for a block of `rounded` bytes, with `large_reserved` bytes
/// already reserved by the large pool, `large_free` of them in free blocks (only
/// [`SegmentSizing::Grow`] reads these two; see the module documentation).
pub fn segment_size(
    rounded: u64,
    sizing: SegmentSizing,
    large_reserved: u64,
    large_free: u64,
) -> u64 {
    let round_large = |bytes: u64| bytes.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE);
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        match sizing {
            SegmentSizing::Pytorch => LARGE_BUFFER,
            SegmentSizing::Grow => {
                let headroom = if large_free > 0 { MISS_HEADROOM } else { 1 };
                round_large(rounded.saturating_mul(headroom))
                    .max(round_large(large_reserved / GROWTH_SHARE))
                    .min(LARGE_BUFFER)
            }
        }
    } else {
        round_large(rounded)
    }
}
