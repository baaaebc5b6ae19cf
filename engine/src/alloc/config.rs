//! The allocator's settings and the PyTorch-style string they are read from.
//!
//! `max_split_size_mb:128,garbage_collection_threshold:0.8,roundup_power2_divisions:4`:
//! comma-separated `key:value` items, read from `BURN_CACHING_ALLOC_CONF` by
//! [`AllocatorConfig::from_env`]. Anything malformed, unknown or out of range is an error
//! that names the key and what it accepts; nothing is silently ignored.

use serde::{Deserialize, Serialize};

use super::history::{HistoryOptions, RecordMode};
use super::size::SegmentSizing;
use super::units::MIB;

/// The environment variable [`AllocatorConfig::from_env`] reads.
pub const CONFIG_ENV: &str = "BURN_CACHING_ALLOC_CONF";

/// The configuration string under which every rule is PyTorch's: the keys whose defaults are
/// ours set to PyTorch's values, and `expandable_segments:False` named, so that a CUDA device
/// with virtual memory does not turn expandable segments on by default. What
/// [`AllocatorConfig::pytorch`] parses; give it to [`CONFIG_ENV`] for the same from the
/// environment.
pub const PYTORCH_CONFIG: &str = "expandable_segments:False,segment_sizing:pytorch,\
pool_borrowing:false,cross_stream_reuse:false,release_outgrown:false";

/// The most trace events `history_capacity` may keep: 2^24 (16 777 216). An event takes
/// about a hundred bytes and more with its stack, so the largest ring is a few GiB; the 2^32
/// allowed before could grow the ring to hundreds of GiB.
pub const MAX_HISTORY_CAPACITY: u64 = 1 << 24;

/// The smallest `max_split_size_mb` / `max_non_split_rounding_mb` accepted: one 20 MiB
/// large-pool segment (PyTorch 2.9's `parseMaxSplitSize`).
const MIN_SPLIT_MB: u64 = 20;

/// Why a configuration string (or a setting) was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An item (or the whole string) is not well-formed `key:value` syntax.
    #[error("malformed allocator config item `{item}`: {reason}")]
    Malformed {
        /// The offending item, or the whole string.
        item: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A key that is not one the configuration string accepts.
    #[error("unknown allocator config key `{key}`; known keys: {}", known_keys())]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// A known key with a value it does not accept.
    #[error("invalid value `{value}` for allocator config key `{key}`: expected {expected}")]
    InvalidValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What the key accepts.
        expected: String,
    },
    /// A `PYTORCH_CUDA_ALLOC_CONF` key this allocator recognises but does not implement
    /// (e.g. `release_lock_on_cudamalloc`), or one the device cannot serve
    /// (`expandable_segments` without virtual memory).
    #[error("allocator config key `{key}` is not supported: {reason}")]
    Unsupported {
        /// The key.
        key: String,
        /// Why it is not supported.
        reason: String,
    },
    /// The same key appears more than once.
    #[error("allocator config key `{key}` is given twice")]
    Duplicate {
        /// The repeated key.
        key: String,
    },
}

/// How many size buckets `roundup_power2_divisions` has (PyTorch's
/// `kRoundUpPowerOfTwoIntervals`).
pub(super) const DIVISION_BUCKETS: usize = 16;

/// Power-of-two rounding divisions, by size bucket, as PyTorch's `AllocatorConfig` keeps them.
///
/// Sixteen buckets by powers of two from 1 MiB: bucket 0 holds every size under 2 MiB,
/// bucket `i >= 1` the sizes in [2^i MiB, 2^(i+1) MiB), and the last one everything from
/// 32 GiB up. Each holds a division count; 0 or 1 means no power-of-two rounding there.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RoundupDivisions {
    pub(super) buckets: [u64; DIVISION_BUCKETS],
}

impl RoundupDivisions {
    /// `n` divisions for every size. Divisions are powers of two (the parser refuses any
    /// other), so that every step between two powers of two is a multiple of 512 bytes and
    /// every block stays aligned: an `n` that is not one is rounded down to one (3 gives 2);
    /// 0 and 1 round nothing.
    pub fn uniform(n: u64) -> Self {
        let n = if n <= 1 { n } else { 1 << n.ilog2() };
        Self {
            buckets: [n; DIVISION_BUCKETS],
        }
    }

