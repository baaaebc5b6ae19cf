//! "Leak or cache?" on the engine alone (`MemoryReport`, simulated device): each of the three
//! symptoms reproduced and told apart, with exact numbers.

use crate::common::MIB;
use caching_alloc_engine::alloc::{
    AllocatorConfig, CachingAllocator, HistoryOptions, MemoryPoint, MemoryReport, Verdict,
};
use caching_alloc_engine::device::{DeviceStream, sim::SimDevice};

fn allocator(config: &str) -> CachingAllocator<SimDevice> {
    let config = AllocatorConfig::parse(config).expect("valid config");
    CachingAllocator::new(SimDevice::new(64 << 30), config).unwrap()
}

fn point(alloc: &CachingAllocator<SimDevice>) -> MemoryPoint {
    MemoryPoint::of_engine(alloc.snapshot())
}

#[inline(never)]
fn keeps_activations(
    alloc: &CachingAllocator<SimDevice>,
    kept: &mut Vec<caching_alloc_engine::alloc::Allocation<u64>>,
) {
    for _ in 0..3 {
        kept.push(
            alloc
                .malloc(3 * MIB, DeviceStream::default())
                .expect("fits"),
        );
    }
    kept.push(alloc.malloc(1000, DeviceStream::default()).expect("fits"));
}

#[test]
fn growing_live_bytes_is_reported_as_held_tensors_with_sizes_and_stacks() {
    // PyTorch's segments, so that the 5 MiB block is split off a 20 MiB segment (under the
    // default its 6 MiB segment would be one 6 MiB block).
    let alloc = allocator("segment_sizing:pytorch");
    alloc.record_memory_history(HistoryOptions::default());
    let stream = DeviceStream::default();
    let steady = alloc.malloc(5 * MIB, stream).expect("fits");
    let before = point(&alloc);
    let mut kept = Vec::new();
    keeps_activations(&alloc, &mut kept);
    let report = MemoryReport::between(&before, &point(&alloc));

    assert_eq!(report.verdict(), Verdict::HeldTensors);
    assert_eq!(report.allocated, (5 * MIB, 5 * MIB + 9 * MIB + 1024));
    assert_eq!(report.held.len(), 2, "{:#?}", report.held);
    let big = &report.held[0];
    assert_eq!((big.requested, big.count, big.bytes), (3 * MIB, 3, 9 * MIB));
    assert!(
        big.frames
            .iter()
            .any(|f| f.name.ends_with("keeps_activations")),
        "{:#?}",
        big.frames
    );
    let small = &report.held[1];
    assert_eq!((small.requested, small.count, small.bytes), (1000, 1, 1024));
    let text = report.to_string();
    assert!(text.starts_with("LEAK?"), "{text}");
    assert!(
        text.contains("3 x 3.00 MiB requested (9.00 MiB in blocks)"),
        "{text}"
    );
    assert!(text.contains("keeps_activations"), "{text}");

    for a in kept {
        alloc.free(a).expect("live");
    }
    alloc.free(steady).expect("live");
}

#[test]
fn reserved_growing_while_live_bytes_are_flat_is_the_cache() {
    let alloc = allocator("");
    let stream = DeviceStream::default();
    let before = point(&alloc);
    // A step that allocates and frees: live bytes come back to 0, the segments stay cached.
    let a = alloc.malloc(30 * MIB, stream).expect("fits");
    let b = alloc.malloc(4 * MIB, stream).expect("fits");
    alloc.free(a).expect("live");
    alloc.free(b).expect("live");
    let report = MemoryReport::between(&before, &point(&alloc));

    assert_eq!(report.verdict(), Verdict::Cache);
    assert_eq!(report.allocated, (0, 0));
    // 30 MiB rounded to 2 MiB gets its own segment; 4 MiB takes one of 4 MiB (an eighth of
    // the 30 MiB the large pool holds, rounded up to 2 MiB: `segment_sizing:grow`).
    assert_eq!(report.reserved, (0, 34 * MIB));
    assert!(report.held.is_empty());
    let cache = &report.cache;
    assert_eq!(cache.cached_in_engine, 34 * MIB);
    assert_eq!(cache.largest_free_block, 30 * MIB);
    assert_eq!(cache.releasable, 34 * MIB, "both segments are empty");
    assert!((cache.fragmentation - (1.0 - 30.0 / 34.0)).abs() < 1e-9);
    let text = report.to_string();
    assert!(text.starts_with("CACHE"), "{text}");
    assert!(
        text.contains("empty_cache gives back at least 34.00 MiB"),
        "{text}"
    );

    alloc.empty_cache().expect("empties");
    let after = MemoryReport::between(&before, &point(&alloc));
    assert_eq!(after.verdict(), Verdict::Steady, "{after}");
}

