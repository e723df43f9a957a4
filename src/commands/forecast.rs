//! `sparda forecast collect|fit|eval|import`: forecast weights for SparDA
//! forecast selection (spec/nosa-model.md §4 "Forecast mode") from a
//! model's own activations. The model-free parts (record format, ridge,
//! targets, recall) are in the `sparda-forecast` crate (forecast/); this
//! module drives the CPU reference and writes the results.

use crate::{
    ForecastCollectArgs, ForecastEvalArgs, ForecastFitArgs, ForecastImportArgs, ForecastModelArgs,
};
use sparda::config::{ModelConfig, Rope};
use sparda::cpu::{
    ops, Capture, CapturedRow, CpuModel, EngineOptions, Logits, Phase, Sequence, PREFILL_CHUNK,
};
use sparda::model::forecast::ForecastWeights;
use sparda::model::select::{self, Budget};
use sparda::model::PrefillMode;
use sparda::tokenizer::Tokenizer;
use sparda::weights::names::{self, LayerTensor};
use sparda::weights::{Checkpoint, DType, OwnedTensor};
use sparda::{Error, Result};
use sparda_forecast::recall::{free_hits, random_expected_hits, Tally};
use sparda_forecast::records::{self, Header, Record};
use sparda_forecast::ridge::{self, Accumulator};
use sparda_forecast::targets;
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

/// A `sparda-forecast` error as this crate's.
fn fe(e: sparda_forecast::Error) -> Error {
    match e {
        sparda_forecast::Error::Io { path, source } => Error::io(path, source),
        other => Error::Input(other.to_string()),
    }
}

/// The checkpoint, tokenizer and CPU reference the model flags name.
fn open_model(a: &ForecastModelArgs) -> Result<(Checkpoint, Tokenizer, CpuModel)> {
    let (ckpt, tokenizer, opts) = open_checkpoint(a)?;
    let model = CpuModel::new(&ckpt, opts)?;
    Ok((ckpt, tokenizer, model))
}

/// The checkpoint, tokenizer and engine options the model flags name.
fn open_checkpoint(a: &ForecastModelArgs) -> Result<(Checkpoint, Tokenizer, EngineOptions)> {
    let name = a.model.to_string_lossy().into_owned();
    let ckpt = sparda::bench::open_model(&name)?;
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| {
        if name.starts_with("synth:") {
            super::fixture_tokenizer()
        } else {
            a.model.join("tokenizer.json")
        }
    });
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let opts = EngineOptions {
        attention: a.sel.overrides(Some(true)),
        prefill: PrefillMode::Auto,
    };
    Ok((ckpt, tokenizer, opts))
}

/// The mode settings as JSON (record headers, reports).
fn settings_json(m: &CpuModel, context: usize) -> serde_json::Value {
    plan_json(&m.plan, context)
}

/// [`settings_json`] of an attention plan.
fn plan_json(plan: &sparda::model::AttentionPlan, context: usize) -> serde_json::Value {
    let b = &plan.budget;
    serde_json::json!({
        "mode": format!("{:?}", plan.mode),
        "budget_blocks": b.attended,
        "select_blocks": plan.sparse.select_blocks,
        "shortlist_blocks": b.shortlist,
        "window_blocks": b.window_blocks,
        "init_blocks": b.init_blocks,
        "block_size": b.block_size,
        "dense_len": plan.sparse.dense_len,
        "context": context,
    })
}

/// The consecutive `context`-token chunks of `text`'s tokens (at most
/// `max_chunks`).
///
/// Errors: a text shorter than one chunk, with both numbers.
fn text_chunks(
    tok: &Tokenizer,
    text: &Path,
    context: usize,
    max_chunks: usize,
) -> Result<Vec<Vec<u32>>> {
    if context == 0 {
        return Err(Error::Input("--context must be ≥ 1 token".into()));
    }
    let s = std::fs::read_to_string(text).map_err(|e| Error::io(text, e))?;
    let ids = tok.encode(&s)?;
    if ids.len() < context {
        return Err(Error::Input(format!(
            "{}: {} tokens, shorter than one --context of {context}",
            text.display(),
            ids.len()
        )));
    }
    Ok(ids
        .chunks_exact(context)
        .take(max_chunks.max(1))
        .map(|c| c.to_vec())
        .collect())
}

/// RoPE rotation of `x` (heads of `head_dim`) at position `pos`, as the
/// engines rotate: a·R(θ) with a the table's attention factor (≠ 1 only for
/// LongRoPE past its original maximum); `inverse` applies its inverse,
/// R(−θ)/a.
fn rotate(rope: &Rope, x: &mut [f32], pos: usize, rope_len: usize, head_dim: usize, inverse: bool) {
    let half = head_dim / 2;
    let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
    rope.cos_sin(pos, rope_len, &mut cos, &mut sin);
    if inverse {
        // cos and sin carry a: (a·R(−θ)) / a² = R(−θ) / a
        let a2 = rope.attention_factor() * rope.attention_factor();
        cos.iter_mut().for_each(|c| *c /= a2);
        sin.iter_mut().for_each(|s| *s = -*s / a2);
    }
    ops::rope_in_place(x, &cos, &sin);
}

