//! When a launch is ready (all the launches it exchanges data with are at the head of their
//! streams) and running it: the collectives and point-to-point exchanges over device memory.

use std::collections::BTreeSet;

use super::elements::{elem_size, reduce};
use super::state::{Key, Kind, NcclOp};
use crate::state::Fake;
use crate::streams::Op;

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

    pub(super) fn comm_device(&self, comm: u64) -> usize {
        self.nccl.comms.get(&comm).map(|c| c.device).unwrap_or(0)
    }

    pub(super) fn comm_rank(&self, comm: u64) -> usize {
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
