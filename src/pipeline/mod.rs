//! The GPU engine: a model's weights on the GPU in
//! bf16, K/V caches on the GPU that grow with the sequences, prefill (chunked,
//! one sequence at a time) and batched decode (one token for each of B
//! sequences of different lengths), f32 logits and greedy argmax on the GPU.
//!
//! It computes what [`crate::cpu::CpuModel::forward`] computes
//! (spec/nosa-model.md §1–§6), with bf16 activations and f32 accumulation:
//!
//! ```text
//! x = embed[tok] · scale_emb                      (bf16)        embed_gather
//! per layer:
//!   resid += x·s ; x̂ = RMSNorm(resid)                           rmsnorm_residual
//!   [q | k | v] = x̂ · Wqkvᵀ (+ bias)                one GEMM      cuBLAS (+ bias_add)
//!   RoPE(q, k); K/V cache[pos] = k, v;                           qkv_rope_append
//!   c[pos] = A · softplus(δ · v + b)   (f32, v as stored bf16)
//!   attention: dense (no bias) or sparse over the selected blocks (+c bias)
//!   o = attn · Woᵀ ; resid += o·s ; x̂ = RMSNorm(resid)          cuBLAS, rmsnorm_residual
//!   x = down(silu(gate) · up), gate|up one GEMM                  cuBLAS, swiglu, cuBLAS
//! h = RMSNorm(resid + x·s) / logit_divisor ; logits = h · lm_headᵀ (f32)
//! ```
//!
//! with s = scale_depth/√L under muP (else 1). Fusions and layouts:
//! - `Wqkv` stacks q_proj, k_proj and v_proj (rows padded to a multiple of
//!   8; forecast mode appends its rows after them, see [`forecast`]). The
//!   NOSA eviction score is not part of the GEMM: the append kernel computes
//!   z = δ·v + b in f32 from the bf16 v the GEMM (+ v bias) produced, the
//!   value the K/V cache stores (δ and b as the checkpoint holds them,
//!   widened to f32), and c = A·softplus(z) in f32 (spec §3), exactly what
//!   the CPU reference computes on that v.
//! - gate_proj and up_proj are stacked into one [2I, d] GEMM weight.
//! - The muP logit divisor is folded into the final norm weight at load
//!   (w / divisor, rounded to bf16; exact when the divisor is a power of two,
//!   as for NOSA-8B's 4096/256 = 16).
//!
//! Attention is one tensor-core kernel for dense and sparse rows
//! (`attn_partial`, kernels/attn_decode.cu: each thread block reads a KV
//! head's keys and values once for up to 16 of its query heads, split-K
//! over tokens or listed blocks) plus `attn_combine`, reached through
//! per-row pointer tables: a "row" is one query token (a prompt token during
//! prefill, one sequence's token during decode) with its own K/V/c pointers
//! and length `pos + 1`, so a prefill chunk is causal attention for free and
//! a decode batch mixes sequence lengths freely.
//!
//! Decode steps (the hot path, runtime.md §5) keep everything they need on
//! the device ([`GpuModel::decode`]): per-layer pointer tables, built once
//! per batch and capacity; token ids, positions and lengths in one small
//! buffer (one upload per step, or none when [`GpuModel::decode_greedy`]
//! feeds each step the previous step's argmax, which the step's last kernel
//! writes there); every scratch buffer allocated up front; grid sizes fixed
//! by the batch's capacity, with blocks past a row's length exiting at
//! once. The whole step — all layers, the lm_head GEMM and the argmax — is
//! then captured once as a CUDA graph and replayed; it is captured again
//! only when a capacity, the batch or its sequences change, a row crosses
//! dense_len, or the RoPE tables grow (the step's key, [`step`]; see
//! [`DecodeMode`]).
//!
//! Sparse selection (spec §4) plugs in per layer after the append; see
//! [`SelectionPath`]. A clearly labelled host fallback mirrors each
//! sequence's K and c on the host (downloaded row by row as they are
//! appended), computes Kc/p and the selection with the CPU reference's own
//! functions on the GPU's post-RoPE bf16 queries, and uploads the block
//! lists. That path synchronises every layer and is for correctness checks
//! only.
//!
//! Device errors: kernels whose guards can fail — `qkv_rope_append` (a
//! position outside the RoPE table), `select_blocks` (more blocks than the
//! launch's cap) and `slot_diff` (more missed blocks than free slots) —
//! skip the offending row and report it to the model's device error record
//! ([`crate::cuda::device_error`]: pinned, device-mapped, one fixed address
//! for the model's lifetime, so captured graphs keep reporting to it).
//! Nothing there costs a synchronisation: the record is read where the
//! engine synchronises or hands results to the host anyway — [`GpuModel::argmax`],
//! [`GpuModel::sample`], [`GpuModel::download_logits`],
//! [`GpuModel::offload_stats`] and the end of [`GpuModel::prefill`] (which
//! synchronises once per prompt) — and by [`GpuModel::check_device_errors`]
//! (loops that only run device-fed steps, such as benchmarks). The first
//! error since the last check comes back as an [`Error::Limit`] naming the
//! kernel, layer, row (and KV head) and the numbers; the record is cleared.
//!
//! Where things are:
//! - this file: [`GpuModel`] (weights, options, the public API) and the
//!   step-independent settings ([`DecodeMode`], [`SelectionPath`], [`StepPart`]);
//! - [`step`]: the decode step (buffers, pointer tables, key; launched eagerly
//!   or as a CUDA graph) — every decode step goes through it;
//! - [`schedule`]: the per-layer order of a decode step for sync and
//!   forecast (+ prefetch) modes, with its streams and events;
//! - [`layer`]: one layer's launches; [`select`]: block selection;
//!   [`forecast`]: forecast weights and forecast selection;
//! - [`prefill`]: prompt chunks; [`workspace`]: scratch buffers;
//! - [`profile`]: per-piece timing and the layer-GEMM ceiling (benchmarks);
//! - [`trace_spans`]: GPU spans of `--trace`;
//! - the KV cache (resident caches, pinned host store, slot pools, fetch,
//!   write-back) is [`crate::kv`].

