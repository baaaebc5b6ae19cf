//! A miss takes a wholly free segment another stream cached, once that stream's work on it is
//! done, before it asks the device for more.
//!
//! PyTorch caches a block for the stream that allocated it and never hands it to another
//! stream. Its streams come from a fixed pool, so that costs little there; CubeCL names a
//! stream after the thread that uses it, and Burn's `MultiThreadDataLoader` starts new worker
//! threads every epoch: under PyTorch's rule every epoch's batches are allocated on new
//! streams, and what the old workers' streams cached is never used again (reserved memory
//! climbs epoch after epoch, burn issue 4792).
//!
//! With `cross_stream_reuse:true` (the default), a miss that would allocate device memory
//! (not a cache-only request), after the stream's own cache and its borrow from the other
//! pool, takes the best-fitting (smallest, then lowest address) **wholly free segment** of
//! the request's pool cached on another stream, **idle streams first** (no allocated or
//! pending block), then busy ones. The segment moves to the requesting stream whole, so every
//! later free of its blocks is ordered by that stream alone, as for any of its segments.
//! Segments with a live block stay where they are: lending one of their free blocks would
//! need an event on every later free of it; an idle stream's cache is all whole segments
//! anyway (free neighbours merge). Expandable segments never move (their address range is
//! the stream's).
//!
//! **Safety**: a block freed on stream A may still be used by work A issued before the free.
//! Each stream counts its frees and stamps each newly free block with the count
//! ([`Block::freed_at`](crate::alloc::block::Block)); a fence (an event recorded on A, with A's
//! free count then) tells which frees are behind completed work: a segment whose stamp is at
//! most the count of A's last completed fence may go to another stream. A stream records its
//! fence when it becomes idle (its last live block freed), so that by the time another stream
//! misses the event has long completed; a miss that finds a candidate newer than the last
//! fence records one (if none is pending) and asks it once. Fences are recorded only once the
//! engine has seen two streams: a single-stream workload pays nothing.
//!
//! **Waiting on the device** (CUDA, [`DeviceMemory::waits_on_device`]): a candidate whose last
//! free is not behind a completed fence is still taken, as RMM's stream-ordered pool takes
//! another stream's block (`get_block_from_other_stream` behind `cudaStreamWaitEvent`): the
//! engine records an event on the lender now and makes the requester wait for it on the
//! device, so the requester's work on the block runs after the lender's; the host never
//! blocks. A segment moved that way counts as freed on its new stream at the move, so that a
//! third stream takes it only behind the new stream's fence or wait, which comes after the
//! wait (a vector-clock property test checks the order transitively). A wait that cannot be
//! set up leaves the block where it is. On a device without such waits, events are only
//! queried: a busy stream's segment is never taken before its work is done, and a miss whose
//! candidates are all behind pending fences allocates new memory.
//!
//! **Lending**: where no wholly free segment fits, a miss is lent the best free *block*
//! another stream cached whose last free is behind completed work (the same fences), without
//! moving it: the block stays its stream's, split there by the usual rules, and the requesting
//! stream is recorded as a use of it (PyTorch's `record_stream`), so its free waits for an
//! event on the requesting stream before the block serves its own stream again. Idle streams
//! lend any block. A busy stream lends only to a stream that holds **no segment of the request's pool** (a new thread's first memory), and
//! only **small-pool room its own use has never needed**: each stream counts the bytes of its
//! blocks it allocated itself, now and at their peak, and a loan must leave its free bytes in
//! the pool covering that peak minus its use now. A new data-loader worker's 100 KiB batch is
//! then served by the free part of the training thread's small segment instead of a 2 MiB
//! segment of its own, and a loader's reserved memory stays level instead of following how
//! many workers the scheduler ran at once. Between threads that keep working, each thread's
//! cache still comes to cover its own work: once it has a segment of the pool, its misses
//! grow it, as under PyTorch's rule, so a steady loop settles after its first rounds: a
//! thread that lived on loans takes its one small segment when a loan is first refused.
//! Large blocks of busy streams are never lent (a large block is a working tensor of its
//! stream's own loop). Without lending each new thread would take a 2 MiB small segment of
//! its own: on a simulated device with CUDA's waits, a loader's 2 to 8 workers making
//! 100 KiB batches reserve 6 MiB with it and 10 to 22 MiB without
//! (`docs/decisions/threads-and-streams.md`).
//!
//! Statistics: a moved segment stays in its pool (no statistic changes but
//! `num_stream_shares`, which counts the moves); it costs no device call. A lent block is an
//! allocation like any other, counted in `num_stream_lends`.
//! `cross_stream_reuse:false` is PyTorch's rule.

