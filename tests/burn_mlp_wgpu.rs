//! A small MLP trains on `Autodiff<CachingWgpu>` (lavapipe in CI): the loss falls, reserved
//! memory stops growing after the first steps, and after everything is dropped and
//! `empty_cache` runs, no memory is reserved.
#![cfg(feature = "wgpu")]

#[path = "support/lavapipe.rs"]
mod lavapipe;

#[path = "support/mlp_check.rs"]
mod mlp_check;

use lavapipe::cpu_device;

use burn::backend::Autodiff;
use burn_caching_alloc::backend::CachingWgpu;
use mlp_check::{MlpShape, train_and_check};

#[test]
fn mlp_trains_and_memory_settles() {
    let Some(device) = cpu_device() else {
        return;
    };
    let shape = MlpShape {
        hidden: 128,
        batch: 256,
        steps: 200,
    };
    train_and_check::<Autodiff<CachingWgpu>>(&device, shape);
}
