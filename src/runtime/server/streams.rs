//! The server's stream table: per stream slot, the CubeCL memory manager over the engine, the
//! driver's stream state, the cross-stream sync points, the metadata scratch, and the errors
//! waiting to be reported.
//!
//! CubeCL names a stream after the thread that uses it, so every new thread (a data-loader
//! worker, a test thread) brings a new [`StreamId`]. As in cubecl-runtime's `StreamPool`,
//! ids map onto a bounded number of slots, `id % max_streams`: threads beyond that share a
//! slot, its driver stream, its engine stream and the memory cached there, instead of each
//! leaving a stream and its cache behind. The default bound is CubeCL's own
//! (`streaming.max_streams` of CubeCL's configuration, 128).
//!
//! CubeCL 0.10's `initialize_memory`, `write` and `launch` cannot return errors, so a failure
//! there is kept on its stream and returned by the next `read`, `sync` or `flush` of that
//! stream, which also clears it: the server keeps working.

use std::collections::HashMap;
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::server::{Handle, ServerError};

use super::super::driver::Driver;
use super::super::stream_memory::{ReclaimPolicy, StreamMemory};
use super::ordering::SyncPoints;
use crate::alloc::{CachingAllocator, RecordMode};
use crate::device::DeviceStream;

/// The slot of CubeCL stream `id` among `max_streams` (cubecl-runtime's `stream_index`).
pub(crate) fn slot(id: StreamId, max_streams: usize) -> usize {
    (id.value % max_streams.max(1) as u64) as usize
}

/// The launching stream's device buffer for uploaded kernel metadata (see `metadata`).
pub(super) struct MetadataScratch {
    pub(super) handle: Handle,
    pub(super) capacity: u64,
}

/// One stream slot on the server.
pub(super) struct ServerStream<D: Driver> {
    pub(super) memory: StreamMemory<D::Memory>,
    pub(super) driver: D::Stream,
    /// Operations issued on this stream so far (reservations, writes, launches): a buffer
    /// bound at cursor `c` is complete for a consumer that synced with this stream at `c` or
    /// later.
    pub(super) cursor: u64,
    /// The cursor of each other slot this stream last waited for.
    pub(super) synced: SyncPoints,
    pub(super) metadata: Option<MetadataScratch>,
    errors: Vec<ServerError>,
}

/// Every stream slot the server has used, created on first use.
pub(super) struct Streams<D: Driver> {
    allocator: Arc<CachingAllocator<D::Memory>>,
    memory_properties: MemoryDeviceProperties,
    max_streams: usize,
    streams: HashMap<usize, ServerStream<D>>,
}

impl<D: Driver> Streams<D> {
    pub(super) fn new(
        allocator: Arc<CachingAllocator<D::Memory>>,
        memory_properties: MemoryDeviceProperties,
        max_streams: usize,
    ) -> Self {
        Self {
            allocator,
            memory_properties,
            max_streams: max_streams.max(1),
            streams: HashMap::new(),
        }
    }

    /// How many slots CubeCL stream ids map onto.
    pub(super) fn max_streams(&self) -> usize {
        self.max_streams
    }

    /// Changes the bound; only before the first stream is used (the mapping must not change
    /// under live buffers).
    pub(super) fn set_max_streams(&mut self, max_streams: usize) -> bool {
        if !self.streams.is_empty() {
            return false;
        }
        self.max_streams = max_streams.max(1);
        true
    }

    /// The slot of CubeCL stream `id`.
    pub(super) fn slot(&self, id: StreamId) -> usize {
        slot(id, self.max_streams)
    }

    /// The stream of `id`'s slot, created (with its driver state from `driver`) on first use.
    pub(super) fn get(&mut self, driver: &mut D, id: StreamId) -> &mut ServerStream<D> {
        let slot = self.slot(id);
        self.get_slot(driver, slot)
    }

    /// The stream of `slot`, created on first use.
    pub(super) fn get_slot(&mut self, driver: &mut D, slot: usize) -> &mut ServerStream<D> {
        let allocator = &self.allocator;
        let properties = &self.memory_properties;
        self.streams.entry(slot).or_insert_with(|| {
            // A stream created while the engine records a trace sees every tensor (see
            // `ReclaimPolicy::EveryReserve`): the policy follows the recording, asked of the
            // allocator (under its lock) only when the stream is created, never on a lookup,
            // which every operation makes.
            let policy = if allocator.history_options().enabled == RecordMode::All {
                ReclaimPolicy::EveryReserve
            } else {
                ReclaimPolicy::Amortised
            };
            let engine_stream = DeviceStream(slot as u64);
            ServerStream {
                memory: StreamMemory::new(allocator.clone(), engine_stream, properties)
                    .with_policy(policy),
                driver: driver.create_stream(engine_stream),
                cursor: 0,
                synced: SyncPoints::default(),
                metadata: None,
                errors: Vec::new(),
            }
        })
    }

    /// Every used slot, as a CubeCL stream id that maps onto it, for calls that visit them all.
    pub(super) fn ids(&self) -> Vec<StreamId> {
        self.streams
            .keys()
            .map(|slot| StreamId {
                value: *slot as u64,
            })
            .collect()
    }

    /// How many slots are in use.
    pub(super) fn len(&self) -> usize {
        self.streams.len()
    }

    /// Every stream but the slot of `except`.
    pub(super) fn others(
        &mut self,
        except: StreamId,
    ) -> impl Iterator<Item = &mut ServerStream<D>> {
        let except = self.slot(except);
        self.streams
            .iter_mut()
            .filter(move |(slot, _)| **slot != except)
            .map(|(_, stream)| stream)
    }

    /// Every stream, for read-only sums.
    pub(super) fn all(&self) -> impl Iterator<Item = &ServerStream<D>> {
        self.streams.values()
    }

    /// Keeps `error` for the next `read`, `sync` or `flush` of `id`.
    pub(super) fn push_error(&mut self, driver: &mut D, id: StreamId, error: ServerError) {
        self.get(driver, id).errors.push(error);
    }

    /// Takes the pending errors of `id` as one error, if there are any.
    pub(super) fn take_errors(&mut self, driver: &mut D, id: StreamId) -> Result<(), ServerError> {
        let errors = core::mem::take(&mut self.get(driver, id).errors);
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.into_iter().next().expect("one error")),
            _ => Err(ServerError::ServerUnhealthy {
                errors,
                backtrace: BackTrace::capture(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_map_onto_bounded_slots_as_cubecl_does() {
        // cubecl-runtime's `stream_index`: `id % max_streams`.
        let id = |value| StreamId { value };
        assert_eq!(slot(id(0), 4), 0);
        assert_eq!(slot(id(5), 4), 1);
        assert_eq!(slot(id(1_000_003), 128), 1_000_003 % 128);
        // A bound of zero would divide by zero: it is one slot.
        assert_eq!(slot(id(7), 0), 0);
    }
}
