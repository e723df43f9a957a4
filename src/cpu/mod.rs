//! The CPU reference backend: f32 compute on the checkpoint's (bf16) weights,
//! one sequence at a time. It is the oracle for every GPU kernel and for all
//! NOSA-specific behaviour (spec/testing.md), so it favours plain, checkable
//! code over speed: GEMMs through `matrixmultiply`, attention as written in
//! spec/nosa-model.md §5, selection through [`crate::model::select`].

pub mod ops;

use crate::config::{AttentionMode, ModelConfig, Rope};
use crate::model::forecast::ForecastWeights;
use crate::model::select::{self, Budget};
use crate::model::state::LayerKv;
use crate::model::{AttentionOverrides, AttentionPlan, PrefillMode};
use crate::weights::names::{self, LayerTensor};
use crate::weights::Checkpoint;
use crate::{Error, Result};

/// Eviction head of one layer (spec §2–§3): c[t,h] = A[h] · softplus(δ_h · v_t + b_h).
#[derive(Debug, Clone)]
struct EvictionHead {
    /// A, [Hkv].
    a: Vec<f32>,
    /// δ, [Hkv, Hkv·D].
    delta: Vec<f32>,
    /// b, [Hkv], when `attention_bias`.
    bias: Option<Vec<f32>>,
}

/// f32 weights of one decoder layer.
#[derive(Debug, Clone)]
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: (Vec<f32>, Option<Vec<f32>>),
    k: (Vec<f32>, Option<Vec<f32>>),
    v: (Vec<f32>, Option<Vec<f32>>),
    o: (Vec<f32>, Option<Vec<f32>>),
    gate: (Vec<f32>, Option<Vec<f32>>),
    up: (Vec<f32>, Option<Vec<f32>>),
    down: (Vec<f32>, Option<Vec<f32>>),
    evict: Option<EvictionHead>,
}

/// Which phase a forward call is (decides dense vs sparse prefill, spec §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The prompt, or a chunk of it; `prompt_len` is the whole prompt's length
    /// in tokens, which decides dense vs sparse (dense iff < dense_len).
    Prefill {
        /// Tokens in the whole prompt.
        prompt_len: usize,
    },
    /// One generated token (or a teacher-forced run of them), each token
    /// dense or sparse by its own length T (dense iff T < dense_len).
    Decode,
}

/// Prompt tokens per prefill forward call on the CPU (bounds the score tiles).
pub const PREFILL_CHUNK: usize = 512;

/// Which logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's, \[V\].
    Last,
    /// Every position's, [n, V].
    All,
}

/// Options of the CPU engine (runtime.md §6 flags).
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineOptions {
    /// `--attention`, `--selection`, `--budget-blocks`, `--select-blocks`.
    pub attention: AttentionOverrides,
    /// `--prefill dense|sparse`.
    pub prefill: PrefillMode,
}

/// Opt-in bf16 activation emulation of the CPU reference
/// ([`CpuModel::set_bf16_emulation`]): the points where the CUDA engine
/// (src/pipeline/ and kernels/) stores an activation in bf16, each a
/// switch, so that the reference can reproduce the engine's rounding (round
/// to nearest even, as `half::bf16::from_f32` and kernels/common.cuh
/// `f2bf`) and tell rounding error from an engine bug. Everything else stays
/// f32 as in the engine: the residual stream, attention scores and softmax,
/// the eviction score c, Kc/p, and the logits. Off (the default, `None`), the
/// reference is the plain f32 path, untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Points {
    /// `embed_gather` (kernels/embedding.cu): x = bf16(embed\[tok\] · scale_emb),
    /// the engine's layer-0 `delta`.
    pub embed: bool,
    /// Input/post-attention RMSNorm (kernels/rmsnorm.cu `rmsnorm_residual`):
    /// the normalised value bf16(x · inv) before the weight multiply (spec §7).
    pub norm_normed: bool,
    /// Input/post-attention RMSNorm: its output bf16(· w), the engine's `xn`.
    pub norm_out: bool,
    /// The fused QKV GEMM's bf16 output (`gpu.linear` into `ws.qkv`,
    /// cuBLAS bf16 C), and again after `bias_add` for biased checkpoints.
    /// NOSA's eviction score is then computed in f32 from that v, as the
    /// engine's append kernel does.
    pub qkv: bool,
    /// q and k after RoPE (kernels/kv_append.cu `qkv_rope_append`: rotated
    /// in f32, stored bf16 in `ws.qkv` and the K cache). V goes to the cache
    /// unchanged (already bf16 from the GEMM).
    pub rope: bool,
    /// Attention output (kernels/attn_combine.cu: bf16 `ws.attn`).
    pub attn_out: bool,
    /// o_proj output (`gpu.linear` into bf16 `ws.delta`, (+`bias_add`)).
    pub o_proj: bool,
    /// gate|up GEMM output (bf16 `ws.gu`, (+`bias_add`)).
    pub gate_up: bool,
    /// SwiGLU output bf16(silu(g)·u) (kernels/swiglu.cu, `ws.act`).
    pub act: bool,
    /// down_proj output (bf16 `ws.delta`, (+`bias_add`)).
    pub down: bool,
    /// Final RMSNorm: the normalised value bf16(x · inv).
    pub final_normed: bool,
    /// Final RMSNorm: its output bf16(· w′), with the muP logit divisor
    /// folded into the weight as the engine does (w′ = bf16(w / divisor)).
    pub final_out: bool,
}

