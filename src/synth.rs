//! Synthetic checkpoints: random bf16 weights of the preset shapes of
//! spec/nosa-model.md §1, deterministic from a seed, for tests and benchmarks.
//!
//! Presets: [`Preset::Tiny`] (CI-sized, a small sparse budget so selection
//! really drops blocks at a few hundred tokens), [`Preset::Nosa1b`],
//! [`Preset::Nosa3b`] (Llama-3 style) and [`Preset::Nosa8b`] (MiniCPM muP,
//! ≈ 8.19 B parameters). Every preset has NOSA eviction heads and untied
//! embeddings, and uses the ids of the SmolLM2 fixture tokenizer (BOS
//! [`BOS_ID`], EOS [`EOS_ID`]).
//!
//! Weight scales keep activations of order 1 through every layer, with muP
//! factors compensated so that a muP model behaves like a plain one:
//! - embedding N(0, 1/scale_emb²);
//! - q/k/v/gate/up N(0, 1/d); o_proj N(0, 1/(H·D)) and down_proj N(0, 1/I),
//!   both further divided by √(2L)·residual_scale;
//! - RMSNorm weights 1 + 0.1·N(0,1) (not exactly 1, so a backend that ignores
//!   them is caught);
//! - eviction head A uniform in [−1.5, −0.5), δ N(0, 1/(Hkv·D)), so that the
//!   eviction score c varies across tokens; biases N(0, 0.02²) (δ bias N(0, 0.1²));
//! - lm_head N(0, (d/dim_model_base)²/d), so logits are about N(0, 1).
//!
//! Each tensor is generated in chunks of [`CHUNK`] elements; chunk `c` of
//! tensor `name` draws from a `SmallRng` seeded by (seed, hash(name), c), so the
//! values depend only on the seed and the name, never on thread count or order.

use std::path::Path;

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::config::{ModelConfig, Mup, RopeScaling, SparseConfig};
use crate::error::{Error, Result};
use crate::weights::{
    expected_tensors, names, write_safetensors, Checkpoint, DType, OwnedTensor, TensorStore,
    INDEX_FILE, SINGLE_FILE,
};

/// BOS id of synthetic models (SmolLM2 fixture tokenizer: `<|im_start|>`).
pub const BOS_ID: u32 = 1;
/// EOS id of synthetic models (SmolLM2 fixture tokenizer: `<|im_end|>`).
pub const EOS_ID: u32 = 2;
/// Elements per independently seeded chunk of a tensor.
pub const CHUNK: usize = 1 << 16;
/// Largest shard [`write()`] produces, in bytes (2 GiB); checkpoints above it are sharded.
pub const SHARD_BYTES: usize = 2 << 30;

