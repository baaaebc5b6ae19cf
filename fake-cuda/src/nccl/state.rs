//! The NCCL state the fake keeps: unique ids, communicators, cliques, operations and launches.

use std::collections::HashMap;
use std::ffi::{c_char, c_int};

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
    /// The device memory it took for its buffers (`FAKE_NCCL_COMM_BYTES`), if any.
    pub buffers: Option<u64>,
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

    pub(super) fn next(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}
