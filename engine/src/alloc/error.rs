//! Why an allocation or a free failed.

use super::units::format_bytes;
use crate::device::DeviceError;

/// Why an allocation or a free failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// A request for 0 bytes.
    #[error("allocation of 0 bytes requested; sizes must be at least 1 byte")]
    ZeroSize,
    /// The request can never fit: it exceeds the device's total memory or its largest segment.
    #[error(
        "cannot allocate {} ({requested} bytes): larger than the largest segment this device can hold, {} ({max} bytes)",
        format_bytes(*requested),
        format_bytes(*max)
    )]
    TooLarge {
        /// The requested size, in bytes.
        requested: u64,
        /// The largest size the device can hold, in bytes.
        max: u64,
    },
    /// The device ran out of memory even after the cache was freed and the allocation retried
    /// (PyTorch's `OutOfMemoryError`). The message states PyTorch's numbers, then why: the
    /// largest free block, the free bytes in blocks too small for the request, and the
    /// configuration that would help when the numbers point at one.
    #[error("{}", OomMessage(self))]
    OutOfMemory {
        /// The requested size, in bytes.
        requested: u64,
        /// Bytes allocated by this allocator at the time.
        allocated: u64,
        /// Bytes this allocator reserved from the device but has not allocated.
        reserved_unallocated: u64,
        /// Free device memory as the device reports it, in bytes (0 if unknown).
        device_free: u64,
        /// Total device memory as the device reports it, in bytes (0 if unknown).
        device_total: u64,
        /// The cap set by the per-process memory fraction, in bytes, if any.
        limit: Option<u64>,
        /// Why: the largest free block, fragmentation, and advice (boxed: errors stay small).
        diagnosis: Box<OomDiagnosis>,
    },
    /// `throw_on_cudamalloc_oom` with a memory fraction below 1: the new device memory the
    /// request needed would have taken reserved memory above the fraction's cap, so it failed
    /// at once, without flushing the cache or retrying (PyTorch's preemptive rejection,
    /// counted in `num_oom_rejections`, not in `num_ooms`).
    #[error(
        "out of memory, rejected at once (throw_on_cudamalloc_oom): tried to allocate {} \
         ({requested} bytes), which needs {} of new device memory, but {} is reserved and \
         the per-process memory fraction allows {} of the device's {}; {} of the reserved \
         memory is cached, unallocated (the cache was not flushed)",
        format_bytes(*requested),
        format_bytes(*needed),
        format_bytes(*reserved),
        format_bytes(*limit),
        format_bytes(*device_total),
        format_bytes(reserved - allocated)
    )]
    Rejected {
        /// The requested size, in bytes.
        requested: u64,
        /// The new device memory the request needed (a segment, or pages to map), in bytes.
        needed: u64,
        /// Bytes this allocator reserved from the device at the time.
        reserved: u64,
        /// Bytes allocated by this allocator at the time.
        allocated: u64,
        /// The cap set by the per-process memory fraction, in bytes.
        limit: u64,
        /// Total device memory as the device reports it, in bytes.
        device_total: u64,
    },
    /// A free of an allocation that is not live in this allocator.
    #[error(
        "invalid free of allocation {id}: it is not live in this allocator (freed twice, or from another allocator)"
    )]
    InvalidFree {
        /// The allocation's id.
        id: u64,
    },
    /// An earlier operation panicked half-way through (a device implementation's panic, a
    /// broken internal assertion), so the allocator's structures may disagree with each other
    /// and with the device. From then on the allocator hands out and takes back nothing: the
    /// memory it holds stays with the device until the process ends. Statistics and snapshots
    /// can still be read, to diagnose.
    #[error(
        "the caching allocator is unusable: an earlier `{operation}` panicked half-way through \
         and may have left its blocks inconsistent, so no memory is handed out or taken back \
         any more (statistics and snapshots can still be read)"
    )]
    Poisoned {
        /// The operation that panicked (`malloc`, `free`, `empty_cache`, ...).
        operation: &'static str,
    },
    /// A request or a call named a private pool this allocator does not have (never created
    /// here, or already released).
    #[error("no private memory pool {id} on this allocator (never created here, or released)")]
    UnknownPool {
        /// The pool's number.
        id: u64,
    },
    /// The device failed in some other way.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// The message of [`AllocError::OutOfMemory`]: PyTorch's numbers, then why.
struct OomMessage<'a>(&'a AllocError);

