//! The wgpu CPU adapter (Mesa's lavapipe in CI) for the wgpu tests.

use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::runtime::wgpu::adapter_available;

/// The CPU device, or `None` (with the reason printed) when there is no CPU adapter.
/// Under `CI=true` a missing adapter fails the test instead: CI proves the whole stack there.
pub fn cpu_device() -> Option<WgpuDevice> {
    let device = WgpuDevice::Cpu;
    if adapter_available(&device) {
        return Some(device);
    }
    let reason = "no wgpu CPU adapter (install mesa-vulkan-drivers for lavapipe)";
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{reason}; CI=true makes this a failure");
    }
    eprintln!("skipping: {reason}");
    None
}
