//! burn-caching-alloc: a PyTorch-style caching allocator for CubeCL, shipped as Burn backends.
//!
//! Where a Burn project writes `Autodiff<Cuda>` it writes `Autodiff<CachingCuda>` (or
//! `Autodiff<CachingWgpu>` for `Autodiff<Wgpu>`), and every tensor is placed by PyTorch's
//! CUDA caching rules: large and small pools, best-fit splitting, coalescing on free, and an
//! out-of-memory path that frees the cache and retries before it fails. What the allocator
//! holds reads as PyTorch's statistics, summaries and snapshots. The guide (`docs/src/` in the
//! repository) explains the rules, the configuration and the benchmarks; this documentation
//! is the API.
//!
//! # Switching a Burn project
//!
//! The backends are Burn backends like `Wgpu` and `Cuda`, over the same device types; the
//! memory API takes the device (module `backend`, features `wgpu` or `cuda`):
//!
//! ```no_run
//! # #[cfg(feature = "wgpu")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use burn::backend::Autodiff;
//! use burn::backend::wgpu::WgpuDevice;
//! use burn::tensor::Tensor;
//! use burn_caching_alloc::backend::{self, CachingWgpu};
//!
//! type B = Autodiff<CachingWgpu>; // where the project had Autodiff<Wgpu>
//! let device = WgpuDevice::default();
//!
//! let x = Tensor::<B, 2>::ones([256, 256], &device).require_grad();
//! let loss = x.clone().matmul(x.clone()).sum();
//! let _grads = loss.backward();
//!
//! let stats = backend::memory_stats(&device);
//! println!("allocated {} B, reserved {} B", stats.memory_allocated(), stats.memory_reserved());
//! println!("{}", backend::memory_summary(&device)); // like torch.cuda.memory_summary()
//! backend::empty_cache(&device); // cached segments go back to the device
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "wgpu"))]
//! # fn main() {}
//! ```
//!
//! The `backend` module walks through the rest of the user API: configuration, snapshots and
//! the viewer, the leak-or-cache report, out-of-memory observers.
//!
//! # The engine on its own
//!
//! The engine is its own crate, `caching-alloc-engine`, re-exported here as [`alloc`] and
//! [`device`]: it knows devices only through [`device::DeviceMemory`], and on the simulated
//! device ([`device::sim::SimDevice`]) it runs anywhere, which is how its rules are tested:
//!
//! ```
//! use burn_caching_alloc::alloc::{AllocatorConfig, CachingAllocator};
//! use burn_caching_alloc::device::{DeviceStream, sim::SimDevice};
//!
//! let alloc = CachingAllocator::new(SimDevice::new(8 << 30), AllocatorConfig::default())?;
//! let block = alloc.malloc(4 << 20, DeviceStream::default())?;
//! assert_eq!(alloc.stats().memory_allocated(), 4 << 20);
//! alloc.free(block)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Layers
//!
//! Each knows only the ones below it:
//! - [`alloc`]: the engine (pools, best fit, split, coalesce, statistics, snapshots, traces).
//!   Pure Rust: it knows devices only through [`device::DeviceMemory`];
//! - [`device`]: the raw-memory trait, a simulated device and a metering wrapper;
//! - [`runtime`]: the CubeCL server over the engine, generic over a [`runtime::Driver`], and
//!   the per-stream pieces that put the engine under CubeCL's memory management;
//! - `cuda` (feature `cuda`) and `wgpu` (feature `wgpu`): one folder per backend, each with its
//!   device memory, its driver and its `cubecl::Runtime`;
//! - `backend` (features `cuda` or `wgpu`): the Burn aliases (`CachingCuda`, `CachingWgpu`) and
//!   the user API (`memory_stats`, `empty_cache`, ...).
//!
//! Each public item has one path: its own module's (`alloc::CachingAllocator`,
//! `device::DeviceStream`, `cuda::CachingCudaRuntime`, `backend::CachingWgpu`, ...); no layer
//! re-exports what sits above it.
//!
//! # Features
//!
//! `cuda` and `wgpu` (the backends), `fusion` and `autotune` (as Burn's defaults have them) are
//! on by default; `train` adds burn-train memory metrics, `distributed` Burn's data-parallel
//! training. With no default features the crate is the engine alone, without Burn.
//!
//! The MNIST showcase (`examples/mnist`), its burn-train version (`examples/mnist-train`), the
//! trace replay benchmark (`replay/`) and the side-by-side benchmark (`bench-burn/`) are
//! workspace crates of their own, built on this API.
#![warn(unnameable_types)]
#![warn(missing_docs)]

pub use caching_alloc_engine::{alloc, device};

/// The README's Rust snippets, compiled as doc tests (`cargo test --doc`): the recipe and the
/// API snippet stay true to the API.
#[cfg(all(doctest, feature = "cuda", feature = "wgpu", feature = "fusion"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's chapters (`docs/src/`), their Rust blocks compiled as doc tests as the README's
/// are. `using.md` is compiled by `examples/mnist-train` (one block calls that crate), and
/// `burn-022.md` and `upstream-hook.md` by `examples/burn-022/hook` (Burn 0.22, CubeCL 0.11).
#[cfg(doctest)]
mod guide_doctests {
    /// `docs/src/seeing-memory.md`.
    #[cfg(feature = "wgpu")]
    #[doc = include_str!("../docs/src/seeing-memory.md")]
    pub struct SeeingMemory;
    /// `docs/src/configuration.md`.
    #[cfg(feature = "wgpu")]
    #[doc = include_str!("../docs/src/configuration.md")]
    pub struct Configuration;
    /// `docs/src/cuda.md`.
    #[cfg(feature = "cuda")]
    #[doc = include_str!("../docs/src/cuda.md")]
    pub struct Cuda;
    /// `docs/src/several-devices.md`.
    #[cfg(all(feature = "wgpu", feature = "train", feature = "distributed"))]
    #[doc = include_str!("../docs/src/several-devices.md")]
    pub struct SeveralDevices;
    /// `docs/src/placement.md`.
    #[doc = include_str!("../docs/src/placement.md")]
    pub struct Placement;
    /// `docs/src/troubleshooting.md`.
    #[cfg(feature = "wgpu")]
    #[doc = include_str!("../docs/src/troubleshooting.md")]
    pub struct Troubleshooting;
}

#[cfg(feature = "runtime")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod runtime;
#[cfg(feature = "wgpu")]
pub mod wgpu;