/// One layer's capture of one position, from either engine: x̂, and the
/// queries before and after RoPE (\[H·D\]).
struct RowView<'a> {
    position: usize,
    xn: &'a [f32],
    /// Borrowed from the capture where the engine recorded it, else rotated here.
    q_pre: Cow<'a, [f32]>,
    q_post: Cow<'a, [f32]>,
}

/// The records of the captured rows of one forward call (CPU reference):
/// see [`records_from`]; the post-RoPE queries are rotated here.
fn records_of(
    m: &CpuModel,
    seq: &Sequence,
    rows: &[Vec<CapturedRow>],
    text: u32,
    phase: u32,
    rope_len: impl Fn(usize) -> usize,
) -> Result<Vec<Record>> {
    let c = &m.config;
    let rope = c.rope();
    let views = rows
        .iter()
        .map(|lr| {
            lr.iter()
                .map(|r| {
                    let mut q_post = r.q.clone();
                    rotate(
                        &rope,
                        &mut q_post,
                        r.position,
                        rope_len(r.position),
                        c.head_dim,
                        false,
                    );
                    RowView {
                        position: r.position,
                        xn: &r.xn,
                        q_pre: Cow::Borrowed(&r.q[..]),
                        q_post: Cow::Owned(q_post),
                    }
                })
                .collect()
        })
        .collect();
    records_from(
        c,
        &m.plan.budget,
        views,
        &|l| &seq.layers[l].kc[..],
        text,
        phase,
        rope_len,
    )
}

/// The records of captured rows (`rows[layer][row]`, every layer holding the
/// same positions in the same order): per position, per layer x̂ and the
/// targets of [`targets::ALL`] (group-mean pre-RoPE query; window-score fit
/// against the layer's compressed keys `kc(l)`, f32 [≥ Mc, Hkv, D], at that
/// position).
fn records_from<'k>(
    c: &ModelConfig,
    budget: &Budget,
    rows: Vec<Vec<RowView<'_>>>,
    kc: &dyn Fn(usize) -> &'k [f32],
    text: u32,
    phase: u32,
    rope_len: impl Fn(usize) -> usize,
) -> Result<Vec<Record>> {
    let (hq, hk, dh) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let g = hq / hk;
    let kvd = hk * dh;
    let rope = c.rope();
    let n = rows.first().map_or(0, |r| r.len());
    if let Some((l, lr)) = rows.iter().enumerate().find(|(_, lr)| lr.len() != n) {
        return Err(Error::Input(format!(
            "capture: layer {l} has {} rows, layer 0 has {n}",
            lr.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let pos = rows[0][i].position;
        let mut data = Vec::with_capacity(c.num_hidden_layers * (c.hidden_size + 2 * kvd));
        for (l, lr) in rows.iter().enumerate() {
            let r = &lr[i];
            if r.position != pos {
                return Err(Error::Input(format!(
                    "capture: layer {l} row {i} is position {}, layer 0's is {pos}",
                    r.position
                )));
            }
            data.extend_from_slice(r.xn);
            data.extend(targets::group_mean(&r.q_pre, hq, hk, dh).map_err(fe)?);
            // the real query-aware window scores of this position (spec §4.1)
            let kcl = kc(l);
            let mc = budget.windows(pos + 1);
            let mut f = vec![0.0f32; kvd];
            for h in 0..hk {
                let kch = if mc > 0 { &kcl[h * dh..] } else { &[][..] };
                let s = select::query_window_scores(
                    &r.q_post[h * g * dh..(h + 1) * g * dh],
                    dh,
                    kch,
                    kvd,
                    mc,
                );
                let ls: Vec<f32> = s.iter().map(|v| v.max(1e-30).ln()).collect();
                let fh = targets::score_fit(kch, kvd, dh, &ls, 1e-3).map_err(|e| {
                    Error::Input(format!("layer {l}, position {pos}, KV head {h}: {}", fe(e)))
                })?;
                f[h * dh..(h + 1) * dh].copy_from_slice(&fh);
            }
            rotate(&rope, &mut f, pos, rope_len(pos), dh, true);
            data.extend_from_slice(&f);
        }
        out.push(Record {
            position: pos as u32,
            text,
            phase,
            data,
        });
    }
    Ok(out)
}

/// A progress bar over `total` units on stderr (drawn only on a terminal).
fn progress(total: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{what} {{bar:40}} {{pos}}/{{len}} positions, {{elapsed}} (eta {{eta}})"
        ))
        .expect("valid template"),
    );
    pb
}