impl Bf16Points {
    /// Every point on: what the CUDA engine does.
    pub const ALL: Bf16Points = Bf16Points {
        embed: true,
        norm_normed: true,
        norm_out: true,
        qkv: true,
        rope: true,
        attn_out: true,
        o_proj: true,
        gate_up: true,
        act: true,
        down: true,
        final_normed: true,
        final_out: true,
    };
    /// Every point off (the f32 path, through the emulation code).
    pub const NONE: Bf16Points = Bf16Points {
        embed: false,
        norm_normed: false,
        norm_out: false,
        qkv: false,
        rope: false,
        attn_out: false,
        o_proj: false,
        gate_up: false,
        act: false,
        down: false,
        final_normed: false,
        final_out: false,
    };
    /// The names of the points (the field names), for ablations.
    pub const NAMES: [&'static str; 12] = [
        "embed",
        "norm_normed",
        "norm_out",
        "qkv",
        "rope",
        "attn_out",
        "o_proj",
        "gate_up",
        "act",
        "down",
        "final_normed",
        "final_out",
    ];

    /// The switch named `name` (one of [`Self::NAMES`]).
    pub fn get_mut(&mut self, name: &str) -> Option<&mut bool> {
        Some(match name {
            "embed" => &mut self.embed,
            "norm_normed" => &mut self.norm_normed,
            "norm_out" => &mut self.norm_out,
            "qkv" => &mut self.qkv,
            "rope" => &mut self.rope,
            "attn_out" => &mut self.attn_out,
            "o_proj" => &mut self.o_proj,
            "gate_up" => &mut self.gate_up,
            "act" => &mut self.act,
            "down" => &mut self.down,
            "final_normed" => &mut self.final_normed,
            "final_out" => &mut self.final_out,
            _ => return None,
        })
    }

    /// These points with `name` switched to `on`; `None` for an unknown name.
    pub fn with(mut self, name: &str, on: bool) -> Option<Self> {
        *self.get_mut(name)? = on;
        Some(self)
    }
}

/// Rounds every value to bf16 and back (round to nearest even) when `on`.
fn round_bf16(v: &mut [f32], on: bool) {
    if on {
        for x in v.iter_mut() {
            *x = half::bf16::from_f32(*x).to_f32();
        }
    }
}

/// State of the bf16 emulation: the points, and the fused weights the
/// engine builds at load.
#[derive(Debug, Clone)]
struct Bf16Emulation {
    points: Bf16Points,
    /// Final norm weight bf16(w / logit divisor) (`GpuModel::new` `fnorm`).
    final_norm: Vec<f32>,
}

/// One sequence's state: the §3 state of every layer, plus the blocks the
/// last sparse query selected per (layer, KV head), for tests and for
/// comparing backends.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Per layer.
    pub layers: Vec<LayerKv>,
    /// `selections[layer][kv_head]`: ascending block ids attended by the last
    /// query of the last forward call (empty when that query was dense).
    pub selections: Vec<Vec<Vec<usize>>>,
    /// `forecasts[layer]`: in forecast mode, the forecast query the last
    /// decode step selected that layer's blocks with — post-RoPE, [Hkv, D] —
    /// and the windows it scored (spec §4); None otherwise.
    pub forecasts: Vec<Option<(Vec<f32>, usize)>>,
    /// The first layer after which the residual stream of the last forward
    /// call held a NaN or ±∞ (any row), `None` when it stayed finite through
    /// every layer: where a non-finite logits row came from
    /// ([`crate::Error::NonFiniteLogits`]'s `layer`). Costs one pass over
    /// the residual per layer.
    pub nonfinite_layer: Option<usize>,
    /// Activations to record for fitting forecast weights (`sparda forecast
    /// collect|eval`); `None` (the default) records nothing and costs nothing.
    pub capture: Option<Capture>,
}

/// Activations a forward call records at chosen positions, for fitting and
/// evaluating forecast projections (spec §4 "Forecast mode": what the
/// forecast sees is x̂_l, what it predicts is layer l+1's query). Rows are
/// appended per layer as forward calls run; the caller drains them.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    /// Absolute token positions whose rows are recorded.
    pub positions: std::collections::BTreeSet<usize>,
    /// Whether to record the pre-RoPE queries too (else `q` stays empty).
    pub queries: bool,
    /// `rows[layer]`: the recorded rows of that layer, in call order.
    pub rows: Vec<Vec<CapturedRow>>,
}

/// One recorded row of one layer ([`Capture`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedRow {
    /// Token position.
    pub position: usize,
    /// x̂: the RMSNorm'd attention input of the layer, \[d\].
    pub xn: Vec<f32>,
    /// The layer's queries before RoPE (bias included), [H·D]; empty unless
    /// [`Capture::queries`].
    pub q: Vec<f32>,
}

