//! PyTorch's rules at their exact edges, where an off-by-one in a comparison changes which
//! block a request gets, and the order in which a full device's cached oversize blocks go
//! back (found by mutation testing: the layouts elsewhere stay clear of the edges, and the
//! other miss-path tests have one oversize block, where every order agrees).

use crate::common::*;

/// PyTorch's `get_free_block`: a request of exactly `max_split_size` is not "under" it, so it
/// may take a cached oversize block, as long as that block is less than
/// `max_non_split_rounding` larger than the request.
#[test]
fn a_request_of_exactly_max_split_size_takes_a_cached_oversize_block() {
    let (alloc, device) = allocator(1024 * MIB, "max_split_size_mb:32");
    let a = alloc.malloc(40 * MIB, S0).unwrap();
    let address = a.address();
    alloc.free(a).unwrap();
    let b = alloc.malloc(32 * MIB, S0).unwrap();
    assert_eq!(
        b.address(),
        address,
        "the cached 40 MiB block serves 32 MiB"
    );
    assert_eq!(b.size(), 40 * MIB, "an oversize block is never split");
    assert_eq!(device.counters().allocs, 1);
    alloc.free(b).unwrap();
    // One byte less is under max_split_size: the oversize block is not for it.
    let c = alloc.malloc(32 * MIB - 512, S0).unwrap();
    assert_ne!(c.address(), address);
    assert_eq!(device.counters().allocs, 2);
    alloc.free(c).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `get_free_block`: an oversize request refuses a cached block of at least
/// request + `max_non_split_rounding` (20 MiB by default), and takes one just below that.
#[test]
fn an_oversize_request_takes_a_block_less_than_max_non_split_rounding_larger() {
    let (alloc, device) = allocator(1024 * MIB, "max_split_size_mb:32");
    let at_edge = alloc.malloc(52 * MIB, S0).unwrap();
    let below = alloc.malloc(50 * MIB, S1).unwrap();
    let (edge_address, below_address) = (at_edge.address(), below.address());
    alloc.free(at_edge).unwrap();
    alloc.free(below).unwrap();
    // 52 MiB is exactly 32 + 20: refused.
    let a = alloc.malloc(32 * MIB, S0).unwrap();
    assert_ne!(a.address(), edge_address);
    assert_eq!(device.counters().allocs, 3);
    // 50 MiB is under 32 + 20: taken, whole.
    let b = alloc.malloc(32 * MIB, S1).unwrap();
    assert_eq!((b.address(), b.size()), (below_address, 50 * MIB));
    assert_eq!(device.counters().allocs, 3);
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `release_available_cached_blocks`: when the device is full, the smallest cached
/// oversize block of the stream that covers the request (at least `max_split_size`) goes back
/// alone; the larger one stays cached, and no full flush (retry) is counted.
#[test]
fn a_full_device_releases_the_smallest_oversize_block_that_covers_the_request() {
    let (alloc, device) = allocator(250 * MIB, "max_split_size_mb:32");
    let keep = alloc.malloc(5 * MIB, S0).unwrap();
    let sixty = alloc.malloc(60 * MIB, S0).unwrap();
    let big = alloc.malloc(150 * MIB, S0).unwrap();
    let big_address = big.address();
    alloc.free(sixty).unwrap();
    alloc.free(big).unwrap();
    // 33 MiB refuses both (each is at least 33 + 20 MiB) and needs a 34 MiB segment: 230 MiB
    // are reserved, 250 MiB is the device.
    let a = alloc.malloc(33 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        stats.num_alloc_retries, 0,
        "releasing one oversize block was enough"
    );
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(
        stats.memory_reserved(),
        (20 + 150 + 34) * MIB,
        "the 60 MiB block went back"
    );
    assert!(
        device
            .live_segments()
            .iter()
            .any(|&(address, _)| address == big_address)
    );
    alloc.free(a).unwrap();
    alloc.free(keep).unwrap();
    check_invariants(&alloc, &device);
}

/// PyTorch's `release_available_cached_blocks`: when no single cached oversize block covers
/// the request, the largest ones go back, largest first, until together they cover it; the
/// rest stays cached and no full flush (retry) is counted.
#[test]
fn a_full_device_releases_the_largest_oversize_blocks_until_they_cover_the_request() {
    let (alloc, device) = allocator(200 * MIB, "max_split_size_mb:32");
    let keep = alloc.malloc(5 * MIB, S0).unwrap();
    let blocks: Vec<_> = [60, 50, 40]
        .into_iter()
        .map(|mib| alloc.malloc(mib * MIB, S0).unwrap())
        .collect();
    let forty = blocks[2].address();
    for b in blocks {
        alloc.free(b).unwrap();
    }
    // 85 MiB fits no cached block and needs an 86 MiB segment beside 170 MiB reserved:
    // 60 + 50 go back (110 MiB, enough), the 40 MiB block stays.
    let a = alloc.malloc(85 * MIB, S0).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        stats.num_alloc_retries, 0,
        "the oversize release was enough"
    );
    assert_eq!(stats.num_device_free, 2);
    assert_eq!(stats.memory_reserved(), (20 + 40 + 86) * MIB);
    assert!(
        device
            .live_segments()
            .iter()
            .any(|&(address, _)| address == forty)
    );
    alloc.free(a).unwrap();
    alloc.free(keep).unwrap();
    check_invariants(&alloc, &device);
}
