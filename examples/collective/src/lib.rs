//! Data-parallel training on several processes, possibly on several machines, with
//! burn-collective 0.21 over `burn-caching-alloc`'s `CachingWgpu`: the crate a user copies.
//!
//! One process runs burn-collective's global orchestrator; each node process registers one
//! peer per local device, and every step each peer computes the gradients of its shard of the
//! batch, averages them with every other peer (burn-collective sums the devices of a process
//! with `to_device` and `add`, which run through the caching backend's `send`/`recv`, then the
//! processes over WebSocket), and takes the same SGD step. Within one process the gradients go
//! through Burn's `GradientsParams::all_reduce`; across processes, where burn-collective 0.21.0
//! completes one operation per registration, through one flattened all-reduce per step and one
//! registration per step ([`node`] says why and how).
//!
//! - [`model`]: the small model, built identically on every process (values and `ParamId`s);
//! - [`data`]: the deterministic batches and each peer's shard of them;
//! - [`flat`]: a step's gradients as one tensor, for one all-reduce per step;
//! - [`devices`]: the `--devices` names and the wgpu devices they open;
//! - [`node`]: one node process: the all-reduce check and training, in registration rounds;
//! - [`barrier`]: the barrier between the node processes at the end of each round (a small
//!   TCP service the `orchestrator` subcommand runs next to burn-collective's orchestrators);
//! - [`single`]: the same training on one device without burn-collective (the reference);
//! - [`train`]: one SGD step, with or without the gradients' all-reduce;
//! - [`report`]: the JSON lines every process prints (one per peer, one per device's memory).
//!
//! `src/main.rs` is the command line.
#![warn(missing_docs)]

pub mod barrier;
pub mod data;
pub mod devices;
pub mod flat;
pub mod model;
pub mod node;
pub mod report;
pub mod single;
pub mod train;

/// The backend every peer computes on by default: the caching allocator under Burn's wgpu
/// backend. burn-collective is given this inner backend, never the `Autodiff` one.
pub type Backend = burn_caching_alloc::backend::CachingWgpu;
/// The training backend.
pub type TrainBackend = burn::backend::Autodiff<Backend>;
/// The backend with `--backend cuda` (feature `cuda`): the caching allocator under Burn's CUDA
/// backend. Everything but the device names is generic over the backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn_caching_alloc::backend::CachingCuda;

/// What the example asks of a backend: a Burn backend on the caching allocator's devices
/// (`memory_stats`), whose devices the command line can name.
pub trait PeerBackend: burn::tensor::backend::Backend<Device = Self::Named> {
    /// The backend's device type.
    type Named: burn_caching_alloc::backend::CachingDevice + devices::DeviceName;
}

impl PeerBackend for Backend {
    type Named = burn::backend::wgpu::WgpuDevice;
}

#[cfg(feature = "cuda")]
impl PeerBackend for CudaBackend {
    type Named = burn::backend::cuda::CudaDevice;
}

/// SGD's learning rate: a power of two, so that a step on exact gradients is exact.
pub const LEARNING_RATE: f64 = 1.0 / 64.0;
