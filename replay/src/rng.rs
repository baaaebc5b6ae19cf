//! A small deterministic random number generator (SplitMix64).
//!
//! The trace generators must give the same trace for the same seed on every machine and with
//! every version of every dependency, so they use this fixed, fully specified algorithm rather
//! than a library generator whose stream may change between releases.

/// SplitMix64 (Steele, Lea and Flood, 2014): 64 bits of state, passes BigCrush.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform float in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `[low, high]` (inclusive). `low <= high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        debug_assert!(low <= high);
        let span = high - low + 1;
        if span == 0 {
            return self.next_u64();
        }
        low + self.next_u64() % span
    }

    /// A size whose logarithm is uniform in `[ln low, ln high]`.
    pub fn log_uniform(&mut self, low: u64, high: u64) -> u64 {
        debug_assert!(0 < low && low <= high);
        let (lo, hi) = ((low as f64).ln(), (high as f64).ln());
        let value = (lo + (hi - lo) * self.next_f64()).exp();
        (value.round() as u64).clamp(low, high)
    }

    /// A geometric count of trials with mean `mean` (at least 1).
    pub fn geometric(&mut self, mean: f64) -> u64 {
        if mean <= 1.0 {
            return 1;
        }
        let p = 1.0 / mean;
        let u = self.next_f64().max(f64::MIN_POSITIVE);
        (u.ln() / (1.0 - p).ln()).floor() as u64 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_first_outputs() {
        // Reference values of SplitMix64 seeded with 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn log_uniform_stays_in_range() {
        let mut rng = SplitMix64::new(7);
        for _ in 0..10_000 {
            let v = rng.log_uniform(512, 1 << 20);
            assert!((512..=1 << 20).contains(&v));
        }
    }
}
