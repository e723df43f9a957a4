//! `offload-check`: offloaded decode against GPU-resident sparse decode,
//! bit for bit (testing.md "Bitwise identity").
//!
//! Both runs use the same prefill (the GPU-resident one), the same
//! selection kernels and the same attention kernel reducing in ascending
//! block order; only where each block is read from differs (GPU cache vs
//! slot pool / tail ring filled from pinned host memory). So greedy decode
//! must give the same token at every step and the same logits bits: each
//! step's f32 logits are hashed (FNV-1a over their bits) and the hashes
//! compared. Long runs cover what NOSI gets wrong (runtime.md §3): the
//! window moving, compressed state growing, many tail roll-overs and
//! write-backs, contexts shorter than the budget at the start.

use crate::pipeline::{DecodeMode, GpuModel, OffloadOptions};
use crate::{Error, Result};
use serde_json::{json, Value};

/// One offloaded configuration to compare with the resident run.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// Offload settings.
    pub offload: OffloadOptions,
    /// Forecast mode: prefetch on the copy stream (ignored without forecast).
    pub prefetch: bool,
    /// Injected delay before every fetch, µs (stress; 0 = none).
    pub copy_delay_us: u32,
}

/// One decode run's record (serialized, without `stats`, by
/// `offload-check --save-resident` so that a long check can run its
/// resident and offloaded halves in separate processes).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Run {
    /// Greedy tokens, one per step (the first from the prefill's logits).
    pub tokens: Vec<u32>,
    /// FNV-1a hash of each step's logits bits (same order).
    pub logit_hashes: Vec<u64>,
    /// Decode wall time, ms.
    pub decode_ms: f64,
    /// Offload counters of the run (None when GPU-resident).
    #[serde(skip)]
    pub stats: Option<crate::pipeline::OffloadStats>,
    /// Memory sampled after the prefill and every `sample_every` decode
    /// steps (and after the last step).
    pub memory: Vec<MemorySample>,
    /// The fetch configuration the run's steps used (`--fetch auto`
    /// resolved for its batch: `sm:N`, `dma`, `split:N:P`, with `+whole`
    /// when the copy CTAs held whole SMs); None when GPU-resident.
    #[serde(default)]
    pub fetch_resolved: Option<String>,
    /// Decode steps that replayed a captured CUDA graph
    /// ([`GpuModel::last_step_was_graph`]); the others ran eagerly.
    #[serde(default)]
    pub graph_steps: usize,
}

/// Memory in use at one decode step of a run (for long-run checks: GPU
/// memory must stay flat; host memory may grow only by the new tokens' KV).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct MemorySample {
    /// Decode steps done (0: after the prefill).
    pub step: usize,
    /// GPU memory in use on the device (total − free, `cuMemGetInfo`), bytes.
    pub gpu_used_bytes: usize,
    /// The process's resident set (VmRSS of /proc/self/status, pinned host
    /// memory included once touched), bytes; 0 where /proc is missing.
    pub host_rss_bytes: usize,
}

/// A [`MemorySample`] now.
fn sample_memory(model: &GpuModel, step: usize) -> Result<MemorySample> {
    let (free, total) = model.gpu().mem_info()?;
    Ok(MemorySample {
        step,
        gpu_used_bytes: total - free,
        host_rss_bytes: crate::bench::host_rss_bytes().map_or(0, |b| b as usize),
    })
}

