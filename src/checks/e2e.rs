//! `gpu_check_e2e`: the GPU engine ([`crate::pipeline::GpuModel`]) end to end
//! against the CPU reference under teacher forcing (spec/testing.md
//! "Tolerances" and "Tokens over many steps"). Each case's sequences are
//! prefilled and then fed the same tokens on both sides (random prompts
//! with the f32 reference's greedy tokens, or real text with the text's own
//! tokens), its B sequences of different lengths decoded together on the
//! GPU.
//!
//! The whole model is judged as llama.cpp's `perplexity --kl-divergence`
//! and vLLM's logprob comparisons judge a backend, against what bf16
//! arithmetic itself costs ([`crate::quality::agreement`]): at every
//! position, the GPU's next-token distribution and that of the CPU
//! reference with bf16 rounding at the engine's points
//! ([`crate::cpu::Bf16Points::ALL`]) are compared with the f32 CPU
//! reference's (KL over the whole vocabulary, top-1 agreement, top-5
//! containment both ways); the GPU passes when its mean and p99 KL are
//! ≤ 1.5× the emulated reference's, its top-1 agreement is at most 1
//! percentage point below, and no position's top-1 falls outside the
//! other side's top 5. In sparse cases the KL and top-1 conditions are
//! taken over the positions where both the GPU and the emulated reference
//! chose the f32 reference's blocks: where one chose another block (a
//! near-tie that bf16 rounding flips, explained as below), the KL measures
//! that one block of the budget, not rounding, and a few such positions
//! decide a p99 over a few hundred; the top-5 condition holds at every
//! position. A per-step relative-L2 bound does not hold for a
//! deep model in bf16 (on SmolLM2 the emulation itself is 5.9e-2 from f32
//! at low-norm steps); the per-step rel-L2 figures are reported as
//! information. The GPU's argmax kernel must agree exactly with the host
//! argmax of the GPU's own logits.
//!
//! Sparse cases also compare the per-layer, per-KV-head block sets of
//! every step with the CPU reference's. With bf16 activations the two
//! sides' queries and keys differ by rounding, so a set can differ where
//! two blocks' scores are that close. Each differing set must be
//! *explained*, either as a near-tie — every block in the symmetric
//! difference scores within [`NEAR_TIE`] (relative) of the cut that decided
//! it (the query-aware shortlist cut or the final top-S cut), scored with
//! the CPU reference's compressed keys and pooled eviction scores and the
//! GPU's own query — or as a cascade of a differing set in a lower layer of
//! the same step (its input already differs by a block), or as a bf16 flip —
//! the bf16-emulated reference's set of that layer and KV head differs from
//! the f32 reference's too (measured on the H200, SmolLM2 with InfLLM-V2
//! selection on real text: the emulated reference's sets differ from the
//! f32 reference's at 236 of 322 positions, and the GPU's differences that
//! neither near-tie nor cascade explained had cut gaps up to 3.4e-2, past
//! [`NEAR_TIE`]). Where unexplained sets remain, the case still passes
//! when the GPU's differing sets are no more than [`KL_RATIO`] × the sets in
//! which the bf16-emulated reference differs from the f32 one: bf16
//! rounding accumulated over 30 layers moves the query by ~1e-2 relative,
//! so it moves decisions a few percent from the cut, at random places on
//! each side (measured on the H200 at 52f740e: 52 such GPU sets of 28,980,
//! cut gaps 5e-3 to 6.7e-2). The kernel-level
//! selection check on identical inputs (exact up to 1e-4 ties) is part of
//! `gpu-check`.
//!
//! Cases: the tiny synthetic model built in memory (dense; NOSA sparse with
//! GPU selection and with the host fallback; NOSA with dense prefill; NOSA
//! with a dense_len that a sequence crosses mid-batch; InfLLM-V2; dense with
//! dynamic NTK RoPE, prompts below, across and past its original maximum;
//! dense and NOSA with dense prefill on the tensor-core prefill kernel; NOSA
//! and InfLLM-V2 with sparse prefill on the tensor-core sparse kernel), and,
//! when a model directory is given (the SmolLM2 fixture), real text through
//! it: dense (≥ 256 positions; also with the tensor-core prefill kernel) and
//! InfLLM-V2 past a small budget (also with tensor-core sparse prefill). Each case
//! grows one sequence's cache during decode (it starts with room for its
//! prompt only).

use super::kernels::{rel_l2, utc_now_iso};
use crate::cpu::{Bf16Points, CpuModel, EngineOptions};
use crate::cuda::Gpu;
use crate::model::{AttentionOverrides, PrefillMode, SelectionRule};
use crate::pipeline::{GpuModel, GpuSequence, PrefillAttention, SelectionPath};
use crate::quality::agreement::{
    compare_full, judge, AgreementSummary, PositionAgreement, RuleOutcome, KL_RATIO, TOP1_SLACK_PP,
    TOP_N,
};
use crate::sample::argmax;
use crate::synth::{self, Preset};
use crate::tokenizer::Tokenizer;
use crate::weights::Checkpoint;
use crate::{Error, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Relative score gap at a selection cut below which an end-to-end set
/// difference counts as a near-tie (bf16 activations: the spec's 1e-4 is
/// for identical inputs, see the module doc).
pub const NEAR_TIE: f64 = 5e-3;

/// Default number of teacher-forced decode steps.
pub const DEFAULT_STEPS: usize = 64;

/// Teacher-forced steps of each real-text case (at least): with its
/// prefill positions, the dense case alone scores 2 × (160 + 1) = 322
/// positions of real text (spec/testing.md asks ≥ 256).
pub const FIXTURE_STEPS: usize = 160;

/// Teacher-forced steps of the `tiny-dense` case (at least): its three
/// prompts then score 3 × 87 = 261 positions, the ≥ 256 the whole-model
/// rule is defined on (spec/testing.md).
pub const TINY_DENSE_STEPS: usize = 86;

/// A prompt length `extra` tokens past one prefill chunk
/// ([`crate::pipeline::prefill_chunk`], 1,024 unless
/// `$SPARDA_PREFILL_CHUNK` says otherwise), so that the cases written to
/// cross a chunk boundary cross it at any chunk: 1,300 for `extra` 276 at
/// the default.
fn past_chunk(extra: usize) -> usize {
    crate::pipeline::prefill_chunk() + extra
}

/// Where a case's tokens come from.
#[derive(Clone)]
enum Inputs<'a> {
    /// Random prompts of these lengths (seeded); the tokens fed during
    /// decode are the f32 CPU reference's greedy choices.
    Random { prompt_lens: Vec<usize>, seed: u64 },
    /// Real text: for each (offset, prompt length), the prompt is
    /// `ids[offset..offset + prompt length]` and the tokens fed are the
    /// text's next tokens (teacher forcing on the text itself).
    Text {
        ids: &'a [u32],
        spans: Vec<(usize, usize)>,
    },
}

/// One end-to-end case: a model, options, its inputs, and the least number
/// of teacher-forced steps it runs (the check's `steps` when larger).
#[derive(Clone)]
struct CaseSpec<'a> {
    name: &'static str,
    ckpt: &'a Checkpoint,
    opts: EngineOptions,
    path: SelectionPath,
    inputs: Inputs<'a>,
    min_steps: usize,
    /// The kernel of prefill rows (dense and sparse) on the GPU.
    prefill_attention: PrefillAttention,
}

