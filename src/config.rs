//! `config.json` → [`ModelConfig`], [`SparseConfig`], [`RopeScaling`], and the
//! RoPE tables ([`Rope`]) (spec/nosa-model.md §1).
//!
//! Entry points: [`ModelConfig::from_file`] (a checkpoint directory or a
//! `config.json` path; reads `generation_config.json` beside it when present)
//! and [`ModelConfig::from_json_str`]. Every value is read from the file; a
//! missing required key, a value of the wrong type, or an inconsistent setting
//! is an [`Error::Config`] naming the key (dotted for nested keys, e.g.
//! `sparse_config.kernel_size`) and the numbers.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// muP scalings of MiniCPM-style checkpoints (NOSA-8B), spec §1.
///
/// Present in a [`ModelConfig`] iff `config.json` has at least one of
/// `scale_emb`, `scale_depth`, `dim_model_base`; the absent ones take their
/// no-op values (`scale_emb` 1, `scale_depth` `None`, `dim_model_base` =
/// `hidden_size`). Use [`Mup::embed_scale`], [`Mup::residual_scale`] and
/// [`Mup::logit_divisor`] rather than the raw fields.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Mup {
    /// Embedding output is multiplied by this.
    pub scale_emb: f32,
    /// Each residual branch is multiplied by `scale_depth / sqrt(L)` before adding;
    /// `None`: no residual scaling (the key was absent).
    pub scale_depth: Option<f32>,
    /// Final hidden state is divided by `hidden_size / dim_model_base` before `lm_head`.
    pub dim_model_base: f32,
}

impl Mup {
    /// Factor applied to the embedding output (`scale_emb`).
    pub fn embed_scale(&self) -> f32 {
        self.scale_emb
    }
    /// Factor applied to each residual branch (attention and MLP outputs) of a
    /// model with `num_layers` layers: `scale_depth / sqrt(L)`, or 1 without `scale_depth`.
    pub fn residual_scale(&self, num_layers: usize) -> f32 {
        match self.scale_depth {
            Some(s) => (f64::from(s) / (num_layers as f64).sqrt()) as f32,
            None => 1.0,
        }
    }
    /// Divisor of the final (normed) hidden state before `lm_head`:
    /// `hidden_size / dim_model_base`.
    pub fn logit_divisor(&self, hidden_size: usize) -> f32 {
        (hidden_size as f64 / f64::from(self.dim_model_base)) as f32
    }
}

/// RoPE frequency scaling (`rope_scaling` / `rope_parameters`), spec §1.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor` (inverse frequencies divided by it).
    Linear {
        /// Scaling factor (> 0).
        factor: f64,
    },
    /// Dynamic NTK: the base grows with the sequence length past the original maximum.
    Dynamic {
        /// Scaling factor (> 0).
        factor: f64,
        /// `original_max_position_embeddings` (defaults to `max_position_embeddings`).
        original_max_position_embeddings: usize,
    },
    /// Llama 3.1 frequency-band scaling.
    Llama3 {
        /// `factor`.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: usize,
    },
    /// LongRoPE / `su` (MiniCPM): per-frequency factors, chosen once per model.
    LongRope {
        /// D/2 factors used when max ≤ original.
        short_factor: Vec<f64>,
        /// D/2 factors used when max > original.
        long_factor: Vec<f64>,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The `rope_type` string of this scaling as Hugging Face writes it.
    pub fn type_name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::LongRope { .. } => "longrope",
        }
    }
}

/// `sparse_config` with the defaults of spec §1 filled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SparseConfig {
    /// Compression window in tokens (default 32); must equal 2·kernel_stride.
    pub kernel_size: usize,
    /// Compression stride in tokens (default 16).
    pub kernel_stride: usize,
    /// Selection/transfer block in tokens (default 64).
    pub block_size: usize,
    /// Sink blocks, always attended (default 1).
    pub init_blocks: usize,
    /// Sliding window in tokens (default 1024): W = window_size/block_size blocks.
    pub window_size: usize,
    /// Attended blocks besides the W window blocks (default 48).
    pub topk: usize,
    /// Query-aware shortlist parameter (default 16): n = init_blocks + W + select_blocks.
    pub select_blocks: usize,
    /// While T < dense_len attention is dense without bias (default 0).
    pub dense_len: usize,
}

impl Default for SparseConfig {
    fn default() -> Self {
        SparseConfig {
            kernel_size: 32,
            kernel_stride: 16,
            block_size: 64,
            init_blocks: 1,
            window_size: 1024,
            topk: 48,
            select_blocks: 16,
            dense_len: 0,
        }
    }
}

impl SparseConfig {
    /// W: window blocks (window_size / block_size), spec §1 budget table.
    pub fn window_blocks(&self) -> usize {
        self.window_size / self.block_size
    }
    /// S: attended blocks per (sequence, KV head) = topk + W.
    pub fn budget_blocks(&self) -> usize {
        self.topk + self.window_blocks()
    }
    /// n: query-aware shortlist = init_blocks + W + select_blocks.
    pub fn shortlist_blocks(&self) -> usize {
        self.init_blocks + self.window_blocks() + self.select_blocks
    }
    /// Compression windows per block (block_size / kernel_stride, 4 by default).
    pub fn windows_per_block(&self) -> usize {
        self.block_size / self.kernel_stride
    }