    /// Whether no size is rounded (every division count is at most 1).
    pub fn is_empty(&self) -> bool {
        self.buckets.iter().all(|n| *n <= 1)
    }

    /// Parses `4` (a power of two, for every size) or a list like `[1:2,16:8,>:4]`, read as
    /// PyTorch 2.9's `parseRoundUpPower2Divisions` reads it: key `N:d` (N a power of two, in
    /// MiB) sets the bucket [N, 2N) MiB, the first such key also fills every bucket below
    /// it, buckets between two keys stay 0, and `>:d` fills every bucket after the last key
    /// read before it. Keys may come in any order; a later one overwrites. List values are
    /// 0 or a power of two.
    fn parse(value: &str) -> Result<Self, ConfigError> {
        let invalid = |expected: &str| ConfigError::InvalidValue {
            key: "roundup_power2_divisions".into(),
            value: value.into(),
            expected: expected.into(),
        };
        let power_of_two = |text: &str, zero_allowed: bool| -> Option<u64> {
            text.trim()
                .parse::<u64>()
                .ok()
                .filter(|n| n.is_power_of_two() || (zero_allowed && *n == 0))
        };
        let Some(list) = value.strip_prefix('[') else {
            return power_of_two(value, false)
                .map(Self::uniform)
                .ok_or_else(|| invalid("a power of two, or a list like [1:2,16:8,>:4]"));
        };
        let list = list
            .strip_suffix(']')
            .ok_or_else(|| invalid("a number or a list like [1:2,16:8,>:4]"))?;
        let mut divisions = Self::default();
        if list.trim().is_empty() {
            return Ok(divisions);
        }
        let mut first_key = true;
        let mut last_bucket = 0;
        for entry in list.split(',') {
            let (key, n) = entry.split_once(':').ok_or_else(|| {
                invalid("list entries of the form SIZE_MB:DIVISIONS or >:DIVISIONS")
            })?;
            let n = power_of_two(n, true)
                .ok_or_else(|| invalid("divisions that are 0 or a power of two"))?;
            if key.trim() == ">" {
                divisions.buckets[last_bucket + 1..].fill(n);
                continue;
            }
            let mb = power_of_two(key, false)
                .ok_or_else(|| invalid("bucket keys that are powers of two in MiB, or `>`"))?;
            let bucket = (mb.trailing_zeros() as usize).min(DIVISION_BUCKETS - 1);
            if first_key {
                divisions.buckets[..bucket].fill(n);
                first_key = false;
            }
            divisions.buckets[bucket] = n;
            last_bucket = bucket;
        }
        Ok(divisions)
    }
}