fn fnv1a(x: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in x {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Greedy decode of `new_tokens` tokens after each of `prompts` (a batch
/// of B sequences of different lengths, decoded together), GPU-resident
/// (`mode` None) or offloaded, sampling memory every `sample_every` steps
/// (0: after the prefill and at the end only). Tokens and logit hashes are
/// step-major: entry `step · B + b`.
///
/// Errors: as [`GpuModel::prefill`], [`GpuModel::offload_sequence`],
/// [`GpuModel::decode`].
pub fn run(
    model: &mut GpuModel,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    mode: Option<Mode>,
    sample_every: usize,
) -> Result<Run> {
    let offload = mode.map(|m| m.offload);
    model.set_offload(offload)?;
    model.set_prefetch(mode.is_some_and(|m| m.prefetch));
    model.set_copy_delay_us(mode.map_or(0, |m| m.copy_delay_us));
    let nb = prompts.len();
    let fetch_resolved = offload.map(|_| {
        let whole = if model.fetch_on_whole_sms(nb) {
            "+whole"
        } else {
            ""
        };
        format!("{}{whole}", model.fetch_engine(nb).label())
    });
    let mut seqs = Vec::with_capacity(nb);
    let mut tok = Vec::with_capacity(nb);
    let mut tokens = Vec::with_capacity(new_tokens * nb);
    let mut logit_hashes = Vec::with_capacity(new_tokens * nb);
    for p in prompts {
        let cap = p.len() + new_tokens + 1;
        let mut seq = model.new_sequence(cap)?;
        if offload.is_some() {
            model.begin_offload(&mut seq, cap)?;
        }
        model.prefill(&mut seq, p, |_, _| {})?;
        if offload.is_some() {
            model.offload_sequence(&mut seq, cap)?;
        }
        logit_hashes.push(fnv1a(&model.download_logits()?));
        tok.push(
            *model
                .argmax()?
                .first()
                .ok_or_else(|| Error::Cuda("argmax returned no token".into()))?,
        );
        seqs.push(seq);
    }
    if offload.is_some() {
        model.reset_offload_stats()?;
    }
    tokens.extend_from_slice(&tok);
    let mut memory = vec![sample_memory(model, 0)?];
    let t = std::time::Instant::now();
    let v = model.config.vocab_size;
    let mut graph_steps = 0;
    for step in 1..new_tokens {
        crate::interrupt::check(|| format!("offload-check decode step {step}"))?;
        model.decode(&mut seqs, &tok)?;
        graph_steps += usize::from(model.last_step_was_graph());
        let logits = model.download_logits()?;
        logit_hashes.extend(logits.chunks_exact(v).map(fnv1a));
        tok = model.argmax()?;
        if tok.len() != nb {
            return Err(Error::Cuda(format!(
                "argmax returned {} tokens for {nb} sequences",
                tok.len()
            )));
        }
        tokens.extend_from_slice(&tok);
        if (sample_every > 0 && step % sample_every == 0) || step + 1 == new_tokens {
            memory.push(sample_memory(model, step)?);
        }
    }
    let decode_ms = t.elapsed().as_secs_f64() * 1e3;
    let stats = if offload.is_some() {
        Some(model.offload_stats()?)
    } else {
        None
    };
    drop(seqs);
    model.set_offload(None)?;
    model.set_copy_delay_us(0);
    model.release_buffers();
    Ok(Run {
        tokens,
        logit_hashes,
        decode_ms,
        stats,
        memory,
        fetch_resolved,
        graph_steps,
    })
}

/// Growth over a run's samples: (GPU bytes, host RSS bytes) from the first
/// sample to the last, as signed numbers.
fn growth(m: &[MemorySample]) -> (i64, i64) {
    match (m.first(), m.last()) {
        (Some(a), Some(b)) => (
            b.gpu_used_bytes as i64 - a.gpu_used_bytes as i64,
            b.host_rss_bytes as i64 - a.host_rss_bytes as i64,
        ),
        _ => (0, 0),
    }
}

/// Whether an offloaded run of `steps` greedy steps (the first from the
/// prefill) should replay CUDA graphs: graph decode mode, and a fetch the
/// device runs alone (`fetch_resolved` `sm:N`, with or without `+whole`;
/// the copy engines, alone or in a split, keep steps eager), over at least
/// three steps (a build's first step runs eagerly).
pub(crate) fn graph_expected(mode: DecodeMode, fetch_resolved: Option<&str>, steps: usize) -> bool {
    mode == DecodeMode::Graph && fetch_resolved.is_some_and(|f| f.starts_with("sm:")) && steps >= 3
}

/// The B greedy tokens of decode step `step` of a step-major token list
/// (`None` past its end).
fn tokens_at(tokens: &[u32], b: usize, step: usize) -> Option<&[u32]> {
    tokens.get(step * b..(step + 1) * b)
}

/// The resident run (or `base`, a resident run recorded before with the
/// same model, prompts and settings), then one offloaded run per entry of
/// `modes`, each compared with the resident one. Returns (all identical,
/// JSON record).
///
/// Errors: as [`run`].
pub fn offload_identity(
    model: &mut GpuModel,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    modes: &[Mode],
    sample_every: usize,
    base: Option<Run>,
) -> Result<(bool, Value)> {
    let base = match base {
        Some(b) => b,
        None => run(model, prompts, new_tokens, None, sample_every)?,
    };
    let nb = prompts.len().max(1);
    // the steps whose tokens the report spells out (long runs: 2K, 8K, 20K,
    // and the last step: a run of 20,000 tokens ends at step 19,999)
    let mut checkpoints: Vec<usize> = [2_000usize, 8_000, 20_000]
        .into_iter()
        .filter(|&s| s < new_tokens)
        .collect();
    if new_tokens > 0 && checkpoints.last() != Some(&(new_tokens - 1)) {
        checkpoints.push(new_tokens - 1);
    }
    eprintln!(
        "offload-check: GPU-resident sparse, {} tokens in {:.0} ms",
        base.tokens.len(),
        base.decode_ms
    );
    let mut all = true;
    let mut runs = Vec::new();
    let forecast = model.forecast_on();
    for m in modes {
        let o = &m.offload;
        let r = run(model, prompts, new_tokens, Some(*m), sample_every)?;
        let tok_mismatch = base.tokens.iter().zip(&r.tokens).position(|(a, b)| a != b);
        let logit_mismatch = base
            .logit_hashes
            .iter()
            .zip(&r.logit_hashes)
            .position(|(a, b)| a != b);
        let same = tok_mismatch.is_none()
            && logit_mismatch.is_none()
            && base.tokens.len() == r.tokens.len();
        let steps = r.tokens.len() / nb;
        // a run that should replay graphs and replayed none: its capture
        // failed (logged) and the identity above only covers eager steps
        let graph_missing = graph_expected(model.decode_mode(), r.fetch_resolved.as_deref(), steps)
            && r.graph_steps == 0;
        all &= same && !graph_missing;
        let st = r.stats.clone().unwrap_or_default();
        if graph_missing {
            eprintln!(
                "offload-check: {:?}: no decode step replayed a CUDA graph (its capture failed: see the warning above)",
                o.fetch
            );
        }
        eprintln!(
            "offload-check: {:?}{}: {} in {:.0} ms; tokens {}, logits {}; γ {:.3}, {} blocks fetched; {} of {} steps from a CUDA graph",
            o.fetch,
            if forecast {
                format!(", forecast, prefetch {}, copy delay {} µs", if m.prefetch { "on" } else { "off" }, m.copy_delay_us)
            } else {
                String::new()
            },
            if same { "IDENTICAL" } else { "DIFFERENT" },
            r.decode_ms,
            tok_mismatch.map_or("all equal".to_string(), |i| format!(
                "first differ at step {i}"
            )),
            logit_mismatch.map_or("bitwise equal".to_string(), |i| format!(
                "first differ at step {i}"
            )),
            st.locality_all(),
            st.fetched.iter().sum::<u64>(),
            r.graph_steps,
            steps.saturating_sub(1)
        );
        runs.push(json!({
            "fetch": o.fetch.name(),
            "fetch_detail": format!("{:?}", o.fetch),
            "fetch_resolved": r.fetch_resolved,
            "offload_layer0": o.offload_layer0,
            "forecast": forecast,
            "prefetch": forecast && m.prefetch,
            "copy_delay_us": m.copy_delay_us,
            "identical": same,
            "first_token_mismatch": tok_mismatch,
            "first_logits_mismatch": logit_mismatch,
            "steps": steps,
            "graph_steps": r.graph_steps,
            "graph_missing": graph_missing,
            "decode_ms": r.decode_ms,
            "locality_gamma": st.locality_all(),
            "locality_gamma_per_layer": st.locality(),
            "blocks_fetched": st.fetched.iter().sum::<u64>(),
            "bytes_fetched": st.bytes_fetched(),
            "memory_samples": r.memory,
            "gpu_mem_growth_bytes": growth(&r.memory).0,
            "host_rss_growth_bytes": growth(&r.memory).1,
            "tokens_at_checkpoints": checkpoints.iter().map(|&s| json!({
                "step": s,
                "tokens": tokens_at(&r.tokens, nb, s),
                "equal_to_resident": tokens_at(&r.tokens, nb, s) == tokens_at(&base.tokens, nb, s),
            })).collect::<Vec<_>>(),
        }));
    }
    let v = json!({
        "batch": prompts.len(),
        "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
        "new_tokens": new_tokens,
        "final_context": prompts.iter().map(|p| p.len() + new_tokens).collect::<Vec<_>>(),
        "resident": {"decode_ms": base.decode_ms, "tokens_head": &base.tokens[..base.tokens.len().min(32)],
            "memory_samples": base.memory,
            "gpu_mem_growth_bytes": growth(&base.memory).0,
            "host_rss_growth_bytes": growth(&base.memory).1,
            "tokens_at_checkpoints": checkpoints.iter().map(|&s| json!({
                "step": s, "tokens": tokens_at(&base.tokens, nb, s)})).collect::<Vec<_>>()},
        "memory_sample_every": sample_every,
        "offloaded": runs,
        "identical": all,
        "compared": "greedy token and FNV-1a hash of the f32 logits bits of every sequence at every step (the batch decoded together)",
    });
    Ok((all, v))
}

/// GPU forecast selection against the CPU reference's (spec §4 "Forecast
/// mode"): the CPU reference with the same forecast weights decodes `steps`
/// greedy tokens after each of `prompts`; the GPU model (forecast on, KV
/// and decode mode as configured) decodes the B sequences together,
/// teacher-forced with those tokens, and every step's block sets, per row,
/// layer and KV head, are compared. Prompts of different lengths on both
/// sides of `dense_len` make steps that mix dense rows (no selection:
/// empty sets on both sides) and sparse rows, with rows crossing dense_len
/// during the run. A set that differs passes only as a near-tie (the
/// differing blocks within [`super::e2e::NEAR_TIE`] of the cut that decided
/// them, scored over the CPU reference's compressed keys with the CPU's
/// forecast or with the GPU's own ([`GpuModel::last_forecasts`], as
/// gpu-check-e2e scores with the GPU's own query): inputs differ by bf16
/// rounding), as a cascade of a difference in a lower layer of the same
/// row and step, or as reproduced: the CPU rule applied to the GPU's own
/// forecast and selection state ([`GpuModel::selection_state`]) gives the
/// GPU's set (the kernels chose right from what they were given) and those
/// inputs are within [`super::kernels::TOLERANCE_BF16`] (relative L2) of the
/// CPU's (the difference is their bf16 rounding); counted apart and
/// reported with the three distances. Returns (pass, JSON record).
///
/// Errors: CPU or GPU failures; an empty batch.
pub fn forecast_selection(
    model: &mut GpuModel,
    cpu: &crate::cpu::CpuModel,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<(bool, Value)> {
    use crate::sample::argmax;
    if prompts.is_empty() {
        return Err(Error::Input("forecast_selection: no prompts".into()));
    }
    // The CPU reference, one sequence at a time: tokens, selections and
    // forecasts of every step, and its final state (for the cut scores).
    /// Per layer: the forecast query and the windows it scored (a step's `Sequence::forecasts`).
    type StepForecasts = Vec<Option<(Vec<f32>, usize)>>;
    struct CpuRun {
        tokens: Vec<u32>,
        sels: Vec<Vec<Vec<Vec<usize>>>>,
        fcs: Vec<StepForecasts>,
        seq: crate::cpu::Sequence,
    }
    let mut runs = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let mut seq = cpu.new_sequence();
        let mut logits = cpu.prefill(&mut seq, prompt, |_, _| {})?;
        let (mut tokens, mut sels, mut fcs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..steps {
            let tok = argmax(&logits);
            tokens.push(tok);
            logits = cpu.decode(&mut seq, tok)?;
            sels.push(seq.selections.clone());
            fcs.push(seq.forecasts.clone());
        }
        runs.push(CpuRun {
            tokens,
            sels,
            fcs,
            seq,
        });
    }
    model.set_record_selections(true);
    let offload = model.offload_options().is_some();
    let mut gseqs = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let cap = prompt.len() + steps + 1;
        let mut g = model.new_sequence(cap)?;
        if offload {
            model.begin_offload(&mut g, cap)?;
        }
        model.prefill(&mut g, prompt, |_, _| {})?;
        if offload {
            model.offload_sequence(&mut g, cap)?;
        }
        gseqs.push(g);
    }
    let (mut sets, mut equal, mut near, mut cascades, mut unexplained) = (0, 0, 0, 0, 0);
    let (mut dense_sets, mut mixed_steps, mut from_inputs) = (0usize, 0usize, 0usize);
    let mut max_gap = 0.0f64;
    let mut examples = Vec::new();
    let plan = cpu.plan;
    let bs = plan.budget.block_size;
    for step in 0..steps {
        let toks: Vec<u32> = runs.iter().map(|r| r.tokens[step]).collect();
        let dense_rows = gseqs
            .iter()
            .filter(|g| !plan.sparse_at(g.len() + 1))
            .count();
        mixed_steps += usize::from(dense_rows > 0 && dense_rows < gseqs.len());
        model.decode(&mut gseqs, &toks)?;
        model.check_device_errors()?;
        let got = model.last_selections();
        let gpu_fc = model.last_forecasts();
        for (b, run) in runs.iter().enumerate() {
            let t_len = prompts[b].len() + step + 1;
            let mut lower = false;
            for (l, want_l) in run.sels[step].iter().enumerate() {
                let mut differs = false;
                for (h, want) in want_l.iter().enumerate() {
                    let g = got
                        .get(l)
                        .and_then(|r| r.get(b))
                        .and_then(|x| x.get(h))
                        .cloned()
                        .unwrap_or_default();
                    sets += 1;
                    dense_sets += usize::from(want.is_empty());
                    if &g == want {
                        equal += 1;
                        continue;
                    }
                    differs = true;
                    let diff: Vec<usize> = want
                        .iter()
                        .filter(|m| !g.contains(m))
                        .chain(g.iter().filter(|m| !want.contains(m)))
                        .copied()
                        .collect();
                    let layer = &run.seq.layers[l];
                    // The cut gap of the differing blocks, scored over the CPU
                    // reference's Kc and p with the CPU's forecast and with the
                    // GPU's own (as gpu-check-e2e scores with the GPU's own
                    // query): a near-tie under either is activation rounding.
                    let gap_with =
                        |layer: &crate::model::state::LayerKv, f: &[f32], windows: usize| {
                            let dh = f.len() / layer.kv_heads;
                            let s = crate::cpu::forecast_window_scores(
                                &f[h * dh..(h + 1) * dh],
                                layer,
                                h,
                                windows,
                            );
                            super::e2e::cut_gap_scores(&plan, layer, &s, h, t_len, &diff)
                        };
                    let (gap_cpu, gap_gpu) = match &run.fcs[step][l] {
                        Some((f, windows)) if !want.is_empty() && !g.is_empty() => {
                            let gf = gpu_fc
                                .get(l)
                                .and_then(|r| r.get(b))
                                .filter(|gf| gf.len() == f.len());
                            (
                                gap_with(layer, f, *windows),
                                gf.map_or(f64::INFINITY, |gf| gap_with(layer, gf, *windows)),
                            )
                        }
                        _ => (f64::INFINITY, f64::INFINITY),
                    };
                    // The GPU's inputs alone: the CPU rule applied to the GPU's
                    // own forecast, compressed keys and pooled scores. When it
                    // gives the GPU's set, the kernels chose right from what
                    // they were given; when, besides, those inputs are within
                    // the bf16 tolerance of the CPU's (testing.md: 2e-2
                    // relative L2), the difference is the inputs' rounding. A
                    // forecast of the wrong layer or position, or state of the
                    // wrong step, is far outside that bound.
                    let (reproduced, input_rel) = match (
                        &run.fcs[step][l],
                        gpu_fc.get(l).and_then(|r| r.get(b)),
                        plan.rule(),
                    ) {
                        (Some((f, windows)), Some(gf), Some(rule))
                            if !want.is_empty() && !g.is_empty() && gf.len() == f.len() =>
                        {
                            let st = model.selection_state(&gseqs[b], l, *windows)?;
                            let dh = gf.len() / st.kv_heads;
                            let fh = h * dh..(h + 1) * dh;
                            let sc = crate::cpu::forecast_window_scores(
                                &gf[fh.clone()],
                                &st,
                                h,
                                *windows,
                            );
                            let budget = &plan.budget;
                            let nb = budget.blocks(t_len - 1);
                            let r = crate::model::select::pool_blocks(budget, &sc, nb);
                            let p: Vec<f32> = (0..*windows)
                                .map(|w| st.p.get(w * st.kv_heads + h).copied().unwrap_or(0.0))
                                .collect();
                            let e = crate::model::select::pool_blocks(budget, &p, nb);
                            let same = crate::model::select::select(budget, rule, &r, &e) == g;
                            let rel = |x: &[f32], y: &[f32]| super::kernels::rel_l2(x, y).0;
                            let f_rel = rel(&gf[fh.clone()], &f[fh]);
                            let kc_rel = rel(&st.kc, &layer.kc[..st.kc.len()]);
                            let p_rel = if st.p.is_empty() {
                                0.0
                            } else {
                                rel(&st.p, &layer.p[..st.p.len()])
                            };
                            let close = [f_rel, kc_rel, p_rel]
                                .iter()
                                .all(|&x| x <= super::kernels::TOLERANCE_BF16);
                            (same && close, Some([f_rel, kc_rel, p_rel]))
                        }
                        _ => (false, None),
                    };
                    let gap = gap_cpu.min(gap_gpu);
                    let how = if gap <= super::e2e::NEAR_TIE {
                        near += 1;
                        max_gap = max_gap.max(gap);
                        "near-tie"
                    } else if lower {
                        cascades += 1;
                        "cascade"
                    } else if reproduced {
                        from_inputs += 1;
                        "reproduced from the GPU's inputs"
                    } else {
                        unexplained += 1;
                        "UNEXPLAINED"
                    };
                    if examples.len() < 32 {
                        let num = |x: f64| if x.is_finite() { json!(x) } else { json!(null) };
                        examples.push(json!({"step": step, "row": b, "layer": l, "head": h, "cpu": want, "gpu": g,
                            "cut_gap": num(gap), "cut_gap_cpu_forecast": num(gap_cpu),
                            "cut_gap_gpu_forecast": num(gap_gpu),
                            "reproduced_from_gpu_inputs": reproduced,
                            "gpu_vs_cpu_rel_l2_forecast_kc_p": input_rel, "explained_as": how,
                            "current_block": (t_len - 1) / bs}));
                    }
                }
                lower |= differs;
            }
        }
    }
    model.set_record_selections(false);
    drop(gseqs);
    model.release_buffers();
    let pass = unexplained == 0;
    eprintln!(
        "forecast selection vs CPU reference (B = {}, {mixed_steps} steps mixing dense and sparse rows): {equal}/{sets} sets equal ({dense_sets} of dense rows), {near} near-ties (max gap {max_gap:.2e}), {cascades} cascades, {from_inputs} reproduced from the GPU's inputs, {unexplained} unexplained",
        prompts.len()
    );
    Ok((
        pass,
        json!({"steps": steps, "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
            "dense_len": plan.sparse.dense_len, "decode_mode": format!("{:?}", model.decode_mode()),
            "steps_mixing_dense_and_sparse_rows": mixed_steps, "sets": sets, "equal": equal,
            "dense_row_sets": dense_sets, "near_ties": near, "max_near_tie_gap": max_gap,
            "cascades": cascades, "reproduced_from_gpu_inputs": from_inputs, "unexplained": unexplained, "pass": pass, "examples": examples,
            "near_tie_bound": super::e2e::NEAR_TIE,
            "near_tie_scored_with": "the CPU reference's Kc and p, with the CPU's forecast and with the GPU's own; the smaller cut gap",
            "reproduced_rule": "the CPU rule on the GPU's own forecast, Kc and p gives the GPU's set, and each of the three is within tolerance_bf16 relative L2 of the CPU's",
            "tolerance_bf16": super::kernels::TOLERANCE_BF16}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_are_expected_of_sm_fetch_runs_in_graph_mode_only() {
        let g = DecodeMode::Graph;
        assert!(graph_expected(g, Some("sm:16"), 2048));
        assert!(graph_expected(g, Some("sm:8+whole"), 3));
        assert!(
            !graph_expected(g, Some("sm:8"), 2),
            "a build's first step is eager"
        );
        assert!(!graph_expected(g, Some("dma"), 2048));
        assert!(!graph_expected(g, Some("split:8:50"), 2048));
        assert!(!graph_expected(g, Some("split:8:50+whole"), 2048));
        assert!(
            !graph_expected(g, None, 2048),
            "GPU-resident runs are not checked here"
        );
        assert!(!graph_expected(DecodeMode::Eager, Some("sm:16"), 2048));
    }
}