/// `sparda forecast collect`.
pub(crate) fn cmd_collect(a: ForecastCollectArgs) -> Result<()> {
    if a.stride == 0 {
        return Err(Error::Input("--stride must be ≥ 1".into()));
    }
    if let Some(t) = a.text.iter().find(|t| !t.is_file()) {
        return Err(Error::Input(format!(
            "--text {}: no such file",
            t.display()
        )));
    }
    let (ckpt, tok, opts) = open_checkpoint(&a.model)?;
    let engine = match super::mode::resolve_backend(a.backend) {
        crate::Backend::Cuda => {
            let gpu = std::sync::Arc::new(sparda::cuda::Gpu::new(0)?);
            // refused with the numbers before anything is uploaded
            sparda::memory::check_weights(&gpu, &ckpt.config, ckpt.eviction_heads)?;
            Collector::Gpu(Box::new(sparda::pipeline::GpuModel::new(gpu, &ckpt, opts)?))
        }
        crate::Backend::Cpu | crate::Backend::Auto => {
            Collector::Cpu(Box::new(CpuModel::new(&ckpt, opts)?))
        }
    };
    let (plan, c) = match &engine {
        Collector::Cpu(m) => (m.plan, m.config.clone()),
        Collector::Gpu(m) => (m.plan, m.config.clone()),
    };
    let budget = plan.budget;
    let min_pos = a
        .min_position
        .unwrap_or(budget.attended * budget.block_size);
    if a.decode >= a.context || min_pos >= a.context {
        let why = if a.min_position.is_some() {
            "--min-position".to_string()
        } else {
            format!(
                "--min-position; by default the attention budget, {} blocks × {} tokens, where selection starts to drop blocks: give a longer --context, a smaller --budget-blocks or --min-position",
                budget.attended, budget.block_size
            )
        };
        return Err(Error::Input(format!(
            "--context {} must exceed --decode {} and the first sampled position {min_pos} ({why})",
            a.context, a.decode
        )));
    }
    let header = Header {
        model: a.model.model.to_string_lossy().into_owned(),
        fingerprint: sparda::quality::identity::model_fingerprint(&ckpt),
        layers: c.num_hidden_layers,
        hidden: c.hidden_size,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        targets: targets::ALL.iter().map(|s| s.to_string()).collect(),
        texts: a.text.iter().map(|t| t.display().to_string()).collect(),
        settings: {
            let mut s = plan_json(&plan, a.context);
            s["stride"] = a.stride.into();
            s["min_position"] = min_pos.into();
            s["decode"] = a.decode.into();
            s["max_chunks"] = a.max_chunks.into();
            s["backend"] = engine.name().into();
            s
        },
    };
    let chunks: Vec<Vec<Vec<u32>>> = a
        .text
        .iter()
        .map(|t| text_chunks(&tok, t, a.context, a.max_chunks))
        .collect::<Result<_>>()?;
    let prefix = a.context - a.decode;
    let per_chunk = sampled_positions(min_pos, prefix, a.stride).len() + a.decode;
    let total: usize = chunks.iter().map(|c| c.len() * per_chunk).sum();
    eprintln!(
        "collect: {} texts, {} chunks of {} tokens, {total} positions ({} prefill every {} from {min_pos}, {} decode per chunk), {} layers, {}",
        a.text.len(),
        chunks.iter().map(Vec::len).sum::<usize>(),
        a.context,
        per_chunk - a.decode,
        a.stride,
        a.decode,
        c.num_hidden_layers,
        engine.describe()
    );
    let mut w = records::Writer::create(&a.out, header).map_err(fe)?;
    let pb = progress(total as u64, "collect");
    let t0 = Instant::now();
    // an interrupted or failed collection leaves no record file behind
    let r = match engine {
        Collector::Cpu(m) => collect_into(&a, &m, &chunks, prefix, min_pos, &mut w, &pb, t0),
        Collector::Gpu(mut m) => {
            collect_into_gpu(&a, &mut m, &chunks, prefix, min_pos, &mut w, &pb, t0)
        }
    };
    if let Err(e) = r {
        pb.finish_and_clear();
        drop(w);
        let _ = std::fs::remove_file(&a.out);
        return Err(e);
    }
    pb.finish_and_clear();
    let n = w.finish().map_err(fe)?;
    let bytes = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {n} records ({:.1} MB) to {} in {:.0} s",
        bytes as f64 / 1e6,
        a.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The prefill positions `collect` records: every `stride`-th from `min_pos`
/// below `prefix`.
fn sampled_positions(min_pos: usize, prefix: usize, stride: usize) -> BTreeSet<usize> {
    (min_pos..prefix)
        .filter(|p| (p - min_pos).is_multiple_of(stride))
        .collect()
}

/// The progress line after each collected chunk.
fn chunk_done(pb: &indicatif::ProgressBar, text: &Path, chunk: usize, records: u64, t0: Instant) {
    pb.suspend(|| {
        eprintln!(
            "  {} chunk {chunk}: {records} records so far, {:.0} s",
            text.display(),
            t0.elapsed().as_secs_f64()
        )
    });
}

/// The collection loop of [`cmd_collect`]: every chunk's prefill (sampled
/// rows) and decode steps (every row) into `w`.
#[allow(clippy::too_many_arguments)] // private; the loop's state
fn collect_into(
    a: &ForecastCollectArgs,
    m: &CpuModel,
    chunks: &[Vec<Vec<u32>>],
    prefix: usize,
    min_pos: usize,
    w: &mut records::Writer,
    pb: &indicatif::ProgressBar,
    t0: Instant,
) -> Result<()> {
    for (ti, text_chunks) in chunks.iter().enumerate() {
        for (ci, toks) in text_chunks.iter().enumerate() {
            let mut seq = m.new_sequence();
            let positions = sampled_positions(min_pos, prefix, a.stride);
            seq.capture = Some(Capture {
                positions,
                queries: true,
                rows: Vec::new(),
            });
            for chunk in toks[..prefix].chunks(PREFILL_CHUNK) {
                sparda::interrupt::check(|| format!("collect, {} records written", w.count()))?;
                m.forward(
                    &mut seq,
                    chunk,
                    Phase::Prefill { prompt_len: prefix },
                    Logits::Last,
                )?;
                let rows = std::mem::take(&mut seq.capture.as_mut().unwrap().rows);
                let recs = records_of(m, &seq, &rows, ti as u32, records::PHASE_PREFILL, |_| {
                    prefix
                })?;
                for r in &recs {
                    w.push(r).map_err(fe)?;
                }
                pb.inc(recs.len() as u64);
            }
            for (t, &token) in toks.iter().enumerate().skip(prefix) {
                sparda::interrupt::check(|| format!("collect, {} records written", w.count()))?;
                seq.capture = Some(Capture {
                    positions: BTreeSet::from([t]),
                    queries: true,
                    rows: Vec::new(),
                });
                m.decode(&mut seq, token)?;
                let rows = std::mem::take(&mut seq.capture.as_mut().unwrap().rows);
                for r in &records_of(m, &seq, &rows, ti as u32, records::PHASE_DECODE, |p| p + 1)? {
                    w.push(r).map_err(fe)?;
                }
                pb.inc(1);
            }
            chunk_done(pb, &a.text[ti], ci, w.count(), t0);
        }
    }
    Ok(())
}

/// The engine `collect` runs (`--backend`).
enum Collector {
    Cpu(Box<CpuModel>),
    Gpu(Box<sparda::pipeline::GpuModel>),
}

impl Collector {
    /// The record header's `backend` setting.
    fn name(&self) -> &'static str {
        match self {
            Collector::Cpu(_) => "cpu",
            Collector::Gpu(_) => "cuda",
        }
    }

    /// The engine in words, for the progress line.
    fn describe(&self) -> String {
        match self {
            Collector::Cpu(_) => "CPU reference".into(),
            Collector::Gpu(m) => format!("GPU engine on {}", m.gpu().info().name),
        }
    }
}

