//! Expandable segments through CubeCL's client on fake device 1 (`expandable_segments:true`,
//! 2 MiB granularity): tensors land in mapped pages that the fake checks against the
//! granularity, map and access order, and unmaps of idle pages only; the range grows; after
//! the tensors are dropped `empty_cache` unmaps every page.

use burn::backend::cuda::CudaDevice;
use burn_caching_alloc::alloc::AllocatorConfig;
use burn_caching_alloc::backend;
use burn_caching_alloc::cuda::CachingCudaRuntime;
use cubecl_common::bytes::Bytes;
use cubecl_runtime::client::ComputeClient;
use cubecl_runtime::runtime::Runtime;

use crate::MIB;
use crate::fake_cuda::fake_or_skip;

#[test]
fn tensors_in_expandable_segments_read_back_and_empty_cache_unmaps_every_page() {
    let Some(driver) = fake_or_skip() else { return };
    if driver.fake().is_none() {
        // On a GPU device 0 is opened by other tests first; the engine-level test in `memory`
        // covers expandable segments there.
        crate::fake_cuda::fake_only("configures its own fake device 1 before its first use");
        return;
    }
    let device = CudaDevice::new(1);
    backend::configure(
        &device,
        AllocatorConfig::parse("expandable_segments:true").unwrap(),
    )
    .expect("device 1 is configured before its first use");
    let client: ComputeClient<CachingCudaRuntime> = CachingCudaRuntime::client(&device);
    let sizes = [
        3 * MIB as usize + 100,
        700 << 10,
        9 * MIB as usize,
        40 << 10,
        17 * MIB as usize,
    ];
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (0..*n)
                .map(|j| (j as u8).wrapping_add(i as u8 * 37))
                .collect()
        })
        .collect();
    let handles: Vec<_> = data
        .iter()
        .map(|d| client.create(Bytes::from_bytes_vec(d.clone())))
        .collect();
    let back = client.read(handles.clone());
    for (i, (got, want)) in back.iter().zip(&data).enumerate() {
        assert!(got.to_vec() == *want, "tensor {i} of {} bytes", want.len());
    }
    let stats = backend::memory_stats(&device);
    assert!(stats.engine.reserved_bytes.all.current > 0);
    if let Some(fake) = driver.fake() {
        let live = fake.live(1);
        assert_eq!(
            live.allocated, 0,
            "no cuMemAlloc segment: every block is in mapped pages"
        );
        assert_eq!(live.created, stats.engine.reserved_bytes.all.current);
        assert_eq!(live.created % (2 * MIB), 0);
    }
    drop(handles);
    drop(back);
    backend::empty_cache(&device);
    let stats = backend::memory_stats(&device);
    assert_eq!(stats.engine.allocated_bytes.all.current, 0, "nothing live");
    if let Some(fake) = driver.fake() {
        assert_eq!(
            fake.live(1).created,
            stats.engine.reserved_bytes.all.current
        );
        assert_eq!(fake.live(1).created, 0, "every page unmapped and released");
        fake.assert_no_violations();
    }
}
