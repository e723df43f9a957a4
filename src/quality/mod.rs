//! Measuring a mode's quality (`sparda perplexity`): perplexity of a text
//! under teacher forcing, and the comparison of a run with a saved base run
//! (KL divergence, top-1 agreement, Δ perplexity).
//!
//! # Procedure
//!
//! The text's token ids are cut into consecutive chunks of `context` tokens
//! ([`ChunkPlan`]; a tail shorter than one chunk is left out). Each chunk is
//! a fresh sequence (a plain slice of the text's ids: nothing is inserted
//! at a chunk's start; special tokens the tokenizer adds stay at the start
//! of the text): its first `context − score` tokens are prefilled, and
//! its last `score` tokens are scored by teacher-forced decode steps, one
//! token per step, so every mode is scored the way it decodes (sparse
//! selection, offloaded KV, forecast). The logits before feeding token t
//! give log p(t): the prefill's last logits score the first scored token,
//! and each decode step's logits the next one (the chunk's last token is
//! scored, never fed). The backend is anything that yields next-token
//! logits ([`NextTokenLogits`]: [`CpuLogits`], [`GpuLogits`], or a test's
//! own).
//!
//! # Figures
//!
//! - NLL_i = lse(x) − x_{t_i} per scored token (nats; log-softmax in f64 of
//!   the f32 logits, [`dist::LogSoftmax`]); perplexity exp(mean NLL), its
//!   95 % interval exp(mean ± 1.96·se) from the standard error of the
//!   per-token NLL ([`stats::NllSummary`]);
//! - with a base run ([`logits_file`]): per position KL(base ‖ this) over
//!   the base's top-K ids plus one bucket for the rest — a lower bound of
//!   the full KL, exact when the base's tail mass is negligible — its mean,
//!   median, p99 and max, top-1 agreement, and Δ perplexity with a 95 %
//!   interval from the paired per-token NLL differences ([`kl`]).
//!
//! A base run is compared only with a run of the same model, tokenizer,
//! text and chunking ([`identity`]); the mode settings are what differ.

pub mod agreement;
pub mod dist;
pub mod identity;
pub mod kl;
pub mod logits_file;
pub mod stats;

use crate::cpu::{CpuModel, Sequence};
use crate::pipeline::{GpuModel, GpuSequence};
use crate::{Error, Result};
use dist::LogSoftmax;
use kl::{KlAccumulator, KlSummary};
use logits_file::{LogitsReader, LogitsWriter, PositionRecord};
use stats::NllSummary;
use std::time::Instant;

/// One backend's next-token logits under teacher forcing: a fresh sequence
/// per [`NextTokenLogits::prefill`], then one token per
/// [`NextTokenLogits::decode`].
pub trait NextTokenLogits {
    /// V: the length of every logits row.
    fn vocab_size(&self) -> usize;
    /// Starts a fresh sequence (the previous one is dropped), prefills
    /// `prefix` (≥ 1 token) and returns the logits after its last token, \[V\].
    fn prefill(&mut self, prefix: &[u32]) -> Result<Vec<f32>>;
    /// Feeds `token` to the current sequence and returns the logits after
    /// it, \[V\].
    fn decode(&mut self, token: u32) -> Result<Vec<f32>>;
}

/// The CPU reference as [`NextTokenLogits`].
pub struct CpuLogits<'a> {
    model: &'a CpuModel,
    seq: Sequence,
}

impl<'a> CpuLogits<'a> {
    /// Next-token logits of `model` (its attention plan, forecast and bf16
    /// emulation settings as they are).
    pub fn new(model: &'a CpuModel) -> Self {
        CpuLogits {
            model,
            seq: model.new_sequence(),
        }
    }
}

impl NextTokenLogits for CpuLogits<'_> {
    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }
    fn prefill(&mut self, prefix: &[u32]) -> Result<Vec<f32>> {
        self.seq = self.model.new_sequence();
        self.model.prefill(&mut self.seq, prefix, |_, _| {})
    }
    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        self.model.decode(&mut self.seq, token)
    }
}

/// The GPU engine as [`NextTokenLogits`]: one sequence of
/// `capacity_tokens` at a time; with offload on ([`GpuModel::set_offload`])
/// it moves to pinned host memory after its prefill, as `generate` does
/// it; decode steps go through [`GpuModel::decode`] (CUDA graphs where the
/// mode allows) and every row of logits is copied to the host
/// ([`GpuModel::download_logits`]).
pub struct GpuLogits<'a> {
    model: &'a mut GpuModel,
    seq: Option<GpuSequence>,
    capacity: usize,
}

