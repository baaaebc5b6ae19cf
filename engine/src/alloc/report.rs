//! "Leak or cache?": what a device's numbers say about why its memory grows.
//!
//! nvidia-smi shows one number, the memory the process holds; a caching allocator holds memory
//! for three different reasons, and each has another cure:
//!
//! 1. **Something holds tensors**: the bytes of live tensors grow between two points. The
//!    cure is in the program (a tensor kept in a list, a graph kept alive). The report lists
//!    the blocks that appeared since the first point, grouped by requested size and, when
//!    stacks are recorded, by where they were allocated.
//! 2. **The cache**: reserved memory grows while the live bytes stay flat. Nothing leaks; the
//!    allocator keeps freed memory for the next request. The report says how much is free in
//!    each layer, how fragmented the engine's free memory is, what `empty_cache` would give
//!    back now, and which configuration key would keep less.
//! 3. **One request reserving much more than it asked**: the rounding and segment rules
//!    (`size.rs`) made a new segment much larger than the request. The report names the rule
//!    for the requests where it cost the most, with the segment each such request sits in.
//!
//! [`MemoryPoint`] is one reading (the engine's snapshot plus what the layer above it says is
//! live and cached); [`MemoryReport::between`] compares two, [`MemoryReport::at`] reads one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use super::block::BlockState;
use super::config::AllocatorConfig;
use super::history::Snapshot;
use super::size::{
    LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, PoolKind, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
    SegmentSizing, round_size, segment_size,
};
use super::stack::{Frame, Stack, StackResolver};
use super::units::format_bytes;

/// A new segment counts as "much more than asked" when it exceeds the request by at least
/// this fraction of the request ...
const OVERSIZE_SHARE: u64 = 8;
/// ... and by at least this many bytes.
const OVERSIZE_MIN_BYTES: u64 = super::units::MIB;
/// How many groups of held blocks, and of oversized requests, a report lists.
const LISTED: usize = 5;
/// How many frames of a held group's stack a report prints.
const FRAMES_SHOWN: usize = 8;

/// One reading of a device's memory, to compare with a later one.
#[derive(Clone, Debug)]
pub struct MemoryPoint {
    /// Bytes of live tensors (what the program holds).
    pub allocated: u64,
    /// Bytes of device segments.
    pub reserved: u64,
    /// Bytes of the blocks free in the layer above the engine (CubeCL's free slices through
    /// Burn; 0 on the engine alone): live to the engine, cache to the program.
    pub cached_above: u64,
    snapshot: Snapshot,
}

impl MemoryPoint {
    /// A reading of the engine alone: live bytes are the engine's allocated bytes.
    pub fn of_engine(snapshot: Snapshot) -> Self {
        let allocated = snapshot.stats.memory_allocated();
        Self::with_layer_above(snapshot, allocated, 0)
    }

    /// A reading of the engine under a layer that caches (CubeCL's): `snapshot` is read with
    /// that layer's blocks as cache ([`CachingAllocator::snapshot_with`](crate::alloc::CachingAllocator::snapshot_with)), `allocated` bytes are live tensors and `cached_above`
    /// bytes are the blocks free in that layer (live to the engine).
    pub fn with_layer_above(snapshot: Snapshot, allocated: u64, cached_above: u64) -> Self {
        Self {
            allocated,
            reserved: snapshot.stats.memory_reserved(),
            cached_above,
            snapshot,
        }
    }

    /// The engine's snapshot of this reading.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// Bytes free in the engine's segments (neither live nor cached above).
    pub fn cached_in_engine(&self) -> u64 {
        self.reserved
            .saturating_sub(self.snapshot.stats.memory_allocated())
            .saturating_sub(self.cached_above)
    }

    fn live_ids(&self) -> HashSet<u64> {
        self.snapshot
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter_map(|b| b.allocation_id)
            .collect()
    }
}

/// Blocks of one requested size (and one stack, when recorded) that appeared between two
/// points and are still held.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldGroup {
    /// What each owner asked for, in bytes.
    pub requested: u64,
    /// How many such blocks are held.
    pub count: usize,
    /// Their bytes (block sizes).
    pub bytes: u64,
    /// Where they were allocated, innermost first (empty without stacks).
    pub frames: Vec<Frame>,
}

impl HeldGroup {
    /// A total order over the frames, for a report that reads the same every time.
    fn frames_key(&self) -> Vec<(&str, &str, u32)> {
        self.frames
            .iter()
            .map(|f| (f.name.as_str(), f.filename.as_str(), f.line))
            .collect()
    }
}

