//! Expandable segments (`expandable_segments:True`), with PyTorch's numbers: 20 MiB pages in
//! the large pool, 2 MiB in the small one, one range of 9/8 of the device per stream and pool
//! (`find_expandable_block`, `map_block`, `unmap_block`, `get_free_block`'s
//! `expandable_size`, `release_blocks` in `CUDACachingAllocator.cpp`).

use caching_alloc_engine::alloc::TraceEvent;

use crate::common::*;

const ES: &str = "expandable_segments:True,record_history:true";

fn maps_and_unmaps(alloc: &caching_alloc_engine::alloc::CachingAllocator<SimDev>) -> Vec<String> {
    alloc
        .trace()
        .events
        .iter()
        .filter_map(|e| match e {
            TraceEvent::SegmentMap { size, .. } => Some(format!("map {}", size / MIB)),
            TraceEvent::SegmentUnmap { size, .. } => Some(format!("unmap {}", size / MIB)),
            TraceEvent::SegmentAlloc { .. } | TraceEvent::SegmentFree { .. } => {
                Some("segment".into())
            }
            _ => None,
        })
        .collect()
}

type SimDev = caching_alloc_engine::device::sim::SimDevice;

/// Map, grow into the free tail, best fit away from the tail, and release.
#[test]
fn the_range_grows_by_pages_and_the_free_tail_joins_the_new_pages() {
    let (alloc, device) = allocator(1024 * MIB, ES);
    let a = alloc.malloc(30 * MIB, S0).unwrap();
    // One range of 9/8 of the device (1152 MiB, rounded to 20 MiB pages: 1160 MiB); two
    // pages mapped, the 10 MiB past the request split off (remainders >= 512 B split).
    let base = a.address();
    assert_eq!(device.reserved_ranges(), vec![(base, 1160 * MIB)]);
    assert_eq!(layout(&alloc), vec![vec![(30 * MIB, A), (10 * MIB, F)]]);
    let s = alloc.stats();
    assert_eq!(s.memory_reserved(), 40 * MIB);
    assert_eq!((s.num_device_alloc, s.segment.all.current), (1, 0));
    assert_eq!(
        s.inactive_split.all.current, 0,
        "expandable blocks are left out"
    );
    check_invariants(&alloc, &device);

    // 25 MiB: the free 10 MiB tail and one new page make one 30 MiB block.
    let b = alloc.malloc(25 * MIB, S0).unwrap();
    assert_eq!(b.address(), base + 30 * MIB);
    assert_eq!(
        layout(&alloc),
        vec![vec![(30 * MIB, A), (25 * MIB, A), (5 * MIB, F)]]
    );
    assert_eq!(alloc.stats().memory_reserved(), 60 * MIB);
    assert_eq!(
        device.mapped_runs(),
        vec![(base, 40 * MIB), (base + 40 * MIB, 20 * MIB)]
    );
    check_invariants(&alloc, &device);

    // 4 MiB: best fit by size is the 5 MiB tail, but it could grow into the unmapped range;
    // the freed 30 MiB block, which cannot, is taken instead.
    alloc.free(a).unwrap();
    let c = alloc.malloc(4 * MIB, S0).unwrap();
    assert_eq!(c.address(), base);
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (4 * MIB, A),
            (26 * MIB, F),
            (25 * MIB, A),
            (5 * MIB, F)
        ]]
    );
    // No whole page is free: nothing to unmap.
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 60 * MIB);
    check_invariants(&alloc, &device);

    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!(s.memory_reserved(), 0);
    assert_eq!((s.num_device_alloc, s.num_device_free), (2, 1));
    assert!(
        device.reserved_ranges().is_empty(),
        "the empty range is given back"
    );
    assert!(alloc.snapshot().segments.is_empty());
    assert_eq!(maps_and_unmaps(&alloc), ["map 40", "map 20", "unmap 60"]);
}

/// `try_allocate_expandable_block` maps what the candidate still lacks with one `map_block`
/// of the remainder: a free 40 MiB block grown to 100 MiB maps 60 MiB (three pages) in one
/// mapping, one `segment_map` and one device allocation, not a page per call.
#[test]
fn a_free_block_grows_by_one_mapping_of_what_it_lacks() {
    let (alloc, device) = allocator(1024 * MIB, ES);
    let a = alloc.malloc(30 * MIB, S0).unwrap();
    let base = a.address();
    alloc.free(a).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(40 * MIB, F)]]);
    let b = alloc.malloc(100 * MIB, S0).unwrap();
    assert_eq!(b.address(), base);
    assert_eq!(layout(&alloc), vec![vec![(100 * MIB, A)]]);
    assert_eq!(maps_and_unmaps(&alloc), ["map 40", "map 60"]);
    assert_eq!(alloc.stats().num_device_alloc, 2);
    alloc.free(b).unwrap();
    // `empty_cache` says what it gave back: the five unmapped pages.
    assert_eq!(alloc.empty_cache().unwrap(), 100 * MIB);
    check_invariants(&alloc, &device);
}