/// [`collect_into`] on the GPU engine: the prefix prefilled with x̂ and
/// the rotated queries captured at the sampled positions
/// ([`sparda::pipeline::GpuModel::set_capture`]) and written chunk by chunk
/// ([`sparda::pipeline::GpuModel::prefill_observed`]), then each decode position
/// as a one-token prefill (the same computation for that row), captured;
/// the targets from the layers' compressed keys read back after each call
/// and the queries rotated back (bf16 activations: the CPU reference's
/// records are f32).
#[allow(clippy::too_many_arguments)] // private; the loop's state
fn collect_into_gpu(
    a: &ForecastCollectArgs,
    m: &mut sparda::pipeline::GpuModel,
    chunks: &[Vec<Vec<u32>>],
    prefix: usize,
    min_pos: usize,
    w: &mut records::Writer,
    pb: &indicatif::ProgressBar,
    t0: Instant,
) -> Result<()> {
    let c = m.config.clone();
    let budget = m.plan.budget;
    let rope = c.rope();
    for (ti, text_chunks) in chunks.iter().enumerate() {
        for (ci, toks) in text_chunks.iter().enumerate() {
            let mut seq = m.new_sequence(toks.len())?;
            let positions = sampled_positions(min_pos, prefix, a.stride);
            // `kc[l]`: layer l's compressed keys read so far (a complete
            // window's never change: each call reads only those completed since).
            let mut kc: Vec<Vec<f32>> = vec![Vec::new(); c.num_hidden_layers];
            let kvd = c.num_key_value_heads * c.head_dim;
            // The records of the rows captured since the last call, their
            // targets from the compressed keys of the windows complete now
            // (each target scores only the windows up to its position).
            let emit = |m: &mut sparda::pipeline::GpuModel,
                        seq: &sparda::pipeline::GpuSequence,
                        w: &mut records::Writer,
                        kc: &mut Vec<Vec<f32>>,
                        phase: u32,
                        rope_len: &dyn Fn(usize) -> usize|
             -> Result<()> {
                let rows = m.drain_capture();
                if rows.iter().all(|r| r.is_empty()) {
                    return Ok(());
                }
                let windows = budget.windows(seq.len());
                for (l, k) in kc.iter_mut().enumerate() {
                    k.extend(m.compressed_keys(seq, l, k.len() / kvd..windows)?);
                }
                let views = rows
                    .iter()
                    .map(|lr| {
                        lr.iter()
                            .map(|r| {
                                let mut q_pre = r.q_rope.clone();
                                let p = r.position;
                                rotate(&rope, &mut q_pre, p, rope_len(p), c.head_dim, true);
                                RowView {
                                    position: p,
                                    xn: &r.xn,
                                    q_pre: Cow::Owned(q_pre),
                                    q_post: Cow::Borrowed(&r.q_rope[..]),
                                }
                            })
                            .collect()
                    })
                    .collect();
                let recs = records_from(
                    &c,
                    &budget,
                    views,
                    &|l| &kc[l][..],
                    ti as u32,
                    phase,
                    rope_len,
                )?;
                for r in &recs {
                    w.push(r).map_err(fe)?;
                }
                pb.inc(recs.len() as u64);
                Ok(())
            };
            // The prefix in one prefill (its chunks, dense/sparse choice and
            // RoPE table those of the whole prompt), each chunk's sampled rows
            // written before the next chunk runs: at most one chunk's rows
            // are held.
            sparda::interrupt::check(|| format!("collect, {} records written", w.count()))?;
            m.set_capture(positions);
            let r = m.prefill_observed(
                &mut seq,
                &toks[..prefix],
                |_, _| {},
                |m, seq| emit(m, seq, w, &mut kc, records::PHASE_PREFILL, &|_| prefix),
            );
            m.take_capture();
            r?;
            for (t, &token) in toks.iter().enumerate().skip(prefix) {
                sparda::interrupt::check(|| format!("collect, {} records written", w.count()))?;
                m.set_capture(BTreeSet::from([t]));
                let r = m.prefill(&mut seq, &[token], |_, _| {});
                let r =
                    r.and_then(|()| emit(m, &seq, w, &mut kc, records::PHASE_DECODE, &|p| p + 1));
                m.take_capture();
                r?;
            }
            chunk_done(pb, &a.text[ti], ci, w.count(), t0);
        }
    }
    Ok(())
}

