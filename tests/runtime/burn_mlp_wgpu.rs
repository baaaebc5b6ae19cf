//! A small MLP trains on `Autodiff<CachingWgpu>` (fused, as Burn's default `Wgpu` is) and on
//! `Autodiff<CachingWgpuUnfused>` (lavapipe in CI): the loss falls, reserved memory stops
//! growing after the first steps, and after everything is dropped and `empty_cache` runs, no
//! memory is reserved.

use burn::backend::Autodiff;
use burn_caching_alloc::backend::{CachingWgpu, CachingWgpuUnfused};

use crate::support::lavapipe::cpu_device;
use crate::support::mlp_check::{MlpShape, train_and_check};

const SHAPE: MlpShape = MlpShape {
    hidden: 128,
    batch: 256,
    steps: 200,
};

#[test]
fn mlp_trains_and_memory_settles() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    train_and_check::<Autodiff<CachingWgpu>>(&device, SHAPE);
}

#[test]
fn mlp_trains_and_memory_settles_unfused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    train_and_check::<Autodiff<CachingWgpuUnfused>>(&device, SHAPE);
}
