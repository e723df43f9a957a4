//! `sparda generate`: text generation on the CPU reference or the GPU.

use super::fixture_tokenizer;
use crate::*;
use indicatif::{ProgressBar, ProgressStyle};
use sparda::cpu::{CpuModel, EngineOptions};
use sparda::generate::{self, Request};
use sparda::model::{AttentionOverrides, PrefillMode, SelectionRule};
use sparda::pipeline::GpuModel;
use sparda::sample::SamplingParams;
use sparda::tokenizer::{TextStream, Tokenizer};
use sparda::{Error, Result};
use std::io::Write;

/// Checks everything `generate` can check from its flags alone (flag
/// combinations, value ranges, output directories) for the resolved
/// `backend`; runs before any model is built or loaded.
pub(crate) fn check_generate_flags(a: &GenerateArgs, backend: Backend) -> Result<()> {
    a.offload.validate()?;
    if a.kv != KvArg::Offload && a.offload.given() {
        return Err(Error::Input(
            "--fetch, --prefetch-ctas and --offload-layer0 apply to offloaded KV: add --kv offload (CUDA backend)".into(),
        ));
    }
    if a.kv == KvArg::Offload && a.offload.fetch.len() != 1 {
        let given: Vec<String> = a
            .offload
            .fetch
            .iter()
            .filter_map(|f| f.to_possible_value().map(|v| v.get_name().to_string()))
            .collect();
        return Err(Error::Input(format!(
            "generate: give one --fetch engine (got --fetch {})",
            given.join(",")
        )));
    }
    if a.kv == KvArg::Offload && backend != Backend::Cuda {
        return Err(Error::Input(
            "--kv offload needs the CUDA backend (--backend cuda)".into(),
        ));
    }
    if a.prefetch == OnOff::Off && (a.kv != KvArg::Offload || a.forecast.is_none()) {
        return Err(Error::Input(
            "--prefetch off applies to forecast mode with offloaded KV (--forecast … --kv offload)"
                .into(),
        ));
    }
    if let (Some(spec), Some(AttentionArg::Dense)) = (&a.forecast, a.attention) {
        return Err(Error::Input(format!(
            "--forecast {spec} selects blocks for sparse attention, but --attention dense was given: drop one"
        )));
    }
    if let Some(spec) = a.forecast.as_deref() {
        let synth = spec == "synth" || spec.starts_with("synth:");
        if !synth && !std::path::Path::new(spec).exists() {
            return Err(Error::Input(format!(
                "--forecast {spec}: no such file or directory (give a .safetensors or .pt file, or synth[:SEED])"
            )));
        }
    }
    if a.prompt_tokens == Some(0) {
        return Err(Error::Input("--prompt-tokens must be ≥ 1".into()));
    }
    if let Some(t) = a.rope_theta {
        if !(t.is_finite() && t > 0.0) {
            return Err(Error::Input(format!(
                "--rope-theta must be a finite value > 0, got {t}"
            )));
        }
    }
    if a.logprobs.is_some() && a.json.is_none() {
        return Err(Error::Input(
            "--logprobs writes to the JSON report: add --json FILE".into(),
        ));
    }
    for p in [&a.json, &a.trace].into_iter().flatten() {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(d) = dir.filter(|d| !d.is_dir()) {
            return Err(Error::Input(format!(
                "{}: directory {} does not exist",
                p.display(),
                d.display()
            )));
        }
    }
    Ok(())
}

/// The config of `generate --model` (a checkpoint's config.json, or a
/// `synth:` preset's) with the --rope-theta and --max-position overrides,
/// read without loading or building any weights.
pub(crate) fn generate_config(a: &GenerateArgs) -> Result<sparda::config::ModelConfig> {
    let name = a.model.to_string_lossy();
    let mut config = match name.strip_prefix("synth:") {
        Some(spec) => sparda::synth::parse_spec(spec)?.0.config(),
        None => sparda::config::ModelConfig::from_file(&a.model)?,
    };
    if let Some(t) = a.rope_theta {
        config = config.with_rope_theta(t);
    }
    if let Some(m) = a.max_position {
        config = config.with_max_position(m);
    }
    Ok(config)
}

