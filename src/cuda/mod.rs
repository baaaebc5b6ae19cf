//! The CUDA backend (feature `cuda`), everything CUDA in one place: the device memory the engine
//! allocates segments from ([`CudaMemory`]), and the CubeCL driver and runtime over it
//! ([`CachingCudaRuntime`]).
//!
//! - `memory`: segments through `cuMemAlloc`/`cuMemFree`, the engine's [`DeviceMemory`];
//! - `streams`, `events`: CUDA streams per engine stream and a pool of events;
//! - `probe`: whether a driver and a device are here, and the device's primary context;
//! - `error`: driver results as [`DeviceError`]s, `libcuda` panics caught;
//! - `kernel`: CubeCL kernels compiled to CUDA C++ and through NVRTC;
//! - `headers`: where NVRTC finds CUDA's headers, checked when the device opens;
//! - `staging`: pinned host buffers for copies, pooled;
//! - `in_flight`: copies in flight, their buffers held until the event after them (or the
//!   stream) says they are done;
//! - `properties`: what the device supports, as CubeCL's `DeviceProperties`;
//! - `peer`: copies between devices (peer access, peers' access to expandable segments);
//! - `nccl`: NCCL loaded at run time, a communicator clique per group, for `all_reduce`;
//! - `driver`: the [`Driver`](crate::runtime::Driver) the generic server runs on;
//! - `runtime`: [`CachingCudaRuntime`], the `cubecl::Runtime` Burn's `CachingCuda` uses.
//!
//! Every driver call first makes the device's primary context current on the calling thread,
//! so the engine and the server may call in from any thread. Nothing here panics, including
//! when `libcuda` is missing: failures are errors.
//!
//! [`DeviceMemory`]: crate::device::DeviceMemory
//! [`DeviceError`]: crate::device::DeviceError

mod driver;
mod error;
mod events;
mod headers;
mod in_flight;
mod kernel;
mod memory;
mod nccl;
mod peer;
mod probe;
mod properties;
mod runtime;
mod staging;
mod streams;
mod virtual_memory;

pub use driver::{CudaDriver, CudaStream};
pub use events::PooledEvent;
pub use kernel::CudaKernel;
pub use memory::CudaMemory;
pub use nccl::{NCCL_ENV, NCCL_NAMES, nccl_version};
pub use peer::CudaPeerBuffer;
pub use probe::{cuda_available, device_count};
pub use runtime::CachingCudaRuntime;