impl Sequence {
    /// T: tokens processed so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }
    /// Whether no token was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The CPU reference model.
pub struct CpuModel {
    /// The model's config (overrides applied).
    pub config: ModelConfig,
    /// The attention in force.
    pub plan: AttentionPlan,
    prefill: PrefillMode,
    rope: Rope,
    embed: Vec<f32>,
    norm: Vec<f32>,
    /// `None` when tied to `embed`.
    lm_head: Option<Vec<f32>>,
    layers: Vec<Layer>,
    /// bf16 activation emulation, off (`None`) by default.
    bf16: Option<Bf16Emulation>,
    /// SparDA forecast weights: when set, sparse decode selects with the
    /// forecast (spec §4 "Forecast mode").
    forecast: Option<ForecastWeights>,
}

impl CpuModel {
    /// Converts a validated checkpoint's weights to f32 (spec §2).
    ///
    /// Errors: a tensor that cannot be converted (dtype), or overrides that
    /// the checkpoint cannot honour (see [`AttentionPlan::resolve`]).
    pub fn new(ckpt: &Checkpoint, opts: EngineOptions) -> Result<Self> {
        let cfg = ckpt.config.clone();
        let plan = AttentionPlan::resolve(&cfg, ckpt.eviction_heads, opts.attention)?;
        let st = &ckpt.store;
        let get = |n: String| st.to_f32(&n);
        let opt = |n: String| -> Result<Option<Vec<f32>>> {
            if st.get(&n).is_some() {
                Ok(Some(st.to_f32(&n)?))
            } else {
                Ok(None)
            }
        };
        let lin =
            |i: usize, w: LayerTensor, b: LayerTensor| -> Result<(Vec<f32>, Option<Vec<f32>>)> {
                Ok((get(names::layer(i, w))?, opt(names::layer(i, b))?))
            };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            use LayerTensor as T;
            let evict = if ckpt.eviction_heads {
                Some(EvictionHead {
                    a: get(names::layer(i, T::EvictA))?,
                    delta: get(names::layer(i, T::EvictDelta))?,
                    bias: opt(names::layer(i, T::EvictDeltaBias))?,
                })
            } else {
                None
            };
            layers.push(Layer {
                input_norm: get(names::layer(i, T::InputNorm))?,
                post_norm: get(names::layer(i, T::PostAttnNorm))?,
                q: lin(i, T::QProj, T::QBias)?,
                k: lin(i, T::KProj, T::KBias)?,
                v: lin(i, T::VProj, T::VBias)?,
                o: lin(i, T::OProj, T::OBias)?,
                gate: lin(i, T::GateProj, T::GateBias)?,
                up: lin(i, T::UpProj, T::UpBias)?,
                down: lin(i, T::DownProj, T::DownBias)?,
                evict,
            });
        }
        let embed = get(names::embed())?;
        let lm_head = if ckpt.lm_head_tied {
            None
        } else {
            Some(get(names::lm_head())?)
        };
        Ok(CpuModel {
            rope: cfg.rope(),
            plan,
            prefill: opts.prefill,
            embed,
            norm: get(names::final_norm())?,
            lm_head,
            layers,
            bf16: None,
            forecast: None,
            config: cfg,
        })
    }

    /// Switches the bf16 activation emulation on at `points` (`Some`) or off
    /// (`None`, the default f32 reference). See [`Bf16Points`]: with
    /// [`Bf16Points::ALL`] the reference rounds where the CUDA engine stores
    /// bf16, so the two differ by accumulation order only. Not an oracle
    /// mode: for explaining GPU-vs-CPU differences.
    pub fn set_bf16_emulation(&mut self, points: Option<Bf16Points>) {
        self.bf16 = points.map(|points| {
            let div = self.config.logit_divisor();
            let final_norm = self
                .norm
                .iter()
                .map(|&x| half::bf16::from_f32(x / div).to_f32())
                .collect();
            Bf16Emulation { points, final_norm }
        });
    }

    /// The bf16 emulation points in force, if on.
    pub fn bf16_emulation(&self) -> Option<Bf16Points> {
        self.bf16.as_ref().map(|e| e.points)
    }

    /// A linear layer as [`ops::linear`]; under bf16 emulation with `round`
    /// as the engine does it: a bias-free bf16-output GEMM, then `bias_add`
    /// (kernels/bias.cu: bf16(y + b)).
    fn linear(
        &self,
        x: &[f32],
        n: usize,
        w: &(Vec<f32>, Option<Vec<f32>>),
        out: usize,
        round: impl Fn(&Bf16Points) -> bool,
    ) -> Vec<f32> {
        match &self.bf16 {
            Some(e) if round(&e.points) => {
                let mut y = ops::linear(x, n, &w.0, None, out);
                round_bf16(&mut y, true);
                if let Some(b) = &w.1 {
                    for row in y.chunks_exact_mut(out) {
                        for (yi, bi) in row.iter_mut().zip(b) {
                            *yi += bi;
                        }
                    }
                    round_bf16(&mut y, true);
                }
                y
            }
            _ => ops::linear(x, n, &w.0, w.1.as_deref(), out),
        }
    }