/// Per-case outcome (one entry of the JSON report).
#[derive(Debug, Clone, serde::Serialize)]
pub struct E2eCase {
    /// Case name.
    pub name: String,
    /// Attention mode in force (`Dense`, `Nosa`, `InfLlmV2`).
    pub attention: String,
    /// Selection path of the GPU engine.
    pub selection_path: SelectionPath,
    /// The kernel of the GPU's prefill rows (dense and sparse).
    pub prefill_attention: PrefillAttention,
    /// Where the tokens come from: "random prompts, reference greedy
    /// tokens" or "real text".
    pub tokens: String,
    /// Prompt length of each sequence of the batch, tokens.
    pub prompt_lens: Vec<usize>,
    /// Teacher-forced decode steps (comparisons per sequence: steps + 1, the prefill's included).
    pub steps: usize,
    /// Largest relative L2 error over every sequence and step.
    pub max_rel_l2: f64,
    /// Largest relative L2 error over the steps whose block sets all equal
    /// the CPU reference's (information).
    pub max_rel_l2_same_selection: f64,
    /// (sequence, step, rel_l2) of every step with a differing set.
    pub selection_diff_steps: Vec<(usize, usize, f64)>,
    /// Mean relative L2 error over every sequence and step.
    pub mean_rel_l2: f64,
    /// (sequence, step) of the largest error (step 0 = after prefill).
    pub worst_at: (usize, usize),
    /// Logit vectors compared.
    pub compared: usize,
    /// The GPU argmax kernel equals the host argmax of the GPU logits on every row.
    pub argmax_kernel_exact: bool,
    /// Steps where the GPU's greedy token equals the CPU reference's.
    pub greedy_agree: usize,
    /// Block sets compared (sequence × step × layer × KV head; sparse cases).
    pub selection_sets: usize,
    /// Of those, sets equal to the CPU reference's.
    pub selection_equal: usize,
    /// Differing sets explained as near-ties (gap ≤ [`NEAR_TIE`]).
    pub selection_near_ties: usize,
    /// Differing sets explained as cascades of a lower layer's difference.
    pub selection_cascades: usize,
    /// Differing sets explained as bf16 flips: the bf16-emulated reference's
    /// set of that layer and KV head also differs from the f32 reference's
    /// (rounding at the engine's points moves that cut by itself).
    pub selection_bf16_flips: usize,
    /// Largest cut gap among the near-tie explanations.
    pub selection_max_gap: f64,
    /// Every differing set (up to 32): seq, step, layer, head, blocks only
    /// the CPU / only the GPU chose, cut gap, how it is explained.
    pub selection_examples: Vec<Value>,
    /// Some sequence's cache grew (reallocated) during the run.
    pub grew: bool,
    /// Per-step diagnostics, `[sequence][step]` (step 0 = after prefill):
    /// rel L2 of the GPU logits against the f32 CPU reference
    /// (information). NaN where logits were not finite.
    pub rel_l2_per_step: Vec<Vec<f64>>,
    /// `[sequence][step]`: ‖reference logits‖₂ (rel L2 spikes sit where it is small).
    pub ref_norm_per_step: Vec<Vec<f64>>,
    /// `[sequence][step]`: rel L2 of the CPU reference with bf16 activation
    /// emulation ([`Bf16Points::ALL`]: rounding where the engine stores bf16)
    /// against the f32 reference, same teacher-forced tokens: the error bf16
    /// arithmetic alone explains.
    pub emulation_rel_l2_per_step: Vec<Vec<f64>>,
    /// `[sequence][step]`: rel L2 of the GPU logits against the bf16-emulating
    /// CPU reference (small when the engine rounds where the emulation does).
    pub gpu_vs_emulation_rel_l2_per_step: Vec<Vec<f64>>,
    /// Largest / mean of [`Self::emulation_rel_l2_per_step`].
    pub emulation_max_rel_l2: f64,
    /// Mean of [`Self::emulation_rel_l2_per_step`].
    pub emulation_mean_rel_l2: f64,
    /// Over steps whose block sets all equal the CPU reference's, the largest
    /// per-step min(GPU vs bf16-emulated reference, GPU vs f32 reference)
    /// (information).
    pub max_rel_l2_same_selection_vs_emulation: f64,
    /// Largest of [`Self::gpu_vs_emulation_rel_l2_per_step`].
    pub gpu_vs_emulation_max_rel_l2: f64,
    /// Mean of [`Self::gpu_vs_emulation_rel_l2_per_step`].
    pub gpu_vs_emulation_mean_rel_l2: f64,
    /// The GPU's next-token distributions against the f32 CPU reference's
    /// at every position (every sequence, prefill and each step): KL
    /// (whole vocabulary), top-1 agreement, top-5 misses.
    pub gpu_vs_f32: AgreementSummary,
    /// The same for the CPU reference with bf16 rounding at the engine's
    /// points ([`Bf16Points::ALL`]): what bf16 arithmetic itself costs.
    pub emulated_vs_f32: AgreementSummary,
    /// [`Self::gpu_vs_f32`] over the positions where the GPU's and the
    /// emulated reference's block sets all equal the f32 reference's (every
    /// position of a dense case): the figures the rule judges.
    pub gpu_vs_f32_same_selection: AgreementSummary,
    /// [`Self::emulated_vs_f32`] over the same positions.
    pub emulated_vs_f32_same_selection: AgreementSummary,
    /// Positions where the emulated reference's block sets differ from the
    /// f32 reference's (its own near-ties).
    pub emulated_selection_diff_positions: usize,
    /// Block sets (sequence × step × layer × KV head) where the emulated
    /// reference's set differs from the f32 reference's.
    pub emulated_selection_diff_sets: usize,
    /// The GPU's differing sets number ≤ kl_ratio × [`Self::emulated_selection_diff_sets`].
    pub selection_within_bf16: bool,
    /// Why the selections failed the rule, in words with the numbers.
    pub selection_failure: Option<String>,
    /// The whole-model rule of spec/testing.md "Tolerances"
    /// ([`crate::quality::agreement::judge`]) applied to the same-selection
    /// summaries, plus top-5 containment at every position.
    pub bf16_rule: RuleOutcome,
    /// Wall time of the GPU side, ms.
    pub gpu_ms: f64,
    /// Wall time of the CPU reference, ms.
    pub cpu_ms: f64,
    /// Wall time of the bf16-emulating CPU reference, ms.
    pub cpu_emulation_ms: f64,
    /// The CPU references were computed for an earlier case with the same
    /// model, options and inputs (their times are that case's).
    pub references_reused: bool,
    /// No error, finite logits, the whole-model rule holds (`bf16_rule`),
    /// every differing set explained, argmax kernel exact. The rel-L2
    /// figures are information.
    pub pass: bool,
    /// Why the case failed to run, if it did.
    pub error: Option<String>,
}

/// The CPU reference's greedy run of one prompt: logits after prefill and
/// after each decode step, the tokens fed, the selections of each step.
struct CpuRun {
    logits: Vec<Vec<f32>>,
    /// tokens[s] is fed at decode step s + 1.
    tokens: Vec<u32>,
    /// `[step][layer][kv_head]`.
    selections: Vec<Vec<Vec<Vec<usize>>>>,
    /// The final state (Kc and p of every window, for explaining differences).
    seq: crate::cpu::Sequence,
}