/// What is free in the two layers, and what could be given back.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheState {
    /// Bytes free in the layer above the engine (CubeCL's free slices).
    pub cached_above: u64,
    /// Bytes free in the engine's segments.
    pub cached_in_engine: u64,
    /// The largest free engine block.
    pub largest_free_block: u64,
    /// Bytes of segments with no live block: what `empty_cache` gives back at least (the
    /// layer above hands its free slices back first, which can empty more segments).
    pub releasable: u64,
    /// `1 - largest free block / free bytes` of the engine (0 when nothing is free): how much
    /// of the free memory a single request could not use.
    pub fragmentation: f64,
    /// A configuration that would keep less, when the numbers point at one.
    pub advice: Option<String>,
}

/// A live request whose new segment is much larger than the request.
#[derive(Clone, Debug, PartialEq)]
pub struct OversizedRequest {
    /// What the owner asked for.
    pub requested: u64,
    /// The block it got (the request rounded).
    pub block: u64,
    /// The largest segment a live block of this size sits in (at most what the rules give).
    pub segment: u64,
    /// How many live blocks asked for this size.
    pub count: usize,
    /// The rules that made `segment` out of `requested`, in order.
    pub rules: Vec<String>,
}

/// The answer: what is happening, with the numbers behind it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct MemoryReport {
    /// Live bytes at the first point and now (equal when there is no first point).
    pub allocated: (u64, u64),
    /// Reserved bytes at the first point and now.
    pub reserved: (u64, u64),
    /// Blocks that appeared since the first point and are still held, most bytes first;
    /// empty unless the live bytes grew.
    pub held: Vec<HeldGroup>,
    /// The caches now.
    pub cache: CacheState,
    /// Live requests whose segment is much larger than the request, most waste first.
    pub oversized: Vec<OversizedRequest>,
    /// The memory scopes whose live bytes changed since the first point, most growth first
    /// (all scopes with live bytes when there is no first point).
    pub scopes: Vec<ScopeChange>,
}

/// The live bytes of one memory scope (`alloc::Tag`) at the first point and now.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeChange {
    /// The scope's name.
    pub name: String,
    /// Its live bytes at the first point.
    pub before: u64,
    /// Its live bytes now.
    pub now: u64,
}

impl ScopeChange {
    /// Bytes gained since the first point (negative: given back).
    pub fn growth(&self) -> i128 {
        i128::from(self.now) - i128::from(self.before)
    }
}

/// The scopes whose live bytes differ between `before` (none: nothing) and `now`, most growth
/// first.
fn scope_changes(before: Option<&MemoryPoint>, now: &MemoryPoint) -> Vec<ScopeChange> {
    let then = |name: &str| {
        before
            .and_then(|p| p.snapshot.stats.scopes.get(name))
            .map_or(0, |s| s.current)
    };
    let mut names: Vec<&String> = now.snapshot.stats.scopes.keys().collect();
    if let Some(before) = before {
        names.extend(before.snapshot.stats.scopes.keys());
    }
    names.sort();
    names.dedup();
    let mut changes: Vec<ScopeChange> = names
        .into_iter()
        .map(|name| ScopeChange {
            name: name.clone(),
            before: then(name),
            now: now.snapshot.stats.scopes.get(name).map_or(0, |s| s.current),
        })
        .filter(|c| c.before != c.now)
        .collect();
    changes.sort_by(|a, b| {
        b.growth()
            .cmp(&a.growth())
            .then_with(|| a.name.cmp(&b.name))
    });
    changes
}

/// What the report concludes, in order of what to look at first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The live bytes grew: something holds tensors.
    HeldTensors,
    /// Reserved grew while the live bytes did not: the cache.
    Cache,
    /// Nothing grew, but some requests reserve much more than they ask.
    Oversized,
    /// Nothing grew and no request is oversized.
    Steady,
}

impl MemoryReport {
    /// What happened between `before` and `now`.
    pub fn between(before: &MemoryPoint, now: &MemoryPoint) -> Self {
        let mut report = Self::at(now);
        report.allocated.0 = before.allocated;
        report.reserved.0 = before.reserved;
        if now.allocated > before.allocated {
            report.held = held_since(before, now);
        }
        report.scopes = scope_changes(Some(before), now);
        report
    }

    /// What one reading says (no growth to explain: the caches and the oversized requests).
    pub fn at(now: &MemoryPoint) -> Self {
        Self {
            allocated: (now.allocated, now.allocated),
            reserved: (now.reserved, now.reserved),
            held: Vec::new(),
            cache: cache_state(now),
            oversized: oversized(&now.snapshot),
            scopes: scope_changes(None, now),
        }
    }