use std::collections::HashMap;

use super::Engine;
use crate::alloc::block::{BlockId, BlockState};
use crate::alloc::error::AllocError;
use crate::alloc::size::{PoolKind, SMALL_BUFFER};
use crate::alloc::stats::StatArray;
use crate::device::{DeviceMemory, DeviceStream};

/// Candidates a search looks at per busy stream past its best fit: a busy stream's free list
/// also holds the split blocks of its live segments, which never move, and a miss should not
/// walk them all.
const BUSY_STREAM_CANDIDATES: usize = 16;

/// A stream's candidate for another stream's request: its size and address (best fit takes
/// the smallest, then the lowest), the block, and whether handing it over needs the requester
/// to wait on the device for the lender's queued work (its last free is not behind a
/// completed fence yet).
type Candidate = (u64, u64, BlockId, bool);

/// What the engine knows of one stream, for sharing its cache.
pub(crate) struct StreamState<E> {
    pub(crate) stream: DeviceStream,
    /// Allocated and pending-free blocks on the stream.
    pub(crate) live: u64,
    /// Blocks that became free on the stream so far: the stamp of the newest.
    pub(crate) frees: u64,
    /// The newest fence recorded and not yet seen complete: its event and the free count
    /// it covers.
    fence: Option<(E, u64)>,
    /// The free count covered by the newest fence seen complete.
    passed: u64,
    /// Bytes of the stream's blocks allocated by the stream itself (not lent to another), per
    /// pool: now (`current`) and at most so far (`peak`, never reset).
    pub(crate) own: StatArray,
}

/// Every stream the engine has served, in first-use order.
pub(crate) struct StreamTable<E> {
    pub(crate) streams: Vec<StreamState<E>>,
}

impl<E> Default for StreamTable<E> {
    fn default() -> Self {
        Self {
            streams: Vec::new(),
        }
    }
}

impl<E> StreamTable<E> {
    /// The index of `stream`, added on first use.
    fn index(&mut self, stream: DeviceStream) -> usize {
        match self.streams.iter().position(|s| s.stream == stream) {
            Some(i) => i,
            None => {
                self.streams.push(StreamState {
                    stream,
                    live: 0,
                    frees: 0,
                    fence: None,
                    passed: 0,
                    own: StatArray::default(),
                });
                self.streams.len() - 1
            }
        }
    }
}

impl<D: DeviceMemory> Engine<D> {
    fn sharing(&self) -> bool {
        self.config.cross_stream_reuse && !self.expandable() && !self.uncached()
    }

    /// Block `block` of `stream` was handed out to `requester`. Counted whatever the settings:
    /// sharing can be turned on at run time (`set_allocator_settings`), and a block freed while
    /// it was off must not look covered by a fence that never saw its stream's work. A block
    /// handed to its own stream counts in the stream's own use (and its peak); one lent to
    /// another stream is marked lent.
    pub(super) fn note_allocated(
        &mut self,
        block: BlockId,
        stream: DeviceStream,
        requester: DeviceStream,
    ) {
        let i = self.streams.index(stream);
        self.streams.streams[i].live += 1;
        if requester != stream {
            self.blocks[block].lent = true;
            return;
        }
        let (pool, size) = (self.blocks.pool(block), self.blocks[block].size());
        self.streams.streams[i].own.increase(pool, size);
    }

