//! Request sizes: 512-byte rounding, power-of-two divisions, pool routing, segment sizes.

use burn_caching_alloc::alloc::{
    AllocatorConfig, KIB, MIB, PoolKind, RoundupDivisions, round_size, segment_size,
};

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
            segment_size(rounded),
            segment,
            "segment for a {request}-byte request"
        );
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

/// PyTorch's buckets (`roundup_power2_divisions(size)`): key `N:d` sets [N, 2N) MiB only;
/// sizes between two keys get no division rounding. The parity tests hold the other cases.
#[test]
fn interval_divisions_apply_per_size_bucket() {
    let config = AllocatorConfig::parse("roundup_power2_divisions:[1:1,64:4,>:8]").unwrap();
    let d = &config.roundup_power2_divisions;
    assert_eq!(d.for_size(100 * KIB), 1);
    assert_eq!(d.for_size(3 * MIB), 0, "between the keys 1 and 64");
    assert_eq!(d.for_size(100 * MIB), 4);
    assert_eq!(d.for_size(200 * MIB), 8);
    assert_eq!(
        round_size(100 * KIB + 1, d),
        100 * KIB + 512,
        "1 division: plain rounding"
    );
    assert_eq!(round_size(3 * MIB + 1, d), 3 * MIB + 512, "no division");
    assert_eq!(
        round_size(100 * MIB, d),
        112 * MIB,
        "steps of 16 MiB between 64 and 128 MiB"
    );
    assert_eq!(
        round_size(200 * MIB, d),
        208 * MIB,
        "steps of 16 MiB between 128 and 256 MiB"
    );
}
