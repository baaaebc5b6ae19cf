//! Readings with a cache above the engine (`CachedAbove`, `stats_with`, `snapshot_with`,
//! `move_scope_with`): the named allocations leave the current live-allocation statistics, per
//! pool and per scope, and show as inactive blocks, while the engine, its accumulated amounts
//! and its peaks stay as they were; an allocation freed since it was named, or named twice,
//! counts once or not at all.

use caching_alloc_engine::alloc::{BlockState, CachedAbove, Tag};

use crate::common::{A, F, KIB, MIB, S0, allocator, layout};

#[test]
fn named_allocations_read_as_cache_and_nothing_in_the_engine_moves() {
    let (alloc, _device) = allocator(64 * MIB, "");
    let kept_small = alloc.malloc(1000, S0).expect("fits"); // 1 KiB block
    let scope = Tag::new("grads").enter();
    let cached_small = alloc.malloc(3 * KIB, S0).expect("fits"); // 3 KiB block
    let cached_large = alloc.malloc(3 * MIB, S0).expect("fits"); // 3 MiB of a 20 MiB segment
    drop(scope);
    let freed = alloc.malloc(2 * KIB, S0).expect("fits");
    let before = alloc.stats();
    let layout_before = layout(&alloc);

    let mut cached = CachedAbove::default();
    cached.insert(&cached_small);
    cached.insert(&cached_large);
    cached.insert(&cached_large); // named twice: counted once
    cached.insert(&freed);
    alloc.free(freed).expect("live"); // freed since it was named: ignored
    assert_eq!(cached.len(), 4);
    let stats = alloc.stats_with(&cached);
    let plain = alloc.stats();

    // Current values: only the 1 KiB block is live; 1 KiB in the small pool, none large.
    assert_eq!(stats.allocated_bytes.all.current, KIB);
    assert_eq!(stats.allocated_bytes.small_pool.current, KIB);
    assert_eq!(stats.allocated_bytes.large_pool.current, 0);
    assert_eq!(stats.allocation.all.current, 1);
    assert_eq!(stats.active_bytes.all.current, KIB);
    assert_eq!(stats.active.large_pool.current, 0);
    assert_eq!(stats.requested_bytes.all.current, 1000);
    assert_eq!(stats.scopes["grads"].current, 0);
    // Peaks, accumulated amounts and reserved are the engine's, which nothing changed.
    assert_eq!(
        stats.allocated_bytes.all.peak,
        plain.allocated_bytes.all.peak
    );
    assert_eq!(
        stats.allocated_bytes.all.allocated,
        plain.allocated_bytes.all.allocated
    );
    assert_eq!(
        stats.allocated_bytes.all.freed,
        plain.allocated_bytes.all.freed
    );
    assert_eq!(stats.scopes["grads"].peak, 3 * KIB + 3 * MIB);
    assert_eq!(stats.memory_reserved(), before.memory_reserved());
    assert_eq!(plain.allocated_bytes.all.current, KIB + 3 * KIB + 3 * MIB);
    // The free space is the engine's own: the 2 KiB just freed coalesced with the small
    // segment's rest, the cached blocks are not free there.
    assert_eq!(stats.free_space, plain.free_space);

    // The snapshot: the two cached blocks inactive, their segments' sums without them.
    let snapshot = alloc.snapshot_with(&cached);
    assert_eq!(snapshot.stats.allocated_bytes, stats.allocated_bytes);
    let states: Vec<Vec<(u64, BlockState)>> = snapshot
        .segments
        .iter()
        .map(|s| s.blocks.iter().map(|b| (b.size, b.state)).collect())
        .collect();
    assert_eq!(
        states,
        vec![
            vec![(KIB, A), (3 * KIB, F), (2 * MIB - 4 * KIB, F)],
            vec![(3 * MIB, F), (17 * MIB, F)],
        ]
    );
    assert_eq!(
        snapshot
            .segments
            .iter()
            .map(|s| (s.allocated_size, s.active_size, s.requested_size))
            .collect::<Vec<_>>(),
        vec![(KIB, KIB, 1000), (0, 0, 0)]
    );
    let cached_block = &snapshot.segments[1].blocks[0];
    assert_eq!(
        (cached_block.allocation_id, cached_block.scope.as_deref()),
        (None, None)
    );
    // The engine itself: the same blocks, still allocated.
    assert_eq!(layout(&alloc), {
        let mut expected = layout_before;
        // Only the freed 2 KiB block changed (it merged with the free rest).
        expected[0] = vec![(KIB, A), (3 * KIB, A), (2 * MIB - 4 * KIB, F)];
        expected
    });

    // Moving a scope leaves the cached blocks where they were; the live ones move.
    let scope = Tag::new("grads").enter();
    let live_grad = alloc.malloc(5 * KIB, S0).expect("fits");
    drop(scope);
    let moved = alloc
        .move_scope_with("grads", Some(Tag::new("optimizer")), &cached)
        .expect("usable");
    assert_eq!(moved, 5 * KIB);
    let after = alloc.stats();
    assert_eq!(after.scopes["grads"].current, 3 * KIB + 3 * MIB);
    assert_eq!(after.scopes["optimizer"].current, 5 * KIB);

    for live in [kept_small, cached_small, cached_large, live_grad] {
        alloc.free(live).expect("live");
    }
    assert_eq!(alloc.stats_with(&cached).memory_allocated(), 0);
}
