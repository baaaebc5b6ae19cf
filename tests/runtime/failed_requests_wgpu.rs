//! A failed request corrupts no live tensor, on `CachingWgpuUnfused` and the fused
//! `CachingWgpu` (lavapipe in CI). PyTorch's contract: a failed allocation raises
//! (`DeviceCachingAllocator::malloc`'s `OutOfMemoryError`), and every live tensor keeps its
//! values. The server leaves a failed tensor's CubeCL handle unbound,
//! and CubeCL resolves an unbound handle to the stream's first slice: before the stream's
//! guard slice (`StreamMemory`), the kernel that fills the failed tensor, or any later
//! operation on it, wrote into whatever tensor held that slice.
//!
//! Every scenario starts from an emptied cache, makes three live tensors of distinct values
//! (a `full` of 2, a fused `ones * 3`, a `full` of 4, 4 MiB each), fails a 64 MiB request a
//! way of its own, then checks: the failed tensor's read is the request's error, and so is
//! every later use of it (a second read, an operation over it); the live tensors keep their
//! values; the next request works.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::alloc::MemPoolOptions;
use burn_caching_alloc::backend::{self, CachingWgpu, CachingWgpuUnfused, MemPool, use_mem_pool};

use crate::MIB;
use crate::multi_device_wgpu::two_devices;
use crate::support::lavapipe::cpu_device;

/// f32 elements of a tensor of `mib` MiB.
fn elements(mib: u64) -> usize {
    (mib * MIB / 4) as usize
}

/// Caps `device` at 48 MiB (and fails fast at the cap with `throw`) until dropped: the
/// device is given back whole when the test ends, passed or failed.
struct Capped<'a>(&'a WgpuDevice);

impl<'a> Capped<'a> {
    fn new(device: &'a WgpuDevice, throw: bool) -> Self {
        let total = backend::memory_stats(device).device.total;
        backend::set_per_process_memory_fraction(device, (48 * MIB) as f64 / total as f64)
            .expect("valid fraction");
        if throw {
            backend::set_allocator_settings(device, "throw_on_cudamalloc_oom:True")
                .expect("setting");
        }
        Self(device)
    }
}

impl Drop for Capped<'_> {
    fn drop(&mut self) {
        let _ = backend::set_allocator_settings(self.0, "throw_on_cudamalloc_oom:False");
        let _ = backend::set_per_process_memory_fraction(self.0, 1.0);
    }
}

/// Every element of `tensor` is `value`.
fn assert_holds<B: Backend>(tensor: &Tensor<B, 1>, value: f32, name: &str) {
    let data = tensor
        .clone()
        .into_data()
        .to_vec::<f32>()
        .expect("f32 values");
    if let Some(at) = data.iter().position(|v| *v != value) {
        panic!(
            "live tensor {name} reads {} at element {at} of {}, not {value}",
            data[at],
            data.len()
        );
    }
}

/// Three live tensors of distinct values, 4 MiB each, on `device`.
fn live_tensors<B: Backend<Device = WgpuDevice>>(
    device: &WgpuDevice,
) -> Vec<(Tensor<B, 1>, f32, &'static str)> {
    let a = Tensor::<B, 1>::full([elements(4)], 2.0, device);
    let b = Tensor::<B, 1>::ones([elements(4)], device) * 3.0;
    let c = Tensor::<B, 1>::full([elements(4)], 4.0, device);
    // Materialised before the failing request, as tensors a model holds are.
    B::sync(device).expect("sync");
    vec![
        (a, 2.0, "a (full 2)"),
        (b, 3.0, "b (ones * 3)"),
        (c, 4.0, "c (full 4)"),
    ]
}

