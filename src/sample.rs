//! Token sampling: greedy, temperature, top-k, top-p, seeded; stop rules.

use crate::{Error, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling parameters (`--temperature`, `--top-k`, `--top-p`, `--seed`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 → greedy (argmax, ties to the lower id); > 0 divides the logits.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1 = no limit).
    pub top_p: f32,
    /// RNG seed: the same seed, logits and parameters give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges: temperature ≥ 0 and finite, 0 < top_p ≤ 1.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::Input(format!(
                "--temperature must be a finite value ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!(
                "--top-p must lie in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A seeded sampler for one sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest logit, ties to the lower index; NaN never wins
/// (a row of only NaN gives 0, as the GPU's argmax kernels do).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || (logits[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best as u32
}

/// A chosen token's log-probability and the most likely alternatives at
/// its position, under the model's own distribution: log-softmax of the raw
/// logits (temperature 1, before top-k/top-p), as the OpenAI and vLLM APIs
/// report `logprob` and `top_logprobs`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    /// The chosen token id.
    pub token: u32,
    /// Its log-probability, nats (≤ 0; NaN when the row has no finite logit).
    pub logprob: f32,
    /// The K most likely ids with their log-probabilities, descending (ties
    /// to the lower id; NaN logits never listed).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// [`TokenLogprob`] of `token` and the `k` most likely ids of a logits row
/// (\[V\], f32): log p(i) = logit_i − log Σ_j exp(logit_j), the sum taken in
/// f64 over the finite logits, with the largest subtracted first.
///
/// Panics: never; a `token` ≥ V gets logprob NaN.
pub fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let s: f64 = logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| f64::from(x - max).exp())
            .sum();
        f64::from(max) + s.ln()
    } else {
        f64::NAN
    };
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    let mut order: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| !logits[i as usize].is_nan())
        .collect();
    let k = k.min(order.len());
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
    }
    order.truncate(k);
    order.sort_by(by_logit);
    TokenLogprob {
        token,
        logprob: logits.get(token as usize).map_or(f32::NAN, |&x| lp(x)),
        top_logprobs: order
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

impl Sampler {
    /// A sampler with its RNG seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            params,
            rng: StdRng::seed_from_u64(params.seed),
        }
    }

    /// The parameters this sampler was made with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether a draw picks the argmax without using the RNG
    /// (temperature 0 or top_k 1).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
    }

    /// The next uniform draw in [0, 1) of this sampler's RNG: what
    /// [`Sampler::sample`] consumes per non-greedy token. A GPU sampler that
    /// is handed it ([`sample_with_u`]'s rule) picks the token the CPU would
    /// pick from the same logits.
    pub fn draw(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Draws the next token from `logits` (\[V\], f32): the argmax when greedy
    /// or when no logit is finite (no draw then), else [`sample_with_u`]
    /// with the next [`Sampler::draw`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() || !logits.iter().any(|x| x.is_finite()) {
            return argmax(logits);
        }
        let u = self.draw();
        sample_with_u(&self.params, logits, u)
    }
}

/// Temperature / top-k / top-p sampling of `logits` (\[V\], f32) with the
/// uniform draw `u01` in [0, 1) (the rule of the GPU kernel
/// kernels/sample.cu as well):
/// 1. the finite logits, ordered by logit descending, then index ascending;
/// 2. `top_k` > 0 keeps the first `top_k`;
/// 3. p_i = exp(f64((l_i − max) / T)), normalised by their sum;
/// 4. `top_p` < 1 keeps the shortest prefix whose cumulative mass reaches
///    `top_p`;
/// 5. returns the token where the cumulative mass of that prefix first
///    exceeds `u01` × its total (the last one if rounding leaves none).
///
/// Greedy parameters (T = 0 or top_k = 1) and rows without a finite logit
/// give [`argmax`].
pub fn sample_with_u(p: &SamplingParams, logits: &[f32], u01: f64) -> u32 {
    match sample_order(p, logits) {
        None => argmax(logits),
        Some((idx, probs)) => {
            let total: f64 = probs.iter().sum();
            let mut u = u01 * total;
            for (j, pr) in probs.iter().enumerate() {
                if u < *pr {
                    return idx[j] as u32;
                }
                u -= pr;
            }
            idx[idx.len() - 1] as u32
        }
    }
}

/// How close `u01` lies to a point where [`sample_with_u`] would switch
/// tokens, relative to the kept mass: the distance of u01·total to the
/// nearest cumulative boundary of the kept prefix, and of `top_p` to the
/// nearest cumulative mass where the top-p cut would move. Two correct
/// implementations that sum in different orders may disagree only when this
/// is within a few f64 ulps (≈ 1e-15). `f64::INFINITY` for greedy rows.
pub fn sample_margin(p: &SamplingParams, logits: &[f32], u01: f64) -> f64 {
    let Some((_, probs)) = sample_order(p, logits) else {
        return f64::INFINITY;
    };
    let mut margin = f64::INFINITY;
    if p.top_p < 1.0 {
        // the cut of step 4, over the normalised masses before it
        let (_, all) = sample_order(&SamplingParams { top_p: 1.0, ..*p }, logits)
            .expect("the same finite logits");
        let mut acc = 0.0;
        for pr in &all {
            acc += pr;
            margin = margin.min((acc - p.top_p as f64).abs());
        }
    }
    let total: f64 = probs.iter().sum();
    let target = u01 * total;
    let mut acc = 0.0;
    for pr in &probs {
        acc += pr;
        margin = margin.min((acc - target).abs() / total.max(f64::MIN_POSITIVE));
    }
    margin
}

/// Steps 1–4 of [`sample_with_u`]: the kept token ids in order and their
/// normalised masses; `None` when greedy or no logit is finite.
fn sample_order(p: &SamplingParams, logits: &[f32]) -> Option<(Vec<usize>, Vec<f64>)> {
    if p.temperature == 0.0 || p.top_k == 1 {
        return None;
    }
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if idx.is_empty() {
        return None;
    }
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if p.top_k > 0 {
        idx.truncate(p.top_k);
    }
    let mx = logits[idx[0]];
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - mx) / p.temperature) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (j, pr) in probs.iter().enumerate() {
            acc += pr;
            if acc >= p.top_p as f64 {
                keep = j + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
    }
    Some((idx, probs))
}

#[cfg(test)]
mod logprob_tests {
    use super::*;

    #[test]
    fn token_logprobs_rank_ties_to_the_lower_id_and_skip_nan() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let t = token_logprobs(&logits, 4, 3);
        // log Σ exp over the finite logits
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp()).ln();
        assert!((t.logprob as f64 - (-2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = t.top_logprobs.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert!((t.top_logprobs[0].1 as f64 - (3.0 - lse)).abs() < 1e-6);
        // k past the finite count lists every non-NaN id; a NaN token has NaN logprob
        let all = token_logprobs(&logits, 2, 10);
        assert_eq!(all.top_logprobs.len(), 4);
        assert!(all.logprob.is_nan());
        // no finite logit: NaN, not a panic
        let none = token_logprobs(&[f32::NAN, f32::NAN], 0, 1);
        assert!(none.logprob.is_nan() && none.top_logprobs.is_empty());
    }
}
