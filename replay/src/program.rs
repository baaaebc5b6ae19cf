//! A trace compiled for replay: its inputs, checked, with allocation ids turned into slots.
//!
//! Compiling checks that the trace is well formed (every free and every stream record names
//! a live allocation, no id is allocated twice while live, no request is of zero bytes, every
//! request routed to a private pool names a pool made before it and not yet let go) and
//! computes what is a property of the trace alone, whatever the allocator: the bytes of live
//! requests after every operation and their peak.

use std::collections::{HashMap, HashSet};

use burn_caching_alloc::alloc::{MemPoolOptions, Trace, TraceEvent};
use burn_caching_alloc::device::DeviceStream;

/// One replayable operation. `slot` indexes a table of live handles; `pool` numbers the
/// trace's private pools from 0, in the order they were made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Malloc {
        slot: u32,
        size: u64,
        stream: DeviceStream,
        /// The private pool the request was routed to; `None`: the allocator's own pools.
        pool: Option<u32>,
    },
    Free {
        slot: u32,
    },
    RecordStream {
        slot: u32,
        stream: DeviceStream,
    },
    EmptyCache,
    /// A private pool is made.
    PoolCreate {
        pool: u32,
        options: MemPoolOptions,
    },
    /// A private pool returns its wholly free segments.
    PoolEmptyCache {
        pool: u32,
    },
    /// A private pool is let go.
    PoolRelease {
        pool: u32,
    },
}

/// Why a trace cannot be replayed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("event {index}: free of allocation {id}, which is not live")]
    FreeOfDeadAllocation { index: usize, id: u64 },
    #[error("event {index}: record_stream of allocation {id}, which is not live")]
    RecordOfDeadAllocation { index: usize, id: u64 },
    #[error("event {index}: allocation {id} is allocated again while still live")]
    DuplicateAllocation { index: usize, id: u64 },
    #[error("event {index}: allocation {id} requests zero bytes")]
    ZeroSize { index: usize, id: u64 },
    #[error("the trace has no malloc")]
    Empty,
    #[error("event {index}: allocation {id} takes the live requests past 2^64 bytes")]
    TooManyBytes { index: usize, id: u64 },
    #[error("event {index}: the trace uses more than {MAX_STREAMS} distinct streams")]
    TooManyStreams { index: usize },
    #[error("event {index}: more than 2^32 allocations are live at once")]
    TooManySlots { index: usize },
    #[error("event {index}: private pool {pool} is made a second time")]
    PoolCreatedTwice { index: usize, pool: u64 },
    #[error("event {index}: private pool {pool} was never made, or was let go")]
    UnknownPool { index: usize, pool: u64 },
    #[error("event {index}: the trace makes more than {MAX_POOLS} private pools")]
    TooManyPools { index: usize },
}

/// The most private pools a replayed trace may make (each costs the allocators a pool).
pub const MAX_POOLS: usize = 4096;

/// The most distinct streams a replayed trace may use: each costs the replay per-stream state
/// (a CubeCL manager in the caching stack), so a trace naming millions is refused.
pub const MAX_STREAMS: usize = 1024;

/// A checked trace, ready to replay.
#[derive(Clone, Debug)]
pub struct Program {
    ops: Vec<Op>,
    slots: usize,
    mallocs: usize,
    peak_allocated: u64,
    peak_op: usize,
    appended_frees: usize,
    skipped_events: usize,
    pools: usize,
}