fn assert_all_hold<B: Backend>(live: &[(Tensor<B, 1>, f32, &'static str)]) {
    for (tensor, value, name) in live {
        assert_holds(tensor, *value, name);
    }
}

/// The failed tensor's read is the request's error (naming `expected`), and so is every later
/// use of it; `live` keep their values throughout; the next request on `device` works.
fn assert_failed<B: Backend<Device = WgpuDevice>>(
    device: &WgpuDevice,
    failed: Tensor<B, 1>,
    expected: &str,
    live: &[(Tensor<B, 1>, f32, &'static str)],
) {
    // What each use did to the live tensors is checked before what it returned.
    let first = failed.clone().try_into_data();
    assert_all_hold(live);
    let err = first.expect_err("the 64 MiB request fails");
    let message = format!("{err:?}");
    assert!(message.contains(expected), "{message}");

    // Every later use fails again, and touches no live tensor: an operation over it (which
    // Burn may run in place), and a second read.
    let used = (failed.clone() * 5.0).try_into_data();
    assert_all_hold(live);
    used.expect_err("an operation over a failed tensor fails");
    let again = failed.clone().try_into_data();
    assert_all_hold(live);
    let again = again.expect_err("a failed tensor has no values");
    assert!(format!("{again:?}").contains(expected), "{again:?}");
    drop(failed);

    let next = Tensor::<B, 1>::full([elements(4)], 6.0, device);
    assert_holds(&next, 6.0, "the next request");
    assert_all_hold(live);
    B::sync(device).expect("sync");
}

/// One scenario on backend `B`: `fail` makes the failing 64 MiB request, whose error names
/// `expected`.
fn scenario<B: Backend<Device = WgpuDevice>>(
    device: &WgpuDevice,
    throw: bool,
    expected: &str,
    fail: impl FnOnce(&WgpuDevice) -> Tensor<B, 1>,
) {
    backend::empty_cache(device);
    let _capped = Capped::new(device, throw);
    let live = live_tensors::<B>(device);
    let failed = fail(device);
    assert_failed(device, failed, expected, &live);
    drop(live);
    B::sync(device).expect("sync");
    backend::empty_cache(device);
}

fn full_64<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice) -> Tensor<B, 1> {
    Tensor::full([elements(64)], 7.0, device)
}

#[test]
fn an_out_of_memory_full_changes_no_live_tensor_unfused_and_fused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    scenario::<CachingWgpuUnfused>(&device, false, "out of memory", full_64);
    scenario::<CachingWgpu>(&device, false, "out of memory", full_64);
}

#[test]
fn a_full_rejected_by_throw_on_cudamalloc_oom_changes_no_live_tensor_unfused_and_fused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    let expected = "throw_on_cudamalloc_oom";
    scenario::<CachingWgpuUnfused>(&device, true, expected, full_64);
    scenario::<CachingWgpu>(&device, true, expected, full_64);
}

#[test]
fn a_failing_ones_times_nine_changes_no_live_tensor_unfused_and_fused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    fn ones_times_nine<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice) -> Tensor<B, 1> {
        Tensor::<B, 1>::ones([elements(64)], device) * 9.0
    }
    scenario::<CachingWgpuUnfused>(&device, false, "out of memory", ones_times_nine);
    scenario::<CachingWgpu>(&device, false, "out of memory", ones_times_nine);
}

#[test]
fn a_rejected_ones_changes_no_live_tensor_unfused_and_fused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    fn ones<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice) -> Tensor<B, 1> {
        Tensor::<B, 1>::ones([elements(64)], device)
    }
    let expected = "throw_on_cudamalloc_oom";
    scenario::<CachingWgpuUnfused>(&device, true, expected, ones);
    scenario::<CachingWgpu>(&device, true, expected, ones);
}

/// A private pool out of room: a tensor of the pool (6) lives beside a, b and c, and the
/// failing request is routed to the pool.
fn pool_scenario<B: Backend<Device = WgpuDevice>>(device: &WgpuDevice) {
    backend::empty_cache(device);
    let _capped = Capped::new(device, false);
    let mut live = live_tensors::<B>(device);
    let pool = MemPool::new(device, MemPoolOptions::default()).expect("pool");
    let failed = {
        let _inside = use_mem_pool(&pool);
        let pooled = Tensor::<B, 1>::full([elements(4)], 8.0, device);
        B::sync(device).expect("sync");
        live.push((pooled, 8.0, "d (full 8, in the pool)"));
        let failed = full_64::<B>(device);
        // The failing request is made inside the pool.
        B::sync(device).expect_err("the pool's 64 MiB request fails");
        failed
    };
    assert!(
        pool.memory_stats().allocated_bytes >= 4 * MIB,
        "the pool holds d: {:?}",
        pool.memory_stats()
    );
    assert_failed(device, failed, "out of memory", &live);
    drop(live);
    B::sync(device).expect("sync");
    drop(pool);
    backend::empty_cache(device);
}

#[test]
fn a_private_pool_out_of_room_changes_no_live_tensor_unfused_and_fused() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    pool_scenario::<CachingWgpuUnfused>(&device);
    pool_scenario::<CachingWgpu>(&device);
}

/// A tensor moved to a device that cannot hold it: the moved tensor is the destination's
/// error at every use, and the destination's live tensors keep their values.
fn to_device_scenario<B: Backend<Device = WgpuDevice>>(source: &WgpuDevice, dst: &WgpuDevice) {
    backend::empty_cache(source);
    backend::empty_cache(dst);
    let _capped = Capped::new(dst, false);
    let live = live_tensors::<B>(dst);
    let big = Tensor::<B, 1>::full([elements(64)], 7.0, source);
    let moved = big.clone().to_device(dst);
    assert_failed(dst, moved, "out of memory", &live);
    // The source is untouched, and a tensor that fits moves.
    assert_holds(&big.narrow(0, 0, 1024), 7.0, "the source");
    let small = Tensor::<B, 1>::from_data(TensorData::new(vec![1.5f32, -2.5], [2]), source);
    assert_eq!(
        small.to_device(dst).into_data().to_vec::<f32>().unwrap(),
        [1.5, -2.5]
    );
    drop(live);
    B::sync(source).expect("sync");
    B::sync(dst).expect("sync");
    backend::empty_cache(source);
    backend::empty_cache(dst);
}

#[test]
fn a_failed_to_device_changes_no_live_tensor_unfused_and_fused() {
    let Some((a, b, _turn)) = two_devices() else {
        return;
    };
    to_device_scenario::<CachingWgpuUnfused>(&a, &b);
    to_device_scenario::<CachingWgpu>(&a, &b);
}
