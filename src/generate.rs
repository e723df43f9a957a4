//! The generation loop behind `sparda generate`: prefill, then decode one
//! token at a time with sampling, until EOS or the token limit.

use crate::cpu::{CpuModel, Sequence};
use crate::sample::{Sampler, SamplingParams};
use crate::{Error, Result};
use std::time::Instant;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum StopReason {
    /// A stop id (config/generation_config `eos_token_id`) was sampled; it is
    /// included in the output tokens.
    Eos,
    /// `max_new_tokens` were generated.
    MaxTokens,
}

/// One generation request for a single sequence.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids (≥ 1).
    pub prompt: Vec<u32>,
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Token ids that end generation.
    pub stop_ids: Vec<u32>,
}

/// What a generation produced, with timings (ms, wall clock).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Output {
    /// Generated token ids (the stop id included when it ended generation).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Prefill wall time, ms.
    pub prefill_ms: f64,
    /// Decode wall time (all decode steps), ms.
    pub decode_ms: f64,
}

impl Output {
    /// Decode throughput: generated tokens after the first (which prefill
    /// produces) per second of decode time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if self.decode_ms > 0.0 {
            steps as f64 / (self.decode_ms / 1e3)
        } else {
            0.0
        }
    }
}

/// Checks a request against the model's context limit before any work:
/// prompt + max_new_tokens must fit `max_position_embeddings`.
pub fn check_length(prompt_len: usize, max_new_tokens: usize, max_position: usize) -> Result<()> {
    if prompt_len == 0 {
        return Err(Error::Input("the prompt encodes to 0 tokens".into()));
    }
    let total = prompt_len.checked_add(max_new_tokens).unwrap_or(usize::MAX);
    if total > max_position {
        return Err(Error::Limit(format!(
            "prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {} exceeds the model's max_position_embeddings {max_position}; shorten the prompt (--prompt-tokens), lower --max-new-tokens, or raise the limit with --max-position and --rope-theta",
            total
        )));
    }
    Ok(())
}

/// Generates on the CPU reference. `progress(done, total)` is called during
/// prefill; `on_token(id)` for every generated token as soon as it is sampled.
pub fn generate_cpu(
    model: &CpuModel,
    req: &Request,
    progress: impl FnMut(usize, usize),
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Output, Sequence)> {
    req.sampling.validate()?;
    check_length(
        req.prompt.len(),
        req.max_new_tokens,
        model.config.max_position_embeddings,
    )?;
    let mut sampler = Sampler::new(req.sampling);
    let mut seq = model.new_sequence();
    let t = Instant::now();
    let mut logits = model.prefill(&mut seq, &req.prompt, progress)?;
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let mut tokens = Vec::new();
    let mut stop = StopReason::MaxTokens;
    while tokens.len() < req.max_new_tokens {
        let tok = sampler.sample(&logits);
        tokens.push(tok);
        on_token(tok)?;
        if req.stop_ids.contains(&tok) {
            stop = StopReason::Eos;
            break;
        }
        if tokens.len() == req.max_new_tokens {
            break;
        }
        logits = model.decode(&mut seq, tok)?;
    }
    let decode_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok((
        Output {
            tokens,
            stop,
            prefill_ms,
            decode_ms,
        },
        seq,
    ))
}
