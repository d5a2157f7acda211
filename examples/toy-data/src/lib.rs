//! The synthetic classification data the example jobs train on: Gaussian-like clusters, one per
//! class, generated from a fixed seed so that every rank (and a single-process reference run)
//! builds exactly the same samples with no download and no shared file.

#![forbid(unsafe_code)]

/// A deterministic xorshift stream of floats in [-1, 1).
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed` (any non-zero value).
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    /// The next value, in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `samples` points of `features` values each, row-major, and their labels: sample `i` belongs
/// to class `i % classes` and lies within `spread` (per feature) of that class's centre.
pub fn clusters(
    samples: usize,
    features: usize,
    classes: usize,
    spread: f32,
) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(0x5eed_1234_abcd_0001);
    let centres: Vec<f32> = (0..classes * features)
        .map(|_| rng.next_f32() * 2.0)
        .collect();
    let mut xs = Vec::with_capacity(samples * features);
    let mut ys = Vec::with_capacity(samples);
    for i in 0..samples {
        let c = i % classes.max(1);
        xs.extend((0..features).map(|f| centres[c * features + f] + rng.next_f32() * spread));
        ys.push(c as u32);
    }
    (xs, ys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_data_every_time_and_labels_cycle() {
        let (a, ya) = clusters(20, 3, 4, 1.0);
        let (b, _) = clusters(20, 3, 4, 1.0);
        assert_eq!(a, b);
        assert_eq!(a.len(), 60);
        assert_eq!(&ya[..5], &[0, 1, 2, 3, 0]);
        assert!(a.iter().all(|v| v.abs() < 3.0));
    }
}
