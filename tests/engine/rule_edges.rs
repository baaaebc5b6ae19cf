//! PyTorch's numeric rules at their exact edges, where an off-by-one in a comparison changes
//! which block a request gets (found by mutation testing: the layouts elsewhere stay clear of
//! the edges).

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
