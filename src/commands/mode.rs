//! What `generate` and `perplexity` share: the mode flags' checks, the
//! model config and tokenizer they name, and the engine (CPU reference or
//! GPU) built from them.

use super::fixture_tokenizer;
use crate::*;
use sparda::config::ModelConfig;
use sparda::cpu::{CpuModel, EngineOptions};
use sparda::model::forecast::ForecastWeights;
use sparda::model::{AttentionPlan, PrefillMode};
use sparda::pipeline::GpuModel;
use sparda::tokenizer::Tokenizer;
use sparda::weights::Checkpoint;
use sparda::{Error, Result};
use std::path::{Path, PathBuf};

/// `--backend auto` resolved: CUDA when available, else the CPU.
pub(crate) fn resolve_backend(b: Backend) -> Backend {
    match b {
        Backend::Auto if sparda::cuda::is_available() => Backend::Cuda,
        Backend::Auto => Backend::Cpu,
        b => b,
    }
}

/// Checks everything the mode flags can say alone (`--model` not a file,
/// flag combinations, value ranges, the forecast file) for the resolved `backend`; runs
/// before any model is built or loaded.
pub(crate) fn check_mode_flags(a: &ModeArgs, backend: Backend, cmd: &str) -> Result<()> {
    sparda::bench::check_model_arg(&a.model.to_string_lossy())?;
    a.offload.validate()?;
    if a.kv != KvArg::Offload && a.offload.given() {
        return Err(Error::Input(
            "--fetch, --prefetch-ctas, --offload-layer0, --fetch-whole-sms, --reserve-fetch-sms and --cache-slots apply to offloaded KV: add --kv offload (CUDA backend)".into(),
        ));
    }
    if a.kv == KvArg::Offload {
        // generate and perplexity run one configuration; lists are for bench and offload-check
        let one = |flag: &str, what: &str, given: Vec<String>| {
            if given.len() == 1 {
                return Ok(());
            }
            Err(Error::Input(format!(
                "{cmd}: give one {flag} {what} (got {flag} {})",
                given.join(",")
            )))
        };
        one(
            "--fetch",
            "engine",
            a.offload.fetch.iter().map(|f| f.label()).collect(),
        )?;
        one(
            "--cache-slots",
            "value",
            a.offload
                .cache_slots
                .iter()
                .map(|c| c.to_string())
                .collect(),
        )?;
    }
    if a.kv == KvArg::Offload && backend != Backend::Cuda {
        return Err(Error::Input(
            "--kv offload needs the CUDA backend (--backend cuda)".into(),
        ));
    }
    if a.prefill_attention == Some(PrefillAttentionArg::TensorCore) && backend != Backend::Cuda {
        return Err(Error::Input(
            "--prefill-attention tensor-core needs the CUDA backend (--backend cuda)".into(),
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
        if !synth && !Path::new(spec).exists() {
            return Err(Error::Input(format!(
                "--forecast {spec}: no such file or directory (give a .safetensors or .pt file, or synth[:SEED])"
            )));
        }
    }
    if let Some(t) = a.rope_theta {
        if !(t.is_finite() && t > 0.0) {
            return Err(Error::Input(format!(
                "--rope-theta must be a finite value > 0, got {t}"
            )));
        }
    }
    Ok(())
}

/// Refuses, before any work, output paths that are directories or whose
/// directory does not exist.
pub(crate) fn check_output_dirs<'a>(paths: impl IntoIterator<Item = &'a PathBuf>) -> Result<()> {
    for p in paths {
        if p.is_dir() {
            return Err(Error::Input(format!(
                "{} is a directory; give a file path for the output",
                p.display()
            )));
        }
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

/// The config of `--model` (a checkpoint's config.json, or a `synth:`
/// preset's) with the --rope-theta and --max-position overrides, read
/// without loading or building any weights.
pub(crate) fn mode_config(a: &ModeArgs) -> Result<ModelConfig> {
    let name = a.model.to_string_lossy();
    let config = match name.strip_prefix("synth:") {
        Some(spec) => sparda::synth::parse_spec(spec)?.0.config(),
        None => ModelConfig::from_file(&a.model)?,
    };
    with_overrides(a, config)
}

/// `config` with the --rope-theta and --max-position overrides applied.
///
/// Errors: a --max-position past an enabled sliding_window.
fn with_overrides(a: &ModeArgs, mut config: ModelConfig) -> Result<ModelConfig> {
    if let Some(t) = a.rope_theta {
        config = config.with_rope_theta(t);
    }
    if let Some(m) = a.max_position {
        config = config.with_max_position(m)?;
    }
    Ok(config)
}

/// The tokenizer file `--tokenizer` names, else the model directory's, or
/// the fixture's for `synth:` models.
pub(crate) fn tokenizer_path(a: &ModeArgs) -> PathBuf {
    a.tokenizer.clone().unwrap_or_else(|| {
        if a.model.to_string_lossy().starts_with("synth:") {
            fixture_tokenizer()
        } else {
            a.model.join("tokenizer.json")
        }
    })
}

/// Loads [`tokenizer_path`].
///
/// Errors: [`Error::Input`] naming the file and how to get one when it
/// cannot be read; tokenizer errors.
pub(crate) fn load_tokenizer(a: &ModeArgs) -> Result<Tokenizer> {
    Tokenizer::from_file(tokenizer_path(a)).map_err(|e| match e {
        Error::Io { path, source } if a.tokenizer.is_some() => {
            Error::Input(format!("--tokenizer {}: {source}", path.display()))
        }
        Error::Io { path, source } => Error::Input(format!(
            "{}: {source} (give the tokenizer with --tokenizer FILE; scripts/fixture.sh builds the default one)",
            path.display()
        )),
        other => other,
    })
}

/// The `--forecast` weights for `config`, if given.
pub(crate) fn load_forecast(a: &ModeArgs, config: &ModelConfig) -> Result<Option<ForecastWeights>> {
    a.forecast
        .as_deref()
        .map(|spec| ForecastWeights::from_arg(spec, config))
        .transpose()
}

/// Opens (or, for `synth:`, builds) `--model` with the config overrides
/// applied; says so on stderr when building takes a while.
pub(crate) fn open_checkpoint(a: &ModeArgs) -> Result<Checkpoint> {
    let name = a.model.to_string_lossy().into_owned();
    if name.starts_with("synth:") {
        eprintln!("building {name} in memory…");
    }
    let mut ckpt = sparda::bench::open_model(&name)?;
    ckpt.config = with_overrides(a, ckpt.config)?;
    Ok(ckpt)
}

/// A model on the backend the flags chose.
pub(crate) enum Engine {
    /// The CPU reference.
    Cpu(Box<CpuModel>),
    /// The GPU engine.
    Cuda(Box<GpuModel>),
}

impl Engine {
    /// The attention in force.
    pub(crate) fn plan(&self) -> AttentionPlan {
        match self {
            Engine::Cpu(m) => m.plan,
            Engine::Cuda(m) => m.plan,
        }
    }

    /// "cpu", or "cuda (selection PATH)".
    pub(crate) fn backend_name(&self) -> String {
        match self {
            Engine::Cpu(_) => "cpu".to_string(),
            Engine::Cuda(m) => format!("cuda (selection {:?})", m.selection_path()),
        }
    }

    /// The GPU's name on the CUDA backend.
    pub(crate) fn gpu_name(&self) -> Option<String> {
        match self {
            Engine::Cpu(_) => None,
            Engine::Cuda(m) => Some(m.gpu().info().name.clone()),
        }
    }
}

/// The engine options of the mode flags.
fn engine_options(a: &ModeArgs) -> EngineOptions {
    EngineOptions {
        attention: a
            .sel
            .overrides(a.attention.map(|x| matches!(x, AttentionArg::Sparse))),
        prefill: match a.prefill {
            Some(PrefillArg::Dense) => PrefillMode::Dense,
            _ => PrefillMode::Auto,
        },
    }
}

/// Builds the model of `ckpt` on `backend` in the mode the flags say:
/// attention overrides and prefill mode; on the GPU the prefill attention
/// kernel, offloaded KV (one
/// --fetch engine, as [`check_mode_flags`] made sure), forecast selection
/// with --prefetch, and GPU trace spans when `trace`; on the CPU forecast
/// selection.
///
/// Errors: overrides the checkpoint cannot honour; forecast selection on a
/// model that runs dense; `--prefill-attention tensor-core` for a head dim
/// without a tensor-core kernel; bf16 weights that do not fit in the GPU's free
/// memory ([`sparda::memory::check_weights`], before the upload); device
/// errors.
pub(crate) fn build_engine(
    a: &ModeArgs,
    backend: Backend,
    ckpt: &Checkpoint,
    forecast: Option<&ForecastWeights>,
    trace: bool,
) -> Result<Engine> {
    let opts = engine_options(a);
    if backend == Backend::Cuda {
        let gpu = std::sync::Arc::new(sparda::cuda::Gpu::new(0)?);
        // refused with the numbers before anything is uploaded
        sparda::memory::check_weights(&gpu, &ckpt.config, ckpt.eviction_heads)?;
        let t = std::time::Instant::now();
        let mut m = GpuModel::new(gpu, ckpt, opts)?;
        if let Some(pa) = a.prefill_attention {
            m.set_prefill_attention(pa.into())?;
        }
        if a.kv == KvArg::Offload {
            m.set_offload(a.offload.options().first().copied())?;
            a.offload.apply_sm_residency(&mut m);
        }
        if let Some(f) = forecast {
            m.set_forecast(Some(f), a.prefetch == OnOff::On)?;
        }
        m.set_trace(trace)?;
        eprintln!(
            "weights on {} in {:.1} s",
            m.gpu().info().name,
            t.elapsed().as_secs_f64()
        );
        Ok(Engine::Cuda(Box::new(m)))
    } else {
        let mut m = CpuModel::new(ckpt, opts)?;
        if let Some(f) = forecast {
            if m.plan.rule().is_none() {
                return Err(Error::Input(
                    "--forecast selects blocks for sparse attention, but this model runs dense: add --attention sparse (or --selection)".into(),
                ));
            }
            m.set_forecast(Some(f.clone()))?;
        }
        Ok(Engine::Cpu(Box::new(m)))
    }
}

/// The attention in force as JSON (`generate --json`'s "attention"):
/// mode, budget, shortlist, dense_len, forecast, backend, the prefill
/// attention and window-scoring kernels (CUDA; null on the CPU reference)
/// and KV placement.
pub(crate) fn plan_json(
    a: &ModeArgs,
    backend: Backend,
    engine: &Engine,
    forecast: bool,
) -> serde_json::Value {
    let plan = engine.plan();
    serde_json::json!({
        "mode": format!("{:?}", plan.mode),
        "budget_blocks": plan.budget.attended,
        "shortlist_blocks": plan.budget.shortlist,
        "dense_len": plan.sparse.dense_len,
        "forecast": forecast,
        "backend": engine.backend_name(),
        "prefill_attention": match engine {
            Engine::Cpu(_) => None,
            Engine::Cuda(m) => Some(m.prefill_attention().name()),
        },
        "prefill_scores": match engine {
            Engine::Cpu(_) => None,
            Engine::Cuda(_) => Some(sparda::cuda::ops::prefill_scores::prefill_scores().name()),
        },
        "kv": match (backend, a.kv) {
            (Backend::Cpu, _) => "host (CPU reference)".to_string(),
            (_, KvArg::Gpu) => "gpu".to_string(),
            (_, KvArg::Offload) => format!("offload ({:?})", a.offload.options()),
        },
    })
}
