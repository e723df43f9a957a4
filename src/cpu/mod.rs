//! The CPU reference backend: f32 compute on the checkpoint's (bf16) weights,
//! one sequence at a time. It is the oracle for every GPU kernel and for all
//! NOSA-specific behaviour (spec/testing.md), so it favours plain, checkable
//! code over speed: GEMMs through `matrixmultiply`, attention as written in
//! spec/nosa-model.md §5, selection through [`crate::model::select`].

pub mod ops;

use crate::config::{AttentionMode, ModelConfig, Rope};
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
    /// One generated token (or a teacher-forced run of them).
    Decode,
}

/// Prompt tokens per prefill forward call on the CPU (bounds the score tiles).
pub const PREFILL_CHUNK: usize = 512;

/// Which logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's, [V].
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

/// One sequence's state: the §3 state of every layer, plus the blocks the
/// last sparse query selected per (layer, KV head), for tests and for
/// comparing backends.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Per layer.
    pub layers: Vec<LayerKv>,
    /// `selections[layer][kv_head]`: ascending block ids attended by the last
    /// query of the last forward call (empty when that call was dense).
    pub selections: Vec<Vec<Vec<usize>>>,
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
            config: cfg,
        })
    }

    /// A new, empty sequence.
    pub fn new_sequence(&self) -> Sequence {
        let c = &self.config;
        Sequence {
            layers: (0..c.num_hidden_layers)
                .map(|_| LayerKv::new(c.num_key_value_heads, c.head_dim))
                .collect(),
            selections: vec![vec![Vec::new(); c.num_key_value_heads]; c.num_hidden_layers],
        }
    }

    /// Runs `tokens` through the model at positions T … T+n−1 of `seq`,
    /// appending their §3 state, and returns logits (f32, [V] or [n, V]).
    ///
    /// Dense or sparse per spec §1/§6: sparse iff the plan is sparse, the
    /// sequence reaches dense_len with this call, and this is not a prefill
    /// under `--prefill dense`.
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
            Phase::Decode => self.plan.sparse_at(t0 + n),
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
        let res_scale = self.residual_scale();
        for (li, layer) in self.layers.iter().enumerate() {
            let attn = self.attention(li, layer, seq, &x, n, sparse, rope_len);
            for (xi, ai) in x.iter_mut().zip(&attn) {
                *xi += ai * res_scale;
            }
            let mlp = self.mlp(layer, &x, n);
            for (xi, mi) in x.iter_mut().zip(&mlp) {
                *xi += mi * res_scale;
            }
        }
        let rows: &[f32] = match logits {
            Logits::Last => &x[(n - 1) * d..],
            Logits::All => &x,
        };
        let m = rows.len() / d;
        let mut h = ops::rms_norm(rows, &self.norm, c.rms_norm_eps);
        if let Some(mup) = c.mup {
            let div = c.hidden_size as f32 / mup.dim_model_base;
            h.iter_mut().for_each(|v| *v /= div);
        }
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        Ok(ops::linear(&h, m, head, None, c.vocab_size))
    }

    /// Prefill: [`forward`](Self::forward) over the prompt in chunks of
    /// [`PREFILL_CHUNK`] tokens, calling `progress(done, total)` after each;
    /// returns the logits of the prompt's last token.
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
            logits = self.forward(seq, chunk, Phase::Prefill { prompt_len }, Logits::Last)?;
            progress(
                (i * PREFILL_CHUNK + chunk.len()).min(prompt.len()),
                prompt.len(),
            );
        }
        Ok(logits)
    }

    /// Decode one token; its logits [V].
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
        let xn = ops::rms_norm(x, &layer.post_norm, c.rms_norm_eps);
        let i = c.intermediate_size;
        let g = ops::linear(&xn, n, &layer.gate.0, layer.gate.1.as_deref(), i);
        let u = ops::linear(&xn, n, &layer.up.0, layer.up.1.as_deref(), i);
        let h: Vec<f32> = g.iter().zip(&u).map(|(a, b)| ops::silu(*a) * b).collect();
        ops::linear(&h, n, &layer.down.0, layer.down.1.as_deref(), c.hidden_size)
    }

    /// Attention block of n rows: projections, eviction score, RoPE, state
    /// append, dense or sparse attention, O projection (spec §3, §5, §6).
    fn attention(
        &self,
        li: usize,
        layer: &Layer,
        seq: &mut Sequence,
        x: &[f32],
        n: usize,
        sparse: bool,
        rope_len: usize,
    ) -> Vec<f32> {
        let c = &self.config;
        let (hq, hk, dh) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let t0 = seq.layers[li].len();
        let xn = ops::rms_norm(x, &layer.input_norm, c.rms_norm_eps);
        let mut q = ops::linear(&xn, n, &layer.q.0, layer.q.1.as_deref(), hq * dh);
        let mut k = ops::linear(&xn, n, &layer.k.0, layer.k.1.as_deref(), hk * dh);
        let v = ops::linear(&xn, n, &layer.v.0, layer.v.1.as_deref(), hk * dh);
        let cvals = match &layer.evict {
            Some(ev) => {
                let mut z = ops::linear(&v, n, &ev.delta, ev.bias.as_deref(), hk);
                for row in z.chunks_exact_mut(hk) {
                    for (h, zh) in row.iter_mut().enumerate() {
                        *zh = ev.a[h] * ops::softplus(*zh);
                    }
                }
                z
            }
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
        let kv = &mut seq.layers[li];
        kv.append(&self.plan.budget, &k, &v, &cvals);
        let mut out = vec![0.0f32; n * hq * dh];
        if sparse {
            let sel = sparse_attention(&self.plan, kv, &q, t0, n, hq, &mut out);
            seq.selections[li] = sel;
        } else {
            dense_attention(kv, &q, t0, n, hq, dh, &mut out);
            seq.selections[li].iter_mut().for_each(Vec::clear);
        }
        ops::linear(&out, n, &layer.o.0, layer.o.1.as_deref(), c.hidden_size)
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
            let kch = if mc > 0 { &kv.kc[h * dh..] } else { &[][..] };
            let s = select::query_window_scores(qh, dh, kch, kvd, mc);
            let r = select::pool_blocks(budget, &s, nb);
            let p: Vec<f32> = (0..mc).map(|w| kv.p[w * hk + h]).collect();
            let e = select::pool_blocks(budget, &p, nb);
            let blocks = select::select(budget, rule, &r, &e);
            for gi in 0..g {
                let qg = &qh[gi * dh..(gi + 1) * dh];
                let toks = blocks.iter().flat_map(|&m| {
                    (m * budget.block_size..((m + 1) * budget.block_size).min(t + 1))
                        .map(move |j| j)
                });
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
