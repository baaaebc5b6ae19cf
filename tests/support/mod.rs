//! Helpers for the `runtime` test binary (`conformance_wgpu` and `engine` include single files
//! of this folder by path).

#[cfg(feature = "wgpu")]
pub mod child;
#[cfg(feature = "wgpu")]
pub mod ci;
#[cfg(feature = "wgpu")]
pub mod lavapipe;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod mlp_check;
pub mod rng;
#[cfg(feature = "wgpu")]
pub mod stock;
