//! Streams, events and the scheduler.
//!
//! Work queued on a stream runs later, in queue order: an item runs once it is at the head of
//! its stream and ready (a `cuStreamWaitEvent` item once the event's work ran; an NCCL item once
//! every rank of its operation is at the head of its stream). When ready work runs is the
//! scheduler's choice ([`Schedule`]): at once (`eager`), only when a synchronisation, a query or
//! a free needs it (`delayed`), or a seeded random part of it at every call (`random`).
//!
//! Independently of that order, a race detector checks every item when it is queued: each
//! stream carries a vector clock (its own count, joined with the clocks of the events it waited
//! for and with what the host saw complete); two accesses of the same bytes from different
//! streams, one a write, neither ordered before the other, are a violation. That check does not
//! depend on timing, so a missing wait is reported on every run, whatever the scheduler did.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::codes;
use crate::config::Schedule;
use crate::memory::Piece;
use crate::state::{Fake, MutexGuardExt};

/// A vector clock: per stream, how many of its items are ordered before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Clock(pub HashMap<u64, u64>);

impl Clock {
    pub fn join(&mut self, other: &Clock) {
        for (stream, seq) in &other.0 {
            let mine = self.0.entry(*stream).or_default();
            *mine = (*mine).max(*seq);
        }
    }

    pub fn get(&self, stream: u64) -> u64 {
        self.0.get(&stream).copied().unwrap_or(0)
    }
}

/// Where a copy reads or writes.
#[derive(Debug, Clone, Copy)]
pub enum Loc {
    /// Device memory, resolved when the work runs (it must still be there).
    Device { address: u64, device: usize },
    /// Host memory the driver reads or writes when the work runs (pinned).
    Host(usize),
}