/// Per-layer fit summary of `fit --json`.
#[derive(serde::Serialize)]
struct LayerFit {
    tensor: String,
    #[serde(flatten)]
    fit: ridge::Fit,
}

/// `sparda forecast fit`.
pub(crate) fn cmd_fit(a: ForecastFitArgs) -> Result<()> {
    if a.data.is_empty() {
        return Err(Error::Input("give at least one --data record file".into()));
    }
    let first = records::Reader::open(&a.data[0]).map_err(fe)?.header;
    first.target_index(&a.target).map_err(fe)?;
    let (l, d, k) = (first.layers, first.hidden, first.kv_heads * first.head_dim);
    if l < 2 {
        return Err(Error::Input(format!(
            "{}: {l} layers; forecast needs ≥ 2",
            a.data[0].display()
        )));
    }
    let mut train: Vec<Accumulator> = (0..l).map(|_| Accumulator::new(d, k)).collect();
    let mut held = train.clone();
    let t0 = Instant::now();
    for (fi, path) in a.data.iter().enumerate() {
        let mut r = records::Reader::open(path).map_err(fe)?;
        let h = r.header.clone();
        if (h.layers, h.hidden, h.kv_heads, h.head_dim, &h.fingerprint)
            != (
                first.layers,
                first.hidden,
                first.kv_heads,
                first.head_dim,
                &first.fingerprint,
            )
        {
            return Err(Error::Input(format!(
                "{}: model {} (fingerprint {}, {} layers, d {}, {}×{}) differs from {}'s {} ({}, {} layers, d {}, {}×{})",
                path.display(), h.model, h.fingerprint, h.layers, h.hidden, h.kv_heads, h.head_dim,
                a.data[0].display(), first.model, first.fingerprint, first.layers, first.hidden, first.kv_heads, first.head_dim
            )));
        }
        let ti = h.target_index(&a.target).map_err(fe)?;
        let pb = progress(r.count, &format!("fit {}", path.display()));
        let mut i = 0u64;
        while let Some(rec) = r.next_record().map_err(fe)? {
            let is_held = a.held_out_every > 0
                && (i % a.held_out_every as u64) == (a.held_out_every as u64 - 1);
            let acc = if is_held { &mut held } else { &mut train };
            let ctx = |e| Error::Input(format!("{} record {i}: {}", path.display(), fe(e)));
            // q_future_proj of layer j: x̂_j → layer j+1's target; slot L−1 holds q_curr_proj of layer 0
            for (j, aj) in acc.iter_mut().enumerate().take(l - 1) {
                aj.add(rec.x(&h, j), rec.target(&h, j + 1, ti))
                    .map_err(ctx)?;
            }
            acc[l - 1]
                .add(rec.x(&h, 0), rec.target(&h, 0, ti))
                .map_err(ctx)?;
            i += 1;
            pb.inc(1);
        }
        pb.finish_and_clear();
        eprintln!(
            "  {}: {} records (file {})",
            path.display(),
            r.count,
            fi + 1
        );
    }
    let mut tensors = Vec::new();
    let mut report = Vec::new();
    for (j, (tr, he)) in train.iter().zip(&held).enumerate() {
        let (name, what) = if j + 1 < l {
            (
                names::layer(j, LayerTensor::QFutureProj),
                format!("layer {j} q_future_proj"),
            )
        } else {
            (
                names::layer(0, LayerTensor::QCurrProj),
                "layer 0 q_curr_proj".to_string(),
            )
        };
        let f = ridge::fit(tr, he, &ridge::DEFAULT_GRID)
            .map_err(|e| Error::Input(format!("{what}: {}", fe(e))))?;
        eprintln!(
            "  {what:<24} λ/mean-eig {:.0e}  held-out rel. error {}  train {:.4}  rows {}+{}",
            f.lambda_rel,
            f.held_rel_err.map_or("-".into(), |e| format!("{e:.4}")),
            f.train_rel_err,
            f.rows.0,
            f.rows.1
        );
        tensors.push(OwnedTensor::from_f32(
            name.clone(),
            vec![k, d],
            &f.w,
            DType::F32,
        )?);
        report.push(LayerFit {
            tensor: name,
            fit: f,
        });
    }
    sparda::weights::write_safetensors(&a.out, &tensors)?;
    eprintln!(
        "wrote {} ({} tensors of [{k}, {d}], target `{}`) in {:.1} s",
        a.out.display(),
        tensors.len(),
        a.target,
        t0.elapsed().as_secs_f64()
    );
    if let Some(j) = &a.json {
        let v = serde_json::json!({
            "data": a.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "model": first.model, "fingerprint": first.fingerprint,
            "target": a.target, "held_out_every": a.held_out_every,
            "lambda_grid_rel": ridge::DEFAULT_GRID, "out": a.out.display().to_string(),
            "collect_settings": first.settings, "layers": report,
            "commit": sparda::bench::git_commit(),
        });
        std::fs::write(j, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| Error::io(j, e))?;
    }
    Ok(())
}

