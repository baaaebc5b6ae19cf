//! The collective and point-to-point operations (`ncclAllReduce`, ..., `ncclSend`, `ncclRecv`),
//! checked and queued or added to the thread's group.

use std::ffi::{c_int, c_void};

use super::comm::comm_checked;
use super::elements::elem_size;
use super::group::{GROUP, post};
use super::state::{Key, Kind, NcclOp};
use super::{NCCL_INVALID_ARGUMENT, NCCL_SUCCESS, nccl_reject};
use crate::state::call as cuda_call;

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
