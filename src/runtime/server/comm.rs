//! Communication between servers (CubeCL's `ServerCommunication`): tensors moved from one
//! device to another, and all-reduce across a group of devices, through host memory.
//!
//! How CubeCL 0.10 calls it (cubecl-runtime `client.rs`): `to_client_tensor` first makes sure
//! both servers joined the pair's group (`comm_init`, once per group), then queues `send` on
//! the source server's thread and `recv` then `sync_collective` on the destination's; burn's
//! `DistributedBackend::all_reduce` queues `all_reduce` on every device of the group, each on
//! its own thread, with the same buffer as source and destination. The client unwraps every
//! result on the device thread, so a failure that can happen in normal use (a destination out
//! of memory, a source that cannot be read) is kept on the destination's stream and returned
//! by its next `read`, `sync` or `flush`, as any other failure of a call that cannot return
//! one. Only calls the client never makes (a device that was never part of a `comm_init`)
//! return an error.
//!
//! The path, the same for every driver:
//! - `send` reads the source on its stream, after the work that produced it (the read is
//!   ordered like any other read of the server), and posts the bytes for the destination. It
//!   never waits for its peer, so queued transfers in both directions cannot deadlock. A read
//!   that fails posts the error instead, so the peer's `recv` never waits for bytes that will
//!   not come.
//! - `recv` takes the bytes posted for it (waiting until the `send` has run), reserves the
//!   destination buffer through the destination's caching allocator (it appears in that
//!   device's statistics and history like any tensor, and an out-of-memory there is the
//!   allocator's error), and writes the bytes on its stream.
//! - `all_reduce`: every member reads its buffer (its one host copy) and contributes it to the
//!   group's round; the last to arrive reduces the contributions into the first member's copy
//!   (in device order, so every member gets the same bytes; large buffers in parallel chunks,
//!   see `host_reduce`) and each member writes that result into its buffer. A round has a lock
//!   of its own and nobody holds it while reducing: all-reduces of other groups, and the other
//!   members' reads and writes, run meanwhile. Rounds are counted per group on each server:
//!   the k-th all-reduce of a device meets the k-th of its peers.
//!
//! Where the driver has a device path (CUDA: peer copies, NCCL), `send`, `recv` and
//! `all_reduce` take it instead (`peer`); what follows is the host path, which wgpu always
//! takes and CUDA takes when told to or for what NCCL cannot reduce.
//!
//! A send and its recv meet by (source device, destination device, stream id) in `post`, which
//! also carries the path `send` chose to `recv`: CubeCL names both clients' streams after the
//! calling thread, so transfers made from several threads at once pair up correctly. The source is read completely before `send` returns, so no other
//! stream reads the source block later and nothing has to be recorded on another stream
//! (PyTorch's `record_stream` for its NCCL process groups): the block may be freed and reused
//! as soon as the tensor is dropped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock};

use cubecl_common::backtrace::BackTrace;
use cubecl_common::bytes::Bytes;
use cubecl_common::device::DeviceId;
use cubecl_common::future::block_on;
use cubecl_common::stream_id::StreamId;
use cubecl_ir::ElemType;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::server::{
    Binding, ComputeServer, CopyDescriptor, Handle, ReduceOperation, ServerCommunication,
    ServerError,
};
use parking_lot::{Condvar, Mutex};

use super::super::comm_path;
use super::super::driver::Driver;
use super::CachingServer;
use super::host_reduce;
use super::ordering::release_completed;
use super::peer::OnDevice;
use super::post::{OFFICE, Posting, Route};
use super::reserve;

/// The groups a server joined with `comm_init`, how many all-reduces it ran in each on the
/// host path (`rounds`) and in all (`calls`).
#[derive(Debug, Default)]
pub(super) struct CommState {
    groups: HashSet<Vec<DeviceId>>,
    rounds: HashMap<Vec<DeviceId>, u64>,
    calls: HashMap<Vec<DeviceId>, u64>,
}

