//! The MNIST crate's integration tests, one binary:
//!
//! - [`idx`]: the IDX reader, the loader and the checksum check, on small files the tests write
//!   themselves, and the shipped `data/` against its `SHA256SUMS`;
//! - [`train`] (feature `wgpu`): the MLP trained on the shipped data with the caching and the
//!   stock wgpu backends (lavapipe on a CPU), which must learn and agree.

mod fuzz;
mod idx;
#[cfg(feature = "wgpu")]
mod support;
#[cfg(feature = "wgpu")]
mod train;
