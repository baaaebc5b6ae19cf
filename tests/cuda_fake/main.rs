//! The CUDA backend's host code under the fake CUDA driver (`fake-cuda/`): `CachingCudaRuntime`
//! through CubeCL's client, `CudaMemory` and the engine, expandable segments, pinned staging
//! and copies in flight, stream-ordered reuse across threads, and the fake's own contract
//! checks. No GPU: the fake keeps device memory in host memory, runs queued work later and in
//! a seeded order across streams, and logs every broken driver contract; each test asserts the
//! log empty. Kernels launch but compute nothing: the fake NVRTC reads their declarations, the
//! fake driver checks each launch's pointers and counts it, for the race detector, as a read or
//! a write of each tensor's bytes (`kernels`); values read back after a kernel are not checked.
//!
//! The binary re-executes itself before `main` with the fake on the library path
//! (`support/fake_cuda.rs`). Without the fake built, every test prints why it skips; with `CI`
//! set, they fail. Build it first: `cargo build -p fake-cuda`. On a GPU,
//! `BURN_CACHING_ALLOC_REAL_CUDA=1` runs the same tests on the real driver (the fake's own
//! checks skipped): `scripts/gpu-check.sh` does.
//!
//! The fake's devices (`start` below), one per concern so that tests of different files do not
//! share an engine:
//!
//! | device | memory | virtual memory | used by |
//! |---|---|---|---|
//! | 0 | 4 GiB | yes | `runtime` (the default configuration) |
//! | 1 | 4 GiB | yes | `expandable` (`expandable_segments:true`) |
//! | 2 | 64 MiB | yes | `oom` |
//! | 3 | 4 GiB | no | `memory` (`CudaMemory` on its own, a server dropped) |
//! | 4 | 4 GiB | yes | `cross_stream` |
//! | 5 | 4 GiB | yes | `memory` and `oom` (expandable segments under the engine) |
//! | 6 | 4 GiB | yes | `uncached` (`no_cuda_memory_caching:True`) |
//! | 7 | 4 GiB | yes | `pinned` (the pinned host pool's keys) |
//! | 8 | 64 MiB | yes | `failed` |
//! | 9 | 4 GiB | yes | `kernels` (Burn on `CachingCuda`) |
//!
//! Modules:
//! - `runtime`: create, read back, copy, statistics, `empty_cache`, staging, drop;
//! - `memory`: `CudaMemory` and the engine directly (segments, events, expandable pages);
//! - `expandable`: expandable segments through the runtime against the granularity contracts;
//! - `oom`: out of memory on a small device, the allocator's report;
//! - `cross_stream`: PyTorch's `record_stream` rule from several threads, every scheduler mode,
//!   20 seeds each, values checked; rounds of threads that come and go, their memory crossing
//!   streams (slot reuse, shared segments, lent blocks), every scheduler mode, values checked;
//! - `comm`: CUDA's device path between devices (peer copies, NCCL) on four fake devices in
//!   child processes, every scheduler mode; a member failing before its NCCL call, the path
//!   of an all-reduce when the setting changes between members, the host path's pinned
//!   staging reused;
//! - `nccl`: the fake NCCL on two devices (values, groups, a missing rank, an abort cancelling
//!   queued work);
//! - `uncached`: `no_cuda_memory_caching`, every tensor one `cuMemAlloc` and one `cuMemFree`
//!   after its stream's work;
//! - `pinned`: the pinned host pool's statistics and limits, and its drop;
//! - `failed`: a failed request (out of memory, rejected at a memory fraction, over a fraction,
//!   in a private pool) corrupts no live tensor, and every use of the failed one is its error;
//! - `kernels`: Burn on `CachingCuda`: launches, its training step on `Autodiff<CachingCuda>`
//!   with the statistics the wgpu tests assert, a tensor made on one thread used by kernels on
//!   another; and the fake's launch checks (a freed or out-of-bounds pointer, a race between
//!   two streams' kernels, the launch shape, a source without an entry point);
//! - `detector`: the fake catches what it claims to (a missing wait, a double free, a map off
//!   the granularity), so that an empty log means something.
#![cfg(feature = "cuda")]

#[path = "../support/child.rs"]
mod child;
#[path = "../support/fake_cuda.rs"]
mod fake_cuda;
// The MLP and its data (`kernels` trains it); the wgpu checks of the file stay unused here.
#[path = "../support/mlp_check.rs"]
#[allow(dead_code)]
mod mlp_check;

/// Before libtest's `main`: under the fake, with the devices above.
// SAFETY (`unsafe` in the attribute): runs before `main`, where std is set up on Linux; it
// reads the environment, creates a folder and links, and re-executes this binary.
#[ctor::ctor(unsafe)]
fn under_the_fake() {
    fake_cuda::start(&[
        ("FAKE_CUDA_DEVICES", "10"),
        ("FAKE_CUDA_MEMORY", "4G,4G,64M,4G,4G,4G,4G,4G,64M,4G"),
        ("FAKE_CUDA_VMM", "1,1,1,0,1,1,1,1,1,1"),
        ("FAKE_CUDA_GRANULARITY", "2M"),
        ("FAKE_CUDA_SCHEDULE", "random"),
    ]);
}

/// 1 MiB.
pub(crate) const MIB: u64 = 1 << 20;

mod comm;
mod cross_stream;
mod detector;
mod expandable;
mod failed;
mod kernels;
mod memory;
mod nccl;
mod oom;
mod pinned;
mod runtime;
mod uncached;
