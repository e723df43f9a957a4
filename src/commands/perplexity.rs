//! `sparda perplexity`: a text's perplexity under teacher forcing in any
//! mode `generate` runs, the run's top-K log-probabilities saved as a base
//! (`--save-logits`), or compared with a saved base (`--kl-base`); the
//! procedure and figures are those of [`sparda::quality`].

use super::mode::{
    build_engine, check_mode_flags, check_output_dirs, load_forecast, load_tokenizer, mode_config,
    open_checkpoint, plan_json, resolve_backend, tokenizer_path, Engine,
};
use crate::*;
use indicatif::{ProgressBar, ProgressStyle};
use sparda::quality::identity::{check_model, check_text, ModelIdentity, TextIdentity};
use sparda::quality::kl::KlSummary;
use sparda::quality::logits_file::{LogitsHeader, LogitsReader, LogitsWriter};
use sparda::quality::{
    evaluate, ChunkPlan, CpuLogits, Evaluation, GpuLogits, NextTokenLogits, Progress,
};
use sparda::sample::check_logits;
use sparda::{Error, Result};
use std::path::Path;

/// The `--flag value` name of a clap value.
fn value_name(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

/// Whether `a` and `b` name one file (by canonical path when both exist).
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

pub(crate) fn cmd_perplexity(a: PerplexityArgs) -> Result<()> {
    let t_start = std::time::Instant::now();
    let backend = resolve_backend(a.mode.backend);
    // Flags, the text, the tokenizer and the base file's header are checked
    // before the model is built (minutes and ~17 GB for synth:nosa-8b).
    check_mode_flags(&a.mode, backend, "perplexity")?;
    check_output_dirs([&a.json, &a.save_logits].into_iter().flatten())?;
    if a.top_k_save == 0 {
        return Err(Error::Input("--top-k-save must be ≥ 1".into()));
    }
    if let (Some(s), Some(b)) = (&a.save_logits, &a.kl_base) {
        if same_file(s, b) {
            return Err(Error::Input(format!(
                "--save-logits and --kl-base both name {}: save this run elsewhere",
                s.display()
            )));
        }
    }
    if backend == Backend::Cuda {
        sparda::cuda::require()?;
    }
    let config = mode_config(&a.mode)?;
    let text = std::fs::read_to_string(&a.text)
        .map_err(|e| Error::Input(format!("--text {}: {e}", a.text.display())))?;
    let tokenizer = load_tokenizer(&a.mode)?;
    let tokens = tokenizer.encode(&text)?;
    let plan = ChunkPlan::new(
        tokens.len(),
        a.context,
        a.score,
        a.max_chunks,
        config.max_position_embeddings,
    )?;
    if a.save_logits.is_some() && a.top_k_save > config.vocab_size {
        return Err(Error::Input(format!(
            "--top-k-save {} exceeds the model's vocabulary of {} ids",
            a.top_k_save, config.vocab_size
        )));
    }
    let text_id = TextIdentity::new(&a.text, &tokens, &tokenizer_path(&a.mode))?;
    let mut base = a.kl_base.as_deref().map(LogitsReader::open).transpose()?;
    if let Some(b) = &base {
        let h = b.header();
        check_text(b.path(), (&h.text, &h.chunking), (&text_id, &plan))?;
    }
    let text_s = t_start.elapsed().as_secs_f64();
    let forecast = load_forecast(&a.mode, &config)?;
    let ckpt = open_checkpoint(&a.mode)?;
    let model_name = a.mode.model.to_string_lossy().into_owned();
    let model_id = ModelIdentity::of(&model_name, &ckpt);
    let checkpoint_s = t_start.elapsed().as_secs_f64() - text_s;
    if let Some(b) = &base {
        check_model(b.path(), &b.header().model, &model_id)?;
    }
    let engine = build_engine(&a.mode, backend, &ckpt, forecast.as_ref(), false)?;
    drop(ckpt);
    let engine_s = t_start.elapsed().as_secs_f64() - text_s - checkpoint_s;
    eprintln!(
        "startup {:.1} s: text and tokenizer {text_s:.1} s, checkpoint and fingerprint {checkpoint_s:.1} s, engine {engine_s:.1} s",
        text_s + checkpoint_s + engine_s
    );
    if let Engine::Cuda(m) = &engine {
        // one chunk's sequence at a time: refused before it is allocated
        m.check_memory(
            1,
            plan.context.max(plan.prefill_len() + 1),
            m.offload_options(),
            true,
            "lower --context",
        )?;
    }
    let plan_a = engine.plan();
    let mut mode = plan_json(&a.mode, backend, &engine, forecast.is_some());
    mode["selection"] = serde_json::json!(plan_a.rule().map(|r| format!("{r:?}")));
    mode["select_blocks"] = serde_json::json!(plan_a.sparse.select_blocks);
    mode["prefill"] = serde_json::json!(a.mode.prefill.map_or("auto".into(), value_name));
    mode["forecast_weights"] = serde_json::json!(a.mode.forecast);
    mode["prefetch"] = serde_json::json!(value_name(a.mode.prefetch));
    mode["rope_theta"] = serde_json::json!(config.rope_theta);
    mode["max_position"] = serde_json::json!(config.max_position_embeddings);
    mode["gpu"] = serde_json::json!(engine.gpu_name());
    eprintln!(
        "model {} ({} layers, d {}), attention {:?}, backend {}; {} tokens of {}: {} × {} tokens, {} prefilled and {} scored each",
        model_name,
        model_id.layers,
        model_id.hidden,
        plan_a.mode,
        engine.backend_name(),
        tokens.len(),
        a.text.display(),
        chunks(plan.chunks),
        plan.context,
        plan.prefill_len(),
        plan.score
    );
    let date_utc = sparda::checks::kernels::utc_now_iso();
    let commit = sparda::bench::git_commit();
    let mut writer = match &a.save_logits {
        Some(p) => Some(LogitsWriter::create(
            p,
            &LogitsHeader {
                model: model_id.clone(),
                text: text_id.clone(),
                chunking: plan,
                top_k: a.top_k_save.min(config.vocab_size),
                positions: plan.positions(),
                mode: mode.clone(),
                date_utc: date_utc.clone(),
                commit: commit.clone(),
            },
        )?),
        None => None,
    };
    let bar = ProgressBar::new(plan.positions() as u64).with_style(
        ProgressStyle::with_template("score {bar:40} {pos}/{len} tokens {per_sec} eta {eta} {msg}")
            .expect("static template"),
    );
    let last = std::cell::Cell::new(None::<Progress>);
    let progress = |p: &Progress| {
        bar.set_position(p.scored as u64);
        bar.set_message(format!("chunk {} ppl {:.4}", p.chunk + 1, p.mean_nll.exp()));
        last.set(Some(*p));
    };
    let ev = match engine {
        Engine::Cpu(model) => evaluate(
            &mut Guarded::new(&mut CpuLogits::new(&model)),
            &tokens,
            &plan,
            writer.as_mut(),
            base.as_mut(),
            progress,
        ),
        Engine::Cuda(mut model) => evaluate(
            &mut Guarded::new(&mut GpuLogits::new(&mut model, plan.context)),
            &tokens,
            &plan,
            writer.as_mut(),
            base.as_mut(),
            progress,
        ),
    };
    bar.finish_and_clear();
    let ev = match ev {
        Ok(ev) => ev,
        Err(e) => {
            // No partial saved-logits file is left behind (and, interrupted,
            // no result file is written: what completed goes to stderr).
            if let Some(p) = &a.save_logits {
                drop(writer.take());
                let _ = std::fs::remove_file(partial_path(p));
            }
            if let Error::Interrupted(_) = e {
                let done = last.get();
                let outputs: Vec<String> = [a.json.as_deref(), a.save_logits.as_deref()]
                    .into_iter()
                    .flatten()
                    .map(|p| p.display().to_string())
                    .collect();
                eprintln!(
                    "interrupted after {} of {} scored positions{}{}",
                    done.map_or(0, |p| p.scored),
                    plan.positions(),
                    done.map_or(String::new(), |p| format!(
                        " (running perplexity {:.4} over them)",
                        p.mean_nll.exp()
                    )),
                    if outputs.is_empty() {
                        String::new()
                    } else {
                        format!("; {} not written", outputs.join(" and "))
                    }
                );
            }
            return Err(e);
        }
    };
    if let Some(w) = writer {
        w.finish()?;
    }
    print!("{}", text_report(&model_name, &a.text, &plan, &ev));
    if let (Some(kl), Some(b)) = (&ev.kl, &base) {
        print!("{}", kl_text_report(b, kl));
    }
    if let Some(p) = &a.save_logits {
        println!(
            "saved the top-{} log-probabilities of {} positions to {}",
            a.top_k_save.min(config.vocab_size),
            plan.positions(),
            p.display()
        );
    }
    if let Some(p) = &a.json {
        let t = &ev.timing;
        let v = serde_json::json!({
            "command": "perplexity",
            "date_utc": date_utc,
            "commit": commit,
            "model": model_id,
            "text": text_id,
            "tokenizer": text_id.tokenizer,
            "mode": mode,
            "gpu": mode["gpu"],
            "chunking": plan,
            "prefill_tokens_per_chunk": plan.prefill_len(),
            "tokens_scored": ev.nll.tokens,
            "mean_nll": ev.nll.mean_nll,
            "nll_se": ev.nll.nll_se,
            "ppl": ev.nll.ppl,
            "ppl_ci95": ev.nll.ppl_ci95,
            "timing": {
                "startup_s": {"text_and_tokenizer": text_s, "checkpoint_and_fingerprint": checkpoint_s,
                    "engine": engine_s},
                "wall_s": t_start.elapsed().as_secs_f64(),
                "prefill_tokens": t.prefill_tokens,
                "prefill_s": t.prefill_s,
                "prefill_tokens_per_s": t.prefill_tokens_per_s(),
                "scored_tokens": t.scored_tokens,
                "score_s": t.score_s,
                "score_tokens_per_s": t.score_tokens_per_s(),
            },
            "save_logits": a.save_logits.as_ref().map(|f| serde_json::json!({
                "file": f, "top_k": a.top_k_save.min(config.vocab_size),
            })),
            "kl": ev.kl.as_ref().zip(base.as_ref()).map(|(kl, b)| {
                let mut v = serde_json::to_value(kl).expect("summary serializes");
                v["base"] = serde_json::json!(b.path());
                v["base_model"] = serde_json::json!(b.header().model.name);
                v["base_mode"] = b.header().mode.clone();
                v["base_date_utc"] = serde_json::json!(b.header().date_utc);
                v["base_commit"] = serde_json::json!(b.header().commit);
                v
            }),
        });
        std::fs::write(p, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| Error::io(p, e))?;
    }
    Ok(())
}

/// A perplexity run's engine, checked between units of work: Ctrl-C
/// ([`sparda::interrupt`]) before each chunk's prefill and each decode
/// step, and every logits row by [`check_logits`] — a NaN, a +inf or no
/// finite logit is [`Error::NonFiniteLogits`] naming the chunk (each chunk
/// is a fresh sequence) and the decode step within it (0: the prefill's
/// logits), on the CPU and the GPU alike (the GPU's kernels report the same
/// fault first, through the device error record).
struct Guarded<'a> {
    inner: &'a mut dyn NextTokenLogits,
    /// The chunk being scored (count of prefills − 1).
    chunk: usize,
    /// Decode steps of this chunk so far.
    step: usize,
    prefills: usize,
}

