//! Request sizes: 512-byte rounding, power-of-two divisions, pool routing, segment sizes.

use crate::common::{KIB, MIB};
use caching_alloc_engine::alloc::{
    AllocatorConfig, PoolKind, RoundupDivisions, SegmentSizing, round_size, segment_size,
};

use crate::common::{A, F, S0, allocator, layout};

#[test]
fn sizes_round_to_512_and_route_to_their_pool() {
    let none = RoundupDivisions::default();
    // (request, block size, pool, new segment size)
    let table = [
        (1, 512, PoolKind::Small, 2 * MIB),
        (511, 512, PoolKind::Small, 2 * MIB),
        (512, 512, PoolKind::Small, 2 * MIB),
        (513, 1024, PoolKind::Small, 2 * MIB),
        (1000, 1024, PoolKind::Small, 2 * MIB),
        (MIB - 1, MIB, PoolKind::Small, 2 * MIB),
        (MIB, MIB, PoolKind::Small, 2 * MIB),
        (MIB + 1, MIB + 512, PoolKind::Large, 20 * MIB),
        (5 * MIB, 5 * MIB, PoolKind::Large, 20 * MIB),
        (10 * MIB - 512, 10 * MIB - 512, PoolKind::Large, 20 * MIB),
        (10 * MIB, 10 * MIB, PoolKind::Large, 10 * MIB),
        (10 * MIB + 1, 10 * MIB + 512, PoolKind::Large, 12 * MIB),
        (21 * MIB, 21 * MIB, PoolKind::Large, 22 * MIB),
        (1600 * MIB, 1600 * MIB, PoolKind::Large, 1600 * MIB),
    ];
    for (request, block, pool, segment) in table {
        let rounded = round_size(request, &none);
        assert_eq!(rounded, block, "block size of a {request}-byte request");
        assert_eq!(
            PoolKind::for_size(rounded),
            pool,
            "pool of a {request}-byte request"
        );
        assert_eq!(
            segment_size(rounded, SegmentSizing::Pytorch, 0, 0),
            segment,
            "segment for a {request}-byte request"
        );
    }
}

/// `segment_sizing:grow` (the default) changes one row of PyTorch's `get_allocation_size`:
/// a mid-size block's segment is an eighth of the large pool's reserved bytes, at least the
/// block (twice the block when the large pool holds free bytes), each rounded up to 2 MiB,
/// and at most 20 MiB. The small pool and blocks of 10 MiB and more are PyTorch's.
#[test]
fn grown_segments_follow_an_eighth_of_the_large_pool_up_to_20_mib() {
    let grow = SegmentSizing::Grow;
    // (block, large pool reserved, new segment)
    let table = [
        (MIB + 512, 0, 2 * MIB),
        (MIB + 512, 16 * MIB, 2 * MIB),
        (MIB + 512, 16 * MIB + 8, 4 * MIB),
        (MIB + 512, 100 * MIB, 14 * MIB),
        (MIB + 512, 152 * MIB, 20 * MIB),
        (MIB + 512, 160 * MIB, 20 * MIB),
        (MIB + 512, 10_000 * MIB, 20 * MIB),
        (5 * MIB, 0, 6 * MIB),
        (5 * MIB, 40 * MIB, 6 * MIB),
        (10 * MIB - 512, 0, 10 * MIB),
        (10 * MIB - 512, 200 * MIB, 20 * MIB),
        // Not mid-size: the reserved bytes do not matter.
        (MIB, 1000 * MIB, 2 * MIB),
        (10 * MIB, 1000 * MIB, 10 * MIB),
        (21 * MIB, 0, 22 * MIB),
    ];
    for (block, reserved, segment) in table {
        assert_eq!(
            segment_size(block, grow, reserved, 0),
            segment,
            "grow: block {block}, large pool {reserved}"
        );
        let pytorch = segment_size(block, SegmentSizing::Pytorch, reserved, 0);
        let expected = if block > MIB && block < 10 * MIB {
            20 * MIB
        } else {
            segment
        };
        assert_eq!(pytorch, expected, "pytorch: block {block}");
    }
    assert_eq!(SegmentSizing::default(), grow);
    assert_eq!(AllocatorConfig::default().segment_sizing, grow);

    // With free bytes in the large pool the request counts twice; the eighth and the 20 MiB
    // bound still apply, and the other rows do not change. (block, reserved, free, segment)
    let missed = [
        (MIB + 512, 8 * MIB, 512, 4 * MIB),
        (3 * MIB, 8 * MIB, 4 * MIB, 6 * MIB),
        (5 * MIB, 8 * MIB, 4 * MIB, 10 * MIB),
        (5 * MIB + 512, 8 * MIB, 4 * MIB, 12 * MIB),
        (3 * MIB, 100 * MIB, 50 * MIB, 14 * MIB),
        (9 * MIB, 0, 1, 18 * MIB),
        (10 * MIB - 512, 8 * MIB, 4 * MIB, 20 * MIB),
        (MIB, 8 * MIB, 4 * MIB, 2 * MIB),
        (10 * MIB, 8 * MIB, 4 * MIB, 10 * MIB),
    ];
    for (block, reserved, free, segment) in missed {
        assert_eq!(
            segment_size(block, grow, reserved, free),
            segment,
            "grow: block {block}, large pool {reserved} with {free} free"
        );
        if block > MIB && block < 10 * MIB {
            assert_eq!(
                segment_size(block, SegmentSizing::Pytorch, reserved, free),
                20 * MIB
            );
        }
    }
}

