//! A seeded generator (SplitMix64), so both sides draw the same shapes and data.

/// SplitMix64: small, fast and the same on every machine.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `low..=high`.
    pub fn range(&mut self, low: usize, high: usize) -> usize {
        low + (self.next_u64() % (high - low + 1) as u64) as usize
    }

    /// `n` values uniform in `[-1, 1)`.
    pub fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    /// `n` class labels below `classes`.
    pub fn labels(&mut self, n: usize, classes: usize) -> Vec<i64> {
        (0..n).map(|_| self.range(0, classes - 1) as i64).collect()
    }
}
