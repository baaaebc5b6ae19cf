//! CubeCL's own runtime conformance suite (`cubecl_core::testgen_all!()`) on
//! `CachingWgpuRuntime`: every kernel, read, write and allocation of the suite goes through the
//! caching server and the engine. Runs on any wgpu adapter; CI runs it on Mesa's lavapipe
//! (`VK_ICD_FILENAMES` pointing at `lvp_icd`), where stock `WgpuRuntime` passes the same suite.
#![cfg(feature = "wgpu")]

mod caching_wgpu {
    pub type TestRuntime = burn_caching_alloc::runtime::CachingWgpuRuntime;

    cubecl_core::testgen_all!();
}
