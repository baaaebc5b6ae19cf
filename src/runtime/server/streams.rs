//! The server's stream table: per stream slot, the CubeCL memory manager over the engine, the
//! driver's stream state, the cross-stream sync points, the metadata scratch, and the errors
//! waiting to be reported.
//!
//! CubeCL names a stream after the thread that uses it, so every new thread (a data-loader
//! worker, a test thread) brings a new [`StreamId`]. As in cubecl-runtime's `StreamPool`,
//! ids map onto a bounded number of slots, `id % max_streams`: threads beyond that share a
//! slot, its driver stream, its engine stream and the memory cached there, instead of each
//! leaving a stream and its cache behind. The default bound is CubeCL's own
//! (`streaming.max_streams` of CubeCL's configuration, 128); on a driver with one queue
//! (`Driver::SINGLE_QUEUE`, wgpu) it is one slot, whatever CubeCL's configuration says: every
//! thread's work is issued in one order there, so one CubeCL pool and one engine stream serve
//! every thread, and what follows has nothing to do.
//!
//! **Slot reuse** (with `cross_stream_reuse`, the default): a thread seen for the first time
//! is given the least recently used slot whose threads have all exited (they report it:
//! [`thread_exit`](crate::runtime::thread_exit)), else the least recently used slot that no
//! operation of its own threads touched for [`REUSE_AFTER`] operations of the device and that
//! one of them will never report leaving (threads that never opened a client of ours are
//! recognised by their silence; a watched thread that is silent is waiting, and keeps its
//! slot), and only when there is neither CubeCL's slot of its id; it keeps that slot for its lifetime (a buffer remembers its maker's id, and the
//! ordering rules find the slot by it). PyTorch's streams come from a fixed pool and threads
//! share the current stream; here the new workers of every epoch take over the slots of the
//! workers that are gone, with their CubeCL pools and their engine caches, so their memory
//! serves them under the per-stream rule itself, even where a tensor the old worker made is
//! still alive and pins its segment (burn-fusion keeps the last batch's integer tensor of each
//! data-loader worker: without slot reuse every epoch left one 2 MiB segment per worker). A
//! slot of an unwatched thread that only looks idle (waiting on a channel) may be shared with
//! a new thread: that is what ids beyond `max_streams` do anyway, ordered by the one driver
//! stream. Watched threads are not given away for silence: two threads that keep working on
//! one stream make its cache follow how they interleave (threads waiting on a barrier between
//! rounds, on a loaded machine, then grew a segment in a later round). A use of
//! a slot's buffer by another stream and a reading of the numbers do not count as touching it.
//! `cross_stream_reuse:false` keeps PyTorch's rule: every thread's stream is its own.
//!
//! A slot whose thread has gone (a data-loader worker of the previous epoch) is never asked
//! for memory again, so the exact-size slices its CubeCL pool keeps free would never reach
//! the engine, which would share them with other streams (`cross_stream_reuse`). The table
//! therefore hands idle slots' free slices back itself: when a slot is created (a new thread
//! came: every other slot holding no live slice gives its free slices back), and, before a
//! reservation, every [`IDLE_PERIOD`] operations ([`Streams::hand_back_idle`]: every slot that
//! no operation touched for a whole period gives back its free slices, live or not). Each slot
//! is walked once per idle spell: a slot handed back is not walked again before an operation
//! touches it.
//!
//! CubeCL 0.10's `initialize_memory`, `write` and `launch` cannot return errors, so a failure
//! there is kept on its stream and returned by the next `read`, `sync` or `flush` of that
//! stream, which also clears it: the server keeps working. A failed reservation is also kept
//! in its slot's `failed` record, so that every later use of the buffer returns its error
//! (see `failed`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use cubecl_common::backtrace::BackTrace;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::server::{Handle, ServerError};

