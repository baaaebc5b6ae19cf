//! Launch metadata: grid-constant launches, the metadata scratch, tensor maps refused.

use cubecl_runtime::server::{ComputeServer, MetadataBindingInfo};

use super::super::super::driver::MetadataLayout;
use super::harness::{harness, ne_bytes, stream};

#[test]
fn grid_constant_launches_allocate_nothing_on_the_device_in_steady_state() {
    let mut h = harness(MetadataLayout::GridConstant, 4);
    let out = h.buffer(4096, stream(0));
    // Scalars and static metadata [10, 11], dynamic metadata (shapes, strides) after them.
    h.launch(
        &[&out],
        MetadataBindingInfo::new(vec![10, 11, 1, 2], 2),
        stream(0),
    );
    let after_first = h.meter.reading();
    for i in 0..100 {
        h.launch(
            &[&out],
            MetadataBindingInfo::new(vec![10, 11, i, i + 1, i + 2], 2),
            stream(0),
        );
    }
    assert_eq!(
        h.meter.reading(),
        after_first,
        "a launch must not allocate or free device memory once the scratch exists"
    );
    // `empty_cache` (CubeCL's memory cleanup) leaves nothing allocated, scratch included.
    drop(out);
    h.server.memory_cleanup(stream(0));
    assert_eq!(h.server.allocator().stats().allocated_bytes.all.current, 0);
    assert_eq!(h.server.allocator().memory_reserved(), 0);
    let seen = h.seen.lock();
    assert_eq!(seen.launches.len(), 101);
    // The driver gets the static part inline and this launch's dynamic part on the device.
    assert_eq!(seen.launches[0], (vec![10, 11], Some(ne_bytes(&[1, 2]))));
    assert_eq!(
        seen.launches[100],
        (vec![10, 11], Some(ne_bytes(&[99, 100, 101])))
    );
}

#[test]
fn a_launch_without_dynamic_metadata_uploads_nothing() {
    let mut h = harness(MetadataLayout::GridConstant, 4);
    let out = h.buffer(4096, stream(0));
    let before = h.meter.reading();
    h.launch(&[&out], MetadataBindingInfo::new(vec![3, 4], 2), stream(0));
    assert_eq!(h.meter.reading(), before);
    assert_eq!(h.seen.lock().launches[0], (vec![3, 4], None));
}

#[test]
fn the_metadata_scratch_grows_rarely_and_through_the_engine() {
    let mut h = harness(MetadataLayout::DeviceBuffer, 4);
    let out = h.buffer(4096, stream(0));
    let reserved_before = h.server.allocator().memory_reserved();
    // Growing sizes: 8 bytes .. 8 KiB of metadata.
    for len in 1..=1024u64 {
        let data: Vec<u64> = (0..len).collect();
        h.launch(&[&out], MetadataBindingInfo::new(data, 0), stream(0));
    }
    let seen = h.seen.lock();
    assert_eq!(
        seen.launches[1023].1,
        Some(ne_bytes(&(0..1024).collect::<Vec<_>>()))
    );
    // The whole info goes through the device buffer in this layout.
    assert!(seen.launches.iter().all(|(inline, _)| inline.is_empty()));
    drop(seen);
    // The scratch is an engine block: what the engine reserved grew, the device saw few
    // allocations (the engine caches; the scratch grows in powers of two).
    assert!(h.server.allocator().memory_reserved() >= reserved_before);
    assert!(
        h.meter.allocs() <= 3,
        "1024 launches of growing metadata allocated {} device segments",
        h.meter.allocs()
    );
}

#[test]
fn tensor_maps_are_refused_with_a_launch_error() {
    // A launch that carries tensor maps is checked first in `launch_one`; building a real
    // `TensorMapMeta` needs a TMA-capable planner, so the check itself is what is tested here.
    let err = super::checks::no_tensor_maps(1).expect_err("refused");
    assert!(err.to_string().contains("tensor map"), "{err}");
    assert!(super::checks::no_tensor_maps(0).is_ok());
}