impl CommState {
    /// Whether `me` and `peer` are in a group this server joined.
    fn connected(&self, me: DeviceId, peer: DeviceId) -> bool {
        self.groups
            .iter()
            .any(|group| group.contains(&me) && group.contains(&peer))
    }

    /// The number of the next all-reduce of `group` on this server, whatever its path: the
    /// k-th of every member is the same all-reduce.
    fn next_call(&mut self, group: &[DeviceId]) -> u64 {
        let call = self.calls.entry(group.to_vec()).or_default();
        *call += 1;
        *call
    }

    /// The number of the next all-reduce of `group` on this server's host path.
    fn next_round(&mut self, group: &[DeviceId]) -> u64 {
        let round = self.rounds.entry(group.to_vec()).or_default();
        *round += 1;
        *round
    }
}

/// `ids` sorted, without repeats: the same devices name the same group in any order.
fn group_of(mut ids: Vec<DeviceId>) -> Vec<DeviceId> {
    ids.sort();
    ids.dedup();
    ids
}

fn generic(reason: String) -> ServerError {
    ServerError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
}

fn not_initialised(me: DeviceId, peers: &[DeviceId]) -> ServerError {
    generic(format!(
        "caching allocator: device {me} has no communication group with {peers:?}: \
         `comm_init` was never called for these devices"
    ))
}

/// What a round's members share: each member's host copy until the last arrives, then the
/// result (the first member's copy, reduced in place).
#[derive(Default)]
struct RoundState {
    contributions: BTreeMap<DeviceId, Result<Bytes, ServerError>>,
    result: Option<Result<Arc<Bytes>, ServerError>>,
    collected: usize,
}

/// One all-reduce of a group, with its own lock: members of other groups and rounds never wait
/// for it, and nobody holds it while the reduction runs.
#[derive(Default)]
struct Round {
    state: Mutex<RoundState>,
    done: Condvar,
}

/// A round of a group: the group's sorted devices and the round's number in that group.
type RoundKey = (Vec<DeviceId>, u64);

/// The rounds in progress, by group and round number. Its lock is held only to find or remove
/// a round.
#[derive(Default)]
struct Collectives {
    rounds: Mutex<HashMap<RoundKey, Arc<Round>>>,
}

static COLLECTIVES: LazyLock<Collectives> = LazyLock::new(Collectives::default);

/// The result of a round whose contributions are all here: the first member's copy with the
/// others reduced into it, or the first member's error in device order.
fn combine(
    contributions: BTreeMap<DeviceId, Result<Bytes, ServerError>>,
    dtype: ElemType,
    op: &ReduceOperation,
) -> Result<Arc<Bytes>, ServerError> {
    let mut copies = Vec::with_capacity(contributions.len());
    for contribution in contributions.into_values() {
        copies.push(contribution?);
    }
    let mut copies = copies.into_iter();
    let mut acc = copies
        .next()
        .ok_or_else(|| generic("caching allocator: all_reduce of an empty group".into()))?;
    let others: Vec<Bytes> = copies.collect();
    let views: Vec<&[u8]> = others.iter().map(|other| &other[..]).collect();
    host_reduce::reduce_in_place(dtype, op, &mut acc, &views, host_reduce::default_threads())?;
    Ok(Arc::new(acc))
}

impl Collectives {
    /// Contributes `data` (this member's host copy) to round `round` of `group` and waits for
    /// the reduced result. The last member to arrive reduces, holding no lock meanwhile.
    fn all_reduce(
        &self,
        group: &[DeviceId],
        round: u64,
        me: DeviceId,
        data: Result<Bytes, ServerError>,
        dtype: ElemType,
        op: &ReduceOperation,
    ) -> Result<Arc<Bytes>, ServerError> {
        let key = (group.to_vec(), round);
        let shared = self.rounds.lock().entry(key.clone()).or_default().clone();
        let mut state = shared.state.lock();
        state.contributions.insert(me, data);
        if state.contributions.len() == group.len() {
            let contributions = std::mem::take(&mut state.contributions);
            drop(state);
            let result = combine(contributions, dtype, op);
            state = shared.state.lock();
            state.result = Some(result);
            shared.done.notify_all();
        }
        let result = loop {
            if let Some(result) = state.result.clone() {
                break result;
            }
            shared.done.wait(&mut state);
        };
        state.collected += 1;
        let last = state.collected == group.len();
        drop(state);
        if last {
            self.rounds.lock().remove(&key);
        }
        result
    }
}