    /// Checks the rules of spec §1 ("Validation"): kernel_size = 2·kernel_stride
    /// (both > 0); kernel_stride divides block_size; block_size divides
    /// window_size; select_blocks ≥ 1; init_blocks + select_blocks ≤ topk;
    /// and the budget S·block_size (tokens) fits in usize, so that
    /// [`SparseConfig::budget_blocks`] and the offload check cannot overflow.
    ///
    /// # Errors
    /// [`Error::Config`] for `path`, field `sparse_config.<key>`, with the numbers.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let err =
            |k: &str, msg: String| Err(Error::config(path, format!("sparse_config.{k}"), msg));
        if self.kernel_stride == 0 {
            return err("kernel_stride", "kernel_stride = 0; must be ≥ 1".into());
        }
        if self.kernel_stride.checked_mul(2) != Some(self.kernel_size) {
            return err(
                "kernel_size",
                format!(
                    "kernel_size = {} must equal 2·kernel_stride = 2·{} = {}",
                    self.kernel_size,
                    self.kernel_stride,
                    2 * self.kernel_stride as u128
                ),
            );
        }
        if self.block_size == 0 {
            return err("block_size", "block_size = 0; must be ≥ 1".into());
        }
        if !self.block_size.is_multiple_of(self.kernel_stride) {
            return err(
                "block_size",
                format!(
                    "kernel_stride = {} does not divide block_size = {}",
                    self.kernel_stride, self.block_size
                ),
            );
        }
        if !self.window_size.is_multiple_of(self.block_size) {
            return err(
                "window_size",
                format!(
                    "block_size = {} does not divide window_size = {}",
                    self.block_size, self.window_size
                ),
            );
        }
        if self.select_blocks < 1 {
            return err(
                "select_blocks",
                format!("select_blocks = {}; must be ≥ 1", self.select_blocks),
            );
        }
        if self.init_blocks as u128 + self.select_blocks as u128 > self.topk as u128 {
            return err(
                "topk",
                format!(
                    "init_blocks + select_blocks = {} + {} = {} exceeds topk = {} (the shortlist must fit in the budget)",
                    self.init_blocks,
                    self.select_blocks,
                    self.init_blocks as u128 + self.select_blocks as u128,
                    self.topk
                ),
            );
        }
        // S = topk + W blocks of block_size tokens: the slot pool, in tokens.
        let budget_tokens =
            (self.topk as u128 + self.window_blocks() as u128) * self.block_size as u128;
        if budget_tokens > usize::MAX as u128 {
            return err(
                "topk",
                format!(
                    "the budget (topk + window_size/block_size) · block_size = ({} + {}) · {} = {budget_tokens} tokens does not fit in usize",
                    self.topk,
                    self.window_blocks(),
                    self.block_size
                ),
            );
        }
        Ok(())
    }

    /// The extra rule of offload mode (spec §1): dense_len ≤ S·block_size, so
    /// that the dense phase fits the slot pool.
    ///
    /// # Errors
    /// [`Error::Config`] for `path`, field `sparse_config.dense_len`, with the numbers.
    pub fn validate_offload(&self, path: &Path) -> Result<()> {
        let cap = self.budget_blocks() * self.block_size;
        if self.dense_len > cap {
            return Err(Error::config(
                path,
                "sparse_config.dense_len",
                format!(
                    "dense_len = {} exceeds S·block_size = {}·{} = {} tokens (offload mode: the dense phase must fit the slot pool)",
                    self.dense_len,
                    self.budget_blocks(),
                    self.block_size,
                    cap
                ),
            ));
        }
        Ok(())
    }

    /// `sparse_config` as a JSON object (every key written).
    pub fn to_json_value(&self) -> Value {
        serde_json::json!({
            "kernel_size": self.kernel_size,
            "kernel_stride": self.kernel_stride,
            "block_size": self.block_size,
            "init_blocks": self.init_blocks,
            "window_size": self.window_size,
            "topk": self.topk,
            "select_blocks": self.select_blocks,
            "dense_len": self.dense_len,
        })
    }
}

/// Which attention the model runs (spec §1, "Which attention a model gets").
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AttentionMode {
    /// All tokens, no bias.
    Dense,
    /// NOSA: query-aware shortlist + eviction-score selection, additive bias.
    Nosa,
    /// InfLLM-V2: query-aware selection only, no bias.
    InfLlmV2,
}

/// Everything the runtime reads from `config.json` (+ `generation_config.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    /// d.
    pub hidden_size: usize,
    /// H.
    pub num_attention_heads: usize,
    /// Hkv.
    pub num_key_value_heads: usize,
    /// D (`head_dim` if present, else d/H).
    pub head_dim: usize,
    /// I.
    pub intermediate_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// V.
    pub vocab_size: usize,
    /// L.
    pub num_hidden_layers: usize,
    /// Maximum context in tokens.
    pub max_position_embeddings: usize,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v/o (and eviction δ) carry biases.
    pub attention_bias: bool,
    /// gate/up/down carry biases.
    pub mlp_bias: bool,
    /// BOS id, if any.
    pub bos_token_id: Option<u32>,
    /// Stop ids (config.json's `eos_token_id`, int or list, plus generation_config.json's).
    pub eos_token_ids: Vec<u32>,
    /// muP scalings (MiniCPM-style), if present.
    pub mup: Option<Mup>,
    /// `sparse_config` as written (defaults filled), if present.
    pub sparse: Option<SparseConfig>,
    /// config.json's `sliding_window` when it is enabled (Mistral-style):
    /// the runtime has no sliding-window attention, so it is accepted only
    /// while it is ≥ `max_position_embeddings` (full attention), also after
    /// [`ModelConfig::with_max_position`]. `None` when absent, null or
    /// `use_sliding_window = false`.
    pub sliding_window: Option<usize>,
}