#[derive(Debug)]
pub enum Op {
    Copy {
        dst: Loc,
        src: Loc,
        len: u64,
    },
    /// Host-to-device from pageable memory: the driver staged the bytes at the call.
    Staged {
        dst: u64,
        device: usize,
        data: Vec<u8>,
    },
    Memset {
        dst: u64,
        device: usize,
        pattern: Vec<u8>,
        len: u64,
    },
    /// `cuStreamWaitEvent`: ready once `stream` has run `seq` items.
    Wait {
        stream: u64,
        seq: u64,
    },
    /// An NCCL launch (a group of operations of one rank).
    Nccl {
        launch: u64,
    },
    /// A kernel launch: it changes no byte (kernels do not compute on the fake); its reads and
    /// writes are its touches. `faulty` when a pointer argument was not valid device memory
    /// at the launch (a violation then): when it runs, its stream gets the sticky
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` a device fault leaves.
    Kernel {
        faulty: bool,
    },
}

/// Memory an item touches, for frees and unmaps with queued work and for the race detector.
#[derive(Debug, Clone, Copy)]
pub enum Touch {
    Phys { piece: Piece, write: bool },
    Host { ptr: usize, len: usize },
}

#[derive(Debug)]
pub struct Work {
    pub seq: u64,
    pub op: Op,
    pub touches: Vec<Touch>,
    pub call: &'static str,
}

#[derive(Debug)]
pub struct Stream {
    pub device: usize,
    pub null: bool,
    pub alive: bool,
    pub queue: VecDeque<Work>,
    pub enqueued: u64,
    pub completed: u64,
    pub clock: Clock,
    /// A sticky error of work that ran (an illegal address), returned by the next
    /// synchronisation.
    pub error: u32,
}

impl Stream {
    pub fn new(device: usize, null: bool) -> Self {
        Self {
            device,
            null,
            alive: true,
            queue: VecDeque::new(),
            enqueued: 0,
            completed: 0,
            clock: Clock::default(),
            error: 0,
        }
    }
}

#[derive(Debug)]
pub struct Event {
    pub device: usize,
    pub alive: bool,
    /// The stream and position recorded, and the stream's clock then.
    pub recorded: Option<(u64, u64, Clock)>,
}

/// An access of queued work not yet known complete to the host.
#[derive(Debug, Clone)]
pub struct TrackedAccess {
    pub piece: Piece,
    pub write: bool,
    pub stream: u64,
    pub seq: u64,
    pub call: &'static str,
}

/// What a synchronisation waits for: streams having run up to positions.
pub type Target = Vec<(u64, u64)>;

impl Fake {
    /// The stream a call names (NULL and the legacy/per-thread handles are the context's
    /// default stream), checked alive.
    pub fn stream(&mut self, call: &str, handle: u64, device: usize) -> Result<u64, u32> {
        let handle = if handle <= 2 {
            self.devices[device].null_stream
        } else {
            handle
        };
        match self.streams.get(&handle) {
            Some(stream) if stream.alive => Ok(handle),
            Some(_) => Err(self.reject(
                call,
                codes::INVALID_HANDLE,
                format!("stream {handle:#x} used after cuStreamDestroy"),
            )),
            None => Err(self.reject(
                call,
                codes::INVALID_HANDLE,
                format!("{handle:#x} is not a stream"),
            )),
        }
    }

    pub fn event(&mut self, call: &str, handle: u64) -> Result<u64, u32> {
        match self.events.get(&handle) {
            Some(event) if event.alive => Ok(handle),
            Some(_) => Err(self.reject(
                call,
                codes::INVALID_HANDLE,
                format!("event {handle:#x} used after cuEventDestroy"),
            )),
            None => Err(self.reject(
                call,
                codes::INVALID_HANDLE,
                format!("{handle:#x} is not an event"),
            )),
        }
    }

    /// Queues `op` on `stream`, after checking its accesses against the race detector.
    pub fn enqueue(&mut self, call: &'static str, stream: u64, op: Op, touches: Vec<Touch>) {
        let host = self.host_clock.clone();
        let s = self.streams.get_mut(&stream).expect("a checked stream");
        s.clock.join(&host);
        s.enqueued += 1;
        let seq = s.enqueued;
        s.clock.0.insert(stream, seq);
        let clock = s.clock.clone();
        self.check_races(call, stream, seq, &clock, &touches);
        let s = self.streams.get_mut(&stream).expect("a checked stream");
        s.queue.push_back(Work {
            seq,
            op,
            touches,
            call,
        });
        self.tick();
    }

    fn check_races(
        &mut self,
        call: &'static str,
        stream: u64,
        seq: u64,
        clock: &Clock,
        touches: &[Touch],
    ) {
        // Forget accesses every future item is ordered after.
        let host = &self.host_clock;
        self.accesses.retain(|a| host.get(a.stream) < a.seq);
        let mut found = Vec::new();
        for touch in touches {
            let Touch::Phys { piece, write } = *touch else {
                continue;
            };
            for a in &self.accesses {
                if a.stream == stream || a.piece.phys != piece.phys || !(a.write || write) {
                    continue;
                }
                let overlap = a.piece.offset < piece.offset + piece.len
                    && piece.offset < a.piece.offset + a.piece.len;
                if overlap && clock.get(a.stream) < a.seq {
                    found.push(format!(
                        "race: {call} on stream {stream:#x} {} bytes [{:#x}, +{}) of physical {:#x} that {} on stream {:#x} {} and nothing orders the two (a missing cuStreamWaitEvent or synchronisation)",
                        if write { "writes" } else { "reads" },
                        piece.offset,
                        piece.len,
                        piece.phys,
                        a.call,
                        a.stream,
                        if a.write { "writes" } else { "reads" },
                    ));
                }
            }
        }
        for line in found {
            self.violation(call, line);
        }
        for touch in touches {
            if let Touch::Phys { piece, write } = *touch {
                self.accesses.push(TrackedAccess {
                    piece,
                    write,
                    stream,
                    seq,
                    call,
                });
            }
        }
    }

    /// The clock of everything queued on `stream` so far: what a synchronisation of it tells
    /// the host.
    pub fn stream_clock(&self, stream: u64) -> Clock {
        self.streams
            .get(&stream)
            .map(|s| s.clock.clone())
            .unwrap_or_default()
    }

    /// Whether the head of `stream` may run now.
    pub fn head_ready(&self, stream: u64) -> bool {
        let Some(work) = self.streams.get(&stream).and_then(|s| s.queue.front()) else {
            return false;
        };
        match &work.op {
            Op::Wait { stream: other, seq } => {
                self.streams.get(other).is_none_or(|o| o.completed >= *seq)
            }
            Op::Nccl { launch } => self.nccl_ready(*launch),
            _ => true,
        }
    }

    /// Streams whose head may run, in handle order.
    pub fn ready_streams(&self) -> Vec<u64> {
        let mut ready: Vec<u64> = self
            .streams
            .keys()
            .copied()
            .filter(|s| self.head_ready(*s))
            .collect();
        ready.sort_unstable();
        ready
    }

    /// Runs the head of `stream` (ready).
    pub fn run_head(&mut self, stream: u64) {
        let launch = match self
            .streams
            .get(&stream)
            .and_then(|s| s.queue.front())
            .map(|w| &w.op)
        {
            Some(Op::Nccl { launch }) => Some(*launch),
            Some(_) => None,
            None => return,
        };
        if let Some(launch) = launch {
            self.nccl_run(launch);
            return;
        }
        let s = self.streams.get_mut(&stream).expect("a stream");
        let work = s.queue.pop_front().expect("a head");
        let device = s.device;
        if let Op::Kernel { faulty } = work.op {
            s.completed = work.seq;
            if faulty && s.error == 0 {
                s.error = codes::ILLEGAL_ADDRESS;
            }
            return;
        }
        let result = self.execute(&work.op, device);
        let s = self.streams.get_mut(&stream).expect("a stream");
        s.completed = work.seq;
        if let Err(what) = result {
            if s.error == 0 {
                s.error = codes::ILLEGAL_ADDRESS;
            }
            self.violation(
                work.call,
                format!("queued work failed when it ran on stream {stream:#x}: {what}"),
            );
        }
    }

    /// Pops the head of `stream` as completed (an NCCL launch that ran).
    pub fn complete_head(&mut self, stream: u64) {
        if let Some(s) = self.streams.get_mut(&stream)
            && let Some(work) = s.queue.pop_front()
        {
            s.completed = work.seq;
        }
    }

    fn execute(&mut self, op: &Op, _device: usize) -> Result<(), String> {
        let peer = |a: usize, b: usize| a == b || self.peer_enabled.contains(&(a, b));
        match op {
            Op::Copy { dst, src, len } => {
                let bytes = match *src {
                    Loc::Device { address, device } => {
                        let resolved = self.memory.resolve(address, *len, device, &peer)?;
                        self.memory.read(&resolved.pieces)?
                    }
                    // SAFETY: pinned host memory, checked live when queued and not freed with work
                    // queued on it (a violation otherwise, reported at the free).
                    Loc::Host(ptr) => {
                        unsafe { std::slice::from_raw_parts(ptr as *const u8, *len as usize) }
                            .to_vec()
                    }
                };
                match *dst {
                    Loc::Device { address, device } => {
                        let resolved = self.memory.resolve(address, *len, device, &peer)?;
                        self.memory.write(&resolved.pieces, &bytes)
                    }
                    Loc::Host(ptr) => {
                        // SAFETY: as above.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_ptr(),
                                ptr as *mut u8,
                                bytes.len(),
                            )
                        };
                        Ok(())
                    }
                }
            }
            Op::Staged { dst, device, data } => {
                let resolved = self
                    .memory
                    .resolve(*dst, data.len() as u64, *device, &peer)?;
                self.memory.write(&resolved.pieces, data)
            }
            Op::Memset {
                dst,
                device,
                pattern,
                len,
            } => {
                let resolved = self.memory.resolve(*dst, *len, *device, &peer)?;
                let bytes: Vec<u8> = pattern
                    .iter()
                    .copied()
                    .cycle()
                    .take(*len as usize)
                    .collect();
                self.memory.write(&resolved.pieces, &bytes)
            }
            Op::Wait { .. } | Op::Nccl { .. } | Op::Kernel { .. } => Ok(()),
        }
    }

    /// After a call queued work: the scheduler runs what its mode says.
    pub fn tick(&mut self) {
        match self.schedule {
            Schedule::Eager => self.run_all_ready(),
            Schedule::Delayed => {}
            Schedule::Random => {
                let steps = self.random() % 4;
                for _ in 0..steps {
                    let ready = self.ready_streams();
                    if ready.is_empty() {
                        break;
                    }
                    let pick = ready[(self.random() % ready.len() as u64) as usize];
                    self.run_head(pick);
                }
            }
        }
    }

    pub fn run_all_ready(&mut self) {
        loop {
            let ready = self.ready_streams();
            if ready.is_empty() {
                return;
            }
            for stream in ready {
                if self.head_ready(stream) {
                    self.run_head(stream);
                }
            }
        }
    }

    pub fn satisfied(&self, target: &Target) -> bool {
        target
            .iter()
            .all(|(stream, seq)| self.streams.get(stream).is_none_or(|s| s.completed >= *seq))
    }

    /// The streams whose progress `target` needs: its own, those their heads wait for.
    fn needed(&self, target: &Target) -> Vec<u64> {
        let mut needed: Vec<u64> = target
            .iter()
            .filter(|(stream, seq)| self.streams.get(stream).is_some_and(|s| s.completed < *seq))
            .map(|(stream, _)| *stream)
            .collect();
        let mut i = 0;
        while i < needed.len() {
            let stream = needed[i];
            i += 1;
            let Some(work) = self.streams.get(&stream).and_then(|s| s.queue.front()) else {
                continue;
            };
            let more = match &work.op {
                Op::Wait { stream: other, .. } => vec![*other],
                Op::Nccl { launch } => self.nccl_partner_streams(*launch),
                _ => Vec::new(),
            };
            for other in more {
                if !needed.contains(&other) {
                    needed.push(other);
                }
            }
        }
        needed.sort_unstable();
        needed
    }

    /// One step toward `target`: whether something ran.
    fn step(&mut self, target: &Target) -> bool {
        let ready = match self.schedule {
            Schedule::Delayed => self
                .needed(target)
                .into_iter()
                .filter(|s| self.head_ready(*s))
                .collect(),
            _ => self.ready_streams(),
        };
        if ready.is_empty() {
            return false;
        }
        let pick = match self.schedule {
            Schedule::Random => ready[(self.random() % ready.len() as u64) as usize],
            _ => ready[0],
        };
        self.run_head(pick);
        true
    }

    /// Runs what `target` needs without waiting for other threads.
    pub fn progress_without_waiting(&mut self, target: &Target) {
        while !self.satisfied(target) && self.step(target) {}
    }

    /// Sticky errors of the target's streams.
    pub fn target_error(&self, target: &Target) -> u32 {
        target
            .iter()
            .filter_map(|(stream, _)| self.streams.get(stream))
            .map(|s| s.error)
            .find(|error| *error != 0)
            .unwrap_or(0)
    }
}

/// Runs work until `target` is done, waiting (lock released) for other threads when nothing
/// that it needs can run; the host then knows `known` (the clock of the target) complete. A wait longer than
/// `FAKE_CUDA_DEADLOCK_SECS` is a violation (the real call would hang) and `CUDA_ERROR_TIMEOUT`.
pub fn drive(
    fake: &mut std::sync::MutexGuard<'static, Fake>,
    call: &str,
    target: Target,
    known: Clock,
) -> u32 {
    let limit = Duration::from_secs(fake.config.deadlock_secs);
    let start = Instant::now();
    while !fake.satisfied(&target) {
        if fake.step(&target) {
            continue;
        }
        let left = limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            let pending: Vec<String> = target
                .iter()
                .filter_map(|(stream, seq)| fake.streams.get(stream).map(|s| (stream, seq, s)))
                .filter(|(_, seq, s)| s.completed < **seq)
                .map(|(stream, _, s)| {
                    format!("{stream:#x} at {:?}", s.queue.front().map(|w| w.call))
                })
                .collect();
            return fake.reject(
                call,
                codes::TIMEOUT,
                format!(
                    "waits forever for work no thread makes ready: {}",
                    pending.join(", ")
                ),
            );
        }
        fake.wait_for_progress(left.min(Duration::from_millis(50)));
    }
    fake.host_clock.join(&known);
    fake.target_error(&target)
}