/// `should_split` with expandable segments splits every large block whose remainder is at
/// least 512 bytes (`kMinBlockSize`), where ordinary large blocks keep remainders up to 1 MiB
/// (`kSmallSize`): 19.5 MiB in a 20 MiB page leaves a free 0.5 MiB block.
#[test]
fn expandable_large_blocks_split_off_remainders_under_1_mib() {
    let (alloc, device) = allocator(1024 * MIB, ES);
    let a = alloc.malloc(19 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(19 * MIB + MIB / 2, A), (MIB / 2, F)]]
    );
    alloc.free(a).unwrap();
    check_invariants(&alloc, &device);
}

/// `get_free_block` moves past the best fit only to a block that could grow to strictly less
/// (`expandable_size(*next) < expandable_size(*it)`): of two free 10 MiB blocks with no
/// unmapped space after them, the lower address (best fit's order) is taken.
#[test]
fn of_two_equal_expandable_blocks_the_lower_address_is_taken() {
    let (alloc, device) = allocator(1024 * MIB, ES);
    let a = alloc.malloc(10 * MIB, S0).unwrap();
    let k1 = alloc.malloc(10 * MIB, S0).unwrap();
    let b = alloc.malloc(10 * MIB, S0).unwrap();
    let k2 = alloc.malloc(10 * MIB, S0).unwrap();
    let a_at = a.address();
    alloc.free(b).unwrap();
    alloc.free(a).unwrap();
    let c = alloc.malloc(10 * MIB, S0).unwrap();
    assert_eq!(c.address(), a_at);
    for x in [c, k1, k2] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// `release_blocks` / `unmap_block`: only whole pages inside free blocks go back; partial
/// pages stay mapped as free blocks; the next miss maps the lowest hole first.
#[test]
fn release_unmaps_whole_free_pages_and_a_miss_fills_the_lowest_hole() {
    let (alloc, device) = allocator(1024 * MIB, ES);
    let x = alloc.malloc(30 * MIB, S0).unwrap(); // maps [0, 40)
    let y = alloc.malloc(15 * MIB, S0).unwrap(); // maps [40, 60)
    let z = alloc.malloc(18 * MIB, S0).unwrap(); // maps [60, 80)
    let base = x.address();
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (30 * MIB, A),
            (15 * MIB, A),
            (18 * MIB, A),
            (17 * MIB, F)
        ]]
    );
    alloc.free(x).unwrap();
    alloc.free(z).unwrap();
    alloc.empty_cache().unwrap();
    // [0, 20) and [60, 80) were whole free pages; [20, 30) and [45, 60) stay.
    let snapshot = alloc.snapshot();
    assert_eq!(snapshot.segments.len(), 1);
    assert_eq!(snapshot.segments[0].address, base + 20 * MIB);
    assert!(snapshot.segments[0].is_expandable);
    assert_eq!(
        layout(&alloc),
        vec![vec![(10 * MIB, F), (15 * MIB, A), (15 * MIB, F)]]
    );
    let s = alloc.stats();
    assert_eq!(s.memory_reserved(), 40 * MIB);
    assert_eq!(s.num_device_free, 2);
    check_invariants(&alloc, &device);

    // 25 MiB fits no free block; the lowest hole [0, 20) and the free [20, 30) make room.
    let w = alloc.malloc(25 * MIB, S0).unwrap();
    assert_eq!(w.address(), base);
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (25 * MIB, A),
            (5 * MIB, F),
            (15 * MIB, A),
            (15 * MIB, F)
        ]]
    );
    assert_eq!(alloc.stats().memory_reserved(), 60 * MIB);
    check_invariants(&alloc, &device);
    alloc.free(w).unwrap();
    alloc.free(y).unwrap();
    alloc.empty_cache().unwrap();
    assert!(device.reserved_ranges().is_empty());
    assert_eq!(device.bytes_in_use(), 0);
}