impl<'a> GpuLogits<'a> {
    /// Next-token logits of `model` for sequences of up to
    /// `capacity_tokens` tokens (e.g. the chunk's context).
    pub fn new(model: &'a mut GpuModel, capacity_tokens: usize) -> Self {
        GpuLogits {
            model,
            seq: None,
            capacity: capacity_tokens,
        }
    }
}

impl NextTokenLogits for GpuLogits<'_> {
    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }
    fn prefill(&mut self, prefix: &[u32]) -> Result<Vec<f32>> {
        // free the previous chunk's caches before allocating the next ones
        self.seq = None;
        let cap = self.capacity.max(prefix.len() + 1);
        let mut seq = self.model.new_sequence(cap)?;
        let offload = self.model.offload_options().is_some();
        if offload {
            // completed blocks go to host memory layer by layer during the prefill
            self.model.begin_offload(&mut seq, cap)?;
        }
        self.model.prefill(&mut seq, prefix, |_, _| {})?;
        if offload {
            self.model.offload_sequence(&mut seq, cap)?;
        }
        self.seq = Some(seq);
        self.model.download_logits()
    }
    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        let seq = self
            .seq
            .as_mut()
            .ok_or_else(|| Error::Input("decode before any prefill".into()))?;
        self.model.decode(std::slice::from_mut(seq), &[token])?;
        self.model.download_logits()
    }
}

/// How a text is cut into scored chunks (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChunkPlan {
    /// Tokens per chunk (one fresh sequence each).
    pub context: usize,
    /// Tokens scored at the end of each chunk; the `context − score` before
    /// them are prefilled.
    pub score: usize,
    /// Chunks scored.
    pub chunks: usize,
}

impl ChunkPlan {
    /// The plan for a text of `text_tokens` tokens: chunks of `context`
    /// tokens, `score` scored per chunk (default context/2), at most
    /// `max_chunks` chunks (default: every whole chunk), for a model of
    /// `max_position` positions.
    ///
    /// Errors: [`Error::Input`] for context < 2, score outside
    /// 1 … context − 1, max_chunks = 0, or a text shorter than one chunk;
    /// [`Error::Limit`] for a context past `max_position`. Each message
    /// names the flag and the numbers.
    pub fn new(
        text_tokens: usize,
        context: usize,
        score: Option<usize>,
        max_chunks: Option<usize>,
        max_position: usize,
    ) -> Result<ChunkPlan> {
        if context < 2 {
            return Err(Error::Input(format!(
                "--context {context}: give ≥ 2 tokens (at least one prefilled and one scored)"
            )));
        }
        let score = score.unwrap_or(context / 2);
        if score == 0 || score >= context {
            return Err(Error::Input(format!(
                "--score {score}: give 1 … {} (context {context} minus at least one prefilled token)",
                context - 1
            )));
        }
        if max_chunks == Some(0) {
            return Err(Error::Input("--max-chunks 0: give ≥ 1".into()));
        }
        if context > max_position {
            return Err(Error::Limit(format!(
                "--context {context} exceeds the model's max_position_embeddings {max_position}; lower --context, or raise the limit with --max-position and --rope-theta"
            )));
        }
        let whole = text_tokens / context;
        if whole == 0 {
            return Err(Error::Input(format!(
                "the text is {text_tokens} tokens, shorter than one chunk of --context {context} tokens: lower --context or give a longer text"
            )));
        }
        Ok(ChunkPlan {
            context,
            score,
            chunks: max_chunks.map_or(whole, |m| m.min(whole)),
        })
    }

    /// Tokens prefilled per chunk, context − score.
    pub fn prefill_len(&self) -> usize {
        self.context - self.score
    }

    /// Positions scored in all, chunks · score.
    pub fn positions(&self) -> usize {
        self.chunks * self.score
    }
}

/// Where an evaluation is, for progress reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// The chunk being scored (0-based).
    pub chunk: usize,
    /// Positions scored so far.
    pub scored: usize,
    /// Positions to score in all.
    pub total: usize,
    /// Mean NLL of the positions scored so far, nats/token.
    pub mean_nll: f64,
}

/// Wall time of an evaluation, split into its two phases (seconds).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Timing {
    /// Tokens prefilled in all.
    pub prefill_tokens: usize,
    /// Prefill time, s.
    pub prefill_s: f64,
    /// Tokens scored in all.
    pub scored_tokens: usize,
    /// Scoring time (decode steps, logits copies and the per-position
    /// statistics, saving and comparison included), s.
    pub score_s: f64,
}

