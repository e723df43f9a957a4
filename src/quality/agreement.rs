//! A run's full next-token distributions against a reference's, position
//! by position, and the whole-model rule of spec/testing.md "Tolerances"
//! that judges a bf16 engine against what bf16 arithmetic itself costs.
//!
//! Where both sides' full logits are in memory (`gpu-check-e2e`), the KL
//! divergence is exact: KL(P ‖ Q) = Σ_j p_j (ln p_j − ln q_j) over every id
//! of the vocabulary, P the reference's distribution (the f32 CPU
//! reference), Q the run's, both from [`LogSoftmax`] in f64. (A run
//! compared with a *saved* base, which keeps only its top-K, uses the
//! bounded form of [`super::kl`].)
//!
//! The rule ([`judge`]): under teacher forcing on the same tokens, the
//! engine (GPU, bf16 activations) and the CPU reference with bf16 rounding
//! at the engine's points (the *emulated* reference) are both compared with
//! the f32 CPU reference. The engine passes when
//! - its mean and p99 KL are ≤ [`KL_RATIO`] × the emulated reference's,
//! - its top-1 agreement is ≥ the emulated reference's minus
//!   [`TOP1_SLACK_PP`] percentage points, or one position where fewer than
//!   100 are judged ([`top1_slack_pp`]),
//! - at every position its top-1 id is among the reference's top
//!   [`TOP_N`] and the reference's top-1 among its top [`TOP_N`].

use super::dist::{top_k_ids, LogSoftmax};
use super::stats::nearest_rank;
use crate::Result;

/// The engine's mean and p99 KL may be at most this multiple of the
/// bf16-emulated reference's (spec/testing.md "Tolerances").
pub const KL_RATIO: f64 = 1.5;

/// The engine's top-1 agreement may be this many percentage points below
/// the bf16-emulated reference's (spec/testing.md "Tolerances").
pub const TOP1_SLACK_PP: f64 = 1.0;

/// The top-1 slack in percentage points over `positions` judged positions:
/// [`TOP1_SLACK_PP`], or one position's share where that is larger (fewer
/// than 100 positions). The spec states the rule for ≥ 256 positions; on
/// fewer, 1 pp is less than one position and the rule would forbid a
/// single flipped near-tie (measured: a tiny NOSA case with 86 judged
/// positions, top-1 85/86 against the emulated reference's 86/86, KL below
/// the emulated reference's).
pub fn top1_slack_pp(positions: usize) -> f64 {
    if positions == 0 {
        return TOP1_SLACK_PP;
    }
    TOP1_SLACK_PP.max(100.0 / positions as f64)
}

/// Each side's top-1 id must be among the other's top `TOP_N` ids at every
/// position (spec/testing.md "Tolerances").
pub const TOP_N: usize = 5;

/// One position: a run's distribution against the reference's.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PositionAgreement {
    /// KL(reference ‖ run) over the whole vocabulary, nats (≥ 0; clamped
    /// at 0 against rounding).
    pub kl: f64,
    /// The run's top-1 id equals the reference's (ties to the lower id).
    pub top1_equal: bool,
    /// The run's top-1 id is among the reference's top [`TOP_N`].
    pub top1_in_reference_top_n: bool,
    /// The reference's top-1 id is among the run's top [`TOP_N`].
    pub reference_top1_in_top_n: bool,
}

/// Compares one position's logits (`reference` and `run`, each \[V\], f32).
///
/// Errors: [`crate::Error::Input`] when either row's distribution is
/// undefined (a NaN or +∞ logit, no finite logit; [`LogSoftmax::of`]) or
/// the rows' lengths differ.
pub fn compare_full(reference: &[f32], run: &[f32]) -> Result<PositionAgreement> {
    if reference.len() != run.len() {
        return Err(crate::Error::Input(format!(
            "logits rows of different lengths: reference {} ids, run {} ids",
            reference.len(),
            run.len()
        )));
    }
    let p = LogSoftmax::of(reference)?;
    let q = LogSoftmax::of(run)?;
    let kl: f64 = reference
        .iter()
        .zip(run)
        .map(|(&x, &y)| {
            let lp = p.logprob(x);
            let pj = lp.exp();
            if pj == 0.0 {
                0.0
            } else {
                pj * (lp - q.logprob(y))
            }
        })
        .sum();
    let ref_top = top_k_ids(reference, TOP_N);
    let run_top = top_k_ids(run, TOP_N);
    Ok(PositionAgreement {
        kl: kl.max(0.0),
        top1_equal: p.argmax == q.argmax,
        top1_in_reference_top_n: ref_top.contains(&q.argmax),
        reference_top1_in_top_n: run_top.contains(&p.argmax),
    })
}