use crate::config::{AttentionMode, ModelConfig, Rope, RopeScaling};
use crate::cpu::EngineOptions;
use crate::cuda::context::{dptr, grid, i32_dim, CudaResultExt};
use crate::cuda::device_error::DeviceErrors;
use crate::cuda::ops::select::{launch_select_blocks, SelectBlocksArgs};
use crate::cuda::ops::{self, AttnArgs, RopeTables};
use crate::cuda::{bf16_bits, Bf16, Gpu};
use crate::model::select::Budget;
use crate::model::{AttentionPlan, PrefillMode};
use crate::trace::timeline::SpanId;
use crate::weights::names::{self, LayerTensor};
use crate::weights::Checkpoint;
use crate::{Error, Result};
use cudarc::driver::{CudaGraph, CudaSlice, LaunchConfig, PushKernelArg};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub mod capture;
pub mod cta_log;
pub mod forecast;
pub mod layer;
pub mod prefill;
pub mod profile;
pub mod schedule;
pub mod select;
pub mod step;
pub mod trace_spans;
pub(crate) mod union_stats;
pub mod workspace;

pub use crate::kv::fetch::{fetch_rule, FetchEngine};
pub use crate::kv::offload::{OffloadOptions, OffloadStats};
pub use crate::kv::resident::GpuSequence;
pub(crate) use layer::compress;
pub use profile::GemmCeiling;
pub(crate) use step::{DecodeStep, Tables};
pub(crate) use workspace::{
    AttnGeometry, LastLogits, LogitRows, Row, RowInputs, SelGeometry, Workspace,
};

/// Prompt tokens per prefill forward call at most (fewer when the attention
/// partials of a long context would exceed [`PARTIALS_BUDGET_BYTES`]), by
/// default ([`prefill_chunk`]). 1024: NOSA-8B at 32K on the H200 prefilled
/// 5 % faster (sparse) and 3 % faster (dense) than in chunks of 512, and
/// chunks of 2048 were no faster (benches/results/
/// prefill_window_scoring_breakdown_32k_sparse_h200_2026-12-02_0da804e/).
pub const PREFILL_CHUNK: usize = 1024;

/// The environment variable that sets the prefill chunk for experiments
/// ([`prefill_chunk`]).
pub const ENV_PREFILL_CHUNK: &str = "SPARDA_PREFILL_CHUNK";

/// Prompt tokens per prefill forward call at most: `$SPARDA_PREFILL_CHUNK`
/// when it is a multiple of 64 in 64 … 4096 (a larger chunk gives the GEMMs
/// and the attention grid more rows per launch and takes more workspace;
/// same results up to the attention's summation order), else
/// [`PREFILL_CHUNK`]; another value is refused with a one-line warning.
/// Read once.
pub fn prefill_chunk() -> usize {
    static CHUNK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHUNK.get_or_init(|| match std::env::var(ENV_PREFILL_CHUNK) {
        Err(_) => PREFILL_CHUNK,
        Ok(v) => match parse_prefill_chunk(&v) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("warning: {e}; prefilling in chunks of {PREFILL_CHUNK}");
                PREFILL_CHUNK
            }
        },
    })
}

/// Reads a [`ENV_PREFILL_CHUNK`] value: a multiple of 64 in 64 … 4096.
///
/// Errors: [`Error::Input`] naming the variable, the value and the range.
pub fn parse_prefill_chunk(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if (64..=4096).contains(&n) && n % 64 == 0 => Ok(n),
        _ => Err(Error::Input(format!(
            "{ENV_PREFILL_CHUNK}={v}: give a multiple of 64 in 64 … 4096 (prompt tokens per prefill chunk)"
        ))),
    }
}

/// Upper bound on the split-K attention workspace of one forward call, bytes;
/// bounds the prefill chunk for long contexts (a dense 128K-token context
/// then runs in chunks of a few dozen rows).
pub const PARTIALS_BUDGET_BYTES: usize = 512 << 20;

/// Rows of the fused QKV weight are padded to a multiple of this.
pub(crate) const QKV_ROW_ALIGN: usize = 8;
/// Per-layer pointer-table entries per row: K, V, c (state), c (bias), Kc, p.
pub(crate) const PTRS_PER_ROW: usize = 6;
/// Per-layer pointer-table entries per sequence: K, c, Kc, p (compression).
pub(crate) const PTRS_PER_SEQ: usize = 4;
/// Cap on the grid of `compress_windows` (it loops over further windows).
pub(crate) const COMPRESS_MAX_GRID_X: usize = 8192;

/// Source of [`GpuSequence`] identities (graph keys compare them).
pub(crate) static NEXT_SEQ_UID: AtomicU64 = AtomicU64::new(1);

/// The selection path from `$SPARDA_SELECTION` (`host` → the host fallback),
/// else [`SelectionPath::Gpu`].
pub fn default_selection_path() -> SelectionPath {
    match std::env::var("SPARDA_SELECTION").as_deref() {
        Ok("host") => SelectionPath::HostFallback,
        _ => SelectionPath::Gpu,
    }
}

/// How [`GpuModel::decode`] launches a decode step. Both launch the same
/// step (one decode path, [`step`] and [`schedule`]); a step that needs the
/// host in the middle (offloaded KV, tracing, the host selection path) is
/// always launched eagerly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DecodeMode {
    /// Device-resident step buffers, the step captured once as a CUDA graph
    /// and replayed (the default). The first step after a (re)build runs
    /// eagerly (it warms up cuBLAS and the kernels); the second is captured.
    Graph,
    /// The same device-resident step, launched kernel by kernel every time
    /// (no graph): for comparisons and debugging.
    Eager,
}

impl DecodeMode {
    /// From `$SPARDA_DECODE` (`graph`, `eager`; `forward`, the name of a
    /// former separate decode path, now means `eager`); [`DecodeMode::Graph`]
    /// when unset or unrecognised.
    pub fn from_env() -> Self {
        match std::env::var("SPARDA_DECODE").as_deref() {
            Ok("eager") | Ok("forward") => DecodeMode::Eager,
            _ => DecodeMode::Graph,
        }
    }
}

