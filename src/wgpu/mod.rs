//! The wgpu backend (feature `wgpu`): Vulkan, Metal, DX12, and Mesa's lavapipe on a CPU.
//!
//! - `memory`: a segment is one wgpu storage buffer ([`WgpuMemory`], the engine's
//!   [`DeviceMemory`](crate::device::DeviceMemory));
//! - `setup`: opening an adapter and device as cubecl-wgpu does, and [`adapter_available`];
//! - `driver`: the [`Driver`](crate::runtime::Driver) the generic server runs on;
//! - `runtime`: [`CachingWgpuRuntime`], the `cubecl::Runtime` Burn's `CachingWgpu` uses.

mod driver;
mod memory;
mod runtime;
mod setup;

pub use driver::{WgpuDriver, WgpuKernel, WgpuStream};
pub use memory::WgpuMemory;
pub use runtime::CachingWgpuRuntime;
pub use setup::adapter_available;
