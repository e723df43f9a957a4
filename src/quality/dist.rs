//! The next-token distribution of one logits row: log-softmax in f64,
//! argmax, top-K ids and the probability mass outside a set of ids, each
//! computed in one fixed order so that identical logits give bitwise
//! identical results (a run compared with itself has KL exactly 0).

use crate::{Error, Result};

/// The log-softmax normalizer of one logits row x \[V\]:
/// ln p_j = x_j − lse with lse = max + ln Σ_j exp(x_j − max), in f64, the
/// sum taken over ascending ids.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSoftmax {
    /// max_j x_j.
    pub max: f64,
    /// Σ_j exp(x_j − max) (≥ 1).
    pub sum: f64,
    /// ln Σ_j exp(x_j): the log-partition function.
    pub lse: f64,
    /// The most likely id (ties to the lower id).
    pub argmax: u32,
}

impl LogSoftmax {
    /// The normalizer of `logits` (\[V\], V ≥ 1).
    ///
    /// Errors: [`Error::Input`] for an empty row, a NaN or +∞ logit, or a row
    /// without a finite logit (−∞ entries are allowed: probability 0).
    pub fn of(logits: &[f32]) -> Result<LogSoftmax> {
        let mut max = f32::NEG_INFINITY;
        let mut argmax = None;
        for (j, &x) in logits.iter().enumerate() {
            if x.is_nan() || x == f32::INFINITY {
                return Err(Error::Input(format!(
                    "logit {x} at id {j}: the next-token distribution is undefined"
                )));
            }
            if x > max {
                max = x;
                argmax = Some(j as u32);
            }
        }
        let argmax = argmax.ok_or_else(|| {
            Error::Input(format!(
                "a logits row of {} ids has no finite logit",
                logits.len()
            ))
        })?;
        let max = f64::from(max);
        let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
        Ok(LogSoftmax {
            max,
            sum,
            lse: max + sum.ln(),
            argmax,
        })
    }

    /// ln p of logit `x`: x − lse (nats, ≤ 0).
    pub fn logprob(&self, x: f32) -> f64 {
        f64::from(x) - self.lse
    }
}

/// The `k` most likely ids of `logits` (\[V\]; k is capped at V), by
/// descending logit, ties to the lower id. No NaN may be present (see
/// [`LogSoftmax::of`]).
pub fn top_k_ids(logits: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(logits.len());
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx
}

/// The probability mass of `logits` outside `ids`: Σ_{j ∉ ids} exp(x_j − max)
/// over ascending j, divided by [`LogSoftmax::sum`]. 0 when `ids` covers
/// every id. Ids ≥ V are ignored.
pub fn mass_outside(logits: &[f32], lsm: &LogSoftmax, ids: &[u32]) -> f64 {
    let mut inside = vec![false; logits.len()];
    for &i in ids {
        if let Some(m) = inside.get_mut(i as usize) {
            *m = true;
        }
    }
    let rest: f64 = logits
        .iter()
        .zip(&inside)
        .filter(|(_, &m)| !m)
        .map(|(&x, _)| (f64::from(x) - lsm.max).exp())
        .sum();
    rest / lsm.sum
}

/// A chosen token's log-probability and the most likely alternatives at
/// its position, under the model's own distribution: log-softmax of the raw
/// logits (temperature 1, before top-k/top-p), as the OpenAI and vLLM APIs
/// report `logprob` and `top_logprobs` (`generate --logprobs`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    /// The chosen token id.
    pub token: u32,
    /// Its log-probability, nats (≤ 0); NaN when the row's distribution is
    /// undefined (a NaN or +∞ logit, or no finite logit).
    pub logprob: f32,
    /// The K most likely ids with their log-probabilities, by [`top_k_ids`]'
    /// order (descending, ties to the lower id); empty when undefined.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// [`TokenLogprob`] of `token` and the `k` most likely ids of a logits row
/// (\[V\], f32), with [`LogSoftmax`] and [`top_k_ids`]: the same numbers a
/// `perplexity` run saves. Never fails: an undefined distribution gives NaN
/// and no alternatives, a `token` ≥ V a NaN logprob.
pub fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    match LogSoftmax::of(logits) {
        Ok(ls) => TokenLogprob {
            token,
            logprob: logits
                .get(token as usize)
                .map_or(f32::NAN, |&x| ls.logprob(x) as f32),
            top_logprobs: top_k_ids(logits, k)
                .into_iter()
                .map(|i| (i, ls.logprob(logits[i as usize]) as f32))
                .collect(),
        },
        Err(_) => TokenLogprob {
            token,
            logprob: f32::NAN,
            top_logprobs: Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_logprobs_rank_ties_to_the_lower_id_and_refuse_undefined_rows() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, -2.0];
        let t = token_logprobs(&logits, 4, 3);
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp()).ln();
        assert!((t.logprob as f64 - (-2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = t.top_logprobs.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert!((t.top_logprobs[0].1 as f64 - (3.0 - lse)).abs() < 1e-6);
        // a token past V: NaN, not a panic
        assert!(token_logprobs(&logits, 9, 1).logprob.is_nan());
        // a NaN logit makes the distribution undefined: NaN, no alternatives
        let bad = token_logprobs(&[0.5, f32::NAN], 0, 2);
        assert!(bad.logprob.is_nan() && bad.top_logprobs.is_empty());
    }

    #[test]
    fn log_softmax_normalizes() {
        let x = [1.0f32, 3.0, -2.0, 3.0, f32::NEG_INFINITY];
        let l = LogSoftmax::of(&x).unwrap();
        let total: f64 = x.iter().map(|&v| l.logprob(v).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert_eq!(l.argmax, 1, "ties go to the lower id");
        assert!(LogSoftmax::of(&[f32::NAN]).is_err());
        assert!(LogSoftmax::of(&[f32::INFINITY]).is_err());
        assert!(LogSoftmax::of(&[f32::NEG_INFINITY]).is_err());
        assert!(LogSoftmax::of(&[]).is_err());
    }

    #[test]
    fn top_k_orders_by_logit_then_id() {
        let x = [0.5f32, 2.0, 2.0, -1.0, 1.0];
        assert_eq!(top_k_ids(&x, 3), vec![1, 2, 4]);
        assert_eq!(top_k_ids(&x, 9), vec![1, 2, 4, 0, 3]);
        assert!(top_k_ids(&x, 0).is_empty());
    }

    #[test]
    fn mass_outside_is_the_complement() {
        let x = [0.5f32, 2.0, 2.0, -1.0, 1.0];
        let l = LogSoftmax::of(&x).unwrap();
        let ids = top_k_ids(&x, 2);
        let inside: f64 = ids.iter().map(|&i| l.logprob(x[i as usize]).exp()).sum();
        assert!((mass_outside(&x, &l, &ids) + inside - 1.0).abs() < 1e-12);
        assert_eq!(mass_outside(&x, &l, &[0, 1, 2, 3, 4]), 0.0);
    }
}