impl<'a> Guarded<'a> {
    fn new(inner: &'a mut dyn NextTokenLogits) -> Self {
        Guarded {
            inner,
            chunk: 0,
            step: 0,
            prefills: 0,
        }
    }

    /// The logits row `r` of decode step `self.step` of this chunk, checked.
    fn checked(&self, r: Result<Vec<f32>>) -> Result<Vec<f32>> {
        let (step, chunk) = (self.step, self.chunk);
        let l = r.map_err(|e| e.locate(step, chunk))?;
        check_logits(&l).map_err(|f| f.to_error(None).locate(step, chunk))?;
        Ok(l)
    }
}

impl NextTokenLogits for Guarded<'_> {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn prefill(&mut self, prefix: &[u32]) -> Result<Vec<f32>> {
        self.chunk = self.prefills;
        self.prefills += 1;
        self.step = 0;
        let c = self.chunk;
        sparda::interrupt::check(|| format!("chunk {c}, before its prefill"))?;
        let r = self.inner.prefill(prefix);
        self.checked(r)
    }
    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        self.step += 1;
        let (c, s) = (self.chunk, self.step);
        sparda::interrupt::check(|| format!("chunk {c}, decode step {s}"))?;
        let r = self.inner.decode(token);
        self.checked(r)
    }
}