/// A synthetic model shape (spec §1 preset table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// L 2, d 192, H 6 / Hkv 2 (G 3), D 64, I 512, V 49,152, max pos 32,768;
    /// sparse budget: kernel 32/16, block 64, init 1, window 128 (W 2), topk 4
    /// (S 6 blocks = 384 tokens), select 2 (n 5).
    Tiny,
    /// Llama-3 style: L 28, d 2048, H 16 / Hkv 2, D 128, I 6144, V 73,448.
    Nosa1b,
    /// Llama-3 style: L 32, d 2560, H 32 / Hkv 2, D 80, I 6912, V 73,448.
    Nosa3b,
    /// MiniCPM4 style (muP 12 / 1.4 / 256, eps 1e-6): L 32, d 4096, H 32 / Hkv 2,
    /// D 128, I 16,384, V 73,448; ≈ 8.19 B parameters.
    Nosa8b,
}

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 4] = [Preset::Tiny, Preset::Nosa1b, Preset::Nosa3b, Preset::Nosa8b];

    /// The CLI name: `tiny`, `nosa-1b`, `nosa-3b`, `nosa-8b`.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Nosa1b => "nosa-1b",
            Preset::Nosa3b => "nosa-3b",
            Preset::Nosa8b => "nosa-8b",
        }
    }

    /// The preset called `name` (see [`Preset::name`]).
    ///
    /// # Errors
    /// [`Error::Input`] naming the unknown preset and listing the valid ones.
    pub fn from_name(name: &str) -> Result<Preset> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| {
                let valid: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
                Error::Input(format!(
                    "unknown synthetic preset `{name}` (valid: {})",
                    valid.join(", ")
                ))
            })
    }

    /// The preset's config (spec §1 table; BOS [`BOS_ID`], EOS [`EOS_ID`],
    /// untied embeddings, default RoPE).
    pub fn config(self) -> ModelConfig {
        let llama = |l, d, h, hkv, dh, i| ModelConfig {
            hidden_size: d,
            num_attention_heads: h,
            num_key_value_heads: hkv,
            head_dim: dh,
            intermediate_size: i,
            rms_norm_eps: 1e-5,
            vocab_size: 73_448,
            num_hidden_layers: l,
            max_position_embeddings: 131_072,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::Default,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: Some(BOS_ID),
            eos_token_ids: vec![EOS_ID],
            mup: None,
            sparse: Some(SparseConfig::default()),
            sliding_window: None,
        };
        match self {
            Preset::Tiny => ModelConfig {
                vocab_size: 49_152,
                max_position_embeddings: 32_768,
                sparse: Some(SparseConfig {
                    kernel_size: 32,
                    kernel_stride: 16,
                    block_size: 64,
                    init_blocks: 1,
                    window_size: 128,
                    topk: 4,
                    select_blocks: 2,
                    dense_len: 0,
                }),
                ..llama(2, 192, 6, 2, 64, 512)
            },
            Preset::Nosa1b => llama(28, 2048, 16, 2, 128, 6144),
            Preset::Nosa3b => llama(32, 2560, 32, 2, 80, 6912),
            Preset::Nosa8b => ModelConfig {
                rms_norm_eps: 1e-6,
                mup: Some(Mup {
                    scale_emb: 12.0,
                    scale_depth: Some(1.4),
                    dim_model_base: 256.0,
                }),
                ..llama(32, 4096, 32, 2, 128, 16_384)
            },
        }
    }
}

