//! Out of memory on `CachingWgpu` (lavapipe in CI): with the device made small by
//! `set_per_process_memory_fraction`, a tensor that cannot fit reaches Burn as an error naming
//! the allocator's numbers, after the server handed every free slice back and the engine freed
//! its cache; the server then keeps computing correctly.

use crate::MIB;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Tensor, TensorData};
use burn_caching_alloc::alloc::format_bytes;
use burn_caching_alloc::backend::{self, CachingWgpu};

use crate::support::lavapipe::cpu_device;

type B = CachingWgpu;

/// Gives the whole device back when the test ends, passed or failed: the next test on the
/// shared CPU device must not find it capped.
struct Uncap<'a>(&'a WgpuDevice);

impl Drop for Uncap<'_> {
    fn drop(&mut self) {
        let _ = backend::set_per_process_memory_fraction(self.0, 1.0);
    }
}

#[test]
fn out_of_memory_reaches_burn_with_the_allocators_numbers_and_the_server_recovers() {
    let Some((device, _turn)) = cpu_device() else {
        return;
    };
    // The device may have run other tests of this binary: start from an empty cache, as a
    // fresh device would, and count out-of-memory events from here.
    backend::empty_cache(&device);
    let before = backend::memory_stats(&device);
    let total = before.device.total;
    assert!(total > 64 * MIB, "device total {total}");
    // Make the device a 64 MiB device.
    let limit = 64 * MIB;
    let _uncap = Uncap(&device);
    backend::set_per_process_memory_fraction(&device, limit as f64 / total as f64)
        .expect("valid fraction");

    // 24 MiB live, then 24 MiB freed into CubeCL's cache (a size never asked again).
    let live = Tensor::<B, 1>::ones([6 * MIB as usize], &device);
    let freed = Tensor::<B, 1>::ones([6 * MIB as usize + 256], &device);
    assert_eq!(
        freed.into_data().to_vec::<f32>().expect("f32")[0],
        1.0,
        "the freed tensor was real"
    );

    // Before the failing request: the freed tensor's slice is cached in CubeCL (reading the
    // stats leaves it there), and the engine reserves both tensors' segments.
    let ready = backend::memory_stats(&device);
    assert!(
        ready.cached_in_cubecl() >= 24 * MIB,
        "the freed tensor's slice is cached in CubeCL: {:?}",
        ready.cubecl
    );
    assert!(
        ready.memory_reserved() >= 48 * MIB,
        "{}",
        ready.memory_reserved()
    );

    // 48 MiB cannot fit beside the live 24 MiB under a 64 MiB cap.
    let too_big = Tensor::<B, 1>::ones([12 * MIB as usize], &device);
    let err = too_big
        .try_into_data()
        .expect_err("a 48 MiB tensor beside 24 MiB live cannot fit in 64 MiB");
    let message = format!("{err:?}");
    println!("error reaching Burn: {message}");
    assert!(message.contains("out of memory"), "{message}");
    assert!(message.contains(&format_bytes(48 * MIB)), "{message}");
    assert!(message.contains(&format_bytes(limit)), "{message}");

    let stats = backend::memory_stats(&device);
    // One failed tensor is one out-of-memory (PyTorch's count), although the request went
    // through CubeCL's reclaim of every stream and the engine's flush and retry.
    assert_eq!(
        stats.engine.num_ooms,
        before.engine.num_ooms + 1,
        "{} out-of-memory events before, {} after",
        before.engine.num_ooms,
        stats.engine.num_ooms
    );
    assert!(
        stats.cubecl.reclaim.reclaims > before.cubecl.reclaim.reclaims,
        "the server reclaimed before failing: {:?}",
        stats.cubecl.reclaim
    );
    // CubeCL's free slices are back in the engine...
    assert!(
        stats.cached_in_cubecl() < 24 * MIB,
        "CubeCL still caches the freed slice: {:?}",
        stats.cubecl
    );
    // ...and the engine freed its cache and retried before failing: the freed tensor's
    // segment went back to the device, and only what live tensors hold stays reserved.
    assert!(
        stats.engine.num_alloc_retries > ready.engine.num_alloc_retries,
        "no retry after freeing the cache"
    );
    assert!(
        stats.engine.num_device_free > ready.engine.num_device_free,
        "no segment went back to the device"
    );
    assert!(
        stats.memory_reserved() + 24 * MIB <= ready.memory_reserved(),
        "reserved {} after the failure, {} before: the freed tensor's 24 MiB stayed",
        stats.memory_reserved(),
        ready.memory_reserved()
    );

    // The server keeps working: new tensors compute correctly.
    let a = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0], [3]), &device);
    let head = live.clone().narrow(0, 0, 3);
    let sum = (a + head).sum();
    assert_eq!(sum.into_data().to_vec::<f32>().expect("f32"), vec![9.0]);

    backend::set_per_process_memory_fraction(&device, 1.0).expect("valid fraction");
    drop(live);
    backend::empty_cache(&device);
    assert_eq!(backend::memory_stats(&device).memory_reserved(), 0);
}