/// How the rows of a prefill call attend (`--prefill-attention`, spec §6).
/// Both compute the same attention — dense causal without bias, or sparse
/// over each row's own block selection with the NOSA bias on the scaled
/// logits (spec §5) — from the same bf16 queries, KV cache and block lists
/// into the same bf16 output; only the kernel and its summation order
/// differ. Decode steps are not affected. The engine starts with
/// [`PrefillAttention::for_head_dim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PrefillAttention {
    /// The decode attention kernel once per query row, split-K with
    /// `attn_combine` (kernels/attn_decode.cu): any head dim.
    Rowwise,
    /// Tiles of (row, query head) pairs against tiles of keys on the tensor
    /// cores with an online softmax, no split-K (kernels/attn_prefill.cu):
    /// head dims 64, 80 and 128 ([`ops::PREFILL_ATTN_FUNCTIONS`]). Sparse
    /// prefill iterates each tile's union of its rows' selected blocks,
    /// built on the device, masking the blocks a row did not select
    /// ([`ops::PREFILL_SPARSE_ATTN_FUNCTIONS`]).
    TensorCore,
}

impl PrefillAttention {
    /// The engine's default for head dim `d`: [`PrefillAttention::TensorCore`]
    /// where it has a kernel (D = 64, 80, 128; 1.8–2.9× the rowwise prefill
    /// of NOSA-8B at 16K on an H200, benches/results/prefill_*), else
    /// [`PrefillAttention::Rowwise`].
    pub fn for_head_dim(d: usize) -> Self {
        if ops::prefill_attn_function("prefill attention", d).is_ok() {
            PrefillAttention::TensorCore
        } else {
            PrefillAttention::Rowwise
        }
    }

    /// The CLI spelling (`--prefill-attention`), also in JSON reports:
    /// `rowwise` or `tensor-core`.
    pub fn name(self) -> &'static str {
        match self {
            PrefillAttention::Rowwise => "rowwise",
            PrefillAttention::TensorCore => "tensor-core",
        }
    }
}

/// The pieces of a decode step, for [`GpuModel::profile_step`]: each is
/// every launch of that kind in one step (per-layer pieces over all layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum StepPart {
    /// Embedding gather and the residual reset.
    Embed,
    /// Residual add + input RMSNorm.
    NormIn,
    /// Fused QKV GEMM (+bias).
    Qkv,
    /// RoPE, K/V append, eviction score (δ·v in f32).
    RopeAppend,
    /// Incremental compression (Kc, p).
    Compress,
    /// Query-aware window scores (logits, softmax statistics, scores).
    WindowScores,
    /// Block pooling and top-k selection.
    Select,
    /// Split-K attention partials (prefill chunks on the tensor cores: the
    /// whole attention).
    Attention,
    /// Split-K combine (`attn_combine`).
    Combine,
    /// O projection (+bias).
    OProj,
    /// Residual add + post-attention RMSNorm.
    NormPost,
    /// gate|up GEMM (+bias).
    GateUp,
    /// SwiGLU.
    Swiglu,
    /// down projection (+bias).
    Down,
    /// Final residual add + norm.
    FinalNorm,
    /// lm_head GEMM.
    LmHead,
    /// Greedy argmax and the advance of the step inputs.
    Argmax,
}

impl StepPart {
    /// Every piece, in step order.
    pub const ALL: [StepPart; 17] = [
        StepPart::Embed,
        StepPart::NormIn,
        StepPart::Qkv,
        StepPart::RopeAppend,
        StepPart::Compress,
        StepPart::WindowScores,
        StepPart::Select,
        StepPart::Attention,
        StepPart::Combine,
        StepPart::OProj,
        StepPart::NormPost,
        StepPart::GateUp,
        StepPart::Swiglu,
        StepPart::Down,
        StepPart::FinalNorm,
        StepPart::LmHead,
        StepPart::Argmax,
    ];
}

/// How sparse-attention rows get their selected blocks (spec §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum SelectionPath {
    /// On the GPU (the default): per layer, `compress_windows` completes Kc
    /// and p (f32) of each sequence from its K/c caches, then
    /// `qa_window_logits` / `qa_window_scores` / `select_blocks`
    /// (kernels/compress.cu, kernels/select.cu, see [`select`]) choose
    /// the blocks of every sparse row, through the engine's per-row pointer
    /// tables (so a prefill chunk's rows each select over their own prefix).
    Gpu,
    /// A check path (`SPARDA_SELECTION=host`, gpu-check-e2e's host-selection
    /// case): K and c mirrored on the host, Kc/p and selection
    /// computed by [`crate::model::select`] on the GPU's own post-RoPE
    /// queries (downloaded every layer), block lists uploaded. Correct but
    /// synchronous: for checks, not for speed.
    HostFallback,
}

/// One decoder layer's weights on the GPU (bf16 matrices in the Hugging Face
/// `[out, in]` layout; biases f32).
pub(crate) struct LayerWeights {
    /// input_layernorm, [d].
    pub(crate) input_norm: CudaSlice<Bf16>,
    /// post_attention_layernorm, [d].
    pub(crate) post_norm: CudaSlice<Bf16>,
    /// [q; k; v; 0-padding] (+ forecast rows), [qkv_cols, d].
    pub(crate) wqkv: CudaSlice<Bf16>,
    /// Fused q|k|v bias (0 for the padding rows), [qkv_cols].
    pub(crate) bqkv: Option<CudaSlice<f32>>,
    /// The eviction head on values (A, δ [Hkv, Hkv·D], b; f32): the append
    /// kernel's eviction score, and scoring synthetic K/V
    /// ([`GpuModel::fill_synthetic`]); NOSA only.
    pub(crate) evict_head: Option<ops::EvictionWeights>,
    /// o_proj, [d, H·D].
    pub(crate) wo: CudaSlice<Bf16>,
    pub(crate) bo: Option<CudaSlice<f32>>,
    /// [gate; up], [2I, d].
    pub(crate) wgu: CudaSlice<Bf16>,
    pub(crate) bgu: Option<CudaSlice<f32>>,
    /// down_proj, [d, I].
    pub(crate) wdown: CudaSlice<Bf16>,
    pub(crate) bdown: Option<CudaSlice<f32>>,
}