    /// RMSNorm of a layer ([`ops::rms_norm`]; under bf16 emulation
    /// [`ops::rms_norm_rounded`] at the `norm_*` points).
    fn layer_norm(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let eps = self.config.rms_norm_eps;
        match &self.bf16 {
            Some(e) => ops::rms_norm_rounded(x, w, eps, e.points.norm_normed, e.points.norm_out),
            None => ops::rms_norm(x, w, eps),
        }
    }

    /// Rounds `v` to bf16 when the emulation is on at the point `at` picks.
    fn round_at(&self, v: &mut [f32], at: impl Fn(&Bf16Points) -> bool) {
        if let Some(e) = &self.bf16 {
            round_bf16(v, at(&e.points));
        }
    }

    /// Turns SparDA forecast selection on (`Some`) or off for sparse decode
    /// (spec §4 "Forecast mode"; prefill is unchanged).
    ///
    /// Errors: weights whose layer count or shapes do not fit the model.
    pub fn set_forecast(&mut self, fw: Option<ForecastWeights>) -> Result<()> {
        if let Some(f) = &fw {
            let c = &self.config;
            let size = c.num_key_value_heads * c.head_dim * c.hidden_size;
            let layers = c.num_hidden_layers.saturating_sub(1);
            if f.future.len() != layers
                || f.curr0.len() != size
                || f.future.iter().any(|w| w.len() != size)
            {
                return Err(Error::Input(format!(
                    "forecast weights: need {layers} q_future_proj and one q_curr_proj of [{}, {}] each",
                    c.num_key_value_heads * c.head_dim,
                    c.hidden_size
                )));
            }
        }
        self.forecast = fw;
        Ok(())
    }

    /// A new, empty sequence.
    pub fn new_sequence(&self) -> Sequence {
        let c = &self.config;
        Sequence {
            layers: (0..c.num_hidden_layers)
                .map(|_| LayerKv::new(c.num_key_value_heads, c.head_dim))
                .collect(),
            selections: vec![vec![Vec::new(); c.num_key_value_heads]; c.num_hidden_layers],
            forecasts: vec![None; c.num_hidden_layers],
            nonfinite_layer: None,
            capture: None,
        }
    }