/// How the allocator places, rounds, collects and records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AllocatorConfig {
    /// Blocks at least this large are never split (`None`: unlimited).
    pub max_split_size: Option<u64>,
    /// How much larger than an oversize request a cached oversize block may be and still serve it.
    pub max_non_split_rounding: u64,
    /// Free old cached segments once reserved memory exceeds this fraction of allowed memory.
    pub garbage_collection_threshold: Option<f64>,
    /// Power-of-two rounding of request sizes.
    pub roundup_power2_divisions: RoundupDivisions,
    /// Reserved memory may not exceed this fraction of the device's total memory.
    pub memory_fraction: Option<f64>,
    /// What the history records from the start (off by default): key `record_history`
    /// switches a trace without stacks on or off ([`HistoryOptions::enabled`]), key
    /// `history_capacity` sets how many events its ring keeps ([`HistoryOptions::max_entries`]).
    /// `CachingAllocator::record_memory_history` changes it later; this field then says what
    /// is recorded.
    #[serde(default = "HistoryOptions::off")]
    pub history: HistoryOptions,
    /// PyTorch's `expandable_segments`: per stream and pool, one reserved address range that
    /// grows by mapping pages at its end instead of new segments (needs a device with
    /// virtual memory).
    #[serde(default)]
    pub expandable_segments: bool,
    /// How large a new segment for a mid-size request (over 1 MiB, under 10 MiB) is:
    /// growing with the large pool up to 20 MiB (the default), or always 20 MiB (PyTorch).
    /// Files written before the key existed used PyTorch's rule and read back as it.
    #[serde(default = "pytorch_segment_sizing")]
    pub segment_sizing: SegmentSizing,
    /// Whether a miss that would allocate device memory first borrows the other pool's free
    /// memory (the default: a large request of at most 2 MiB a small-pool free block, a small
    /// request a wholly free 2 MiB large-pool segment), or never, as in PyTorch
    /// (`pool_borrowing:false`). Files written before the key existed used PyTorch's rule and
    /// read back as it.
    #[serde(default)]
    pub pool_borrowing: bool,
    /// Whether a miss that would allocate device memory first takes a wholly free segment
    /// another stream cached, behind a device-side wait for an event recorded on that stream
    /// after the segment's last free where the device can wait between streams, else once
    /// such an event has completed (the default; idle streams first), or never, as in PyTorch, whose
    /// blocks serve only the stream that allocated them (`cross_stream_reuse:false`). Where no
    /// whole segment fits, a small request of a stream with no small segment of its own (a new
    /// thread) is lent free room of another stream's small segment that the lender's own use
    /// has never needed, the requester recorded as a use of it. Files written before the key
    /// existed used PyTorch's rule and read back as it.
    #[serde(default)]
    pub cross_stream_reuse: bool,
    /// Whether a large request that none of its stream's cached blocks can serve, about to
    /// take a new segment of `n` bytes, first returns up to `n` bytes of the stream's wholly
    /// free large segments to the device, smallest first (the default): a working set that
    /// climbs (longer sequences, a larger batch) replaces the segments it outgrew instead of
    /// keeping them beside the new ones. `release_outgrown:false` keeps them until an
    /// out-of-memory, as PyTorch does. Files written before the key existed used PyTorch's rule
    /// and read back as it.
    #[serde(default)]
    pub release_outgrown: bool,
    /// PyTorch's `throw_on_cudamalloc_oom` (off by default): with a memory fraction below 1, a
    /// request whose new device memory would take reserved memory above the fraction's cap
    /// fails at once with [`AllocError::Rejected`](crate::alloc::AllocError::Rejected),
    /// without the cache flush and retry that would stall every stream of the device
    /// (counted in `num_oom_rejections`). Without a fraction below 1 it changes nothing.
    #[serde(default)]
    pub throw_on_cudamalloc_oom: bool,
    /// Named after PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING` switch (read by
    /// `forceUncachedAllocator`), off by default: nothing is cached. Every request gets a
    /// device allocation of its own (its size rounded to 512 bytes, never split, never shared),
    /// and every free returns it to the device once an event recorded on its stream (and on
    /// every stream `record_stream` named) has completed, so that compute-sanitizer's memcheck
    /// sees an out-of-bounds access past a block as one past its allocation. The statistics
    /// keep their meaning (a segment per live block). Placement keys (`max_split_size_mb`,
    /// `roundup_power2_divisions`, `garbage_collection_threshold`, `pool_borrowing`,
    /// `cross_stream_reuse`, `release_outgrown`) have nothing to act on;
    /// `expandable_segments` is refused with it.
    #[serde(default)]
    pub no_cuda_memory_caching: bool,
    /// The pinned host pool that stages copies between host and device (CUDA only; wgpu has
    /// none): `pinned_max_idle_mb`, `pinned_max_cached_size_mb`,
    /// `pinned_reserve_segment_size_mb`.
    #[serde(default)]
    pub pinned: PinnedHostConfig,
}

/// The pinned host pool's limits (the CUDA backend's staging buffers for uploads and reads,
/// `src/cuda/staging.rs`). Read when the device opens; a later `set_allocator_settings`
/// changes the configuration shown but not the open pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PinnedHostConfig {
    /// Idle pinned bytes kept for reuse (`pinned_max_idle_mb`, ours; 256 MiB by default): a
    /// buffer released beyond it goes back to the driver (`cuMemFreeHost`). PyTorch keeps
    /// every idle pinned block until `host_empty_cache`.
    pub max_idle: u64,
    /// PyTorch's `pinned_max_cached_size_mb` (`CachingHostAllocator`'s `size <=
    /// pinned_max_cached_size()` test): a buffer larger than this is never kept idle but goes
    /// back to the driver when released. `None` (the default, as PyTorch's): no such limit.
    pub max_cached_size: Option<u64>,
    /// PyTorch's `pinned_reserve_segment_size_mb`: one pinned allocation of this many bytes
    /// made when the device opens, from which buffers are carved before the driver is asked
    /// (buffers carved from it are always kept idle, and it is freed only with the pool). 0
    /// (the default): none.
    pub reserve_segment: u64,
}