/// Through the engine: a miss while the large pool holds free memory that does not fit (the
/// shapes changed) makes a segment of twice the request, whose rest serves the next request
/// of that size; a miss with nothing free makes one of the request. Under the request-sized
/// rule the two 5 MiB requests took a 6 MiB segment each (20 MiB in all); PyTorch's
/// `get_allocation_size` gives every mid-size miss 20 MiB.
#[test]
fn a_miss_beside_free_memory_takes_a_segment_twice_its_request() {
    let (alloc, _device) = allocator(1024 * MIB, "segment_sizing:grow");
    let a = alloc.malloc(3 * MIB, S0).unwrap();
    let b = alloc.malloc(3 * MIB, S0).unwrap();
    // Nothing was free: a segment of the request (4 MiB; the 1 MiB rest stays in the block).
    assert_eq!(layout(&alloc), [vec![(4 * MIB, A)], vec![(4 * MIB, A)]]);
    alloc.free(a).unwrap();
    // 4 MiB free, too small for 5 MiB: twice the request, 10 MiB, split.
    let c = alloc.malloc(5 * MIB, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        [
            vec![(4 * MIB, F)],
            vec![(4 * MIB, A)],
            vec![(5 * MIB, A), (5 * MIB, F)]
        ]
    );
    // The next 5 MiB needs no device memory.
    let d = alloc.malloc(5 * MIB, S0).unwrap();
    assert_eq!(
        layout(&alloc),
        [
            vec![(4 * MIB, F)],
            vec![(4 * MIB, A)],
            vec![(5 * MIB, A), (5 * MIB, A)]
        ]
    );
    let stats = alloc.stats();
    assert_eq!(stats.memory_reserved(), 18 * MIB);
    assert_eq!(stats.num_device_alloc, 3);
    for x in [b, c, d] {
        alloc.free(x).unwrap();
    }
}