    /// Runs `tokens` through the model at positions T … T+n−1 of `seq`,
    /// appending their §3 state, and returns logits (f32, \[V\] or [n, V]).
    ///
    /// Dense or sparse per spec §1/§6. Prefill: sparse iff the plan is
    /// sparse, the whole prompt reaches dense_len, and not `--prefill dense`.
    /// Decode: per token — token i (T = t0 + i + 1 with t0 = `seq.len()`) is
    /// sparse iff the plan is sparse and T ≥ dense_len; a call that crosses
    /// dense_len runs as two decode calls, its dense tokens then its sparse
    /// ones, so each token gets the attention it would get decoded alone. In
    /// forecast mode a sparse decode call runs one token per call (forecast
    /// selection is per decode step, spec §4).
    ///
    /// Errors: an empty call, a token id ≥ V, or a length past
    /// `max_position_embeddings` (with the numbers).
    pub fn forward(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        phase: Phase,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (n, t0) = (tokens.len(), seq.len());
        if n == 0 {
            return Err(Error::Input("forward called with no tokens".into()));
        }
        if t0 + n > c.max_position_embeddings {
            return Err(Error::Limit(format!(
                "sequence of {} tokens exceeds max_position_embeddings {} (override with --max-position / --rope-theta)",
                t0 + n,
                c.max_position_embeddings
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {} ids",
                c.vocab_size
            )));
        }
        if phase == Phase::Decode && n > 1 {
            // dense_len is decided per token (spec §1): T = t0 + i + 1 < dense_len
            // is dense. Split a call that crosses it at the crossing token.
            let dense = (0..n)
                .take_while(|&i| !self.plan.sparse_at(t0 + i + 1))
                .count();
            if dense > 0 && dense < n {
                let (d, s) = tokens.split_at(dense);
                return self.decode_in_parts(seq, [d, s], logits);
            }
            // Forecast selection is defined per decode step: a sparse call
            // (dense is 0 or n here) runs one token at a time.
            if self.forecast.is_some() && dense == 0 {
                return self.decode_in_parts(seq, tokens.chunks(1), logits);
            }
        }
        // Sequence length for length-dependent RoPE (dynamic NTK): the whole
        // prompt during prefill, so the result does not depend on chunking.
        let rope_len = match phase {
            Phase::Prefill { prompt_len } => prompt_len.max(t0 + n),
            Phase::Decode => t0 + n,
        };
        let sparse = match phase {
            Phase::Prefill { prompt_len } => {
                self.plan.sparse_at(prompt_len) && self.prefill != PrefillMode::Dense
            }
            // every token of a decode call is on one side of dense_len (split above)
            Phase::Decode => self.plan.sparse_at(t0 + 1),
        };
        let d = c.hidden_size;
        let mut x = Vec::with_capacity(n * d);
        let emb_scale = c.mup.map_or(1.0, |m| m.scale_emb);
        for &t in tokens {
            x.extend(
                self.embed[t as usize * d..(t as usize + 1) * d]
                    .iter()
                    .map(|v| v * emb_scale),
            );
        }
        // bf16 emulation: embed_gather writes bf16(embed · scale_emb) (kernels/embedding.cu).
        self.round_at(&mut x, |p| p.embed);
        let forecast = self.forecast.is_some() && sparse && phase == Phase::Decode;
        // The forecast for the next layer, computed by the current one (spec §4).
        let mut pending: Option<Vec<f32>> = None;
        let res_scale = self.residual_scale();
        seq.nonfinite_layer = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let fc = if forecast { Some(&mut pending) } else { None };
            let attn = self.attention(li, layer, seq, &x, n, sparse, rope_len, fc);
            for (xi, ai) in x.iter_mut().zip(&attn) {
                *xi += ai * res_scale;
            }
            let mlp = self.mlp(layer, &x, n);
            for (xi, mi) in x.iter_mut().zip(&mlp) {
                *xi += mi * res_scale;
            }
            if seq.nonfinite_layer.is_none() && !x.iter().all(|v| v.is_finite()) {
                seq.nonfinite_layer = Some(li);
            }
        }
        let rows: &[f32] = match logits {
            Logits::Last => &x[(n - 1) * d..],
            Logits::All => &x,
        };
        let m = rows.len() / d;
        let h = if let Some(e) = &self.bf16 {
            // The engine's final add_rmsnorm: bf16(bf16(x · inv) · bf16(w / divisor)),
            // the muP divisor folded into the weight (GpuModel::new `fnorm`).
            let p = e.points;
            if p.final_out {
                ops::rms_norm_rounded(rows, &e.final_norm, c.rms_norm_eps, p.final_normed, true)
            } else {
                let mut h =
                    ops::rms_norm_rounded(rows, &self.norm, c.rms_norm_eps, p.final_normed, false);
                if let Some(mup) = c.mup {
                    let div = c.hidden_size as f32 / mup.dim_model_base;
                    h.iter_mut().for_each(|v| *v /= div);
                }
                h
            }
        } else {
            let mut h = ops::rms_norm(rows, &self.norm, c.rms_norm_eps);
            if let Some(mup) = c.mup {
                let div = c.hidden_size as f32 / mup.dim_model_base;
                h.iter_mut().for_each(|v| *v /= div);
            }
            h
        };
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        Ok(ops::linear(&h, m, head, None, c.vocab_size))
    }

    /// Runs the consecutive `parts` of one decode call as decode calls of
    /// their own, in order, and returns the logits the whole call would:
    /// every part's rows for [`Logits::All`], the last part's for
    /// [`Logits::Last`].
    fn decode_in_parts<'a>(
        &self,
        seq: &mut Sequence,
        parts: impl IntoIterator<Item = &'a [u32]>,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let mut all = Vec::new();
        for part in parts {
            let l = self.forward(seq, part, Phase::Decode, logits)?;
            match logits {
                Logits::All => all.extend(l),
                Logits::Last => all = l,
            }
        }
        Ok(all)
    }

    /// Prefill: [`forward`](Self::forward) over the prompt in chunks of
    /// [`PREFILL_CHUNK`] tokens, calling `progress(done, total)` after each;
    /// returns the logits of the prompt's last token.
    ///
    /// Errors: as [`forward`](Self::forward); [`Error::Interrupted`] when
    /// Ctrl-C was pressed ([`crate::interrupt`], checked before each chunk).
    pub fn prefill(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        if prompt.is_empty() {
            return Err(Error::Input("empty prompt: give at least one token".into()));
        }
        let prompt_len = seq.len() + prompt.len();
        let mut logits = Vec::new();
        for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
            crate::interrupt::check(|| {
                format!(
                    "prefill, {} of {} prompt tokens done",
                    i * PREFILL_CHUNK,
                    prompt.len()
                )
            })?;
            logits = self.forward(seq, chunk, Phase::Prefill { prompt_len }, Logits::Last)?;
            progress(
                (i * PREFILL_CHUNK + chunk.len()).min(prompt.len()),
                prompt.len(),
            );
        }
        Ok(logits)
    }

    /// Decode one token; its logits \[V\].
    pub fn decode(&self, seq: &mut Sequence, token: u32) -> Result<Vec<f32>> {
        self.forward(seq, &[token], Phase::Decode, Logits::Last)
    }

    /// scale_depth / √L under muP, else 1 (spec §1).
    fn residual_scale(&self) -> f32 {
        let c = &self.config;
        c.mup
            .and_then(|m| m.scale_depth)
            .map_or(1.0, |sd| sd / (c.num_hidden_layers as f32).sqrt())
    }

    /// SwiGLU MLP of n rows: down(silu(gate(x̂)) · up(x̂)).
    fn mlp(&self, layer: &Layer, x: &[f32], n: usize) -> Vec<f32> {
        let c = &self.config;
        let xn = self.layer_norm(x, &layer.post_norm);
        let i = c.intermediate_size;
        // bf16 emulation: the gate|up GEMM stores bf16 (`ws.gu`).
        let g = self.linear(&xn, n, &layer.gate, i, |p| p.gate_up);
        let u = self.linear(&xn, n, &layer.up, i, |p| p.gate_up);
        let mut h: Vec<f32> = g.iter().zip(&u).map(|(a, b)| ops::silu(*a) * b).collect();
        // kernels/swiglu.cu stores bf16(silu(g) · u) (`ws.act`).
        self.round_at(&mut h, |p| p.act);
        // down_proj stores bf16 (`ws.delta`), added to the f32 residual by the next add_rmsnorm.
        self.linear(&h, n, &layer.down, c.hidden_size, |p| p.down)
    }

    /// Attention block of n rows: projections, eviction score, RoPE, state
    /// append, dense or sparse attention, O projection (spec §3, §5, §6).
    #[allow(clippy::too_many_arguments)] // private; the per-call facts of one layer
    fn attention(
        &self,
        li: usize,
        layer: &Layer,
        seq: &mut Sequence,
        x: &[f32],
        n: usize,
        sparse: bool,
        rope_len: usize,
        forecast: Option<&mut Option<Vec<f32>>>,
    ) -> Vec<f32> {
        let c = &self.config;
        let (hq, hk, dh) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let t0 = seq.layers[li].len();
        let xn = self.layer_norm(x, &layer.input_norm);
        // Forecast mode (n = 1): this layer's forecast query — layer 0 from its
        // own q_curr_proj, layer l ≥ 1 from layer l−1's q_future_proj — and the
        // next layer's, both RoPE'd at the current position t0 (spec §4).
        let fq = forecast.map(|pending| {
            let fw = self.forecast.as_ref().expect("forecast mode needs weights");
            let project = |w: &[f32]| {
                let mut f = ops::linear(&xn, 1, w, None, hk * dh);
                let (mut cos, mut sin) = (vec![0.0f32; dh / 2], vec![0.0f32; dh / 2]);
                self.rope.cos_sin(t0, rope_len, &mut cos, &mut sin);
                ops::rope_in_place(&mut f, &cos, &sin);
                f
            };
            let own = if li == 0 {
                project(&fw.curr0)
            } else {
                pending.take().expect("layer l−1 forecast")
            };
            if li + 1 < c.num_hidden_layers {
                *pending = Some(project(&fw.future[li]));
            }
            // layer 0 scores its own current-step windows; layer l ≥ 1 those of
            // the previous step (layer l has not run yet when l−1 forecasts it)
            let windows = if li == 0 {
                self.plan.budget.windows(t0 + 1)
            } else {
                self.plan.budget.windows(t0)
            };
            (own, windows)
        });
        // bf16 emulation: the fused QKV GEMM stores bf16 (`ws.qkv`).
        let mut q = self.linear(&xn, n, &layer.q, hq * dh, |p| p.qkv);
        if let Some(cap) = seq.capture.as_mut() {
            if cap.rows.len() < c.num_hidden_layers {
                cap.rows.resize(c.num_hidden_layers, Vec::new());
            }
            let d = c.hidden_size;
            for (i, pos) in (t0..t0 + n).enumerate() {
                if cap.positions.contains(&pos) {
                    cap.rows[li].push(CapturedRow {
                        position: pos,
                        xn: xn[i * d..(i + 1) * d].to_vec(),
                        q: if cap.queries {
                            q[i * hq * dh..(i + 1) * hq * dh].to_vec()
                        } else {
                            Vec::new()
                        },
                    });
                }
            }
        }
        let mut k = self.linear(&xn, n, &layer.k, hk * dh, |p| p.qkv);
        let v = self.linear(&xn, n, &layer.v, hk * dh, |p| p.qkv);
        // The eviction score from v as the cache stores it (bf16 under the
        // emulation's `qkv` point), in f32: the engine's append kernel
        // (kernels/kv_append.cu) computes exactly this.
        let cvals = match &layer.evict {
            Some(ev) => ops::eviction_scores(&v, n, &ev.delta, ev.bias.as_deref(), &ev.a),
            None => vec![0.0; n * hk],
        };
        let half = dh / 2;
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        for i in 0..n {
            let pos = t0 + i;
            self.rope.cos_sin(pos, rope_len, &mut cos, &mut sin);
            ops::rope_in_place(&mut q[i * hq * dh..(i + 1) * hq * dh], &cos, &sin);
            ops::rope_in_place(&mut k[i * hk * dh..(i + 1) * hk * dh], &cos, &sin);
        }
        // bf16 emulation: qkv_rope_append stores the rotated q and k as bf16
        // (`ws.qkv` and the K cache); V is cached as the GEMM left it.
        self.round_at(&mut q, |p| p.rope);
        self.round_at(&mut k, |p| p.rope);
        let kv = &mut seq.layers[li];
        kv.append(&self.plan.budget, &k, &v, &cvals);
        let mut out = vec![0.0f32; n * hq * dh];
        seq.forecasts[li] = fq.clone();
        if sparse {
            let fq = fq.as_ref().map(|(f, windows)| ForecastQuery {
                f,
                windows: *windows,
            });
            let sel = sparse_attention_with(&self.plan, kv, &q, t0, n, hq, fq, &mut out);
            seq.selections[li] = sel;
        } else {
            dense_attention(kv, &q, t0, n, hq, dh, &mut out);
            seq.selections[li].iter_mut().for_each(Vec::clear);
        }
        // bf16 emulation: attn_combine stores bf16 (`ws.attn`); o_proj stores
        // bf16 (`ws.delta`), added to the f32 residual by add_rmsnorm.
        self.round_at(&mut out, |p| p.attn_out);
        self.linear(&out, n, &layer.o, c.hidden_size, |p| p.o_proj)
    }
}