    /// The free of block `block` was asked for: its bytes leave its stream's own use (a lent
    /// block's never entered it).
    pub(super) fn note_free_requested(&mut self, block: BlockId) {
        if std::mem::take(&mut self.blocks[block].lent) {
            return;
        }
        let (pool, size) = (self.blocks.pool(block), self.blocks[block].size());
        let i = self.streams.index(self.blocks.stream(block));
        self.streams.streams[i].own.decrease(pool, size);
    }

    /// Whether `stream` holds a segment of `pool` of the allocator's own pools.
    fn holds_segment(&self, stream: DeviceStream, pool: PoolKind) -> bool {
        self.blocks.segments().any(|(_, segment)| {
            segment.stream == stream && segment.pool == pool && segment.mem_pool.is_none()
        })
    }

    /// Whether busy stream `i` can lend `bytes` of `pool` and still hold, free, what its own
    /// use has needed beyond its use now: its free bytes in the pool's segments minus `bytes`
    /// cover its peak own use minus its own use now. A busy stream thus lends only the part
    /// of its cache its own work has never needed (the loader worker's batch served by the
    /// free part of the training thread's small segment), never memory it will ask for again
    /// (a thread's working set in a loop: lending it made the lender grow a segment in a
    /// later round).
    fn has_surplus(&self, i: usize, pool: PoolKind, bytes: u64, free: u64) -> bool {
        let own = self.streams.streams[i].own.pool(pool);
        free.saturating_sub(bytes) >= own.peak - own.current
    }

    /// The free bytes each stream holds in `pool`'s ordinary segments (one walk of the blocks,
    /// made when a miss first looks at a busy stream, for every busy stream it looks at).
    fn free_bytes_by_stream(&self, pool: PoolKind) -> HashMap<DeviceStream, u64> {
        let mut free = HashMap::new();
        for (id, segment) in self.blocks.segments() {
            if segment.pool != pool || segment.mem_pool.is_some() || segment.expandable {
                continue;
            }
            let bytes: u64 = self
                .blocks
                .segment_blocks(id)
                .filter(|&block| self.blocks[block].state == BlockState::Inactive)
                .map(|block| self.blocks[block].size())
                .sum();
            *free.entry(segment.stream).or_insert(0) += bytes;
        }
        free
    }

    /// Block `block` of `stream` became free (after merging): stamps it (whatever the
    /// settings, as [`note_allocated`](Self::note_allocated) counts), and, while sharing is on,
    /// records the stream's fence when this was its last live block.
    pub(super) fn note_freed(&mut self, block: BlockId, stream: DeviceStream) {
        let i = self.streams.index(stream);
        let state = &mut self.streams.streams[i];
        state.live = state.live.saturating_sub(1);
        state.frees += 1;
        self.blocks[block].freed_at = state.frees;
        if state.live == 0 && self.streams.streams.len() > 1 && self.sharing() {
            // A failure leaves the stream without a new fence: a later miss tries again and
            // reports it.
            let _ = self.record_fence(i);
        }
    }

    /// Records a fence on stream `i` covering its frees so far, unless one is pending (a
    /// fence completes in stream order, so a newer one would wait behind it anyway).
    fn record_fence(&mut self, i: usize) -> Result<(), AllocError> {
        let state = &self.streams.streams[i];
        if state.fence.is_some() || state.passed == state.frees {
            return Ok(());
        }
        let (stream, frees) = (state.stream, state.frees);
        let event = self.device.record_event(stream)?;
        self.streams.streams[i].fence = Some((event, frees));
        Ok(())
    }

