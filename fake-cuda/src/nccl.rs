//! The fake NCCL, in the same library as the fake driver (linked as `libnccl.so.2` and
//! `libnccl.so`), so that its operations are queued on the fake's streams.
//!
//! Communicators over the fake devices of one process (`ncclGetUniqueId` + `ncclCommInitRank`
//! from one thread per rank, or `ncclCommInitAll`). Every operation, or every group of them
//! between `ncclGroupStart` and `ncclGroupEnd`, is one launch queued on the caller's stream, as
//! NCCL's kernel is. A launch runs only when every launch it exchanges data with (the other
//! ranks of a collective, the peer of a send or receive) is at the head of its own stream: a
//! rank's stream is held until all ranks have queued their part, NCCL's blocking semantics, and
//! a synchronisation waiting for a rank that never calls is reported as a deadlock. Data types:
//! all of NCCL's (integers, f16, bf16, f32, f64, fp8 e4m3 and e5m2); operations sum, prod, max,
//! min, avg. Reductions are computed in f64 (i128 for integers) and converted once.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::{BTreeSet, HashMap};
use std::ffi::{c_char, c_int, c_void};
use std::time::{Duration, Instant};

use crate::state::{Fake, call as cuda_call, current_device, global, lock};
use crate::streams::{Op, Touch};

pub const NCCL_SUCCESS: u32 = 0;
pub const NCCL_INVALID_ARGUMENT: u32 = 4;
pub const NCCL_INVALID_USAGE: u32 = 5;

/// NCCL 2.23.4, as `ncclGetVersion` encodes it.
pub const VERSION: c_int = 22304;

const COMM_BASE: u64 = 0xCC00_0000;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

#[derive(Debug)]
pub struct Comm {
    pub clique: u64,
    pub rank: usize,
    pub device: usize,
    pub alive: bool,
    pub aborted: bool,
    pub collectives: u64,
    pub sends: HashMap<usize, u64>,
    pub recvs: HashMap<usize, u64>,
}

#[derive(Debug)]
pub struct Clique {
    pub nranks: usize,
    pub comms: Vec<Option<u64>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// The `n`th collective of a clique.
    Collective(u64, u64),
    /// The `n`th message from rank `src` to rank `dst` of a clique.
    Message(u64, usize, usize, u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    AllReduce,
    Broadcast { root: usize },
    Reduce { root: usize },
    AllGather,
    ReduceScatter,
    Send,
    Recv,
}

#[derive(Debug, Clone)]
pub struct NcclOp {
    pub key: Key,
    pub kind: Kind,
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub dtype: c_int,
    pub redop: c_int,
    pub comm: u64,
}

#[derive(Debug)]
pub struct Launch {
    pub stream: u64,
    pub ops: Vec<NcclOp>,
    /// A communicator of it was aborted: it completes without exchanging anything when it
    /// reaches the head of its stream (NCCL's abort ends the communicator's kernels).
    pub cancelled: bool,
}

#[derive(Debug, Default)]
pub struct Nccl {
    pub comms: HashMap<u64, Comm>,
    pub cliques: HashMap<u64, Clique>,
    pub launches: HashMap<u64, Launch>,
    /// Launches posted per key.
    pub posted: HashMap<Key, Vec<u64>>,
    pub next: u64,
}

impl Nccl {
    pub fn leaks(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .comms
            .iter()
            .filter(|(_, c)| c.alive)
            .map(|(h, c)| {
                format!(
                    "ncclComm {h:#x}: rank {} on device {}, never destroyed",
                    c.rank, c.device
                )
            })
            .collect();
        lines.sort();
        lines
    }

