//! A small MLP trains on `Autodiff<CachingWgpu>` (lavapipe in CI): the loss falls, reserved
//! memory stops growing after the first steps, and after everything is dropped and
//! `empty_cache` runs, no memory is reserved.

use burn::backend::Autodiff;
use burn_caching_alloc::backend::CachingWgpu;

use crate::support::lavapipe::cpu_device;
use crate::support::mlp_check::{MlpShape, train_and_check};

#[test]
fn mlp_trains_and_memory_settles() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let shape = MlpShape {
        hidden: 128,
        batch: 256,
        steps: 200,
    };
    train_and_check::<Autodiff<CachingWgpu>>(&device, shape);
}