pub(crate) fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let backend = match a.backend {
        Backend::Auto if sparda::cuda::is_available() => Backend::Cuda,
        Backend::Auto => Backend::Cpu,
        b => b,
    };
    // Everything below up to the model build reads only flags and small
    // files, so a bad invocation fails in well under a second, before
    // e.g. synth:nosa-8b spends minutes and ~17 GB on its weights; flag
    // errors come before a missing CUDA library is reported.
    check_generate_flags(&a, backend)?;
    if backend == Backend::Cuda {
        sparda::cuda::require()?;
    }
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(t), None) => t.clone(),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map_err(|e| Error::Input(format!("--prompt-file {}: {e}", p.display())))?,
        _ => {
            return Err(Error::Input(
                "give --prompt TEXT or --prompt-file FILE".into(),
            ))
        }
    };
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling.validate()?;
    let config = generate_config(&a)?;
    let model_name = a.model.to_string_lossy().into_owned();
    let synth = model_name.starts_with("synth:");
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| {
        if synth {
            fixture_tokenizer()
        } else {
            a.model.join("tokenizer.json")
        }
    });
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| match e {
        Error::Io { path, source } if a.tokenizer.is_some() => {
            Error::Input(format!("--tokenizer {}: {source}", path.display()))
        }
        Error::Io { path, source } => Error::Input(format!(
            "{}: {source} (give the tokenizer with --tokenizer FILE; scripts/fixture.sh builds the default one)",
            path.display()
        )),
        other => other,
    })?;
    let mut prompt = tokenizer.encode(&text)?;
    if let Some(n) = a.prompt_tokens {
        prompt.truncate(n);
    }
    generate::check_length(
        prompt.len(),
        a.max_new_tokens,
        config.max_position_embeddings,
    )?;
    let forecast = a
        .forecast
        .as_deref()
        .map(|spec| sparda::model::forecast::ForecastWeights::from_arg(spec, &config))
        .transpose()?;
    if synth {
        eprintln!("building {model_name} in memory…");
    }
    let mut ckpt = sparda::bench::open_model(&model_name)?;
    if let Some(t) = a.rope_theta {
        ckpt.config = ckpt.config.with_rope_theta(t);
    }
    if let Some(m) = a.max_position {
        ckpt.config = ckpt.config.with_max_position(m);
    }
    let opts = EngineOptions {
        attention: AttentionOverrides {
            sparse: a.attention.map(|x| matches!(x, AttentionArg::Sparse)),
            selection: a.selection.map(|s| match s {
                SelectionArg::Nosa => SelectionRule::Nosa,
                SelectionArg::Infllmv2 => SelectionRule::InfLlmV2,
            }),
            budget_blocks: a.budget_blocks,
            select_blocks: a.select_blocks,
        },
        prefill: match a.prefill {
            Some(PrefillArg::Dense) => PrefillMode::Dense,
            _ => PrefillMode::Auto,
        },
    };
    enum Engine {
        Cpu(Box<CpuModel>),
        Cuda(Box<GpuModel>),
    }
    let engine = if backend == Backend::Cuda {
        let gpu = std::sync::Arc::new(sparda::cuda::Gpu::new(0)?);
        let t = std::time::Instant::now();
        let mut m = GpuModel::new(gpu, &ckpt, opts)?;
        if a.kv == KvArg::Offload {
            // check_generate_flags made sure there is exactly one engine.
            m.set_offload(a.offload.options().first().copied())?;
        }
        if let Some(f) = &forecast {
            m.set_forecast(Some(f), a.prefetch == OnOff::On)?;
        }
        m.set_trace(a.trace.is_some())?;
        eprintln!(
            "weights on {} in {:.1} s",
            m.gpu().info().name,
            t.elapsed().as_secs_f64()
        );
        Engine::Cuda(Box::new(m))
    } else {
        let mut m = CpuModel::new(&ckpt, opts)?;
        if let Some(f) = &forecast {
            if m.plan.rule().is_none() {
                return Err(Error::Input(
                    "--forecast selects blocks for sparse attention, but this model runs dense: add --attention sparse (or --selection)".into(),
                ));
            }
            m.set_forecast(Some(f.clone()))?;
        }
        Engine::Cpu(Box::new(m))
    };
    let (plan, backend_name) = match &engine {
        Engine::Cpu(m) => (m.plan, "cpu".to_string()),
        Engine::Cuda(m) => (m.plan, format!("cuda (selection {:?})", m.selection_path())),
    };
    let mode = plan.mode;
    let plan_json = serde_json::json!({
        "mode": format!("{:?}", plan.mode),
        "budget_blocks": plan.budget.attended,
        "shortlist_blocks": plan.budget.shortlist,
        "dense_len": plan.sparse.dense_len,
        "forecast": forecast.is_some(),
        "backend": backend_name,
        "kv": match (backend, a.kv) {
            (Backend::Cpu, _) => "host (CPU reference)".to_string(),
            (_, KvArg::Gpu) => "gpu".to_string(),
            (_, KvArg::Offload) => format!("offload ({:?})", a.offload.options()),
        },
    });
    eprintln!(
        "model {} ({} layers, d {}), attention {:?}, backend {backend_name}, prompt {} tokens",
        a.model.display(),
        ckpt.config.num_hidden_layers,
        ckpt.config.hidden_size,
        mode,
        prompt.len()
    );
    let req = Request {
        prompt,
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_ids: if a.ignore_eos {
            Vec::new()
        } else {
            ckpt.config.eos_token_ids.clone()
        },
        logprobs: a.logprobs,
    };
    let bar = ProgressBar::new(req.prompt.len() as u64).with_style(
        ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens {per_sec} eta {eta}")
            .expect("static template"),
    );
    let mut stream = TextStream::new(&tokenizer);
    let mut stdout = std::io::stdout().lock();
    let progress = |done: usize, _| bar.set_position(done as u64);
    let on_token = |tok| {
        if !bar.is_finished() {
            bar.finish_and_clear();
        }
        let piece = stream.push(tok)?;
        stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
            .map_err(|e| Error::io("<stdout>", e))
    };
    let out = match engine {
        Engine::Cpu(model) => generate::generate_cpu(&model, &req, progress, on_token)?.0,
        Engine::Cuda(mut model) => {
            let out = generate::generate_gpu(&mut model, &req, progress, on_token)?;
            model.flush_trace()?;
            out
        }
    };
    writeln!(stdout).ok();
    eprintln!(
        "prefill {} tokens in {:.0} ms ({:.1} tokens/s); {} tokens generated, {} decode steps in {:.0} ms ({:.2} tokens/s); stop: {:?}",
        req.prompt.len(),
        out.prefill_ms,
        req.prompt.len() as f64 / (out.prefill_ms / 1e3),
        out.tokens.len(),
        out.tokens.len().saturating_sub(1),
        out.decode_ms,
        out.decode_tokens_per_s(),
        out.stop
    );
    if let Some(p) = a.json {
        let mut v = serde_json::json!({
            "model": a.model, "attention": plan_json, "prompt_tokens": req.prompt, "tokens": out.tokens, "stop": out.stop,
            "prefill_ms": out.prefill_ms, "decode_ms": out.decode_ms, "decode_tokens_per_s": out.decode_tokens_per_s(),
        });
        if req.logprobs.is_some() {
            let text = |id: u32| tokenizer.decode(&[id]).unwrap_or_default();
            v["logprobs"] = serde_json::json!(out
                .logprobs
                .iter()
                .map(|t| serde_json::json!({
                    "token": t.token, "text": text(t.token), "logprob": t.logprob,
                    "top_logprobs": t.top_logprobs.iter()
                        .map(|&(id, lp)| serde_json::json!({"token": id, "text": text(id), "logprob": lp}))
                        .collect::<Vec<_>>(),
                }))
                .collect::<Vec<_>>());
        }
        std::fs::write(&p, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}