/// A model on the GPU. See the module doc for what it computes.
pub struct GpuModel {
    pub(crate) gpu: Arc<Gpu>,
    /// The model's config (overrides applied).
    pub config: ModelConfig,
    /// The attention in force (as [`crate::cpu::CpuModel::plan`]).
    pub plan: AttentionPlan,
    pub(crate) prefill_mode: PrefillMode,
    /// The attention kernel of prefill rows ([`GpuModel::set_prefill_attention`]).
    pub(crate) prefill_attention: PrefillAttention,
    pub(crate) rope: Rope,
    pub(crate) rope_tables: Option<RopeTables>,
    pub(crate) embed: CudaSlice<Bf16>,
    /// `None` when tied to `embed`.
    pub(crate) lm_head: Option<CudaSlice<Bf16>>,
    /// Final norm weight divided by the muP logit divisor, bf16 [d].
    pub(crate) final_norm: CudaSlice<Bf16>,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) eviction: bool,
    /// Row width of the fused QKV output (padded; forecast rows included).
    pub(crate) qkv_cols: usize,
    pub(crate) ws: Option<Workspace>,
    pub(crate) step: Option<DecodeStep>,
    pub(crate) decode_mode: DecodeMode,
    /// When set, step enqueues launch only this piece ([`GpuModel::profile_step`]).
    pub(crate) only_part: std::cell::Cell<Option<StepPart>>,
    /// Set for the launches of one decode step whose GEMVs fold their
    /// neighbours in ([`GpuModel::gemv_fusion_applies`]; layer.rs).
    pub(crate) fused_gemv: std::cell::Cell<bool>,
    pub(crate) selection: SelectionPath,
    pub(crate) record_selections: bool,
    /// Activation capture for forecast collection ([`GpuModel::set_capture`]).
    pub(crate) capture: Option<capture::GpuCapture>,
    /// The per-CTA timeline buffers ([`GpuModel::set_cta_log`]).
    pub(crate) cta_log: Option<cta_log::CtaLogBuffers>,
    /// `[layer][row][kv_head]`: the blocks each row attended in the last
    /// forward call (empty for dense rows), when recording.
    pub(crate) last_selections: Vec<Vec<Vec<Vec<usize>>>>,
    /// `[layer][row]`: each row's post-RoPE query (H·D, f32 from bf16) in
    /// the last sparse forward call, when recording.
    pub(crate) last_queries: Vec<Vec<Vec<f32>>>,
    /// `[layer][row]`: the forecast each row's layer selected with in the
    /// last decode step in forecast mode (Hkv·D, f32 from bf16), when
    /// recording.
    pub(crate) last_forecasts: Vec<Vec<Vec<f32>>>,
    /// Where the logits of the last call are.
    pub(crate) last: LastLogits,
    /// Offloaded KV settings (`--kv offload`), for sequences offloaded
    /// through [`GpuModel::offload_sequence`].
    pub(crate) offload: Option<OffloadOptions>,
    /// The fetch table of this GPU ([`crate::kv::fetch_table`]), loaded by
    /// [`GpuModel::set_offload`] for `--fetch auto`; `None`: SparDA's rule.
    pub(crate) fetch_table: Option<std::sync::Arc<crate::kv::fetch_table::FetchTable>>,
    /// u64 [L, 2]: selected and fetched blocks per layer (offload).
    pub(crate) offload_counters: CudaSlice<u64>,
    /// Time every fetch with events ([`GpuModel::set_fetch_timing`]).
    pub(crate) fetch_timing: bool,
    pub(crate) fetch_ms: f64,
    pub(crate) timed_bytes: u64,
    pub(crate) fetched_at_timing: u64,
    pub(crate) offload_steps: u64,
    /// QKV columns without forecast rows.
    pub(crate) qkv_base_cols: usize,
    /// Forecast mode: (column of the next layer's forecast, column of layer
    /// 0's own forecast) in the fused QKV rows ([`GpuModel::set_forecast`]).
    pub(crate) forecast_cols: Option<(usize, usize)>,
    /// Forecast mode with offloaded KV: prefetch on the copy stream.
    pub(crate) prefetch: bool,
    /// Injected delay before each fetch, µs (stress check).
    pub(crate) copy_delay_us: u32,
    /// Prefetch with the SM copy kernel: size cuBLAS's GEMMs for the SMs
    /// its CTAs leave ([`GpuModel::set_reserve_fetch_sms`]).
    pub(crate) reserve_fetch_sms: bool,
    /// The SM copy kernel's CTAs hold whole SMs ([`GpuModel::set_fetch_whole_sms`]).
    pub(crate) fetch_whole_sms: bool,
    /// GPU spans for `--trace` (disabled: no CUDA calls).
    pub(crate) timeline: std::cell::RefCell<crate::trace::timeline::GpuTimeline>,
    /// Decode steps traced so far (span args).
    pub(crate) trace_step: std::cell::Cell<u32>,
    /// Fetch spans of the step being enqueued, (layer, span).
    pub(crate) fetch_spans: std::cell::RefCell<Vec<(usize, SpanId)>>,
    /// Fetch counts of traced steps, read at [`GpuModel::flush_trace`].
    pub(crate) trace_fetches: std::cell::RefCell<Vec<trace_spans::PendingFetch>>,
    /// The device error record every guarded kernel of this model reports
    /// to (see the module doc); its address never changes.
    pub(crate) device_errors: DeviceErrors,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("layers", &self.layers.len())
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

/// Columns of the fused QKV GEMM output of a model with `h` query heads,
/// `hk` KV heads of dimension `dh`: the q, k and v rows, (H + 2·Hkv)·D,
/// padded to a multiple of [`QKV_ROW_ALIGN`] (forecast rows, when on, come
/// after these). The eviction head adds no rows: its score is computed from
/// v by the append kernel.
pub(crate) fn fused_qkv_cols(h: usize, hk: usize, dh: usize) -> usize {
    ((h + 2 * hk) * dh).div_ceil(QKV_ROW_ALIGN) * QKV_ROW_ALIGN
}

