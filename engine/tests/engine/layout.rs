//! Exact block layouts after splitting and coalescing, and the max_split_size rules of
//! placement (`get_free_block`, `should_split`), at their exact edges too.

use crate::common::*;

#[test]
fn small_requests_split_a_2mib_segment_in_address_order() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(1000, S0).unwrap();
    let b = alloc.malloc(4096, S0).unwrap();
    let c = alloc.malloc(512, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(1024, A), (4096, A), (512, A), (2 * MIB - 5632, F)]]
    );
    assert_eq!(b.address(), a.address() + 1024);
    assert_eq!(c.address(), b.address() + 4096);
    assert_eq!((a.offset(), b.offset(), c.offset()), (0, 1024, 5120));
    assert_eq!(a.requested_size(), 1000);
    assert_eq!(a.size(), 1024);
    assert_eq!(device.counters().allocs, 1, "one segment serves all three");
    check_invariants(&alloc, &device);
}

#[test]
fn freeing_merges_with_the_previous_the_next_and_both_neighbours() {
    let (alloc, device) = allocator(64 * MIB, "");
    let a = alloc.malloc(1024, S0).unwrap();
    let b = alloc.malloc(2048, S0).unwrap();
    let c = alloc.malloc(4096, S0).unwrap();
    let d = alloc.malloc(8192, S0).unwrap();
    let rest = 2 * MIB - 15360;

    // Next neighbour: d merges with the free tail.
    alloc.free(d).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(1024, A), (2048, A), (4096, A), (rest + 8192, F)]]
    );
    // No free neighbour: a stays alone.
    alloc.free(a).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(1024, F), (2048, A), (4096, A), (rest + 8192, F)]]
    );
    // Previous neighbour: b merges with the freed a.
    alloc.free(b).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![(3072, F), (4096, A), (rest + 8192, F)]]
    );
    // Both neighbours: c joins everything back into one block.
    alloc.free(c).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(2 * MIB, F)]]);
    check_invariants(&alloc, &device);
}

#[test]
fn best_fit_takes_the_smallest_block_that_fits_and_the_lowest_address_on_ties() {
    let (alloc, device) = allocator(64 * MIB, "");
    let blocks: Vec<_> = [4096, 512, 8192, 512, 2048, 512]
        .iter()
        .map(|&s| alloc.malloc(s, S0).unwrap())
        .collect();
    let addresses: Vec<u64> = blocks.iter().map(|b| b.address()).collect();
    // Free the 4096, 8192 and 2048 blocks; the 512-byte ones keep them apart.
    let mut blocks = blocks.into_iter();
    let (b0, b1, b2, b3, b4, b5) = (
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
    );
    alloc.free(b0).unwrap();
    alloc.free(b2).unwrap();
    alloc.free(b4).unwrap();
    // 3000 -> 3072: the 4096 hole is the smallest that fits (2048 is too small).
    let x = alloc.malloc(3000, S0).unwrap();
    assert_eq!(x.address(), addresses[0]);
    // 1536 fits the 2048 hole best, although the 1024-byte remainder of the first hole is free.
    let y = alloc.malloc(1536, S0).unwrap();
    assert_eq!(y.address(), addresses[4]);
    // 512: the 512-byte remainder after y fits exactly; the 1024-byte one after x is larger.
    let z = alloc.malloc(512, S0).unwrap();
    assert_eq!(z.address(), addresses[4] + 1536);
    for b in [b1, b3, b5, x, y, z] {
        alloc.free(b).unwrap();
    }
    check_invariants(&alloc, &device);
}

#[test]
fn among_equal_free_blocks_the_lowest_address_wins() {
    let (alloc, device) = allocator(64 * MIB, "");
    let mut blocks: Vec<_> = (0..5).map(|_| alloc.malloc(512, S0).unwrap()).collect();
    let addresses: Vec<u64> = blocks.iter().map(|b| b.address()).collect();
    let b3 = blocks.remove(3);
    let b1 = blocks.remove(1);
    alloc.free(b3).unwrap();
    alloc.free(b1).unwrap();
    assert_eq!(alloc.malloc(512, S0).unwrap().address(), addresses[1]);
    assert_eq!(alloc.malloc(512, S0).unwrap().address(), addresses[3]);
    check_invariants(&alloc, &device);
}

#[test]
fn large_pool_splits_only_remainders_over_1mib() {
    let (alloc, device) = allocator(256 * MIB, "");
    // 2 MiB request -> 20 MiB segment, remainder 18 MiB is split off.
    let a = alloc.malloc(2 * MIB, S0).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(2 * MIB, A), (18 * MIB, F)]]);
    // 17.5 MiB from the 18 MiB block: the 0.5 MiB remainder stays with the block.
    let b = alloc.malloc(17 * MIB + 512 * KIB, S0).unwrap();
    assert_eq!(b.size(), 18 * MIB);
    assert_eq!(layout(&alloc), vec![vec![(2 * MIB, A), (18 * MIB, A)]]);
    alloc.free(b).unwrap();
    // 17 MiB from the 18 MiB block: a remainder of exactly 1 MiB is not over 1 MiB either.
    let c = alloc.malloc(17 * MIB, S0).unwrap();
    assert_eq!(c.size(), 18 * MIB);
    alloc.free(c).unwrap();
    // 16.5 MiB: the 1.5 MiB remainder is split off.
    let d = alloc.malloc(16 * MIB + 512 * KIB, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        vec![vec![
            (2 * MIB, A),
            (16 * MIB + 512 * KIB, A),
            (MIB + 512 * KIB, F)
        ]]
    );
    alloc.free(a).unwrap();
    alloc.free(d).unwrap();
    check_invariants(&alloc, &device);
}

