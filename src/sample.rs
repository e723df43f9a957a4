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

/// Index of the largest logit, ties to the lower index; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler with its RNG seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            params,
            rng: StdRng::seed_from_u64(params.seed),
        }
    }

    /// Draws the next token from `logits` ([V], f32).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature == 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let mut idx: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .collect();
        if idx.is_empty() {
            return argmax(logits);
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
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (j, pr) in probs.iter().enumerate() {
            if u < *pr {
                return idx[j] as u32;
            }
            u -= pr;
        }
        idx[idx.len() - 1] as u32
    }
}