/// Uploads tensor `name` as bf16.
pub(crate) fn upload_bf16(gpu: &Gpu, ckpt: &Checkpoint, name: &str) -> Result<CudaSlice<Bf16>> {
    let v = ckpt.store.to_bf16(name)?;
    gpu.upload(bf16_bits(&v))
}

/// Tensor `name` as f32 if present.
pub(crate) fn opt_f32(ckpt: &Checkpoint, name: &str) -> Result<Option<Vec<f32>>> {
    if ckpt.store.get(name).is_some() {
        Ok(Some(ckpt.store.to_f32(name)?))
    } else {
        Ok(None)
    }
}

impl GpuModel {
    /// Uploads a validated checkpoint's weights (bf16, fused as in the module
    /// doc) and resolves the attention plan exactly as the CPU reference
    /// does ([`AttentionPlan::resolve`]).
    ///
    /// Errors: [`Error::Input`] for overrides the checkpoint cannot honour or
    /// a head dim the attention kernel does not support (not a multiple of
    /// 16, or above 128); [`Error::Checkpoint`] for an unreadable tensor;
    /// [`Error::Cuda`] on an allocation or copy failure (e.g. out of device
    /// memory).
    pub fn new(gpu: Arc<Gpu>, ckpt: &Checkpoint, opts: EngineOptions) -> Result<Self> {
        let cfg = ckpt.config.clone();
        let plan = AttentionPlan::resolve(&cfg, ckpt.eviction_heads, opts.attention)?;
        let (h, hk, dh, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        ops::check_attn_head_dim("the CUDA backend", dh)?;
        if hk == 0 || h % hk != 0 {
            return Err(Error::Input(format!(
                "{h} query heads is not a multiple of {hk} KV heads"
            )));
        }
        let eviction = ckpt.eviction_heads;
        let qkv_cols = fused_qkv_cols(h, hk, dh);
        let g = &*gpu;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            use LayerTensor as T;
            let n = |t: T| names::layer(i, t);
            // Fused [q; k; v; pad] rows.
            let mut w: Vec<half::bf16> = Vec::with_capacity(qkv_cols * d);
            for t in [T::QProj, T::KProj, T::VProj] {
                w.extend_from_slice(&ckpt.store.to_bf16(&n(t))?);
            }
            let bv = opt_f32(ckpt, &n(T::VBias))?;
            let evict_head = if eviction {
                // f32 on the device: the checkpoint's values exactly.
                Some(ops::EvictionWeights::new(
                    g,
                    &ckpt.store.to_f32(&n(T::EvictA))?,
                    &ckpt.store.to_f32(&n(T::EvictDelta))?,
                    opt_f32(ckpt, &n(T::EvictDeltaBias))?.as_deref(),
                    hk,
                    dh,
                )?)
            } else {
                None
            };
            w.resize(qkv_cols * d, half::bf16::ZERO);
            let bq = opt_f32(ckpt, &n(T::QBias))?;
            let bk = opt_f32(ckpt, &n(T::KBias))?;
            let bqkv = if bq.is_some() || bk.is_some() || bv.is_some() {
                let mut b = vec![0.0f32; qkv_cols];
                for (off, src) in [(0, &bq), (h * dh, &bk), ((h + hk) * dh, &bv)] {
                    if let Some(s) = src {
                        b[off..off + s.len()].copy_from_slice(s);
                    }
                }
                Some(g.upload(&b)?)
            } else {
                None
            };
            let mut wgu = ckpt.store.to_bf16(&n(T::GateProj))?;
            wgu.extend_from_slice(&ckpt.store.to_bf16(&n(T::UpProj))?);
            let bgu = match (
                opt_f32(ckpt, &n(T::GateBias))?,
                opt_f32(ckpt, &n(T::UpBias))?,
            ) {
                (None, None) => None,
                (gb, ub) => {
                    let i_ = cfg.intermediate_size;
                    let mut b = gb.unwrap_or_else(|| vec![0.0; i_]);
                    b.extend(ub.unwrap_or_else(|| vec![0.0; i_]));
                    Some(g.upload(&b)?)
                }
            };
            let up_opt = |name: String| -> Result<Option<CudaSlice<f32>>> {
                opt_f32(ckpt, &name)?.map(|v| g.upload(&v)).transpose()
            };
            layers.push(LayerWeights {
                input_norm: upload_bf16(g, ckpt, &n(T::InputNorm))?,
                post_norm: upload_bf16(g, ckpt, &n(T::PostAttnNorm))?,
                wqkv: g.upload(bf16_bits(&w))?,
                bqkv,
                evict_head,
                wo: upload_bf16(g, ckpt, &n(T::OProj))?,
                bo: up_opt(n(T::OBias))?,
                wgu: g.upload(bf16_bits(&wgu))?,
                bgu,
                wdown: upload_bf16(g, ckpt, &n(T::DownProj))?,
                bdown: up_opt(n(T::DownBias))?,
            });
        }
        let embed = upload_bf16(g, ckpt, &names::embed())?;
        let lm_head = if ckpt.lm_head_tied {
            None
        } else {
            Some(upload_bf16(g, ckpt, &names::lm_head())?)
        };
        let div = cfg.logit_divisor();
        let fnorm: Vec<Bf16> = ckpt
            .store
            .to_f32(&names::final_norm())?
            .into_iter()
            .map(|x| Bf16::from_f32(x / div))
            .collect();
        let final_norm = g.upload(&fnorm)?;
        Ok(GpuModel {
            rope: cfg.rope(),
            rope_tables: None,
            embed,
            lm_head,
            final_norm,
            layers,
            eviction,
            qkv_cols,
            ws: None,
            step: None,
            decode_mode: DecodeMode::from_env(),
            only_part: std::cell::Cell::new(None),
            fused_gemv: std::cell::Cell::new(false),
            selection: default_selection_path(),
            record_selections: false,
            capture: None,
            cta_log: None,
            last_selections: Vec::new(),
            last_queries: Vec::new(),
            last_forecasts: Vec::new(),
            last: LastLogits::None,
            offload: None,
            fetch_table: None,
            offload_counters: g.zeros(2 * cfg.num_hidden_layers.max(1))?,
            fetch_timing: false,
            fetch_ms: 0.0,
            timed_bytes: 0,
            fetched_at_timing: 0,
            offload_steps: 0,
            qkv_base_cols: qkv_cols,
            forecast_cols: None,
            prefetch: false,
            copy_delay_us: 0,
            reserve_fetch_sms: false,
            fetch_whole_sms: false,
            timeline: std::cell::RefCell::new(crate::trace::timeline::GpuTimeline::new(g, false)?),
            trace_step: std::cell::Cell::new(0),
            fetch_spans: std::cell::RefCell::new(Vec::new()),
            trace_fetches: std::cell::RefCell::new(Vec::new()),
            device_errors: DeviceErrors::new(g)?,
            prefill_mode: opts.prefill,
            prefill_attention: PrefillAttention::for_head_dim(cfg.head_dim),
            plan,
            config: cfg,
            gpu,
        })
    }