/// The summary of a run's positions against the reference.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct AgreementSummary {
    /// Positions compared.
    pub positions: usize,
    /// Mean KL(reference ‖ run), nats.
    pub kl_mean: f64,
    /// Nearest-rank 99th percentile of the per-position KL, nats.
    pub kl_p99: f64,
    /// Largest per-position KL, nats.
    pub kl_max: f64,
    /// Positions whose top-1 id equals the reference's, % of positions.
    pub top1_agreement_pct: f64,
    /// Positions where the run's top-1 is outside the reference's top
    /// [`TOP_N`] or the reference's top-1 outside the run's.
    pub top_n_misses: usize,
}

impl AgreementSummary {
    /// The summary of `positions` (an empty slice gives zero positions and
    /// NaN figures).
    pub fn of(positions: &[PositionAgreement]) -> AgreementSummary {
        let n = positions.len();
        if n == 0 {
            return AgreementSummary {
                positions: 0,
                kl_mean: f64::NAN,
                kl_p99: f64::NAN,
                kl_max: f64::NAN,
                top1_agreement_pct: f64::NAN,
                top_n_misses: 0,
            };
        }
        let mut kl: Vec<f64> = positions.iter().map(|p| p.kl).collect();
        kl.sort_by(f64::total_cmp);
        AgreementSummary {
            positions: n,
            kl_mean: kl.iter().sum::<f64>() / n as f64,
            kl_p99: nearest_rank(&kl, 0.99),
            kl_max: kl[n - 1],
            top1_agreement_pct: 100.0 * positions.iter().filter(|p| p.top1_equal).count() as f64
                / n as f64,
            top_n_misses: positions
                .iter()
                .filter(|p| !(p.top1_in_reference_top_n && p.reference_top1_in_top_n))
                .count(),
        }
    }
}

/// The verdict of [`judge`]: pass, and each failed condition in words with
/// its numbers.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RuleOutcome {
    /// Every condition holds.
    pub pass: bool,
    /// The failed conditions (empty when `pass`).
    pub failures: Vec<String>,
}

