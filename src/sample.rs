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

/// Why no token can be chosen from a logits row ([`check_logits`]). The
/// GPU's argmax and sampling kernels report the same faults, with the same
/// numbers, through the device error record
/// ([`crate::cuda::device_error::DeviceErrorKind::LogitsNan`] and its
/// siblings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFault {
    /// At least one NaN: `id` is the lowest id holding one, `count` how many
    /// of the row's `vocab` entries are NaN.
    Nan {
        /// Lowest id holding a NaN.
        id: usize,
        /// NaN entries in the row.
        count: usize,
        /// Entries in the row (V).
        vocab: usize,
    },
    /// No NaN, but at least one +∞: `id` is the lowest id holding one,
    /// `count` how many entries are +∞.
    PosInf {
        /// Lowest id holding +∞.
        id: usize,
        /// +∞ entries in the row.
        count: usize,
        /// Entries in the row (V).
        vocab: usize,
    },
    /// No finite entry: every entry is −∞ (or the row is empty).
    NoFinite {
        /// Entries in the row (V).
        vocab: usize,
    },
}

impl std::fmt::Display for LogitsFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            LogitsFault::Nan { id, count, vocab } => {
                write!(f, "NaN at id {id} ({count} of {vocab} entries NaN)")
            }
            LogitsFault::PosInf { id, count, vocab } => {
                write!(f, "+inf at id {id} ({count} of {vocab} entries +inf)")
            }
            LogitsFault::NoFinite { vocab: 0 } => write!(f, "an empty logits row"),
            LogitsFault::NoFinite { vocab } => {
                write!(f, "no finite logit (all {vocab} entries -inf)")
            }
        }
    }
}

impl LogitsFault {
    /// The crate error for this fault, step and sequence not yet known
    /// ([`Error::locate`] adds them); `layer` as the engine can tell.
    pub fn to_error(self, layer: Option<usize>) -> Error {
        Error::NonFiniteLogits {
            step: None,
            sequence: None,
            layer,
            what: self.to_string(),
        }
    }
}

/// Whether a token can be chosen from `logits` (\[V\], f32): the rule every
/// token-picking path applies (greedy and sampled, CPU and GPU): a NaN
/// anywhere, a +∞ anywhere, or no finite entry (every entry −∞, the
/// distribution is undefined) is a fault; −∞ entries among finite ones are
/// fine (masked tokens). A NaN is reported before a +∞, and both before
/// "no finite". One pass over the row.
///
/// Errors: the [`LogitsFault`] (turn it into the crate's error with
/// [`LogitsFault::to_error`]).
pub fn check_logits(logits: &[f32]) -> std::result::Result<(), LogitsFault> {
    let (mut nan, mut nan_id, mut inf, mut inf_id, mut finite) = (0, None, 0, None, false);
    for (j, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            nan += 1;
            nan_id.get_or_insert(j);
        } else if x == f32::INFINITY {
            inf += 1;
            inf_id.get_or_insert(j);
        } else if x.is_finite() {
            finite = true;
        }
    }
    let vocab = logits.len();
    if let Some(id) = nan_id {
        return Err(LogitsFault::Nan {
            id,
            count: nan,
            vocab,
        });
    }
    if let Some(id) = inf_id {
        return Err(LogitsFault::PosInf {
            id,
            count: inf,
            vocab,
        });
    }
    if !finite {
        return Err(LogitsFault::NoFinite { vocab });
    }
    Ok(())
}

/// Index of the largest logit, ties to the lower index; NaN never wins
/// (a row of only NaN gives 0, as the GPU's argmax kernels do). A pure
/// rule: token-picking paths first refuse rows that [`check_logits`]
/// faults ([`Sampler::sample`] does).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || (logits[best].is_nan() && !v.is_nan()) {
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
    /// (no draw then), else [`sample_with_u`] with the next
    /// [`Sampler::draw`].
    ///
    /// Errors: [`Error::NonFiniteLogits`] (step and sequence not yet known,
    /// see [`Error::locate`]) for a row [`check_logits`] refuses: a NaN, a
    /// +∞, or no finite logit; no draw is taken then.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        check_logits(logits).map_err(|f| f.to_error(None))?;
        if self.is_greedy() {
            return Ok(argmax(logits));
        }
        let u = self.draw();
        Ok(sample_with_u(&self.params, logits, u))
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
