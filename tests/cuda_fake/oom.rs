//! Out of memory through CubeCL's client on fake device 2 (64 MiB): the allocator frees its
//! cache and retries, then fails with PyTorch's report (request, capacity, free, allocated,
//! reserved), and the device keeps working after.

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::alloc::{AllocError, AllocatorConfig, CachingAllocator};
use burn_caching_alloc::backend;
use burn_caching_alloc::cuda::CachingCudaRuntime;
use burn_caching_alloc::cuda::CudaMemory;
use burn_caching_alloc::device::DeviceStream;
use cubecl_common::bytes::Bytes;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

use crate::MIB;
use crate::fake_cuda::fake_or_skip;

#[test]
fn more_than_the_small_device_holds_is_the_allocators_out_of_memory_and_the_device_recovers() {
    let Some(driver) = fake_or_skip() else { return };
    if driver.fake().is_none() {
        crate::fake_cuda::fake_only("needs the fake's 64 MiB device 2");
        return;
    }
    let device = CudaDevice::new(2);
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
    let live = client.create(Bytes::from_bytes_vec(vec![1u8; 24 * MIB as usize]));
    let cached = client.create(Bytes::from_bytes_vec(vec![2u8; 20 * MIB as usize + 4096]));
    drop(cached);
    let before = backend::memory_stats(&device);
    // 48 MiB beside the live 24 MiB cannot fit in 64 MiB, even with the cache freed.
    let too_big = client.create(Bytes::from_bytes_vec(vec![3u8; 48 * MIB as usize]));
    let err = client.read_async(vec![too_big]);
    let err = cubecl_common::future::block_on(err).expect_err("48 MiB beside 24 MiB in 64 MiB");
    let message = format!("{err:?}");
    assert!(message.contains("out of memory"), "{message}");
    assert!(
        message.contains("64.00 MiB") || message.contains("64 MiB"),
        "{message}"
    );
    let stats = backend::memory_stats(&device);
    assert_eq!(stats.engine.num_ooms, before.engine.num_ooms + 1);
    assert!(
        stats.engine.num_alloc_retries > before.engine.num_alloc_retries,
        "retried after freeing the cache"
    );
    // The device still works.
    let after = client.create(Bytes::from_bytes_vec(vec![4u8; 8 * MIB as usize]));
    assert!(client.read(vec![after])[0].iter().all(|b| *b == 4));
    assert!(client.read(vec![live])[0].iter().all(|b| *b == 1));
    driver.fake().expect("checked").assert_no_violations();
}

#[test]
fn a_failed_map_under_the_engine_is_out_of_memory_and_maps_nothing() {
    let Some(driver) = fake_or_skip() else { return };
    let Some(fake) = driver.fake() else {
        crate::fake_cuda::fake_only("injects faults into the fake");
        return;
    };
    if !crate::child::in_child(
        "oom::a_failed_map_under_the_engine_is_out_of_memory_and_maps_nothing",
        &[],
    ) {
        return;
    }
    let memory = CudaMemory::new(5).expect("device 5");
    let alloc = CachingAllocator::new(
        memory,
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    )
    .unwrap();
    let a = alloc.malloc(4 * MIB, DeviceStream(0)).expect("4 MiB");
    // The third page of the next growth fails to map: nothing of that growth stays mapped.
    let created = fake.live(5).created;
    let maps = fake.calls("cuMemMap");
    fake.inject("cuMemMap", 3, true, 0);
    let err = alloc
        .malloc(64 * MIB, DeviceStream(0))
        .expect_err("mapping fails");
    assert!(
        fake.calls("cuMemMap") >= maps + 3,
        "the growth mapped pages"
    );
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err:?}");
    assert_eq!(
        fake.live(5).created,
        created,
        "the pages mapped before the failure were released"
    );
    fake.clear_faults();
    let b = alloc
        .malloc(64 * MIB, DeviceStream(0))
        .expect("64 MiB after the fault");
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(fake.live(5).created, 0);
    fake.assert_no_violations();
}
