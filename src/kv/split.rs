//! The split fetch (runtime.md §4): one layer's misses divided between the
//! copy engines (`cuMemcpyBatchAsync`) and the SM copy kernel, so that the
//! two run at once and the kernel takes SMs for a shorter time. This file
//! is the partition, a pure function of the layer's miss counts; the GPU
//! side is [`crate::cuda::ops::offload::fetch_split`].
//!
//! The rule, for `ce_pct` = P (1 … 99) and the layer's (row, KV head) miss
//! lists of n₀, n₁, … pairs (as `slot_diff` lists them, ascending block),
//! with c_k = n₀ + … + n_{k−1} the pairs before list k and
//! f(x) = ⌊(x·P + 50) / 100⌋ (x·P/100 rounded half up):
//! - the copy engines take the **last** f(c_k + n_k) − f(c_k) pairs of list
//!   k, the SM kernel the pairs before them;
//! - so the copy engines take f(T) = round(T·P/100) of the layer's T pairs
//!   in all, spread over the lists in proportion to their lengths (every
//!   list's share within one pair of n_k·P/100), and each list's share is
//!   at most n_k (f rises by at most 1 per pair, as P < 100).
//!
//! Every pair is fetched exactly once, by one engine, into the slot
//! `slot_diff` gave it, so the pool after a split fetch is bitwise the pool
//! after either engine alone. The kernel's share is a prefix of each list,
//! so it runs on the unchanged device lists with only its per-list counts
//! replaced (no list is rewritten or uploaded, only the counts).
//!
//! Why by count: every pair is one (block, head) K+V chunk of the same size
//! (2·B·D·2 bytes, 32 KiB on NOSA-8B), and two pairs of a list are
//! contiguous on both sides only when Hkv = 1 and both their blocks and
//! their slots are consecutive, so there are no larger chunks to prefer
//! for the copy engines (which need large chunks to be fast, runtime.md §4).

use crate::{Error, Result};

/// The largest copy-engine share a split takes, % (the SM kernel keeps ≥ 1 %).
pub const MAX_CE_PCT: usize = 99;
/// The smallest copy-engine share a split takes, %.
pub const MIN_CE_PCT: usize = 1;

/// One layer's split ([`split_misses`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    /// Per (row, KV head), in the order of the `nfetch` given: the pairs
    /// the SM kernel fetches, the first `sm[k]` of list k (i32, the type
    /// of the kernel's `nfetch` argument).
    pub sm: Vec<i32>,
    /// Pairs of the layer the SM kernel fetches, Σ `sm`.
    pub sm_chunks: usize,
    /// Pairs the copy engines fetch: the rest of every list.
    pub ce_chunks: usize,
}

impl SplitPlan {
    /// Pairs of the layer, both engines together.
    pub fn total(&self) -> usize {
        self.sm_chunks + self.ce_chunks
    }
}

/// round(x·P/100), half up.
fn ce_share(x: usize, ce_pct: usize) -> usize {
    (x * ce_pct + 50) / 100
}

/// Checks a copy-engine share, %: 1 … 99 (`what` names it in the error).
///
/// Errors: [`Error::Input`] naming `what` and the range otherwise.
pub fn check_ce_pct(ce_pct: usize, what: &str) -> Result<()> {
    if (MIN_CE_PCT..=MAX_CE_PCT).contains(&ce_pct) {
        Ok(())
    } else {
        Err(Error::Input(format!(
            "{what}: copy-engine share {ce_pct} % (give {MIN_CE_PCT} … {MAX_CE_PCT})"
        )))
    }
}