/// One forecast candidate of `eval`: its label and weights.
struct Candidate {
    label: String,
    weights: ForecastWeights,
}

/// The blocks a forecast selects at layer `l` for the query at position `t`
/// (spec §4 "Forecast mode"), per KV head: f = RoPE(W · x̂) with W =
/// q_curr_proj and x̂ = x̂_0 for layer 0 (its current-step windows), W =
/// q_future_proj_{l−1} and x̂ = x̂_{l−1} for l ≥ 1 (the previous step's windows).
fn forecast_selection(
    m: &CpuModel,
    w: &ForecastWeights,
    xn: &[Vec<f32>],
    seq: &Sequence,
    l: usize,
    t: usize,
) -> Vec<Vec<usize>> {
    let c = &m.config;
    let (hk, dh) = (c.num_key_value_heads, c.head_dim);
    let budget: &Budget = &m.plan.budget;
    let (wt, x, windows) = if l == 0 {
        (&w.curr0, &xn[0], budget.windows(t + 1))
    } else {
        (&w.future[l - 1], &xn[l - 1], budget.windows(t))
    };
    let mut f = ops::linear(x, 1, wt, None, hk * dh);
    rotate(&c.rope(), &mut f, t, t + 1, dh, false);
    let kv = &seq.layers[l];
    let nb = budget.blocks(t);
    let rule = m.plan.rule().expect("sparse plan");
    (0..hk)
        .map(|h| {
            let s = sparda::cpu::forecast_window_scores(&f[h * dh..(h + 1) * dh], kv, h, windows);
            let r = select::pool_blocks(budget, &s, nb);
            let p: Vec<f32> = (0..windows).map(|i| kv.p[i * hk + h]).collect();
            let e = select::pool_blocks(budget, &p, nb);
            select::select(budget, rule, &r, &e)
        })
        .collect()
}

