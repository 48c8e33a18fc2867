//! The benches' seeded pseudo-random source: a 64-bit linear congruential generator (Knuth's
//! MMIX constants), so every run draws the same data.

pub struct Rng(pub u64);

impl Rng {
    /// The next state. Its high bits are the good ones; the low bits repeat with short periods.
    pub fn step(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0
    }
}
