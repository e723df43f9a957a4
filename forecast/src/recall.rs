//! Recall of a predicted block set against the real selection (spec §4):
//! only the freely chosen blocks count — the forced sink and window blocks
//! are selected by every method and would inflate the figure.

use serde::Serialize;

/// Hits of `predicted` among the freely chosen blocks of `real`: returns
/// (hits, free) where free = |{m ∈ real : ¬forced(m)}| and hits = |{m ∈
/// real ∩ predicted : ¬forced(m)}|. Block ids need not be sorted;
/// duplicates in `predicted` count once.
pub fn free_hits(
    real: &[usize],
    predicted: &[usize],
    forced: impl Fn(usize) -> bool,
) -> (u64, u64) {
    let mut hits = 0u64;
    let mut free = 0u64;
    for &m in real {
        if forced(m) {
            continue;
        }
        free += 1;
        if predicted.contains(&m) {
            hits += 1;
        }
    }
    (hits, free)
}

/// Expected hits of a uniformly random choice of `k` free blocks out of
/// `candidates` non-forced existing blocks, against a real set with `k`
/// free blocks: k·k/candidates (each real free block is drawn with
/// probability k/candidates). 0 when there are no candidates.
pub fn random_expected_hits(k: u64, candidates: u64) -> f64 {
    if candidates == 0 {
        0.0
    } else {
        (k as f64) * (k.min(candidates) as f64) / candidates as f64
    }
}

/// Running recall of one method at one layer: hits over free real blocks,
/// summed over steps and KV heads (a micro-average).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Tally {
    /// Real free blocks the method also chose (expected value for random).
    pub hits: f64,
    /// Real free blocks.
    pub free: u64,
    /// (step, KV head) pairs counted.
    pub sets: u64,
}

impl Tally {
    /// Adds one (step, KV head) set's hits and free blocks.
    pub fn add(&mut self, hits: f64, free: u64) {
        self.hits += hits;
        self.free += free;
        self.sets += 1;
    }

    /// hits / free, `None` when no free block was counted.
    pub fn recall(&self) -> Option<f64> {
        (self.free > 0).then(|| self.hits / self.free as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_blocks_do_not_count() {
        // blocks 0 (sink) and 8..=10 (window) forced; real free {3, 5, 6}
        let forced = |m: usize| m == 0 || (8..=10).contains(&m);
        let real = [0, 3, 5, 6, 8, 9, 10];
        assert_eq!(free_hits(&real, &[0, 8, 9, 10, 5, 1, 2], forced), (1, 3));
        assert_eq!(free_hits(&real, &[3, 5, 6], forced), (3, 3));
        assert_eq!(free_hits(&real, &[0, 8, 9, 10], forced), (0, 3));
        assert_eq!(free_hits(&real, &[6, 6, 6], forced), (1, 3));
    }

    #[test]
    fn random_expectation_and_tally() {
        assert_eq!(random_expected_hits(4, 16), 1.0);
        assert_eq!(random_expected_hits(3, 0), 0.0);
        let mut t = Tally::default();
        t.add(1.0, 3);
        t.add(3.0, 3);
        assert_eq!(t.recall(), Some(4.0 / 6.0));
        assert_eq!(t.sets, 2);
        assert_eq!(Tally::default().recall(), None);
    }
}
