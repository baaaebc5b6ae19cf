//! The runtime layer and the Burn backends, in one process:
//!
//! - `faults`: dropped stream memory and a poisoned engine at the runtime layer;
//! - `readings_ab`: readings that change nothing, three streams on the simulated device;
//! - `storage`: `EngineStorage` and CubeCL's persistent manager over it, on the simulated
//!   device (no GPU, no feature; the reclaim policy's tests are in the crate, beside it);
//! - `burn_fused_wgpu`, `burn_mlp_wgpu`, `burn_oom_wgpu`, `caller_stacks_wgpu`, `components_wgpu`,
//!   `configure_wgpu`, `expandable_wgpu`, `failed_requests_wgpu`, `history_wgpu`,
//!   `launches_wgpu`, `mem_pool_wgpu`,
//!   `memory_report_wgpu`, `observe_twice_wgpu`, `oom_observers_wgpu`, `readings_ab_wgpu`,
//!   `scopes_wgpu`, `soak_wgpu`,
//!   `thread_rounds_wgpu`,
//!   `trace_wgpu` (feature `wgpu`): Burn on
//!   `CachingWgpu` (fused) and `CachingWgpuUnfused`, on the wgpu CPU adapter (Mesa's lavapipe
//!   in CI);
//!   `memory_metric_wgpu` (features `wgpu` and `train`): the burn-train metrics;
//!   `loader_epochs_wgpu` (features `wgpu` and `train`, for Burn's data loader): a
//!   multi-threaded loader over epochs;
//! - `multi_device_wgpu` (feature `wgpu`): two caching devices in one process (`Cpu` and
//!   `DefaultDevice`, both lavapipe in CI), tensors moved between them;
//!   `multi_device_train_wgpu`: data-parallel training across the two, against one device;
//!   `multi_device_learner_wgpu` (and feature `train`): burn-train's `MultiDevice` strategy;
//! - `multi_device_one` (wgpu, and cuda ignored without a device): a copy to the same device
//!   and an all-reduce of one rank through CubeCL's client;
//! - `comm_cuda` (feature `cuda`, ignored without a device): the NCCL probe, NCCL against the
//!   host path, the staging block's reuse rule with two threads, the 256 MiB micro-benchmark,
//!   and two-device tests that skip on one GPU;
//! - `burn_mlp_cuda`, `cross_stream_cuda`, `cuda_faults`, `cuda_launches`, `cuda_memory`
//!   (feature `cuda`): Burn on `CachingCuda`
//!   and `CudaMemory` on a real CUDA device; ignored by default ("needs a CUDA device"), each
//!   prints why it skips when run without one (`--include-ignored`).
//!
//! Sharing a process: CubeCL keeps one server per device for the whole process, and the
//! library one engine per device. The wgpu tests all use `WgpuDevice::Cpu` (the only device
//! lavapipe offers), so `support::lavapipe::cpu_device` hands it out under a process-wide lock:
//! they run one at a time, each leaves the device as it found it (cache emptied, memory
//! fraction back to 1) and compares cumulative counters as deltas. `trace_wgpu` and
//! `configure_wgpu` need a device to open with a given configuration, so they run in a child
//! process of this binary (`support::child`). In the CUDA tests, `cuda_memory` opens its own
//! `CudaMemory`; `burn_mlp_cuda`
//! and `cuda_launches` use the registered CUDA device one at a time (`burn_mlp_cuda::cuda_turn`).

#[path = "../support/mod.rs"]
mod support;

/// 1 MiB, the unit the tests size tensors in.
pub(crate) const MIB: u64 = 1 << 20;

mod faults;
mod readings_ab;
mod storage;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod multi_device_one;

#[cfg(feature = "wgpu")]
mod burn_fused_wgpu;
#[cfg(feature = "wgpu")]
mod burn_mlp_wgpu;
#[cfg(feature = "wgpu")]
mod burn_oom_wgpu;
#[cfg(feature = "wgpu")]
mod caller_stacks_wgpu;
#[cfg(feature = "wgpu")]
mod components_wgpu;
#[cfg(feature = "wgpu")]
mod configure_wgpu;
#[cfg(feature = "wgpu")]
mod expandable_wgpu;
#[cfg(feature = "wgpu")]
mod failed_requests_wgpu;
#[cfg(feature = "wgpu")]
mod history_wgpu;
#[cfg(feature = "wgpu")]
mod launches_wgpu;
#[cfg(all(feature = "wgpu", feature = "train"))]
mod loader_epochs_wgpu;
#[cfg(feature = "wgpu")]
mod mem_pool_wgpu;
#[cfg(all(feature = "wgpu", feature = "train"))]
mod memory_metric_wgpu;
#[cfg(feature = "wgpu")]
mod memory_report_wgpu;
#[cfg(all(feature = "wgpu", feature = "train"))]
mod multi_device_learner_wgpu;
#[cfg(feature = "wgpu")]
mod multi_device_train_wgpu;
#[cfg(feature = "wgpu")]
mod multi_device_wgpu;
#[cfg(feature = "wgpu")]
mod observe_twice_wgpu;
#[cfg(feature = "wgpu")]
mod oom_observers_wgpu;
#[cfg(feature = "wgpu")]
mod readings_ab_wgpu;
#[cfg(feature = "wgpu")]
mod scopes_wgpu;
#[cfg(feature = "wgpu")]
mod soak_wgpu;
#[cfg(feature = "wgpu")]
mod thread_rounds_wgpu;
#[cfg(feature = "wgpu")]
mod trace_wgpu;

#[cfg(feature = "cuda")]
mod burn_mlp_cuda;
#[cfg(feature = "cuda")]
mod comm_cuda;
#[cfg(feature = "cuda")]
mod cross_stream_cuda;
#[cfg(feature = "cuda")]
mod cuda_faults;
#[cfg(feature = "cuda")]
mod cuda_launches;
#[cfg(feature = "cuda")]
mod cuda_memory;
