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
    /// (PyTorch's `OutOfMemoryError`).
    #[error(
        "out of memory: tried to allocate {} ({requested} bytes). The device has a total capacity of {} of which {} is free{}. \
         Of the memory this allocator holds, {} is allocated and {} is reserved but unallocated \
         (the cache was freed and the allocation retried before failing).",
        format_bytes(*requested),
        format_bytes(*device_total),
        format_bytes(*device_free),
        limit.map(|l| format!("; the per-process memory fraction allows {}", format_bytes(l))).unwrap_or_default(),
        format_bytes(*allocated),
        format_bytes(*reserved_unallocated)
    )]
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
    },
    /// A free of an allocation that is not live in this allocator.
    #[error(
        "invalid free of allocation {id}: it is not live in this allocator (freed twice, or from another allocator)"
    )]
    InvalidFree {
        /// The allocation's id.
        id: u64,
    },
    /// The device failed in some other way.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

impl AllocError {
    /// Whether this is [`AllocError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory { .. })
    }
}