    /// The free count of stream `i` behind completed work, after asking its pending fence.
    fn poll_fence(&mut self, i: usize) -> Result<u64, AllocError> {
        if let Some((event, _)) = &self.streams.streams[i].fence
            && self.device.query_event(event)?
        {
            let (event, covered) = self.streams.streams[i].fence.take().expect("a fence");
            self.device.release_event(event);
            self.streams.streams[i].passed = covered;
        }
        Ok(self.streams.streams[i].passed)
    }

    /// Takes the best wholly free segment of `pool` that another stream cached for a request
    /// of `rounded` bytes on `stream`, and hands it to `stream`: its one free, unlisted block.
    /// `None` when no other stream holds one whose last free is behind completed work.
    pub(super) fn take_from_other_stream(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        self.take_segment_from_other_stream(pool, stream, rounded, u64::MAX)
    }

    /// With pool borrowing on as well, a miss of `pool` that neither its stream's other pool
    /// nor another stream's `pool` could serve borrows from another stream's other pool: the
    /// wholly free segment a borrow could take there (a small-pool segment for a large
    /// request of at most 2 MiB, an exactly 2 MiB large-pool segment for a small request)
    /// moves to `stream` and is borrowed as [`borrow_from_other_pool`] borrows. Without this,
    /// rounds of new threads whose requests straddle the 1 MiB line kept the wrong pool's
    /// segments of the gone threads cached and made new ones for every round.
    ///
    /// [`borrow_from_other_pool`]: Engine::borrow_from_other_pool
    pub(super) fn borrow_from_other_stream(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if !self.config.pool_borrowing {
            return Ok(None);
        }
        let (other, want, limit) = match pool {
            PoolKind::Large if rounded <= SMALL_BUFFER => (PoolKind::Small, rounded, u64::MAX),
            PoolKind::Large => return Ok(None),
            PoolKind::Small => (PoolKind::Large, SMALL_BUFFER, SMALL_BUFFER),
        };
        let Some(segment) = self.take_segment_from_other_stream(other, stream, want, limit)? else {
            return Ok(None);
        };
        // The segment is the stream's now: listed there, it is the one block of the other
        // pool that the borrow can take (the stream's own were looked at before this).
        self.list(segment);
        let borrowed = self.borrow_from_other_pool(pool, stream, rounded);
        debug_assert!(borrowed.is_some(), "a moved segment is borrowed");
        Ok(borrowed)
    }

    /// [`take_from_other_stream`](Self::take_from_other_stream) for segments of at most
    /// `limit` bytes.
    fn take_segment_from_other_stream(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
        limit: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if !self.sharing() {
            return Ok(None);
        }
        // The requesting stream counts as known from its first miss: another stream's idle
        // cache may serve that very miss.
        self.streams.index(stream);
        if self.streams.streams.len() < 2 {
            return Ok(None);
        }
        let best = self.best_of_other_streams(stream, |engine, i, idle| {
            engine.shareable_segment(i, pool, rounded, limit, idle)
        });
        let Some((block, waited)) = self.hand_over(best, stream) else {
            return Ok(None);
        };
        self.unlist(block);
        self.blocks.set_stream(block, stream);
        self.blocks[block].freed_at = if waited {
            // The old stream's work may still use it: only the new stream is ordered after
            // that work (by its wait), so for every other stream the segment counts as freed
            // on the new stream now, behind the wait: a third stream takes it (or a part of
            // it) only after a fence or a wait on the new stream, which comes after the old
            // stream's work.
            let i = self.streams.index(stream);
            self.streams.streams[i].frees += 1;
            self.streams.streams[i].frees
        } else {
            // Its old stream's work on it is done (its fence passed).
            0
        };
        self.stats.num_stream_shares += 1;
        Ok(Some(block))
    }