/// A buffer's bytes as one contiguous run, for the server's `read` and `write`.
fn bytes_of(binding: Binding, len: usize) -> CopyDescriptor {
    CopyDescriptor::new(binding, [len].into(), [1].into(), 1)
}

impl<D: Driver> CachingServer<D> {
    /// Reserves `size` bytes for `memory` on `stream` through the engine and binds them: what
    /// `initialize_memory` does (which keeps the failure on the stream) and `recv` needs
    /// (which returns it).
    pub(super) fn reserve_bound(
        &mut self,
        memory: ManagedMemoryHandle,
        size: u64,
        stream: StreamId,
    ) -> Result<(), ServerError> {
        // Memory other streams finished using may be handed out again now.
        if let Err(err) = release_completed(&mut self.driver, &mut self.uses) {
            log::error!("caching allocator: polling cross-stream uses failed: {err}");
        }
        let reserved = reserve::reserve(
            &mut self.driver,
            &mut self.streams,
            &mut self.uses,
            self.max_binding_size,
            size,
            stream,
        )?;
        let cursor = self.advance(stream);
        self.streams
            .get(&mut self.driver, stream)
            .memory
            .manager()
            .bind(reserved, memory, cursor)
            .map_err(ServerError::Io)
    }

    /// Reads a whole buffer on `stream`, after the work that produced it.
    fn read_all(&mut self, desc: CopyDescriptor, stream: StreamId) -> Result<Bytes, ServerError> {
        block_on(self.read(vec![desc], stream))?
            .pop()
            .ok_or_else(|| generic("caching allocator: a read returned nothing".into()))
    }

    /// `recv`'s work once the bytes are here: the destination reserved, then written.
    fn receive(
        &mut self,
        handle: &Handle,
        parcel: Result<Bytes, ServerError>,
        stream: StreamId,
    ) -> Result<(), ServerError> {
        let data = parcel?;
        if data.len() as u64 > handle.size() {
            return Err(generic(format!(
                "caching allocator: received {} bytes for a buffer of {} bytes",
                data.len(),
                handle.size()
            )));
        }
        self.reserve_bound(handle.memory.clone(), handle.size(), stream)?;
        let desc = bytes_of(handle.clone().binding(), data.len());
        self.write_one(desc, &data, stream)
    }
}

impl<D: Driver> ServerCommunication for CachingServer<D> {
    const SERVER_COMM_ENABLED: bool = true;

    fn comm_init(&mut self, device_ids: Vec<DeviceId>) -> Result<(), ServerError> {
        let group = group_of(device_ids);
        if !group.contains(&self.device) {
            return Err(generic(format!(
                "caching allocator: device {} cannot join the group {group:?} it is not in",
                self.device
            )));
        }
        let peers: Vec<DeviceId> = group
            .iter()
            .copied()
            .filter(|id| *id != self.device)
            .collect();
        // Peer access only speeds copies up: without it the device path still copies.
        if let Err(err) = self.driver.connect(&peers) {
            log::warn!(
                "caching allocator: {} cannot reach {peers:?} directly: {err}",
                self.device
            );
        }
        self.comm.groups.insert(group);
        Ok(())
    }

    fn sync_collective(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        // Transfers and all-reduces are complete on the host and written on their stream
        // before they return: later work of the stream is ordered after them already. Start it.
        let (driver, driver_stream) = self.split(stream_id);
        if let Err(err) = driver.flush(driver_stream) {
            self.push_error(stream_id, err);
        }
        Ok(())
    }