use super::super::driver::Driver;
use super::super::stream_memory::{ReclaimPolicy, StreamMemory};
use super::failed::FailedReservations;
use super::ordering::SyncPoints;
use crate::alloc::CachingAllocator;
use crate::device::DeviceStream;
use crate::runtime::thread_exit::{self, ExitInbox, UNMATCHED_EXITS};

/// Operations on a device between two looks for slots that no operation touched since the
/// previous look (see the module documentation).
pub(crate) const IDLE_PERIOD: u64 = 4096;

/// Operations on a device during which no operation of a slot's own threads touched it, before
/// a new thread is given that slot instead of one of its own (see the module documentation).
pub(crate) const REUSE_AFTER: u64 = 32;

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
    /// The buffers made on this slot whose reservation failed (see `failed`).
    pub(super) failed: FailedReservations,
    errors: Vec<ServerError>,
    /// The table's operation count when an operation last touched this slot.
    touched: u64,
    /// Whether the slot's free slices were handed back as idle since it was last touched.
    handed_back: bool,
    /// The CubeCL stream id last given this slot, for calls that visit every slot.
    owner: Option<u64>,
}

impl<D: Driver> ServerStream<D> {
    /// Keeps `error` for the next `read`, `sync` or `flush` of this stream, once: a use of a
    /// buffer whose reservation failed returns that failure's error (see `failed`), which the
    /// stream may hold already, and it is reported once.
    pub(super) fn push_error(&mut self, error: ServerError) {
        let text = error.to_string();
        if !self.errors.iter().any(|kept| kept.to_string() == text) {
            self.errors.push(error);
        }
    }
}

/// The reclaim policy of a stream slot given out now: every tensor an engine event while
/// `BURN_CACHING_ALLOC_TRACE` records a trace (`every_tensor`, read when the device opened) or
/// the engine caches nothing (see `get_slot`), else amortised. Recording history with
/// `record_memory_history` changes no policy: a program allocates the same whether or not it
/// records.
fn policy_for<M: crate::device::DeviceMemory>(
    allocator: &CachingAllocator<M>,
    every_tensor: bool,
) -> ReclaimPolicy {
    if every_tensor || allocator.config().no_cuda_memory_caching {
        ReclaimPolicy::EveryReserve
    } else {
        ReclaimPolicy::Amortised
    }
}