    /// The block of the winning candidate `best` (of lender stream index `.0`), once
    /// `requester` may use it: at once when the lender's fence covers its last free, else
    /// after `requester` was made to wait on the device for an event recorded on the lender
    /// now (RMM's stream-ordered pool takes another stream's block behind
    /// `cudaStreamWaitEvent` the same way), with whether it waited. `None` when that wait could
    /// not be set up: the block stays where it is, and the request goes on to new memory.
    fn hand_over(
        &mut self,
        best: Option<(usize, Candidate)>,
        requester: DeviceStream,
    ) -> Option<(BlockId, bool)> {
        let (lender, (_, _, block, wait)) = best?;
        if !wait {
            return Some((block, false));
        }
        let stream = self.streams.streams[lender].stream;
        let waited = self.device.record_event(stream).and_then(|event| {
            let waited = self.device.wait_event(requester, &event);
            self.device.release_event(event);
            waited
        });
        match waited {
            Ok(()) => Some((block, true)),
            Err(err) => {
                log::warn!(
                    "caching allocator: {requester} cannot wait for {stream}'s work ({err}); \
                     its cache stays with it"
                );
                None
            }
        }
    }

    /// Stream `i`'s best wholly free segment for a request of `rounded` bytes that its fences
    /// allow another stream to take: (size, address, block). Records a fence when the best
    /// candidate is newer than every fence.
    fn shareable_segment(
        &mut self,
        i: usize,
        pool: PoolKind,
        rounded: u64,
        limit: u64,
        idle: bool,
    ) -> Result<Option<Candidate>, AllocError> {
        let stream = self.streams.streams[i].stream;
        let list = self.free_list_ref(pool);
        let mut next = list.best_fit(stream, rounded);
        let mut visited = 0;
        let mut candidate = None;
        while let Some((size, block)) = next {
            if size > limit || !self.oversize_rules_allow(rounded, size) {
                break;
            }
            if !self.blocks[block].is_split() && !self.in_expandable_segment(block) {
                candidate = Some((size, self.blocks.address(block), block));
                break;
            }
            visited += 1;
            if !idle && visited > BUSY_STREAM_CANDIDATES {
                break;
            }
            next = list.next_after(stream, size, self.blocks.address(block));
        }
        let Some((size, address, block)) = candidate else {
            return Ok(None);
        };
        let stamp = self.blocks[block].freed_at;
        if stamp <= self.poll_fence(i)? {
            return Ok(Some((size, address, block, false)));
        }
        if self.device.waits_on_device() {
            return Ok(Some((size, address, block, true)));
        }
        self.record_fence(i)?;
        Ok((stamp <= self.poll_fence(i)?).then_some((size, address, block, false)))
    }

    /// Lends `stream` the best free block (smallest, then lowest address; idle streams first)
    /// of `pool` that another stream cached and whose last free is behind completed work, for
    /// a request of `rounded` bytes: the block stays its stream's (split by its rules, its
    /// remainder cached there), and `stream` is recorded as a use of it, so that its free
    /// waits for an event on `stream` before the block is that stream's again (PyTorch's
    /// `record_stream` rule). For what whole segments cannot do: a new thread's first small
    /// request served by the part of another stream's small segment that is free, instead of
    /// a 2 MiB segment of its own per thread. The caller allocates the block
    /// ([`Engine::allocate_block_for`]).
    pub(super) fn lend_from_other_stream(
        &mut self,
        pool: PoolKind,
        stream: DeviceStream,
        rounded: u64,
    ) -> Option<BlockId> {
        if !self.sharing() || self.streams.streams.len() < 2 {
            return None;
        }
        // A busy stream lends only to a stream without a segment of the pool, small-pool room
        // its own use never needed (see the module documentation).
        let busy_lend = pool == PoolKind::Small && !self.holds_segment(stream, pool);
        let mut free: Option<HashMap<DeviceStream, u64>> = None;
        let best = self.best_of_other_streams(stream, |engine, i, idle| {
            if !idle {
                if !busy_lend {
                    return Ok(None);
                }
                let free = free.get_or_insert_with(|| engine.free_bytes_by_stream(pool));
                let held = free
                    .get(&engine.streams.streams[i].stream)
                    .copied()
                    .unwrap_or(0);
                if !engine.has_surplus(i, pool, rounded, held) {
                    return Ok(None);
                }
            }
            engine.lendable_block(i, pool, rounded, idle)
        });
        // A lent block stays its stream's, and its free waits for the borrower's work (the use
        // is recorded): no stamp to move.
        let (block, _) = self.hand_over(best, stream)?;
        self.unlist(block);
        self.stats.num_stream_lends += 1;
        Some(block)
    }