/// `FILE.partial`, where [`LogitsWriter`] writes `--save-logits FILE` until
/// it is complete (src/quality/logits_file.rs, "Format").
fn partial_path(p: &Path) -> std::path::PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".partial");
    s.into()
}

/// "1 chunk", "2 chunks".
fn chunks(n: usize) -> String {
    format!("{n} chunk{}", if n == 1 { "" } else { "s" })
}

/// `x ± y` with y absent as "n/a".
fn pm(x: f64, se: Option<f64>, digits: usize) -> String {
    match se {
        Some(s) => format!("{x:.digits$} ± {s:.digits$}"),
        None => format!("{x:.digits$} (± n/a: one token)"),
    }
}

/// The perplexity part of the text report (stdout).
fn text_report(model: &str, text: &Path, plan: &ChunkPlan, ev: &Evaluation) -> String {
    let n = &ev.nll;
    let t = &ev.timing;
    let ci = n.ppl_ci95.map_or_else(
        || "n/a".to_string(),
        |[lo, hi]| format!("{lo:.4} … {hi:.4}"),
    );
    format!(
        "perplexity of {model} on {}: {} × {} tokens, the last {} of each scored\n\
         \x20 tokens scored    {}\n\
         \x20 mean NLL         {} nats/token (± 1 standard error)\n\
         \x20 perplexity       {:.4}  (95 % interval {ci})\n\
         \x20 speed            prefill {:.1} tokens/s ({} tokens in {:.2} s); scoring {:.2} tokens/s ({} tokens in {:.2} s)\n",
        text.display(),
        chunks(plan.chunks),
        plan.context,
        plan.score,
        n.tokens,
        pm(n.mean_nll, n.nll_se, 5),
        n.ppl,
        t.prefill_tokens_per_s(),
        t.prefill_tokens,
        t.prefill_s,
        t.score_tokens_per_s(),
        t.scored_tokens,
        t.score_s,
    )
}

