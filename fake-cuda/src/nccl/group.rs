//! Group semantics (`ncclGroupStart`/`ncclGroupEnd`) and posting a launch on a stream.

use super::elements::elem_size;
use super::state::{Kind, Launch, NcclOp};
use super::{NCCL_INVALID_USAGE, NCCL_SUCCESS, nccl_reject};
use crate::state::{Fake, call as cuda_call};
use crate::streams::{Op, Touch};

thread_local! {
    /// `ncclGroupStart` depth and the operations issued inside the group, with their streams.
    pub(super) static GROUP: std::cell::RefCell<(u32, Vec<(u64, NcclOp)>)> = const { std::cell::RefCell::new((0, Vec::new())) };
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
pub(super) fn post(fake: &mut Fake, stream: u64, ops: Vec<NcclOp>) {
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
