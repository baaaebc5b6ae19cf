//! Communicators: unique ids, initialisation (`ncclCommInitRank`, `ncclCommInitAll`), destroy,
//! abort and queries.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::time::{Duration, Instant};

use super::state::{Clique, Comm, UniqueId};
use super::{
    NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_SUCCESS, NCCL_UNHANDLED_CUDA_ERROR, nccl_reject,
};
use crate::state::{Fake, call as cuda_call, current_device, global, lock};

const COMM_BASE: u64 = 0xCC00_0000;

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

fn new_comm(fake: &mut Fake, clique: u64, rank: usize, device: usize, buffers: Option<u64>) -> u64 {
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
            buffers,
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
        let handle = new_comm(fake, clique, rank as usize, device, None);
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
        let mut devices = Vec::new();
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
            devices.push(device as usize);
        }
        // NCCL's own buffers, from the devices' memory beside the caller's allocator: without
        // room on one device no communicator is made.
        let bytes = fake.config.nccl_comm_bytes;
        for &device in &devices {
            let needed = bytes * devices.iter().filter(|&&d| d == device).count() as u64;
            if bytes > 0 && fake.memory.used(device) + needed > fake.config.memory[device] {
                return NCCL_UNHANDLED_CUDA_ERROR;
            }
        }
        for (rank, &device) in devices.iter().enumerate() {
            let buffers = (bytes > 0).then(|| fake.memory.alloc(device, bytes));
            handles.push(new_comm(fake, clique, rank, device, buffers));
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

pub(super) fn comm_checked(fake: &mut Fake, name: &str, comm: *mut c_void) -> Result<u64, u32> {
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
        if let Some(base) = c.buffers.take() {
            fake.memory.free(base);
        }
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