/// The comparison part of the text report (stdout).
fn kl_text_report(base: &LogitsReader, kl: &KlSummary) -> String {
    let h = base.header();
    let ci = kl.delta_ppl_ci95.map_or_else(
        || "n/a".to_string(),
        |[lo, hi]| format!("{lo:+.4} … {hi:+.4}"),
    );
    format!(
        "against the base run {} ({}, attention {}, backend {}; {} positions, top-{} + rest):\n\
         \x20 note             {}\n\
         \x20                  (base tail mass outside its top-{}: mean {:.3e}, max {:.3e})\n\
         \x20 KL mean          {} nats\n\
         \x20 KL median        {:.6} nats\n\
         \x20 KL p99           {:.6} nats\n\
         \x20 KL max           {:.6} nats\n\
         \x20 top-1 agreement  {} % (this run's argmax = the base's)\n\
         \x20 Δ perplexity     {:+.4}  (95 % interval {ci}; this {:.4}, base {:.4}; paired per-token NLL differences)\n\
         \x20 Δ mean NLL       {} nats/token\n",
        base.path().display(),
        h.model.name,
        h.mode["mode"].as_str().unwrap_or("?"),
        h.mode["backend"].as_str().unwrap_or("?"),
        kl.positions,
        kl.top_k,
        kl.note,
        kl.top_k,
        kl.base_tail_mass_mean,
        kl.base_tail_mass_max,
        pm(kl.kl_mean, kl.kl_mean_se, 6),
        kl.kl_median,
        kl.kl_p99,
        kl.kl_max,
        pm(kl.top1_agreement_pct, kl.top1_agreement_se_pct, 2),
        kl.delta_ppl,
        kl.this_ppl,
        kl.base_ppl,
        pm(kl.delta_nll_mean, kl.delta_nll_se, 6),
    )
}
