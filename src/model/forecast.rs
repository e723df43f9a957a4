//! SparDA forecast weights (spec/nosa-model.md §2, §4 "Forecast mode"):
//! `q_future_proj` of layer l ([Hkv·D, d]) maps layer l's normed attention
//! input x̂_l to a forecast query for layer l+1; `q_curr_proj` of layer 0
//! does the same for layer 0 itself.

use crate::config::ModelConfig;
use crate::weights::names::{self, LayerTensor};
use crate::weights::{OwnedTensor, TensorStore};
use crate::{Error, Result};
use std::path::Path;

/// Forecast projections, f32, row-major [Hkv·D, d].
#[derive(Debug, Clone)]
pub struct ForecastWeights {
    /// `future[l]` = q_future_proj of layer l, for l = 0 … L−2 (it forecasts layer l+1).
    pub future: Vec<Vec<f32>>,
    /// q_curr_proj of layer 0.
    pub curr0: Vec<f32>,
}

/// Name suffix of layer `l`'s tensor `t` (`layers.{l}.self_attn.…`): SparDA's
/// trainer prefixes keys differently (`model.`, `module.`), so keys are
/// matched by this suffix.
fn suffix(l: usize, t: LayerTensor) -> String {
    let full = names::layer(l, t);
    full.strip_prefix("model.").unwrap_or(&full).to_string()
}

impl ForecastWeights {
    /// Reads the forecast tensors of `cfg` from `store`, matching keys by the
    /// suffix `layers.{l}.self_attn.{q_future_proj|q_curr_proj}.weight`. A
    /// last-layer q_future_proj may exist and is ignored.
    ///
    /// Errors: one [`Error::Checkpoint`] naming every missing or mis-shaped
    /// layer (expected [Hkv·D, d]).
    pub fn from_store(cfg: &ModelConfig, store: &TensorStore, origin: &Path) -> Result<Self> {
        let want = vec![cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size];
        let names = store.names();
        let mut problems = Vec::new();
        let mut fetch = |l: usize, t: LayerTensor| -> Option<Vec<f32>> {
            let suf = suffix(l, t);
            let Some(name) = names.iter().find(|n| {
                n.ends_with(&suf)
                    && (n.len() == suf.len() || n.as_bytes()[n.len() - suf.len() - 1] == b'.')
            }) else {
                problems.push(format!("layer {l}: missing `{suf}`"));
                return None;
            };
            let (_, shape) = store.info(name)?;
            if shape != want.as_slice() {
                problems.push(format!(
                    "layer {l}: `{name}` has shape {shape:?}, expected {want:?}"
                ));
                return None;
            }
            match store.to_f32(name) {
                Ok(v) => Some(v),
                Err(e) => {
                    problems.push(format!("layer {l}: {e}"));
                    None
                }
            }
        };
        let future: Vec<Option<Vec<f32>>> = (0..cfg.num_hidden_layers.saturating_sub(1))
            .map(|l| fetch(l, LayerTensor::QFutureProj))
            .collect();
        let curr0 = fetch(0, LayerTensor::QCurrProj);
        if !problems.is_empty() {
            return Err(Error::checkpoint(
                origin,
                format!("forecast weights:\n  {}", problems.join("\n  ")),
            ));
        }
        Ok(ForecastWeights {
            future: future.into_iter().map(Option::unwrap).collect(),
            curr0: curr0.unwrap(),
        })
    }

    /// Loads forecast weights from a `.safetensors` file (or a directory of
    /// them), or from a SparDA trainer checkpoint (`.pt` / `.pth`, as
    /// torch.save writes it; only tensors whose key ends in
    /// `q_future_proj.weight` or `q_curr_proj.weight` are read, optimizer
    /// state is skipped).
    ///
    /// Errors: unreadable file; missing or mis-shaped layers (see [`Self::from_store`]).
    pub fn open(path: &Path, cfg: &ModelConfig) -> Result<Self> {
        let is_pt = path.extension().is_some_and(|e| e == "pt" || e == "pth");
        let store = if is_pt {
            let want =
                |n: &str| n.ends_with("q_future_proj.weight") || n.ends_with("q_curr_proj.weight");
            TensorStore::from_tensors(super::torch_pt::read_tensors(path, want)?)
        } else {
            TensorStore::open(path)?
        };
        Self::from_store(cfg, &store, path)
    }

    /// Forecast weights from a command-line value: a file (see [`Self::open`])
    /// or `synth[:SEED]` for random ones ([`Self::synth_tensors`]).
    ///
    /// Errors: a bad seed; as [`Self::open`].
    pub fn from_arg(spec: &str, cfg: &ModelConfig) -> Result<Self> {
        if spec == "synth" || spec.starts_with("synth:") {
            let seed = match spec.strip_prefix("synth:") {
                Some(x) => x
                    .parse::<u64>()
                    .map_err(|_| Error::Input(format!("--forecast synth:SEED: bad seed `{x}`")))?,
                None => 0,
            };
            let store = TensorStore::from_tensors(Self::synth_tensors(cfg, seed));
            Self::from_store(cfg, &store, Path::new("<synth>"))
        } else {
            Self::open(Path::new(spec), cfg)
        }
    }

    /// Random forecast tensors for `cfg` (q_future_proj of layers 0 … L−2 and
    /// q_curr_proj of layer 0), bf16, deterministic from `seed` (for
    /// benchmarks; `sparda synth --forecast`).
    pub fn synth_tensors(cfg: &ModelConfig, seed: u64) -> Vec<OwnedTensor> {
        let shape = [cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size];
        let mut out: Vec<OwnedTensor> = (0..cfg.num_hidden_layers.saturating_sub(1))
            .map(|l| {
                crate::synth::generate_tensor(
                    cfg,
                    &names::layer(l, LayerTensor::QFutureProj),
                    &shape,
                    seed,
                )
            })
            .collect();
        out.push(crate::synth::generate_tensor(
            cfg,
            &names::layer(0, LayerTensor::QCurrProj),
            &shape,
            seed,
        ));
        out
    }
}
