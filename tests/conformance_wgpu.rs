//! CubeCL's own runtime conformance suite (`cubecl_core::testgen_all!()`) on
//! `CachingWgpuRuntime`: every kernel, read, write and allocation of the suite goes through the
//! caching server and the engine. Runs on any wgpu adapter; CI runs it on Mesa's lavapipe
//! (`VK_ICD_FILENAMES` pointing at `lvp_icd`), where stock `WgpuRuntime` passes the same suite.
//!
//! The suite's tests open the default device unconditionally, so they cannot skip one by one.
//! Instead, before libtest starts, [`skip_without_an_adapter`] checks that device: without an
//! adapter the binary prints why and exits successfully, having run nothing; in CI (`CI` set
//! to anything but empty, `0` or `false`) it fails instead.
#![cfg(feature = "wgpu")]

#[path = "support/ci.rs"]
mod ci;

mod caching_wgpu {
    pub type TestRuntime = burn_caching_alloc::wgpu::CachingWgpuRuntime;

    cubecl_core::testgen_all!();
}

/// Runs before libtest's `main` (see the module docs).
// SAFETY (`unsafe` in the attribute): the function runs before `main`, where std is set up on
// the platforms wgpu supports; it reads the environment, probes wgpu, prints and may exit.
#[ctor::ctor(unsafe)]
fn skip_without_an_adapter() {
    // The device every test of the suite opens: `TestRuntime::client(&Default::default())`.
    let device = cubecl_wgpu::WgpuDevice::default();
    if burn_caching_alloc::wgpu::adapter_available(&device) {
        return;
    }
    if ci::is_ci() {
        eprintln!(
            "error: no wgpu adapter for CubeCL's conformance suite on CachingWgpuRuntime \
             ({device:?}); CI is set, which makes this a failure (install mesa-vulkan-drivers \
             for lavapipe, or run with a GPU)"
        );
        std::process::exit(101);
    }
    println!(
        "skipping CubeCL's conformance suite on CachingWgpuRuntime: no wgpu adapter (install \
         mesa-vulkan-drivers for lavapipe, or run with a GPU)"
    );
    std::process::exit(0);
}