/// Sparse attention for n queries at positions t0 … t0+n−1 (spec §4–§6):
/// per query and KV head, windows visible to the query, pooled scores,
/// selection, then attention over the selected blocks' tokens j ≤ t in
/// ascending block order, with the eviction bias in NOSA mode. Returns
/// the last query's selection per KV head.
///
/// `q`: [n, H, D] post-RoPE queries (H = `hq`); `kv` already holds the
/// n new tokens; `out`: [n, H, D]. Panics if `plan` is dense.
pub fn sparse_attention(
    plan: &AttentionPlan,
    kv: &LayerKv,
    q: &[f32],
    t0: usize,
    n: usize,
    hq: usize,
    out: &mut [f32],
) -> Vec<Vec<usize>> {
    sparse_attention_with(plan, kv, q, t0, n, hq, None, out)
}

/// A forecast query for one decode step (spec §4 "Forecast mode").
#[derive(Debug, Clone, Copy)]
pub struct ForecastQuery<'a> {
    /// One post-RoPE vector per KV head, [Hkv, D].
    pub f: &'a [f32],
    /// Compressed windows it scores (Mc of the step the state is taken from).
    pub windows: usize,
}

/// Forecast window scores of one KV head: f_h · Kc\[i,h\] for i < windows
/// (plain dot product: no scale, no softmax, no head sum; spec §4).
pub fn forecast_window_scores(f_h: &[f32], kv: &LayerKv, h: usize, windows: usize) -> Vec<f32> {
    let dh = f_h.len();
    (0..windows)
        .map(|i| {
            ops::dot(
                f_h,
                &kv.kc[i * kv.kv_dim + h * dh..i * kv.kv_dim + (h + 1) * dh],
            )
        })
        .collect()
}

