//! A run compared with a saved base run, position by position (the
//! comparison llama.cpp's `perplexity --kl-divergence` and vLLM's logprob
//! tests make, on the top-K the base saved).
//!
//! At each scored position, with the base's distribution P known on its
//! top-K ids and as one remaining mass p_rest, and this run's distribution
//! Q from its full logits:
//!
//! KL(P ‖ Q) ≈ Σ_{i ∈ top-K} p_i (ln p_i − ln q_i) + p_rest (ln p_rest − ln q_rest),
//!
//! with q_rest = Q's mass outside the base's top-K ids (summed directly).
//! Merging the tail ids into one bucket can only lower the divergence (log
//! sum inequality), so this is a lower bound of the full KL, exact when
//! the base's tail mass is negligible; the report gives that mass (mean and
//! max) so the reader can judge. Both sides use f32-rounded
//! log-probabilities computed the same way, so a run compared with itself
//! gets exactly 0; rounding can otherwise leave a position a few 1e-7 below
//! zero, and each position's value is clamped at 0.
//!
//! Top-1 agreement: this run's argmax (ties to the lower id) equals the
//! base's most likely id. Δ perplexity: from the paired per-token NLL
//! differences d_i = NLL_this,i − NLL_base,i (both from f32
//! log-probabilities): ΔPPL = PPL_base · (exp(mean d) − 1), with the 95 %
//! interval PPL_base · (exp(mean d ± 1.96·se(d)) − 1), the base's mean NLL
//! held fixed.

use super::dist::{mass_outside, LogSoftmax};
use super::logits_file::PositionRecord;
use super::stats::{MeanSe, Spread, Z95};
use crate::{Error, Result};

/// What the KL figures are, for reports (text and JSON).
pub const KL_NOTE: &str = "KL(base ‖ this) over the base's top-K ids plus one bucket for the rest of the vocabulary: a lower bound of the full KL, exact when the base's tail mass is negligible";

/// One position's comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionKl {
    /// KL(base ‖ this) over the base's top-K ids plus the rest, nats (≥ 0).
    pub kl: f64,
    /// This run's argmax is the base's most likely id.
    pub top1_agree: bool,
    /// NLL_this − NLL_base of the scored token, nats (f32 log-probabilities).
    pub delta_nll: f64,
    /// NLL_base of the scored token, nats.
    pub base_nll: f64,
    /// The base's probability mass outside its top-K.
    pub base_tail: f64,
}

/// Compares this run's logits row (\[V\], normalized by `lsm`) with the base
/// run's record of the same position.
///
/// Errors: [`Error::Input`] when the record holds an id ≥ V.
pub fn compare_position(
    base: &PositionRecord,
    logits: &[f32],
    lsm: &LogSoftmax,
) -> Result<PositionKl> {
    let v = logits.len();
    let lq = |id: u32| -> Result<f64> {
        let x = logits.get(id as usize).ok_or_else(|| {
            Error::Input(format!(
                "the base run's token id {id} is outside this model's vocabulary of {v} ids"
            ))
        })?;
        Ok(f64::from(lsm.logprob(*x) as f32))
    };
    let mut kl = 0.0;
    for (&id, &lp) in base.ids.iter().zip(&base.logprobs) {
        let lq = lq(id)?;
        let lp = f64::from(lp);
        let p = lp.exp();
        if p > 0.0 {
            kl += p * (lp - lq);
        }
    }
    let p_rest = f64::from(base.rest_mass);
    if p_rest > 0.0 {
        let q_rest = f64::from(mass_outside(logits, lsm, &base.ids) as f32);
        kl += p_rest * (p_rest.ln() - q_rest.ln());
    }
    let base_nll = -f64::from(base.next_logprob);
    Ok(PositionKl {
        kl: kl.max(0.0),
        top1_agree: base.ids.first() == Some(&lsm.argmax),
        delta_nll: -lq(base.next)? - base_nll,
        base_nll,
        base_tail: p_rest,
    })
}

/// The comparison of a whole run with its base (see the module doc).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KlSummary {
    /// Positions compared.
    pub positions: usize,
    /// K of the base file.
    pub top_k: usize,
    /// Always true: the KL figures are lower bounds of the full KL.
    pub lower_bound: bool,
    /// [`KL_NOTE`].
    pub note: String,
    /// Mean KL, nats.
    pub kl_mean: f64,
    /// Standard error of the mean KL (`None` for fewer than 2 positions).
    pub kl_mean_se: Option<f64>,
    /// Median KL, nats.
    pub kl_median: f64,
    /// Nearest-rank 99th percentile of the KL, nats.
    pub kl_p99: f64,
    /// Largest KL, nats.
    pub kl_max: f64,
    /// Positions where this run's argmax is the base's top-1, %.
    pub top1_agreement_pct: f64,
    /// Binomial standard error of the agreement, percentage points.
    pub top1_agreement_se_pct: Option<f64>,
    /// Mean of the base's mass outside its top-K.
    pub base_tail_mass_mean: f64,
    /// Largest base mass outside its top-K.
    pub base_tail_mass_max: f64,
    /// The base's perplexity, exp(mean NLL_base) over the saved f32 values.
    pub base_ppl: f64,
    /// This run's perplexity on the same footing (f32 log-probabilities).
    pub this_ppl: f64,
    /// PPL_this − PPL_base.
    pub delta_ppl: f64,
    /// 95 % interval of the difference (paired, base mean held fixed).
    pub delta_ppl_ci95: Option<[f64; 2]>,
    /// Mean of the paired NLL differences, nats/token.
    pub delta_nll_mean: f64,
    /// Standard error of that mean.
    pub delta_nll_se: Option<f64>,
}