impl Timing {
    /// Prefilled tokens per second of prefill time (0 when no time passed).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        per_s(self.prefill_tokens, self.prefill_s)
    }
    /// Scored tokens per second of scoring time (0 when no time passed).
    pub fn score_tokens_per_s(&self) -> f64 {
        per_s(self.scored_tokens, self.score_s)
    }
}

fn per_s(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// What an evaluation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Perplexity over the scored tokens.
    pub nll: NllSummary,
    /// The comparison with the base run, when one was given.
    pub kl: Option<KlSummary>,
    /// Wall time per phase.
    pub timing: Timing,
    /// Every scored token's NLL (nats), in scoring order.
    pub nlls: Vec<f64>,
}

/// Scores `tokens` with `engine` by `plan` (see the module doc); with
/// `save`, writes every position's record (the caller then calls
/// [`LogitsWriter::finish`]); with `base`, compares
/// every position with the base file's record of it. `progress` is called
/// after every scored position.
///
/// Errors: a text shorter than the plan; logits rows of the wrong length
/// or with a NaN/+∞ entry (naming chunk and position); a base record whose
/// scored token differs from this run's; the engine's, writer's or
/// reader's errors.
pub fn evaluate(
    engine: &mut dyn NextTokenLogits,
    tokens: &[u32],
    plan: &ChunkPlan,
    mut save: Option<&mut LogitsWriter>,
    mut base: Option<&mut LogitsReader>,
    mut progress: impl FnMut(&Progress),
) -> Result<Evaluation> {
    let need = plan.chunks * plan.context;
    if tokens.len() < need {
        return Err(Error::Input(format!(
            "{} tokens for {} chunks of {} tokens",
            tokens.len(),
            plan.chunks,
            plan.context
        )));
    }
    let v = engine.vocab_size();
    let p = plan.prefill_len();
    let mut nlls = Vec::with_capacity(plan.positions());
    let mut nll_sum = 0.0;
    let mut acc = KlAccumulator::default();
    let mut timing = Timing {
        prefill_tokens: 0,
        prefill_s: 0.0,
        scored_tokens: 0,
        score_s: 0.0,
    };
    for (c, chunk) in tokens[..need].chunks_exact(plan.context).enumerate() {
        let t = Instant::now();
        let mut logits = engine.prefill(&chunk[..p])?;
        timing.prefill_s += t.elapsed().as_secs_f64();
        timing.prefill_tokens += p;
        let t = Instant::now();
        for (i, &next) in chunk.iter().enumerate().skip(p) {
            let at = |e: Error| {
                Error::Input(format!(
                    "chunk {c}, position {i} (token {next}): {}",
                    match e {
                        Error::Input(m) => m,
                        e => e.to_string(),
                    }
                ))
            };
            if logits.len() != v {
                return Err(at(Error::Input(format!(
                    "a logits row of {} entries for a vocabulary of {v}",
                    logits.len()
                ))));
            }
            let lsm = LogSoftmax::of(&logits).map_err(at)?;
            let x = *logits.get(next as usize).ok_or_else(|| {
                at(Error::Input(format!(
                    "token id outside the vocabulary of {v} ids"
                )))
            })?;
            let nll = -lsm.logprob(x);
            nlls.push(nll);
            nll_sum += nll;
            if let Some(w) = save.as_mut() {
                let k = w.top_k();
                w.write(&PositionRecord::from_logits(&logits, &lsm, next, k)?)?;
            }
            if let Some(b) = base.as_mut() {
                let rec = b.next_record()?;
                if rec.next != next {
                    return Err(at(Error::Input(format!(
                        "the base run scored token {} here",
                        rec.next
                    ))));
                }
                acc.push(&kl::compare_position(&rec, &logits, &lsm).map_err(at)?);
            }
            if i + 1 < plan.context {
                logits = engine.decode(next)?;
            }
            progress(&Progress {
                chunk: c,
                scored: nlls.len(),
                total: plan.positions(),
                mean_nll: nll_sum / nlls.len() as f64,
            });
        }
        timing.score_s += t.elapsed().as_secs_f64();
        timing.scored_tokens += plan.score;
    }
    Ok(Evaluation {
        nll: NllSummary::of(&nlls),
        kl: base.map(|b| acc.summary(b.header().top_k)),
        timing,
        nlls,
    })
}