/// The reference's run of `prompt`: greedy when `forced` is `None`, else
/// fed `forced[s]` at decode step s + 1 (`forced` holds ≥ `steps` tokens).
fn cpu_run(cpu: &CpuModel, prompt: &[u32], steps: usize, forced: Option<&[u32]>) -> Result<CpuRun> {
    let mut seq = cpu.new_sequence();
    let mut logits = vec![cpu.prefill(&mut seq, prompt, |_, _| {})?];
    let mut selections = vec![seq.selections.clone()];
    let mut tokens = Vec::with_capacity(steps);
    for s in 0..steps {
        let tok = match forced {
            Some(f) => f[s],
            None => argmax(logits.last().expect("prefill logits")),
        };
        tokens.push(tok);
        logits.push(cpu.decode(&mut seq, tok)?);
        selections.push(seq.selections.clone());
    }
    Ok(CpuRun {
        logits,
        tokens,
        selections,
        seq,
    })
}

/// Logits of `cpu` teacher-forced on `prompt` then `tokens` (after prefill
/// and after each decode step)
/// and each step's block sets (`[step][layer][kv_head]`).
fn teacher_forced(cpu: &CpuModel, prompt: &[u32], tokens: &[u32]) -> Result<TeacherForced> {
    let mut seq = cpu.new_sequence();
    let mut logits = vec![cpu.prefill(&mut seq, prompt, |_, _| {})?];
    let mut selections = vec![seq.selections.clone()];
    for &t in tokens {
        logits.push(cpu.decode(&mut seq, t)?);
        selections.push(seq.selections.clone());
    }
    Ok((logits, selections))
}

/// Logits and block sets of a teacher-forced run ([`teacher_forced`]).
type TeacherForced = (Vec<Vec<f32>>, Vec<Vec<Vec<Vec<usize>>>>);

/// The largest relative gap, over `blocks`, between a block's score and the
/// selection cut that decided it (spec §4), for KV head `h` of a query at
/// t = t_len − 1, scored with the CPU state `kv` (its first Mc(t_len)
/// windows: complete windows never change) and query `q` ([H, D]).
/// NOSA: a block's gap is the smaller of its query-aware score's gap to the
/// shortlist cut (n-th highest r) and its eviction score's gap to the final
/// cut (S-th highest e after the shortlist); InfLLM-V2: r to the S-th
/// highest r. Forced blocks and infinite cuts give an infinite gap.
fn cut_gap(
    plan: &crate::model::AttentionPlan,
    kv: &crate::model::state::LayerKv,
    q: &[f32],
    hq: usize,
    h: usize,
    t_len: usize,
    blocks: &[usize],
) -> f64 {
    use crate::model::select::query_window_scores;
    let b = &plan.budget;
    let (hk, kvd) = (kv.kv_heads, kv.kv_dim);
    let dh = kvd / hk;
    let g = hq / hk;
    if t_len == 0 || q.len() < hq * dh {
        return f64::INFINITY;
    }
    let mc = b.windows(t_len).min(kv.windows());
    let qh = &q[h * g * dh..(h + 1) * g * dh];
    let kch = if mc > 0 { &kv.kc[h * dh..] } else { &[][..] };
    let s = query_window_scores(qh, dh, kch, kvd, mc);
    cut_gap_scores(plan, kv, &s, h, t_len, blocks)
}

/// [`cut_gap`] from given window scores `s` (its length = the windows
/// scored; forecast mode passes f·Kc over the previous step's windows).
pub(crate) fn cut_gap_scores(
    plan: &crate::model::AttentionPlan,
    kv: &crate::model::state::LayerKv,
    s: &[f32],
    h: usize,
    t_len: usize,
    blocks: &[usize],
) -> f64 {
    use crate::model::select::{pool_blocks, top_k};
    let b = &plan.budget;
    let hk = kv.kv_heads;
    if t_len == 0 {
        return f64::INFINITY;
    }
    let mc = s.len();
    let nb = b.blocks(t_len - 1);
    let qblk = nb - 1;
    let force = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .enumerate()
            .map(|(m, x)| {
                if b.is_forced(m, qblk) {
                    f32::INFINITY
                } else {
                    x
                }
            })
            .collect()
    };
    let r = force(pool_blocks(b, s, nb));
    let p: Vec<f32> = (0..mc).map(|w| kv.p[w * hk + h]).collect();
    let mut e = force(pool_blocks(b, &p, nb));
    let rel = |x: f32, cut: f32| -> f64 {
        if !x.is_finite() || !cut.is_finite() {
            f64::INFINITY
        } else {
            ((x - cut).abs() / cut.abs().max(1e-30)) as f64
        }
    };
    let kth = |v: &[f32], k: usize| -> f32 {
        let idx = top_k(v, k.min(v.len()).max(1));
        idx.last().map_or(f32::INFINITY, |&i| v[i])
    };
    let nosa = plan.mode == crate::config::AttentionMode::Nosa;
    let (r_cut, e_cut) = if nosa {
        let rc = kth(&r, b.shortlist);
        for m in top_k(&r, b.shortlist.min(nb)) {
            e[m] = f32::INFINITY;
        }
        (rc, kth(&e, b.attended))
    } else {
        (kth(&r, b.attended), f32::INFINITY)
    };
    let e_raw = force(pool_blocks(b, &p, nb));
    blocks
        .iter()
        .filter(|&&m| m < nb)
        .map(|&m| {
            let gr = rel(r[m], r_cut);
            if nosa {
                gr.min(rel(e_raw[m], e_cut))
            } else {
                gr
            }
        })
        .fold(0.0f64, f64::max)
}

/// Differing sets of one step and how they are explained.
#[derive(Default)]
struct StepDiff {
    sets: usize,
    equal: usize,
    near_ties: usize,
    cascades: usize,
    bf16_flips: usize,
    unexplained: usize,
    max_gap: f64,
    examples: Vec<Value>,
}

/// Compares one step's selections of sequence `b` (GPU row `row`, query
/// positions t = `t_len` − 1) with the CPU reference's, explaining each
/// difference (see the module doc); `emu`: the bf16-emulated reference's
/// sets at this step, `[layer][kv_head]`.
#[allow(clippy::too_many_arguments)]
fn compare_step(
    model: &GpuModel,
    row: usize,
    run: &CpuRun,
    emu: &[Vec<Vec<usize>>],
    plan: &crate::model::AttentionPlan,
    hq: usize,
    b: usize,
    step: usize,
    t_len: usize,
) -> StepDiff {
    let mut d = StepDiff::default();
    let gpu_sel = model.last_selections();
    let queries = model.last_queries();
    let mut lower_differs = false;
    for (l, cpu_l) in run.selections[step].iter().enumerate() {
        let mut layer_differs = false;
        for (h, want) in cpu_l.iter().enumerate() {
            let got = gpu_sel
                .get(l)
                .and_then(|rows| rows.get(row))
                .and_then(|heads| heads.get(h))
                .cloned()
                .unwrap_or_default();
            if want.is_empty() && got.is_empty() {
                continue; // dense at this step on both sides
            }
            d.sets += 1;
            if &got == want {
                d.equal += 1;
                continue;
            }
            layer_differs = true;
            let cpu_only: Vec<usize> = want.iter().filter(|m| !got.contains(m)).copied().collect();
            let gpu_only: Vec<usize> = got.iter().filter(|m| !want.contains(m)).copied().collect();
            let diff: Vec<usize> = cpu_only.iter().chain(&gpu_only).copied().collect();
            let gap = queries
                .get(l)
                .and_then(|rows| rows.get(row))
                .map_or(f64::INFINITY, |q| {
                    cut_gap(plan, &run.seq.layers[l], q, hq, h, t_len, &diff)
                });
            let how = if gap <= NEAR_TIE {
                d.near_ties += 1;
                d.max_gap = d.max_gap.max(gap);
                "near-tie"
            } else if lower_differs {
                d.cascades += 1;
                "cascade"
            } else if emu
                .get(l)
                .and_then(|hs| hs.get(h))
                .is_some_and(|e| e != want)
            {
                d.bf16_flips += 1;
                "bf16 flip"
            } else {
                d.unexplained += 1;
                "UNEXPLAINED"
            };
            if d.examples.len() < 32 || how == "UNEXPLAINED" {
                d.examples
                    .push(json!({"seq": b, "step": step, "layer": l, "head": h,
                    "cpu_only": cpu_only, "gpu_only": gpu_only,
                    "cut_gap": if gap.is_finite() { json!(gap) } else { json!(null) },
                    "explained_as": how}));
            }
        }
        lower_differs |= layer_differs;
    }
    d
}