    /// The conclusion.
    pub fn verdict(&self) -> Verdict {
        if self.allocated.1 > self.allocated.0 {
            Verdict::HeldTensors
        } else if self.reserved.1 > self.reserved.0 {
            Verdict::Cache
        } else if !self.oversized.is_empty() {
            Verdict::Oversized
        } else {
            Verdict::Steady
        }
    }
}

fn held_since(before: &MemoryPoint, now: &MemoryPoint) -> Vec<HeldGroup> {
    let old = before.live_ids();
    let mut resolver = StackResolver::new();
    let mut groups: HashMap<(u64, Vec<Frame>), (usize, u64)> = HashMap::new();
    for block in now.snapshot.segments.iter().flat_map(|s| &s.blocks) {
        let Some(id) = block.allocation_id else {
            continue;
        };
        if block.state != BlockState::ActiveAllocated || old.contains(&id) {
            continue;
        }
        let frames = block
            .stack
            .as_ref()
            .map(|s: &Stack| resolver.frames(s))
            .unwrap_or_default();
        let entry = groups
            .entry((block.requested_size, frames))
            .or_insert((0, 0));
        entry.0 += 1;
        entry.1 += block.size;
    }
    let mut held: Vec<HeldGroup> = groups
        .into_iter()
        .map(|((requested, frames), (count, bytes))| HeldGroup {
            requested,
            count,
            bytes,
            frames,
        })
        .collect();
    held.sort_by(|a, b| {
        (b.bytes, a.requested, &a.frames_key()).cmp(&(a.bytes, b.requested, &b.frames_key()))
    });
    held
}

fn cache_state(now: &MemoryPoint) -> CacheState {
    let segments = &now.snapshot.segments;
    let mut free = 0u64;
    let mut largest = 0u64;
    let mut split_large_free = 0u64;
    for segment in segments {
        let split = segment.blocks.len() > 1;
        for block in &segment.blocks {
            if block.state == BlockState::Inactive {
                free += block.size;
                largest = largest.max(block.size);
                if split && segment.pool == PoolKind::Large {
                    split_large_free += block.size;
                }
            }
        }
    }
    let releasable = segments
        .iter()
        .filter(|s| s.active_size == 0)
        .map(|s| s.total_size)
        .sum();
    let fragmentation = if free == 0 {
        0.0
    } else {
        1.0 - largest as f64 / free as f64
    };
    let config = &now.snapshot.config;
    let advice = if fragmentation >= 0.5 && split_large_free >= free / 2 && free > 0 {
        Some(if config.expandable_segments {
            "max_split_size_mb: most free memory is split off large segments; a limit keeps \
             large blocks whole for large requests"
                .to_string()
        } else {
            "expandable_segments:True (CUDA): free memory is scattered over split segments; \
             growing one segment per stream keeps it contiguous (or max_split_size_mb to keep \
             large blocks whole)"
                .to_string()
        })
    } else if releasable > 0 && config.garbage_collection_threshold.is_none() {
        Some(format!(
            "garbage_collection_threshold with a memory fraction below 1 returns unused \
             cached segments ({} now) before the cap is reached; empty_cache returns them \
             at once",
            format_bytes(releasable)
        ))
    } else {
        None
    };
    CacheState {
        cached_above: now.cached_above,
        cached_in_engine: now.cached_in_engine(),
        largest_free_block: largest,
        releasable,
        fragmentation,
        advice,
    }
}