/// Through the engine (`Engine::malloc`): on an empty pool, 3 MiB requests each take a 4 MiB
/// segment of their own (the 1 MiB rest stays in the block: PyTorch's `should_split` splits a
/// large block only for a rest over 1 MiB) while an eighth of the pool is at most 4 MiB; the
/// tenth, with 36 MiB reserved, takes a 6 MiB segment (4.5 MiB rounded up to 2 MiB) and leaves
/// 3 MiB free in it, which the eleventh takes. PyTorch's rule makes a 20 MiB segment for six
/// of them and a second for the other five.
#[test]
fn mid_size_segments_grow_with_an_eighth_of_the_large_pool() {
    let request = 3 * MIB;
    let (alloc, _device) = allocator(1024 * MIB, "segment_sizing:grow");
    let _held: Vec<_> = (0..11)
        .map(|_| alloc.malloc(request, S0).unwrap())
        .collect();
    let mut sizes: Vec<u64> = alloc
        .snapshot()
        .segments
        .iter()
        .map(|s| s.total_size)
        .collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [vec![4 * MIB; 9], vec![6 * MIB]].concat());
    let stats = alloc.stats();
    assert_eq!(stats.memory_reserved(), 42 * MIB);
    assert_eq!(stats.memory_allocated(), 9 * 4 * MIB + 2 * request);

    let (alloc, _device) = allocator(1024 * MIB, "segment_sizing:pytorch");
    let _held: Vec<_> = (0..11)
        .map(|_| alloc.malloc(request, S0).unwrap())
        .collect();
    assert_eq!(
        layout(&alloc),
        [
            [vec![(request, A); 6], vec![(2 * MIB, F)]].concat(),
            [vec![(request, A); 5], vec![(5 * MIB, F)]].concat(),
        ]
    );
    assert_eq!(alloc.stats().memory_reserved(), 40 * MIB);
}

/// Built in code, a division count that is not a power of two is rounded down to one, so no
/// block loses its 512-byte alignment (the parser refuses such a count outright).
#[test]
fn uniform_divisions_that_are_no_power_of_two_round_down_to_one() {
    assert_eq!(RoundupDivisions::uniform(3), RoundupDivisions::uniform(2));
    assert_eq!(
        RoundupDivisions::uniform(1000),
        RoundupDivisions::uniform(512)
    );
    assert_eq!(RoundupDivisions::uniform(0).for_size(MIB), 0);
    assert_eq!(RoundupDivisions::uniform(1).for_size(MIB), 1);
    let three = RoundupDivisions::uniform(3);
    for size in [513 * 3, 5 * MIB + 7, 48 * MIB + 1, 3 * 1024 * MIB + 11] {
        let rounded = round_size(size, &three);
        assert_eq!(rounded % 512, 0, "{size} rounds to {rounded}");
        assert!(rounded >= size);
    }
}

#[test]
fn power_of_two_divisions_round_to_the_next_step() {
    let four = RoundupDivisions::uniform(4);
    // Steps between 4096 and 8192 with 4 divisions: 4096, 5120, 6144, 7168.
    assert_eq!(round_size(5000, &four), 5120);
    assert_eq!(round_size(5121, &four), 6144);
    assert_eq!(round_size(8192, &four), 8192, "powers of two stay");
    assert_eq!(round_size(1200 * MIB, &four), 1280 * MIB);
    // 1200 B with 4 divisions would step by 256 B: below the 512-byte block granularity, so
    // the size is rounded to 512 B as without divisions (every offset stays 512-aligned).
    assert_eq!(round_size(1200, &four), 1536);
    assert_eq!(
        round_size(2049, &four),
        2560,
        "above 512 x 4 the division applies"
    );
    let eight = RoundupDivisions::uniform(8);
    assert_eq!(round_size(9 * MIB, &eight), 9 * MIB);
    assert_eq!(round_size(9 * MIB + 1, &eight), 10 * MIB);
}