    /// The GPU this model lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// How sparse rows get their block selection.
    pub fn selection_path(&self) -> SelectionPath {
        self.selection
    }

    /// This model with selection path `path`. Sequences carry the state of
    /// the path they were made under: create them after this call.
    pub fn with_selection_path(mut self, path: SelectionPath) -> Self {
        self.selection = path;
        self.step = None;
        self
    }

    /// Re-resolves the attention plan with `opts` (as [`GpuModel::new`]
    /// does), keeping the weights: e.g. dense and sparse benchmarks on one
    /// upload. Sequences carry the state of the plan they were made under:
    /// create them after this call.
    ///
    /// Errors: [`Error::Input`] for overrides the checkpoint cannot honour;
    /// with offload on ([`GpuModel::set_offload`]), the errors of
    /// `set_offload` for a plan that breaks its rules (then nothing changes:
    /// turn offload off first to switch to such a plan).
    pub fn set_options(&mut self, opts: EngineOptions) -> Result<()> {
        let plan = AttentionPlan::resolve(&self.config, self.eviction, opts.attention)?;
        let old = std::mem::replace(&mut self.plan, plan);
        if let Some(o) = self.offload {
            // the new budget must still hold offload's rules (slot pool size, dense_len)
            if let Err(e) = self.set_offload(Some(o)) {
                self.plan = old;
                return Err(e);
            }
        }
        self.prefill_mode = opts.prefill;
        self.step = None;
        self.last = LastLogits::None;
        Ok(())
    }

    /// Sets the attention kernel of prefill rows, dense and sparse (default
    /// [`PrefillAttention::for_head_dim`]); decode steps are not affected. Takes
    /// effect at the next prefill call.
    ///
    /// Errors: [`Error::Input`] naming the head dim when
    /// [`PrefillAttention::TensorCore`] is asked for a model whose head dim
    /// has no tensor-core kernel (only D = 64, 80, 128 have one); the
    /// setting is then left as it was.
    pub fn set_prefill_attention(&mut self, a: PrefillAttention) -> Result<()> {
        if a == PrefillAttention::TensorCore {
            ops::prefill_attn_function("--prefill-attention tensor-core", self.config.head_dim)?;
        }
        self.prefill_attention = a;
        Ok(())
    }

    /// The attention kernel of prefill rows.
    pub fn prefill_attention(&self) -> PrefillAttention {
        self.prefill_attention
    }

    /// Sets how decode steps run (default: `$SPARDA_DECODE`, else
    /// [`DecodeMode::Graph`]); drops any captured step.
    pub fn set_decode_mode(&mut self, mode: DecodeMode) {
        self.decode_mode = mode;
        self.step = None;
    }

    /// How decode steps run.
    pub fn decode_mode(&self) -> DecodeMode {
        self.decode_mode
    }

    /// Frees the decode step's and the forward call's scratch buffers (and
    /// the captured graph); they are allocated again when next needed.
    pub fn release_buffers(&mut self) {
        self.step = None;
        self.ws = None;
        self.last = LastLogits::None;
    }

    /// Whether the last decode step ran as a replayed CUDA graph.
    pub fn last_step_was_graph(&self) -> bool {
        self.step.as_ref().is_some_and(|s| s.replayed)
    }

    /// Whether piece `p` of a step is enqueued (always, unless profiling another piece).
    pub(crate) fn on(&self, p: StepPart) -> bool {
        self.only_part.get().is_none_or(|q| q == p)
    }

    /// Whether a decode step of `n` rows runs its layers on the fused
    /// small-batch GEMVs (kernels/gemv.cu, [`ops::launch_gemv`]): the QKV
    /// and gate|up projections normalise the residual stream themselves,
    /// the gate|up projection applies SwiGLU to its outputs, and the O and down
    /// projections add into the residual stream, so no RMSNorm, SwiGLU or
    /// residual-add kernel runs between layer 1's QKV and the lm_head
    /// (which normalises too). It applies when [`Gpu::small_gemv_takes`] n rows, no
    /// projection has a bias, every GEMV input fits ([`ops::gemv_fits`]) and
    /// every weight is 16-byte aligned.
    pub(crate) fn gemv_fusion_applies(&self, n: usize) -> bool {
        let c = &self.config;
        let gpu = &*self.gpu;
        let aligned = |w: &CudaSlice<Bf16>| dptr(gpu, w).is_multiple_of(16);
        gpu.small_gemv_takes(n)
            && [
                c.hidden_size,
                c.num_attention_heads * c.head_dim,
                c.intermediate_size,
            ]
            .iter()
            .all(|&k| ops::gemv_fits(n, k))
            && aligned(self.lm_head.as_ref().unwrap_or(&self.embed))
            && self.layers.iter().all(|lw| {
                lw.bqkv.is_none()
                    && lw.bo.is_none()
                    && lw.bgu.is_none()
                    && lw.bdown.is_none()
                    && [&lw.wqkv, &lw.wo, &lw.wgu, &lw.wdown]
                        .into_iter()
                        .all(aligned)
            })
    }

    /// Whether sparse attention runs anywhere in this plan (NOSA or InfLLM-V2).
    pub(crate) fn sparse_plan(&self) -> bool {
        self.plan.mode != AttentionMode::Dense
    }