/// Judges an engine's summary against the bf16-emulated reference's (both
/// against the f32 reference, same positions): the conditions of the
/// module doc. Both summaries must cover at least one position.
pub fn judge(engine: &AgreementSummary, emulated: &AgreementSummary) -> RuleOutcome {
    let mut failures = Vec::new();
    if engine.positions == 0 || engine.positions != emulated.positions {
        failures.push(format!(
            "positions: engine {}, emulated reference {} (must be equal and > 0)",
            engine.positions, emulated.positions
        ));
    }
    // A NaN figure fails each condition (`within` is false for NaN).
    let within = |x: f64, limit: f64| x.partial_cmp(&limit).is_some_and(|o| o.is_le());
    if !within(engine.kl_mean, KL_RATIO * emulated.kl_mean) {
        failures.push(format!(
            "mean KL {:.3e} > {KL_RATIO} × the emulated reference's {:.3e}",
            engine.kl_mean, emulated.kl_mean
        ));
    }
    if !within(engine.kl_p99, KL_RATIO * emulated.kl_p99) {
        failures.push(format!(
            "p99 KL {:.3e} > {KL_RATIO} × the emulated reference's {:.3e}",
            engine.kl_p99, emulated.kl_p99
        ));
    }
    let slack = top1_slack_pp(engine.positions);
    // a hair of tolerance: agreement percentages of equal counts are equal,
    // but k/n − 100/n is not exactly (k − 1)/n in f64
    if !within(
        emulated.top1_agreement_pct - slack - 1e-9,
        engine.top1_agreement_pct,
    ) {
        failures.push(format!(
            "top-1 agreement {:.2} % < the emulated reference's {:.2} % − {slack:.2} pp ({} positions)",
            engine.top1_agreement_pct, emulated.top1_agreement_pct, engine.positions
        ));
    }
    if engine.top_n_misses > 0 {
        failures.push(format!(
            "{} of {} positions have a top-1 id outside the other side's top {TOP_N}",
            engine.top_n_misses, engine.positions
        ));
    }
    RuleOutcome {
        pass: failures.is_empty(),
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(kl_mean: f64, kl_p99: f64, top1: f64, misses: usize) -> AgreementSummary {
        AgreementSummary {
            positions: 300,
            kl_mean,
            kl_p99,
            kl_max: kl_p99 * 2.0,
            top1_agreement_pct: top1,
            top_n_misses: misses,
        }
    }

    #[test]
    fn the_top1_slack_is_one_position_below_100_positions() {
        assert_eq!(top1_slack_pp(300), TOP1_SLACK_PP);
        assert_eq!(top1_slack_pp(100), TOP1_SLACK_PP);
        assert!((top1_slack_pp(86) - 100.0 / 86.0).abs() < 1e-12);
        let at = |n: usize, k: usize| AgreementSummary {
            positions: n,
            kl_mean: 1e-6,
            kl_p99: 2e-6,
            kl_max: 3e-6,
            top1_agreement_pct: 100.0 * k as f64 / n as f64,
            top_n_misses: 0,
        };
        // 86 judged: one flip passes, two fail
        assert!(judge(&at(86, 85), &at(86, 86)).pass);
        assert!(!judge(&at(86, 84), &at(86, 86)).pass);
        // 300 judged: 1 pp is three positions
        assert!(judge(&at(300, 297), &at(300, 300)).pass);
        assert!(!judge(&at(300, 296), &at(300, 300)).pass);
    }

    #[test]
    fn identical_rows_agree_with_zero_kl() {
        let x = [0.3f32, -1.0, 2.5, 0.0, 1.25, -0.5, 0.7];
        let a = compare_full(&x, &x).unwrap();
        assert_eq!(a.kl, 0.0);
        assert!(a.top1_equal && a.top1_in_reference_top_n && a.reference_top1_in_top_n);
    }

    #[test]
    fn kl_equals_the_direct_sum() {
        let p = [1.0f32, 2.0, 0.5, -1.0];
        let q = [1.5f32, 1.0, 0.5, 0.0];
        let lse = |v: &[f32]| v.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        let (lp, lq) = (lse(&p), lse(&q));
        let want: f64 = p
            .iter()
            .zip(&q)
            .map(|(&x, &y)| {
                let a = f64::from(x) - lp;
                a.exp() * (a - (f64::from(y) - lq))
            })
            .sum();
        let got = compare_full(&p, &q).unwrap();
        assert!((got.kl - want).abs() < 1e-12, "{} vs {want}", got.kl);
        assert!(got.kl > 0.1);
        // p's top-1 is id 1, q's is id 0: both within each other's top 5 of 4 ids.
        assert!(!got.top1_equal);
        assert!(got.top1_in_reference_top_n && got.reference_top1_in_top_n);
    }

    #[test]
    fn a_top1_outside_the_other_top_n_is_counted() {
        // Reference: id 0 far ahead; run: id 7 first, id 0 ranked last.
        let r: Vec<f32> = (0..8)
            .map(|i| if i == 0 { 9.0 } else { i as f32 * 0.1 })
            .collect();
        let mut q: Vec<f32> = (0..8).map(|i| i as f32).collect();
        q[0] = -5.0;
        let a = compare_full(&r, &q).unwrap();
        assert!(!a.reference_top1_in_top_n);
        let s = AgreementSummary::of(&[a, compare_full(&r, &r).unwrap()]);
        assert_eq!(s.top_n_misses, 1);
        assert_eq!(s.top1_agreement_pct, 50.0);
        assert_eq!(s.kl_max, s.kl_p99);
        assert!((s.kl_mean - a.kl / 2.0).abs() < 1e-12);
    }

    #[test]
    fn undefined_rows_and_length_mismatches_are_errors() {
        assert!(compare_full(&[f32::NAN, 1.0], &[0.0, 1.0]).is_err());
        assert!(compare_full(&[0.0, 1.0], &[f32::INFINITY, 1.0]).is_err());
        let e = compare_full(&[0.0, 1.0], &[0.0]).unwrap_err().to_string();
        assert!(e.contains("reference 2 ids, run 1 ids"), "{e}");
    }

    #[test]
    fn the_rule_passes_within_its_margins_and_names_each_failure() {
        let emu = summary(1e-3, 1e-2, 95.0, 0);
        assert!(judge(&summary(1.5e-3, 1.5e-2, 94.0, 0), &emu).pass);
        let o = judge(&summary(1.6e-3, 1.6e-2, 93.9, 2), &emu);
        assert!(!o.pass);
        assert_eq!(o.failures.len(), 4, "{:?}", o.failures);
        assert!(
            o.failures[0].starts_with("mean KL 1.600e-3"),
            "{:?}",
            o.failures
        );
        assert!(o.failures[1].starts_with("p99 KL"));
        assert!(o.failures[2].contains("93.90 %"));
        assert!(o.failures[3].starts_with("2 of 300 positions"));
        // A NaN figure fails.
        assert!(!judge(&summary(f64::NAN, 1e-2, 95.0, 0), &emu).pass);
        // Different position counts fail.
        let mut short = emu;
        short.positions = 10;
        assert!(!judge(&emu, &short).pass);
    }
}