/// Reads typed values out of one JSON object, naming `prefix + key` in errors.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }
    fn err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::config(self.path, self.name(key), msg)
    }
    /// The value of `key`, `None` when absent or `null`.
    fn raw(&self, key: &str) -> Option<&'a Value> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    fn has(&self, key: &str) -> bool {
        self.raw(key).is_some()
    }
    fn usize_of(&self, key: &str, v: &Value) -> Result<usize> {
        if let Some(u) = v.as_u64() {
            return usize::try_from(u)
                .map_err(|_| self.err(key, format!("{u} does not fit in usize")));
        }
        if let Some(f) = v.as_f64() {
            if f >= 0.0 && f.fract() == 0.0 && f < 1e15 {
                return Ok(f as usize);
            }
        }
        Err(self.err(key, format!("expected a non-negative integer, found {v}")))
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.raw(key).map(|v| self.usize_of(key, v)).transpose()
    }
    fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(key, "required field is missing"))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.raw(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a number, found {v}"))),
        }
    }
    fn req_f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?
            .ok_or_else(|| self.err(key, "required field is missing"))
    }
    /// `v`, the value of `key`, as the f32 the runtime computes with: it
    /// must be positive and finite, also once rounded to f32 (1e-50 would
    /// become 0, 1e50 infinity).
    fn positive_f32(&self, key: &str, v: f64) -> Result<f32> {
        if !(v > 0.0 && v.is_finite()) {
            return Err(self.err(key, format!("must be a positive finite number, found {v}")));
        }
        let x = v as f32;
        if !(x > 0.0 && x.is_finite()) {
            return Err(self.err(
                key,
                format!(
                    "{v:e} is {x} in f32, the precision the runtime computes in \
                     (positive finite f32 values: {:e} to {:e})",
                    f32::from_bits(1),
                    f32::MAX
                ),
            ));
        }
        Ok(x)
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.raw(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected true or false, found {v}"))),
        }
    }
    fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.raw(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, found {v}"))),
        }
    }
    fn req_f64_list(&self, key: &str) -> Result<Vec<f64>> {
        let v = self
            .raw(key)
            .ok_or_else(|| self.err(key, "required field is missing"))?;
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, format!("expected a list of numbers, found {v}")))?;
        arr.iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_f64().ok_or_else(|| {
                    self.err(key, format!("element {i}: expected a number, found {x}"))
                })
            })
            .collect()
    }
    /// A token id or a list of token ids (e.g. `eos_token_id`); empty when absent.
    fn id_list(&self, key: &str) -> Result<Vec<u32>> {
        let one = |v: &Value| -> Result<u32> {
            v.as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or_else(|| self.err(key, format!("expected a token id (u32), found {v}")))
        };
        match self.raw(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
    fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(self.err(key, format!("expected an object, found {v}"))),
        }
    }
}

/// Parses `text` as a JSON object, naming `path` and the serde message (with line
/// and column) on failure.
fn parse_object(text: &str, path: &Path) -> Result<Map<String, Value>> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| Error::config(path, "<json>", format!("malformed JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(Error::config(
            path,
            "<json>",
            format!(
                "expected a JSON object at the top level, found {}",
                json_kind(&other)
            ),
        )),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON number holding the shortest decimal that round-trips `x` as f32