    /// Whether this plan keeps Kc/p on the GPU (sparse plan, GPU selection).
    pub(crate) fn gpu_selection(&self) -> bool {
        self.sparse_plan() && self.selection == SelectionPath::Gpu
    }

    /// Keep (true) or drop the per-layer block selections of each forward
    /// call, for [`GpuModel::last_selections`] (tests; costs a download per
    /// layer on GPU selection paths).
    pub fn set_record_selections(&mut self, on: bool) {
        self.record_selections = on;
        self.last_selections.clear();
        self.last_queries.clear();
        self.last_forecasts.clear();
    }

    /// `[layer][row][kv_head]`: ascending block ids each row of the last
    /// forward call attended (empty for dense rows), when recording is on.
    /// Rows are prompt tokens of the last prefill chunk, or sequences of the
    /// last decode step, in order.
    pub fn last_selections(&self) -> &[Vec<Vec<Vec<usize>>>] {
        &self.last_selections
    }

    /// `[layer][row]`: the post-RoPE query (H·D values, bf16 widened to f32)
    /// each row used for selection in the last forward call, when recording
    /// is on and the call had sparse rows (empty otherwise). For explaining
    /// selection differences against the CPU reference.
    pub fn last_queries(&self) -> &[Vec<Vec<f32>>] {
        &self.last_queries
    }

    /// `[layer][row]`: in forecast mode, the post-RoPE forecast (Hkv·D
    /// values, bf16 widened to f32; spec §4) that chose each row's blocks of
    /// that layer in the last decode step — layer 0's own from q_curr_proj,
    /// layer l ≥ 1's from layer l−1's q_future_proj — when recording is on
    /// and the step had sparse rows (empty otherwise). For explaining
    /// forecast-selection differences against the CPU reference.
    pub fn last_forecasts(&self) -> &[Vec<Vec<f32>>] {
        &self.last_forecasts
    }