impl Program {
    /// Compiles the inputs of `trace`. Allocations still live at the end get a free appended,
    /// so every replay ends with nothing allocated.
    ///
    /// A recorded trace whose ring overwrote events (`dropped > 0`) may free or record
    /// allocations whose malloc fell off the ring, and route requests to a pool whose making
    /// fell off it; those frees, records and pool operations are skipped and those requests
    /// served by the allocator's own pools (each counted in [`Program::skipped_events`]). In a
    /// complete trace they are errors.
    pub fn compile(trace: &Trace) -> Result<Self, TraceError> {
        let lenient = trace.dropped > 0;
        let mut ops = Vec::new();
        let mut live: HashMap<u64, (u32, u64)> = HashMap::new();
        let mut free_slots: Vec<u32> = Vec::new();
        let mut slots = 0usize;
        let mut mallocs = 0usize;
        let mut allocated = 0u64;
        let mut peak_allocated = 0u64;
        let mut peak_op = 0usize;
        let mut skipped_events = 0usize;
        // Trace pool number -> (program pool, still routable).
        let mut pools: HashMap<u64, (u32, bool)> = HashMap::new();
        let mut streams: HashSet<u64> = HashSet::new();
        let mut stream_seen = |stream: u64, index: usize| {
            if streams.len() >= MAX_STREAMS && !streams.contains(&stream) {
                return Err(TraceError::TooManyStreams { index });
            }
            streams.insert(stream);
            Ok(())
        };
        for (index, event) in trace.events.iter().enumerate() {
            match *event {
                TraceEvent::Malloc {
                    id,
                    size,
                    stream,
                    pool,
                    ..
                } => {
                    let pool = match (pool, pools.get(&pool)) {
                        (0, _) => None,
                        (_, Some(&(number, true))) => Some(number),
                        _ if lenient => {
                            skipped_events += 1;
                            None
                        }
                        _ => return Err(TraceError::UnknownPool { index, pool }),
                    };
                    if size == 0 {
                        return Err(TraceError::ZeroSize { index, id });
                    }
                    if live.contains_key(&id) {
                        return Err(TraceError::DuplicateAllocation { index, id });
                    }
                    allocated = allocated
                        .checked_add(size)
                        .ok_or(TraceError::TooManyBytes { index, id })?;
                    stream_seen(stream, index)?;
                    let slot = match free_slots.pop() {
                        Some(slot) => slot,
                        None => {
                            let slot = u32::try_from(slots)
                                .map_err(|_| TraceError::TooManySlots { index })?;
                            slots += 1;
                            slot
                        }
                    };
                    live.insert(id, (slot, size));
                    mallocs += 1;
                    ops.push(Op::Malloc {
                        slot,
                        size,
                        stream: DeviceStream(stream),
                        pool,
                    });
                    if allocated > peak_allocated {
                        peak_allocated = allocated;
                        peak_op = ops.len() - 1;
                    }
                }
                TraceEvent::FreeRequested { id } => match live.remove(&id) {
                    Some((slot, size)) => {
                        allocated -= size;
                        free_slots.push(slot);
                        ops.push(Op::Free { slot });
                    }
                    None if lenient => skipped_events += 1,
                    None => return Err(TraceError::FreeOfDeadAllocation { index, id }),
                },
                TraceEvent::RecordStream { id, stream } => match live.get(&id) {
                    Some(&(slot, _)) => {
                        stream_seen(stream, index)?;
                        ops.push(Op::RecordStream {
                            slot,
                            stream: DeviceStream(stream),
                        })
                    }
                    None if lenient => skipped_events += 1,
                    None => return Err(TraceError::RecordOfDeadAllocation { index, id }),
                },
                TraceEvent::EmptyCache => ops.push(Op::EmptyCache),
                TraceEvent::PoolCreate {
                    pool,
                    no_split,
                    use_on_oom,
                } => {
                    if pool == 0 || pools.contains_key(&pool) {
                        return Err(TraceError::PoolCreatedTwice { index, pool });
                    }
                    if pools.len() >= MAX_POOLS {
                        return Err(TraceError::TooManyPools { index });
                    }
                    let number = pools.len() as u32;
                    pools.insert(pool, (number, true));
                    ops.push(Op::PoolCreate {
                        pool: number,
                        options: MemPoolOptions {
                            no_split,
                            use_on_oom,
                        },
                    });
                }
                TraceEvent::PoolEmptyCache { pool } | TraceEvent::PoolRelease { pool } => {
                    match pools.get_mut(&pool) {
                        Some((number, routable @ true)) => {
                            if matches!(event, TraceEvent::PoolRelease { .. }) {
                                *routable = false;
                                ops.push(Op::PoolRelease { pool: *number });
                            } else {
                                ops.push(Op::PoolEmptyCache { pool: *number });
                            }
                        }
                        _ if lenient => skipped_events += 1,
                        _ => return Err(TraceError::UnknownPool { index, pool }),
                    }
                }
                _ => {}
            }
        }
        if mallocs == 0 {
            return Err(TraceError::Empty);
        }
        let mut leftovers: Vec<(u64, u32)> = live.iter().map(|(id, (s, _))| (*id, *s)).collect();
        leftovers.sort_unstable();
        let appended_frees = leftovers.len();
        ops.extend(leftovers.into_iter().map(|(_, slot)| Op::Free { slot }));
        Ok(Self {
            ops,
            slots,
            mallocs,
            peak_allocated,
            peak_op,
            appended_frees,
            skipped_events,
            pools: pools.len(),
        })
    }

    /// Private pools the trace makes (numbered from 0 in [`Op`]).
    pub fn pools(&self) -> usize {
        self.pools
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Size of the handle table a replay needs.
    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn mallocs(&self) -> usize {
        self.mallocs
    }

    /// Peak of the bytes of live requests: a property of the trace, the same for every
    /// allocator that serves every request.
    pub fn peak_allocated(&self) -> u64 {
        self.peak_allocated
    }

    /// Index of the operation after which live requests first reach their peak.
    pub fn peak_op(&self) -> usize {
        self.peak_op
    }

    /// Frees appended for allocations the trace left live.
    pub fn appended_frees(&self) -> usize {
        self.appended_frees
    }

    /// Frees and stream records skipped because their malloc fell off a recording ring.
    pub fn skipped_events(&self) -> usize {
        self.skipped_events
    }

    /// Bytes of live requests after each operation.
    pub fn allocated_curve(&self) -> Vec<u64> {
        let mut sizes = vec![0u64; self.slots];
        let mut allocated = 0u64;
        self.ops
            .iter()
            .map(|op| {
                match *op {
                    Op::Malloc { slot, size, .. } => {
                        sizes[slot as usize] = size;
                        allocated += size;
                    }
                    Op::Free { slot } => allocated -= sizes[slot as usize],
                    Op::RecordStream { .. }
                    | Op::EmptyCache
                    | Op::PoolCreate { .. }
                    | Op::PoolEmptyCache { .. }
                    | Op::PoolRelease { .. } => {}
                }
                allocated
            })
            .collect()
    }
}
