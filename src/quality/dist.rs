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

#[cfg(test)]
mod tests {
    use super::*;

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
