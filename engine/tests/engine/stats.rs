//! Statistics after every step of a scripted scenario, PyTorch's keys, and resets.

use crate::common::*;
use caching_alloc_engine::alloc::Stat;

fn stat(current: u64, peak: u64, allocated: u64, freed: u64) -> Stat {
    Stat {
        current,
        peak,
        allocated,
        freed,
    }
}

#[test]
fn statistics_follow_a_scripted_scenario_step_by_step() {
    let (alloc, device) = allocator(1024 * MIB, "");

    // 1. A small request: one 2 MiB segment, split.
    let a = alloc.malloc(1000, S0).unwrap();
    let s = alloc.stats();
    assert_eq!(s.allocation.all, stat(1, 1, 1, 0));
    assert_eq!(s.allocated_bytes.small_pool, stat(1024, 1024, 1024, 0));
    assert_eq!(s.allocated_bytes.large_pool, stat(0, 0, 0, 0));
    assert_eq!(s.requested_bytes.all, stat(1000, 1000, 1000, 0));
    assert_eq!(s.reserved_bytes.all, stat(2 * MIB, 2 * MIB, 2 * MIB, 0));
    assert_eq!(s.segment.small_pool, stat(1, 1, 1, 0));
    assert_eq!(s.inactive_split.small_pool.current, 1);
    assert_eq!(s.inactive_split_bytes.small_pool.current, 2 * MIB - 1024);
    assert_eq!(s.active_bytes.all.current, 1024);
    assert_eq!((s.num_device_alloc, s.num_device_free), (1, 0));
    check_invariants(&alloc, &device);

    // 2. A large request: a 20 MiB segment, split into 3 MiB + 17 MiB.
    let b = alloc.malloc(3 * MIB, S0).unwrap();
    let s = alloc.stats();
    assert_eq!(
        s.allocated_bytes.all,
        stat(3 * MIB + 1024, 3 * MIB + 1024, 3 * MIB + 1024, 0)
    );
    assert_eq!(
        s.reserved_bytes.large_pool,
        stat(20 * MIB, 20 * MIB, 20 * MIB, 0)
    );
    assert_eq!(s.inactive_split.all.current, 2);
    assert_eq!(s.inactive_split_bytes.large_pool.current, 17 * MIB);
    check_invariants(&alloc, &device);

    // 3. Free the large block: it merges back, its segment is whole and free again.
    alloc.free(b).unwrap();
    let s = alloc.stats();
    assert_eq!(
        s.allocated_bytes.all,
        stat(1024, 3 * MIB + 1024, 3 * MIB + 1024, 3 * MIB)
    );
    assert_eq!(
        s.allocated_bytes.large_pool,
        stat(0, 3 * MIB, 3 * MIB, 3 * MIB)
    );
    assert_eq!(
        s.inactive_split.large_pool.current, 0,
        "the segment is no longer split"
    );
    assert_eq!(s.inactive_split_bytes.large_pool.current, 0);
    assert_eq!(
        s.reserved_bytes.all.current,
        22 * MIB,
        "freeing keeps the segment cached"
    );
    assert_eq!(s.cached_in_engine(), 22 * MIB - 1024);
    check_invariants(&alloc, &device);

    // 4. Reset peaks: every peak drops to its current value.
    alloc.reset_peak_memory_stats();
    let s = alloc.stats();
    assert_eq!(s.max_memory_allocated(), 1024);
    assert_eq!(s.max_memory_reserved(), 22 * MIB);

    // 5. empty_cache returns the free large segment, keeps the small one holding `a`.
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!(
        s.reserved_bytes.all,
        stat(2 * MIB, 22 * MIB, 22 * MIB, 20 * MIB)
    );
    assert_eq!(s.segment.large_pool, stat(0, 1, 1, 1));
    assert_eq!((s.num_device_alloc, s.num_device_free), (2, 1));
    check_invariants(&alloc, &device);

    // 6. Free the last block; reset the accumulated counters.
    alloc.free(a).unwrap();
    alloc.reset_accumulated_memory_stats();
    let s = alloc.stats();
    assert_eq!(s.allocation.all, stat(0, 1, 0, 0));
    assert_eq!(s.allocated_bytes.all, stat(0, 1024, 0, 0));
    assert_eq!((s.num_device_alloc, s.num_device_free), (0, 0));
    assert_eq!(s.memory_reserved(), 2 * MIB);
    let baseline = Baseline::now(&alloc, &device);
    check_invariants_since(&alloc, &device, &baseline);
    // Counted from the reset: the segment's release is one device free, a change of -1.
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!((s.num_device_alloc, s.num_device_free), (0, 1));
    assert_eq!((s.segment.all.current, s.segment.all.freed), (0, 1));
    check_invariants_since(&alloc, &device, &baseline);
}