impl std::fmt::Display for OomMessage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let AllocError::OutOfMemory {
            requested,
            allocated,
            reserved_unallocated,
            device_free,
            device_total,
            limit,
            diagnosis,
        } = self.0
        else {
            return Ok(());
        };
        let (asked, total, free) = (
            format_bytes(*requested),
            format_bytes(*device_total),
            format_bytes(*device_free),
        );
        write!(
            f,
            "out of memory: tried to allocate {asked} ({requested} bytes). The device has a \
             total capacity of {total} of which {free} is free"
        )?;
        if let Some(limit) = limit {
            let limit = format_bytes(*limit);
            write!(f, "; the per-process memory fraction allows {limit}")?;
        }
        let (allocated, cached) = (
            format_bytes(*allocated),
            format_bytes(*reserved_unallocated),
        );
        write!(
            f,
            ". Of the memory this allocator holds, {allocated} is allocated and {cached} is \
             reserved but unallocated (the cache was freed and the allocation retried before \
             failing)."
        )?;
        let (needed, largest, fragmented) = (
            format_bytes(diagnosis.rounded),
            format_bytes(diagnosis.largest_free_block),
            format_bytes(diagnosis.fragmented),
        );
        write!(
            f,
            " Why: the request needs a block of {needed}; the largest free block is {largest}, \
             and {fragmented} of the reserved-but-unallocated memory is in free blocks too \
             small for it (fragmentation)."
        )?;
        for advice in &diagnosis.advice {
            write!(f, " Advice: {advice}.")?;
        }
        Ok(())
    }
}

/// What [`CachingAllocator::check_invariants`](super::CachingAllocator::check_invariants)
/// found: the first disagreement between the engine's structures, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct InvariantViolation {
    what: String,
}

impl InvariantViolation {
    pub(crate) fn new(what: String) -> Self {
        InvariantViolation { what }
    }

    /// The disagreement: which structure, which block or statistic, what was expected.
    pub fn what(&self) -> &str {
        &self.what
    }
}

/// Why a request ran out of memory: what the allocator's free memory looked like.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OomDiagnosis {
    /// The block size the request needs (the request rounded).
    pub rounded: u64,
    /// The largest free (cached) block, in bytes.
    pub largest_free_block: u64,
    /// Bytes in free blocks smaller than `rounded`: reserved, unallocated, and no use to this
    /// request (fragmentation).
    pub fragmented: u64,
    /// Configuration that would help, when the numbers point at it.
    pub advice: Vec<OomAdvice>,
}

/// Configuration an out-of-memory report recommends, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OomAdvice {
    /// The free bytes would hold the request if they were contiguous (fragmentation):
    /// `expandable_segments:True` grows one segment instead of leaving gaps between many.
    ExpandableSegments,
    /// Large cached blocks were split by smaller requests: `max_split_size_mb` keeps blocks
    /// above it whole, so a large request finds one.
    MaxSplitSize,
    /// The cache had to be flushed and the request retried before (costly, synchronising):
    /// `garbage_collection_threshold` frees old cached blocks before it comes to that.
    GarbageCollectionThreshold,
}

impl std::fmt::Display for OomAdvice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OomAdvice::ExpandableSegments => {
                "the free memory would hold the request if it were contiguous; try \
                 `expandable_segments:True` to avoid fragmentation (on an open device: \
                 `backend::set_allocator_settings(&device, \"expandable_segments:True\")`, \
                 for segments made after the call)"
            }
            OomAdvice::MaxSplitSize => {
                "large cached blocks were split by smaller requests; try `max_split_size_mb` \
                 (e.g. the request's size in MiB) to keep large blocks whole (on an open \
                 device: `backend::set_allocator_settings(&device, \"max_split_size_mb:N\")`)"
            }
            OomAdvice::GarbageCollectionThreshold => {
                "the cache was flushed and requests retried before this one; try \
                 `garbage_collection_threshold:0.8` to free old cached blocks earlier (on an \
                 open device: `backend::set_allocator_settings(&device, \
                 \"garbage_collection_threshold:0.8\")`)"
            }
        })
    }
}

/// The numbers an out-of-memory diagnosis reads.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OomNumbers {
    pub rounded: u64,
    pub device_free: u64,
    /// Free bytes in blocks too small for the request, all pools.
    pub fragmented: u64,
    /// The part of `fragmented` in large-pool blocks.
    pub fragmented_large: u64,
    pub max_split_size_set: bool,
    pub garbage_collection_threshold_set: bool,
    pub expandable_segments_set: bool,
    /// Cache flushes before this request (`num_alloc_retries` minus `num_ooms`).
    pub earlier_flushes: u64,
}