/// The rules that turn a request of `requested` bytes into its block and its new segment:
/// `(block, segment, rules)`. Under [`SegmentSizing::Grow`] a mid-size request's segment
/// depends on what the large pool already reserves; `segment` is then the largest the rule
/// gives (20 MiB).
pub fn segment_rules(requested: u64, config: &AllocatorConfig) -> (u64, u64, Vec<String>) {
    let block = round_size(requested.max(1), &config.roundup_power2_divisions);
    let mut rules = Vec::new();
    let plain = requested.max(1).div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE;
    if block != plain {
        rules.push(format!(
            "roundup_power2_divisions ({} divisions here) rounds {} up to {}",
            config.roundup_power2_divisions.for_size(requested),
            format_bytes(requested),
            format_bytes(block)
        ));
    }
    let segment = if config.expandable_segments {
        block.div_ceil(ROUND_LARGE) * ROUND_LARGE
    } else {
        segment_size(block, config.segment_sizing, u64::MAX, 0)
    };
    if config.expandable_segments {
        rules.push(format!(
            "expandable segments grow by whole {} pages: {}",
            format_bytes(ROUND_LARGE),
            format_bytes(segment)
        ));
    } else if block <= SMALL_SIZE {
        rules.push(format!(
            "a request of at most {} goes to the small pool, whose segments are {} (shared \
             by later small requests)",
            format_bytes(SMALL_SIZE),
            format_bytes(SMALL_BUFFER)
        ));
    } else if block < MIN_LARGE_ALLOC && config.segment_sizing == SegmentSizing::Pytorch {
        rules.push(format!(
            "a large request under {} gets a {} segment (shared by later requests of that \
             range; segment_sizing:pytorch)",
            format_bytes(MIN_LARGE_ALLOC),
            format_bytes(LARGE_BUFFER)
        ));
    } else if block < MIN_LARGE_ALLOC {
        rules.push(format!(
            "a large request under {} gets a segment of an eighth of what the large pool \
             already reserves, at least the request (twice the request when the large pool \
             holds free memory that did not fit it) rounded up to {} and at most {} (shared \
             by later requests of that range; segment_sizing:grow)",
            format_bytes(MIN_LARGE_ALLOC),
            format_bytes(ROUND_LARGE),
            format_bytes(LARGE_BUFFER)
        ));
    } else {
        rules.push(format!(
            "a request of {} or more gets a segment of its own, rounded up to a multiple of \
             {}: {}",
            format_bytes(MIN_LARGE_ALLOC),
            format_bytes(ROUND_LARGE),
            format_bytes(segment)
        ));
    }
    (block, segment, rules)
}

fn oversized(snapshot: &Snapshot) -> Vec<OversizedRequest> {
    // Requested size -> (live blocks, the largest segment one sits in).
    let mut sizes: BTreeMap<u64, (usize, u64)> = BTreeMap::new();
    for segment in &snapshot.segments {
        for block in &segment.blocks {
            // Small-pool segments (2 MiB) are shared by every small request by design.
            if block.state == BlockState::ActiveAllocated && block.requested_size > SMALL_SIZE {
                let entry = sizes.entry(block.requested_size).or_default();
                entry.0 += 1;
                entry.1 = entry.1.max(segment.total_size);
            }
        }
    }
    let mut found: Vec<OversizedRequest> = sizes
        .into_iter()
        .filter_map(|(requested, (count, sits_in))| {
            // An expandable range is address space, not what the request made: the rule's
            // segment bounds what is charged to it.
            let (block, rule_segment, rules) = segment_rules(requested, &snapshot.config);
            let segment = sits_in.min(rule_segment);
            let excess = segment.saturating_sub(requested);
            (excess >= OVERSIZE_MIN_BYTES && excess >= requested / OVERSIZE_SHARE).then_some(
                OversizedRequest {
                    requested,
                    block,
                    segment,
                    count,
                    rules,
                },
            )
        })
        .collect();
    found.sort_by_key(|o| std::cmp::Reverse(o.segment - o.requested));
    found
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = format_bytes;
        let grew = |(a, z): (u64, u64)| {
            if z >= a {
                format!("{} -> {} (+{})", b(a), b(z), b(z - a))
            } else {
                format!("{} -> {} (-{})", b(a), b(z), b(a - z))
            }
        };
        let verdict = match self.verdict() {
            Verdict::HeldTensors => "LEAK? live tensors grew: something holds them",
            Verdict::Cache => "CACHE: reserved grew while live tensors did not; nothing leaks",
            Verdict::Oversized => "OVERSIZED: requests reserve much more than they ask",
            Verdict::Steady => "STEADY: nothing grew",
        };
        writeln!(f, "{verdict}")?;
        writeln!(f, "  allocated (live tensors): {}", grew(self.allocated))?;
        writeln!(f, "  reserved (segments):      {}", grew(self.reserved))?;
        if !self.held.is_empty() {
            writeln!(f, "held since the first point (most bytes first):")?;
            for group in self.held.iter().take(LISTED) {
                writeln!(
                    f,
                    "  {} x {} requested ({} in blocks)",
                    group.count,
                    b(group.requested),
                    b(group.bytes)
                )?;
                // The program's frames: CubeCL's, Burn's and the standard library's are in
                // the snapshot, not here.
                for frame in group
                    .frames
                    .iter()
                    .filter(|f| is_program_frame(f))
                    .take(FRAMES_SHOWN)
                {
                    writeln!(
                        f,
                        "      at {} ({}:{})",
                        frame.name, frame.filename, frame.line
                    )?;
                }
            }
            if self.held.len() > LISTED {
                writeln!(f, "  ... {} more groups", self.held.len() - LISTED)?;
            }
        }
        if !self.scopes.is_empty() {
            writeln!(f, "by scope (live bytes, most growth first):")?;
            for scope in self.scopes.iter().take(LISTED) {
                writeln!(f, "  {}: {}", scope.name, grew((scope.before, scope.now)))?;
            }
        }
        let c = &self.cache;
        writeln!(
            f,
            "cache: {} free in CubeCL's slices, {} free in the engine's segments (largest \
             free block {}, {:.0} % fragmented); empty_cache gives back at least {}",
            b(c.cached_above),
            b(c.cached_in_engine),
            b(c.largest_free_block),
            c.fragmentation * 100.0,
            b(c.releasable)
        )?;
        if let Some(advice) = &c.advice {
            writeln!(f, "  config: {advice}")?;
        }
        for o in self.oversized.iter().take(LISTED) {
            writeln!(
                f,
                "oversized: {} x {} requested -> block {} -> segment {} (+{})",
                o.count,
                b(o.requested),
                b(o.block),
                b(o.segment),
                b(o.segment - o.requested)
            )?;
            for rule in &o.rules {
                writeln!(f, "  because {rule}")?;
            }
        }
        Ok(())
    }
}