/// `sparda forecast eval`.
pub(crate) fn cmd_eval(a: ForecastEvalArgs) -> Result<()> {
    let (ckpt, tok, m) = open_model(&a.model)?;
    let cfg: &ModelConfig = &m.config;
    let mut cands = Vec::new();
    for spec in &a.forecast {
        let (label, path) = match spec.split_once('=') {
            Some((l, p)) => (l.to_string(), p.to_string()),
            None => (
                Path::new(spec)
                    .file_stem()
                    .map_or(spec.clone(), |s| s.to_string_lossy().into_owned()),
                spec.clone(),
            ),
        };
        cands.push(Candidate {
            label,
            weights: ForecastWeights::from_arg(&path, cfg)?,
        });
    }
    if let Some(p) = &a.sparda {
        cands.push(Candidate {
            label: "sparda".into(),
            weights: ForecastWeights::open(p, cfg)?,
        });
    }
    let budget = m.plan.budget;
    if a.positions == 0 || a.positions >= a.context {
        return Err(Error::Input(format!(
            "--positions {} must be in 1 … --context − 1 = {}",
            a.positions,
            a.context.saturating_sub(1)
        )));
    }
    let prefix = a.context - a.positions;
    if budget.blocks(prefix) <= budget.attended {
        eprintln!(
            "warning: the first scored position {prefix} has {} blocks, within the budget of {}: selection keeps every block there (raise --context or lower --budget-blocks)",
            budget.blocks(prefix),
            budget.attended
        );
    }
    let nl = cfg.num_hidden_layers;
    let methods: Vec<String> = ["reuse_previous_step".to_string(), "random".to_string()]
        .into_iter()
        .chain(cands.iter().map(|c| c.label.clone()))
        .collect();
    let mut tallies = vec![vec![Tally::default(); methods.len()]; nl];
    let chunks: Vec<(usize, Vec<u32>)> = a
        .text
        .iter()
        .enumerate()
        .map(|(i, t)| {
            text_chunks(&tok, t, a.context, a.max_chunks)
                .map(|c| c.into_iter().map(move |x| (i, x)))
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let pb = progress((chunks.len() * a.positions) as u64, "eval");
    let t0 = Instant::now();
    let mut steps = 0u64;
    for (_ti, toks) in &chunks {
        let mut seq = m.new_sequence();
        m.prefill(&mut seq, &toks[..prefix], |_, _| {})?;
        for (t, &token) in toks.iter().enumerate().skip(prefix) {
            sparda::interrupt::check(|| format!("eval, {steps} steps scored"))?;
            let prev = seq.selections.clone();
            seq.capture = Some(Capture {
                positions: BTreeSet::from([t]),
                queries: false,
                rows: Vec::new(),
            });
            m.decode(&mut seq, token)?;
            let rows = seq.capture.take().map(|c| c.rows).unwrap_or_default();
            let xn: Vec<Vec<f32>> = rows
                .into_iter()
                .map(|mut r| r.pop().map(|r| r.xn).unwrap_or_default())
                .collect();
            pb.inc(1);
            let nb = budget.blocks(t);
            if !m.plan.sparse_at(t + 1) || nb <= budget.attended || xn.len() != nl {
                continue;
            }
            steps += 1;
            let q = t / budget.block_size;
            let forced = |b: usize| budget.is_forced(b, q);
            let candidates = (0..nb).filter(|&b| !forced(b)).count() as u64;
            for l in 0..nl {
                let fsel: Vec<Vec<Vec<usize>>> = cands
                    .iter()
                    .map(|c| forecast_selection(&m, &c.weights, &xn, &seq, l, t))
                    .collect();
                for (h, real) in seq.selections[l].iter().enumerate() {
                    let (hits, free) =
                        free_hits(real, prev[l].get(h).map_or(&[][..], |v| v), forced);
                    tallies[l][0].add(hits as f64, free);
                    tallies[l][1].add(random_expected_hits(free, candidates), free);
                    for (ci, sel) in fsel.iter().enumerate() {
                        let (hits, free) = free_hits(real, &sel[h], forced);
                        tallies[l][2 + ci].add(hits as f64, free);
                    }
                }
            }
        }
    }
    pb.finish_and_clear();
    // the table
    let mut md = String::new();
    md.push_str(&format!(
        "| layer | {} |\n|---|{}\n",
        methods.join(" | "),
        "---|".repeat(methods.len())
    ));
    let mut all = vec![Tally::default(); methods.len()];
    for (l, row) in tallies.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .map(|t| t.recall().map_or("-".into(), |r| format!("{:.3}", r)))
            .collect();
        md.push_str(&format!(
            "| {l}{} | {} |\n",
            if l == 0 { " (q_curr)" } else { "" },
            cells.join(" | ")
        ));
        if l >= 1 {
            for (a, t) in all.iter_mut().zip(row) {
                a.hits += t.hits;
                a.free += t.free;
                a.sets += t.sets;
            }
        }
    }
    let cells: Vec<String> = all
        .iter()
        .map(|t| t.recall().map_or("-".into(), |r| format!("{:.3}", r)))
        .collect();
    md.push_str(&format!("| all ≥ 1 | {} |\n", cells.join(" | ")));
    println!(
        "recall of the freely chosen blocks of layer l's real query-aware selection ({} steps, {:?} budget {} blocks, {:.0} s):\n{md}",
        steps,
        m.plan.mode,
        budget.attended,
        t0.elapsed().as_secs_f64()
    );
    if let Some(j) = &a.json {
        let layers: Vec<serde_json::Value> = tallies
            .iter()
            .enumerate()
            .map(|(l, row)| {
                let mut o = serde_json::Map::new();
                o.insert("layer".into(), l.into());
                for (name, t) in methods.iter().zip(row) {
                    o.insert(name.clone(), serde_json::json!({"recall": t.recall(), "hits": t.hits, "free": t.free, "sets": t.sets}));
                }
                serde_json::Value::Object(o)
            })
            .collect();
        let v = serde_json::json!({
            "model": a.model.model.display().to_string(),
            "fingerprint": sparda::quality::identity::model_fingerprint(&ckpt),
            "texts": a.text.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "settings": settings_json(&m, a.context),
            "positions_per_chunk": a.positions, "chunks": chunks.len(), "steps_scored": steps,
            "forecasts": a.forecast, "sparda": a.sparda.as_ref().map(|p| p.display().to_string()),
            "methods": methods,
            "definition": "per layer l: Σ over steps and KV heads of |real ∩ predicted| / |real| over the real selection's blocks that are neither sink nor window blocks; layer 0 is predicted by q_curr_proj, layer l ≥ 1 by layer l−1's q_future_proj; reuse_previous_step = layer l's real selection one step earlier; random = the expectation of a uniform choice",
            "layers": layers,
            "all_layers_ge_1": methods.iter().zip(&all).map(|(n, t)| (n.clone(), serde_json::json!(t.recall()))).collect::<serde_json::Map<_, _>>(),
            "markdown": md,
            "commit": sparda::bench::git_commit(),
        });
        std::fs::write(j, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| Error::io(j, e))?;
        eprintln!("report in {}", j.display());
    }
    Ok(())
}

/// The canonical name of a forecast tensor key (`…layers.{l}.self_attn.{q_future_proj|q_curr_proj}.weight`).
fn canonical_forecast_name(key: &str) -> Option<String> {
    let i = key.rfind("layers.")?;
    let rest = &key[i + "layers.".len()..];
    let (l, tail) = rest.split_once('.')?;
    let l: usize = l.parse().ok()?;
    let t = match tail {
        "self_attn.q_future_proj.weight" => LayerTensor::QFutureProj,
        "self_attn.q_curr_proj.weight" => LayerTensor::QCurrProj,
        _ => return None,
    };
    Some(names::layer(l, t))
}

/// Converts a SparDA trainer checkpoint's forecast tensors to a
/// `.safetensors` file with canonical names; returns how many were written.
/// With `cfg`, the written file is loaded back as [`ForecastWeights`] to
/// check layers and shapes.
///
/// Errors: an unreadable `.pt`; one without forecast tensors; a key that
/// appears twice under different prefixes; as [`ForecastWeights::open`].
pub(crate) fn import(pt: &Path, out: &Path, cfg: Option<&ModelConfig>) -> Result<usize> {
    let want = |n: &str| n.ends_with("q_future_proj.weight") || n.ends_with("q_curr_proj.weight");
    let mut tensors = sparda::model::torch_pt::read_tensors(pt, want)?;
    let mut seen = std::collections::BTreeMap::new();
    for t in &mut tensors {
        let Some(name) = canonical_forecast_name(&t.name) else {
            return Err(Error::checkpoint(
                pt,
                format!("tensor `{}`: no layer index in its key", t.name),
            ));
        };
        if let Some(prev) = seen.insert(name.clone(), t.name.clone()) {
            return Err(Error::checkpoint(
                pt,
                format!("`{}` and `{prev}` both map to `{name}`", t.name),
            ));
        }
        t.name = name;
    }
    if tensors.is_empty() {
        return Err(Error::checkpoint(
            pt,
            "no q_future_proj / q_curr_proj tensors in this checkpoint",
        ));
    }
    sparda::weights::write_safetensors(out, &tensors)?;
    if let Some(cfg) = cfg {
        ForecastWeights::open(out, cfg)?;
    }
    Ok(tensors.len())
}

/// `sparda forecast import`.
pub(crate) fn cmd_import(a: ForecastImportArgs) -> Result<()> {
    let cfg = a
        .model
        .as_ref()
        .map(|m| match m.to_string_lossy().strip_prefix("synth:") {
            Some(spec) => Ok(sparda::synth::parse_spec(spec)?.0.config()),
            None => ModelConfig::from_file(m),
        })
        .transpose()?;
    let n = import(&a.file, &a.out, cfg.as_ref())?;
    eprintln!(
        "wrote {n} forecast tensors from {} to {}{}",
        a.file.display(),
        a.out.display(),
        if cfg.is_some() {
            " (checked against the model's shapes)"
        } else {
            ""
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparda::config::RopeScaling;

    /// The inverse rotation undoes the forward one, the LongRoPE attention
    /// factor included (a table past the original maximum: a ≈ 1.19).
    #[test]
    fn inverse_rotation_undoes_rope_with_its_attention_factor() {
        let d = 8;
        let scaling = RopeScaling::LongRope {
            short_factor: vec![1.0; d / 2],
            long_factor: vec![1.5; d / 2],
            original_max_position_embeddings: 4096,
        };
        for (rope, name) in [
            (Rope::new(d, 10_000.0, 131_072, scaling), "longrope"),
            (
                Rope::new(d, 10_000.0, 4096, RopeScaling::Default),
                "default",
            ),
        ] {
            let x: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = x.clone();
            rotate(&rope, &mut y, 3000, 3001, d, false);
            assert!(
                y.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3),
                "{name}"
            );
            rotate(&rope, &mut y, 3000, 3001, d, true);
            for (a, b) in y.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5, "{name}: {a} vs {b}");
            }
        }
        let long = Rope::new(
            d,
            10_000.0,
            131_072,
            RopeScaling::LongRope {
                short_factor: vec![1.0; d / 2],
                long_factor: vec![1.5; d / 2],
                original_max_position_embeddings: 4096,
            },
        );
        assert!(long.attention_factor() > 1.1, "the case tests a ≠ 1");
    }
}