/// Small requests map 2 MiB pages of their own range.
#[test]
fn the_small_pool_maps_2_mib_pages() {
    let (alloc, device) = allocator(1024 * MIB, ES);
    let a = alloc.malloc(4096, S0).unwrap();
    let b = alloc.malloc(3 * MIB, S0).unwrap();
    assert_eq!(device.reserved_ranges().len(), 2, "one range per pool");
    assert_eq!(
        layout(&alloc),
        vec![
            vec![(4096, A), (2 * MIB - 4096, F)],
            vec![(3 * MIB, A), (17 * MIB, F)]
        ]
    );
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// The last retry before an out-of-memory unmaps the free pages of other streams' ranges.
#[test]
fn a_failed_map_unmaps_cached_pages_and_retries() {
    let (alloc, device) = allocator(100 * MIB, ES);
    let a = alloc.malloc(60 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    let b = alloc.malloc(50 * MIB, S1).unwrap(); // 60 MiB of pages: only after the unmap
    let s = alloc.stats();
    assert_eq!(
        (s.num_alloc_retries, s.num_device_free, s.memory_reserved()),
        (1, 1, 60 * MIB)
    );
    assert_eq!(device.counters().failed_allocs, 1);
    assert_eq!(maps_and_unmaps(&alloc), ["map 60", "unmap 60", "map 60"]);
    check_invariants(&alloc, &device);
    alloc.free(b).unwrap();
    // An injected map failure takes the same path.
    device.fail_nth_allocation(1);
    let c = alloc.malloc(90 * MIB, S1).unwrap();
    assert_eq!(alloc.stats().num_alloc_retries, 2);
    alloc.free(c).unwrap();
    check_invariants(&alloc, &device);
}

/// Garbage collection never unmaps (pytorch/pytorch PR 134338), and with `max_split_size`
/// a small request still takes a large free expandable block instead of mapping more
/// (the unbounded growth of pytorch/pytorch#123548).
#[test]
fn garbage_collection_and_max_split_size_leave_expandable_pages_alone() {
    let (alloc, device) = allocator(
        1000 * MIB,
        "expandable_segments:True,garbage_collection_threshold:0.1,\
         per_process_memory_fraction:0.5,max_split_size_mb:20",
    );
    let a = alloc.malloc(100 * MIB, S0).unwrap();
    let keep = alloc.malloc(30 * MIB, S0).unwrap();
    let a_at = a.address();
    alloc.free(a).unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 140 * MIB);
    // A miss far over the 50 MiB threshold: no collection of expandable pages.
    let b = alloc.malloc(300 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().num_device_free, 0);
    // A 10 MiB request takes the free 100 MiB block (>= max_split_size) and splits it.
    let c = alloc.malloc(10 * MIB, S0).unwrap();
    assert_eq!(c.address(), a_at);
    let reserved = alloc.stats().memory_reserved();
    assert_eq!(reserved, 440 * MIB, "no page mapped for it");
    for x in [b, c, keep] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// The memory fraction caps expandable segments as ordinary ones, inclusively (PyTorch's
/// `alloc_block` checks `alloc_size` against `allowed_memory_maximum` before it maps):
/// fraction 0.5 of 1000 MiB allows 500 MiB; 400 + 100 MiB of pages reach it exactly and are
/// mapped, one more page is out of memory.
#[test]
fn the_memory_fraction_admits_pages_up_to_exactly_its_limit() {
    use caching_alloc_engine::alloc::AllocError;

    let (alloc, device) = allocator(
        1000 * MIB,
        "expandable_segments:True,per_process_memory_fraction:0.5",
    );
    let a = alloc.malloc(400 * MIB, S0).unwrap();
    let b = alloc.malloc(100 * MIB, S0).unwrap();
    assert_eq!(alloc.stats().memory_reserved(), 500 * MIB);
    assert!(matches!(
        alloc.malloc(20 * MIB, S0),
        Err(AllocError::OutOfMemory { limit: Some(limit), .. }) if limit == 500 * MIB
    ));
    assert_eq!(alloc.stats().memory_reserved(), 500 * MIB);
    for x in [a, b] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// Issue 20 point 6: a `cuMemUnmap` failing half-way (the simulated device unmaps the first
/// page of the three, then fails) used to leave the whole block listed as mapped over pages
/// that were gone. The block is split where the unmap stopped: the first page is unmapped
/// address space, the other two a free mapped block, and the next release unmaps them.
#[test]
fn an_unmap_failing_half_way_splits_the_block_where_it_stopped() {
    use caching_alloc_engine::alloc::AllocError;
    use caching_alloc_engine::device::DeviceError;
    use caching_alloc_engine::device::sim::SimCall;

    let (alloc, device) = allocator(1024 * MIB, ES);
    let a = alloc.malloc(60 * MIB, S0).unwrap();
    let base = a.address();
    alloc.free(a).unwrap();
    assert_eq!(device.mapped_runs(), vec![(base, 60 * MIB)]);
    device.fail_next(SimCall::Unmap);
    match alloc.empty_cache() {
        Err(AllocError::Device(DeviceError::PartialUnmap { unmapped, .. })) => {
            assert_eq!(unmapped, 20 * MIB)
        }
        other => panic!("expected a partial unmap, got {other:?}"),
    }
    assert_eq!(device.mapped_runs(), vec![(base + 20 * MIB, 40 * MIB)]);
    assert_eq!(alloc.stats().reserved_bytes.all.current, 40 * MIB);
    check_invariants(&alloc, &device);
    // What stays mapped serves a request again, and the next release unmaps it all.
    let b = alloc.malloc(40 * MIB, S0).unwrap();
    assert_eq!(b.address(), base + 20 * MIB);
    alloc.free(b).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(device.mapped_runs(), vec![]);
    assert_eq!(device.bytes_in_use(), 0);
    check_invariants(&alloc, &device);
}

/// A partial unmap the device cannot have done (no bytes, more than the range asked for, or
/// not whole pages) is the device's error, passed on as it is: the engine trusts no such
/// report, splits nothing and keeps the block mapped and cached.
#[test]
fn an_impossible_partial_unmap_is_an_error_and_splits_nothing() {
    use caching_alloc_engine::alloc::AllocError;
    use caching_alloc_engine::device::DeviceError;
    use caching_alloc_engine::device::sim::SimCall;

    // The freed block starts one page into the range, so "more than asked for" (80 MiB of a
    // 60 MiB unmap) is not hidden by counting from the range's start.
    for unmapped in [0, MIB, 80 * MIB] {
        let (alloc, device) = allocator(1024 * MIB, ES);
        let keep = alloc.malloc(20 * MIB, S0).unwrap();
        let a = alloc.malloc(60 * MIB, S0).unwrap();
        alloc.free(a).unwrap();
        device.fail_next(SimCall::Unmap);
        device.misreport_partial_unmap(unmapped);
        match alloc.empty_cache() {
            Err(AllocError::Device(DeviceError::PartialUnmap { unmapped: got, .. })) => {
                assert_eq!(got, unmapped)
            }
            other => panic!("expected the device's error, got {other:?}"),
        }
        assert_eq!(
            layout(&alloc),
            vec![vec![(20 * MIB, A), (60 * MIB, F)]],
            "{unmapped}"
        );
        assert_eq!(alloc.stats().memory_reserved(), 80 * MIB, "{unmapped}");
        assert!(
            !maps_and_unmaps(&alloc)
                .iter()
                .any(|e| e.starts_with("unmap"))
        );
        alloc.free(keep).unwrap();
    }
}

/// `get_free_block` takes the next block that fits when it could grow into less unmapped
/// space: its `expandable_size` is its size *plus* the unmapped block after it. With a free
/// 5 MiB block before the range's last 20 MiB of unmapped space (25 MiB in all) and a free
/// 30 MiB block with none, a 4 MiB request stays in the 5 MiB block: 30 is not below 25.
#[test]
fn a_block_near_the_end_of_the_range_counts_its_size_plus_the_unmapped_tail() {
    // 100 MiB device: a range of 9/8 of it in 20 MiB pages, 120 MiB.
    let (alloc, device) = allocator(100 * MIB, ES);
    let a = alloc.malloc(30 * MIB, S0).unwrap();
    let base = a.address();
    let b = alloc.malloc(25 * MIB, S0).unwrap();
    let c = alloc.malloc(40 * MIB, S0).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (30 * MIB, F),
            (25 * MIB, A),
            (40 * MIB, A),
            (5 * MIB, F)
        ]]
    );
    assert_eq!(device.reserved_ranges(), vec![(base, 120 * MIB)]);
    let d = alloc.malloc(4 * MIB, S0).unwrap();
    assert_eq!(d.address(), base + 95 * MIB);
    for x in [b, c, d] {
        alloc.free(x).unwrap();
    }
    check_invariants(&alloc, &device);
}

/// A device without virtual memory cannot serve expandable segments: the engine refuses the
/// configuration with `ConfigError::Unsupported` naming the key (one policy for a missing
/// capability, issue 19), instead of serving ordinary segments under a key that says
/// otherwise. The same device serves the configuration without the key.
#[test]
fn expandable_segments_are_refused_on_a_device_without_virtual_memory() {
    use caching_alloc_engine::alloc::{AllocatorConfig, CachingAllocator, ConfigError};
    use caching_alloc_engine::device::sim::SimDevice;

    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let err = CachingAllocator::new(
        SimDevice::new(1 << 30).without_virtual_memory(),
        expandable.clone(),
    )
    .err()
    .expect("refused");
    assert!(
        matches!(&err, ConfigError::Unsupported { key, .. } if key == "expandable_segments"),
        "{err:?}"
    );
    assert!(CachingAllocator::new(SimDevice::new(1 << 30), expandable).is_ok());
    assert!(
        CachingAllocator::new(
            SimDevice::new(1 << 30).without_virtual_memory(),
            AllocatorConfig::default()
        )
        .is_ok()
    );
}
