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
//!
//! By part: `state` (communicators, cliques, operations and launches), `elements` (data types
//! and reductions), `execution` (readiness and running a launch), `comm` (communicator
//! functions), `group` (groups and posting launches), `operations` (collectives, send and
//! receive) and `info` (version and error strings).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use crate::state::Fake;

pub const NCCL_SUCCESS: u32 = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: u32 = 1;
pub const NCCL_INVALID_ARGUMENT: u32 = 4;
pub const NCCL_INVALID_USAGE: u32 = 5;

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

mod comm;
mod elements;
mod execution;
mod group;
mod info;
mod operations;
mod state;

pub use state::Nccl;
