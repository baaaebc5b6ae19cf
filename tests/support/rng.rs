//! The seeded generator the tests draw their programs from.

/// The next value of a 64-bit linear congruential generator (Knuth's MMIX constants), the
/// state's top 31 bits.
pub fn next(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *state >> 33
}
