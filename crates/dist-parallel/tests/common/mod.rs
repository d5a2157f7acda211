//! Random valid pipeline schedules, for tests that must hold for any schedule, not just the
//! generators' orders.

use dist_parallel::pipeline::{Action, Schedule};

/// A small deterministic generator (xorshift64*), so failures reproduce from the seed.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// A value in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// A random valid schedule: `n` stages spread over `p` ranks at random (every rank gets at
/// least one when `n >= p`), and the ranks' lists cut from one random sequential execution
/// order, so they cannot deadlock. Backwards are whole or split at random, and a split's W
/// comes any time after its I.
pub(crate) fn random_schedule(seed: u64, p: usize, n: usize, m: usize) -> Schedule {
    let mut rng = Rng::new(seed);
    let mut stage_to_rank: Vec<usize> = (0..n).map(|s| s % p).collect();
    for s in (1..n).rev() {
        stage_to_rank.swap(s, rng.below(s + 1));
    }
    // Per (stage, mb): forward done, backward (or I) done, W owed.
    let mut f = vec![false; n * m];
    let mut b = vec![false; n * m];
    let mut w_owed = vec![false; n * m];
    let mut lists = vec![Vec::new(); p];
    loop {
        let mut ready = Vec::new();
        for s in 0..n {
            for mb in 0..m {
                let i = s * m + mb;
                if !f[i] && (s == 0 || f[i - m]) {
                    ready.push(Action::Forward { stage: s, mb });
                }
                if f[i] && !b[i] && (s + 1 == n || b[i + m]) {
                    ready.push(Action::Backward { stage: s, mb });
                }
                if w_owed[i] {
                    ready.push(Action::BackwardWeight { stage: s, mb });
                }
            }
        }
        if ready.is_empty() {
            break;
        }
        let mut a = ready[rng.below(ready.len())];
        let (s, mb) = (a.stage(), a.mb());
        let i = s * m + mb;
        match a {
            Action::Forward { .. } => f[i] = true,
            Action::Backward { .. } => {
                b[i] = true;
                if rng.below(2) == 0 {
                    a = Action::BackwardInput { stage: s, mb };
                    w_owed[i] = true;
                }
            }
            _ => w_owed[i] = false,
        }
        lists[stage_to_rank[s]].push(a);
    }
    Schedule::new(format!("random-{seed}"), stage_to_rank, m, lists)
        .unwrap_or_else(|e| panic!("a random sequential order must validate: {e}"))
}