/// Every stream slot the server has used, created on first use.
pub(super) struct Streams<D: Driver> {
    allocator: Arc<CachingAllocator<D::Memory>>,
    memory_properties: MemoryDeviceProperties,
    max_streams: usize,
    streams: HashMap<usize, ServerStream<D>>,
    /// Operations on any slot so far.
    operations: u64,
    /// The operation count at the last look for idle slots.
    last_look: u64,
    /// The slot of every CubeCL stream id seen, fixed for the id's lifetime: a buffer
    /// remembers the id of the stream that made it, and the ordering rules find its slot by
    /// that id.
    assigned: HashMap<u64, usize>,
    /// Stream ids given an idle slot of an earlier thread.
    reuses: u64,
    /// Per slot, how many of the stream ids given it have not reported their thread's exit.
    living: HashMap<usize, u32>,
    /// Per slot, how many of the stream ids given it belong to threads that will never report
    /// their exit (not watched when first met): only such a slot is given away for its silence.
    unwatched: HashMap<usize, u32>,
    /// Where exiting threads post their stream ids.
    exits: Arc<ExitInbox>,
    /// The slot the last new thread took over from earlier threads, until its free slices are
    /// handed back (see [`Streams::get`]).
    taken_over: Option<usize>,
    /// Ids whose exit was read before this server met them (their last operations were still
    /// on their way, or another device's threads), most recent last, at most
    /// [`UNMATCHED_EXITS`].
    exited_unseen: VecDeque<u64>,
    /// [`REUSE_AFTER`], or `u64::MAX` in tests of what happens without slot reuse.
    reuse_after: u64,
    /// Whether `BURN_CACHING_ALLOC_TRACE` named a trace when the device opened: every stream
    /// then shows the engine every tensor ([`ReclaimPolicy::EveryReserve`]).
    every_tensor: bool,
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
            max_streams: Self::slots_for(max_streams),
            streams: HashMap::new(),
            operations: 0,
            last_look: 0,
            assigned: HashMap::new(),
            reuses: 0,
            living: HashMap::new(),
            unwatched: HashMap::new(),
            exits: ExitInbox::subscribe(),
            taken_over: None,
            exited_unseen: VecDeque::new(),
            reuse_after: REUSE_AFTER,
            every_tensor: super::super::env::traces_every_tensor(),
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
        self.max_streams = Self::slots_for(max_streams);
        true
    }

    /// The slots `max_streams` asks for: one on a driver with one queue (every thread's work
    /// is issued in one order there, so one CubeCL pool and one engine stream serve them all,
    /// see `Driver::SINGLE_QUEUE`), else `max_streams` (at least one).
    fn slots_for(max_streams: usize) -> usize {
        if D::SINGLE_QUEUE {
            1
        } else {
            max_streams.max(1)
        }
    }

    /// The slot of CubeCL stream `id`: the one it was given when first seen, else CubeCL's.
    pub(super) fn slot(&self, id: StreamId) -> usize {
        match self.assigned.get(&id.value) {
            Some(&slot) => slot,
            None => slot(id, self.max_streams),
        }
    }

    /// New threads get slots of their own, never an idle one (for tests of the idle hand-back
    /// and of the engine's cross-stream reuse, which slot reuse would leave nothing to do).
    #[cfg(test)]
    pub(super) fn never_reuse_slots(&mut self) {
        self.reuse_after = u64::MAX;
    }

    /// Hears no thread exits (for tests whose stream ids are made up; see `tests::harness`).
    #[cfg(test)]
    pub(super) fn ignore_thread_exits(&mut self) {
        self.exits = Arc::new(ExitInbox::default());
    }

    /// Hears thread exits again, from now on.
    #[cfg(test)]
    pub(super) fn listen_to_thread_exits(&mut self) {
        self.exits = ExitInbox::subscribe();
    }

    /// How many stream ids were given an idle slot of an earlier thread so far.
    pub(super) fn reuses(&self) -> u64 {
        self.reuses
    }

    /// Counts the exits threads have reported since the last look against their slots.
    fn read_exits(&mut self) {
        for id in self.exits.take() {
            match self.assigned.get(&id) {
                Some(slot) => {
                    if let Some(living) = self.living.get_mut(slot) {
                        *living = living.saturating_sub(1);
                    }
                }
                // A thread whose operations have not all arrived yet, or another device's.
                None => {
                    if self.exited_unseen.len() == UNMATCHED_EXITS {
                        self.exited_unseen.pop_front();
                    }
                    self.exited_unseen.push_back(id);
                }
            }
        }
    }

    /// The slot of `id`, given on first sight: the least recently touched slot whose threads
    /// have all exited, else the least recently touched slot of a thread that will not report
    /// its exit and that no operation touched for [`REUSE_AFTER`] operations (a thread that is
    /// gone without a word, or one that has been waiting; sharing a slot is correct either
    /// way, as for ids beyond `max_streams`), else CubeCL's slot of `id`.
    fn assign(&mut self, id: StreamId) -> usize {
        if let Some(&slot) = self.assigned.get(&id.value) {
            return slot;
        }
        let operations = self.operations;
        // Read whatever the setting: the inbox is emptied as new threads come.
        self.read_exits();
        // Under PyTorch's per-stream rule (`cross_stream_reuse:false`) a new thread's stream
        // is its own, as in PyTorch: nothing it did not allocate itself serves it.
        let idle = if self.allocator.config().cross_stream_reuse && self.reuse_after != u64::MAX {
            let living = &self.living;
            let vacant = self
                .streams
                .iter()
                .filter(|(slot, _)| living.get(slot) == Some(&0))
                .min_by_key(|(slot, stream)| (stream.touched, **slot))
                .map(|(slot, _)| *slot);
            let unwatched = &self.unwatched;
            vacant.or_else(|| {
                self.streams
                    .iter()
                    .filter(|(slot, stream)| {
                        unwatched.get(slot).is_some_and(|&threads| threads > 0)
                            && stream.touched.saturating_add(self.reuse_after) <= operations
                    })
                    .min_by_key(|(slot, stream)| (stream.touched, **slot))
                    .map(|(slot, _)| *slot)
            })
        } else {
            None
        };
        let slot = match idle {
            Some(slot) => {
                self.reuses += 1;
                slot
            }
            None => slot(id, self.max_streams),
        };
        self.taken_over = idle;
        self.assigned.insert(id.value, slot);
        let living = self.living.entry(slot).or_default();
        match self.exited_unseen.iter().position(|&gone| gone == id.value) {
            // Its thread has exited already: the slot is no more lived in than before.
            Some(index) => {
                self.exited_unseen.remove(index);
            }
            None => {
                *living += 1;
                if !thread_exit::is_watched(id.value) {
                    *self.unwatched.entry(slot).or_default() += 1;
                }
            }
        }
        if let Some(stream) = self.streams.get_mut(&slot) {
            stream.owner = Some(id.value);
            if idle.is_some() {
                // As for a slot created now: under `no_cuda_memory_caching` (which may have
                // been set since) every tensor is an engine event.
                stream
                    .memory
                    .set_policy(policy_for(&self.allocator, self.every_tensor));
            }
        }
        slot
    }

    /// The slot of `id`, given now if `id` is new: what every decision about `id`'s work (which
    /// stream waits for which) must use, so that a wait goes to the stream the work then runs
    /// on. [`slot`](Self::slot) alone would name CubeCL's slot for a new thread, and slot
    /// reuse could then put its work on another one.
    pub(super) fn assign_slot(&mut self, id: StreamId) -> usize {
        self.assign(id)
    }

    /// The stream of `id`'s slot, created (with its driver state from `driver`) on first use,
    /// for an operation on it.
    pub(super) fn get(&mut self, driver: &mut D, id: StreamId) -> &mut ServerStream<D> {
        let slot = self.assign(id);
        self.operations += 1;
        if !self.streams.contains_key(&slot) {
            // A new thread: the slots of threads that are gone give their free slices back
            // before it allocates.
            self.get_slot(driver, slot);
            self.hand_back(driver, slot, false);
        }
        if let Some(taken) = self.taken_over.take()
            && let Some(stream) = self.streams.get_mut(&taken)
        {
            // A slot taken over by a new thread: the exact-size slices its earlier threads
            // left free go back to the engine, whose best fit serves the new thread's sizes
            // from the slot's cache (CubeCL's pools serve only the sizes the earlier threads
            // used). Its work so far is issued first, as for any hand-back.
            if let Err(err) = driver.flush(&mut stream.driver) {
                stream.errors.push(err);
            }
            stream.memory.reclaim_idle();
        }
        let operations = self.operations;
        let stream = self.get_slot(driver, slot);
        stream.touched = operations;
        stream.handed_back = false;
        stream.owner.get_or_insert(id.value);
        stream
    }

    /// The stream of `id`'s slot, without counting an operation of it: for a use of its
    /// buffer by another stream, or a reading, which say nothing of whether its threads are
    /// still there.
    pub(super) fn peek(&mut self, driver: &mut D, id: StreamId) -> &mut ServerStream<D> {
        let slot = self.slot(id);
        self.get_slot(driver, slot)
    }

    /// Every [`IDLE_PERIOD`] operations, hands the free CubeCL slices of the slots no
    /// operation touched since the last look back to the engine (see the module
    /// documentation); one comparison otherwise.
    pub(super) fn hand_back_idle(&mut self, driver: &mut D, id: StreamId) {
        if self.operations >= self.last_look + IDLE_PERIOD {
            let current = self.slot(id);
            self.hand_back(driver, current, true);
            self.last_look = self.operations;
        }
    }

    /// Hands the free slices of slots other than `current` back to the engine: with
    /// `period_over`, of those untouched since the last look; otherwise of those holding no
    /// live slice. A slot already handed back and untouched since is skipped.
    fn hand_back(&mut self, driver: &mut D, current: usize, period_over: bool) {
        let last_look = self.last_look;
        for (slot, stream) in &mut self.streams {
            if *slot == current || stream.handed_back {
                continue;
            }
            if period_over {
                if stream.touched >= last_look {
                    continue;
                }
            } else {
                // The slot's metadata scratch is the one live slice a slot without tensors
                // holds.
                let scratch = u64::from(stream.metadata.is_some());
                if stream.memory.usage().number_allocs > scratch {
                    continue;
                }
            }
            // As for `memory_cleanup`: the work submitted so far is issued before its slices
            // may serve other tensors.
            if let Err(err) = driver.flush(&mut stream.driver) {
                stream.errors.push(err);
            }
            stream.metadata = None;
            stream.memory.reclaim_idle();
            stream.handed_back = true;
        }
    }

    /// The stream of `slot`, created on first use.
    pub(super) fn get_slot(&mut self, driver: &mut D, slot: usize) -> &mut ServerStream<D> {
        let allocator = &self.allocator;
        let properties = &self.memory_properties;
        let every_tensor = self.every_tensor;
        self.streams.entry(slot).or_insert_with(|| {
            // Under `BURN_CACHING_ALLOC_TRACE` a stream sees every tensor (see
            // `ReclaimPolicy::EveryReserve`), so that the trace is the workload. The policy is
            // asked of the allocator (under its lock) only when the stream is created, never
            // on a lookup, which every operation makes.
            // Without caching (`no_cuda_memory_caching`) CubeCL's exact-size reuse is bypassed
            // the same way, so that every tensor is an engine request of its own.
            let policy = policy_for(allocator, every_tensor);
            let engine_stream = DeviceStream(slot as u64);
            ServerStream {
                memory: StreamMemory::new(allocator.clone(), engine_stream, properties)
                    .with_policy(policy),
                driver: driver.create_stream(engine_stream),
                cursor: 0,
                synced: SyncPoints::default(),
                metadata: None,
                failed: FailedReservations::default(),
                errors: Vec::new(),
                touched: 0,
                handed_back: false,
                owner: None,
            }
        })
    }

    /// Every used slot, as a CubeCL stream id that maps onto it, for calls that visit them all.
    pub(super) fn ids(&self) -> Vec<StreamId> {
        self.streams
            .iter()
            .map(|(slot, stream)| StreamId {
                value: stream.owner.unwrap_or(*slot as u64),
            })
            .collect()
    }

    /// Operations counted so far (what the idle looks are spaced by).
    #[cfg(test)]
    pub(super) fn operations(&self) -> u64 {
        self.operations
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

    /// The slot `id` maps onto, if it exists (nothing is made, given or marked).
    pub(super) fn existing(&mut self, id: StreamId) -> Option<&mut ServerStream<D>> {
        let slot = self.slot(id);
        self.streams.get_mut(&slot)
    }

    /// Every stream, for a reading that must touch no slot (no slot is made, given or marked).
    pub(super) fn all_mut(&mut self) -> impl Iterator<Item = &mut ServerStream<D>> {
        self.streams.values_mut()
    }

    /// Every stream, for read-only sums.
    pub(super) fn all(&self) -> impl Iterator<Item = &ServerStream<D>> {
        self.streams.values()
    }

    /// Keeps `error` for the next `read`, `sync` or `flush` of `id`.
    pub(super) fn push_error(&mut self, driver: &mut D, id: StreamId, error: ServerError) {
        self.get(driver, id).push_error(error);
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
