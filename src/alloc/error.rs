//! Why an allocation or a free failed.

use super::size::format_bytes;
use crate::device::DeviceError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("allocation of 0 bytes requested; sizes must be at least 1 byte")]
    ZeroSize,
    #[error(
        "cannot allocate {} ({requested} bytes): larger than the largest segment this device can hold, {} ({max} bytes)",
        format_bytes(*requested),
        format_bytes(*max)
    )]
    TooLarge { requested: u64, max: u64 },
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
        requested: u64,
        allocated: u64,
        reserved_unallocated: u64,
        device_free: u64,
        device_total: u64,
        limit: Option<u64>,
    },
    #[error(
        "invalid free of allocation {id}: it is not live in this allocator (freed twice, or from another allocator)"
    )]
    InvalidFree { id: u64 },
    #[error(transparent)]
    Device(#[from] DeviceError),
}

impl AllocError {
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory { .. })
    }
}
