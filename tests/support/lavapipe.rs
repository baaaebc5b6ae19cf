//! The wgpu CPU adapter (Mesa's lavapipe in CI) for the wgpu tests.

use std::sync::{Mutex, MutexGuard, PoisonError};

use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::wgpu::adapter_available;

use super::ci::is_ci;

/// The wgpu tests of one binary share `WgpuDevice::Cpu`: its CubeCL server and its engine live
/// as long as the process. They take turns through this lock, so that none sees another's
/// tensors, cache or memory fraction.
static CPU_DEVICE: Mutex<()> = Mutex::new(());

/// The CPU device and the lock on it (hold it until the test ends), or `None` when there is
/// no CPU adapter: the test then skips, saying why in one line. In CI (see [`is_ci`]) a
/// missing adapter fails the test instead: CI proves the whole stack there.
pub fn cpu_device() -> Option<(WgpuDevice, MutexGuard<'static, ()>)> {
    // A test that failed while holding the lock has left the device as any test may.
    let lock = CPU_DEVICE.lock().unwrap_or_else(PoisonError::into_inner);
    let device = WgpuDevice::Cpu;
    if adapter_available(&device) {
        return Some((device, lock));
    }
    if is_ci() {
        panic!(
            "no wgpu CPU adapter (install mesa-vulkan-drivers for lavapipe); CI is set, which \
             makes this a failure"
        );
    }
    eprintln!(
        "skipping: no wgpu CPU adapter (install mesa-vulkan-drivers for lavapipe; CI=true \
         makes this a failure)"
    );
    None
}