/// (so `1e-5f32` is written `1e-05`, not `9.99999974e-06`).
fn f32_json(x: f32) -> Value {
    let shortest: f64 = format!("{x}").parse().unwrap_or(f64::from(x));
    serde_json::Number::from_f64(shortest)
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

fn f64_json(x: f64) -> Value {
    serde_json::Number::from_f64(x)
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

/// The `model_type` values this runtime was written for (Llama layout;
/// MiniCPM's muP scalings). Others load, with a warning.
pub const KNOWN_MODEL_TYPES: &[&str] = &["llama", "mistral", "minicpm"];

/// The `architectures` entries this runtime was written for. Others load,
/// with a warning.
pub const KNOWN_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MiniCPMForCausalLM",
];

/// The one-line warning for a config whose `model_type` or `architectures`
/// this runtime has not seen (`None` when every given name is in
/// [`KNOWN_MODEL_TYPES`] / [`KNOWN_ARCHITECTURES`], or none is given). Such
/// configs are not refused — NOSA checkpoints may use new names — but the
/// names are reported, since the runtime loads them as Llama-layout models.
pub fn architecture_warning(
    path: &Path,
    model_type: Option<&str>,
    architectures: &[String],
) -> Option<String> {
    let mut unseen = Vec::new();
    if let Some(t) = model_type.filter(|t| !KNOWN_MODEL_TYPES.contains(t)) {
        unseen.push(format!("model_type `{t}`"));
    }
    let archs: Vec<&str> = architectures
        .iter()
        .map(String::as_str)
        .filter(|a| !KNOWN_ARCHITECTURES.contains(a))
        .collect();
    if !archs.is_empty() {
        unseen.push(format!("architectures [{}]", archs.join(", ")));
    }
    if unseen.is_empty() {
        return None;
    }
    Some(format!(
        "{}: {} not seen by this runtime (it knows model_type {} and architectures {}); loading it as a Llama-layout model",
        path.display(),
        unseen.join(" and "),
        KNOWN_MODEL_TYPES.join(", "),
        KNOWN_ARCHITECTURES.join(", ")
    ))
}

impl ModelConfig {
    /// G = H / Hkv.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Reads `config.json` from `path` (a checkpoint directory, or the path of
    /// the config file itself) and, when it exists beside it,
    /// `generation_config.json`: its `eos_token_id` (int or list) adds stop ids,
    /// its `bos_token_id` replaces config.json's (as Hugging Face `generate` does).
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when `config.json` (or an existing
    /// `generation_config.json`) cannot be read; [`Error::Config`] as in
    /// [`ModelConfig::from_json_str`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<ModelConfig> {
        let path = path.as_ref();
        // A path that is not a file is taken as a model directory, so a
        // missing directory is reported as its missing config.json.
        let config_path: PathBuf = if path.is_file() {
            path.to_path_buf()
        } else {
            path.join("config.json")
        };
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let mut cfg = Self::from_json_str(&text, &config_path)?;
        let gen_path = config_path.with_file_name("generation_config.json");
        if gen_path.is_file() {
            let gtext = std::fs::read_to_string(&gen_path).map_err(|e| Error::io(&gen_path, e))?;
            cfg.apply_generation_config(&gtext, &gen_path)?;
        }
        Ok(cfg)
    }

    /// Merges a `generation_config.json` text: extra stop ids (deduplicated, in
    /// order), and its BOS id when present.
    ///
    /// # Errors
    /// [`Error::Config`] naming `path` for malformed JSON or ids out of range
    /// (≥ `vocab_size`).
    pub fn apply_generation_config(&mut self, text: &str, path: &Path) -> Result<()> {
        let map = parse_object(text, path)?;
        let f = Fields {
            map: &map,
            prefix: "",
            path,
        };
        for id in f.id_list("eos_token_id")? {
            self.check_token_id(id, "eos_token_id", path)?;
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
        if let Some(b) = f.id_list("bos_token_id")?.first().copied() {
            self.check_token_id(b, "bos_token_id", path)?;
            self.bos_token_id = Some(b);
        }
        Ok(())
    }

    fn check_token_id(&self, id: u32, field: &str, path: &Path) -> Result<()> {
        if id as usize >= self.vocab_size {
            return Err(Error::config(
                path,
                field,
                format!(
                    "token id {id} is outside the vocabulary (vocab_size = {})",
                    self.vocab_size
                ),
            ));
        }
        Ok(())
    }

    /// Parses the text of a `config.json`; `path` only names the file in errors.
    ///
    /// Required: `hidden_size`, `num_attention_heads`, `num_hidden_layers`,
    /// `intermediate_size`, `vocab_size`, `rms_norm_eps`,
    /// `max_position_embeddings`. Defaults as in Hugging Face: Hkv = H,
    /// D = d/H (d must then divide by H), θ = 10,000, no biases,
    /// `tie_word_embeddings` false (true for `model_type` `minicpm`, as
    /// MiniCPM's config class defaults), no BOS/EOS. RoPE from
    /// `rope_parameters` (transformers 5) when it names a type, else
    /// `rope_scaling`; `rope_theta` from `rope_parameters` first, then the top
    /// level. `sparse_config`: missing keys take [`SparseConfig::default`],
    /// then [`SparseConfig::validate`].
    ///
    /// # Errors
    /// [`Error::Config`] naming the key: malformed JSON (serde's message with
    /// line and column, field `<json>`), a missing required key, a wrong type,
    /// zero sizes, H not divisible by Hkv, odd D, `hidden_act` other than silu,
    /// an unknown RoPE type (named), LongRoPE factor lists of length ≠ D/2,
    /// non-positive factors, `rms_norm_eps` or a muP scale that is 0 or
    /// infinite once rounded to f32, token ids ≥ V, every sparse rule of spec §1, and
    /// a feature the runtime does not implement: `sliding_window` below
    /// `max_position_embeddings` (unless `use_sliding_window` is false).
    /// A `model_type` or `architectures` outside [`KNOWN_MODEL_TYPES`] /
    /// [`KNOWN_ARCHITECTURES`] is not an error: it is named in one warning
    /// ([`architecture_warning`]).
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<ModelConfig> {
        let path = path.as_ref();
        let map = parse_object(text, path)?;
        let f = Fields {
            map: &map,
            prefix: "",
            path,
        };

        let hidden_size = f.req_usize("hidden_size")?;
        let num_attention_heads = f.req_usize("num_attention_heads")?;
        let num_hidden_layers = f.req_usize("num_hidden_layers")?;
        let intermediate_size = f.req_usize("intermediate_size")?;
        let vocab_size = f.req_usize("vocab_size")?;
        let max_position_embeddings = f.req_usize("max_position_embeddings")?;
        let rms_norm_eps = f.req_f64("rms_norm_eps")?;
        for (k, v) in [
            ("hidden_size", hidden_size),
            ("num_attention_heads", num_attention_heads),
            ("num_hidden_layers", num_hidden_layers),
            ("intermediate_size", intermediate_size),
            ("vocab_size", vocab_size),
            ("max_position_embeddings", max_position_embeddings),
        ] {
            if v == 0 {
                return Err(f.err(k, "must be ≥ 1, found 0"));
            }
        }
        let rms_norm_eps = f.positive_f32("rms_norm_eps", rms_norm_eps)?;
        let num_key_value_heads = f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 {
            return Err(f.err("num_key_value_heads", "must be ≥ 1, found 0"));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "num_attention_heads = {num_attention_heads} is not divisible by num_key_value_heads = {num_key_value_heads}"
                ),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.err(
                        "head_dim",
                        format!(
                            "absent, and hidden_size = {hidden_size} is not divisible by num_attention_heads = {num_attention_heads}"
                        ),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.err(
                "head_dim",
                format!("must be even and ≥ 2 (RoPE pairs), found {head_dim}"),
            ));
        }
        if let Some(act) = f.opt_str("hidden_act")? {
            if act != "silu" && act != "swish" {
                return Err(f.err(
                    "hidden_act",
                    format!("unsupported activation `{act}` (only silu)"),
                ));
            }
        }
        if let Some(p) = f.opt_f64("partial_rotary_factor")? {
            if p != 1.0 {
                return Err(f.err(
                    "partial_rotary_factor",
                    format!("partial RoPE is unsupported (found {p}, need 1)"),
                ));
            }
        }

        // RoPE: transformers-5 `rope_parameters` first, then `rope_theta` / `rope_scaling`.
        let rope_params = f.object("rope_parameters")?;
        let rope_params = rope_params.filter(|m| !m.is_empty());
        let mut rope_theta = None;
        if let Some(rp) = rope_params {
            rope_theta = Fields {
                map: rp,
                prefix: "rope_parameters.",
                path,
            }
            .opt_f64("rope_theta")?;
        }
        if rope_theta.is_none() {
            rope_theta = f.opt_f64("rope_theta")?;
        }
        let rope_theta = rope_theta.unwrap_or(10_000.0);
        if !(rope_theta > 0.0 && rope_theta.is_finite()) {
            return Err(f.err(
                "rope_theta",
                format!("must be a positive finite number, found {rope_theta}"),
            ));
        }
        let top_orig = f.opt_usize("original_max_position_embeddings")?;
        let scaling_src = match rope_params {
            Some(rp) if rp.contains_key("rope_type") || rp.contains_key("type") => {
                Some((rp, "rope_parameters."))
            }
            _ => f
                .object("rope_scaling")?
                .filter(|m| !m.is_empty())
                .map(|m| (m, "rope_scaling.")),
        };
        let rope_scaling = match scaling_src {
            None => RopeScaling::Default,
            Some((m, prefix)) => parse_rope_scaling(
                &Fields {
                    map: m,
                    prefix,
                    path,
                },
                head_dim,
                max_position_embeddings,
                top_orig,
            )?,
        };

        let mut sliding_window = None;
        if let Some(w) = f.raw("sliding_window") {
            let w = f.usize_of("sliding_window", w)?;
            let enabled = f.opt_bool("use_sliding_window")?.unwrap_or(true);
            if enabled {
                sliding_window = Some(w);
            }
            if enabled && w < max_position_embeddings {
                return Err(f.err(
                    "sliding_window",
                    format!(
                        "sliding-window attention is not implemented: sliding_window = {w} < max_position_embeddings = {max_position_embeddings} \
                         (null, or a value ≥ max_position_embeddings, or use_sliding_window = false means full attention)"
                    ),
                ));
            }
        }
        let model_type = f.opt_str("model_type")?;
        let architectures: Vec<String> = match f.raw("architectures") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
                .collect(),
            Some(other) => vec![other.to_string()],
        };
        if let Some(note) = architecture_warning(path, model_type, &architectures) {
            tracing::warn!("{note}");
        }
        let model_type = model_type.unwrap_or("");
        let tie_default = model_type.eq_ignore_ascii_case("minicpm");
        let tie_word_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(tie_default);
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        let mlp_bias = f.opt_bool("mlp_bias")?.unwrap_or(false);

        let bos_token_id = f.id_list("bos_token_id")?.first().copied();
        let mut eos_token_ids: Vec<u32> = Vec::new();
        for id in f.id_list("eos_token_id")? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        let mup = if f.has("scale_emb") || f.has("scale_depth") || f.has("dim_model_base") {
            let scale_emb = f.opt_f64("scale_emb")?.unwrap_or(1.0);
            let scale_depth = f.opt_f64("scale_depth")?;
            let dim_model_base = f.opt_f64("dim_model_base")?.unwrap_or(hidden_size as f64);
            Some(Mup {
                scale_emb: f.positive_f32("scale_emb", scale_emb)?,
                scale_depth: scale_depth
                    .map(|v| f.positive_f32("scale_depth", v))
                    .transpose()?,
                dim_model_base: f.positive_f32("dim_model_base", dim_model_base)?,
            })
        } else {
            None
        };

        let sparse = match f.object("sparse_config")? {
            None => None,
            Some(m) => {
                let s = Fields {
                    map: m,
                    prefix: "sparse_config.",
                    path,
                };
                let d = SparseConfig::default();
                let sc = SparseConfig {
                    kernel_size: s.opt_usize("kernel_size")?.unwrap_or(d.kernel_size),
                    kernel_stride: s.opt_usize("kernel_stride")?.unwrap_or(d.kernel_stride),
                    block_size: s.opt_usize("block_size")?.unwrap_or(d.block_size),
                    init_blocks: s.opt_usize("init_blocks")?.unwrap_or(d.init_blocks),
                    window_size: s.opt_usize("window_size")?.unwrap_or(d.window_size),
                    topk: s.opt_usize("topk")?.unwrap_or(d.topk),
                    select_blocks: s.opt_usize("select_blocks")?.unwrap_or(d.select_blocks),
                    dense_len: s.opt_usize("dense_len")?.unwrap_or(d.dense_len),
                };
                sc.validate(path)?;
                Some(sc)
            }
        };

        let cfg = ModelConfig {
            hidden_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size,
            rms_norm_eps,
            vocab_size,
            num_hidden_layers,
            max_position_embeddings,
            rope_theta,
            rope_scaling,
            tie_word_embeddings,
            attention_bias,
            mlp_bias,
            bos_token_id,
            eos_token_ids,
            mup,
            sparse,
            sliding_window,
        };
        if let Some(b) = cfg.bos_token_id {
            cfg.check_token_id(b, "bos_token_id", path)?;
        }
        for &e in &cfg.eos_token_ids {
            cfg.check_token_id(e, "eos_token_id", path)?;
        }
        Ok(cfg)
    }

    /// Checks a config built in code (synthetic presets, tests) with the same
    /// rules as [`ModelConfig::from_json_str`], by writing and re-reading it.
    ///
    /// # Errors
    /// [`Error::Config`] naming `path_for_errors` and the key at fault.
    pub fn validate(&self, path_for_errors: &Path) -> Result<()> {
        let text = self.to_json_value().to_string();
        let back = Self::from_json_str(&text, path_for_errors)?;
        if back != *self {
            return Err(Error::config(
                path_for_errors,
                "<config>",
                "the config does not survive a config.json round trip (a value is not representable)",
            ));
        }
        Ok(())
    }

    /// The config as a Hugging Face style `config.json` object (Llama layout,
    /// `model_type` `minicpm` when muP is set), which
    /// [`ModelConfig::from_json_str`] reads back to an equal config.
    pub fn to_json_value(&self) -> Value {
        let mut m = Map::new();
        let is_mup = self.mup.is_some();
        m.insert(
            "architectures".into(),
            Value::from(vec![if is_mup {
                "MiniCPMForCausalLM"
            } else {
                "LlamaForCausalLM"
            }]),
        );
        m.insert(
            "model_type".into(),
            Value::from(if is_mup { "minicpm" } else { "llama" }),
        );
        m.insert("hidden_size".into(), Value::from(self.hidden_size));
        m.insert(
            "num_attention_heads".into(),
            Value::from(self.num_attention_heads),
        );
        m.insert(
            "num_key_value_heads".into(),
            Value::from(self.num_key_value_heads),
        );
        m.insert("head_dim".into(), Value::from(self.head_dim));
        m.insert(
            "intermediate_size".into(),
            Value::from(self.intermediate_size),
        );
        m.insert("hidden_act".into(), Value::from("silu"));
        m.insert("rms_norm_eps".into(), f32_json(self.rms_norm_eps));
        m.insert("vocab_size".into(), Value::from(self.vocab_size));
        m.insert(
            "num_hidden_layers".into(),
            Value::from(self.num_hidden_layers),
        );
        m.insert(
            "max_position_embeddings".into(),
            Value::from(self.max_position_embeddings),
        );
        m.insert("rope_theta".into(), f64_json(self.rope_theta));
        let scaling = match &self.rope_scaling {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "dynamic", "factor": factor,
                "original_max_position_embeddings": original_max_position_embeddings}),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                serde_json::json!({
                    "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings})
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "longrope", "short_factor": short_factor, "long_factor": long_factor,
                "original_max_position_embeddings": original_max_position_embeddings}),
        };
        m.insert("rope_scaling".into(), scaling);
        if let Some(w) = self.sliding_window {
            m.insert("sliding_window".into(), Value::from(w));
        }
        m.insert(
            "tie_word_embeddings".into(),
            Value::from(self.tie_word_embeddings),
        );
        m.insert("attention_bias".into(), Value::from(self.attention_bias));
        m.insert("mlp_bias".into(), Value::from(self.mlp_bias));
        m.insert(
            "bos_token_id".into(),
            self.bos_token_id.map(Value::from).unwrap_or(Value::Null),
        );
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => Value::from(*one),
            many => Value::from(many.to_vec()),
        };
        m.insert("eos_token_id".into(), eos);
        if let Some(mup) = &self.mup {
            m.insert("scale_emb".into(), f32_json(mup.scale_emb));
            if let Some(sd) = mup.scale_depth {
                m.insert("scale_depth".into(), f32_json(sd));
            }
            m.insert("dim_model_base".into(), f32_json(mup.dim_model_base));
        }
        if let Some(s) = &self.sparse {
            m.insert("sparse_config".into(), s.to_json_value());
        }
        m.insert("torch_dtype".into(), Value::from("bfloat16"));
        Value::Object(m)
    }

    /// Which attention this model runs (spec §1): eviction heads present →
    /// NOSA; else a `sparse_config` → InfLLM-V2; else dense.
    pub fn attention_mode(&self, eviction_heads: bool) -> AttentionMode {
        if eviction_heads {
            AttentionMode::Nosa
        } else if self.sparse.is_some() {
            AttentionMode::InfLlmV2
        } else {
            AttentionMode::Dense
        }
    }

    /// The sparse settings in force: `sparse_config` as written, or the spec §1
    /// defaults (what a NOSA checkpoint without `sparse_config` runs with).
    pub fn sparse_or_default(&self) -> SparseConfig {
        self.sparse.unwrap_or_default()
    }

    /// Embedding output factor: muP `scale_emb`, else 1.
    pub fn embed_scale(&self) -> f32 {
        self.mup.map_or(1.0, |m| m.embed_scale())
    }
    /// Residual-branch factor: muP `scale_depth / sqrt(L)`, else 1.
    pub fn residual_scale(&self) -> f32 {
        self.mup
            .map_or(1.0, |m| m.residual_scale(self.num_hidden_layers))
    }
    /// Divisor of the final normed hidden state before `lm_head`: muP
    /// `hidden_size / dim_model_base`, else 1.
    pub fn logit_divisor(&self) -> f32 {
        self.mup.map_or(1.0, |m| m.logit_divisor(self.hidden_size))
    }
    /// 1/√D, the attention logit scale (D = `head_dim`).
    pub fn attn_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    /// The user override `--rope-theta`: the same config with RoPE base `theta`.
    pub fn with_rope_theta(mut self, theta: f64) -> Self {
        self.rope_theta = theta;
        self
    }
    /// The user override `--max-position`: the same config with context limit
    /// `n` tokens. RoPE depends on it only for LongRoPE, whose factor set and
    /// attention factor follow `max_position_embeddings` as in MiniCPM's code
    /// (so raising it past `original_max_position_embeddings` switches to the
    /// long factors, exactly as editing config.json would).
    ///
    /// Errors: [`Error::Input`] when `n` passes an enabled `sliding_window`
    /// (sliding-window attention would then apply; not implemented).
    pub fn with_max_position(mut self, n: usize) -> Result<Self> {
        if let Some(w) = self.sliding_window.filter(|&w| w < n) {
            return Err(Error::Input(format!(
                "--max-position {n}: past the model's sliding_window = {w}, where its sliding-window attention would apply (not implemented); give --max-position ≤ {w}"
            )));
        }
        self.max_position_embeddings = n;
        Ok(self)
    }

    /// The RoPE tables of this config (spec §1, NeoX layout).
    pub fn rope(&self) -> Rope {
        Rope::new(
            self.head_dim,
            self.rope_theta,
            self.max_position_embeddings,
            self.rope_scaling.clone(),
        )
    }
}