    /// The best candidate (smallest, then lowest address) that `candidate` finds on a stream
    /// other than `stream`, streams with no live block first (`candidate` is told which it is
    /// looking at). A fence that cannot be recorded or asked (an event pool exhausted on a
    /// nearly full device) leaves that stream's cache where it is: the request goes on to new
    /// memory and the out-of-memory path, never fails here.
    fn best_of_other_streams(
        &mut self,
        stream: DeviceStream,
        mut candidate: impl FnMut(&mut Self, usize, bool) -> Result<Option<Candidate>, AllocError>,
    ) -> Option<(usize, Candidate)> {
        for idle in [true, false] {
            let mut best: Option<(usize, Candidate)> = None;
            for i in 0..self.streams.streams.len() {
                let state = &self.streams.streams[i];
                if state.stream == stream || (state.live == 0) != idle {
                    continue;
                }
                let found = candidate(self, i, idle).unwrap_or_else(|err| {
                    log::warn!(
                        "caching allocator: a stream's fence failed ({err}); its cache stays with it"
                    );
                    None
                });
                if let Some(found) = found
                    && best.is_none_or(|(_, b)| (found.0, found.1) < (b.0, b.1))
                {
                    best = Some((i, found));
                }
            }
            if best.is_some() {
                return best;
            }
        }
        None
    }

    /// Stream `i`'s best free block for a request of `rounded` bytes that its fences allow
    /// another stream to use: (size, address, block). Records a fence when the best
    /// candidate is newer than every fence; a busy stream's list is walked for at most
    /// [`BUSY_STREAM_CANDIDATES`] blocks.
    fn lendable_block(
        &mut self,
        i: usize,
        pool: PoolKind,
        rounded: u64,
        idle: bool,
    ) -> Result<Option<Candidate>, AllocError> {
        let stream = self.streams.streams[i].stream;
        let list = self.free_list_ref(pool);
        let mut next = list.best_fit(stream, rounded);
        let mut visited = 0;
        let mut fenced = false;
        while let Some((size, block)) = next {
            if !self.oversize_rules_allow(rounded, size) {
                return Ok(None);
            }
            // An expandable segment is its stream's growing range: never lent, even where
            // `expandable_segments` was turned off after it was made.
            if self.in_expandable_segment(block) {
                let list = self.free_list_ref(pool);
                next = list.next_after(stream, size, self.blocks.address(block));
                continue;
            }
            let stamp = self.blocks[block].freed_at;
            if stamp <= self.poll_fence(i)? {
                return Ok(Some((size, self.blocks.address(block), block, false)));
            }
            if self.device.waits_on_device() {
                return Ok(Some((size, self.blocks.address(block), block, true)));
            }
            if !fenced {
                self.record_fence(i)?;
                fenced = true;
                if stamp <= self.poll_fence(i)? {
                    return Ok(Some((size, self.blocks.address(block), block, false)));
                }
            }
            visited += 1;
            if !idle && visited > BUSY_STREAM_CANDIDATES {
                return Ok(None);
            }
            let list = self.free_list_ref(pool);
            next = list.next_after(stream, size, self.blocks.address(block));
        }
        Ok(None)
    }

    /// Hands back every pending fence's event (waiting for none): for `empty_cache` and a drop.
    pub(super) fn release_fences(&mut self) {
        for state in &mut self.streams.streams {
            if let Some((event, _)) = state.fence.take() {
                self.device.release_event(event);
            }
        }
    }
}
