//! CubeCL's own runtime conformance suite (`cubecl_core::testgen_all!()`) on
//! `CachingCudaRuntime`: every kernel, read, write and allocation of the suite goes through the
//! caching server, NVRTC and the engine on a real CUDA device.
//!
//! The suite's tests open the device unconditionally, so they cannot skip at run time. They are
//! compiled only with `--cfg gpu_conformance`, passed to this crate alone:
//!
//! ```text
//! cargo rustc --release --features cuda --test conformance_cuda -- --cfg gpu_conformance
//! ```
//!
//! `scripts/gpu-bundle.sh` builds it that way for the GPU machine (and fails if it does not
//! build), and `scripts/gpu-check.sh` requires its pass count. Without the cfg this file holds
//! one test, ignored with the reason, that says why the suite did not run when it is run
//! anyway (`--include-ignored`).
#![cfg(feature = "cuda")]
#![allow(unexpected_cfgs)]

#[cfg(gpu_conformance)]
mod caching_cuda {
    pub type TestRuntime = burn_caching_alloc::runtime::CachingCudaRuntime;

    cubecl_core::testgen_all!();
}

#[cfg(not(gpu_conformance))]
#[test]
#[ignore = "needs a CUDA device and the --cfg gpu_conformance build of scripts/gpu-bundle.sh"]
fn conformance_suite_needs_a_gpu_build() {
    let device = match burn_caching_alloc::cuda::cuda_available() {
        Ok(()) => "a CUDA device is present".to_string(),
        Err(reason) => reason.to_string(),
    };
    eprintln!(
        "skipping CubeCL's conformance suite on CachingCudaRuntime: it is compiled only with \
         `--cfg gpu_conformance` (scripts/gpu-bundle.sh does this); here: {device}"
    );
}
