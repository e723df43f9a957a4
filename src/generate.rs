//! The generation loop behind `sparda generate`: prefill, then decode one
//! token at a time with sampling, until EOS or the token limit.

use crate::cpu::{CpuModel, Sequence};
use crate::pipeline::{GpuModel, GpuSequence};
use crate::quality::dist::{token_logprobs, TokenLogprob};
use crate::sample::{check_logits, Sampler, SamplingParams};
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
    /// Ctrl-C (SIGINT, [`crate::interrupt`]) between two decode steps: the
    /// tokens are those chosen before it.
    Interrupted,
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
    /// `Some(K)`: record each generated token's log-probability and its K
    /// most likely alternatives ([`Output::logprobs`]).
    pub logprobs: Option<usize>,
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
    /// With [`Request::logprobs`]: one entry per generated token (empty
    /// otherwise). Its cost (reading each step's logits row back from the
    /// GPU) counts in `decode_ms`.
    pub logprobs: Vec<TokenLogprob>,
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
    let total = prompt_len.saturating_add(max_new_tokens);
    if total > max_position {
        return Err(Error::Limit(format!(
            "prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {} exceeds the model's max_position_embeddings {max_position}; shorten the prompt (--prompt-tokens), lower --max-new-tokens, or raise the limit with --max-position and --rope-theta",
            total
        )));
    }
    Ok(())
}

/// One backend's side of the generation loop ([`run_loop`]): prefill a
/// prompt, decode one token, and pick the next token from the logits the
/// last call left.
pub trait Stepper {
    /// Runs the prompt; `progress(done, total)` after each chunk.
    fn prefill(&mut self, prompt: &[u32], progress: &mut dyn FnMut(usize, usize)) -> Result<()>;
    /// Feeds one generated token.
    fn decode(&mut self, token: u32) -> Result<()>;
    /// The next token from the last call's logits: greedy (argmax) when
    /// `greedy`, else drawn by `sampler`.
    fn next_token(&mut self, sampler: &mut Sampler, greedy: bool) -> Result<u32>;
    /// The last call's logits row, f32 \[V\], on the host.
    fn logits(&mut self) -> Result<Vec<f32>>;
}

/// The generation loop shared by every backend: validation, prefill (timed),
/// then sample → report → stop check → decode until a stop id or
/// `max_new_tokens` (timed). `on_token(id)` sees every token as soon as it
/// is chosen. A Ctrl-C ([`crate::interrupt::requested`]) seen before a
/// decode step ends the loop with [`StopReason::Interrupted`] and the
/// tokens so far.
///
/// Errors: bad sampling parameters, a request past the model's context
/// (`max_position`), any backend error; a logits row no token can be
/// chosen from ([`crate::sample::check_logits`]) is
/// [`Error::NonFiniteLogits`] naming the decode step (tokens chosen before,
/// 0 = the prefill's logits) and the sequence (0); Ctrl-C during the
/// prefill is [`Error::Interrupted`].
pub fn run_loop(
    engine: &mut dyn Stepper,
    req: &Request,
    max_position: usize,
    mut progress: impl FnMut(usize, usize),
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Output> {
    req.sampling.validate()?;
    check_length(req.prompt.len(), req.max_new_tokens, max_position)?;
    let greedy = req.sampling.temperature == 0.0 || req.sampling.top_k == 1;
    let mut sampler = Sampler::new(req.sampling);
    let t = Instant::now();
    {
        let _span =
            tracing::info_span!(target: "sparda::generate", "prefill", tokens = req.prompt.len())
                .entered();
        engine.prefill(&req.prompt, &mut progress)?;
    }
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    let mut stop = StopReason::MaxTokens;
    while tokens.len() < req.max_new_tokens {
        let step = tokens.len();
        let tok = engine
            .next_token(&mut sampler, greedy)
            .map_err(|e| e.locate(step, 0))?;
        if let Some(k) = req.logprobs {
            logprobs.push(token_logprobs(&engine.logits()?, tok, k));
        }
        tokens.push(tok);
        on_token(tok)?;
        if req.stop_ids.contains(&tok) {
            stop = StopReason::Eos;
            break;
        }
        if tokens.len() == req.max_new_tokens {
            break;
        }
        if crate::interrupt::requested() {
            stop = StopReason::Interrupted;
            break;
        }
        let _span =
            tracing::info_span!(target: "sparda::generate", "decode step", step = tokens.len() - 1)
                .entered();
        engine.decode(tok)?;
    }
    let decode_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(Output {
        tokens,
        stop,
        prefill_ms,
        decode_ms,
        logprobs,
    })
}

/// The CPU reference as a [`Stepper`]: one sequence, logits on the host.
struct CpuStepper<'a> {
    model: &'a CpuModel,
    seq: Sequence,
    logits: Vec<f32>,
}