impl std::str::FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Preset> {
        Preset::from_name(s)
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one tensor's values are drawn.
#[derive(Debug, Clone, Copy)]
enum Init {
    /// mean + std·N(0,1).
    Normal { mean: f32, std: f32 },
    /// Uniform in [lo, hi).
    Uniform { lo: f32, hi: f32 },
}

/// The init rule for tensor `name` of `cfg` (see the module doc).
fn init_for(cfg: &ModelConfig, name: &str) -> Init {
    let d = cfg.hidden_size as f32;
    let l = cfg.num_hidden_layers as f32;
    let branch = 1.0 / ((2.0 * l).sqrt() * cfg.residual_scale());
    let normal = |std: f32| Init::Normal { mean: 0.0, std };
    if name == names::embed() {
        return normal(1.0 / cfg.embed_scale());
    }
    if name == names::lm_head() {
        return normal(cfg.logit_divisor() / d.sqrt());
    }
    if name.ends_with("layernorm.weight") || name == names::final_norm() {
        return Init::Normal {
            mean: 1.0,
            std: 0.1,
        };
    }
    let suffix = name.splitn(4, '.').nth(3).unwrap_or(name);
    match suffix {
        "self_attn.q_proj.weight"
        | "self_attn.k_proj.weight"
        | "self_attn.v_proj.weight"
        | "mlp.gate_proj.weight"
        | "mlp.up_proj.weight"
        | "self_attn.q_future_proj.weight"
        | "self_attn.q_curr_proj.weight" => normal(1.0 / d.sqrt()),
        "self_attn.o_proj.weight" => {
            normal(branch / ((cfg.num_attention_heads * cfg.head_dim) as f32).sqrt())
        }
        "mlp.down_proj.weight" => normal(branch / (cfg.intermediate_size as f32).sqrt()),
        "self_attn.A" => Init::Uniform { lo: -1.5, hi: -0.5 },
        "self_attn.delta.weight" => {
            normal(1.0 / ((cfg.num_key_value_heads * cfg.head_dim) as f32).sqrt())
        }
        "self_attn.delta.bias" => normal(0.1),
        _ => normal(0.02),
    }
}

/// FNV-1a, 64 bit (stable across builds, unlike `DefaultHasher`).
fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64 finalizer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `out` (bf16 little-endian bytes of chunk `chunk`) from `init`.
fn fill_chunk(out: &mut [u8], init: Init, seed: u64, name_hash: u64, chunk: usize) {
    let mut rng = SmallRng::seed_from_u64(mix(mix(seed ^ name_hash) ^ chunk as u64));
    for c in out.chunks_exact_mut(2) {
        let v = match init {
            Init::Normal { mean, std } => {
                let z: f32 = rng.sample(StandardNormal);
                mean + std * z
            }
            Init::Uniform { lo, hi } => lo + (hi - lo) * rng.random::<f32>(),
        };
        c.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
    }
}

/// Generates tensor `name` of shape `shape` for `cfg` from `seed` (bf16),
/// using every available core for large tensors.
pub fn generate_tensor(cfg: &ModelConfig, name: &str, shape: &[usize], seed: u64) -> OwnedTensor {
    let numel: usize = shape.iter().product();
    let init = init_for(cfg, name);
    let h = fnv1a(name);
    let mut data = vec![0u8; numel * 2];
    let chunks: Vec<(usize, &mut [u8])> = data.chunks_mut(CHUNK * 2).enumerate().collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(chunks.len().max(1));
    if threads <= 1 {
        for (c, buf) in chunks {
            fill_chunk(buf, init, seed, h, c);
        }
    } else {
        let mut groups: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
        for (k, item) in chunks.into_iter().enumerate() {
            groups[k % threads].push(item);
        }
        std::thread::scope(|s| {
            for g in groups {
                s.spawn(move || {
                    for (c, buf) in g {
                        fill_chunk(buf, init, seed, h, c);
                    }
                });
            }
        });
    }
    OwnedTensor {
        name: name.to_string(),
        dtype: DType::BF16,
        shape: shape.to_vec(),
        data,
    }
}

/// Parses `PRESET[:SEED]` (the part after `synth:` in `--model synth:…`);
/// the seed defaults to 0.
///
/// Errors: an unknown preset or a seed that is not an integer, naming it.
pub fn parse_spec(spec: &str) -> Result<(Preset, u64)> {
    let (name, seed) = spec
        .split_once(':')
        .map_or((spec, None), |(n, s)| (n, Some(s)));
    let preset = Preset::from_name(name)?;
    let seed = match seed {
        Some(x) => x
            .parse::<u64>()
            .map_err(|_| Error::Input(format!("synth:PRESET:SEED: bad seed `{x}`")))?,
        None => 0,
    };
    Ok((preset, seed))
}

/// Builds preset `preset` in memory from `seed` (nothing touches disk).
/// nosa-8b needs about 16.4 GB of RAM.
///
/// # Errors
/// Only if the preset's config fails validation (a bug).
pub fn build(preset: Preset, seed: u64) -> Result<Checkpoint> {
    build_config(&preset.config(), true, seed)
}

/// Builds a synthetic model of any config in memory from `seed`, with NOSA
/// eviction heads iff `eviction_heads` (e.g. other G or D for kernel tests).
///
/// # Errors
/// [`Error::Config`] when `config` fails validation (named `<synth>`).
pub fn build_config(config: &ModelConfig, eviction_heads: bool, seed: u64) -> Result<Checkpoint> {
    config.validate(Path::new("<synth>"))?;
    let tensors: Vec<OwnedTensor> = expected_tensors(config, eviction_heads)
        .iter()
        .map(|(name, shape)| generate_tensor(config, name, shape, seed))
        .collect();
    Checkpoint::from_parts(config.clone(), TensorStore::from_tensors(tensors))
}

/// Writes preset `preset` from `seed` as a Hugging Face checkpoint in
/// `out_dir`: `config.json`, `generation_config.json`, the weights
/// (`model.safetensors`, or ~2 GiB shards with `model.safetensors.index.json`
/// when the total exceeds [`SHARD_BYTES`]) and a copy of `tokenizer_json`.
/// Tensors are generated one shard at a time, so memory stays near one shard.
/// The result loads with [`Checkpoint::open`] to the same tensors as [`build`].
///
/// # Errors
/// [`Error::Io`] naming `tokenizer_json` when it is missing (checked before
/// anything is written) or a file that cannot be written.
pub fn write(preset: Preset, seed: u64, out_dir: &Path, tokenizer_json: &Path) -> Result<()> {
    write_config(&preset.config(), true, seed, out_dir, tokenizer_json)
}

/// [`write()`] for any config (eviction heads iff `eviction_heads`).
///
/// # Errors
/// As [`write()`], plus [`Error::Config`] when `config` fails validation.
pub fn write_config(
    config: &ModelConfig,
    eviction_heads: bool,
    seed: u64,
    out_dir: &Path,
    tokenizer_json: &Path,
) -> Result<()> {
    write_config_sharded(
        config,
        eviction_heads,
        seed,
        out_dir,
        tokenizer_json,
        SHARD_BYTES,
    )
}

/// [`write_config`] with shards of at most `shard_bytes` bytes (a larger
/// tensor gets a shard of its own); sharded iff the total exceeds it.
///
/// # Errors
/// As [`write_config`].
pub fn write_config_sharded(
    config: &ModelConfig,
    eviction_heads: bool,
    seed: u64,
    out_dir: &Path,
    tokenizer_json: &Path,
    shard_bytes: usize,
) -> Result<()> {
    config.validate(Path::new("<synth>"))?;
    if !tokenizer_json.is_file() {
        return Err(Error::io(
            tokenizer_json,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "tokenizer.json to copy into the synthetic checkpoint not found",
            ),
        ));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;

    let write_json = |name: &str, v: &serde_json::Value| -> Result<()> {
        let p = out_dir.join(name);
        let text = serde_json::to_string_pretty(v).expect("JSON values serialize");
        std::fs::write(&p, text + "\n").map_err(|e| Error::io(&p, e))
    };
    write_json("config.json", &config.to_json_value())?;
    let mut gen = serde_json::Map::new();
    gen.insert(
        "bos_token_id".into(),
        config
            .bos_token_id
            .map_or(serde_json::Value::Null, serde_json::Value::from),
    );
    gen.insert(
        "eos_token_id".into(),
        match config.eos_token_ids.as_slice() {
            [] => serde_json::Value::Null,
            [one] => serde_json::Value::from(*one),
            many => serde_json::Value::from(many.to_vec()),
        },
    );
    write_json("generation_config.json", &serde_json::Value::Object(gen))?;
    let tok_dst = out_dir.join("tokenizer.json");
    std::fs::copy(tokenizer_json, &tok_dst).map_err(|e| Error::io(&tok_dst, e))?;

    // Weights: plan shards, then generate and write one shard at a time.
    let plan = expected_tensors(config, eviction_heads);
    let bytes_of = |s: &[usize]| s.iter().product::<usize>() * 2;
    let total: usize = plan.iter().map(|(_, s)| bytes_of(s)).sum();
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut cur = 0usize;
    for (name, shape) in plan {
        let b = bytes_of(&shape);
        if total > shard_bytes && cur > 0 && cur + b > shard_bytes {
            shards.push(Vec::new());
            cur = 0;
        }
        cur += b;
        shards.last_mut().expect("non-empty").push((name, shape));
    }
    // Remove stale weight files of an earlier write into the same directory.
    for stale in [SINGLE_FILE, INDEX_FILE] {
        let p = out_dir.join(stale);
        if p.exists() {
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    if shards.len() == 1 {
        let tensors: Vec<OwnedTensor> = shards[0]
            .iter()
            .map(|(n, s)| generate_tensor(config, n, s, seed))
            .collect();
        return write_safetensors(&out_dir.join(SINGLE_FILE), &tensors);
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, n);
        let tensors: Vec<OwnedTensor> = shard
            .iter()
            .map(|(nm, s)| generate_tensor(config, nm, s, seed))
            .collect();
        write_safetensors(&out_dir.join(&file), &tensors)?;
        for (nm, _) in shard {
            weight_map.insert(nm.clone(), serde_json::Value::from(file.clone()));
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    });
    write_json(INDEX_FILE, &index)
}