impl Default for PinnedHostConfig {
    fn default() -> Self {
        Self {
            max_idle: 256 * MIB,
            max_cached_size: None,
            reserve_segment: 0,
        }
    }
}

/// The rule of configurations serialised before `segment_sizing` existed.
fn pytorch_segment_sizing() -> SegmentSizing {
    SegmentSizing::Pytorch
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        Self {
            max_split_size: None,
            max_non_split_rounding: 20 * MIB,
            garbage_collection_threshold: None,
            roundup_power2_divisions: RoundupDivisions::default(),
            memory_fraction: None,
            history: HistoryOptions::off(),
            expandable_segments: false,
            segment_sizing: SegmentSizing::Grow,
            pool_borrowing: true,
            cross_stream_reuse: true,
            release_outgrown: true,
            throw_on_cudamalloc_oom: false,
            no_cuda_memory_caching: false,
            pinned: PinnedHostConfig::default(),
        }
    }
}

impl AllocatorConfig {
    /// PyTorch's allocator exactly: [`PYTORCH_CONFIG`] (every key whose default is ours set to
    /// PyTorch's rule; everything else is PyTorch's already). The one place that says it, and
    /// the one rule for keys a serialised configuration lacks: a file written before a key of
    /// ours existed reads that key back as this configuration has it.
    pub fn pytorch() -> Self {
        Self::parse(PYTORCH_CONFIG).expect("PYTORCH_CONFIG parses")
    }

    /// Reads `BURN_CACHING_ALLOC_CONF`; unset or empty gives the defaults.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(CONFIG_ENV) {
            Ok(value) => Self::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::Malformed {
                item: CONFIG_ENV.into(),
                reason: "the variable is not valid UTF-8".into(),
            }),
        }
    }

    /// Parses a comma-separated `key:value` string; an empty string gives the defaults.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        Self::default()
            .with_settings(text)
            .map(|(config, _)| config)
    }

    /// This configuration with the keys of `text` (the same `key:value` string as
    /// [`parse`](Self::parse)) set over it, and the keys `text` named, in its order. Keys it
    /// does not name keep their value here. Used to change an open allocator's settings
    /// (`CachingAllocator::set_allocator_settings`).
    pub fn with_settings(&self, text: &str) -> Result<(Self, Vec<&'static str>), ConfigError> {
        let mut config = self.clone();
        let mut seen: Vec<&'static str> = Vec::new();
        for item in split_items(text)? {
            let (key, value) = item.split_once(':').ok_or_else(|| ConfigError::Malformed {
                item: item.to_string(),
                reason: "expected `key:value`".into(),
            })?;
            let (key, value) = (key.trim(), value.trim());
            if key.is_empty() || value.is_empty() {
                return Err(ConfigError::Malformed {
                    item: item.to_string(),
                    reason: "expected a non-empty key and value".into(),
                });
            }
            if seen.contains(&key) {
                return Err(ConfigError::Duplicate { key: key.into() });
            }
            seen.push(config.apply(key, value)?);
        }
        config.refuse_conflicts()?;
        Ok((config, seen))
    }

    /// Checks what the configuration string's parser checks, for a configuration built in
    /// code or deserialised: split sizes of at least 20 MiB, fractions in range, division
    /// counts that are 0 or powers of two (so that every block stays a multiple of 512
    /// bytes). The allocator checks it when it starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let megabytes = |key: &str, bytes: u64| {
            if bytes >= MIN_SPLIT_MB * MIB {
                Ok(())
            } else {
                Err(invalid(
                    key,
                    &format!("{bytes} bytes"),
                    &format!("at least {MIN_SPLIT_MB} MiB"),
                ))
            }
        };
        if let Some(bytes) = self.max_split_size {
            megabytes("max_split_size_mb", bytes)?;
        }
        megabytes("max_non_split_rounding_mb", self.max_non_split_rounding)?;
        if let Some(threshold) = self.garbage_collection_threshold {
            parse_fraction(
                "garbage_collection_threshold",
                &threshold.to_string(),
                false,
            )?;
        }
        if let Some(fraction) = self.memory_fraction {
            validate_memory_fraction(fraction)?;
        }
        self.refuse_conflicts()?;
        if let Some(n) = self
            .roundup_power2_divisions
            .buckets
            .iter()
            .find(|n| **n > 1 && !n.is_power_of_two())
        {
            return Err(invalid(
                "roundup_power2_divisions",
                &n.to_string(),
                "0 or a power of two",
            ));
        }
        Ok(())
    }

    /// Refuses keys that contradict each other: `no_cuda_memory_caching` gives every request a
    /// device allocation of its own, which `expandable_segments` (pages mapped into one growing
    /// range per stream) cannot.
    fn refuse_conflicts(&self) -> Result<(), ConfigError> {
        if self.no_cuda_memory_caching && self.expandable_segments {
            return Err(ConfigError::Unsupported {
                key: "expandable_segments".into(),
                reason: "no_cuda_memory_caching gives every request a device allocation of its \
                         own; set one of them, not both"
                    .into(),
            });
        }
        Ok(())
    }

    /// Sets `key` from `value`; the key's name as the table spells it.
    fn apply(&mut self, key: &str, value: &str) -> Result<&'static str, ConfigError> {
        if let Some(row) = KEYS.iter().find(|row| row.name == key) {
            (row.apply)(self, key, value)?;
            return Ok(row.name);
        }
        if UNSUPPORTED_KEYS.contains(&key) {
            return Err(ConfigError::Unsupported {
                key: key.into(),
                reason: "this allocator has no such mode".into(),
            });
        }
        Err(ConfigError::UnknownKey { key: key.into() })
    }
}