impl Stepper for CpuStepper<'_> {
    fn prefill(&mut self, prompt: &[u32], progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
        self.logits = self.model.prefill(&mut self.seq, prompt, progress)?;
        Ok(())
    }
    fn decode(&mut self, token: u32) -> Result<()> {
        self.logits = self.model.decode(&mut self.seq, token)?;
        Ok(())
    }
    fn next_token(&mut self, sampler: &mut Sampler, _greedy: bool) -> Result<u32> {
        // the layer where the hidden state went non-finite, when it did
        check_logits(&self.logits).map_err(|f| f.to_error(self.seq.nonfinite_layer))?;
        sampler.sample(&self.logits)
    }
    fn logits(&mut self) -> Result<Vec<f32>> {
        Ok(self.logits.clone())
    }
}

/// Generates on the CPU reference. `progress(done, total)` is called during
/// prefill; `on_token(id)` for every generated token as soon as it is sampled.
pub fn generate_cpu(
    model: &CpuModel,
    req: &Request,
    progress: impl FnMut(usize, usize),
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Output, Sequence)> {
    let mut st = CpuStepper {
        model,
        seq: model.new_sequence(),
        logits: Vec::new(),
    };
    let out = run_loop(
        &mut st,
        req,
        model.config.max_position_embeddings,
        progress,
        on_token,
    )?;
    Ok((out, st.seq))
}

/// The GPU engine as a [`Stepper`]: one sequence; greedy picks and
/// temperature/top-k/top-p sampling run on the GPU ([`GpuModel::sample`],
/// fed the CPU sampler's seeded draws; only the id is copied back). A row
/// no token can be chosen from is refused by the kernels themselves
/// through the device error record, read with the id: no extra copy.
struct GpuStepper<'a> {
    model: &'a mut GpuModel,
    seq: GpuSequence,
}

impl Stepper for GpuStepper<'_> {
    fn prefill(&mut self, prompt: &[u32], progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
        // the capacity the sequence was made with: prompt + max new tokens
        let cap = self.seq.capacity();
        let offload = self.model.offload_options().is_some();
        if offload {
            // completed blocks go to host memory layer by layer during the prefill
            self.model.begin_offload(&mut self.seq, cap)?;
        }
        self.model.prefill(&mut self.seq, prompt, progress)?;
        if offload {
            self.model.offload_sequence(&mut self.seq, cap)?;
        }
        Ok(())
    }
    fn decode(&mut self, token: u32) -> Result<()> {
        self.model
            .decode(std::slice::from_mut(&mut self.seq), &[token])
    }
    fn next_token(&mut self, sampler: &mut Sampler, greedy: bool) -> Result<u32> {
        if greedy {
            let ids = self.model.argmax()?;
            ids.first()
                .copied()
                .ok_or_else(|| Error::Cuda("argmax returned no token".into()))
        } else {
            // on the GPU with the CPU sampler's next draw: only the id travels
            let u = sampler.draw();
            let params = *sampler.params();
            let ids = self.model.sample(&params, &[u])?;
            ids.first()
                .copied()
                .ok_or_else(|| Error::Cuda("sampling returned no token".into()))
        }
    }
    fn logits(&mut self) -> Result<Vec<f32>> {
        // one sequence: the whole [1, V] row
        self.model.download_logits()
    }
}

/// Generates on the GPU engine (one sequence; its caches sized for prompt +
/// max_new_tokens up front; with offload on ([`GpuModel::set_offload`]) the
/// prefilled sequence moves to pinned host memory before decoding). Same loop, stop rules and timings as
/// [`generate_cpu`]; decode time includes the per-step copy of the chosen id.
///
/// Errors: as [`run_loop`]; [`Error::Limit`] when the sequence's KV, the
/// step and prefill buffers (and with offload the pinned host store) do not
/// fit the GPU's free memory (and the host's available memory), refused
/// before they are allocated ([`GpuModel::check_memory`]); [`Error::Cuda`]
/// on a device failure.
pub fn generate_gpu(
    model: &mut GpuModel,
    req: &Request,
    progress: impl FnMut(usize, usize),
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Output> {
    let max_position = model.config.max_position_embeddings;
    check_length(req.prompt.len(), req.max_new_tokens, max_position)?;
    let cap = req.prompt.len() + req.max_new_tokens;
    // refused with the numbers before the caches are allocated
    model.check_memory(
        1,
        cap,
        model.offload_options(),
        true,
        match model.offload_options() {
            Some(_) => "lower --prompt-tokens or --max-new-tokens",
            None => "lower --prompt-tokens or --max-new-tokens, or offload the KV to host memory (--kv offload)",
        },
    )?;
    let seq = model.new_sequence(cap)?;
    let mut st = GpuStepper { model, seq };
    run_loop(&mut st, req, max_position, progress, on_token)
}