/// cubecl issue 1614: one 6 x 512 x 50257 f32 tensor (617,564,160 B, 588.96 MiB). CubeCL 0.10's
/// default pools reserved 1,480 MiB for it; here the reservation is the request rounded up to
/// 2 MiB (PyTorch's `get_allocation_size`), and the report says no request is oversized.
#[test]
fn cubecl_1614_one_589_mib_tensor_reserves_the_request_rounded_to_2_mib() {
    let alloc = allocator("");
    let requested: u64 = 6 * 512 * 50257 * 4;
    let tensor = alloc
        .malloc(requested, DeviceStream::default())
        .expect("fits");
    let report = MemoryReport::at(&point(&alloc));
    assert_eq!(report.reserved.1, 590 * MIB);
    assert_eq!(report.reserved.1, requested.div_ceil(2 * MIB) * 2 * MIB);
    assert!(report.oversized.is_empty(), "{report}");
    assert_eq!(report.verdict(), Verdict::Steady);
    alloc.free(tensor).expect("live");
}

#[test]
fn a_request_reserving_much_more_than_it_asked_names_the_rule() {
    // Under PyTorch's segment rule a 1.5 MiB request takes a fresh 20 MiB segment (its
    // kLargeBuffer for large requests under 10 MiB); with 2 power-of-two divisions a 600 MiB
    // request becomes 768 MiB.
    let alloc = allocator("roundup_power2_divisions:2,segment_sizing:pytorch");
    let stream = DeviceStream::default();
    let mid = alloc.malloc(3 * MIB / 2, stream).expect("fits");
    let big = alloc.malloc(600 * MIB, stream).expect("fits");
    let report = MemoryReport::at(&point(&alloc));

    assert_eq!(report.verdict(), Verdict::Oversized);
    assert_eq!(report.reserved.1, 20 * MIB + 768 * MIB);
    assert_eq!(report.oversized.len(), 2, "{report}");
    let first = &report.oversized[0];
    assert_eq!(
        (first.requested, first.block, first.segment),
        (600 * MIB, 768 * MIB, 768 * MIB)
    );
    assert!(
        first.rules[0].starts_with("roundup_power2_divisions"),
        "{:?}",
        first.rules
    );
    let second = &report.oversized[1];
    assert_eq!(
        (second.requested, second.block, second.segment),
        (3 * MIB / 2, 3 * MIB / 2, 20 * MIB)
    );
    assert!(
        second.rules[0].contains("gets a 20.00 MiB segment"),
        "{:?}",
        second.rules
    );
    let text = report.to_string();
    assert!(text.starts_with("OVERSIZED"), "{text}");
    println!("{text}");

    alloc.free(mid).expect("live");
    alloc.free(big).expect("live");

    // The default rule (`segment_sizing:grow`) gives the first 1.5 MiB request a 2 MiB
    // segment: only the rounding is reported.
    let alloc = allocator("roundup_power2_divisions:2");
    let mid = alloc.malloc(3 * MIB / 2, stream).expect("fits");
    let big = alloc.malloc(600 * MIB, stream).expect("fits");
    let report = MemoryReport::at(&point(&alloc));
    assert_eq!(report.reserved.1, 2 * MIB + 768 * MIB);
    assert_eq!(report.oversized.len(), 1, "{report}");
    assert_eq!(report.oversized[0].requested, 600 * MIB);
    alloc.free(mid).expect("live");
    alloc.free(big).expect("live");
}