/// Divides one layer's misses between the SM kernel and the copy engines
/// (the module doc gives the rule): `nfetch` i32 \[rows·Hkv\] as `slot_diff`
/// wrote it (negative counts are 0, as the kernel reads them), `slots` the
/// pool size S, `ce_pct` the copy engines' share in % (1 … 99).
/// Deterministic: the same counts always give the same plan.
///
/// Errors: [`Error::Input`] for a share outside 1 … 99 or a count above
/// `slots` (naming the (row, head) index).
pub fn split_misses(nfetch: &[i32], slots: usize, ce_pct: usize) -> Result<SplitPlan> {
    check_ce_pct(ce_pct, "split fetch")?;
    let mut sm = Vec::with_capacity(nfetch.len());
    let (mut before, mut ce_total) = (0usize, 0usize);
    for (k, &n) in nfetch.iter().enumerate() {
        let n = n.max(0) as usize;
        if n > slots {
            return Err(Error::Input(format!(
                "split fetch: nfetch {n} > {slots} slots at (row, head) {k}"
            )));
        }
        let ce = ce_share(before + n, ce_pct) - ce_share(before, ce_pct);
        before += n;
        ce_total += ce;
        // n ≤ slots ≤ i32 range of the device lists
        sm.push((n - ce) as i32);
    }
    Ok(SplitPlan {
        sm,
        sm_chunks: before - ce_total,
        ce_chunks: ce_total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_copy_engines_take_the_rounded_share_spread_over_the_lists() {
        let p = split_misses(&[4, 0, 3, 5], 8, 50).unwrap();
        // T = 12, round(6) = 6; prefix shares 0,2 | 2,2 | 2,4 (f(7)=4) | 4,6
        assert_eq!(p.ce_chunks, 6);
        assert_eq!(p.sm_chunks, 6);
        assert_eq!(p.sm, vec![2, 0, 1, 3]);
        assert_eq!(p.total(), 12);
        // rounding half up: T = 1 at 50 % goes to the copy engines
        let p = split_misses(&[1], 4, 50).unwrap();
        assert_eq!((p.sm, p.ce_chunks), (vec![0], 1));
        let p = split_misses(&[1], 4, 49).unwrap();
        assert_eq!((p.sm, p.ce_chunks), (vec![1], 0));
        // negative counts are empty lists; nothing to fetch is an empty plan
        let p = split_misses(&[-3, 0], 4, 25).unwrap();
        assert_eq!((p.sm, p.sm_chunks, p.ce_chunks), (vec![0, 0], 0, 0));
        assert_eq!(split_misses(&[], 4, 25).unwrap().total(), 0);
    }

    #[test]
    fn every_pair_goes_to_exactly_one_engine_and_the_plan_is_deterministic() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for _ in 0..2000 {
            let s = rng.random_range(1..=64usize);
            let lists = rng.random_range(0..40usize);
            let nf: Vec<i32> = (0..lists)
                .map(|_| rng.random_range(-1..=s as i32))
                .collect();
            let pct = rng.random_range(1..=99usize);
            let p = split_misses(&nf, s, pct).unwrap();
            assert_eq!(p, split_misses(&nf, s, pct).unwrap());
            let total: usize = nf.iter().map(|&n| n.max(0) as usize).sum();
            assert_eq!(p.total(), total);
            assert_eq!(p.ce_chunks, (total * pct + 50) / 100);
            assert_eq!(p.sm_chunks, p.sm.iter().map(|&x| x as usize).sum::<usize>());
            for (k, (&n, &m)) in nf.iter().zip(&p.sm).enumerate() {
                let n = n.max(0);
                assert!((0..=n).contains(&m), "list {k}: sm {m} of {n}");
                // each list's share is within one pair of its exact share
                let ce = (n - m) as f64;
                assert!((ce - n as f64 * pct as f64 / 100.0).abs() <= 1.0);
            }
        }
    }

    /// The SM kernel's share as its copies: the first `sm[k]` pairs of each
    /// list at the kernel's addresses (kernels/kv_offload.cu kv_fetch_sm).
    fn kernel_copies(
        fetch: &[i32],
        sm: &[i32],
        s: usize,
        hkv: usize,
        rows: &[crate::cuda::ops::offload::DmaRow],
        chunk: usize,
    ) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (rh, &n) in sm.iter().enumerate() {
            let (r, h) = (rh / hkv, rh % hkv);
            for i in 0..n as usize {
                let (slot, block) = (fetch[(rh * s + i) * 2], fetch[(rh * s + i) * 2 + 1]);
                out.push((
                    rows[r].host + (block as usize * hkv * chunk + h * chunk) as u64,
                    rows[r].pool + ((h * s + slot as usize) * chunk) as u64,
                ));
            }
        }
        out
    }

    #[test]
    fn the_two_shares_copy_every_chunk_once_to_the_slots_of_the_whole_fetch() {
        use crate::cuda::ops::offload::{dma_copies, DmaRow};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let (bs, d) = (64usize, 128usize);
        let chunk = 2 * bs * d * 2;
        for _ in 0..300 {
            let (rows_n, hkv, s) = (
                rng.random_range(1..5usize),
                rng.random_range(1..4usize),
                rng.random_range(1..12usize),
            );
            let rows: Vec<DmaRow> = (0..rows_n)
                .map(|r| DmaRow {
                    host: (r as u64 + 1) << 40,
                    pool: (r as u64 + 1) << 32,
                })
                .collect();
            let mut fetch = Vec::new();
            let mut nfetch = Vec::new();
            for _ in 0..rows_n * hkv {
                let n = rng.random_range(0..=s);
                let mut slots: Vec<usize> = (0..s).collect();
                slots.sort_by_key(|_| rng.random::<u32>());
                for (i, &slot) in slots.iter().enumerate() {
                    if i < n {
                        fetch.extend([slot as i32, (3 * i + 1) as i32]);
                    } else {
                        fetch.extend([-7, -7]);
                    }
                }
                nfetch.push(n as i32);
            }
            let whole = dma_copies(&fetch, &nfetch, None, s, hkv, &rows, bs, d).unwrap();
            let pct = rng.random_range(1..=99usize);
            let plan = split_misses(&nfetch, s, pct).unwrap();
            let ce = dma_copies(&fetch, &nfetch, Some(&plan.sm), s, hkv, &rows, bs, d).unwrap();
            let sm = kernel_copies(&fetch, &plan.sm, s, hkv, &rows, chunk);
            assert_eq!((sm.len(), ce.len()), (plan.sm_chunks, plan.ce_chunks));
            let mut both: Vec<(u64, u64)> = sm.into_iter().chain(ce).collect();
            let mut all = whole.clone();
            both.sort_unstable();
            all.sort_unstable();
            assert_eq!(both, all, "each chunk once, to the same slot");
            // no destination written twice
            let mut dst: Vec<u64> = all.iter().map(|c| c.1).collect();
            dst.sort_unstable();
            dst.dedup();
            assert_eq!(dst.len(), whole.len());
        }
        // a count from the split outside 0 … nfetch is refused
        let rows = [DmaRow {
            host: 1 << 40,
            pool: 1 << 32,
        }];
        let e = dma_copies(&[0, 1, 1, 2], &[2], Some(&[3]), 2, 1, &rows, bs, d)
            .unwrap_err()
            .to_string();
        assert!(e.contains("SM count 3 is outside 0 … 2"), "{e}");
    }

    #[test]
    fn bad_shares_and_counts_are_refused_with_their_values() {
        for pct in [0, 100, 250] {
            let e = split_misses(&[1], 4, pct).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{pct} %")) && e.contains("1 … 99"),
                "{e}"
            );
        }
        let e = split_misses(&[2, 9], 8, 50).unwrap_err().to_string();
        assert!(e.contains("nfetch 9 > 8 slots at (row, head) 1"), "{e}");
    }
}