/// Collects [`PositionKl`]s of a run.
#[derive(Debug, Clone, Default)]
pub struct KlAccumulator {
    kl: Vec<f64>,
    agree: usize,
    delta_nll: Vec<f64>,
    base_nll_sum: f64,
    tail_sum: f64,
    tail_max: f64,
}

impl KlAccumulator {
    /// Adds one position.
    pub fn push(&mut self, p: &PositionKl) {
        self.kl.push(p.kl);
        self.agree += usize::from(p.top1_agree);
        self.delta_nll.push(p.delta_nll);
        self.base_nll_sum += p.base_nll;
        self.tail_sum += p.base_tail;
        self.tail_max = self.tail_max.max(p.base_tail);
    }

    /// Positions added.
    pub fn len(&self) -> usize {
        self.kl.len()
    }

    /// Whether no position was added.
    pub fn is_empty(&self) -> bool {
        self.kl.is_empty()
    }

    /// The summary, for a base file of K = `top_k` (all zeros for no positions).
    pub fn summary(&self, top_k: usize) -> KlSummary {
        let n = self.kl.len();
        let nf = n.max(1) as f64;
        let kl = MeanSe::of(&self.kl);
        let spread = Spread::of(&self.kl);
        let agree = self.agree as f64 / nf;
        let d = MeanSe::of(&self.delta_nll);
        let base_ppl = (self.base_nll_sum / nf).exp();
        KlSummary {
            positions: n,
            top_k,
            lower_bound: true,
            note: KL_NOTE.to_string(),
            kl_mean: kl.mean,
            kl_mean_se: kl.se,
            kl_median: spread.median,
            kl_p99: spread.p99,
            kl_max: spread.max,
            top1_agreement_pct: 100.0 * agree,
            top1_agreement_se_pct: (n >= 2)
                .then(|| 100.0 * (agree * (1.0 - agree) / (n - 1) as f64).sqrt()),
            base_tail_mass_mean: self.tail_sum / nf,
            base_tail_mass_max: self.tail_max,
            base_ppl,
            this_ppl: base_ppl * d.mean.exp(),
            delta_ppl: base_ppl * d.mean.exp_m1(),
            delta_ppl_ci95: d
                .se
                .map(|se| [-1.0, 1.0].map(|s| base_ppl * (d.mean + s * Z95 * se).exp_m1())),
            delta_nll_mean: d.mean,
            delta_nll_se: d.se,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(logits: &[f32], next: u32, k: usize) -> PositionRecord {
        let l = LogSoftmax::of(logits).unwrap();
        PositionRecord::from_logits(logits, &l, next, k).unwrap()
    }

    #[test]
    fn a_row_against_itself_is_exactly_zero() {
        let x: Vec<f32> = (0..50)
            .map(|i| ((i * 37 % 11) as f32) * 0.3 - 1.0)
            .collect();
        let l = LogSoftmax::of(&x).unwrap();
        for k in [1, 5, 50] {
            let p = compare_position(&record(&x, 7, k), &x, &l).unwrap();
            assert_eq!((p.kl, p.delta_nll, p.top1_agree), (0.0, 0.0, true), "k {k}");
        }
    }

    #[test]
    fn full_k_is_the_exact_kl() {
        let p: Vec<f32> = vec![2.0, 1.0, 0.0, -1.0];
        let q: Vec<f32> = vec![1.0, 2.0, 0.0, -3.0];
        let (lp, lq) = (LogSoftmax::of(&p).unwrap(), LogSoftmax::of(&q).unwrap());
        let exact: f64 = p
            .iter()
            .zip(&q)
            .map(|(&a, &b)| lp.logprob(a).exp() * (lp.logprob(a) - lq.logprob(b)))
            .sum();
        let got = compare_position(&record(&p, 0, 4), &q, &lq).unwrap();
        assert!((got.kl - exact).abs() < 1e-6, "{} vs {exact}", got.kl);
        assert!(!got.top1_agree);
        // a smaller K merges the tail: never more than the full KL
        let k1 = compare_position(&record(&p, 0, 1), &q, &lq).unwrap();
        assert!(k1.kl <= got.kl + 1e-7);
    }

    #[test]
    fn summary_of_paired_differences() {
        let mut acc = KlAccumulator::default();
        for (kl, d) in [(0.1, 0.2), (0.3, -0.1), (0.2, 0.05), (0.0, 0.1)] {
            acc.push(&PositionKl {
                kl,
                top1_agree: kl < 0.25,
                delta_nll: d,
                base_nll: 2.0,
                base_tail: 0.01,
            });
        }
        let s = acc.summary(8);
        assert_eq!((s.positions, s.top_k, s.top1_agreement_pct), (4, 8, 75.0));
        assert!((s.kl_mean - 0.15).abs() < 1e-12);
        assert!((s.base_ppl - 2f64.exp()).abs() < 1e-12);
        assert!((s.delta_ppl - (s.this_ppl - s.base_ppl)).abs() < 1e-9);
        let [lo, hi] = s.delta_ppl_ci95.unwrap();
        assert!(lo < s.delta_ppl && s.delta_ppl < hi);
    }
}