/// The CPU references of a case's inputs: the f32 reference's runs and the
/// bf16-emulated reference's logits and block sets on the same tokens,
/// with the wall time each took (ms).
struct References {
    runs: Vec<CpuRun>,
    emu_logits: Vec<Vec<Vec<f32>>>,
    emu_sel: Vec<Vec<Vec<Vec<Vec<usize>>>>>,
    cpu_ms: f64,
    emu_ms: f64,
}

/// References already computed, by [`ref_key`]: cases that differ only in
/// GPU settings (the prefill kernel, the selection path) share them.
type RefCache = std::collections::HashMap<String, std::rc::Rc<References>>;

/// What the CPU references depend on: the checkpoint (by address: one
/// object per model in a run), the engine options, the steps and the
/// inputs (FNV-1a over every prompt and fed token).
fn ref_key(spec: &CaseSpec<'_>, steps: usize, inputs: &[PromptAndFed]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (p, f) in inputs {
        let fed = f.as_deref().unwrap_or(&[]);
        for x in [p.len() as u32, fed.len() as u32]
            .iter()
            .chain(p)
            .chain(fed)
        {
            for b in x.to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    format!("{:p}|{:?}|{steps}|{h:016x}", spec.ckpt, spec.opts)
}

/// Runs one case; errors become a failed case.
fn run_case(gpu: &Arc<Gpu>, spec: &CaseSpec<'_>, steps: usize, refs: &mut RefCache) -> E2eCase {
    let steps = steps.max(spec.min_steps);
    let (tokens, prompt_lens) = match &spec.inputs {
        Inputs::Random { prompt_lens, .. } => (
            "random prompts; the f32 reference's greedy tokens fed".to_string(),
            prompt_lens.clone(),
        ),
        Inputs::Text { spans, .. } => (
            "real text: prompts and fed tokens from the text".to_string(),
            spans.iter().map(|s| s.1).collect(),
        ),
    };
    let empty = AgreementSummary::of(&[]);
    let mut out = E2eCase {
        name: spec.name.to_string(),
        attention: String::new(),
        selection_path: spec.path,
        prefill_attention: spec.prefill_attention,
        tokens,
        prompt_lens,
        steps,
        max_rel_l2: f64::NAN,
        max_rel_l2_same_selection: f64::NAN,
        selection_diff_steps: Vec::new(),
        mean_rel_l2: f64::NAN,
        worst_at: (0, 0),
        compared: 0,
        argmax_kernel_exact: false,
        greedy_agree: 0,
        selection_sets: 0,
        selection_equal: 0,
        selection_near_ties: 0,
        selection_cascades: 0,
        selection_bf16_flips: 0,
        selection_max_gap: 0.0,
        selection_examples: Vec::new(),
        grew: false,
        rel_l2_per_step: Vec::new(),
        ref_norm_per_step: Vec::new(),
        emulation_rel_l2_per_step: Vec::new(),
        gpu_vs_emulation_rel_l2_per_step: Vec::new(),
        emulation_max_rel_l2: f64::NAN,
        emulation_mean_rel_l2: f64::NAN,
        gpu_vs_emulation_max_rel_l2: f64::NAN,
        max_rel_l2_same_selection_vs_emulation: f64::NAN,
        gpu_vs_emulation_mean_rel_l2: f64::NAN,
        gpu_vs_f32: empty,
        emulated_vs_f32: empty,
        gpu_vs_f32_same_selection: empty,
        emulated_vs_f32_same_selection: empty,
        emulated_selection_diff_positions: 0,
        emulated_selection_diff_sets: 0,
        selection_within_bf16: false,
        selection_failure: None,
        bf16_rule: RuleOutcome {
            pass: false,
            failures: Vec::new(),
        },
        gpu_ms: 0.0,
        cpu_ms: 0.0,
        cpu_emulation_ms: 0.0,
        references_reused: false,
        pass: false,
        error: None,
    };
    if let Err(e) = run_case_inner(gpu, spec, steps, refs, &mut out) {
        out.error = Some(e.to_string());
        out.pass = false;
    }
    out
}

/// One sequence's prompt and the tokens it is fed (`None`: the
/// reference's greedy choices).
type PromptAndFed = (Vec<u32>, Option<Vec<u32>>);

/// The prompts of a case and the tokens each sequence is fed (`None`:
/// the reference's greedy choices).
///
/// Errors: a text span that runs past the text's end.
fn case_prompts(inputs: &Inputs<'_>, vocab: usize, steps: usize) -> Result<Vec<PromptAndFed>> {
    match inputs {
        Inputs::Random { prompt_lens, seed } => {
            let mut rng = SmallRng::seed_from_u64(*seed);
            Ok(prompt_lens
                .iter()
                .map(|&n| ((0..n).map(|_| rng.random_range(3..vocab as u32)).collect(), None))
                .collect())
        }
        Inputs::Text { ids, spans } => spans
            .iter()
            .map(|&(off, n)| {
                let end = off + n + steps;
                if end > ids.len() {
                    return Err(Error::Input(format!(
                        "the end-to-end text has {} tokens; a case needs tokens {off}..{end} ({n} prompt + {steps} steps)",
                        ids.len()
                    )));
                }
                Ok((ids[off..off + n].to_vec(), Some(ids[off + n..end].to_vec())))
            })
            .collect(),
    }
}

fn run_case_inner(
    gpu: &Arc<Gpu>,
    spec: &CaseSpec<'_>,
    steps: usize,
    refs: &mut RefCache,
    out: &mut E2eCase,
) -> Result<()> {
    let cpu = CpuModel::new(spec.ckpt, spec.opts)?;
    out.attention = format!("{:?}", cpu.plan.mode);
    let vocab = spec.ckpt.config.vocab_size;
    let inputs = case_prompts(&spec.inputs, vocab, steps)?;
    let prompts: Vec<Vec<u32>> = inputs.iter().map(|i| i.0.clone()).collect();
    let key = ref_key(spec, steps, &inputs);
    out.references_reused = refs.contains_key(&key);
    let r = match refs.get(&key) {
        Some(r) => r.clone(),
        None => {
            let t = Instant::now();
            let runs = inputs
                .iter()
                .map(|(p, f)| cpu_run(&cpu, p, steps, f.as_deref()))
                .collect::<Result<Vec<_>>>()?;
            let cpu_ms = t.elapsed().as_secs_f64() * 1e3;
            // The reference with bf16 activation emulation on the same tokens.
            let t = Instant::now();
            let mut emu = CpuModel::new(spec.ckpt, spec.opts)?;
            emu.set_bf16_emulation(Some(Bf16Points::ALL));
            let (emu_logits, emu_sel): (Vec<_>, Vec<_>) = prompts
                .iter()
                .zip(&runs)
                .map(|(p, r)| teacher_forced(&emu, p, &r.tokens))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
            let r = std::rc::Rc::new(References {
                runs,
                emu_logits,
                emu_sel,
                cpu_ms,
                emu_ms: t.elapsed().as_secs_f64() * 1e3,
            });
            refs.insert(key, r.clone());
            r
        }
    };
    let (runs, emu_logits, emu_sel) = (&r.runs, &r.emu_logits, &r.emu_sel);
    out.cpu_ms = r.cpu_ms;
    out.cpu_emulation_ms = r.emu_ms;
    // `[sequence][step]`: the emulated reference against the f32 one.
    let emulated: Vec<Vec<PositionAgreement>> = runs
        .iter()
        .zip(emu_logits)
        .map(|(r, e)| {
            r.logits
                .iter()
                .zip(e)
                .map(|(w, g)| compare_full(w, g))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()
        .map_err(|e| Error::Input(format!("bf16-emulated CPU reference: {e}")))?;
    let nan_as_inf = |e: f64| if e.is_nan() { f64::INFINITY } else { e };
    let norm = |l: &[f32]| l.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    out.ref_norm_per_step = runs
        .iter()
        .map(|r| r.logits.iter().map(|l| norm(l)).collect())
        .collect();
    out.emulation_rel_l2_per_step = runs
        .iter()
        .zip(emu_logits)
        .map(|(r, e)| {
            r.logits
                .iter()
                .zip(e)
                .map(|(w, g)| nan_as_inf(rel_l2(g, w).0))
                .collect()
        })
        .collect();
    out.rel_l2_per_step = vec![vec![f64::NAN; steps + 1]; prompts.len()];
    out.gpu_vs_emulation_rel_l2_per_step = vec![vec![f64::NAN; steps + 1]; prompts.len()];

    let t = Instant::now();
    let mut model =
        GpuModel::new(gpu.clone(), spec.ckpt, spec.opts)?.with_selection_path(spec.path);
    model.set_prefill_attention(spec.prefill_attention)?;
    model.set_record_selections(true);
    let mut seqs: Vec<GpuSequence> = prompts
        .iter()
        .enumerate()
        .map(|(b, p)| {
            // Sequence 0 starts with room for its prompt only: decode must grow it.
            let cap = if b == 0 { p.len() } else { p.len() + steps + 1 };
            model.new_sequence(cap)
        })
        .collect::<Result<_>>()?;
    let caps0: Vec<usize> = seqs.iter().map(GpuSequence::capacity).collect();
    let plan = cpu.plan;
    let hq = spec.ckpt.config.num_attention_heads;
    // (rel_l2, sequence, step, a set differed) of every comparison; NaN (non-finite logits) as +∞.
    let mut errs: Vec<(f64, usize, usize, bool)> = Vec::new();
    let mut unexplained = 0usize;
    let mut tally = |d: StepDiff, out: &mut E2eCase| -> bool {
        out.selection_sets += d.sets;
        out.selection_equal += d.equal;
        out.selection_near_ties += d.near_ties;
        out.selection_cascades += d.cascades;
        out.selection_bf16_flips += d.bf16_flips;
        out.selection_max_gap = out.selection_max_gap.max(d.max_gap);
        unexplained += d.unexplained;
        // up to 32 examples, and every unexplained set
        for ex in d.examples {
            if out.selection_examples.len() < 32 || ex["explained_as"] == "UNEXPLAINED" {
                out.selection_examples.push(ex);
            }
        }
        d.equal < d.sets
    };
    let mut argmax_exact = true;
    // Every position's GPU distribution against the f32 reference's (a
    // position whose logits are not finite is left out: the case fails on
    // finiteness and on the position count).
    // (sequence, step, a GPU block set differed, agreement).
    let mut gpu_pos: Vec<(usize, usize, bool, PositionAgreement)> = Vec::new();
    // Prefill, one sequence at a time.
    for (b, p) in prompts.iter().enumerate() {
        model.prefill(&mut seqs[b], p, |_, _| {})?;
        let got = model.download_logits()?;
        let am = model.argmax()?;
        argmax_exact &= am.len() == 1 && am[0] == argmax(&got);
        out.greedy_agree += usize::from(am[0] == argmax(&runs[b].logits[0]));
        let last = model
            .last_selections()
            .first()
            .map_or(0, |rows| rows.len().saturating_sub(1));
        let differs = tally(
            compare_step(
                &model,
                last,
                &runs[b],
                &emu_sel[b][0],
                &plan,
                hq,
                b,
                0,
                p.len(),
            ),
            out,
        );
        if let Ok(a) = compare_full(&runs[b].logits[0], &got) {
            gpu_pos.push((b, 0, differs, a));
        }
        let e = rel_l2(&got, &runs[b].logits[0]).0;
        out.rel_l2_per_step[b][0] = e;
        out.gpu_vs_emulation_rel_l2_per_step[b][0] = rel_l2(&got, &emu_logits[b][0]).0;
        errs.push((if e.is_nan() { f64::INFINITY } else { e }, b, 0, differs));
    }
    // Batched teacher-forced decode (step indexes every per-sequence record).
    let v = vocab;
    #[allow(clippy::needless_range_loop)]
    for step in 1..=steps {
        let toks: Vec<u32> = runs.iter().map(|r| r.tokens[step - 1]).collect();
        model.decode(&mut seqs, &toks)?;
        let got = model.download_logits()?;
        let am = model.argmax()?;
        for (b, run) in runs.iter().enumerate() {
            let row = &got[b * v..(b + 1) * v];
            argmax_exact &= am.get(b) == Some(&argmax(row));
            out.greedy_agree += usize::from(am.get(b) == Some(&argmax(&run.logits[step])));
            let t_len = prompts[b].len() + step;
            let differs = tally(
                compare_step(&model, b, run, &emu_sel[b][step], &plan, hq, b, step, t_len),
                out,
            );
            if let Ok(a) = compare_full(&run.logits[step], row) {
                gpu_pos.push((b, step, differs, a));
            }
            let e = rel_l2(row, &run.logits[step]).0;
            out.rel_l2_per_step[b][step] = e;
            out.gpu_vs_emulation_rel_l2_per_step[b][step] = emu_logits[b]
                .get(step)
                .map_or(f64::NAN, |w| rel_l2(row, w).0);
            errs.push((if e.is_nan() { f64::INFINITY } else { e }, b, step, differs));
        }
    }
    out.gpu_ms = t.elapsed().as_secs_f64() * 1e3;
    out.grew = seqs.iter().zip(&caps0).any(|(s, &c)| s.capacity() > c);
    let worst = errs
        .iter()
        .copied()
        .fold((0.0f64, 0usize, 0usize, false), |w, e| {
            if e.0 > w.0 {
                e
            } else {
                w
            }
        });
    out.worst_at = (worst.1, worst.2);
    out.max_rel_l2 = worst.0;
    let same = errs
        .iter()
        .filter(|e| !e.3)
        .map(|e| e.0)
        .fold(0.0f64, f64::max);
    out.max_rel_l2_same_selection = same;
    out.selection_diff_steps = errs
        .iter()
        .filter(|e| e.3)
        .map(|e| (e.1, e.2, e.0))
        .collect();
    out.mean_rel_l2 = errs.iter().map(|e| e.0).sum::<f64>() / errs.len().max(1) as f64;
    out.compared = errs.len();
    let max_mean = |v: &[Vec<f64>]| {
        let all: Vec<f64> = v.iter().flatten().map(|&e| nan_as_inf(e)).collect();
        (
            all.iter().copied().fold(0.0f64, f64::max),
            all.iter().sum::<f64>() / all.len().max(1) as f64,
        )
    };
    (out.emulation_max_rel_l2, out.emulation_mean_rel_l2) =
        max_mean(&out.emulation_rel_l2_per_step);
    (
        out.gpu_vs_emulation_max_rel_l2,
        out.gpu_vs_emulation_mean_rel_l2,
    ) = max_mean(&out.gpu_vs_emulation_rel_l2_per_step);
    out.argmax_kernel_exact = argmax_exact;
    let finite = errs.iter().all(|e| e.0.is_finite());
    // Information: over steps whose block sets all equal the reference's,
    // the smaller of the GPU's rel L2 to the bf16-emulated and to the f32
    // reference (a per-step bound does not hold in bf16: spec/testing.md).
    let same_emu = errs
        .iter()
        .filter(|e| !e.3)
        .map(|e| nan_as_inf(out.gpu_vs_emulation_rel_l2_per_step[e.1][e.2]).min(e.0))
        .fold(0.0f64, f64::max);
    out.max_rel_l2_same_selection_vs_emulation = same_emu;
    // The rule judges arithmetic: at positions where the GPU or the
    // emulated reference chose other blocks than the f32 reference (each
    // GPU difference explained above as a near-tie or cascade), one block of
    // the budget differs and the KL measures that choice, not rounding.
    let all_gpu: Vec<PositionAgreement> = gpu_pos.iter().map(|p| p.3).collect();
    let all_emu: Vec<PositionAgreement> = emulated.iter().flatten().copied().collect();
    out.gpu_vs_f32 = AgreementSummary::of(&all_gpu);
    out.emulated_vs_f32 = AgreementSummary::of(&all_emu);
    let same: Vec<(PositionAgreement, PositionAgreement)> = gpu_pos
        .iter()
        .filter(|&&(b, step, differs, _)| !differs && emu_sel[b][step] == runs[b].selections[step])
        .map(|&(b, step, _, a)| (a, emulated[b][step]))
        .collect();
    let (same_gpu, same_emu_pos): (Vec<_>, Vec<_>) = same.into_iter().unzip();
    out.gpu_vs_f32_same_selection = AgreementSummary::of(&same_gpu);
    out.emulated_vs_f32_same_selection = AgreementSummary::of(&same_emu_pos);
    out.emulated_selection_diff_positions = emu_sel
        .iter()
        .zip(runs)
        .map(|(e, r)| e.iter().zip(&r.selections).filter(|(x, y)| x != y).count())
        .sum();
    out.emulated_selection_diff_sets = emu_sel
        .iter()
        .zip(runs)
        .flat_map(|(e, r)| e.iter().zip(&r.selections))
        .flat_map(|(el, rl)| el.iter().zip(rl))
        .flat_map(|(eh, rh)| eh.iter().zip(rh))
        .filter(|(x, y)| x != y)
        .count();
    let gpu_diff_sets = out.selection_sets - out.selection_equal;
    // Every differing set explained one by one, or, on a model whose
    // bf16-emulated reference flips many sets by itself (deep models on real
    // text), no more differing sets than kl_ratio × the emulation's.
    out.selection_within_bf16 =
        gpu_diff_sets as f64 <= KL_RATIO * out.emulated_selection_diff_sets as f64;
    let selections_ok = unexplained == 0 || out.selection_within_bf16;
    if !selections_ok {
        out.selection_failure = Some(format!(
            "{unexplained} differing block sets are unexplained (not a near-tie within {NEAR_TIE}, a cascade or a bf16 flip), and the GPU's {gpu_diff_sets} differing sets exceed {KL_RATIO} × the bf16-emulated reference's {}",
            out.emulated_selection_diff_sets
        ));
    }
    out.bf16_rule = judge(
        &out.gpu_vs_f32_same_selection,
        &out.emulated_vs_f32_same_selection,
    );
    if out.gpu_vs_f32.top_n_misses > 0 {
        out.bf16_rule.pass = false;
        out.bf16_rule.failures.push(format!(
            "over all {} positions (block-set differences included), {} have a top-1 id outside the other side's top {TOP_N}",
            out.gpu_vs_f32.positions, out.gpu_vs_f32.top_n_misses
        ));
    }
    out.pass = finite && out.bf16_rule.pass && selections_ok && argmax_exact;
    Ok(())
}

/// Runs every case and writes the JSON report to `out_json`; returns
/// whether every case passed. `model_dir`: the SmolLM2 fixture (or any
/// dense checkpoint with a tokenizer.json) for the real-weights cases,
/// skipped when `None`; `text`: the text those cases read (tokenized with
/// the model's tokenizer; it must hold ≥ 13,760 tokens).
///
/// Errors: [`Error::Cuda`] when CUDA is missing or the GPU cannot be set
/// up; [`Error::Io`] when the report cannot be written; a model directory
/// that cannot be opened. Case failures are not errors: they are failed cases.
pub fn gpu_check_e2e(
    model_dir: Option<&Path>,
    text: &Path,
    out_json: &Path,
    steps: usize,
) -> Result<bool> {
    let missing = crate::cuda::missing_libraries();
    if !missing.is_empty() {
        return Err(Error::Cuda(format!(
            "gpu-check-e2e needs an NVIDIA GPU with the CUDA 13 libraries; not found: {} (on a GPU machine set LD_LIBRARY_PATH=/usr/local/cuda/lib64)",
            missing.join(", ")
        )));
    }
    let gpu = Arc::new(Gpu::new(0)?);
    let info = gpu.info().clone();
    println!(
        "gpu-check-e2e on {} ({}, driver CUDA {}), {steps} teacher-forced steps",
        info.name,
        info.arch,
        info.driver_version_string()
    );
    let tiny = synth::build(Preset::Tiny, 7)?;
    let mut dl_cfg = Preset::Tiny.config();
    if let Some(sc) = dl_cfg.sparse.as_mut() {
        sc.dense_len = 400;
    }
    let tiny_dl = synth::build_config(&dl_cfg, true, 8)?;
    // Dynamic NTK RoPE with a 256-token original maximum: one prompt
    // prefilled past it (its own prefill table), one crossing it during
    // decode (the decode table's per-position lengths), one below it.
    let mut ntk_cfg = Preset::Tiny.config();
    ntk_cfg.rope_scaling = crate::config::RopeScaling::Dynamic {
        factor: 2.0,
        original_max_position_embeddings: 256,
    };
    let tiny_ntk = synth::build_config(&ntk_cfg, true, 9)?;
    // 16 query heads on 2 KV heads (G 8): the prefill window scores take the
    // 32-M-row kernels (qa_prefill_scores_m32*, G 4/8/16), which the tiny
    // model's G 3 does not reach.
    let mut g8_cfg = Preset::Tiny.config();
    g8_cfg.num_attention_heads = 16;
    let tiny_g8 = synth::build_config(&g8_cfg, true, 10)?;
    let fixture = model_dir.map(Checkpoint::open).transpose()?;
    let text_ids = match model_dir {
        Some(dir) => {
            let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
            let body = std::fs::read_to_string(text).map_err(|e| Error::io(text, e))?;
            Some(tok.encode(&body)?)
        }
        None => None,
    };
    let ov = |sparse: Option<bool>, selection: Option<SelectionRule>| AttentionOverrides {
        sparse,
        selection,
        ..Default::default()
    };
    let opts = |attention, prefill| EngineOptions { attention, prefill };
    let mut specs = vec![
        CaseSpec {
            name: "tiny-dense",
            ckpt: &tiny,
            opts: opts(ov(Some(false), None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![5, 77, 300],
                seed: 11,
            },
            // 3 × (TINY_DENSE_STEPS + 1) = 261 positions: the rule is
            // defined on ≥ 256 (spec/testing.md); at 195 one near-tie
            // of the random-weight model was half a percentage point
            min_steps: TINY_DENSE_STEPS,
            prefill_attention: PrefillAttention::Rowwise,
        },
        CaseSpec {
            name: "tiny-nosa-sparse",
            ckpt: &tiny,
            opts: opts(ov(None, None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![20, 150, 700],
                seed: 12,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::Rowwise,
        },
        CaseSpec {
            name: "tiny-nosa-sparse-host-selection",
            ckpt: &tiny,
            opts: opts(ov(None, None), PrefillMode::Auto),
            path: SelectionPath::HostFallback,
            inputs: Inputs::Random {
                prompt_lens: vec![31, 650],
                seed: 13,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::Rowwise,
        },
        CaseSpec {
            name: "tiny-nosa-dense-prefill",
            ckpt: &tiny,
            opts: opts(ov(None, None), PrefillMode::Dense),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![64, 450],
                seed: 14,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::Rowwise,
        },
        CaseSpec {
            name: "tiny-nosa-dense-len-400",
            ckpt: &tiny_dl,
            opts: opts(ov(None, None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![100, 380, 600],
                seed: 15,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::Rowwise,
        },
        CaseSpec {
            name: "tiny-dense-dynamic-ntk",
            ckpt: &tiny_ntk,
            opts: opts(ov(Some(false), None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![100, 230, 300],
                seed: 18,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::Rowwise,
        },
        CaseSpec {
            name: "tiny-infllmv2",
            ckpt: &tiny,
            opts: opts(ov(None, Some(SelectionRule::InfLlmV2)), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![100, 500],
                seed: 16,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::Rowwise,
        },
        // Dense prefill on the tensor cores (kernels/attn_prefill.cu): a
        // prompt of the prefill chunk + 276 tokens (1,300 at the default
        // 1,024) crosses a chunk, so its second chunk starts at T0 = the
        // chunk; then sparse decode after a dense prefill.
        CaseSpec {
            name: "tiny-dense-tc-prefill",
            ckpt: &tiny,
            opts: opts(ov(Some(false), None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![5, 77, past_chunk(276)],
                seed: 19,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::TensorCore,
        },
        CaseSpec {
            name: "tiny-nosa-dense-tc-prefill",
            ckpt: &tiny,
            opts: opts(ov(None, None), PrefillMode::Dense),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![64, 600],
                seed: 20,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::TensorCore,
        },
        // Sparse prefill on the tensor cores (attn_prefill_sparse_d*): each
        // tile's union of its rows' block lists, built on the device; the
        // chunk + 276-token prompt's second chunk starts at T0 = the chunk
        // (1,300 and 1,024 by default), the chunk + 5-token prompt's
        // second chunk is 5 rows (fewer than
        // QA_GEMM_MIN_ROWS: per-row window logits after a chunk scored from
        // the shared Kc, whichever SPARDA_PREFILL_SCORES says); a 20-token
        // prompt has no window yet (forced blocks only).
        CaseSpec {
            name: "tiny-nosa-sparse-tc-prefill",
            ckpt: &tiny,
            opts: opts(ov(None, None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![20, 150, past_chunk(5), past_chunk(276)],
                seed: 21,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::TensorCore,
        },
        CaseSpec {
            name: "tiny-g8-nosa-sparse-tc-prefill",
            ckpt: &tiny_g8,
            opts: opts(ov(None, None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![150, past_chunk(276)],
                seed: 23,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::TensorCore,
        },
        CaseSpec {
            name: "tiny-infllmv2-tc-prefill",
            ckpt: &tiny,
            opts: opts(ov(None, Some(SelectionRule::InfLlmV2)), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![100, 600],
                seed: 22,
            },
            min_steps: 0,
            prefill_attention: PrefillAttention::TensorCore,
        },
    ];
    if let (Some(f), Some(ids)) = (&fixture, &text_ids) {
        // Real text: two sequences (a short prompt, and one of two prefill
        // chunks) dense, two InfLLM-V2 sequences past their 20-block budget
        // (16 window blocks, the sink and 3 selected), each fed FIXTURE_STEPS
        // tokens of the text. The tensor-core cases read the same inputs, so
        // they share the CPU references (computed once).
        specs.push(CaseSpec {
            name: "fixture-dense-text",
            ckpt: f,
            opts: opts(ov(None, None), PrefillMode::Auto),
            path: SelectionPath::Gpu,
            inputs: Inputs::Text {
                ids,
                spans: vec![(0, 40), (6_000, past_chunk(76))],
            },
            min_steps: FIXTURE_STEPS,
            prefill_attention: PrefillAttention::Rowwise,
        });
        specs.push(CaseSpec {
            name: "fixture-infllmv2-text",
            ckpt: f,
            opts: opts(
                AttentionOverrides {
                    selection: Some(SelectionRule::InfLlmV2),
                    budget_blocks: Some(20),
                    select_blocks: Some(3),
                    ..Default::default()
                },
                PrefillMode::Auto,
            ),
            path: SelectionPath::Gpu,
            inputs: Inputs::Text {
                ids,
                spans: vec![(4_000, past_chunk(576)), (12_000, past_chunk(576))],
            },
            min_steps: FIXTURE_STEPS,
            prefill_attention: PrefillAttention::Rowwise,
        });
        // Both again on the tensor-core prefill kernels: dense (the long
        // prompt is two chunks, the second at T0 = the chunk) and sparse past
        // the budget (two chunks, the second at T0 = the chunk). Same inputs: they
        // share the CPU references.
        let tc: Vec<CaseSpec<'_>> = specs[specs.len() - 2..]
            .iter()
            .zip([
                "fixture-dense-text-tc-prefill",
                "fixture-infllmv2-text-tc-prefill",
            ])
            .map(|(c, name)| CaseSpec {
                name,
                prefill_attention: PrefillAttention::TensorCore,
                ..c.clone()
            })
            .collect();
        specs.extend(tc);
    }
    let mut cases = Vec::new();
    let mut refs = RefCache::new();
    for spec in &specs {
        let c = run_case(&gpu, spec, steps, &mut refs);
        let (g, e) = (
            &c.gpu_vs_f32_same_selection,
            &c.emulated_vs_f32_same_selection,
        );
        println!(
            "  {:<26} {:<5} {} positions, {} judged (block sets equal on both sides); KL vs f32 mean/p99/max: GPU {:.2e}/{:.2e}/{:.2e}, bf16-emulated CPU {:.2e}/{:.2e}/{:.2e}; top-1 GPU {:.1}% emulated {:.1}%; all positions: KL mean GPU {:.2e} emulated {:.2e}, top-{TOP_N} misses {}; rel_l2 max {:.2e} (emulated {:.2e}); selections {}/{} equal ({} near-ties, {} cascades, {} bf16 flips; emulated differs at {} positions, {} sets){}{}{}",
            c.name,
            if c.pass { "pass" } else { "FAIL" },
            c.gpu_vs_f32.positions,
            g.positions,
            g.kl_mean,
            g.kl_p99,
            g.kl_max,
            e.kl_mean,
            e.kl_p99,
            e.kl_max,
            g.top1_agreement_pct,
            e.top1_agreement_pct,
            c.gpu_vs_f32.kl_mean,
            c.emulated_vs_f32.kl_mean,
            c.gpu_vs_f32.top_n_misses,
            c.max_rel_l2,
            c.emulation_max_rel_l2,
            c.selection_equal,
            c.selection_sets,
            c.selection_near_ties,
            c.selection_cascades,
            c.selection_bf16_flips,
            c.emulated_selection_diff_positions,
            c.emulated_selection_diff_sets,
            c.selection_failure.as_deref().map(|f| format!("; {f}")).unwrap_or_default(),
            if c.bf16_rule.failures.is_empty() {
                String::new()
            } else {
                format!("; {}", c.bf16_rule.failures.join("; "))
            },
            c.error.as_deref().map(|e| format!(" error: {e}")).unwrap_or_default()
        );
        cases.push(c);
    }
    let passed = cases.iter().all(|c| c.pass);
    let report = json!({
        "what": "sparda gpu-check-e2e: GPU engine vs the CPU reference under teacher forcing (spec/testing.md)",
        "gpu": info.name,
        "arch": info.arch,
        "driver_cuda_version": info.driver_version_string(),
        "nvrtc_version": format!("{}.{}", info.nvrtc_version.0, info.nvrtc_version.1),
        "date_utc": utc_now_iso(),
        "commit": std::env::var("SPARDA_COMMIT").ok(),
        "nvrtc_options": crate::cuda::context::env_nvrtc_options(),
        "steps": steps,
        "fixture": model_dir.map(|p| p.display().to_string()),
        "text": model_dir.map(|_| text.display().to_string()),
        "kl_ratio": KL_RATIO,
        "top1_slack_pp": TOP1_SLACK_PP,
        "top_n": TOP_N,
        "near_tie_rel": NEAR_TIE,
        "diagnostics": "per case, [sequence][step] arrays (step 0 = after prefill): rel_l2_per_step (GPU vs f32 CPU), ref_norm_per_step (|CPU logits|_2), emulation_rel_l2_per_step (CPU with bf16 activation emulation, rounding where the engine stores bf16, vs f32 CPU: what bf16 arithmetic alone gives), gpu_vs_emulation_rel_l2_per_step (GPU vs the bf16-emulating CPU). Not part of the pass criteria.",
        "criteria": "spec/testing.md Tolerances. pass = finite logits; the whole-model rule: against the f32 CPU reference, over the positions (every sequence; prefill and each teacher-forced step) where the GPU's and the bf16-emulated reference's block sets all equal the f32 reference's (every position of a dense case), the GPU's mean and p99 KL (full vocabulary) <= kl_ratio x the bf16-emulated CPU reference's and its top-1 agreement >= the emulated reference's - top1_slack_pp (or one judged position's share, where fewer than 100 positions are judged); at every position (all) each side's top-1 among the other's top_n; every differing block set explained as a near-tie (each differing block within near_tie_rel of the cut that decided it, scored with the CPU reference's Kc/p and the GPU's own query) or as a cascade of a lower layer's difference at the same step, or as a bf16 flip (the bf16-emulated reference's set of that layer and head differs from the f32 reference's too), or else the GPU's differing sets number at most kl_ratio x the bf16-emulated reference's own differing sets (a deep model on real text, where bf16 rounding alone flips hundreds of sets); GPU argmax kernel == host argmax of the GPU logits. Rel L2 figures are information.",
        "passed": passed,
        "cases": cases,
    });
    let text = serde_json::to_string_pretty(&report)
        .map_err(|e| Error::Cuda(format!("serialising the report: {e}")))?;
    if let Some(dir) = out_json.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    std::fs::write(out_json, text).map_err(|e| Error::io(out_json, e))?;
    Ok(passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_share_references_only_with_the_same_model_options_and_inputs() {
        let ckpt = crate::bench::open_model("synth:tiny").unwrap();
        let other = crate::bench::open_model("synth:tiny").unwrap();
        let spec = |c, sparse: bool, pa| CaseSpec {
            name: "x",
            ckpt: c,
            opts: EngineOptions {
                attention: AttentionOverrides {
                    sparse: Some(sparse),
                    ..Default::default()
                },
                prefill: PrefillMode::Auto,
            },
            path: SelectionPath::Gpu,
            inputs: Inputs::Random {
                prompt_lens: vec![3],
                seed: 1,
            },
            min_steps: 0,
            prefill_attention: pa,
        };
        let inputs = vec![(vec![5u32, 6, 7], None), (vec![8u32], Some(vec![9u32]))];
        let a = ref_key(&spec(&ckpt, true, PrefillAttention::Rowwise), 4, &inputs);
        // the GPU's prefill kernel does not change the CPU references
        assert_eq!(
            a,
            ref_key(&spec(&ckpt, true, PrefillAttention::TensorCore), 4, &inputs)
        );
        assert_ne!(
            a,
            ref_key(&spec(&ckpt, false, PrefillAttention::Rowwise), 4, &inputs)
        );
        assert_ne!(
            a,
            ref_key(&spec(&other, true, PrefillAttention::Rowwise), 4, &inputs)
        );
        assert_ne!(
            a,
            ref_key(&spec(&ckpt, true, PrefillAttention::Rowwise), 5, &inputs)
        );
        let fed_other = vec![(vec![5u32, 6, 7], None), (vec![8u32], Some(vec![10u32]))];
        assert_ne!(
            a,
            ref_key(&spec(&ckpt, true, PrefillAttention::Rowwise), 4, &fed_other)
        );
        // a token moved across the prompt/fed boundary is another input
        let moved = vec![(vec![5u32, 6, 7], None), (vec![8u32, 9], None)];
        assert_ne!(
            a,
            ref_key(&spec(&ckpt, true, PrefillAttention::Rowwise), 4, &moved)
        );
    }

    /// Without CUDA the check is a clear error, never a panic (it must run
    /// on the GPU-less CI machines).
    #[test]
    fn without_cuda_the_check_is_a_clear_error() {
        if crate::cuda::is_available() {
            return;
        }
        let out = std::env::temp_dir().join(format!("sparda-e2e-{}.json", std::process::id()));
        match gpu_check_e2e(None, Path::new("data/texts/hamlet.txt"), &out, 2) {
            Err(Error::Cuda(msg)) => assert!(msg.contains("not found"), "{msg}"),
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
    }
}