/// [`sparse_attention`] with an optional forecast: when given (n must be
/// 1), the forecast's window scores replace the query-aware ones and the
/// pooled eviction scores come from the same `windows` (the previous step's
/// state for layers ≥ 1).
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_with(
    plan: &AttentionPlan,
    kv: &LayerKv,
    q: &[f32],
    t0: usize,
    n: usize,
    hq: usize,
    forecast: Option<ForecastQuery<'_>>,
    out: &mut [f32],
) -> Vec<Vec<usize>> {
    assert!(
        forecast.is_none() || n == 1,
        "forecast selection is per decode step"
    );
    let (hk, dh) = (kv.kv_heads, kv.kv_dim / kv.kv_heads);
    let g = hq / hk;
    let budget: &Budget = &plan.budget;
    let rule = plan.rule().expect("sparse attention needs a sparse plan");
    let nosa = plan.mode == AttentionMode::Nosa;
    let scale = 1.0 / (dh as f32).sqrt();
    let kvd = hk * dh;
    let mut last = vec![Vec::new(); hk];
    for i in 0..n {
        let t = t0 + i;
        let mc = budget.windows(t + 1);
        let nb = budget.blocks(t);
        for h in 0..hk {
            let qh = &q[(i * hq + h * g) * dh..(i * hq + (h + 1) * g) * dh];
            let (s, mc) = match forecast {
                Some(fq) => (
                    forecast_window_scores(&fq.f[h * dh..(h + 1) * dh], kv, h, fq.windows),
                    fq.windows,
                ),
                None => {
                    let kch = if mc > 0 { &kv.kc[h * dh..] } else { &[][..] };
                    (select::query_window_scores(qh, dh, kch, kvd, mc), mc)
                }
            };
            let r = select::pool_blocks(budget, &s, nb);
            let p: Vec<f32> = (0..mc).map(|w| kv.p[w * hk + h]).collect();
            let e = select::pool_blocks(budget, &p, nb);
            let blocks = select::select(budget, rule, &r, &e);
            for gi in 0..g {
                let qg = &qh[gi * dh..(gi + 1) * dh];
                let toks = blocks
                    .iter()
                    .flat_map(|&m| m * budget.block_size..((m + 1) * budget.block_size).min(t + 1));
                let kvb = toks.map(|j| {
                    let off = j * kvd + h * dh;
                    let bias = if nosa { kv.c[j * hk + h] } else { 0.0 };
                    (&kv.k[off..off + dh], &kv.v[off..off + dh], bias)
                });
                let o = &mut out[(i * hq + h * g + gi) * dh..(i * hq + h * g + gi + 1) * dh];
                ops::attend(qg, scale, kvb, o);
            }
            if i + 1 == n {
                last[h] = blocks;
            }
        }
    }
    last
}