impl OomNumbers {
    /// The advice the numbers point at.
    pub fn advice(&self) -> Vec<OomAdvice> {
        let mut advice = Vec::new();
        if !self.expandable_segments_set
            && self.fragmented > 0
            && self.fragmented + self.device_free >= self.rounded
        {
            advice.push(OomAdvice::ExpandableSegments);
        }
        if !self.max_split_size_set
            && self.fragmented_large * 4 >= self.rounded
            && self.fragmented_large > 0
        {
            advice.push(OomAdvice::MaxSplitSize);
        }
        if !self.garbage_collection_threshold_set && self.earlier_flushes > 0 {
            advice.push(OomAdvice::GarbageCollectionThreshold);
        }
        advice
    }
}

impl AllocError {
    /// The diagnosis of an [`AllocError::OutOfMemory`]; `None` for other errors.
    pub fn oom_diagnosis(&self) -> Option<&OomDiagnosis> {
        match self {
            AllocError::OutOfMemory { diagnosis, .. } => Some(diagnosis),
            _ => None,
        }
    }

    /// Whether this is an out-of-memory: [`AllocError::OutOfMemory`], or
    /// [`AllocError::TooLarge`], a request no device memory could ever hold. PyTorch learns the
    /// latter only when `cudaMalloc` fails and treats it as any out-of-memory (`num_ooms`, the
    /// observers, the OOM snapshot); so does this allocator, which only knows it earlier. A
    /// [`AllocError::Rejected`] request is one too (the observers and the snapshot see it,
    /// and the error says why), counted in `num_oom_rejections` instead of `num_ooms`.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            AllocError::OutOfMemory { .. }
                | AllocError::TooLarge { .. }
                | AllocError::Rejected { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::units::MIB;

    fn out_of_memory(limit: Option<u64>, advice: Vec<OomAdvice>) -> AllocError {
        AllocError::OutOfMemory {
            requested: 12 * MIB + 5,
            allocated: 40 * MIB,
            reserved_unallocated: 3 * MIB,
            device_free: 1536,
            device_total: 64 * MIB,
            limit,
            diagnosis: Box::new(OomDiagnosis {
                rounded: 14 * MIB,
                largest_free_block: 2 * MIB,
                fragmented: 3 * MIB - 512,
                advice,
            }),
        }
    }

    /// The out-of-memory message (PyTorch's `OutOfMemoryError` text, then why), pinned whole
    /// with and without a memory fraction and advice.
    #[test]
    fn the_out_of_memory_message_is_pinned() {
        let plain = out_of_memory(None, Vec::new()).to_string();
        let advised = out_of_memory(
            Some(48 * MIB),
            vec![OomAdvice::ExpandableSegments, OomAdvice::MaxSplitSize],
        )
        .to_string();
        assert_eq!(plain, PLAIN);
        assert_eq!(advised, ADVISED);
    }

    const PLAIN: &str = "out of memory: tried to allocate 12.00 MiB (12582917 bytes). The device has a total \
         capacity of 64.00 MiB of which 1.50 KiB is free. Of the memory this allocator holds, \
         40.00 MiB is allocated and 3.00 MiB is reserved but unallocated (the cache was freed \
         and the allocation retried before failing). Why: the request needs a block of 14.00 \
         MiB; the largest free block is 2.00 MiB, and 3.00 MiB of the \
         reserved-but-unallocated memory is in free blocks too small for it (fragmentation).";
    const ADVISED: &str = "out of memory: tried to allocate 12.00 MiB (12582917 bytes). The device has a total \
         capacity of 64.00 MiB of which 1.50 KiB is free; the per-process memory fraction \
         allows 48.00 MiB. Of the memory this allocator holds, 40.00 MiB is allocated and \
         3.00 MiB is reserved but unallocated (the cache was freed and the allocation retried \
         before failing). Why: the request needs a block of 14.00 MiB; the largest free block \
         is 2.00 MiB, and 3.00 MiB of the reserved-but-unallocated memory is in free blocks \
         too small for it (fragmentation). Advice: the free memory would hold the request if \
         it were contiguous; try `expandable_segments:True` to avoid fragmentation (on an \
         open device: `backend::set_allocator_settings(&device, \"expandable_segments:True\")`, \
         for segments made after the call). Advice: large cached blocks were split by smaller \
         requests; try `max_split_size_mb` (e.g. the request's size in MiB) to keep large \
         blocks whole (on an open device: `backend::set_allocator_settings(&device, \
         \"max_split_size_mb:N\")`).";
}
