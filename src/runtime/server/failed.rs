//! Buffers whose reservation failed, and the error every later use of one returns.
//!
//! CubeCL 0.10's `initialize_memory` cannot fail: when the engine cannot serve a new tensor,
//! the server keeps the error on the stream (the next `read`, `sync` or `flush` reports it) and
//! the tensor's handle stays unbound. Burn goes on with the tensor: the kernel that fills it
//! is launched, the bytes of a `create` are written, a later operation reads it. None of these
//! may touch memory: an unbound handle has none (it resolves to the stream's guard slice, see
//! [`StreamMemory`](super::super::StreamMemory)), so the server refuses it, and each such use
//! returns the reservation's own error, as PyTorch raises the failed allocation's error and
//! every live tensor keeps its values.
//!
//! CubeCL's handles carry no identity the server can read, so a failure is found again by the
//! stream that made the buffer and the buffer's size: the latest failed reservation of that
//! size on that stream whose tensor is still alive. Two failed buffers of one size on one
//! stream share the latest error; a buffer with none on record (its failure's record pruned,
//! or never made on this server) gets a generic one. A record is dropped, at the slot's next
//! failure or lookup, once the server holds the only reference to its handle.

use cubecl_common::backtrace::BackTrace;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::server::ServerError;

/// One failed reservation.
struct Failed {
    /// A clone of the buffer's handle: tells when the tensor is gone.
    handle: ManagedMemoryHandle,
    /// The bytes the buffer asked for (the size of every binding of it).
    size: u64,
    /// What the reservation failed with.
    error: ServerError,
}

/// The failed reservations of one stream slot whose buffers are still alive.
#[derive(Default)]
pub(super) struct FailedReservations {
    failed: Vec<Failed>,
}

impl FailedReservations {
    /// Remembers that `handle`'s reservation of `size` bytes failed with `error`.
    pub(super) fn record(&mut self, handle: ManagedMemoryHandle, size: u64, error: ServerError) {
        self.prune();
        self.failed.push(Failed {
            handle,
            size,
            error,
        });
    }

    /// The error a use of an unbound buffer of `size` bytes returns: its reservation's.
    pub(super) fn error_for(&mut self, size: u64) -> ServerError {
        self.prune();
        match self.failed.iter().rev().find(|failed| failed.size == size) {
            Some(failed) => failed.error.clone(),
            None => ServerError::Generic {
                reason: format!(
                    "caching allocator: a buffer of {size} bytes has no memory: its \
                     reservation failed (that error was reported then)"
                ),
                backtrace: BackTrace::capture(),
            },
        }
    }

    /// How many failed buffers are still alive.
    #[cfg(test)]
    pub(super) fn len(&mut self) -> usize {
        self.prune();
        self.failed.len()
    }

    /// Forgets the failures whose tensors are gone (the record holds the last reference).
    fn prune(&mut self) {
        self.failed.retain(|failed| !failed.handle.is_free());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(reason: &str) -> ServerError {
        ServerError::Generic {
            reason: reason.into(),
            backtrace: BackTrace::capture(),
        }
    }

    fn reason(error: ServerError) -> String {
        match error {
            ServerError::Generic { reason, .. } => reason,
            other => panic!("not a generic error: {other:?}"),
        }
    }

    #[test]
    fn a_use_returns_the_latest_live_failure_of_its_size() {
        let mut failed = FailedReservations::default();
        let small = ManagedMemoryHandle::new();
        let large = ManagedMemoryHandle::new();
        failed.record(small.clone(), 512, error("small"));
        failed.record(large.clone(), 4096, error("large"));
        assert_eq!(reason(failed.error_for(512)), "small");
        assert_eq!(reason(failed.error_for(4096)), "large");
        let again = ManagedMemoryHandle::new();
        failed.record(again.clone(), 512, error("small again"));
        assert_eq!(reason(failed.error_for(512)), "small again");
        // Gone tensors are forgotten: the older failure of the size answers again.
        drop(again);
        assert_eq!(reason(failed.error_for(512)), "small");
        assert_eq!(failed.len(), 2);
        drop((small, large));
        assert_eq!(failed.len(), 0);
        assert!(reason(failed.error_for(512)).contains("has no memory"));
    }
}