/// Whether `frame` is the program's own rather than a library's under it (CubeCL, Burn, the
/// standard library, the test harness). A frame named without a path (a function inlined in
/// an optimised build, whose debug information gives its bare name) is the program's when its
/// source file is: not the standard library's (`/rustc/...`), nor a downloaded crate's.
fn is_program_frame(frame: &Frame) -> bool {
    const LIBRARIES: [&str; 8] = [
        "cubecl",
        "burn_",
        "core::",
        "std::",
        "alloc::",
        "backtrace",
        "test::",
        "fn(",
    ];
    let name = frame.name.trim_start_matches('<');
    if LIBRARIES.iter().any(|lib| name.starts_with(lib)) {
        return false;
    }
    let path = name.split('<').next().unwrap_or(name);
    path.contains("::") || is_program_file(&frame.filename)
}

/// Whether `file` is a source file of the program rather than of the standard library or a
/// crate cargo downloaded ("??" when unknown: not the program's).
fn is_program_file(file: &str) -> bool {
    const LIBRARY_SOURCES: [&str; 4] = ["/rustc/", "/.cargo/registry/", "/.cargo/git/", "??"];
    let file = file.replace('\\', "/");
    !file.is_empty() && !LIBRARY_SOURCES.iter().any(|dir| file.contains(dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::units::MIB;

    #[test]
    fn a_frame_named_without_a_path_is_the_programs_when_its_file_is() {
        let frame = |name: &str, filename: &str| Frame {
            name: name.into(),
            filename: filename.into(),
            line: 1,
        };
        // Unoptimised: full paths decide.
        assert!(is_program_frame(&frame("app::train::step", "??")));
        assert!(!is_program_frame(&frame(
            "burn_core::module::Module::forward",
            "src/m.rs"
        )));
        // Optimised with line tables: an inlined function has its bare name.
        assert!(is_program_frame(&frame(
            "step",
            "/home/me/app/src/train.rs"
        )));
        assert!(is_program_frame(&frame(
            "{closure#0}",
            "./tests/engine/memory_report.rs"
        )));
        assert!(!is_program_frame(&frame(
            "call_once<app::Main>",
            "/rustc/5980761/library/core/src/ops/function.rs"
        )));
        assert!(!is_program_frame(&frame(
            "launch",
            "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/cubecl-runtime-0.10.0/src/lib.rs"
        )));
        assert!(!is_program_frame(&frame("step", "??")));
    }

    #[test]
    fn segment_rules_follow_pytorchs_round_size_and_get_allocation_size() {
        let mut config = AllocatorConfig::default();
        // cubecl issue 1614: 6 x 512 x 50257 f32.
        let requested = 6 * 512 * 50257 * 4;
        let (block, segment, rules) = segment_rules(requested, &config);
        assert_eq!(block, requested, "already a multiple of 512");
        assert_eq!(segment, requested.div_ceil(2 * MIB) * 2 * MIB);
        assert_eq!(segment, 590 * MIB);
        assert_eq!(rules.len(), 1, "{rules:?}");
        // Mid-size: 20 MiB at most under the default, always under PyTorch's rule.
        let (block, segment, rules) = segment_rules(MIB + 1, &config);
        assert_eq!((block, segment), (MIB + 512, 20 * MIB));
        assert!(rules[0].contains("segment_sizing:grow"), "{rules:?}");
        config.segment_sizing = SegmentSizing::Pytorch;
        let (block, segment, rules) = segment_rules(MIB + 1, &config);
        assert_eq!((block, segment), (MIB + 512, 20 * MIB));
        assert!(rules[0].contains("segment_sizing:pytorch"), "{rules:?}");
    }
}