    /// Bytes of device memory the weights take.
    pub fn weight_bytes(&self) -> usize {
        let b16 = |s: &CudaSlice<Bf16>| s.len() * 2;
        let f = |s: &Option<CudaSlice<f32>>| s.as_ref().map_or(0, |x| x.len() * 4);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                b16(&l.input_norm)
                    + b16(&l.post_norm)
                    + b16(&l.wqkv)
                    + b16(&l.wo)
                    + b16(&l.wgu)
                    + b16(&l.wdown)
                    + f(&l.bqkv)
                    + f(&l.bo)
                    + f(&l.bgu)
                    + f(&l.bdown)
                    + l.evict_head.as_ref().map_or(0, |e| {
                        (e.delta.len() + e.a.len() + e.bias.as_ref().map_or(0, |b| b.len())) * 4
                    })
            })
            .sum();
        layers + b16(&self.embed) + self.lm_head.as_ref().map_or(0, b16) + b16(&self.final_norm)
    }

    /// Makes the decode RoPE table ([`RopeTables::for_decode`]: row p at
    /// sequence length p + 1) cover positions 0 … need−1.
    pub(crate) fn ensure_rope(&mut self, need: usize) -> Result<()> {
        if self.rope_tables.as_ref().is_some_and(|t| t.rows >= need) {
            return Ok(());
        }
        let max = self.config.max_position_embeddings;
        let have = self.rope_tables.as_ref().map_or(0, |t| t.rows);
        let rows = need.max(2 * have).max(4096).min(max.max(need));
        self.rope_tables = Some(RopeTables::for_decode(
            &self.gpu,
            &self.rope,
            self.config.head_dim,
            rows,
        )?);
        Ok(())
    }

    /// Whether a prefill reaching `prompt_len` tokens rotates its positions
    /// with other angles than the decode table's: dynamic NTK RoPE past its
    /// original maximum, where the CPU reference rotates every prompt
    /// position at the prompt's whole length (spec §1; the result does not
    /// depend on chunking).
    pub(crate) fn prefill_needs_own_rope(&self, prompt_len: usize) -> bool {
        matches!(self.config.rope_scaling,
            RopeScaling::Dynamic { original_max_position_embeddings: orig, .. } if prompt_len > orig)
    }

    /// The table a prefill of `prompt_len` tokens rotates with when
    /// [`GpuModel::prefill_needs_own_rope`]: positions 0 … prompt_len−1 at
    /// sequence length prompt_len.
    ///
    /// Errors: [`Error::Cuda`] on a copy failure.
    pub(crate) fn prefill_rope(&self, prompt_len: usize) -> Result<RopeTables> {
        RopeTables::from_rope(
            &self.gpu,
            &self.rope,
            self.config.head_dim,
            prompt_len,
            prompt_len,
        )
    }

    /// The logits of the last call, f32 [rows, V] on the device (rows = 1
    /// after a prefill, B after a decode step; see [`GpuModel::logit_rows`]).
    ///
    /// Errors: [`Error::Input`] before any call produced logits.
    pub fn logits(&self) -> Result<cudarc::driver::CudaView<'_, f32>> {
        let v = self.config.vocab_size;
        match (self.last, &self.ws, &self.step) {
            (LastLogits::Forward(n), Some(ws), _) => Ok(ws.logits.slice(0..n * v)),
            (LastLogits::Step(n), _, Some(st)) => Ok(st.ws.logits.slice(0..n * v)),
            _ => Err(Error::Input(
                "no logits yet: run prefill or decode first".into(),
            )),
        }
    }

    /// Rows of [`GpuModel::logits`].
    pub fn logit_rows(&self) -> usize {
        match self.last {
            LastLogits::None => 0,
            LastLogits::Forward(n) | LastLogits::Step(n) => n,
        }
    }

    /// The logits of the last call copied to the host, [rows, V] (synchronises).
    ///
    /// Errors: as [`GpuModel::logits`]; [`Error::Cuda`] on a copy failure;
    /// a device error raised since the last check (see
    /// [`GpuModel::check_device_errors`]).
    pub fn download_logits(&self) -> Result<Vec<f32>> {
        let l = self.logits()?;
        let v = self.gpu.download(&l)?;
        self.device_errors.take()?;
        Ok(v)
    }

    /// Checks the device error record (see the module doc): synchronises the
    /// compute stream, then returns the first error a guarded kernel raised
    /// since the last check and clears the record. The engine checks it
    /// itself in [`GpuModel::argmax`], [`GpuModel::sample`],
    /// [`GpuModel::download_logits`], [`GpuModel::offload_stats`] and at the
    /// end of [`GpuModel::prefill`]; call this after device-fed steps
    /// ([`GpuModel::decode_greedy`]) that none of those follow.
    ///
    /// Errors: [`Error::Limit`] naming the kernel (`qkv_rope_append`,
    /// `select_blocks`, `slot_diff`), layer, row (a sequence of a decode
    /// batch, a token of a prefill chunk), KV head and the numbers (position
    /// vs RoPE table rows, blocks vs the launch's cap, misses vs free slots);
    /// [`Error::Cuda`] when the stream fails or the record is corrupt.
    pub fn check_device_errors(&self) -> Result<()> {
        self.gpu.synchronize()?;
        self.device_errors.take()
    }

    /// Sampling on the GPU: one token per row of the last logits
    /// ([`GpuModel::logits`]) with the uniform draws `u01` (\[rows\], in
    /// [0, 1); e.g. [`crate::sample::Sampler::draw`]), by the rule of
    /// [`crate::sample::sample_with_u`]; greedy parameters give
    /// [`GpuModel::argmax`]. Synchronises; only the ids travel.
    ///
    /// Errors: as [`ops::sample_rows`]; [`Error::Input`] before any logits
    /// or when `u01` does not hold one draw per row; a device error raised
    /// since the last check (see [`GpuModel::check_device_errors`]), among
    /// them [`Error::NonFiniteLogits`] naming the sequence (row) of a logits
    /// row no token can be chosen from ([`crate::sample::check_logits`]'s
    /// rule, applied by the kernels; read with the ids, no extra copy).
    pub fn sample(
        &mut self,
        params: &crate::sample::SamplingParams,
        u01: &[f64],
    ) -> Result<Vec<u32>> {
        if params.temperature == 0.0 || params.top_k == 1 {
            return self.argmax();
        }
        let rows = self.logit_rows();
        let logits = self.logits()?;
        let ids = ops::sample_rows(
            &self.gpu,
            &logits,
            rows,
            self.config.vocab_size,
            params,
            u01,
            self.device_errors.sink(0),
        )?;
        self.device_errors.take()?;
        Ok(ids)
    }

    /// Greedy sampling on the GPU: the argmax of each logits row (ties to the
    /// lower id), \[rows\] (synchronises; only the ids travel).
    /// After a device-resident decode step the step computed it already.
    ///
    /// Errors: as [`GpuModel::logits`]; [`Error::Cuda`] on a failure; a
    /// device error raised since the last check (see
    /// [`GpuModel::check_device_errors`]), among them
    /// [`Error::NonFiniteLogits`] naming the sequence (row) of a logits row
    /// with a NaN, a +∞ or no finite entry ([`crate::sample::check_logits`]'s
    /// rule, applied by the argmax kernels; read with the ids, no extra
    /// copy).
    pub fn argmax(&mut self) -> Result<Vec<u32>> {
        let ids = self.argmax_rows()?;
        self.device_errors.take()?;
        Ok(ids)
    }

    /// [`GpuModel::argmax`] without the device error check.
    fn argmax_rows(&mut self) -> Result<Vec<u32>> {
        match self.last {
            LastLogits::Step(n) => {
                let st = self.step.as_ref().expect("a step produced the logits");
                self.gpu.download(&st.ws.argmax.slice(0..n))
            }
            LastLogits::Forward(rows) => {
                let gpu = self.gpu.clone();
                let ws = self.ws.as_mut().expect("logits imply a workspace");
                let (lp, op) = (dptr(&gpu, &ws.logits), dptr(&gpu, &ws.argmax));
                let rec = self.device_errors.device_ptr();
                ops::launch_argmax_rows(&gpu, lp, rows, self.config.vocab_size, op, rec)?;
                gpu.download(&ws.argmax.slice(0..rows))
            }
            LastLogits::None => Err(Error::Input(
                "no logits yet: run prefill or decode first".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused QKV rows are q, k and v only (the eviction score is
    /// computed from v by the append kernel), padded to 8.
    #[test]
    fn fused_qkv_has_no_eviction_rows() {
        // NOSA-8B: H 32, Hkv 2, D 128.
        assert_eq!(fused_qkv_cols(32, 2, 128), (32 + 4) * 128);
        // Tiny: H 6, Hkv 2, D 64.
        assert_eq!(fused_qkv_cols(6, 2, 64), 10 * 64);
        // Padding to a multiple of QKV_ROW_ALIGN.
        assert_eq!(fused_qkv_cols(3, 1, 2), 16);
        assert_eq!(fused_qkv_cols(3, 1, 2) % QKV_ROW_ALIGN, 0);
    }

    /// The engine's default prefill attention: the tensor cores for the head
    /// dims that have a kernel, rowwise for the others.
    #[test]
    fn prefill_attention_defaults_to_tensor_cores_where_a_kernel_exists() {
        for d in [64, 80, 128] {
            assert_eq!(
                PrefillAttention::for_head_dim(d),
                PrefillAttention::TensorCore,
                "D {d}"
            );
        }
        for d in [32, 96, 112, 256] {
            assert_eq!(
                PrefillAttention::for_head_dim(d),
                PrefillAttention::Rowwise,
                "D {d}"
            );
        }
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    #[test]
    fn prefill_chunk_values_are_multiples_of_64_up_to_4096() {
        assert_eq!(parse_prefill_chunk("2048").unwrap(), 2048);
        assert_eq!(parse_prefill_chunk(" 64 ").unwrap(), 64);
        for bad in ["0", "100", "8192", "-64", "big", ""] {
            let e = parse_prefill_chunk(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{ENV_PREFILL_CHUNK}={bad}")) && e.contains("64 … 4096"),
                "{bad}: {e}"
            );
        }
    }
}