    fn send(
        &mut self,
        desc: CopyDescriptor,
        _dtype: ElemType,
        stream_id: StreamId,
        device_id_dst: DeviceId,
    ) -> Result<(), ServerError> {
        let route = Route {
            src: self.device,
            dst: device_id_dst,
            stream: stream_id.value,
        };
        if !self.comm.connected(self.device, device_id_dst) {
            let err = not_initialised(self.device, &[device_id_dst]);
            // The peer may already wait in `recv`: it gets the error, not a hang.
            OFFICE.post::<D>(route, Posting::Host(Err(err.clone())));
            return Err(err);
        }
        // The path is chosen here, once: the posting carries it to `recv` (`post`).
        if self.peer_path(desc.handle.size_in_used()) {
            self.send_to_peer(desc, stream_id, device_id_dst);
            return Ok(());
        }
        let bytes = self.read_all(desc, stream_id);
        OFFICE.post::<D>(route, Posting::Host(bytes));
        Ok(())
    }

    fn recv(
        &mut self,
        handle: Handle,
        _dtype: ElemType,
        stream_id: StreamId,
        device_id_src: DeviceId,
    ) -> Result<(), ServerError> {
        if !self.comm.connected(self.device, device_id_src) {
            return Err(not_initialised(self.device, &[device_id_src]));
        }
        // The path `send` took, whatever the setting says now.
        let posting = OFFICE.collect::<D>(Route {
            src: device_id_src,
            dst: self.device,
            stream: stream_id.value,
        });
        let (memory, size, made_on) = (handle.memory.clone(), handle.size(), handle.stream);
        let received = match posting {
            Posting::Device(parcel) => self.import(handle, parcel, stream_id),
            Posting::Host(bytes) => self.receive(&handle, bytes, stream_id),
        };
        if let Err(err) = received {
            // A destination left unbound (its reservation failed, or nothing came to reserve
            // it for) returns this error at every later use, as a failed `initialize_memory`.
            self.keep_failure(&memory, size, made_on, &err);
            self.push_error(stream_id, err);
        }
        Ok(())
    }

    fn all_reduce(
        &mut self,
        src: Binding,
        dst: Binding,
        dtype: ElemType,
        stream_id: StreamId,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> Result<(), ServerError> {
        let group = group_of(device_ids);
        if !group.contains(&self.device) || !self.comm.groups.contains(&group) {
            return Err(not_initialised(self.device, &group));
        }
        // The path of this all-reduce as its first member read the setting: the same on every
        // member, whatever the setting is by the time each gets here.
        let call = self.comm.next_call(&group);
        let path = comm_path::agreed(&group, call, self.device);
        let failed =
            match self.all_reduce_on_device(&src, &dst, dtype, stream_id, &op, &group, &path) {
                OnDevice::Done => return Ok(()),
                OnDevice::Host => None,
                OnDevice::HostFailed(err) => Some(err),
            };
        let round = self.comm.next_round(&group);
        let len = src.size_in_used() as usize;
        // The member's one host copy: the read's own buffer, reduced in place if it is first.
        // A member that failed already contributes its error: the others meet it in the
        // round instead of waiting for bytes that will not come.
        let data = match failed {
            Some(err) => Err(err),
            None => self.read_all(bytes_of(src, len), stream_id),
        };
        let reduced = COLLECTIVES.all_reduce(&group, round, self.device, data, dtype, &op);
        let written = reduced.and_then(|data| {
            if data.len() as u64 > dst.size_in_used() {
                return Err(generic(format!(
                    "caching allocator: all_reduce of {} bytes into a buffer of {} bytes",
                    data.len(),
                    dst.size_in_used()
                )));
            }
            self.write_one(bytes_of(dst, data.len()), &data, stream_id)
        });
        if let Err(err) = written {
            self.push_error(stream_id, err);
        }
        Ok(())
    }
}