fn parse_rope_scaling(
    f: &Fields<'_>,
    head_dim: usize,
    max_pos: usize,
    top_orig: Option<usize>,
) -> Result<RopeScaling> {
    let (ty, ty_key) = match f.opt_str("rope_type")? {
        Some(t) => (t, "rope_type"),
        None => (f.opt_str("type")?.unwrap_or("default"), "type"),
    };
    let positive = |k: &str| -> Result<f64> {
        let v = f.req_f64(k)?;
        if !(v > 0.0 && v.is_finite()) {
            return Err(f.err(k, format!("must be a positive finite number, found {v}")));
        }
        Ok(v)
    };
    let orig = |default: usize| -> Result<usize> {
        let o = f
            .opt_usize("original_max_position_embeddings")?
            .unwrap_or(default);
        if o == 0 {
            return Err(f.err("original_max_position_embeddings", "must be ≥ 1, found 0"));
        }
        Ok(o)
    };
    Ok(match ty {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: positive("factor")? },
        "dynamic" => RopeScaling::Dynamic { factor: positive("factor")?, original_max_position_embeddings: orig(max_pos)? },
        "llama3" => {
            let low = positive("low_freq_factor")?;
            let high = positive("high_freq_factor")?;
            if high <= low {
                return Err(f.err(
                    "high_freq_factor",
                    format!("high_freq_factor = {high} must exceed low_freq_factor = {low}"),
                ));
            }
            RopeScaling::Llama3 {
                factor: positive("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: orig(max_pos)?,
            }
        }
        "longrope" | "su" => {
            let short_factor = f.req_f64_list("short_factor")?;
            let long_factor = f.req_f64_list("long_factor")?;
            for (k, list) in [("short_factor", &short_factor), ("long_factor", &long_factor)] {
                if list.len() != head_dim / 2 {
                    return Err(f.err(
                        k,
                        format!("has {} values; need head_dim/2 = {}/2 = {}", list.len(), head_dim, head_dim / 2),
                    ));
                }
                if let Some((i, v)) = list.iter().enumerate().find(|(_, v)| !(**v > 0.0 && v.is_finite())) {
                    return Err(f.err(k, format!("element {i} = {v}; factors must be positive and finite")));
                }
            }
            // Phi-3 style: a top-level `original_max_position_embeddings` wins (as in transformers).
            let o = match top_orig {
                Some(o) if o > 0 => o,
                _ => orig(max_pos)?,
            };
            RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings: o }
        }
        other => {
            return Err(f.err(
                ty_key,
                format!("unknown RoPE type `{other}` (supported: default, linear, dynamic, llama3, longrope, su)"),
            ))
        }
    })
}