/// Dense causal attention without bias for n queries at positions t0 …
/// (spec §5 "Dense"): per query head, scores Q·Kᵀ/√D through GEMM over all
/// tokens j ≤ t, softmax, then P·V, queries in tiles of 256 rows; decode
/// shapes (n ≤ [`ops::MATVEC_ROWS`]) take one online-softmax pass instead.
///
/// `q`, `out`: [n, H, D]; `kv` already holds the n new tokens.
pub fn dense_attention(
    kv: &LayerKv,
    q: &[f32],
    t0: usize,
    n: usize,
    hq: usize,
    dh: usize,
    out: &mut [f32],
) {
    let hk = kv.kv_heads;
    let g = hq / hk;
    let kvd = hk * dh;
    let t_all = t0 + n;
    let scale = 1.0 / (dh as f32).sqrt();
    if n <= ops::MATVEC_ROWS {
        // Decode: one online-softmax pass per query head over contiguous key rows.
        for i in 0..n {
            let t = t0 + i;
            for head in 0..hq {
                let h = head / g;
                let kvb = (0..=t).map(|j| {
                    let off = j * kvd + h * dh;
                    (&kv.k[off..off + dh], &kv.v[off..off + dh], 0.0)
                });
                let o = (i * hq + head) * dh;
                ops::attend(&q[o..o + dh], scale, kvb, &mut out[o..o + dh]);
            }
        }
        return;
    }
    const TILE: usize = 256;
    let mut scores = vec![0.0f32; TILE.min(n) * t_all];
    for head in 0..hq {
        let h = head / g;
        for i0 in (0..n).step_by(TILE) {
            let rows = TILE.min(n - i0);
            let kmax = t0 + i0 + rows; // keys needed by the last row of the tile
            let sc = &mut scores[..rows * kmax];
            // SAFETY: q rows i0.. of this head (stride hq·dh), keys [kmax, dh] of KV head h (stride kvd).
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    dh,
                    kmax,
                    scale,
                    q.as_ptr().add((i0 * hq + head) * dh),
                    (hq * dh) as isize,
                    1,
                    kv.k.as_ptr().add(h * dh),
                    1,
                    kvd as isize,
                    0.0,
                    sc.as_mut_ptr(),
                    kmax as isize,
                    1,
                );
            }
            for r in 0..rows {
                let t = t0 + i0 + r;
                let row = &mut sc[r * kmax..(r + 1) * kmax];
                let mx = row[..=t].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for s in row[..=t].iter_mut() {
                    *s = (*s - mx).exp();
                    sum += *s;
                }
                for s in row[..=t].iter_mut() {
                    *s /= sum;
                }
                row[t + 1..].fill(0.0);
            }
            // SAFETY: P [rows, kmax] · V [kmax, dh] of head h → out rows (stride hq·dh).
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    kmax,
                    dh,
                    1.0,
                    sc.as_ptr(),
                    kmax as isize,
                    1,
                    kv.v.as_ptr().add(h * dh),
                    kvd as isize,
                    1,
                    0.0,
                    out.as_mut_ptr().add((i0 * hq + head) * dh),
                    (hq * dh) as isize,
                    1,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{self, Preset};

    /// The eviction score the reference stores is A·softplus(δ·v + b) in f32
    /// on the v it stores — under the bf16 emulation, the bf16 v the
    /// engine's GEMM (+ v bias) produces — exactly what the engine's append
    /// kernel computes from that v (kernels/kv_append.cu). With and without
    /// `attention_bias` (v bias, eviction bias b).
    #[test]
    fn eviction_score_is_f32_delta_on_the_stored_v() {
        for bias in [false, true] {
            let mut cfg = Preset::Tiny.config();
            cfg.attention_bias = bias;
            let ckpt = synth::build_config(&cfg, true, 3).unwrap();
            let mut m = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
            m.set_bf16_emulation(Some(Bf16Points::ALL));
            let prompt: Vec<u32> = (0..150).map(|i| (i * 37 % 4000) as u32 + 3).collect();
            let mut seq = m.new_sequence();
            m.prefill(&mut seq, &prompt, |_, _| {}).unwrap();
            m.decode(&mut seq, 11).unwrap();
            let (hk, t) = (cfg.num_key_value_heads, prompt.len() + 1);
            for (li, kv) in seq.layers.iter().enumerate() {
                let ev = m.layers[li].evict.as_ref().expect("NOSA layer");
                assert_eq!(ev.bias.is_some(), bias);
                assert!(
                    kv.v.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x),
                    "layer {li}: the emulated v is bf16"
                );
                let want = ops::eviction_scores(&kv.v, t, &ev.delta, ev.bias.as_deref(), &ev.a);
                assert_eq!(kv.c.len(), t * hk);
                // Equal up to f32 summation order (the GEMM's blocking differs
                // between the prefill chunk and a single decode row); a z
                // rounded to bf16 (as fused bf16(δ·W_v) GEMM rows give) is off
                // by up to 2⁻⁹ relative, far above this bound.
                for (i, (&g, &w)) in kv.c.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs().max(1e-3),
                        "layer {li}, bias {bias}, element {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
