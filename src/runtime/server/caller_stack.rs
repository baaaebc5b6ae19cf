//! The caller's stack for each reservation: captured where the tensor operation was called,
//! handed to the engine where the reservation is served.
//!
//! CubeCL 0.10 serves every server call on its device thread, so a stack captured at the
//! engine's `malloc` shows CubeCL's machinery, not the model. But every client call that
//! reserves memory (cubecl-runtime 0.10 `src/client.rs`: `do_empty` behind `empty`,
//! `empty_tensor(s)`; `do_create` behind `create`, `create_tensor(s)`;
//! `do_create_from_slices` behind the `*_from_slice(s)` calls; `change_client_sync` behind
//! `to_client`) first applies the server's `MemoryLayoutPolicy` **on the caller's thread**, and
//! then queues exactly one `initialize_memory(handle, size, stream_id)` whose `size` is the
//! policy's base handle's size and whose `stream_id` is the one the policy was given (the
//! calling thread's stream). The policy computes all the tensors of one call into a single
//! base handle, so one call is one reservation, with or without data, however many tensors.
//!
//! [`CallerStackPolicy`] therefore captures the caller's stack there (only while the engine
//! records stacks: otherwise it costs one relaxed atomic load) and appends it, with the size
//! and the private pool the calling stream routes this device's reservations to (a
//! [`CallerContext`]; `runtime::pool_route`, one more relaxed load while no route exists),
//! to a FIFO per stream id in [`CallerStacks`]. The device thread runs one thread's queued calls
//! in the order that thread queued them (`ChannelDeviceHandle`; the reentrant handle runs them
//! inline, in order too), so the server's next `initialize_memory` of that stream is the call
//! the FIFO's front was captured for; [`CallerStacks::take`] checks the size as well and pops
//! the front before the reservation runs, so a reservation that fails consumes its own entry.
//! Threads each have their own stream id, hence their own FIFO.
//!
//! With the stack, the policy captures the caller's memory scope ([`CallerContext::scope`]:
//! the scope of the stream id it was given, see `runtime::scopes`), so that the reservation is
//! tagged with it. Entries are queued only while stacks are recorded or a scope is active
//! somewhere; otherwise the policy costs two relaxed atomic loads.
//!
//! The one call where the policy and the reservation are not the same server's is
//! `ComputeClient::to_client` without server communication (`change_client_sync`, which Burn
//! does not call: Burn moves tensors with `to_client_tensor`, which applies no policy): it
//! applies the *source* device's policy and reserves on the destination. The policy
//! recognises it by its caller's name (resolved once per return address) and records nothing,
//! so the source's FIFO stays in step; on the destination that reservation has no entry, and
//! carries the device thread's own stack unless the FIFO's front (a later call of the same
//! thread) has exactly its size.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cubecl_common::stream_id::StreamId;
use cubecl_runtime::allocator::ContiguousMemoryLayoutPolicy;
use cubecl_runtime::server::{Handle, MemoryLayout, MemoryLayoutDescriptor, MemoryLayoutPolicy};
use parking_lot::Mutex;

use crate::alloc::{CachingAllocator, MemPoolId, Stack, Tag};
use crate::device::DeviceMemory;
use crate::runtime::{pool_route, scopes};

/// How many of the innermost frames above the capture are looked at to name the client call.
const CALLER_FRAMES: usize = 8;

/// What the policy learnt on the caller's thread about one reservation: the caller's stack
/// (while the engine records stacks), its memory scope (see `runtime::scopes`) and the
/// private pool it routes to (see `runtime::pool_route`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct CallerContext {
    /// The caller's stack, while the engine records stacks.
    pub(crate) stack: Option<Stack>,
    /// The caller's memory scope, if one is active on its stream.
    pub(crate) scope: Option<Tag>,
    /// The private pool the caller's stream routes to, if any.
    pub(crate) pool: Option<MemPoolId>,
}

/// One caller's context waiting for its reservation.
struct Pending {
    size: u64,
    context: CallerContext,
}

/// The stacks captured by the policy, per CubeCL stream id, oldest first.
#[derive(Default)]
pub(crate) struct CallerStacks {
    /// How many stacks wait, over all streams: the server's check when stacks are off.
    waiting: AtomicUsize,
    queues: Mutex<HashMap<StreamId, VecDeque<Pending>>>,
    /// Per return address: whether it lies in a client call that reserves on another server.
    elsewhere: Mutex<HashMap<usize, bool>>,
}

impl CallerStacks {
    fn push(&self, stream: StreamId, size: u64, context: CallerContext) {
        self.queues
            .lock()
            .entry(stream)
            .or_default()
            .push_back(Pending { size, context });
        self.waiting.fetch_add(1, Ordering::Release);
    }