/// `parseRoundUpPower2Divisions` and `roundup_power2_divisions(size)`: 16 buckets from 1 MiB.
/// `[1:2,16:8,>:4]`: bucket 0 (< 2 MiB) 2, buckets [2, 16) MiB 0, [16, 32) MiB 8, from 32 MiB
/// on 4. So 5 MiB is not rounded by divisions, 20 MiB takes 8 (steps of 2 MiB). A key sets its
/// own bucket and, up to the next key, nothing more: sizes between two keys get no division.
#[test]
fn roundup_list_fills_buckets_as_pytorch_parses_them() {
    let parse = |text: &str| {
        AllocatorConfig::parse(&format!("roundup_power2_divisions:{text}"))
            .unwrap()
            .roundup_power2_divisions
    };
    let d = parse("[1:2,16:8,>:4]");
    let table = [
        (600 * KIB, 2),
        (MIB + MIB / 2, 2),
        (3 * MIB, 0),
        (5 * MIB, 0),
        (15 * MIB, 0),
        (20 * MIB, 8),
        (100 * MIB, 4),
        (64 * 1024 * MIB, 4),
    ];
    for (size, n) in table {
        assert_eq!(d.for_size(size), n, "divisions for {size} bytes");
    }
    assert_eq!(round_size(600 * KIB, &d), 768 * KIB, "steps of 256 KiB");
    assert_eq!(round_size(5 * MIB + 1, &d), 5 * MIB + 512, "no division");
    assert_eq!(round_size(20 * MIB + 1, &d), 22 * MIB, "8 steps of 2 MiB");
    assert_eq!(round_size(100 * MIB, &d), 112 * MIB, "4 steps of 16 MiB");

    // Key `N:d` sets [N, 2N) MiB only: sizes between two keys get no division rounding.
    let d = parse("[1:1,64:4,>:8]");
    assert_eq!(d.for_size(100 * KIB), 1);
    assert_eq!(d.for_size(3 * MIB), 0, "between the keys 1 and 64");
    assert_eq!(d.for_size(100 * MIB), 4);
    assert_eq!(d.for_size(200 * MIB), 8);
    assert_eq!(
        round_size(100 * KIB + 1, &d),
        100 * KIB + 512,
        "1 division: plain rounding"
    );
    assert_eq!(round_size(3 * MIB + 1, &d), 3 * MIB + 512, "no division");
    assert_eq!(
        round_size(200 * MIB, &d),
        208 * MIB,
        "steps of 16 MiB between 128 and 256 MiB"
    );

    // Unordered: the first key also fills every bucket below it; a later one overwrites.
    let d = parse("[16:8,1:2]");
    assert_eq!(
        (d.for_size(MIB), d.for_size(3 * MIB), d.for_size(20 * MIB)),
        (2, 8, 8)
    );
    assert_eq!(
        d.for_size(40 * MIB),
        0,
        "no `>`: buckets after the last key stay 0"
    );
    // `>` fills after the last key read before it (none: bucket 0 stays).
    let d = parse("[>:4,64:2]");
    assert_eq!(
        (
            d.for_size(MIB),
            d.for_size(100 * MIB),
            d.for_size(200 * MIB)
        ),
        (2, 2, 4)
    );
    // A key beyond the last bucket is clamped to it.
    assert_eq!(parse("[65536:4]"), RoundupDivisions::uniform(4));
    assert_eq!(parse("[]"), RoundupDivisions::default());
    // A single value has no cap; 1 is a power of two that rounds nothing.
    assert_eq!(parse("128"), RoundupDivisions::uniform(128));
    assert_eq!(round_size(3 * MIB + 1, &parse("1")), 3 * MIB + 512);
}

/// The pools carry PyTorch's names, the ones `torch.cuda.memory_stats()` keys hold
/// (`small_pool`, `large_pool`): each pool's bytes are found under its own name.
#[test]
fn each_pool_is_named_as_its_memory_stats_keys() {
    use crate::common::{S0, allocator};
    let (alloc, _device) = allocator(1024 * MIB, "");
    let _small = alloc.malloc(1000, S0).unwrap();
    let _large = alloc.malloc(3 * MIB, S0).unwrap();
    let stats = alloc.stats().to_map();
    for (pool, bytes) in [(PoolKind::Small, 1024), (PoolKind::Large, 3 * MIB)] {
        let key = format!("allocated_bytes.{}.current", pool.stat_name());
        assert_eq!(stats.get(&key), Some(&(bytes as i64)), "{key}");
    }
}