#[test]
fn to_map_uses_pytorch_keys() {
    let (alloc, _device) = allocator(1024 * MIB, "max_split_size_mb:64");
    let a = alloc.malloc(3 * MIB, S0).unwrap();
    let map = alloc.stats().to_map();
    let mib = MIB as i64;
    assert_eq!(map["allocated_bytes.all.current"], 3 * mib);
    assert_eq!(map["allocated_bytes.large_pool.peak"], 3 * mib);
    assert_eq!(map["allocated_bytes.small_pool.current"], 0);
    assert_eq!(map["reserved_bytes.large_pool.current"], 20 * mib);
    assert_eq!(map["segment.all.allocated"], 1);
    assert_eq!(map["requested_bytes.all.current"], 3 * mib);
    assert_eq!(map["num_device_alloc"], 1);
    assert_eq!(map["num_ooms"], 0);
    assert_eq!(map["max_split_size"], 64 * mib);
    for name in [
        "allocation",
        "segment",
        "active",
        "inactive_split",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ] {
        for pool in ["all", "small_pool", "large_pool"] {
            for field in ["current", "peak", "allocated", "freed"] {
                let key = format!("{name}.{pool}.{field}");
                assert!(map.contains_key(&key), "missing {key}");
            }
        }
    }
    // PyTorch's counters (with 2.12's `num_oom_rejections`) and `max_split_size`, and two of
    // ours: `num_pool_borrows`, `num_stream_shares` and `num_stream_lends`.
    assert_eq!(map["num_pool_borrows"], 0);
    assert_eq!(map["num_stream_shares"], 0);
    assert_eq!(map["num_stream_lends"], 0);
    assert_eq!(map["num_oom_rejections"], 0);
    // And the free memory's shape per pool (`free_space`): 17 MiB free in the large segment.
    assert_eq!(map["free_bytes.large_pool"], 17 * mib);
    assert_eq!(map["largest_free_block.all"], 17 * mib);
    assert_eq!(map.len(), 9 * 3 * 4 + 2 * 4 + 10 + 2 * 3);
    alloc.free(a).unwrap();
}

#[test]
fn the_summary_table_shows_the_numbers() {
    let (alloc, _device) = allocator(1024 * MIB, "");
    let _a = alloc.malloc(3 * MIB, S0).unwrap();
    let summary = alloc.summary();
    assert!(summary.contains("Allocated memory"), "{summary}");
    assert!(summary.contains("3.00 MiB"), "{summary}");
    assert!(summary.contains("20.00 MiB"), "{summary}");
    assert!(summary.contains("Device allocations: 1"), "{summary}");
    assert!(
        summary.lines().all(|l| l.chars().count() == 84),
        "{summary}"
    );
}

/// The free memory's shape (`free_space`, RMM's and XLA's fragmentation: 1 - largest free
/// block / free bytes, per pool) follows the blocks through a split, a free that leaves a hole,
/// and the free that coalesces it, and is in `to_map` and the summary.
#[test]
fn free_space_reads_the_free_blocks_of_each_pool_after_split_and_coalesce() {
    use caching_alloc_engine::alloc::PoolFree;
    let free = |bytes, largest| PoolFree {
        free_bytes: bytes,
        largest_free_block: largest,
    };
    let (alloc, device) = allocator(1024 * MIB, "");
    assert_eq!(alloc.stats().free_space.all, free(0, 0));
    assert_eq!(alloc.stats().free_space.all.fragmentation(), 0.0);

    // Three small blocks of one 2 MiB segment: the rest of it is one free block.
    let a = alloc.malloc(256 * KIB, S0).unwrap();
    let b = alloc.malloc(512 * KIB, S0).unwrap();
    let c = alloc.malloc(256 * KIB, S0).unwrap();
    let s = alloc.stats().free_space;
    assert_eq!(s.small_pool, free(MIB, MIB));
    assert_eq!(s.large_pool, free(0, 0));
    assert_eq!(s.small_pool.fragmentation(), 0.0);

    // A hole of 512 KiB beside the 1 MiB tail: a third of the free bytes are not in the
    // largest block.
    alloc.free(b).unwrap();
    let s = alloc.stats().free_space;
    assert_eq!(s.small_pool, free(MIB + 512 * KIB, MIB));
    assert!((s.small_pool.fragmentation() - 1.0 / 3.0).abs() < 1e-12);
    let map = alloc.stats().to_map();
    assert_eq!(map["free_bytes.small_pool"], (MIB + 512 * KIB) as i64);
    assert_eq!(map["largest_free_block.small_pool"], MIB as i64);
    assert_eq!(map["largest_free_block.all"], MIB as i64);
    assert!(
        alloc.summary().contains(
            "|       in small pool      |    1.50 MiB |    1.00 MiB |      33.3 % |             |"
        ),
        "{}",
        alloc.summary()
    );

    // Freeing `c` merges the hole, `c` and the tail into one block: no fragmentation.
    alloc.free(c).unwrap();
    let s = alloc.stats().free_space;
    assert_eq!(s.small_pool, free(2 * MIB - 256 * KIB, 2 * MIB - 256 * KIB));
    assert_eq!(s.small_pool.fragmentation(), 0.0);

    // A large block: its 20 MiB segment's remainder is free in the large pool; `all` sums both
    // pools and takes the larger block.
    let d = alloc.malloc(3 * MIB, S0).unwrap();
    let s = alloc.stats().free_space;
    assert_eq!(s.large_pool, free(17 * MIB, 17 * MIB));
    assert_eq!(s.all, free(17 * MIB + 2 * MIB - 256 * KIB, 17 * MIB));
    alloc.free(a).unwrap();
    alloc.free(d).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().free_space.all, free(0, 0));
    check_invariants(&alloc, &device);
}

/// Unmapped address space of an expandable segment is not free memory: only the mapped pages
/// a free block spans count.
#[test]
fn free_space_leaves_out_what_an_expandable_segment_has_not_mapped() {
    let (alloc, _device) = allocator(1024 * MIB, "expandable_segments:True");
    let a = alloc.malloc(3 * MIB, S0).unwrap();
    let s = alloc.stats().free_space;
    // One 20 MiB page mapped for a 3 MiB block: 17 MiB of it free, however large the range.
    assert_eq!(s.large_pool.free_bytes, 17 * MIB);
    assert_eq!(s.large_pool.largest_free_block, 17 * MIB);
    alloc.free(a).unwrap();
}