/// One key of the configuration string: its name, and how its value (`key`, `value`) sets
/// the configuration.
struct Key {
    name: &'static str,
    apply: fn(&mut AllocatorConfig, &str, &str) -> Result<(), ConfigError>,
}

/// A row of [`KEYS`]: `name`, and a statement that sets `config` from `key` and `value`.
macro_rules! key {
    ($name:literal, |$config:ident, $key:tt, $value:ident| $set:expr) => {
        Key {
            name: $name,
            apply: |$config, $key, $value| {
                $set;
                Ok(())
            },
        }
    };
}

/// Every key the configuration string accepts, one row each (a new key is a new row).
const KEYS: [Key; 17] = [
    key!("expandable_segments", |config, key, value| {
        config.expandable_segments = parse_true_false(key, value)?
    }),
    key!("segment_sizing", |config, key, value| {
        config.segment_sizing = match value {
            "grow" => SegmentSizing::Grow,
            "pytorch" => SegmentSizing::Pytorch,
            _ => return Err(invalid(key, value, "grow or pytorch")),
        }
    }),
    key!("pool_borrowing", |config, key, value| {
        config.pool_borrowing = parse_true_false(key, value)?
    }),
    key!("cross_stream_reuse", |config, key, value| {
        config.cross_stream_reuse = parse_true_false(key, value)?
    }),
    key!("release_outgrown", |config, key, value| {
        config.release_outgrown = parse_true_false(key, value)?
    }),
    key!("throw_on_cudamalloc_oom", |config, key, value| {
        config.throw_on_cudamalloc_oom = parse_true_false(key, value)?
    }),
    key!("max_split_size_mb", |config, key, value| {
        config.max_split_size = Some(parse_megabytes(key, value)?)
    }),
    key!("max_non_split_rounding_mb", |config, key, value| {
        config.max_non_split_rounding = parse_megabytes(key, value)?
    }),
    key!("garbage_collection_threshold", |config, key, value| {
        config.garbage_collection_threshold = Some(parse_fraction(key, value, false)?)
    }),
    key!("roundup_power2_divisions", |config, _, value| {
        config.roundup_power2_divisions = RoundupDivisions::parse(value)?
    }),
    key!("per_process_memory_fraction", |config, key, value| {
        config.memory_fraction = Some(parse_fraction(key, value, true)?)
    }),
    // A trace without stacks (`HistoryOptions::trace`), or nothing.
    key!("record_history", |config, key, value| {
        config.history = config
            .history
            .with_enabled(if parse_true_false(key, value)? {
                RecordMode::All
            } else {
                RecordMode::Off
            })
    }),
    key!("history_capacity", |config, key, value| {
        let entries = parse_integer(key, value, 1, MAX_HISTORY_CAPACITY)? as usize;
        config.history = config.history.with_max_entries(entries)
    }),
    key!("no_cuda_memory_caching", |config, key, value| {
        config.no_cuda_memory_caching = parse_true_false(key, value)?
    }),
    key!("pinned_max_idle_mb", |config, key, value| {
        config.pinned.max_idle = parse_mib(key, value)?
    }),
    key!("pinned_max_cached_size_mb", |config, key, value| {
        config.pinned.max_cached_size = Some(parse_mib(key, value)?)
    }),
    key!("pinned_reserve_segment_size_mb", |config, key, value| {
        config.pinned.reserve_segment = parse_mib(key, value)?
    }),
];