    fn next(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

/// Bytes per element, or `None` for an unknown type.
fn elem_size(dtype: c_int) -> Option<usize> {
    match dtype {
        0 | 1 | 10 | 11 => Some(1),
        2 | 3 => Some(4),
        4 | 5 => Some(8),
        6 | 9 => Some(2),
        7 => Some(4),
        8 => Some(8),
        _ => None,
    }
}

fn is_float(dtype: c_int) -> bool {
    matches!(dtype, 6..=11)
}

// --- element conversions ---------------------------------------------------------------------

fn fp8_e4m3_to_f64(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xF) as i32;
    let man = (b & 0x7) as f64;
    if exp == 0xF && (b & 0x7) == 0x7 {
        return f64::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f64.powi(exp - 7)
    }
}

fn f64_to_fp8_e4m3(v: f64) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    // Nearest representable (saturating at +-448), ties to even mantissa.
    let mut best = 0u8;
    let mut best_err = f64::INFINITY;
    for b in 0u8..=255 {
        let x = fp8_e4m3_to_f64(b);
        if x.is_nan() {
            continue;
        }
        let err = (x - v).abs();
        if err < best_err
            || (err == best_err && b & 1 == 0 && (x.is_sign_negative() == v.is_sign_negative()))
        {
            best = b;
            best_err = err;
        }
    }
    best
}

fn load(bytes: &[u8], dtype: c_int, i: usize) -> Num {
    let size = elem_size(dtype).expect("checked");
    let b = &bytes[i * size..(i + 1) * size];
    match dtype {
        0 => Num::I(b[0] as i8 as i128),
        1 => Num::I(b[0] as i128),
        2 => Num::I(i32::from_ne_bytes(b.try_into().unwrap()) as i128),
        3 => Num::I(u32::from_ne_bytes(b.try_into().unwrap()) as i128),
        4 => Num::I(i64::from_ne_bytes(b.try_into().unwrap()) as i128),
        5 => Num::I(u64::from_ne_bytes(b.try_into().unwrap()) as i128),
        6 => Num::F(half::f16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        7 => Num::F(f32::from_ne_bytes(b.try_into().unwrap()) as f64),
        8 => Num::F(f64::from_ne_bytes(b.try_into().unwrap())),
        9 => Num::F(half::bf16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        10 => Num::F(fp8_e4m3_to_f64(b[0])),
        _ => Num::F(half::f16::from_bits((b[0] as u16) << 8).to_f64()),
    }
}

fn store(out: &mut [u8], dtype: c_int, i: usize, value: Num) {
    let size = elem_size(dtype).expect("checked");
    let o = &mut out[i * size..(i + 1) * size];
    let (int, float) = match value {
        Num::I(v) => (v, v as f64),
        Num::F(v) => (v as i128, v),
    };
    match dtype {
        0 => o.copy_from_slice(&(int as i8).to_ne_bytes()),
        1 => o.copy_from_slice(&(int as u8).to_ne_bytes()),
        2 => o.copy_from_slice(&(int as i32).to_ne_bytes()),
        3 => o.copy_from_slice(&(int as u32).to_ne_bytes()),
        4 => o.copy_from_slice(&(int as i64).to_ne_bytes()),
        5 => o.copy_from_slice(&(int as u64).to_ne_bytes()),
        6 => o.copy_from_slice(&half::f16::from_f64(float).to_ne_bytes()),
        7 => o.copy_from_slice(&(float as f32).to_ne_bytes()),
        8 => o.copy_from_slice(&float.to_ne_bytes()),
        9 => o.copy_from_slice(&half::bf16::from_f64(float).to_ne_bytes()),
        10 => o[0] = f64_to_fp8_e4m3(float),
        _ => {
            // e5m2 is the high byte of an f16: round the f16 to nearest even on that byte.
            let bits = half::f16::from_f64(float).to_bits();
            let rounded = if (bits & 0x7C00) == 0x7C00 {
                bits
            } else {
                let low = bits & 0xFF;
                let up = low > 0x80 || (low == 0x80 && (bits >> 8) & 1 == 1);
                if up { bits.wrapping_add(0x100) } else { bits }
            };
            o[0] = (rounded >> 8) as u8;
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Num {
    I(i128),
    F(f64),
}

/// Reduces rank inputs element-wise with `redop` (0 sum, 1 prod, 2 max, 3 min, 4 avg).
fn reduce(inputs: &[Vec<u8>], dtype: c_int, redop: c_int, count: usize) -> Vec<u8> {
    let size = elem_size(dtype).expect("checked");
    let mut out = vec![0u8; count * size];
    let n = inputs.len();
    for i in 0..count {
        let values: Vec<Num> = inputs.iter().map(|input| load(input, dtype, i)).collect();
        let value = if is_float(dtype) {
            let xs = values.iter().map(|v| match v {
                Num::F(x) => *x,
                Num::I(x) => *x as f64,
            });
            Num::F(match redop {
                0 => xs.sum(),
                1 => xs.product(),
                2 => xs.fold(f64::NEG_INFINITY, f64::max),
                3 => xs.fold(f64::INFINITY, f64::min),
                _ => xs.sum::<f64>() / n as f64,
            })
        } else {
            let xs = values.iter().map(|v| match v {
                Num::I(x) => *x,
                Num::F(x) => *x as i128,
            });
            Num::I(match redop {
                0 => xs.fold(0i128, |a, b| a.wrapping_add(b)),
                1 => xs.fold(1i128, |a, b| a.wrapping_mul(b)),
                2 => xs.max().unwrap_or(0),
                3 => xs.min().unwrap_or(0),
                _ => xs.sum::<i128>() / n as i128,
            })
        };
        store(&mut out, dtype, i, value);
    }
    out
}

// --- readiness and execution -----------------------------------------------------------------

impl Fake {
    /// The launches exchanging data with `launch`, itself included, if all are posted and
    /// none was cancelled (a rank whose peer aborted waits forever, as with NCCL).
    fn nccl_component(&self, launch: u64) -> Option<BTreeSet<u64>> {
        let mut component = BTreeSet::from([launch]);
        let mut todo = vec![launch];
        while let Some(l) = todo.pop() {
            let this = self.nccl.launches.get(&l)?;
            if this.cancelled {
                return None;
            }
            for op in &this.ops {
                let posted = self.nccl.posted.get(&op.key)?;
                let needed = match op.key {
                    Key::Collective(clique, _) => self.nccl.cliques.get(&clique)?.nranks,
                    Key::Message(..) => 2,
                };
                if posted.len() < needed {
                    return None;
                }
                for other in posted {
                    if component.insert(*other) {
                        todo.push(*other);
                    }
                }
            }
        }
        Some(component)
    }

    pub fn nccl_ready(&self, launch: u64) -> bool {
        // Cancelled: runs (as nothing) once at the head of its stream, which the caller checked.
        if self.nccl.launches.get(&launch).is_some_and(|l| l.cancelled) {
            return true;
        }
        let Some(component) = self.nccl_component(launch) else {
            return false;
        };
        component.iter().all(|l| {
            let Some(stream) = self.nccl.launches.get(l).map(|x| x.stream) else {
                return false;
            };
            matches!(
                self.streams.get(&stream).and_then(|s| s.queue.front()).map(|w| &w.op),
                Some(Op::Nccl { launch }) if launch == l
            )
        })
    }

    pub fn nccl_partner_streams(&self, launch: u64) -> Vec<u64> {
        let mut streams = Vec::new();
        let Some(l) = self.nccl.launches.get(&launch).filter(|l| !l.cancelled) else {
            return streams;
        };
        for op in &l.ops {
            for other in self.nccl.posted.get(&op.key).into_iter().flatten() {
                if let Some(o) = self.nccl.launches.get(other) {
                    streams.push(o.stream);
                }
            }
        }
        streams
    }

    fn nccl_read(&self, address: u64, len: usize, device: usize) -> Result<Vec<u8>, String> {
        let peer = |a: usize, b: usize| a == b || self.peer_enabled.contains(&(a, b));
        let resolved = self.memory.resolve(address, len as u64, device, &peer)?;
        self.memory.read(&resolved.pieces)
    }

    fn nccl_write(&mut self, address: u64, bytes: &[u8], device: usize) -> Result<(), String> {
        let peer_enabled = self.peer_enabled.clone();
        let peer = move |a: usize, b: usize| a == b || peer_enabled.contains(&(a, b));
        let resolved = self
            .memory
            .resolve(address, bytes.len() as u64, device, &peer)?;
        self.memory.write(&resolved.pieces, bytes)
    }

    /// Runs a ready launch with every launch it exchanges data with, and completes them all;
    /// a cancelled launch completes alone, exchanging nothing.
    pub fn nccl_run(&mut self, launch: u64) {
        if self.nccl.launches.get(&launch).is_some_and(|l| l.cancelled) {
            let done = self.nccl.launches.remove(&launch).expect("checked");
            for op in &done.ops {
                if let Some(posted) = self.nccl.posted.get_mut(&op.key) {
                    posted.retain(|l| *l != launch);
                    if posted.is_empty() {
                        self.nccl.posted.remove(&op.key);
                    }
                }
            }
            self.complete_head(done.stream);
            return;
        }
        let Some(component) = self.nccl_component(launch) else {
            return;
        };
        let mut keys: BTreeSet<Key> = BTreeSet::new();
        for l in &component {
            for op in &self.nccl.launches[l].ops {
                keys.insert(op.key);
            }
        }
        let mut failures = Vec::new();
        for key in keys {
            let ops: Vec<NcclOp> = self.nccl.posted[&key]
                .iter()
                .flat_map(|l| {
                    self.nccl.launches[l]
                        .ops
                        .iter()
                        .filter(|op| op.key == key)
                        .cloned()
                })
                .collect();
            if let Err(what) = self.nccl_exchange(key, &ops) {
                failures.push(what);
            }
            self.nccl.posted.remove(&key);
        }
        for what in failures {
            self.violation(
                "nccl",
                format!("an NCCL operation failed when it ran: {what}"),
            );
        }
        for l in component {
            if let Some(done) = self.nccl.launches.remove(&l) {
                self.complete_head(done.stream);
            }
        }
    }

    fn comm_device(&self, comm: u64) -> usize {
        self.nccl.comms.get(&comm).map(|c| c.device).unwrap_or(0)
    }

    fn comm_rank(&self, comm: u64) -> usize {
        self.nccl.comms.get(&comm).map(|c| c.rank).unwrap_or(0)
    }

    /// The data movement of one key: all ranks' inputs read first, then outputs written.
    fn nccl_exchange(&mut self, key: Key, ops: &[NcclOp]) -> Result<(), String> {
        let size = elem_size(ops[0].dtype).ok_or("unknown data type")?;
        match key {
            Key::Message(..) => {
                let send = ops
                    .iter()
                    .find(|op| op.kind == Kind::Send)
                    .ok_or("no send")?;
                let recv = ops
                    .iter()
                    .find(|op| op.kind == Kind::Recv)
                    .ok_or("no receive")?;
                let bytes =
                    self.nccl_read(send.send, send.count * size, self.comm_device(send.comm))?;
                self.nccl_write(recv.recv, &bytes, self.comm_device(recv.comm))
            }
            Key::Collective(..) => {
                let mut ops: Vec<&NcclOp> = ops.iter().collect();
                ops.sort_by_key(|op| self.comm_rank(op.comm));
                let first = ops[0];
                let n = ops.len();
                let count = first.count;
                let inputs: Vec<Vec<u8>> = ops
                    .iter()
                    .map(|op| {
                        let len = match op.kind {
                            Kind::ReduceScatter => count * n * size,
                            _ => count * size,
                        };
                        let needs_input = match op.kind {
                            Kind::Broadcast { root } => self.comm_rank(op.comm) == root,
                            _ => true,
                        };
                        if needs_input {
                            self.nccl_read(op.send, len, self.comm_device(op.comm))
                        } else {
                            Ok(Vec::new())
                        }
                    })
                    .collect::<Result<_, _>>()?;
                for (rank, op) in ops.iter().enumerate() {
                    let device = self.comm_device(op.comm);
                    let output = match op.kind {
                        Kind::AllReduce => reduce(&inputs, op.dtype, op.redop, count),
                        Kind::Reduce { root } => {
                            if rank != root {
                                continue;
                            }
                            reduce(&inputs, op.dtype, op.redop, count)
                        }
                        Kind::Broadcast { root } => inputs[root].clone(),
                        Kind::AllGather => inputs.concat(),
                        Kind::ReduceScatter => {
                            let parts: Vec<Vec<u8>> = inputs
                                .iter()
                                .map(|input| {
                                    input[rank * count * size..(rank + 1) * count * size].to_vec()
                                })
                                .collect();
                            reduce(&parts, op.dtype, op.redop, count)
                        }
                        Kind::Send | Kind::Recv => unreachable!("messages have their own keys"),
                    };
                    self.nccl_write(op.recv, &output, device)?;
                }
                Ok(())
            }
        }
    }
}

// --- the API ---------------------------------------------------------------------------------

fn nccl_reject(fake: &mut Fake, name: &str, code: u32, what: impl AsRef<str>) -> u32 {
    fake.violation(name, format!("{} (NCCL result {code})", what.as_ref()));
    code
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(value) => value,
            Err(code) => return code,
        }
    };
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> u32 {
    cuda_call("ncclGetVersion", |_| {
        if !version.is_null() {
            unsafe { version.write(VERSION) };
        }
        NCCL_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> u32 {
    cuda_call("ncclGetUniqueId", |fake| {
        if id.is_null() {
            return nccl_reject(fake, "ncclGetUniqueId", NCCL_INVALID_ARGUMENT, "a NULL id");
        }
        let n = fake.nccl.next();
        let mut internal = [0 as c_char; 128];
        for (i, b) in b"fake-nccl".iter().enumerate() {
            internal[i] = *b as c_char;
        }
        for (i, b) in n.to_le_bytes().iter().enumerate() {
            internal[16 + i] = *b as c_char;
        }
        unsafe { id.write(UniqueId { internal }) };
        NCCL_SUCCESS
    })
}

fn clique_of(id: &UniqueId) -> Option<u64> {
    let magic: Vec<u8> = id.internal[..9].iter().map(|c| *c as u8).collect();
    if magic != b"fake-nccl" {
        return None;
    }
    let mut n = [0u8; 8];
    for (i, b) in n.iter_mut().enumerate() {
        *b = id.internal[16 + i] as u8;
    }
    Some(u64::from_le_bytes(n))
}

fn new_comm(fake: &mut Fake, clique: u64, rank: usize, device: usize) -> u64 {
    let handle = COMM_BASE + fake.nccl.next();
    fake.nccl.comms.insert(
        handle,
        Comm {
            clique,
            rank,
            device,
            alive: true,
            aborted: false,
            collectives: 0,
            sends: HashMap::new(),
            recvs: HashMap::new(),
        },
    );
    handle
}

/// `ncclCommInitRank`: joins the clique of `id` as `rank` on the current device, and returns
/// once all ranks joined (the lock released while waiting).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> u32 {
    let name = "ncclCommInitRank";
    let (clique, handle) = {
        let mut guard = lock();
        let fake = &mut *guard;
        if let Some(code) = fake.count_call(name) {
            return code;
        }
        let Some(device) = current_device() else {
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_USAGE,
                "no current CUDA device on the calling thread",
            );
        };
        let Some(clique) = clique_of(&id) else {
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_ARGUMENT,
                "not an id from ncclGetUniqueId",
            );
        };
        if comm.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_ARGUMENT,
                format!("rank {rank} of {nranks}"),
            );
        }
        let entry = fake.nccl.cliques.entry(clique).or_insert_with(|| Clique {
            nranks: nranks as usize,
            comms: vec![None; nranks as usize],
        });
        if entry.nranks != nranks as usize || entry.comms[rank as usize].is_some() {
            let (n, taken) = (
                entry.nranks,
                entry.comms[(rank as usize).min(entry.nranks - 1)].is_some(),
            );
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_ARGUMENT,
                format!("rank {rank} of {nranks} joins a clique of {n} (rank taken: {taken})"),
            );
        }
        let handle = new_comm(fake, clique, rank as usize, device);
        fake.nccl.cliques.get_mut(&clique).expect("inserted").comms[rank as usize] = Some(handle);
        (clique, handle)
    };
    global().progress.notify_all();
    let mut guard = lock();
    let start = Instant::now();
    loop {
        if guard.nccl.cliques[&clique]
            .comms
            .iter()
            .all(Option::is_some)
        {
            break;
        }
        let limit = Duration::from_secs(guard.config.deadlock_secs);
        if start.elapsed() >= limit {
            return nccl_reject(
                &mut guard,
                name,
                NCCL_INVALID_USAGE,
                "waits forever for ranks that never join",
            );
        }
        use crate::state::MutexGuardExt;
        guard.wait_for_progress(Duration::from_millis(50));
    }
    unsafe { comm.write(handle as *mut c_void) };
    NCCL_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut *mut c_void,
    ndev: c_int,
    devlist: *const c_int,
) -> u32 {
    cuda_call("ncclCommInitAll", |fake| {
        if comms.is_null() || ndev < 1 {
            return nccl_reject(
                fake,
                "ncclCommInitAll",
                NCCL_INVALID_ARGUMENT,
                "no communicators",
            );
        }
        let clique = fake.nccl.next();
        let mut handles = Vec::new();
        for rank in 0..ndev as usize {
            let device = if devlist.is_null() {
                rank as c_int
            } else {
                unsafe { *devlist.add(rank) }
            };
            if device < 0 || device as usize >= fake.devices.len() {
                return nccl_reject(
                    fake,
                    "ncclCommInitAll",
                    NCCL_INVALID_ARGUMENT,
                    format!("no device {device}"),
                );
            }
            handles.push(new_comm(fake, clique, rank, device as usize));
        }
        fake.nccl.cliques.insert(
            clique,
            Clique {
                nranks: ndev as usize,
                comms: handles.iter().map(|h| Some(*h)).collect(),
            },
        );
        for (i, h) in handles.iter().enumerate() {
            unsafe { comms.add(i).write(*h as *mut c_void) };
        }
        NCCL_SUCCESS
    })
}

fn comm_checked(fake: &mut Fake, name: &str, comm: *mut c_void) -> Result<u64, u32> {
    match fake.nccl.comms.get(&(comm as u64)) {
        Some(c) if c.alive && !c.aborted => Ok(comm as u64),
        Some(_) => Err(nccl_reject(
            fake,
            name,
            NCCL_INVALID_ARGUMENT,
            "a communicator used after ncclCommDestroy/Abort",
        )),
        None => Err(nccl_reject(
            fake,
            name,
            NCCL_INVALID_ARGUMENT,
            format!("{:#x} is not a communicator", comm as u64),
        )),
    }
}

fn comm_end(name: &'static str, comm: *mut c_void, abort: bool) -> u32 {
    cuda_call(name, |fake| {
        let handle = tri!(comm_checked(fake, name, comm));
        // Operations of it still queued: the real destroy waits for them; abort cancels them
        // (they complete at the head of their streams without exchanging anything).
        let mut pending = false;
        for launch in fake.nccl.launches.values_mut() {
            if launch.ops.iter().any(|op| op.comm == handle) {
                pending = true;
                launch.cancelled |= abort;
            }
        }
        if pending && !abort {
            fake.violation(
                name,
                "a communicator destroyed with operations queued that no peer completed",
            );
        }
        let c = fake.nccl.comms.get_mut(&handle).expect("checked");
        c.alive = false;
        c.aborted = abort;
        NCCL_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> u32 {
    comm_end("ncclCommDestroy", comm, false)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> u32 {
    comm_end("ncclCommAbort", comm, true)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: *mut c_void, error: *mut u32) -> u32 {
    cuda_call("ncclCommGetAsyncError", |fake| {
        let _ = tri!(comm_checked(fake, "ncclCommGetAsyncError", comm));
        if !error.is_null() {
            unsafe { error.write(NCCL_SUCCESS) };
        }
        NCCL_SUCCESS
    })
}

fn comm_query(
    name: &'static str,
    comm: *mut c_void,
    out: *mut c_int,
    what: fn(&Comm, &Fake) -> c_int,
) -> u32 {
    cuda_call(name, |fake| {
        let handle = tri!(comm_checked(fake, name, comm));
        let value = what(&fake.nccl.comms[&handle], fake);
        if !out.is_null() {
            unsafe { out.write(value) };
        }
        NCCL_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: *mut c_void, count: *mut c_int) -> u32 {
    comm_query("ncclCommCount", comm, count, |c, f| {
        f.nccl.cliques[&c.clique].nranks as c_int
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: *mut c_void, device: *mut c_int) -> u32 {
    comm_query("ncclCommCuDevice", comm, device, |c, _| c.device as c_int)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: *mut c_void, rank: *mut c_int) -> u32 {
    comm_query("ncclCommUserRank", comm, rank, |c, _| c.rank as c_int)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetErrorString(result: u32) -> *const c_char {
    let text: &'static std::ffi::CStr = match result {
        0 => c"no error",
        1 => c"unhandled cuda error",
        2 => c"unhandled system error",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    text.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    c"".as_ptr()
}

thread_local! {
    /// `ncclGroupStart` depth and the operations issued inside the group, with their streams.
    static GROUP: std::cell::RefCell<(u32, Vec<(u64, NcclOp)>)> = const { std::cell::RefCell::new((0, Vec::new())) };
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupStart() -> u32 {
    GROUP.with(|g| g.borrow_mut().0 += 1);
    cuda_call("ncclGroupStart", |_| NCCL_SUCCESS)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGroupEnd() -> u32 {
    let ops = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 == 0 {
            return None;
        }
        g.0 -= 1;
        Some(if g.0 == 0 {
            std::mem::take(&mut g.1)
        } else {
            Vec::new()
        })
    });
    cuda_call("ncclGroupEnd", |fake| {
        let Some(ops) = ops else {
            return nccl_reject(
                fake,
                "ncclGroupEnd",
                NCCL_INVALID_USAGE,
                "ncclGroupEnd without ncclGroupStart",
            );
        };
        // One launch per (communicator, stream), in issue order.
        let mut launches: Vec<((u64, u64), Vec<NcclOp>)> = Vec::new();
        for (stream, op) in ops {
            match launches.iter_mut().find(|(k, _)| *k == (op.comm, stream)) {
                Some((_, list)) => list.push(op),
                None => launches.push(((op.comm, stream), vec![op])),
            }
        }
        for ((_, stream), ops) in launches {
            post(fake, stream, ops);
        }
        NCCL_SUCCESS
    })
}

/// Queues one launch of `ops` on `stream`.
fn post(fake: &mut Fake, stream: u64, ops: Vec<NcclOp>) {
    let id = fake.nccl.next();
    let mut touches = Vec::new();
    let peer_enabled = fake.peer_enabled.clone();
    let peer = move |a: usize, b: usize| a == b || peer_enabled.contains(&(a, b));
    for op in &ops {
        let device = fake.comm_device(op.comm);
        let size = elem_size(op.dtype).unwrap_or(1);
        let n = fake.nccl.cliques[&fake.nccl.comms[&op.comm].clique].nranks;
        let (send_len, recv_len) = match op.kind {
            Kind::AllGather => (op.count * size, op.count * size * n),
            Kind::ReduceScatter => (op.count * size * n, op.count * size),
            _ => (op.count * size, op.count * size),
        };
        let reads = !matches!(op.kind, Kind::Recv)
            && !(matches!(op.kind, Kind::Broadcast { root } if fake.comm_rank(op.comm) != root));
        let writes = !matches!(op.kind, Kind::Send)
            && !(matches!(op.kind, Kind::Reduce { root } if fake.comm_rank(op.comm) != root));
        if reads && let Ok(r) = fake.memory.resolve(op.send, send_len as u64, device, &peer) {
            touches.extend(r.pieces.into_iter().map(|piece| Touch::Phys {
                piece,
                write: false,
            }));
        }
        if writes && let Ok(r) = fake.memory.resolve(op.recv, recv_len as u64, device, &peer) {
            touches.extend(
                r.pieces
                    .into_iter()
                    .map(|piece| Touch::Phys { piece, write: true }),
            );
        }
        fake.nccl.posted.entry(op.key).or_default().push(id);
    }
    fake.nccl.launches.insert(
        id,
        Launch {
            stream,
            ops,
            cancelled: false,
        },
    );
    fake.enqueue("nccl", stream, Op::Nccl { launch: id }, touches);
}

/// Checks and queues (or adds to the thread's group) one operation.
#[allow(clippy::too_many_arguments)]
fn issue(
    name: &'static str,
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    redop: c_int,
    peer: Option<c_int>,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    let grouped = GROUP.with(|g| g.borrow().0 > 0);
    cuda_call(name, |fake| {
        let handle = tri!(comm_checked(fake, name, comm));
        let Some(size) = elem_size(dtype) else {
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_ARGUMENT,
                format!("data type {dtype}"),
            );
        };
        if !(0..=4).contains(&redop) {
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_ARGUMENT,
                format!("reduction {redop}"),
            );
        }
        let c = &fake.nccl.comms[&handle];
        let (device, rank, clique) = (c.device, c.rank, c.clique);
        let nranks = fake.nccl.cliques[&clique].nranks;
        let stream_handle = if (stream as u64) <= 2 {
            fake.devices[device].null_stream
        } else {
            stream as u64
        };
        match fake.streams.get(&stream_handle) {
            Some(s) if s.alive && s.device == device => {}
            Some(s) if s.alive => {
                let other = s.device;
                return nccl_reject(
                    fake,
                    name,
                    NCCL_INVALID_ARGUMENT,
                    format!("a stream of device {other} for a communicator of device {device}"),
                );
            }
            _ => {
                return nccl_reject(
                    fake,
                    name,
                    NCCL_INVALID_ARGUMENT,
                    format!("{stream_handle:#x} is not a live stream"),
                );
            }
        }
        if let Some(root) = match kind {
            Kind::Broadcast { root } | Kind::Reduce { root } => Some(root),
            _ => peer.map(|p| p as usize),
        } && (root >= nranks || (peer.is_some() && root == rank))
        {
            return nccl_reject(
                fake,
                name,
                NCCL_INVALID_ARGUMENT,
                format!("rank {root} of {nranks} (self {rank})"),
            );
        }
        // Memory must be reachable from the communicator's device.
        let peer_enabled = fake.peer_enabled.clone();
        let reach = move |a: usize, b: usize| a == b || peer_enabled.contains(&(a, b));
        let (send_len, recv_len) = match kind {
            Kind::AllGather => (count * size, count * size * nranks),
            Kind::ReduceScatter => (count * size * nranks, count * size),
            _ => (count * size, count * size),
        };
        for (address, len, used) in [
            (send as u64, send_len, !matches!(kind, Kind::Recv)),
            (recv as u64, recv_len, !matches!(kind, Kind::Send)),
        ] {
            if used
                && count > 0
                && let Err(what) = fake.memory.resolve(address, len as u64, device, &reach)
            {
                return nccl_reject(fake, name, NCCL_INVALID_ARGUMENT, what);
            }
        }
        let c = fake.nccl.comms.get_mut(&handle).expect("checked");
        let key = match kind {
            Kind::Send => {
                let p = peer.expect("a peer") as usize;
                let n = c.sends.entry(p).or_default();
                *n += 1;
                Key::Message(clique, rank, p, *n)
            }
            Kind::Recv => {
                let p = peer.expect("a peer") as usize;
                let n = c.recvs.entry(p).or_default();
                *n += 1;
                Key::Message(clique, p, rank, *n)
            }
            _ => {
                c.collectives += 1;
                Key::Collective(clique, c.collectives)
            }
        };
        // Ranks must agree on what the collective is.
        let disagreement = fake
            .nccl
            .posted
            .get(&key)
            .and_then(|ls| ls.first())
            .and_then(|l| fake.nccl.launches.get(l))
            .and_then(|l| l.ops.iter().find(|op| op.key == key))
            .and_then(|first| {
                let same = match (first.kind, kind) {
                    (Kind::Send, Kind::Recv) | (Kind::Recv, Kind::Send) => first.count == count && first.dtype == dtype,
                    (a, b) => a == b && first.count == count && first.dtype == dtype && first.redop == redop,
                };
                (!same).then(|| {
                    format!(
                        "ranks disagree on operation {key:?}: {:?} of {} x type {} against {kind:?} of {count} x type {dtype}",
                        first.kind, first.count, first.dtype
                    )
                })
            });
        if let Some(what) = disagreement {
            fake.violation(name, what);
        }
        let op = NcclOp {
            key,
            kind,
            send: send as u64,
            recv: recv as u64,
            count,
            dtype,
            redop,
            comm: handle,
        };
        if grouped {
            GROUP.with(|g| g.borrow_mut().1.push((stream_handle, op)));
        } else {
            post(fake, stream_handle, vec![op]);
        }
        NCCL_SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclAllReduce",
        Kind::AllReduce,
        send,
        recv,
        count,
        dtype,
        op,
        None,
        comm,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclReduce",
        Kind::Reduce {
            root: root.max(0) as usize,
        },
        send,
        recv,
        count,
        dtype,
        op,
        None,
        comm,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclBroadcast",
        Kind::Broadcast {
            root: root.max(0) as usize,
        },
        send,
        recv,
        count,
        dtype,
        0,
        None,
        comm,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclAllGather",
        Kind::AllGather,
        send,
        recv,
        count,
        dtype,
        0,
        None,
        comm,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclReduceScatter",
        Kind::ReduceScatter,
        send,
        recv,
        count,
        dtype,
        op,
        None,
        comm,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclSend",
        Kind::Send,
        send,
        std::ptr::null_mut(),
        count,
        dtype,
        0,
        Some(peer),
        comm,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> u32 {
    issue(
        "ncclRecv",
        Kind::Recv,
        std::ptr::null(),
        recv,
        count,
        dtype,
        0,
        Some(peer),
        comm,
        stream,
    )
}