    /// The context captured for `stream`'s next reservation, if it is one of `size` bytes.
    pub(crate) fn take(&self, stream: StreamId, size: u64) -> Option<CallerContext> {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut queues = self.queues.lock();
        let queue = queues.get_mut(&stream)?;
        if queue.front()?.size != size {
            return None;
        }
        let pending = queue.pop_front()?;
        if queue.is_empty() {
            queues.remove(&stream);
        }
        self.waiting.fetch_sub(1, Ordering::Release);
        Some(pending.context)
    }

    /// How many stacks wait for their reservation (all streams).
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether `stack` was captured in a client call whose reservation goes to another server
    /// (`ComputeClient::to_client` / `change_client_sync`).
    fn reserves_elsewhere(&self, stack: &Stack) -> bool {
        let mut known = self.elsewhere.lock();
        stack
            .addresses()
            .iter()
            .take(CALLER_FRAMES)
            .any(|&address| {
                *known.entry(address).or_insert_with(|| {
                    Stack::names_at(address).iter().any(|name| {
                        name.contains("change_client_sync")
                            || (name.contains("ComputeClient<") && name.ends_with("::to_client"))
                    })
                })
            })
    }
}

/// CubeCL's contiguous layout, plus the caller's stack captured for the reservation that
/// follows while the engine records stacks (see the module documentation).
pub struct CallerStackPolicy<M: DeviceMemory> {
    layout: ContiguousMemoryLayoutPolicy,
    allocator: Arc<CachingAllocator<M>>,
    stacks: Arc<CallerStacks>,
}

impl<M: DeviceMemory> CallerStackPolicy<M> {
    /// Contiguous layouts aligned to `alignment`, with stacks for `allocator`'s recording.
    pub(crate) fn new(
        alignment: usize,
        allocator: Arc<CachingAllocator<M>>,
        stacks: Arc<CallerStacks>,
    ) -> Self {
        // The policy sits between the caller and the capture: resolved stacks start below it.
        crate::alloc::Stack::skip_frames_of("burn_caching_alloc::runtime::server::caller_stack::");
        Self {
            layout: ContiguousMemoryLayoutPolicy::new(alignment),
            allocator,
            stacks,
        }
    }
}

impl<M: DeviceMemory> MemoryLayoutPolicy for CallerStackPolicy<M> {
    // Kept out of line: its frame marks where the stack was captured, and the resolver drops
    // it with everything inside.
    #[inline(never)]
    fn apply(
        &self,
        stream_id: StreamId,
        descriptors: &[MemoryLayoutDescriptor],
    ) -> (Handle, Vec<MemoryLayout>) {
        let applied = self.layout.apply(stream_id, descriptors);
        let pool = pool_route::current(self.allocator.allocator_id(), stream_id);
        let scope = scopes::current(stream_id);
        let records = self.allocator.records_stacks();
        if records || pool.is_some() || scope.is_some() {
            // Captured for a scope or a pool too: it tells a reservation made on another
            // server apart, which must leave this server's queue in step.
            let stack = Stack::capture();
            if !self.stacks.reserves_elsewhere(&stack) {
                let context = CallerContext {
                    stack: records.then_some(stack),
                    scope,
                    pool,
                };
                self.stacks.push(stream_id, applied.0.size(), context);
            }
        }
        applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_goes_to_its_streams_next_reservation_of_its_size_only() {
        let stacks = CallerStacks::default();
        let (a, b) = (StreamId { value: 1 }, StreamId { value: 2 });
        let first = Stack::capture();
        let second = Stack::capture();
        let context = |stack: &Stack, scope: Option<Tag>, pool| CallerContext {
            stack: Some(stack.clone()),
            scope,
            pool,
        };
        stacks.push(a, 1024, context(&first, None, None));
        stacks.push(
            a,
            2048,
            context(
                &second,
                Some(Tag::new("second")),
                Some(MemPoolId::from_number(3)),
            ),
        );
        let take = |stream, size| {
            stacks
                .take(stream, size)
                .map(|c: CallerContext| (c.stack, c.scope.map(|t| t.name().to_string()), c.pool))
        };
        assert_eq!(take(b, 1024), None, "another stream's");
        // A reservation the policy recorded nothing for (a `to_client` copy) does not take
        // the next call's stack, and leaves it in place.
        assert_eq!(take(a, 4096), None);
        assert_eq!(take(a, 1024), Some((Some(first), None, None)));
        assert_eq!(
            take(a, 2048),
            Some((
                Some(second),
                Some("second".to_string()),
                Some(MemPoolId::from_number(3))
            ))
        );
        assert_eq!(stacks.waiting(), 0);
        assert_eq!(take(a, 2048), None);
    }
}
