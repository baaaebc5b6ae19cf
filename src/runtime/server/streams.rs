//! The server's stream table: per CubeCL stream, the CubeCL memory manager over the engine, the
//! driver's stream state, and the errors waiting to be reported.
//!
//! CubeCL 0.10's `initialize_memory`, `write` and `launch` cannot return errors, so a failure
//! there is kept on its stream and returned by the next `read`, `sync` or `flush` of that
//! stream, which also clears it: the server keeps working.

use std::collections::HashMap;
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::stream_id::StreamId as CubeStreamId;
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::server::ServerError;

use super::super::driver::Driver;
use super::super::stream_memory::{ReclaimPolicy, StreamMemory};
use crate::alloc::CachingAllocator;
use crate::device::StreamId;

/// One CubeCL stream on the server.
pub(super) struct ServerStream<D: Driver> {
    pub(super) memory: StreamMemory<D::Memory>,
    pub(super) driver: D::Stream,
    errors: Vec<ServerError>,
}

/// Every stream the server has seen, created on first use.
pub(super) struct Streams<D: Driver> {
    allocator: Arc<CachingAllocator<D::Memory>>,
    memory_properties: MemoryDeviceProperties,
    streams: HashMap<CubeStreamId, ServerStream<D>>,
}

impl<D: Driver> Streams<D> {
    pub(super) fn new(
        allocator: Arc<CachingAllocator<D::Memory>>,
        memory_properties: MemoryDeviceProperties,
    ) -> Self {
        Self {
            allocator,
            memory_properties,
            streams: HashMap::new(),
        }
    }

    /// The stream `id`, created (with its driver state from `driver`) on first use.
    pub(super) fn get(&mut self, driver: &mut D, id: CubeStreamId) -> &mut ServerStream<D> {
        let allocator = &self.allocator;
        let properties = &self.memory_properties;
        self.streams.entry(id).or_insert_with(|| {
            // A recording engine sees every tensor: see `ReclaimPolicy::EveryReserve`.
            let policy = if allocator.config().record_history {
                ReclaimPolicy::EveryReserve
            } else {
                ReclaimPolicy::Amortised
            };
            let engine_stream = StreamId(id.value);
            ServerStream {
                memory: StreamMemory::new(allocator.clone(), engine_stream, properties)
                    .with_policy(policy),
                driver: driver.create_stream(engine_stream),
                errors: Vec::new(),
            }
        })
    }

    /// Every stream's id, for calls that visit them all.
    pub(super) fn ids(&self) -> Vec<CubeStreamId> {
        self.streams.keys().copied().collect()
    }

    /// How many streams exist.
    pub(super) fn len(&self) -> usize {
        self.streams.len()
    }

    /// Every stream but `except`.
    pub(super) fn others(
        &mut self,
        except: CubeStreamId,
    ) -> impl Iterator<Item = &mut ServerStream<D>> {
        self.streams
            .iter_mut()
            .filter(move |(id, _)| **id != except)
            .map(|(_, stream)| stream)
    }

    /// Every stream, for read-only sums.
    pub(super) fn all(&self) -> impl Iterator<Item = &ServerStream<D>> {
        self.streams.values()
    }

    /// Keeps `error` for the next `read`, `sync` or `flush` of `id`.
    pub(super) fn push_error(&mut self, driver: &mut D, id: CubeStreamId, error: ServerError) {
        self.get(driver, id).errors.push(error);
    }

    /// Takes the pending errors of `id` as one error, if there are any.
    pub(super) fn take_errors(
        &mut self,
        driver: &mut D,
        id: CubeStreamId,
    ) -> Result<(), ServerError> {
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
