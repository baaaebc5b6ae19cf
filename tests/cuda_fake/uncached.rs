//! `no_cuda_memory_caching` (PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING`, read by
//! `forceUncachedAllocator()`) through `CachingCudaRuntime` on fake device 6, configured in code
//! before its first use: every tensor is one `cuMemAlloc` of its own size, every free one
//! `cuMemFree` after its stream's work (the fake logs a free while queued work may still use
//! the memory), under every scheduler mode, with values exact and the statistics meaning what
//! they mean with caching.

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::alloc::AllocatorConfig;
use burn_caching_alloc::backend;
use burn_caching_alloc::cuda::CachingCudaRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

use crate::MIB;
use crate::fake_cuda::{SCHEDULES, fake_or_skip};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

#[test]
fn without_caching_every_tensor_is_one_cu_mem_alloc_and_every_free_one_cu_mem_free_after_its_work()
{
    let Some(driver) = fake_or_skip() else { return };
    let _real = driver.real_turn();
    let device = CudaDevice::new(driver.ordinal(6));
    let config = AllocatorConfig::parse("no_cuda_memory_caching:True").expect("parses");
    if let Err(err) = backend::configure(&device, config) {
        // The real driver's device 0 is shared by every test and may be open already.
        assert!(driver.fake().is_none(), "device 6 is this test's: {err}");
        println!("skipping on the real driver: {err}");
        return;
    }
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
    assert!(backend::allocator_settings(&device).no_cuda_memory_caching);
    assert!(
        !backend::allocator_settings(&device).expandable_segments,
        "not turned on by default without caching"
    );
    // Pageable, pinned-staged and large writes, one of the same size twice.
    let sizes = [4096usize, 100_000, 100_000, 3 * MIB as usize + 17];
    let rounded: u64 = sizes
        .iter()
        .map(|size| (*size as u64).next_multiple_of(512))
        .sum();
    for (round, mode) in SCHEDULES.into_iter().enumerate() {
        if let Some(fake) = driver.fake() {
            fake.set_schedule(mode, 40 + round as u64);
        }
        let before = backend::memory_stats(&device).engine;
        let data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, size)| pattern(*size, i as u8 ^ round as u8))
            .collect();
        let handles: Vec<_> = data
            .iter()
            .map(|d| client.create(Bytes::from_bytes_vec(d.clone())))
            .collect();
        let stats = backend::memory_stats(&device).engine;
        assert_eq!(
            stats.num_device_alloc - before.num_device_alloc,
            sizes.len() as u64,
            "{mode:?}: one device allocation per tensor"
        );
        assert_eq!(stats.segment.all.current, sizes.len() as u64, "{mode:?}");
        assert_eq!(stats.reserved_bytes.all.current, rounded, "{mode:?}");
        assert_eq!(stats.allocated_bytes.all.current, rounded, "{mode:?}");
        if let Some(fake) = driver.fake() {
            assert_eq!(
                fake.live(6).allocated,
                rounded,
                "{mode:?}: the fake holds exactly the tensors, each cuMemAlloc its own size"
            );
        }
        let back = client.read(handles.clone());
        for (i, (got, want)) in back.iter().zip(&data).enumerate() {
            assert!(got.to_vec() == *want, "{mode:?}: tensor {i}");
        }
        drop(handles);
        drop(back);
        let _ = cubecl_common::future::block_on(client.sync());
        // Reading the statistics hands the dropped tensors to the engine: freed, each
        // returned once its stream's work is done (`empty_cache` waits for the rest).
        let freed = backend::memory_stats(&device).engine;
        assert_eq!(freed.allocated_bytes.all.current, 0, "{mode:?}");
        backend::empty_cache(&device);
        let after = backend::memory_stats(&device).engine;
        assert_eq!(after.reserved_bytes.all.current, 0, "{mode:?}");
        assert_eq!(
            after.num_device_free - before.num_device_free,
            sizes.len() as u64,
            "{mode:?}: one cuMemFree per tensor"
        );
        assert_eq!(after.num_alloc_retries, 0);
        if let Some(fake) = driver.fake() {
            assert_eq!(fake.live(6).allocated, 0, "{mode:?}");
            fake.assert_no_violations();
        }
    }
}
