//! Issue 20 point 6, the CUDA error paths that a real device can show: an out-of-memory while
//! mapping pages of an expandable segment is `DeviceError::OutOfMemory` (the engine's retry
//! path, not a hard error) with nothing left mapped, and one map of several pages is readable and writable
//! across all of them (access is set once over the run, as PyTorch's `setAccess` does).
//! Ignored without a GPU ("needs a CUDA device"); `scripts/gpu-check.sh` runs them
//! (`test-runtime`, `--include-ignored`). Each opens a `CudaMemory` of its own.

use crate::MIB;
use burn_caching_alloc::cuda::{CudaMemory, cuda_available};
use burn_caching_alloc::device::{DeviceError, DeviceMemory, DeviceStream};
use cudarc::driver::result;

fn device() -> Option<CudaMemory> {
    if let Err(reason) = cuda_available() {
        eprintln!("skipping: {reason}");
        return None;
    }
    let memory = CudaMemory::new(0).expect("CUDA is available, so device 0 opens");
    if memory.virtual_memory_granularity().is_none() {
        eprintln!("skipping: this device has no virtual memory management");
        return None;
    }
    Some(memory)
}

#[test]
#[ignore = "needs a CUDA device"]
fn mapping_more_than_the_device_holds_is_out_of_memory_and_maps_nothing() {
    // For the moment the device is full, no other test of this binary allocates on it (the
    // `cuda_memory` tests allocate a few MiB, and briefly).
    let Some(_turn) = crate::burn_mlp_cuda::cuda_turn() else {
        return;
    };
    let Some(mut memory) = device() else { return };
    let granularity = memory.virtual_memory_granularity().unwrap();
    // Large pages keep the number of `cuMemCreate` calls small on a large device.
    let page = (1024 * MIB).next_multiple_of(granularity);
    let total = memory.total_memory();
    let size = (total + page).next_multiple_of(page);
    let range = memory
        .reserve_range(size, DeviceStream(0))
        .expect("reserve");
    let free_before = memory.memory_info().expect("cuMemGetInfo").free;
    // SAFETY (this and the calls below): the range was reserved above and is released once;
    // each map covers unmapped pages, each unmap mapped ones, no work uses them.
    match unsafe { memory.map_range(&range, 0, size, page) } {
        Err(DeviceError::OutOfMemory { .. }) => {}
        other => panic!("mapping {size} bytes on a {total}-byte device: {other:?}"),
    }
    let free_after = memory.memory_info().expect("cuMemGetInfo").free;
    assert!(
        free_after + page >= free_before,
        "the pages mapped before the failure were given back ({free_before} -> {free_after})"
    );
    // The range is intact: one page maps, and goes back.
    unsafe { memory.map_range(&range, 0, page, page) }.expect("one page");
    unsafe { memory.unmap_range(&range, 0, page) }.expect("unmap");
    unsafe { memory.release_range(range) }.expect("release");
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_map_of_several_pages_is_readable_and_writable_across_them() {
    let Some(mut memory) = device() else { return };
    let page = memory.virtual_memory_granularity().unwrap();
    let range = memory
        .reserve_range(8 * page, DeviceStream(0))
        .expect("reserve");
    // SAFETY (this and the calls below): the range was reserved above and is released once;
    // the map covers unmapped pages, the unmap the same ones after the synchronous copies.
    unsafe { memory.map_range(&range, page, 3 * page, page) }.expect("map");
    let data: Vec<u8> = (0..3 * page).map(|i| (i % 253) as u8).collect();
    let mut back = vec![0u8; data.len()];
    // SAFETY: `[page, 4 * page)` of the range is mapped; the context is current after the map.
    unsafe {
        result::memcpy_htod_sync(range.handle + page, &data).expect("upload across pages");
        result::memcpy_dtoh_sync(&mut back, range.handle + page).expect("download");
    }
    assert!(
        back == data,
        "every page of the run is readable and writable"
    );
    unsafe { memory.unmap_range(&range, page, 3 * page) }.expect("unmap");
    unsafe { memory.release_range(range) }.expect("release");
}