#[test]
fn small_and_large_requests_never_share_a_segment() {
    let (alloc, device) = allocator(256 * MIB, "");
    let _small = alloc.malloc(MIB, S0).unwrap();
    let _large = alloc.malloc(MIB + 1, S0).unwrap();
    let snapshot = alloc.snapshot();
    assert_eq!(snapshot.segments.len(), 2);
    let sizes: Vec<u64> = snapshot.segments.iter().map(|s| s.total_size).collect();
    assert_eq!(sizes, vec![2 * MIB, 20 * MIB]);
    check_invariants(&alloc, &device);
}

#[test]
fn oversize_blocks_are_never_split_and_never_serve_small_requests() {
    let (alloc, device) = allocator(1024 * MIB, "max_split_size_mb:64");
    let big = alloc.malloc(100 * MIB, S0).unwrap();
    alloc.free(big).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(100 * MIB, F)]]);
    // A 30 MiB request is under max_split_size: it may not take the cached 100 MiB block.
    let mid = alloc.malloc(30 * MIB, S0).unwrap();
    assert_eq!(
        device.counters().allocs,
        2,
        "a new segment for the 30 MiB request"
    );
    assert_eq!(
        layout(&alloc),
        vec![vec![(100 * MIB, F)], vec![(30 * MIB, A)]]
    );
    // A 90 MiB request is oversize and within 20 MiB of the cached block: it takes it whole.
    let over = alloc.malloc(90 * MIB, S0).unwrap();
    assert_eq!(over.size(), 100 * MIB, "oversize blocks are not split");
    assert_eq!(device.counters().allocs, 2);
    alloc.free(over).unwrap();
    // A 70 MiB request is 30 MiB smaller than the cached block: more than the 20 MiB
    // rounding allowed, so it gets its own segment.
    let other = alloc.malloc(70 * MIB, S0).unwrap();
    assert_eq!(device.counters().allocs, 3);
    assert_eq!(other.size(), 70 * MIB);
    let stats = alloc.stats();
    assert_eq!(stats.oversize_allocations.current, 1);
    assert_eq!(stats.oversize_segments.current, 2);
    alloc.free(mid).unwrap();
    alloc.free(other).unwrap();
    check_invariants(&alloc, &device);
}

/// `should_split`: in the large pool the *request* is compared with `max_split_size`. A
/// 62.5 MiB request under `max_split_size_mb:64` gets a 64 MiB segment and the 1.5 MiB
/// remainder is split off. Freed, the segment is whole again at 64 MiB, and `get_free_block`
/// keeps it from any request under 64 MiB, the same 62.5 MiB included.
#[test]
fn should_split_compares_the_request_with_max_split_size() {
    let (alloc, device) = allocator(1024 * MIB, "max_split_size_mb:64");
    let request = 62 * MIB + 512 * KIB;
    let remainder = MIB + 512 * KIB;
    let a = alloc.malloc(request, S0).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(request, A), (remainder, F)]]);
    let s = alloc.stats();
    assert_eq!(s.allocated_bytes.all.current, request);
    assert_eq!(s.reserved_bytes.all.current, 64 * MIB);
    assert_eq!(s.inactive_split.all.current, 1);
    assert_eq!(s.inactive_split_bytes.all.current, remainder);
    assert_eq!(s.oversize_allocations.current, 0, "62.5 MiB < 64 MiB");
    assert_eq!(s.oversize_segments.current, 1, "the segment is 64 MiB");
    check_invariants(&alloc, &device);

    alloc.free(a).unwrap();
    assert_eq!(layout(&alloc), vec![vec![(64 * MIB, F)]]);
    assert_eq!(alloc.stats().inactive_split.all.current, 0);
    let b = alloc.malloc(request, S0).unwrap();
    assert_eq!(
        device.counters().allocs,
        2,
        "the oversize block is not taken"
    );
    assert_eq!(
        layout(&alloc),
        vec![vec![(64 * MIB, F)], vec![(request, A), (remainder, F)]]
    );
    // A request at max_split_size takes it (less than 20 MiB over), whole.
    let c = alloc.malloc(64 * MIB, S0).unwrap();
    assert_eq!(device.counters().allocs, 2);
    assert_eq!(c.size(), 64 * MIB);
    assert_eq!(alloc.stats().oversize_allocations.current, 1);
    check_invariants(&alloc, &device);
    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    check_invariants(&alloc, &device);
}

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
/// request + `max_non_split_rounding` (20 MiB by default), and takes one just below that;
/// `max_non_split_rounding_mb` widens the margin.
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
    // With a 40 MiB margin, a 70 MiB request takes a cached 100 MiB block.
    let (alloc, device) = allocator(
        1024 * MIB,
        "max_split_size_mb:64,max_non_split_rounding_mb:40",
    );
    let big = alloc.malloc(100 * MIB, S0).unwrap();
    alloc.free(big).unwrap();
    let other = alloc.malloc(70 * MIB, S0).unwrap();
    assert_eq!(
        other.size(),
        100 * MIB,
        "30 MiB over is within the 40 MiB allowed"
    );
    assert_eq!(device.counters().allocs, 1);
}