/// `PYTORCH_CUDA_ALLOC_CONF` keys this allocator knows but does not implement.
const UNSUPPORTED_KEYS: [&str; 2] = [
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
];

/// The accepted keys, for the unknown-key message.
fn known_keys() -> String {
    KEYS.map(|row| row.name).join(", ")
}

/// Checks a memory fraction: a number in (0, 1].
pub fn validate_memory_fraction(fraction: f64) -> Result<f64, ConfigError> {
    parse_fraction("per_process_memory_fraction", &fraction.to_string(), true)
}

/// Splits on commas that are not inside `[...]`.
fn split_items(text: &str) -> Result<Vec<&str>, ConfigError> {
    let mut items = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(ConfigError::Malformed {
                item: text.into(),
                reason: "unbalanced or nested brackets".into(),
            });
        }
    }
    if depth != 0 {
        return Err(ConfigError::Malformed {
            item: text.into(),
            reason: "unclosed `[`".into(),
        });
    }
    items.push(&text[start..]);
    let trimmed: Vec<&str> = items.into_iter().map(str::trim).collect();
    if trimmed.len() == 1 && trimmed[0].is_empty() {
        return Ok(Vec::new());
    }
    if trimmed.iter().any(|item| item.is_empty()) {
        return Err(ConfigError::Malformed {
            item: text.into(),
            reason: "empty item between commas".into(),
        });
    }
    Ok(trimmed)
}

fn invalid(key: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.into(),
        value: value.into(),
        expected: expected.into(),
    }
}

fn parse_integer(key: &str, value: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    match value.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(invalid(
            key,
            value,
            &format!("a whole number from {min} to {max}"),
        )),
    }
}

/// At least 20 MiB, as bytes; values too large to hold in bytes are capped, as PyTorch caps
/// them (`std::min(value, SIZE_MAX / kMB)`).
fn parse_megabytes(key: &str, value: &str) -> Result<u64, ConfigError> {
    match value.parse::<u64>() {
        Ok(mb) if mb >= MIN_SPLIT_MB => Ok(mb.min(u64::MAX / MIB) * MIB),
        _ => Err(invalid(
            key,
            value,
            &format!("a whole number of MiB, at least {MIN_SPLIT_MB}"),
        )),
    }
}

/// A whole number of MiB, 0 included, as bytes (the pinned pool's sizes; at most what a
/// 64-bit byte count holds).
fn parse_mib(key: &str, value: &str) -> Result<u64, ConfigError> {
    parse_integer(key, value, 0, u64::MAX / MIB).map(|mb| mb * MIB)
}

/// A boolean in PyTorch's spelling, `True`/`False` (its tokenizer's), or `true`/`false`/`1`/`0`.
fn parse_true_false(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(invalid(key, value, "True or False")),
    }
}

/// A number in (0, 1] when `one_allowed`, else in (0, 1).
fn parse_fraction(key: &str, value: &str, one_allowed: bool) -> Result<f64, ConfigError> {
    let range = if one_allowed { "(0, 1]" } else { "(0, 1)" };
    match value.parse::<f64>() {
        // A subnormal fraction (1e-320) is no fraction of any device: its limit is 0 bytes.
        Ok(f) if f.is_normal() && f > 0.0 && (f < 1.0 || (one_allowed && f == 1.0)) => Ok(f),
        _ => Err(invalid(key, value, &format!("a number in {range}"))),
    }
}