/// RoPE tables for one model (spec §1): inverse frequencies, the LongRoPE
/// attention factor, and cos/sin per position. NeoX (rotate-half) layout: the
/// D/2 values of [`Rope::cos_sin`] apply to dims `i` and `i + D/2`.
///
/// Arithmetic follows transformers: inverse frequencies in f32 as
/// `1 / θ^(2i/D)`, angle `f32(pos) · inv_freq` in f32, cos/sin in f32, times
/// the attention factor.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    head_dim: usize,
    theta: f64,
    max_position: usize,
    scaling: RopeScaling,
    /// inv_freq for every sequence length (all types but dynamic past the original maximum).
    base_inv_freq: Vec<f32>,
    attention_factor: f32,
}

/// `1 / base^(2i/D)` for i < D/2, in f32 as transformers computes it.
fn plain_inv_freq(base: f64, head_dim: usize) -> Vec<f32> {
    let b = base as f32;
    (0..head_dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / head_dim as f32;
            1.0f32 / b.powf(e)
        })
        .collect()
}

impl Rope {
    /// RoPE for head dim `head_dim` (even), base `theta`, the model's
    /// `max_position` (LongRoPE's factor choice) and `scaling`.
    pub fn new(head_dim: usize, theta: f64, max_position: usize, scaling: RopeScaling) -> Rope {
        let half = head_dim / 2;
        let mut attention_factor = 1.0f32;
        let base_inv_freq = match &scaling {
            RopeScaling::Default | RopeScaling::Dynamic { .. } => plain_inv_freq(theta, head_dim),
            RopeScaling::Linear { factor } => {
                let fct = *factor as f32;
                plain_inv_freq(theta, head_dim)
                    .into_iter()
                    .map(|x| x / fct)
                    .collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let inv = plain_inv_freq(theta, head_dim);
                let old = *original_max_position_embeddings as f64;
                let low_wl = (old / low_freq_factor) as f32;
                let high_wl = (old / high_freq_factor) as f32;
                let fct = *factor as f32;
                let lo = *low_freq_factor as f32;
                let hi = *high_freq_factor as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let old32 = old as f32;
                inv.into_iter()
                    .map(|x| {
                        let wavelen = two_pi / x;
                        let scaled = if wavelen > low_wl { x / fct } else { x };
                        // wavelen is finite (inv_freq > 0), so this is transformers' ~(< high) & ~(> low).
                        let medium = wavelen >= high_wl && wavelen <= low_wl;
                        if medium {
                            let smooth = (old32 / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * scaled / fct + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
            } => {
                let orig = *original_max_position_embeddings;
                let ext = if max_position > orig {
                    long_factor
                } else {
                    short_factor
                };
                if max_position > orig {
                    let ratio = max_position as f64 / orig as f64;
                    attention_factor = (1.0 + ratio.ln() / (orig as f64).ln()).sqrt() as f32;
                }
                let b = theta as f32;
                (0..half)
                    .map(|i| {
                        let e = (2 * i) as f32 / head_dim as f32;
                        let f = ext.get(i).copied().unwrap_or(1.0) as f32;
                        1.0f32 / (f * b.powf(e))
                    })
                    .collect()
            }
        };
        Rope {
            head_dim,
            theta,
            max_position,
            scaling,
            base_inv_freq,
            attention_factor,
        }
    }

    /// D.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The D/2 inverse frequencies (radians per position) for a sequence of
    /// `seq_len` tokens. Only dynamic NTK depends on `seq_len`: past the
    /// original maximum `orig` the base becomes
    /// θ·((factor·seq_len/orig) − (factor−1))^(D/(D−2)) (in f64, then the
    /// inverse frequencies in f32 as usual; transformers does the same for the
    /// longest sequence seen, and decode lengths only grow).
    pub fn inv_freq(&self, seq_len: usize) -> Vec<f32> {
        match &self.scaling {
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } if seq_len > *original_max_position_embeddings => {
                let d = self.head_dim as f64;
                let ratio = factor * seq_len as f64 / *original_max_position_embeddings as f64
                    - (factor - 1.0);
                let base = self.theta * ratio.powf(d / (d - 2.0));
                plain_inv_freq(base, self.head_dim)
            }
            _ => self.base_inv_freq.clone(),
        }
    }

    /// Factor multiplying cos and sin: 1, except LongRoPE with
    /// max > orig: √(1 + ln(max/orig) / ln(orig)) (spec §1).
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// Fills `cos` and `sin` (each at least D/2 long; the first D/2 entries are
    /// written) for position `pos` of a sequence of `seq_len` tokens:
    /// `cos(f32(pos)·inv_freq[i]) · attention_factor`, likewise sin.
    ///
    /// # Panics
    /// If `cos` or `sin` is shorter than D/2 (a caller bug, not bad input).
    pub fn cos_sin(&self, pos: usize, seq_len: usize, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.head_dim / 2;
        let dynamic;
        let inv: &[f32] = match &self.scaling {
            RopeScaling::Dynamic {
                original_max_position_embeddings,
                ..
            } if seq_len > *original_max_position_embeddings => {
                dynamic = self.inv_freq(seq_len);
                &dynamic
            }
            _ => &self.base_inv_freq,
        };
        let p = pos as f32;
        let af = self.attention_factor;
        for i in 0..half {
            let a = p * inv[i];
            cos[i] = a.cos() * af;
            sin[i] = a.sin() * af;
        }
    }

    /// The model's `max_position_embeddings` this table was built for.
    pub fn max_position(&self) -> usize {
        self.max_position
    }
}
