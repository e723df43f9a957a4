//! The GPU-resident decode engine (issue 3): a model's weights on the GPU in
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
//!   [q | k | v | z] = x̂ · Wqkvzᵀ                   one GEMM      cuBLAS
//!   RoPE(q, k); K/V cache[pos] = k, v;                           qkv_rope_append
//!   c[pos] = A · softplus(z + zb)
//!   attention: dense (no bias) or sparse over the selected blocks (+c bias)
//!   o = attn · Woᵀ ; resid += o·s ; x̂ = RMSNorm(resid)          cuBLAS, rmsnorm_residual
//!   x = down(silu(gate) · up), gate|up one GEMM                  cuBLAS, swiglu, cuBLAS
//! h = RMSNorm(resid + x·s) / logit_divisor ; logits = h · lm_headᵀ (f32)
//! ```
//!
//! with s = scale_depth/√L under muP (else 1). Fusions and layouts:
//! - `Wqkvz` stacks q_proj, k_proj, v_proj and, for NOSA checkpoints, the
//!   eviction head folded into the value projection: z = δ·(W_v x̂ + b_v) =
//!   (δ·W_v) x̂ + δ·b_v, so the Hkv rows δ·W_v (computed in f32 at load, then
//!   rounded to bf16) ride in the same GEMM; rows are padded to a multiple of
//!   8. The eviction score c = A·softplus(z + b + δ·b_v) is computed in f32
//!   by the append kernel.
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
//! only when a capacity, the batch or its sequences change (see
//! [`DecodeMode`]).
//!
//! Sparse selection (spec §4) plugs in per layer after the append; see
//! [`SelectionPath`]. A clearly labelled host fallback mirrors each
//! sequence's K and c on the host (downloaded row by row as they are
//! appended), computes Kc/p and the selection with the CPU reference's own
//! functions on the GPU's post-RoPE bf16 queries, and uploads the block
//! lists. That path synchronises every layer and is for correctness checks
//! only.

use super::context::{dptr, grid, i32_dim, CudaResultExt};
use super::ops::{self, AttnArgs, RopeTables};
use super::select::{ensure_smem, launch_select_blocks, SelectBlocksArgs};
use super::{bf16_bits, Bf16, Gpu};
use crate::config::{AttentionMode, ModelConfig, Rope, RopeScaling};
use crate::cpu::EngineOptions;
use crate::cuda::timeline::SpanId;
use crate::model::select::{self, Budget};
use crate::model::state::LayerKv;
use crate::model::{AttentionPlan, PrefillMode};
use crate::weights::names::{self, LayerTensor};
use crate::weights::Checkpoint;
use crate::{Error, Result};
use cudarc::driver::{CudaGraph, CudaSlice, LaunchConfig, PushKernelArg};

#[path = "engine_forecast.rs"]
mod forecast;
#[path = "engine_offload.rs"]
mod offloaded;
#[path = "engine_trace.rs"]
mod tracing_spans;
pub use offloaded::{fetch_rule, FetchEngine, OffloadOptions, OffloadStats};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Prompt tokens per prefill forward call at most (fewer when the attention
/// partials of a long context would exceed [`PARTIALS_BUDGET_BYTES`]).
pub const PREFILL_CHUNK: usize = 512;

/// Upper bound on the split-K attention workspace of one forward call, bytes;
/// bounds the prefill chunk for long contexts (a dense 128K-token context
/// then runs in chunks of a few dozen rows).
pub const PARTIALS_BUDGET_BYTES: usize = 512 << 20;

/// Rows of the fused QKV(+z) weight are padded to a multiple of this.
const QKV_ROW_ALIGN: usize = 8;
/// Per-layer pointer-table entries per row: K, V, c (state), c (bias), Kc, p.
const PTRS_PER_ROW: usize = 6;
/// Per-layer pointer-table entries per sequence: K, c, Kc, p (compression).
const PTRS_PER_SEQ: usize = 4;
/// Cap on the grid of `compress_windows` (it loops over further windows).
const COMPRESS_MAX_GRID_X: usize = 8192;

/// Source of [`GpuSequence`] identities (graph keys compare them).
static NEXT_SEQ_UID: AtomicU64 = AtomicU64::new(1);

/// The selection path from `$SPARDA_SELECTION` (`host` → the host fallback),
/// else [`SelectionPath::Gpu`].
pub fn default_selection_path() -> SelectionPath {
    match std::env::var("SPARDA_SELECTION").as_deref() {
        Ok("host") => SelectionPath::HostFallback,
        _ => SelectionPath::Gpu,
    }
}

/// How [`GpuModel::decode`] runs a decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DecodeMode {
    /// Device-resident step buffers, the step captured once as a CUDA graph
    /// and replayed (the default). The first step after a (re)build runs
    /// eagerly (it warms up cuBLAS and the kernels); the second is captured.
    Graph,
    /// The same device-resident step, launched kernel by kernel every time
    /// (no graph): for comparisons and debugging.
    Eager,
    /// Every step through the general forward call (per-call pointer-table
    /// and input uploads, grids sized by the current lengths), as prefill
    /// runs: for comparisons.
    Forward,
}

impl DecodeMode {
    /// From `$SPARDA_DECODE` (`graph`, `eager`, `forward`); [`DecodeMode::Graph`]
    /// when unset or unrecognised.
    pub fn from_env() -> Self {
        match std::env::var("SPARDA_DECODE").as_deref() {
            Ok("eager") => DecodeMode::Eager,
            Ok("forward") => DecodeMode::Forward,
            _ => DecodeMode::Graph,
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
    /// Fused QKV(+z) GEMM (+bias).
    Qkv,
    /// RoPE, K/V append, eviction score.
    RopeAppend,
    /// Incremental compression (Kc, p).
    Compress,
    /// Query-aware window scores (logits, softmax statistics, scores).
    WindowScores,
    /// Block pooling and top-k selection.
    Select,
    /// Split-K attention partials (and their combine when it is fused
    /// into the attention kernel: [`ops::attn_fused_combine`]).
    Attention,
    /// Split-K combine as its own kernel (not timed when fused).
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
    /// (kernels/compress.cu, kernels/select.cu, see [`super::select`]) choose
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
struct LayerWeights {
    /// input_layernorm, [d].
    input_norm: CudaSlice<Bf16>,
    /// post_attention_layernorm, [d].
    post_norm: CudaSlice<Bf16>,
    /// [q; k; v; δ·W_v; 0-padding], [qkv_cols, d].
    wqkv: CudaSlice<Bf16>,
    /// Fused q|k|v bias (0 for the z and padding rows), [qkv_cols].
    bqkv: Option<CudaSlice<f32>>,
    /// Eviction head A, [Hkv] (NOSA).
    evict_a: Option<CudaSlice<f32>>,
    /// b + δ·b_v, [Hkv] (NOSA).
    evict_zb: Option<CudaSlice<f32>>,
    /// The eviction head on values (A, δ bf16 [Hkv, Hkv·D], b), for scoring
    /// synthetic K/V ([`GpuModel::fill_synthetic`]); NOSA only.
    evict_head: Option<ops::EvictionWeights>,
    /// o_proj, [d, H·D].
    wo: CudaSlice<Bf16>,
    bo: Option<CudaSlice<f32>>,
    /// [gate; up], [2I, d].
    wgu: CudaSlice<Bf16>,
    bgu: Option<CudaSlice<f32>>,
    /// down_proj, [d, I].
    wdown: CudaSlice<Bf16>,
    bdown: Option<CudaSlice<f32>>,
}

/// One layer's state of one sequence on the GPU (spec §3): post-RoPE K and V,
/// bf16 [cap, Hkv, D]; eviction scores c, f32 [cap, Hkv] (eviction heads
/// only); for sparse plans on [`SelectionPath::Gpu`], compressed keys Kc,
/// f32 [capw, Hkv, D], and pooled eviction scores p, f32 [capw, Hkv]
/// (eviction heads only), capw = Mc(cap) windows.
struct SeqLayer {
    k: CudaSlice<Bf16>,
    v: CudaSlice<Bf16>,
    c: Option<CudaSlice<f32>>,
    kc: Option<CudaSlice<f32>>,
    p: Option<CudaSlice<f32>>,
}

/// One sequence's state on the GPU: every layer's K/V/c cache with room for
/// `capacity()` tokens (a multiple of the block size), grown by reallocation
/// (double, copy) whenever a forward call needs more — never silently
/// overflowed (runtime.md §3 fault 1). Create with
/// [`GpuModel::new_sequence`]; a sequence belongs to the model that made it.
pub struct GpuSequence {
    /// Offloaded KV (issue 4): the host store, slot pools and slot maps.
    /// Offloaded layers' `k`/`v` are then tail rings of
    /// [`crate::kv::RING_BLOCKS`] blocks. Declared first: dropped first, its
    /// `Drop` waits for in-flight write-backs before the rings are freed.
    off: Option<offloaded::SeqOffload>,
    /// Being prefilled for offload: its store, written chunk by chunk
    /// (dropped early too: its `Drop` waits for the spills).
    spill: Option<offloaded::Spill>,
    len: usize,
    cap: usize,
    layers: Vec<SeqLayer>,
    /// Host mirror of K, V, c, Kc, p per layer for [`SelectionPath::HostFallback`].
    mirror: Option<Vec<LayerKv>>,
    /// Unique per sequence object (never reused).
    uid: u64,
    /// Bumped whenever the device buffers move (growth).
    generation: u64,
}

impl std::fmt::Debug for GpuSequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSequence")
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish_non_exhaustive()
    }
}

impl GpuSequence {
    /// T: tokens processed so far.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no token was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Tokens the caches hold without growing.
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// Whether this sequence's KV lives in pinned host memory
    /// ([`GpuModel::offload_sequence`]).
    pub fn is_offloaded(&self) -> bool {
        self.off.is_some()
    }
}

/// Scratch buffers of a forward call or of a decode step, sized for `rows`
/// query rows. A forward call grows (reallocates) its workspace when it needs
/// more; a decode step's is allocated once per (re)build and holds
/// per-layer copies of `qkv`, `sel` and `nsel`.
struct Workspace {
    rows: usize,
    /// f32 residual stream, [rows, d].
    resid: CudaSlice<f32>,
    /// Branch output (embedding, o_proj, down_proj), bf16 [rows, d].
    delta: CudaSlice<Bf16>,
    /// Normed activations, bf16 [rows, d].
    xn: CudaSlice<Bf16>,
    /// Fused QKV(+z) output, bf16 [layers, rows, qkv_cols] (layers = 1 in a forward call).
    qkv: CudaSlice<Bf16>,
    /// Attention output, bf16 [rows, H·D].
    attn: CudaSlice<Bf16>,
    /// gate|up output, bf16 [rows, 2I].
    gu: CudaSlice<Bf16>,
    /// SwiGLU output, bf16 [rows, I].
    act: CudaSlice<Bf16>,
    /// Logits, f32 [rows, V].
    logits: CudaSlice<f32>,
    /// Token ids, [rows] (forward calls).
    ids: CudaSlice<u32>,
    /// Positions, [rows] (forward calls).
    pos: CudaSlice<i32>,
    /// pos + 1, [rows] (forward calls).
    lens: CudaSlice<i32>,
    /// Argmax output, [rows].
    argmax: CudaSlice<u32>,
    /// Per-layer pointer tables, u64 [L, PTRS_PER_ROW·rows + PTRS_PER_SEQ·sequences].
    ptrs: CudaSlice<u64>,
    /// Split-K partial outputs, f32.
    part_o: CudaSlice<f32>,
    /// Split-K partial (max, sum) pairs, f32.
    part_ml: CudaSlice<f32>,
    /// Arrival counters of the fused split-K combine, u32 [rows · head
    /// blocks], zero between launches (the kernel leaves them at zero).
    attn_count: CudaSlice<u32>,
    /// Selected block ids, i32 [layers, rows, Hkv, s_max].
    sel: CudaSlice<i32>,
    /// Selected counts, i32 [layers, rows, Hkv].
    nsel: CudaSlice<i32>,
    /// 1 for dense rows of a sparse call, i32 [rows].
    dense: CudaSlice<i32>,
    /// Each sequence's length after the call, i32 [sequences] (compression; forward calls).
    seq_lens: CudaSlice<i32>,
    /// Query-aware window logits, f32 [rows, H, w_stride] (GPU selection).
    qa_logits: CudaSlice<f32>,
    /// Per-tile softmax statistics, f32 [rows, H, tiles, 2].
    qa_stats: CudaSlice<f32>,
    /// Window scores s, f32 [rows, Hkv, w_stride].
    qa_scores: CudaSlice<f32>,
}

/// Device addresses of the per-row inputs the kernels read.
#[derive(Debug, Clone, Copy)]
struct RowInputs {
    /// i32 [rows]: each row's position.
    pos: u64,
    /// i32 [rows]: pos + 1, the tokens each row attends to.
    lens: u64,
    /// i32 [sequences]: each sequence's length after the call (compression).
    seq_lens: u64,
}

/// Geometry of the attention launch of one call or step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AttnGeometry {
    /// Sparse rows (block lists) or dense rows.
    sparse: bool,
    /// Tokens (dense) or list entries (sparse) per split.
    span: usize,
    /// Splits.
    nsplit: usize,
    /// Block-list width (sparse).
    s_max: usize,
}

/// Geometry of GPU selection: query-aware scoring over up to `mc` windows
/// (`w_stride` = mc rounded up to whole tiles) and pooling/selection over
/// up to `nb_cap` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SelGeometry {
    mc: usize,
    w_stride: usize,
    nb_cap: usize,
    s_max: usize,
}

/// One query row of a forward call.
#[derive(Debug, Clone, Copy)]
struct Row {
    /// Index into the call's sequences.
    seq: usize,
    token: u32,
    /// Position in its sequence (0-based).
    pos: usize,
    /// Sparse attention for this row (else dense, no bias).
    sparse: bool,
}

/// Which rows a forward call computes logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogitRows {
    /// None (a prefill chunk before the last).
    None,
    /// The last row only (end of a prefill).
    Last,
    /// Every row (decode: one per sequence).
    All,
}

/// Where the logits of the last call are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LastLogits {
    /// No logits (no call yet, or a prefill chunk before the last).
    None,
    /// The first n rows of the forward workspace.
    Forward(usize),
    /// The decode step's buffers (n rows; the argmax is computed too).
    Step(usize),
}

/// What a captured decode step depends on besides its per-step inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepKey {
    /// (uid, generation) of each row's sequence, in row order.
    seqs: Vec<(u64, u64)>,
    /// Every row sparse (else every row dense).
    sparse: bool,
    /// The batch's largest capacity, tokens: sizes every grid.
    cap: usize,
    /// Rows of the RoPE tables (their buffers move when they grow).
    rope_rows: usize,
    /// Offloaded KV (eager step with slot pools and fetches).
    offload: bool,
}

/// The device-resident decode step of one batch (see the module doc).
struct DecodeStep {
    /// Slot lists, fetch lists and tables of an offloaded batch. First field:
    /// dropped first, its `Drop` waits for the last write-back, which reads
    /// the workspace's pointer tables.
    off: Option<offloaded::StepOffload>,
    key: StepKey,
    /// B: rows = sequences.
    n: usize,
    attn: AttnGeometry,
    sel: SelGeometry,
    /// Step inputs, u32 [ids n | pos n | lens n | seq_lens n]; advanced on the
    /// device by the step's last kernel (`argmax_advance`).
    io: CudaSlice<u32>,
    ws: Workspace,
    graph: Option<CudaGraph>,
    /// Capture failed once: stay eager for this build.
    capture_failed: bool,
    /// The sequence lengths the device inputs describe (the next step's positions).
    dev_lens: Vec<usize>,
    /// Steps run since the build.
    steps: usize,
}

/// A model on the GPU. See the module doc for what it computes.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    /// The model's config (overrides applied).
    pub config: ModelConfig,
    /// The attention in force (as [`crate::cpu::CpuModel::plan`]).
    pub plan: AttentionPlan,
    prefill_mode: PrefillMode,
    rope: Rope,
    rope_tables: Option<RopeTables>,
    embed: CudaSlice<Bf16>,
    /// `None` when tied to `embed`.
    lm_head: Option<CudaSlice<Bf16>>,
    /// Final norm weight divided by the muP logit divisor, bf16 [d].
    final_norm: CudaSlice<Bf16>,
    layers: Vec<LayerWeights>,
    eviction: bool,
    /// Row width of the fused QKV(+z) output (padded).
    qkv_cols: usize,
    /// Column of the first eviction logit z in a fused row.
    z_off: usize,
    ws: Option<Workspace>,
    step: Option<DecodeStep>,
    decode_mode: DecodeMode,
    /// When set, step enqueues launch only this piece ([`GpuModel::profile_step`]).
    only_part: std::cell::Cell<Option<StepPart>>,
    selection: SelectionPath,
    record_selections: bool,
    /// `[layer][row][kv_head]`: the blocks each row attended in the last
    /// forward call (empty for dense rows), when recording.
    last_selections: Vec<Vec<Vec<Vec<usize>>>>,
    /// `[layer][row]`: each row's post-RoPE query (H·D, f32 from bf16) in
    /// the last sparse forward call, when recording.
    last_queries: Vec<Vec<Vec<f32>>>,
    /// Where the logits of the last call are.
    last: LastLogits,
    /// Offloaded KV settings (`--kv offload`), for sequences offloaded
    /// through [`GpuModel::offload_sequence`].
    offload: Option<OffloadOptions>,
    /// u64 [L, 2]: selected and fetched blocks per layer (offload).
    offload_counters: CudaSlice<u64>,
    /// Time every fetch with events ([`GpuModel::set_fetch_timing`]).
    fetch_timing: bool,
    fetch_ms: f64,
    timed_bytes: u64,
    fetched_at_timing: u64,
    offload_steps: u64,
    /// QKV(+z) columns without forecast rows.
    qkv_base_cols: usize,
    /// Forecast mode: (column of the next layer's forecast, column of layer
    /// 0's own forecast) in the fused QKV rows ([`GpuModel::set_forecast`]).
    forecast_cols: Option<(usize, usize)>,
    /// Forecast mode with offloaded KV: prefetch on the copy stream.
    prefetch: bool,
    /// Injected delay before each fetch, µs (stress check).
    copy_delay_us: u32,
    /// GPU spans for `--trace` (disabled: no CUDA calls).
    timeline: std::cell::RefCell<super::timeline::GpuTimeline>,
    /// Decode steps traced so far (span args).
    trace_step: std::cell::Cell<u32>,
    /// Fetch spans of the step being enqueued, (layer, span).
    fetch_spans: std::cell::RefCell<Vec<(usize, SpanId)>>,
    /// Fetch counts of traced steps, read at [`GpuModel::flush_trace`].
    trace_fetches: std::cell::RefCell<Vec<tracing_spans::PendingFetch>>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("layers", &self.layers.len())
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

/// Uploads tensor `name` as bf16.
fn upload_bf16(gpu: &Gpu, ckpt: &Checkpoint, name: &str) -> Result<CudaSlice<Bf16>> {
    let v = ckpt.store.to_bf16(name)?;
    gpu.upload(bf16_bits(&v))
}

/// Tensor `name` as f32 if present.
fn opt_f32(ckpt: &Checkpoint, name: &str) -> Result<Option<Vec<f32>>> {
    if ckpt.store.get(name).is_some() {
        Ok(Some(ckpt.store.to_f32(name)?))
    } else {
        Ok(None)
    }
}

/// Per-layer figures of the layer-GEMM ceiling ([`GpuModel::gemm_ceiling`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmCeiling {
    /// Rows (batch size) of every GEMM.
    pub batch: usize,
    /// Median over replays of the graph of every layer's four GEMMs
    /// (QKV+z, O, gate|up, down), all through cuBLAS, milliseconds: the
    /// ceiling of spec/device.md.
    pub layers_graph_ms: f64,
    /// The same graph with the engine's own routing ([`Gpu::linear`]: the
    /// small-batch kernel for the QKV and O projections at n ≤ 4 when
    /// [`Gpu::set_small_gemv`] is on, else cuBLAS too), milliseconds.
    pub layers_graph_ms_engine: f64,
    /// Median of the lm_head GEMM alone (f32 logits), milliseconds.
    pub lm_head_ms: f64,
    /// Weight bytes the layer GEMMs read per replay.
    pub layer_weight_bytes: usize,
    /// layer_weight_bytes / layers_graph_ms, GB/s.
    pub layers_gb_per_s: f64,
    /// Replays timed.
    pub reps: usize,
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
        let kvd = hk * dh;
        let eviction = ckpt.eviction_heads;
        let z_off = (h + 2 * hk) * dh;
        let qkv_rows = z_off + if eviction { hk } else { 0 };
        let qkv_cols = qkv_rows.div_ceil(QKV_ROW_ALIGN) * QKV_ROW_ALIGN;
        let g = &*gpu;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            use LayerTensor as T;
            let n = |t: T| names::layer(i, t);
            // Fused [q; k; v; δ·W_v; pad] rows.
            let mut w: Vec<half::bf16> = Vec::with_capacity(qkv_cols * d);
            for t in [T::QProj, T::KProj, T::VProj] {
                w.extend_from_slice(&ckpt.store.to_bf16(&n(t))?);
            }
            let bv = opt_f32(ckpt, &n(T::VBias))?;
            let (mut evict_a, mut evict_zb, mut evict_head) = (None, None, None);
            if eviction {
                let delta = ckpt.store.to_f32(&n(T::EvictDelta))?; // [Hkv, kvd]
                let wv = ckpt.store.to_f32(&n(T::VProj))?; // [kvd, d]
                let mut zw = vec![0.0f32; hk * d];
                for hh in 0..hk {
                    let row = &mut zw[hh * d..(hh + 1) * d];
                    for j in 0..kvd {
                        let c = delta[hh * kvd + j];
                        if c != 0.0 {
                            for (r, x) in row.iter_mut().zip(&wv[j * d..(j + 1) * d]) {
                                *r += c * x;
                            }
                        }
                    }
                }
                w.extend(zw.iter().map(|&x| half::bf16::from_f32(x)));
                let b = opt_f32(ckpt, &n(T::EvictDeltaBias))?;
                let zb: Vec<f32> = (0..hk)
                    .map(|hh| {
                        let mut s = b.as_ref().map_or(0.0, |b| b[hh]);
                        if let Some(bv) = &bv {
                            s += (0..kvd).map(|j| delta[hh * kvd + j] * bv[j]).sum::<f32>();
                        }
                        s
                    })
                    .collect();
                let a_host = ckpt.store.to_f32(&n(T::EvictA))?;
                let delta_bf: Vec<Bf16> = delta.iter().map(|&x| Bf16::from_f32(x)).collect();
                evict_head = Some(ops::EvictionWeights::new(
                    g,
                    &a_host,
                    &delta_bf,
                    b.as_deref(),
                    hk,
                    dh,
                )?);
                evict_a = Some(g.upload(&a_host)?);
                evict_zb = Some(g.upload(&zb)?);
            }
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
                evict_a,
                evict_zb,
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
            z_off,
            ws: None,
            step: None,
            decode_mode: DecodeMode::from_env(),
            only_part: std::cell::Cell::new(None),
            selection: default_selection_path(),
            record_selections: false,
            last_selections: Vec::new(),
            last_queries: Vec::new(),
            last: LastLogits::None,
            offload: None,
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
            timeline: std::cell::RefCell::new(super::timeline::GpuTimeline::new(g, false)?),
            trace_step: std::cell::Cell::new(0),
            fetch_spans: std::cell::RefCell::new(Vec::new()),
            trace_fetches: std::cell::RefCell::new(Vec::new()),
            prefill_mode: opts.prefill,
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
    /// Errors: [`Error::Input`] for overrides the checkpoint cannot honour.
    pub fn set_options(&mut self, opts: EngineOptions) -> Result<()> {
        self.plan = AttentionPlan::resolve(&self.config, self.eviction, opts.attention)?;
        self.prefill_mode = opts.prefill;
        self.step = None;
        self.last = LastLogits::None;
        Ok(())
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
        self.step.as_ref().is_some_and(|s| s.graph.is_some())
    }

    /// Whether piece `p` of a step is enqueued (always, unless profiling another piece).
    fn on(&self, p: StepPart) -> bool {
        self.only_part.get().is_none_or(|q| q == p)
    }

    /// Whether sparse attention runs anywhere in this plan (NOSA or InfLLM-V2).
    fn sparse_plan(&self) -> bool {
        self.plan.mode != AttentionMode::Dense
    }

    /// Whether this plan keeps Kc/p on the GPU (sparse plan, GPU selection).
    fn gpu_selection(&self) -> bool {
        self.sparse_plan() && self.selection == SelectionPath::Gpu
    }

    /// Keep (true) or drop the per-layer block selections of each forward
    /// call, for [`GpuModel::last_selections`] (tests; costs a download per
    /// layer on GPU selection paths).
    pub fn set_record_selections(&mut self, on: bool) {
        self.record_selections = on;
        self.last_selections.clear();
        self.last_queries.clear();
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
                    + f(&l.evict_a)
                    + f(&l.evict_zb)
                    + l.evict_head
                        .as_ref()
                        .map_or(0, |e| e.delta.len() * 2 + e.a.len() * 4)
            })
            .sum();
        layers + b16(&self.embed) + self.lm_head.as_ref().map_or(0, b16) + b16(&self.final_norm)
    }

    /// Bytes of device memory one sequence with room for `capacity_tokens`
    /// tokens takes under the current plan and selection path (K, V, c,
    /// and Kc/p for GPU selection), every layer.
    pub fn sequence_bytes(&self, capacity_tokens: usize) -> usize {
        let c = &self.config;
        let bs = self.plan.budget.block_size.max(1);
        let cap = capacity_tokens.max(1).div_ceil(bs) * bs;
        let (hk, kvd) = (c.num_key_value_heads, c.num_key_value_heads * c.head_dim);
        let mut per = cap * kvd * 2 * 2;
        if self.eviction {
            per += cap * hk * 4;
        }
        if self.gpu_selection() {
            let capw = self.plan.budget.windows(cap).max(1);
            per += capw * kvd * 4;
            if self.eviction {
                per += capw * hk * 4;
            }
        }
        per * self.layers.len()
    }

    /// A new, empty sequence with room for `capacity_tokens` tokens (rounded
    /// up to whole blocks; e.g. prompt + max_new_tokens). It grows when a
    /// call needs more.
    ///
    /// Errors: [`Error::Cuda`] when device memory runs out.
    pub fn new_sequence(&self, capacity_tokens: usize) -> Result<GpuSequence> {
        let bs = self.plan.budget.block_size.max(1);
        let cap = capacity_tokens.max(1).div_ceil(bs) * bs;
        let layers = (0..self.layers.len())
            .map(|_| self.alloc_layer(cap))
            .collect::<Result<Vec<_>>>()?;
        let c = &self.config;
        let mirror =
            (self.sparse_plan() && self.selection == SelectionPath::HostFallback).then(|| {
                (0..c.num_hidden_layers)
                    .map(|_| LayerKv::new(c.num_key_value_heads, c.head_dim))
                    .collect()
            });
        Ok(GpuSequence {
            len: 0,
            cap,
            layers,
            mirror,
            uid: NEXT_SEQ_UID.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            off: None,
            spill: None,
        })
    }

    fn alloc_layer(&self, cap: usize) -> Result<SeqLayer> {
        self.alloc_layer_state(cap, true)
    }

    /// As [`GpuModel::alloc_layer`]; without `with_kv` the K/V caches are
    /// one-element placeholders (an offloaded layer keeps its ring).
    fn alloc_layer_state(&self, cap: usize, with_kv: bool) -> Result<SeqLayer> {
        let kv_cap = if with_kv { cap } else { 0 };
        let c = &self.config;
        let kvd = c.num_key_value_heads * c.head_dim;
        let what = |x: &str| format!("allocating the {x} cache of {cap} tokens");
        let s = self.gpu.stream();
        let gpu_sel = self.gpu_selection();
        let capw = self.plan.budget.windows(cap).max(1);
        Ok(SeqLayer {
            kc: if gpu_sel {
                Some(s.alloc_zeros(capw * kvd).cuda(&what("compressed-key"))?)
            } else {
                None
            },
            p: if gpu_sel && self.eviction {
                Some(
                    s.alloc_zeros(capw * c.num_key_value_heads)
                        .cuda(&what("pooled-score"))?,
                )
            } else {
                None
            },
            k: s.alloc_zeros((kv_cap * kvd).max(1)).cuda(&what("K"))?,
            v: s.alloc_zeros((kv_cap * kvd).max(1)).cuda(&what("V"))?,
            c: if self.eviction {
                Some(
                    s.alloc_zeros(cap * c.num_key_value_heads)
                        .cuda(&what("eviction-score"))?,
                )
            } else {
                None
            },
        })
    }

    /// Grows `seq`'s caches to hold at least `need` tokens (capacity
    /// doubled, at least `need`, whole blocks), copying the stored tokens.
    /// An offloaded sequence grows only its GPU state (c, Kc, p; resident
    /// layers' K/V): its tail rings move over as they are, its pools never
    /// grow, and it may not pass its host store's capacity.
    ///
    /// Errors: [`Error::Limit`] past an offloaded sequence's host store;
    /// device memory errors.
    fn ensure_capacity(&self, seq: &mut GpuSequence, need: usize) -> Result<()> {
        let bs = self.plan.budget.block_size.max(1);
        if let Some(off) = &seq.off {
            let host = off.capacity_tokens(bs);
            if need > host {
                return Err(Error::Limit(format!(
                    "offloaded sequence: {need} tokens exceed the host KV store's {host} tokens (offload with a larger capacity: prompt + max new tokens)"
                )));
            }
        }
        if need <= seq.cap {
            return Ok(());
        }
        let cap = need.max(2 * seq.cap).div_ceil(bs) * bs;
        let c = &self.config;
        let (kvd, hk) = (c.num_key_value_heads * c.head_dim, c.num_key_value_heads);
        let s = self.gpu.stream();
        let len = seq.len;
        let offloaded: Vec<bool> = (0..seq.layers.len())
            .map(|l| seq.off.as_ref().is_some_and(|o| o.offloaded(l)))
            .collect();
        for (sl, &off) in seq.layers.iter_mut().zip(&offloaded) {
            let mut n = self.alloc_layer_state(cap, !off)?;
            if off {
                std::mem::swap(&mut n.k, &mut sl.k);
                std::mem::swap(&mut n.v, &mut sl.v);
            }
            if len > 0 {
                if !off {
                    let used = len * kvd;
                    s.memcpy_dtod(&sl.k.slice(0..used), &mut n.k.slice_mut(0..used))
                        .cuda("growing the K cache")?;
                    s.memcpy_dtod(&sl.v.slice(0..used), &mut n.v.slice_mut(0..used))
                        .cuda("growing the V cache")?;
                }
                if let (Some(old), Some(new)) = (&sl.c, &mut n.c) {
                    s.memcpy_dtod(&old.slice(0..len * hk), &mut new.slice_mut(0..len * hk))
                        .cuda("growing the eviction-score cache")?;
                }
                let mc = self.plan.budget.windows(len);
                if mc > 0 {
                    if let (Some(old), Some(new)) = (&sl.kc, &mut n.kc) {
                        s.memcpy_dtod(&old.slice(0..mc * kvd), &mut new.slice_mut(0..mc * kvd))
                            .cuda("growing the compressed-key cache")?;
                    }
                    if let (Some(old), Some(new)) = (&sl.p, &mut n.p) {
                        s.memcpy_dtod(&old.slice(0..mc * hk), &mut new.slice_mut(0..mc * hk))
                            .cuda("growing the pooled-score cache")?;
                    }
                }
            }
            *sl = n;
        }
        seq.cap = cap;
        seq.generation += 1;
        Ok(())
    }

    /// Makes the RoPE tables cover positions 0 … need−1.
    fn ensure_rope(&mut self, need: usize) -> Result<()> {
        if self.rope_tables.as_ref().is_some_and(|t| t.rows >= need) {
            return Ok(());
        }
        let max = self.config.max_position_embeddings;
        if let RopeScaling::Dynamic {
            original_max_position_embeddings: orig,
            ..
        } = self.config.rope_scaling
        {
            if need > orig {
                return Err(Error::Input(format!(
                    "dynamic NTK RoPE past original_max_position_embeddings {orig} (needed {need} positions) is not supported by the CUDA backend yet; use --backend cpu"
                )));
            }
        }
        let have = self.rope_tables.as_ref().map_or(0, |t| t.rows);
        let rows = need.max(2 * have).max(4096).min(max.max(need));
        // seq_len only matters for dynamic NTK, refused above past its original maximum.
        self.rope_tables = Some(RopeTables::from_rope(
            &self.gpu,
            &self.rope,
            self.config.head_dim,
            rows,
            1,
        )?);
        Ok(())
    }

    /// A workspace for `rows` rows, with `layers` per-layer copies of the
    /// QKV output and the block lists (of width `s_max`).
    fn new_workspace(&self, rows: usize, layers: usize, s_max: usize) -> Result<Workspace> {
        let c = &self.config;
        let (d, hq, dh, i_, v, l, hk) = (
            c.hidden_size,
            c.num_attention_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
            c.num_hidden_layers,
            c.num_key_value_heads,
        );
        let s = self.gpu.stream();
        let what = format!("allocating the workspace for {rows} rows");
        // SAFETY (each `alloc`): every buffer is written by a kernel or copy
        // before it is read.
        unsafe {
            Ok(Workspace {
                rows,
                resid: s.alloc(rows * d).cuda(&what)?,
                delta: s.alloc(rows * d).cuda(&what)?,
                xn: s.alloc(rows * d).cuda(&what)?,
                qkv: s.alloc(layers * rows * self.qkv_cols).cuda(&what)?,
                attn: s.alloc(rows * hq * dh).cuda(&what)?,
                gu: s.alloc(rows * 2 * i_).cuda(&what)?,
                act: s.alloc(rows * i_).cuda(&what)?,
                logits: s.alloc(rows * v).cuda(&what)?,
                ids: s.alloc(rows).cuda(&what)?,
                pos: s.alloc(rows).cuda(&what)?,
                lens: s.alloc(rows).cuda(&what)?,
                argmax: s.alloc(rows).cuda(&what)?,
                ptrs: s
                    .alloc(l * (PTRS_PER_ROW * rows + PTRS_PER_SEQ * rows).max(1))
                    .cuda(&what)?,
                part_o: s.alloc(1).cuda(&what)?,
                part_ml: s.alloc(1).cuda(&what)?,
                attn_count: s
                    .alloc_zeros((rows * ops::attn_head_blocks(hq, hk)).max(1))
                    .cuda(&what)?,
                sel: s.alloc((layers * rows * hk * s_max).max(1)).cuda(&what)?,
                nsel: s.alloc(layers * rows * hk).cuda(&what)?,
                dense: s.alloc(rows).cuda(&what)?,
                seq_lens: s.alloc(rows.max(1)).cuda(&what)?,
                qa_logits: s.alloc(1).cuda(&what)?,
                qa_stats: s.alloc(1).cuda(&what)?,
                qa_scores: s.alloc(1).cuda(&what)?,
            })
        }
    }

    /// Makes the forward workspace hold `rows` rows.
    fn ensure_workspace(&mut self, rows: usize) -> Result<()> {
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.ws = None;
        self.ws = Some(self.new_workspace(rows, 1, 1)?);
        Ok(())
    }

    /// Prefills `prompt` into `seq` (positions T … T+n−1), in chunks of at
    /// most [`PREFILL_CHUNK`] tokens (fewer for long contexts), calling
    /// `progress(done, total)` after each chunk. Afterwards
    /// [`GpuModel::logits`] holds the last prompt token's logits ([1, V]).
    ///
    /// Dense or sparse as the CPU reference decides (spec §6): sparse iff the
    /// plan is sparse, the whole prompt (T + n tokens) reaches dense_len, and
    /// the prefill mode is not `Dense`.
    ///
    /// Errors: an empty prompt, a token id ≥ V, a length past
    /// `max_position_embeddings` ([`Error::Input`] / [`Error::Limit`]);
    /// [`Error::Cuda`] on a device failure.
    pub fn prefill(
        &mut self,
        seq: &mut GpuSequence,
        prompt: &[u32],
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::Input("empty prompt: give at least one token".into()));
        }
        let t0 = seq.len;
        let prompt_len = t0 + prompt.len();
        self.check_tokens(prompt, prompt_len)?;
        let sparse = self.plan.sparse_at(prompt_len) && self.prefill_mode != PrefillMode::Dense;
        let mut done = 0;
        while done < prompt.len() {
            let t_end = t0 + done;
            let n = self
                .prefill_rows(t_end + PREFILL_CHUNK, sparse)
                .min(prompt.len() - done);
            let rows: Vec<Row> = prompt[done..done + n]
                .iter()
                .enumerate()
                .map(|(i, &token)| Row {
                    seq: 0,
                    token,
                    pos: t0 + done + i,
                    sparse,
                })
                .collect();
            done += n;
            let which = if done == prompt.len() {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            self.forward(std::slice::from_mut(seq), &rows, which)?;
            progress(done, prompt.len());
        }
        Ok(())
    }

    /// Rows per prefill chunk so the attention partials of a context of up
    /// to `t_len` tokens stay within [`PARTIALS_BUDGET_BYTES`] (counted at
    /// the finest split, one per [`ops::ATTN_TILE`] tokens).
    fn prefill_rows(&self, t_len: usize, sparse: bool) -> usize {
        let c = &self.config;
        let nsplit = if sparse {
            self.plan.budget.attended
        } else {
            t_len.div_ceil(ops::ATTN_TILE)
        }
        .max(1);
        let mut per_row = c.num_attention_heads * nsplit * (c.head_dim + 2) * 4;
        if sparse && self.selection == SelectionPath::Gpu {
            // Query-aware logits, tile statistics and window scores.
            let w_stride = self
                .plan
                .budget
                .windows(t_len)
                .max(1)
                .div_ceil(super::select::QA_TILE)
                * super::select::QA_TILE;
            let tiles = w_stride / super::select::QA_TILE;
            per_row += (c.num_attention_heads * (w_stride + 2 * tiles)
                + c.num_key_value_heads * w_stride)
                * 4;
        }
        (PARTIALS_BUDGET_BYTES / per_row.max(1)).clamp(1, PREFILL_CHUNK)
    }

    /// Fills the empty sequence `seq` with `len` tokens of synthetic state
    /// (runtime.md §5 `--prefill synthetic`, for decode benchmarks on
    /// random-weight models): every layer's K and V random bf16 N(0, 1)
    /// (kernels/synth.cu, from `seed`, the layer and the sequence's uid), the
    /// eviction scores c = A·softplus(δ·v + b) of those values with the
    /// layer's own eviction head (kernels/eviction.cu), and, for GPU
    /// selection, Kc and p completed from K and c (kernels/compress.cu) —
    /// the state a prefill would leave, minus the model. The next decode
    /// token goes to position `len`. No logits are produced.
    ///
    /// Errors: [`Error::Input`] when `seq` is not empty, `len` is 0 or past
    /// max_position_embeddings, or the sequence mirrors its state on the
    /// host ([`SelectionPath::HostFallback`]); [`Error::Cuda`] on a device
    /// failure (e.g. out of memory when growing).
    pub fn fill_synthetic(&mut self, seq: &mut GpuSequence, len: usize, seed: u64) -> Result<()> {
        if seq.len != 0 || len == 0 || seq.mirror.is_some() {
            return Err(Error::Input(format!(
                "fill_synthetic: needs an empty sequence on the GPU selection path and len ≥ 1 (sequence has {} tokens, len {len})",
                seq.len
            )));
        }
        if len >= self.config.max_position_embeddings {
            return Err(Error::Limit(format!(
                "synthetic context of {len} tokens leaves no position for decoding below max_position_embeddings {}",
                self.config.max_position_embeddings
            )));
        }
        self.ensure_capacity(seq, len)?;
        let c = &self.config;
        let (hk, dh) = (c.num_key_value_heads, c.head_dim);
        let kvd = hk * dh;
        let gpu = self.gpu.clone();
        let s = gpu.stream().clone();
        let fill = gpu.function("fill_normal_bf16")?;
        let n_u64 = (len * kvd) as u64;
        let blocks = (len * kvd).div_ceil(256).clamp(1, 16_384) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = 1.0f32;
        let budget = self.plan.budget;
        // Per-sequence table for compression: K, c, Kc, p, and its length.
        let mut tab_host = vec![0u64; PTRS_PER_SEQ];
        let lens_dev = gpu.upload(&[i32_dim(len, "len")?])?;
        let mut tab_dev: CudaSlice<u64> = gpu.zeros(PTRS_PER_SEQ)?;
        for (l, sl) in seq.layers.iter_mut().enumerate() {
            for (which, buf) in [(0u64, &sl.k), (1u64, &sl.v)] {
                let ptr = dptr(&gpu, buf);
                let sd = seed
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .wrapping_add(seq.uid << 20)
                    .wrapping_add((l as u64) << 2)
                    .wrapping_add(which);
                let mut b = s.launch_builder(fill);
                b.arg(&ptr).arg(&n_u64).arg(&sd).arg(&scale);
                // SAFETY: argument list matches kernels/synth.cu; the cache holds
                // capacity ≥ len tokens of Hkv·D values.
                unsafe { b.launch(cfg) }.cuda("fill_normal_bf16")?;
            }
            if let (Some(head), Some(cbuf)) = (&self.layers[l].evict_head, &mut sl.c) {
                ops::eviction_score(
                    &gpu,
                    &sl.v.slice(0..len * kvd),
                    len,
                    kvd,
                    head,
                    &mut cbuf.slice_mut(0..len * hk),
                )?;
            }
            if let Some(kc) = &sl.kc {
                let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |b| dptr(&gpu, b));
                tab_host[0] = dptr(&gpu, &sl.k);
                tab_host[1] = opt(&sl.c);
                tab_host[2] = dptr(&gpu, kc);
                tab_host[3] = opt(&sl.p);
                s.memcpy_htod(&tab_host, &mut tab_dev)
                    .cuda("uploading a compression table")?;
                let base = dptr(&gpu, &tab_dev);
                let tab = Tables::new(base, 0, 1);
                let windows = budget.windows(len);
                if windows > 0 {
                    compress(
                        &gpu,
                        &budget,
                        &tab,
                        dptr(&gpu, &lens_dev),
                        1,
                        len,
                        windows.min(COMPRESS_MAX_GRID_X),
                        hk,
                        dh,
                        self.eviction,
                        0,
                    )?;
                }
                // The table is rewritten for the next layer: finish this one first.
                gpu.synchronize()?;
            }
        }
        seq.len = len;
        gpu.synchronize()
    }

    /// One decode step for a batch: `tokens[b]` goes to `seqs[b]` at its
    /// next position; afterwards [`GpuModel::logits`] holds [B, V] and the
    /// step's greedy argmax is computed (see [`GpuModel::argmax`]). Each
    /// sequence is sparse or dense by its own length (dense_len, spec §1).
    ///
    /// When every row is sparse (or every row dense), the step runs on the
    /// device-resident step of the module doc ([`DecodeMode`]): one upload of
    /// the B token ids, positions and lengths, then the captured graph. A
    /// batch mixing dense and sparse rows, or the host selection fallback,
    /// runs as a general forward call.
    ///
    /// Errors: B = 0, `tokens.len() != seqs.len()`, a token id ≥ V, a length
    /// past `max_position_embeddings`; [`Error::Cuda`] on a device failure.
    pub fn decode(&mut self, seqs: &mut [GpuSequence], tokens: &[u32]) -> Result<()> {
        if seqs.is_empty() || tokens.len() != seqs.len() {
            return Err(Error::Input(format!(
                "decode: {} tokens for {} sequences (need one per sequence, at least one)",
                tokens.len(),
                seqs.len()
            )));
        }
        for (s, &t) in seqs.iter().zip(tokens) {
            self.check_tokens(&[t], s.len + 1)?;
        }
        let rows: Vec<Row> = seqs
            .iter()
            .zip(tokens)
            .enumerate()
            .map(|(b, (s, &token))| Row {
                seq: b,
                token,
                pos: s.len,
                sparse: self.plan.sparse_at(s.len + 1),
            })
            .collect();
        if self.step_eligible(&rows) {
            self.run_step(seqs, Some(tokens))
        } else {
            self.forward(seqs, &rows, LogitRows::All)
        }
    }

    /// One greedy decode step fed on the device: each sequence's next token
    /// is the argmax of its row of the previous step's logits, which that
    /// step left in the device-resident step inputs — nothing is copied
    /// between host and device (the benchmark loop, runtime.md §5).
    /// Afterwards [`GpuModel::logits`] / [`GpuModel::argmax`] are as after
    /// [`GpuModel::decode`].
    ///
    /// Errors: [`Error::Input`] unless the previous call was a
    /// device-resident decode step of exactly these sequences with nothing
    /// run on them since (call [`GpuModel::decode`] with tokens first); a
    /// length past `max_position_embeddings` ([`Error::Limit`]);
    /// [`Error::Cuda`] on a device failure.
    pub fn decode_greedy(&mut self, seqs: &mut [GpuSequence]) -> Result<()> {
        let ok = matches!(self.last, LastLogits::Step(n) if n == seqs.len())
            && self.step.as_ref().is_some_and(|st| {
                st.dev_lens.len() == seqs.len()
                    && st
                        .key
                        .seqs
                        .iter()
                        .zip(seqs.iter())
                        .all(|(&(uid, _), s)| uid == s.uid)
                    && st
                        .dev_lens
                        .iter()
                        .zip(seqs.iter())
                        .all(|(&l, s)| l == s.len)
            });
        if !ok {
            return Err(Error::Input(
                "decode_greedy: the previous call was not a device-resident decode step of these sequences; call decode with tokens first".into(),
            ));
        }
        for s in seqs.iter() {
            self.check_tokens(&[], s.len + 1)?;
        }
        let sparse0 = self.plan.sparse_at(seqs[0].len + 1);
        if seqs
            .iter()
            .any(|s| self.plan.sparse_at(s.len + 1) != sparse0)
        {
            return Err(Error::Input(
                "decode_greedy: the batch now mixes dense and sparse rows (dense_len); call decode with tokens".into(),
            ));
        }
        self.run_step(seqs, None)
    }

    /// Whether a decode call over `rows` can run on the device-resident step.
    fn step_eligible(&self, rows: &[Row]) -> bool {
        if self.decode_mode == DecodeMode::Forward {
            return false;
        }
        if self.sparse_plan() && self.selection != SelectionPath::Gpu {
            return false;
        }
        let s0 = rows[0].sparse;
        rows.iter().all(|r| r.sparse == s0)
    }

    /// Token ids < V and the length `t_len` within max_position_embeddings.
    fn check_tokens(&self, tokens: &[u32], t_len: usize) -> Result<()> {
        let c = &self.config;
        if t_len > c.max_position_embeddings {
            return Err(Error::Limit(format!(
                "sequence of {t_len} tokens exceeds max_position_embeddings {} (override with --max-position / --rope-theta)",
                c.max_position_embeddings
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {} ids",
                c.vocab_size
            )));
        }
        Ok(())
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
    /// Errors: as [`GpuModel::logits`]; [`Error::Cuda`] on a copy failure.
    pub fn download_logits(&self) -> Result<Vec<f32>> {
        let l = self.logits()?;
        self.gpu.download(&l)
    }

    /// Sampling on the GPU: one token per row of the last logits
    /// ([`GpuModel::logits`]) with the uniform draws `u01` (\[rows\], in
    /// [0, 1); e.g. [`crate::sample::Sampler::draw`]), by the rule of
    /// [`crate::sample::sample_with_u`]; greedy parameters give
    /// [`GpuModel::argmax`]. Synchronises; only the ids travel.
    ///
    /// Errors: as [`ops::sample_rows`]; [`Error::Input`] before any logits
    /// or when `u01` does not hold one draw per row.
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
        ops::sample_rows(
            &self.gpu,
            &logits,
            rows,
            self.config.vocab_size,
            params,
            u01,
        )
    }

    /// Greedy sampling on the GPU: the argmax of each logits row (ties to the
    /// lower id, NaN never wins), \[rows\] (synchronises; only the ids travel).
    /// After a device-resident decode step the step computed it already.
    ///
    /// Errors: as [`GpuModel::logits`]; [`Error::Cuda`] on a failure.
    pub fn argmax(&mut self) -> Result<Vec<u32>> {
        match self.last {
            LastLogits::Step(n) => {
                let st = self.step.as_ref().expect("a step produced the logits");
                self.gpu.download(&st.ws.argmax.slice(0..n))
            }
            LastLogits::Forward(rows) => {
                let gpu = self.gpu.clone();
                let ws = self.ws.as_mut().expect("logits imply a workspace");
                let v = i32_dim(self.config.vocab_size, "vocab")?;
                let n = i32_dim(rows, "rows")?;
                let (lp, op) = (dptr(&gpu, &ws.logits), dptr(&gpu, &ws.argmax));
                let f = gpu.function("argmax_rows")?;
                let cfg = LaunchConfig {
                    grid_dim: (grid(rows, "rows")?, 1, 1),
                    block_dim: (1024, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = gpu.stream().launch_builder(f);
                b.arg(&lp).arg(&n).arg(&v).arg(&op);
                // SAFETY: argument list matches kernels/argmax.cu; logits hold rows·V
                // values, argmax at least rows.
                unsafe { b.launch(cfg) }.cuda("argmax_rows")?;
                gpu.download(&ws.argmax.slice(0..rows))
            }
            LastLogits::None => Err(Error::Input(
                "no logits yet: run prefill or decode first".into(),
            )),
        }
    }

    /// Adds an f32 bias to the first `cols` columns of `n` bf16 rows at stride `ld`.
    fn bias_add(
        gpu: &Gpu,
        y: u64,
        ld: usize,
        b: &CudaSlice<f32>,
        n: usize,
        cols: usize,
    ) -> Result<()> {
        let (ld_, n_, c_) = (i32_dim(ld, "ld")?, i32_dim(n, "n")?, i32_dim(cols, "cols")?);
        let bp = dptr(gpu, b);
        let f = gpu.function("bias_add")?;
        let blocks = (n * cols).div_ceil(256).clamp(1, 65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut bl = gpu.stream().launch_builder(f);
        bl.arg(&y).arg(&ld_).arg(&bp).arg(&n_).arg(&c_);
        // SAFETY: argument list matches kernels/bias.cu; y holds n rows of ld ≥ cols.
        unsafe { bl.launch(cfg) }.cuda("bias_add").map(drop)
    }

    /// The RoPE rows a step over `seqs` needs: positions up to the batch's
    /// capacity (device-fed steps advance without the host), or, for dynamic
    /// NTK RoPE (tables limited to the original maximum), the next position.
    fn step_rope_need(&self, seqs: &[GpuSequence], cap: usize) -> usize {
        let next = seqs.iter().map(|s| s.len + 1).max().unwrap_or(1);
        let want = cap.min(self.config.max_position_embeddings).max(next);
        match self.config.rope_scaling {
            RopeScaling::Dynamic {
                original_max_position_embeddings: orig,
                ..
            } if want > orig => next,
            _ => want,
        }
    }

    /// Runs one device-resident decode step (see the module doc): grows
    /// caches, (re)builds the step when its key changed, uploads the step
    /// inputs (when `tokens` is given), then replays the graph (capturing it
    /// on the second step of a build) or launches the kernels eagerly.
    fn run_step(&mut self, seqs: &mut [GpuSequence], tokens: Option<&[u32]>) -> Result<()> {
        let n = seqs.len();
        for sq in seqs.iter_mut() {
            let need = sq.len + 1;
            self.ensure_capacity(sq, need)?;
        }
        let cap = seqs.iter().map(|s| s.cap).max().unwrap_or(1);
        let need = self.step_rope_need(seqs, cap);
        self.ensure_rope(need)?;
        let rope_rows = self.rope_tables.as_ref().map_or(0, |t| t.rows);
        let sparse = self.plan.sparse_at(seqs[0].len + 1);
        let offload = seqs[0].off.is_some();
        if seqs.iter().any(|s| s.off.is_some() != offload) {
            return Err(Error::Input(
                "decode: a batch must be all offloaded or all GPU-resident".into(),
            ));
        }
        if offload && !sparse {
            return Err(Error::Input(
                "decode: offloaded sequences decode sparse steps only".into(),
            ));
        }
        let key = StepKey {
            seqs: seqs.iter().map(|s| (s.uid, s.generation)).collect(),
            sparse,
            cap,
            rope_rows,
            offload,
        };
        if self.step.as_ref().is_none_or(|st| st.key != key) {
            if tokens.is_none() {
                return Err(Error::Input(
                    "decode_greedy: the step must be rebuilt (capacity or batch changed); call decode with tokens".into(),
                ));
            }
            self.step = None;
            let st = self.build_step(seqs, key)?;
            self.step = Some(st);
        }
        let gpu = self.gpu.clone();
        let mut st = self.step.take().expect("built above");
        let r = (|| -> Result<()> {
            if let Some(toks) = tokens {
                let mut io = Vec::with_capacity(4 * n);
                io.extend_from_slice(toks);
                io.extend(seqs.iter().map(|s| s.len as u32));
                io.extend(seqs.iter().map(|s| s.len as u32 + 1));
                io.extend(seqs.iter().map(|s| s.len as u32 + 1));
                gpu.stream()
                    .memcpy_htod(&io, &mut st.io)
                    .cuda("uploading the decode step inputs")?;
            }
            if let Some(off) = st.off.as_mut() {
                off.completes = offloaded::step_completes_block(seqs, self.plan.budget.block_size);
            }
            let capture = self.decode_mode == DecodeMode::Graph
                && st.off.is_none()
                && !self.trace_on()
                && st.graph.is_none()
                && !st.capture_failed
                && st.steps >= 1;
            if capture {
                match gpu.capture(|| self.enqueue_step(&mut st)) {
                    Ok(g) => st.graph = Some(g),
                    Err(e) => {
                        tracing::warn!(
                            "decode step: CUDA graph capture failed ({e}); running eagerly"
                        );
                        st.capture_failed = true;
                    }
                }
            }
            match &st.graph {
                Some(g) => g.launch().cuda("cuGraphLaunch (decode step)"),
                None => self.enqueue_step(&mut st),
            }
        })();
        let ok = r.is_ok();
        if !ok {
            // spans the failed step began and never ended
            self.timeline.borrow_mut().drop_open();
            self.fetch_spans.borrow_mut().clear();
        }
        st.steps += 1;
        if st.off.is_some() {
            self.offload_steps += 1;
        }
        st.dev_lens = seqs.iter().map(|s| s.len + 1).collect();
        self.step = Some(st);
        r?;
        if ok {
            for sq in seqs.iter_mut() {
                sq.len += 1;
            }
            self.last = LastLogits::Step(n);
            if self.record_selections {
                self.record_step()?;
            }
            self.offload_collect_timing()?;
            self.finish_traced_step()?;
        }
        Ok(())
    }

    /// Allocates a decode step for `seqs` under `key` and uploads its
    /// pointer tables (the only host→device copy besides the step inputs).
    fn build_step(&self, seqs: &[GpuSequence], key: StepKey) -> Result<DecodeStep> {
        let c = &self.config;
        let (hq, hk, dh, nl) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.num_hidden_layers,
        );
        let n = seqs.len();
        let budget = self.plan.budget;
        let hb = ops::attn_head_blocks(hq, hk);
        let attn = if key.sparse {
            let s_max = budget.attended.max(1);
            let (span, nsplit) = ops::attn_sparse_split(n, hb, s_max);
            AttnGeometry {
                sparse: true,
                span,
                nsplit,
                s_max,
            }
        } else {
            let (span, nsplit) = ops::attn_dense_split(n, hb, key.cap);
            AttnGeometry {
                sparse: false,
                span,
                nsplit,
                s_max: 1,
            }
        };
        let mc = budget.windows(key.cap);
        let qa_tile = super::select::QA_TILE;
        let sel = SelGeometry {
            mc,
            w_stride: mc.max(1).div_ceil(qa_tile) * qa_tile,
            nb_cap: budget.blocks(key.cap.saturating_sub(1)).max(1),
            s_max: attn.s_max,
        };
        let mut ws = self.new_workspace(n, nl, attn.s_max)?;
        let s = self.gpu.stream();
        let part = n * hq * attn.nsplit;
        // SAFETY (each `alloc`): written by a kernel before it is read.
        unsafe {
            ws.part_o = s.alloc(part * dh).cuda("allocating attention partials")?;
            ws.part_ml = s.alloc(part * 2).cuda("allocating attention partials")?;
            if key.sparse {
                let tiles = sel.w_stride / qa_tile;
                ws.qa_logits = s
                    .alloc(n * hq * sel.w_stride)
                    .cuda("allocating the window-score workspace")?;
                ws.qa_stats = s
                    .alloc(n * hq * tiles * 2)
                    .cuda("allocating the window-score workspace")?;
                ws.qa_scores = s
                    .alloc(n * hk * sel.w_stride)
                    .cuda("allocating the window-score workspace")?;
            }
        }
        let rows: Vec<Row> = (0..n)
            .map(|b| Row {
                seq: b,
                token: 0,
                pos: seqs[b].len,
                sparse: key.sparse,
            })
            .collect();
        let table = self.pointer_tables(seqs, &rows);
        s.memcpy_htod(&table, &mut ws.ptrs.slice_mut(0..table.len()))
            .cuda("uploading KV pointer tables")?;
        let io: CudaSlice<u32> = self.gpu.zeros(4 * n)?;
        let off = if key.offload {
            Some(self.build_step_offload(seqs, attn.s_max)?)
        } else {
            None
        };
        Ok(DecodeStep {
            key,
            n,
            attn,
            sel,
            io,
            ws,
            graph: None,
            capture_failed: false,
            dev_lens: Vec::new(),
            steps: 0,
            off,
        })
    }

    /// Per-layer pointer tables of a call over `rows` of `seqs` (see
    /// [`Tables`]): [L][PTRS_PER_ROW·n + PTRS_PER_SEQ·ns] u64.
    fn pointer_tables(&self, seqs: &[GpuSequence], rows: &[Row]) -> Vec<u64> {
        let gpu = &*self.gpu;
        let (n, ns, nl) = (rows.len(), seqs.len(), self.layers.len());
        let nosa = self.plan.mode == AttentionMode::Nosa;
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * ns;
        let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |c| dptr(gpu, c));
        let mut table = vec![0u64; nl * per_layer];
        for l in 0..nl {
            let t = &mut table[l * per_layer..(l + 1) * per_layer];
            for (i, r) in rows.iter().enumerate() {
                let sl = &seqs[r.seq].layers[l];
                let c = opt(&sl.c);
                t[i] = dptr(gpu, &sl.k);
                t[n + i] = dptr(gpu, &sl.v);
                t[2 * n + i] = c;
                t[3 * n + i] = if r.sparse && nosa { c } else { 0 };
                t[4 * n + i] = opt(&sl.kc);
                t[5 * n + i] = opt(&sl.p);
            }
            for (j, sq) in seqs.iter().enumerate() {
                let sl = &sq.layers[l];
                t[6 * n + j] = dptr(gpu, &sl.k);
                t[6 * n + ns + j] = opt(&sl.c);
                t[6 * n + 2 * ns + j] = opt(&sl.kc);
                t[6 * n + 3 * ns + j] = opt(&sl.p);
            }
        }
        table
    }

    /// Enqueues a whole decode step on the stream (no host work besides
    /// launches, so it can be captured): embedding of the ids in `st.io`,
    /// every layer, final norm, lm_head, argmax, and the advance of the step
    /// inputs for the next step.
    fn enqueue_step(&self, st: &mut DecodeStep) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (d, vocab, nl) = (c.hidden_size, c.vocab_size, c.num_hidden_layers);
        let n = st.n;
        let w = self.qkv_cols;
        let io = dptr(gpu, &st.io);
        let inp = RowInputs {
            pos: io + (4 * n) as u64,
            lens: io + (8 * n) as u64,
            seq_lens: io + (12 * n) as u64,
        };
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * n;
        let hk = c.num_key_value_heads;
        if self.on(StepPart::Embed) {
            ops::embed_gather(
                gpu,
                &self.embed,
                vocab,
                d,
                &st.io.slice(0..n),
                c.embed_scale(),
                &mut st.ws.delta.slice_mut(0..n * d),
            )?;
            gpu.stream()
                .memset_zeros(&mut st.ws.resid.slice_mut(0..n * d))
                .cuda("zeroing the residual stream")?;
        }
        let ptrs = dptr(gpu, &st.ws.ptrs);
        self.offload_wait_write_back(st)?;
        let forecast = self.forecast_cols.filter(|_| st.attn.sparse);
        let prefetch = forecast.is_some() && self.prefetch && st.off.is_some();
        let s_max = st.attn.s_max;
        let lists = |l: usize| (l * n * hk * s_max, l * n * hk);
        // The open compute-stream span: consecutive phases share their
        // boundary event (`tspan_next`), across layers too.
        let mut open = SpanId::NONE;
        for l in 0..nl {
            let tab = Tables::new(ptrs + (l * per_layer * 8) as u64, n, n);
            let qkv_off = l * n * w;
            let comp = self.gpu_selection().then_some((1usize, 1usize));
            let ring = st.off.as_ref().map_or(0, |o| o.ring_of(l));
            let cs = gpu.stream().clone();
            let sp = self.tspan_next(&cs, open, "qkv", l)?;
            self.layer_front(l, &mut st.ws, n, n, qkv_off, &inp, &tab, comp, ring)?;
            self.rope_forecast(&st.ws, n, qkv_off, inp.pos)?;
            let (sel_off, nsel_off) = lists(l);
            let slots = match forecast {
                None => {
                    if st.attn.sparse {
                        let sp = self.tspan_next(&cs, sp, "select", l)?;
                        self.gpu_select(
                            &st.ws, n, qkv_off, sel_off, nsel_off, &inp, &tab, &st.sel,
                        )?;
                        self.tspan_end(&cs, sp)?;
                    } else {
                        self.tspan_end(&cs, sp)?;
                    }
                    (
                        self.offload_layer(st, l, sel_off, nsel_off, inp.lens)?,
                        SpanId::NONE,
                    )
                }
                Some((fut, cur)) => {
                    let mut sp = self.tspan_next(&cs, sp, "select", l)?;
                    if l == 0 {
                        // layer 0 scores its own current-step windows with q_curr_proj
                        self.forecast_select(
                            &st.ws,
                            n,
                            qkv_off + cur,
                            &tab,
                            sel_off,
                            nsel_off,
                            inp.lens,
                            0,
                            &st.sel,
                        )?;
                        if st.off.as_ref().is_some_and(|o| o.offloaded(0)) {
                            // layer 0's own diff and synchronous fetch, in their own spans
                            sp = self.tspan_next(&cs, sp, "diff", 0)?;
                            self.offload_diff(st, 0, sel_off, nsel_off, inp.lens)?;
                            self.tspan_end(&cs, sp)?;
                            self.offload_fetch(st, 0, &cs)?;
                            sp = self.tspan(&cs, crate::trace::Track::Compute, "select", 0)?;
                        }
                    }
                    if l + 1 < nl {
                        // PREP(l+1): layer l+1's selection from this layer's forecast,
                        // over its state as of the previous step
                        let next = Tables::new(ptrs + ((l + 1) * per_layer * 8) as u64, n, n);
                        let (ns_off, nn_off) = lists(l + 1);
                        self.forecast_select(
                            &st.ws,
                            n,
                            qkv_off + fut,
                            &next,
                            ns_off,
                            nn_off,
                            inp.lens,
                            inp.pos,
                            &st.sel,
                        )?;
                        sp = self.tspan_next(&cs, sp, "diff", l + 1)?;
                        let offloaded = self.offload_diff(st, l + 1, ns_off, nn_off, inp.lens)?;
                        if offloaded && prefetch {
                            // The SM kernel's prefetch puts only events on the compute
                            // stream, so the diff span stays open into the wait; the
                            // copy engines' reads the fetch lists back on it first.
                            if matches!(self.fetch_engine(n), FetchEngine::Dma) {
                                self.tspan_end(&cs, sp)?;
                                sp = SpanId::NONE;
                            }
                            self.offload_prefetch(st, l + 1)?;
                        }
                    }
                    if l >= 1 {
                        if prefetch {
                            sp = self.tspan_next(&cs, sp, "wait", l)?;
                            self.offload_wait_fetched(st, l)?;
                        } else if st.off.as_ref().is_some_and(|o| o.offloaded(l)) {
                            self.tspan_end(&cs, sp)?;
                            sp = SpanId::NONE;
                            self.offload_fetch(st, l, &cs)?;
                        }
                    }
                    (self.offload_attn_slots(st, l), sp)
                }
            };
            let (slots, sp) = slots;
            open = self.layer_back(
                l, &mut st.ws, n, qkv_off, sel_off, nsel_off, &inp, &tab, &st.attn, slots, sp,
            )?;
        }
        self.tspan_end(&gpu.stream().clone(), open)?;
        self.offload_write_back(st, inp.lens)?;
        self.head(&mut st.ws, n, 0, n)?;
        if !self.on(StepPart::Argmax) {
            return Ok(());
        }
        let (v_, n_) = (i32_dim(vocab, "vocab")?, i32_dim(n, "rows")?);
        let (lp, op) = (dptr(gpu, &st.ws.logits), dptr(gpu, &st.ws.argmax));
        let f = gpu.function("argmax_advance")?;
        let cfg = LaunchConfig {
            grid_dim: (grid(n, "rows")?, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&lp).arg(&n_).arg(&v_).arg(&op).arg(&io);
        // SAFETY: argument list matches kernels/argmax.cu; logits hold n·V values,
        // argmax n, io 4n.
        unsafe { b.launch(cfg) }.cuda("argmax_advance").map(drop)
    }

    /// Copies the last step's per-layer queries and block lists to the
    /// recording ([`GpuModel::last_selections`] / [`GpuModel::last_queries`]).
    fn record_step(&mut self) -> Result<()> {
        let st = self.step.as_ref().expect("a step ran");
        let c = &self.config;
        let (hq, hk, dh, nl) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.num_hidden_layers,
        );
        let (n, w, s_max) = (st.n, self.qkv_cols, st.attn.s_max);
        if !st.attn.sparse {
            self.last_selections = vec![vec![vec![Vec::new(); hk]; n]; nl];
            self.last_queries = vec![Vec::new(); nl];
            return Ok(());
        }
        let qkv = self.gpu.download(&st.ws.qkv.slice(0..nl * n * w))?;
        let sel = self
            .gpu
            .download(&st.ws.sel.slice(0..nl * n * hk * s_max))?;
        let nsel = self.gpu.download(&st.ws.nsel.slice(0..nl * n * hk))?;
        self.last_queries = (0..nl)
            .map(|l| {
                (0..n)
                    .map(|i| {
                        let o = (l * n + i) * w;
                        qkv[o..o + hq * dh].iter().map(|x| x.to_f32()).collect()
                    })
                    .collect()
            })
            .collect();
        self.last_selections = (0..nl)
            .map(|l| {
                (0..n)
                    .map(|i| {
                        (0..hk)
                            .map(|h| {
                                let r = (l * n + i) * hk + h;
                                let k = nsel[r].clamp(0, s_max as i32) as usize;
                                sel[r * s_max..r * s_max + k]
                                    .iter()
                                    .map(|&m| m.max(0) as usize)
                                    .collect()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Ok(())
    }

    /// First half of layer `l` over n rows: residual add + input RMSNorm,
    /// the fused QKV(+z) GEMM (+bias) into `ws.qkv` at element `qkv_off`,
    /// RoPE and the KV append (+ eviction score), and — `comp` = (new
    /// tokens, grid width) — the compression of the windows this call
    /// completes (GPU selection).
    #[allow(clippy::too_many_arguments)]
    fn layer_front(
        &self,
        l: usize,
        ws: &mut Workspace,
        n: usize,
        ns: usize,
        qkv_off: usize,
        inp: &RowInputs,
        tab: &Tables,
        comp: Option<(usize, usize)>,
        ring: usize,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, hq, hk, dh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let lw = &self.layers[l];
        let w = self.qkv_cols;
        if self.on(StepPart::NormIn) {
            ops::add_rmsnorm(
                gpu,
                &mut ws.resid.slice_mut(0..n * d),
                &ws.delta.slice(0..n * d),
                if l == 0 { 1.0 } else { cfg.residual_scale() },
                &lw.input_norm,
                cfg.rms_norm_eps,
                &mut ws.xn.slice_mut(0..n * d),
            )?;
        }
        let qp = dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64;
        if self.on(StepPart::Qkv) {
            gpu.linear(
                &ws.xn.slice(0..n * d),
                n,
                d,
                &lw.wqkv,
                w,
                &mut ws.qkv.slice_mut(qkv_off..qkv_off + n * w),
            )?;
            if let Some(b) = &lw.bqkv {
                Self::bias_add(gpu, qp, w, b, n, w)?;
            }
        }
        // RoPE + append (+ eviction score).
        let t = self.rope_tables.as_ref().expect("rope tables ensured");
        let (cosp, sinp) = (dptr(gpu, &t.cos), dptr(gpu, &t.sin));
        let (ap, zbp) = match (&lw.evict_a, &lw.evict_zb) {
            (Some(a), Some(zb)) => (dptr(gpu, a), dptr(gpu, zb)),
            _ => (0u64, 0u64),
        };
        let cstate = if self.eviction { tab.c_state } else { 0u64 };
        let (w_, h_, hk_, d_, tr, zo) = (
            i32_dim(w, "qkv row")?,
            i32_dim(hq, "H")?,
            i32_dim(hk, "Hkv")?,
            i32_dim(dh, "D")?,
            i32_dim(t.rows, "rope rows")?,
            i32_dim(self.z_off, "z offset")?,
        );
        let ring_ = i32_dim(ring, "ring tokens")?;
        let f = gpu.function("qkv_rope_append")?;
        let lc = LaunchConfig {
            grid_dim: (grid(n, "rows")?, grid(hq + 2 * hk, "heads")?, 1),
            block_dim: (((dh / 2).div_ceil(32) * 32).clamp(32, 128) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&qp)
            .arg(&w_)
            .arg(&h_)
            .arg(&hk_)
            .arg(&d_)
            .arg(&inp.pos)
            .arg(&cosp)
            .arg(&sinp)
            .arg(&tr)
            .arg(&tab.k)
            .arg(&tab.v)
            .arg(&cstate)
            .arg(&zo)
            .arg(&ap)
            .arg(&zbp)
            .arg(&ring_);
        if self.on(StepPart::RopeAppend) {
            // SAFETY: argument list matches kernels/kv_append.cu; every row's
            // position is below its sequence's capacity (ensure_capacity) and the
            // kernel skips positions past the RoPE table; pointer tables hold n rows.
            unsafe { b.launch(lc) }.cuda("qkv_rope_append")?;
        }
        if let Some((n_new, gx)) = comp {
            if gx > 0 && self.on(StepPart::Compress) {
                compress(
                    gpu,
                    &self.plan.budget,
                    tab,
                    inp.seq_lens,
                    ns,
                    n_new,
                    gx,
                    hk,
                    dh,
                    self.eviction,
                    ring,
                )?;
            }
        }
        Ok(())
    }

    /// Second half of layer `l`: attention (dense, or sparse over the lists
    /// at `sel_off` / `nsel_off`) and its combine into `ws.attn`, O
    /// projection (+bias), residual add + post-attention RMSNorm, gate|up
    /// GEMM (+bias), SwiGLU, down projection (+bias) into `ws.delta`.
    #[allow(clippy::too_many_arguments)]
    fn layer_back(
        &self,
        l: usize,
        ws: &mut Workspace,
        n: usize,
        qkv_off: usize,
        sel_off: usize,
        nsel_off: usize,
        inp: &RowInputs,
        tab: &Tables,
        geo: &AttnGeometry,
        slots: Option<(u64, u64, usize, usize)>,
        open: SpanId,
    ) -> Result<SpanId> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, hq, hk, dh, inter) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        );
        let budget = &self.plan.budget;
        let (part_o, part_ml) = (dptr(gpu, &ws.part_o), dptr(gpu, &ws.part_ml));
        let args = AttnArgs {
            q: dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64,
            q_stride: self.qkv_cols,
            kptr: tab.k,
            vptr: tab.v,
            cptr: if geo.sparse { tab.c_attn } else { 0 },
            lens: inp.lens,
            sel: if geo.sparse {
                dptr(gpu, &ws.sel) + (sel_off * 4) as u64
            } else {
                0
            },
            nsel: if geo.sparse {
                dptr(gpu, &ws.nsel) + (nsel_off * 4) as u64
            } else {
                0
            },
            s_max: geo.s_max,
            block_size: budget.block_size,
            span: geo.span,
            nsplit: geo.nsplit,
            part_o,
            part_ml,
            rows: n,
            heads: hq,
            kv_heads: hk,
            head_dim: dh,
            scale: cfg.attn_scale(),
            out: dptr(gpu, &ws.attn),
            out_stride: hq * dh,
            counters: 0,
            slot_list: slots.map_or(0, |s| s.0),
            pool_ptr: slots.map_or(0, |s| s.1),
            pool_slots: slots.map_or(0, |s| s.2),
            ring: slots.map_or(0, |s| s.3),
        };
        // The split-K combine runs inside the attention kernel when asked
        // (SPARDA_FUSED_COMBINE=1); its time then counts as Attention.
        let fused = ops::attn_fused_combine(geo.nsplit, dh);
        let args = AttnArgs {
            counters: if fused { dptr(gpu, &ws.attn_count) } else { 0 },
            ..args
        };
        let cs = gpu.stream();
        let sp = self.tspan_next(cs, open, "attention", l)?;
        if self.on(StepPart::Attention) {
            ops::launch_attn_partial(gpu, &args)?;
        }
        if !fused && self.on(StepPart::Combine) {
            ops::launch_attn_combine(
                gpu,
                part_o,
                part_ml,
                dptr(gpu, &ws.attn),
                hq * dh,
                n,
                hq,
                dh,
                geo.nsplit,
            )?;
        }
        let sp = self.tspan_next(cs, sp, "o_proj", l)?;
        let lw = &self.layers[l];
        if self.on(StepPart::OProj) {
            gpu.linear(
                &ws.attn.slice(0..n * hq * dh),
                n,
                hq * dh,
                &lw.wo,
                d,
                &mut ws.delta.slice_mut(0..n * d),
            )?;
            if let Some(b) = &lw.bo {
                Self::bias_add(gpu, dptr(gpu, &ws.delta), d, b, n, d)?;
            }
        }
        let sp = self.tspan_next(cs, sp, "ffn", l)?;
        if self.on(StepPart::NormPost) {
            ops::add_rmsnorm(
                gpu,
                &mut ws.resid.slice_mut(0..n * d),
                &ws.delta.slice(0..n * d),
                cfg.residual_scale(),
                &lw.post_norm,
                cfg.rms_norm_eps,
                &mut ws.xn.slice_mut(0..n * d),
            )?;
        }
        if self.on(StepPart::GateUp) {
            gpu.linear(
                &ws.xn.slice(0..n * d),
                n,
                d,
                &lw.wgu,
                2 * inter,
                &mut ws.gu.slice_mut(0..n * 2 * inter),
            )?;
            if let Some(b) = &lw.bgu {
                Self::bias_add(gpu, dptr(gpu, &ws.gu), 2 * inter, b, n, 2 * inter)?;
            }
        }
        if self.on(StepPart::Swiglu) {
            ops::swiglu(
                gpu,
                &ws.gu.slice(0..n * 2 * inter),
                n,
                inter,
                &mut ws.act.slice_mut(0..n * inter),
            )?;
        }
        if self.on(StepPart::Down) {
            gpu.linear(
                &ws.act.slice(0..n * inter),
                n,
                inter,
                &lw.wdown,
                d,
                &mut ws.delta.slice_mut(0..n * d),
            )?;
            if let Some(b) = &lw.bdown {
                Self::bias_add(gpu, dptr(gpu, &ws.delta), d, b, n, d)?;
            }
        }
        Ok(sp)
    }

    /// Final residual add + norm (÷ logit divisor folded into its weight)
    /// over n rows, then the lm_head GEMM (f32) of rows first … first+m−1
    /// into `ws.logits` rows 0 … m−1.
    fn head(&self, ws: &mut Workspace, n: usize, first: usize, m: usize) -> Result<()> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, vocab) = (cfg.hidden_size, cfg.vocab_size);
        if self.on(StepPart::FinalNorm) {
            ops::add_rmsnorm(
                gpu,
                &mut ws.resid.slice_mut(0..n * d),
                &ws.delta.slice(0..n * d),
                cfg.residual_scale(),
                &self.final_norm,
                cfg.rms_norm_eps,
                &mut ws.xn.slice_mut(0..n * d),
            )?;
        }
        if m == 0 || !self.on(StepPart::LmHead) {
            return Ok(());
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        gpu.linear(
            &ws.xn.slice(first * d..(first + m) * d),
            m,
            d,
            head,
            vocab,
            &mut ws.logits.slice_mut(0..m * vocab),
        )
    }

    /// GPU block selection of every row (spec §4) through the per-row
    /// tables: `qa_window_logits` + `qa_window_scores` over up to `geo.mc`
    /// windows (grids sized by it; each row scores the Mc(pos+1) windows it
    /// sees), then `select_blocks` over up to `geo.nb_cap` blocks into the
    /// lists at `sel_off` / `nsel_off` (width `geo.s_max`).
    #[allow(clippy::too_many_arguments)]
    fn gpu_select(
        &self,
        ws: &Workspace,
        n: usize,
        qkv_off: usize,
        sel_off: usize,
        nsel_off: usize,
        inp: &RowInputs,
        tab: &Tables,
        geo: &SelGeometry,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (hq, hk, dh) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let budget = &self.plan.budget;
        let g = hq / hk;
        let qa_tile = super::select::QA_TILE;
        let ntiles = geo.w_stride / qa_tile;
        let (qs, h_, hk_, d_, wst, nt, st, ks) = (
            i32_dim(self.qkv_cols, "q_stride")?,
            i32_dim(hq, "H")?,
            i32_dim(hk, "Hkv")?,
            i32_dim(dh, "D")?,
            i32_dim(geo.w_stride, "w_stride")?,
            i32_dim(ntiles, "tiles")?,
            i32_dim(budget.kernel_stride, "kernel_stride")?,
            i32_dim(budget.kernel_size, "kernel_size")?,
        );
        let qp = dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64;
        let lp = inp.lens;
        let (lgp, stp, sp) = (
            dptr(gpu, &ws.qa_logits),
            dptr(gpu, &ws.qa_stats),
            dptr(gpu, &ws.qa_scores),
        );
        if geo.mc > 0 && self.on(StepPart::WindowScores) {
            let tiles = geo.mc.div_ceil(qa_tile);
            let grid3 = (grid(tiles, "tiles")?, grid(hk, "Hkv")?, grid(n, "rows")?);
            let scale = 1.0 / (dh as f32).sqrt();
            let f1 = gpu.function("qa_window_logits")?;
            let smem1 = ensure_smem(
                gpu,
                f1,
                super::select::qa_logits_smem_bytes(g, dh),
                0,
                "qa_window_logits",
            )?;
            let mut l1 = gpu.stream().launch_builder(f1);
            l1.arg(&qp)
                .arg(&qs)
                .arg(&tab.kc)
                .arg(&lp)
                .arg(&lgp)
                .arg(&stp)
                .arg(&h_)
                .arg(&hk_)
                .arg(&d_)
                .arg(&wst)
                .arg(&nt)
                .arg(&st)
                .arg(&ks)
                .arg(&scale);
            let cfg1 = LaunchConfig {
                grid_dim: grid3,
                block_dim: (super::select::QA_THREADS, 1, 1),
                shared_mem_bytes: smem1,
            };
            // SAFETY: argument list matches qa_window_logits (kernels/select.cu); each
            // row's Kc holds ≥ Mc(pos+1) windows (compressed above); the workspace
            // holds n·H·w_stride logits and n·H·ntiles·2 statistics.
            unsafe { l1.launch(cfg1) }.cuda("qa_window_logits")?;
            let f2 = gpu.function("qa_window_scores")?;
            let smem2 = ensure_smem(gpu, f2, 2 * g * 4, 0, "qa_window_scores")?;
            let mut l2 = gpu.stream().launch_builder(f2);
            l2.arg(&lgp)
                .arg(&stp)
                .arg(&lp)
                .arg(&sp)
                .arg(&h_)
                .arg(&hk_)
                .arg(&wst)
                .arg(&nt)
                .arg(&st)
                .arg(&ks);
            let cfg2 = LaunchConfig {
                grid_dim: grid3,
                block_dim: (128, 1, 1),
                shared_mem_bytes: smem2,
            };
            // SAFETY: argument list matches qa_window_scores; reads what the
            // previous kernel wrote for windows < Mc; scores hold n·Hkv·w_stride.
            unsafe { l2.launch(cfg2) }.cuda("qa_window_scores")?;
        }
        if !self.on(StepPart::Select) {
            return Ok(());
        }
        self.select_from_scores(ws, n, tab, sel_off, nsel_off, lp, 0, geo, "select_blocks")
    }

    /// `select_blocks` (spec §4 steps 2–6) of n rows from the window scores
    /// in `ws.qa_scores` and the p of the layer whose tables are `tab`, into
    /// the lists at `sel_off` / `nsel_off`; windows Mc(`win_lens`) (0: Mc of
    /// the rows' lengths `lens`).
    #[allow(clippy::too_many_arguments)]
    fn select_from_scores(
        &self,
        ws: &Workspace,
        n: usize,
        tab: &Tables,
        sel_off: usize,
        nsel_off: usize,
        lens: u64,
        win_lens: u64,
        geo: &SelGeometry,
        op: &str,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let nosa = self.plan.mode == AttentionMode::Nosa;
        let args = SelectBlocksArgs {
            scores: dptr(gpu, &ws.qa_scores),
            p: if nosa { tab.p } else { 0 },
            lens,
            sel: dptr(gpu, &ws.sel) + (sel_off * 4) as u64,
            nsel: dptr(gpu, &ws.nsel) + (nsel_off * 4) as u64,
            pooled_r: 0,
            pooled_e: 0,
            w_stride: geo.w_stride,
            s_max: geo.s_max,
            nb_stride: 0,
            blocks: geo.nb_cap,
            kv_heads: self.config.num_key_value_heads,
            rows: n,
            nosa,
            win_lens,
        };
        // SAFETY: every row has ≤ nb_cap blocks (the kernel clears rows with
        // more) and Mc(win_lens or lens) ≤ w_stride scored windows, its p
        // (NOSA) holds them; the lists hold n·Hkv·s_max / n·Hkv entries.
        unsafe { launch_select_blocks(gpu, &self.plan.budget, &args, op) }
    }

    /// Dense rows of a sparse forward call (dense_len) get every existing
    /// block (`sel_fill_dense`); `s_max` ≥ their block counts.
    fn fill_dense_rows(&self, ws: &Workspace, n: usize, lens: u64, s_max: usize) -> Result<()> {
        let gpu = &*self.gpu;
        let hk = self.config.num_key_value_heads;
        let (hk_, sm, bs) = (
            i32_dim(hk, "Hkv")?,
            i32_dim(s_max, "s_max")?,
            i32_dim(self.plan.budget.block_size, "block size")?,
        );
        let (selp, nselp, dp) = (
            dptr(gpu, &ws.sel),
            dptr(gpu, &ws.nsel),
            dptr(gpu, &ws.dense),
        );
        let f = gpu.function("sel_fill_dense")?;
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&selp)
            .arg(&nselp)
            .arg(&dp)
            .arg(&lens)
            .arg(&hk_)
            .arg(&sm)
            .arg(&bs);
        let cfg = LaunchConfig {
            grid_dim: (grid(n, "rows")?, grid(hk, "Hkv")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument list matches kernels/sel_fill.cu; s_max ≥ every dense
        // row's block count (sized by the caller).
        unsafe { b.launch(cfg) }.cuda("sel_fill_dense").map(drop)
    }

    /// Times each piece of the current decode step ([`StepPart`]) alone: per
    /// piece, its launches for the whole step (every layer) captured as one
    /// CUDA graph, two warm-up replays, then the median of `reps` replays, in
    /// milliseconds per step. Pieces that do not run in this step (selection
    /// in a dense step) and [`StepPart::Argmax`] (it would advance the step
    /// inputs) are left out. Replays repeat the step's side effects (the
    /// same token appended again, queries rotated again), so the batch's
    /// state is garbage afterwards: the step is dropped, and the sequences
    /// must be dropped too.
    ///
    /// Errors: [`Error::Input`] without a device-resident step (run a
    /// decode step first) or for reps 0; [`Error::Cuda`] on a failure.
    pub fn profile_step(&mut self, reps: usize) -> Result<Vec<(StepPart, f64)>> {
        if reps == 0 {
            return Err(Error::Input("profile_step: reps must be ≥ 1".into()));
        }
        let mut st = self.step.take().ok_or_else(|| {
            Error::Input("profile_step: no device-resident decode step; run one first".into())
        })?;
        self.last = LastLogits::None;
        let gpu = self.gpu.clone();
        let sparse = st.attn.sparse;
        let gpu_sel = self.gpu_selection();
        let fused_combine = ops::attn_fused_combine(st.attn.nsplit, self.config.head_dim);
        let mut out = Vec::new();
        for part in StepPart::ALL {
            let applies = match part {
                StepPart::Argmax => false,
                StepPart::Compress => gpu_sel,
                StepPart::WindowScores | StepPart::Select => sparse,
                // Fused into Attention: nothing of its own to time.
                StepPart::Combine => !fused_combine,
                _ => true,
            };
            if !applies {
                continue;
            }
            self.only_part.set(Some(part));
            let g = gpu.capture(|| self.enqueue_step(&mut st));
            self.only_part.set(None);
            let g = g?;
            for _ in 0..2 {
                g.launch().cuda("cuGraphLaunch")?;
            }
            let mut ms = Vec::with_capacity(reps);
            for _ in 0..reps {
                let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
                a.record(gpu.stream()).cuda("cuEventRecord")?;
                g.launch().cuda("cuGraphLaunch")?;
                b.record(gpu.stream()).cuda("cuEventRecord")?;
                b.synchronize().cuda("cuEventSynchronize")?;
                ms.push(a.elapsed_ms(&b).cuda("cuEventElapsedTime")? as f64);
            }
            ms.sort_by(f64::total_cmp);
            out.push((part, ms[ms.len() / 2]));
        }
        drop(st);
        Ok(out)
    }

    /// Times the layer GEMMs alone (runtime.md §4's ceiling): every layer's
    /// QKV+z, O, gate|up and down GEMMs at `batch` rows on random bf16
    /// activations, captured as one CUDA graph and replayed `reps` times
    /// (after three warm-up replays), median per replay; and the lm_head
    /// GEMM alone, eagerly, median of `reps`.
    ///
    /// Errors: [`Error::Input`] for batch 0 or reps 0; [`Error::Cuda`] on a
    /// device failure.
    pub fn gemm_ceiling(&self, batch: usize, reps: usize) -> Result<GemmCeiling> {
        if batch == 0 || reps == 0 {
            return Err(Error::Input(
                "gemm_ceiling: batch and reps must be ≥ 1".into(),
            ));
        }
        let gpu = &*self.gpu;
        let c = &self.config;
        let (d, hq, dh, inter, vocab) = (
            c.hidden_size,
            c.num_attention_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        );
        let w = self.qkv_cols;
        let width = d.max(inter).max(hq * dh);
        let x: CudaSlice<Bf16> = gpu.zeros(batch * width)?;
        {
            let f = gpu.function("fill_normal_bf16")?;
            let (p, n, seed, scale) = (dptr(gpu, &x), (batch * width) as u64, 7u64, 1.0f32);
            let mut b = gpu.stream().launch_builder(f);
            b.arg(&p).arg(&n).arg(&seed).arg(&scale);
            let cfg = LaunchConfig {
                grid_dim: ((batch * width).div_ceil(256).min(16_384) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches kernels/synth.cu; x holds n values.
            unsafe { b.launch(cfg) }.cuda("fill_normal_bf16")?;
        }
        let mut yq: CudaSlice<Bf16> = gpu.zeros(batch * w)?;
        let mut yo: CudaSlice<Bf16> = gpu.zeros(batch * d)?;
        let mut yg: CudaSlice<Bf16> = gpu.zeros(batch * 2 * inter)?;
        let mut logits: CudaSlice<f32> = gpu.zeros(batch * vocab)?;
        let enqueue = |yq: &mut CudaSlice<Bf16>,
                       yo: &mut CudaSlice<Bf16>,
                       yg: &mut CudaSlice<Bf16>|
         -> Result<()> {
            for lw in &self.layers {
                gpu.linear(&x.slice(0..batch * d), batch, d, &lw.wqkv, w, yq)?;
                gpu.linear(&x.slice(0..batch * hq * dh), batch, hq * dh, &lw.wo, d, yo)?;
                gpu.linear(&x.slice(0..batch * d), batch, d, &lw.wgu, 2 * inter, yg)?;
                gpu.linear(&x.slice(0..batch * inter), batch, inter, &lw.wdown, d, yo)?;
            }
            Ok(())
        };
        // Warm up eagerly (cuBLAS picks its kernels), then capture: once with
        // cuBLAS alone, once with the engine's routing.
        let small = gpu.small_gemv();
        gpu.set_small_gemv(false);
        let captured = (|| -> Result<(CudaGraph, CudaGraph)> {
            enqueue(&mut yq, &mut yo, &mut yg)?;
            gpu.synchronize()?;
            let cublas = gpu.capture(|| enqueue(&mut yq, &mut yo, &mut yg))?;
            gpu.set_small_gemv(small);
            enqueue(&mut yq, &mut yo, &mut yg)?;
            gpu.synchronize()?;
            let engine = gpu.capture(|| enqueue(&mut yq, &mut yo, &mut yg))?;
            Ok((cublas, engine))
        })();
        gpu.set_small_gemv(small);
        let (graph, graph_engine) = captured?;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
            a.record(gpu.stream()).cuda("cuEventRecord")?;
            f()?;
            b.record(gpu.stream()).cuda("cuEventRecord")?;
            b.synchronize().cuda("cuEventSynchronize")?;
            Ok(a.elapsed_ms(&b).cuda("cuEventElapsedTime")? as f64)
        };
        for _ in 0..3 {
            graph.launch().cuda("cuGraphLaunch")?;
        }
        let mut layer_ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            layer_ms.push(time(&mut || graph.launch().cuda("cuGraphLaunch"))?);
        }
        for _ in 0..3 {
            graph_engine.launch().cuda("cuGraphLaunch")?;
        }
        let mut engine_ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            engine_ms.push(time(&mut || graph_engine.launch().cuda("cuGraphLaunch"))?);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut head_ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            head_ms.push(time(&mut || {
                gpu.linear(
                    &x.slice(0..batch * d),
                    batch,
                    d,
                    head,
                    vocab,
                    &mut logits.slice_mut(0..batch * vocab),
                )
            })?);
        }
        let layer_weight_bytes: usize = self
            .layers
            .iter()
            .map(|l| (l.wqkv.len() + l.wo.len() + l.wgu.len() + l.wdown.len()) * 2)
            .sum();
        let layers_graph_ms = median(&mut layer_ms);
        Ok(GemmCeiling {
            batch,
            layers_graph_ms,
            layers_graph_ms_engine: median(&mut engine_ms),
            lm_head_ms: median(&mut head_ms),
            layer_weight_bytes,
            layers_gb_per_s: layer_weight_bytes as f64 / (layers_graph_ms * 1e-3) / 1e9,
            reps,
        })
    }

    /// One forward call over `rows` (see [`Row`]) of `seqs`: appends every
    /// row's token to its sequence and computes the logits `which` asks for.
    /// Rows of one sequence must be at consecutive positions starting at its
    /// length (the public entry points guarantee it). Grids are sized by the
    /// call's own lengths; pointer tables and row inputs are uploaded per
    /// call (prefill chunks, and decode batches the device-resident step
    /// does not take).
    fn forward(&mut self, seqs: &mut [GpuSequence], rows: &[Row], which: LogitRows) -> Result<()> {
        let n = rows.len();
        if n == 0 {
            return Err(Error::Input("forward called with no tokens".into()));
        }
        let (d, hq, hk, dh, vocab, nl) = (
            self.config.hidden_size,
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.config.head_dim,
            self.config.vocab_size,
            self.config.num_hidden_layers,
        );
        let ns = seqs.len();
        if seqs.iter().any(|s| s.off.is_some()) {
            return Err(Error::Input(
                "an offloaded sequence takes decode steps only (prefill before offload_sequence; every row sparse)".into(),
            ));
        }
        let sparse_plan = self.sparse_plan();
        let path = self.selection;
        // Each row extends its sequence; every sequence carries its path's state.
        let mut new_len = seqs.iter().map(|s| s.len).collect::<Vec<_>>();
        for r in rows {
            if r.seq >= ns || r.pos != new_len[r.seq] {
                return Err(Error::Input(format!(
                    "forward: row for sequence {} at position {} does not extend it (length {})",
                    r.seq,
                    r.pos,
                    new_len.get(r.seq).copied().unwrap_or(0)
                )));
            }
            new_len[r.seq] += 1;
        }
        if sparse_plan {
            for (i, sq) in seqs.iter().enumerate() {
                let ok = match path {
                    SelectionPath::HostFallback => sq.mirror.is_some(),
                    SelectionPath::Gpu => sq.layers.iter().all(|l| l.kc.is_some()),
                };
                if !ok {
                    return Err(Error::Input(format!(
                        "forward: sequence {i} was not made by this model's selection path {path:?} (create sequences after with_selection_path)"
                    )));
                }
            }
        }
        // Room for every row, RoPE tables, workspace (after the spills of
        // earlier calls, which read the K/V buffers growth may replace).
        self.spill_wait(seqs)?;
        for (sq, &len) in seqs.iter_mut().zip(&new_len) {
            self.ensure_capacity(sq, len)?;
        }
        let max_pos = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        self.ensure_rope(max_pos)?;
        self.ensure_workspace(n)?;
        let any_sparse = rows.iter().any(|r| r.sparse);
        let any_dense_in_sparse = any_sparse && rows.iter().any(|r| !r.sparse);
        let budget = self.plan.budget;
        // Block-list width: S for sparse rows; a dense row of a sparse call lists all its blocks.
        let s_max = if any_sparse {
            rows.iter()
                .map(|r| {
                    if r.sparse {
                        budget.attended
                    } else {
                        budget.blocks(r.pos)
                    }
                })
                .max()
                .unwrap_or(1)
                .max(budget.attended)
                .max(1)
        } else {
            1
        };
        let hb = ops::attn_head_blocks(hq, hk);
        let (span, nsplit) = if any_sparse {
            ops::attn_sparse_split(n, hb, s_max)
        } else {
            ops::attn_dense_split(n, hb, max_pos)
        };
        let attn_geo = AttnGeometry {
            sparse: any_sparse,
            span,
            nsplit,
            s_max,
        };
        // Query-aware scoring workspace (GPU selection): every row of a sparse
        // call is scored (dense rows' lists are overwritten afterwards), so
        // the widths cover them all.
        let mc_max = if any_sparse {
            rows.iter()
                .map(|r| budget.windows(r.pos + 1))
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let qa_tile = super::select::QA_TILE;
        let w_stride = mc_max.max(1).div_ceil(qa_tile) * qa_tile;
        let ntiles = w_stride / qa_tile;
        let nb_max = rows
            .iter()
            .map(|r| budget.blocks(r.pos))
            .max()
            .unwrap_or(1)
            .max(1);
        let sel_geo = SelGeometry {
            mc: mc_max,
            w_stride,
            nb_cap: nb_max,
            s_max,
        };
        let gpu = self.gpu.clone();
        let s = gpu.stream().clone();
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * ns;
        let table = self.pointer_tables(seqs, rows);
        let mut ws = self.ws.take().expect("workspace allocated above");
        let r = (|| -> Result<Option<()>> {
            let part = n * hq * nsplit;
            // SAFETY (each `alloc` below): written by a kernel or copy before it is read.
            if ws.part_o.len() < part * dh {
                ws.part_o = unsafe { s.alloc(part * dh) }.cuda("allocating attention partials")?;
            }
            if ws.part_ml.len() < part * 2 {
                ws.part_ml = unsafe { s.alloc(part * 2) }.cuda("allocating attention partials")?;
            }
            let counts = n * ops::attn_head_blocks(hq, hk);
            if ws.attn_count.len() < counts {
                ws.attn_count = s
                    .alloc_zeros(counts)
                    .cuda("allocating attention counters")?;
            }
            if ws.sel.len() < n * hk * s_max {
                ws.sel = unsafe { s.alloc(n * hk * s_max) }.cuda("allocating block lists")?;
            }
            if ws.ptrs.len() < nl * per_layer {
                ws.ptrs = unsafe { s.alloc(nl * per_layer) }.cuda("allocating pointer tables")?;
            }
            if ws.seq_lens.len() < ns {
                ws.seq_lens = unsafe { s.alloc(ns) }.cuda("allocating sequence lengths")?;
            }
            if any_sparse && path == SelectionPath::Gpu {
                if ws.qa_logits.len() < n * hq * w_stride {
                    ws.qa_logits = unsafe { s.alloc(n * hq * w_stride) }
                        .cuda("allocating the window-score workspace")?;
                }
                if ws.qa_stats.len() < n * hq * ntiles * 2 {
                    ws.qa_stats = unsafe { s.alloc(n * hq * ntiles * 2) }
                        .cuda("allocating the window-score workspace")?;
                }
                if ws.qa_scores.len() < n * hk * w_stride {
                    ws.qa_scores = unsafe { s.alloc(n * hk * w_stride) }
                        .cuda("allocating the window-score workspace")?;
                }
            }
            // Row inputs and pointer tables.
            let ids: Vec<u32> = rows.iter().map(|r| r.token).collect();
            let pos: Vec<i32> = rows.iter().map(|r| r.pos as i32).collect();
            let lens: Vec<i32> = rows.iter().map(|r| r.pos as i32 + 1).collect();
            let dense: Vec<i32> = rows.iter().map(|r| i32::from(!r.sparse)).collect();
            let slens: Vec<i32> = new_len.iter().map(|&l| l as i32).collect();
            s.memcpy_htod(&ids, &mut ws.ids.slice_mut(0..n))
                .cuda("uploading token ids")?;
            s.memcpy_htod(&pos, &mut ws.pos.slice_mut(0..n))
                .cuda("uploading positions")?;
            s.memcpy_htod(&lens, &mut ws.lens.slice_mut(0..n))
                .cuda("uploading lengths")?;
            s.memcpy_htod(&dense, &mut ws.dense.slice_mut(0..n))
                .cuda("uploading row modes")?;
            s.memcpy_htod(&slens, &mut ws.seq_lens.slice_mut(0..ns))
                .cuda("uploading sequence lengths")?;
            s.memcpy_htod(&table, &mut ws.ptrs.slice_mut(0..nl * per_layer))
                .cuda("uploading KV pointer tables")?;
            // Embedding; the residual stream starts at zero and takes it as layer 0's delta.
            ops::embed_gather(
                &gpu,
                &self.embed,
                vocab,
                d,
                &ws.ids.slice(0..n),
                self.config.embed_scale(),
                &mut ws.delta.slice_mut(0..n * d),
            )?;
            s.memset_zeros(&mut ws.resid.slice_mut(0..n * d))
                .cuda("zeroing the residual stream")?;
            Ok(Some(()))
        })();
        if let Err(e) = r {
            self.ws = Some(ws);
            return Err(e);
        }
        let inp = RowInputs {
            pos: dptr(&gpu, &ws.pos),
            lens: dptr(&gpu, &ws.lens),
            seq_lens: dptr(&gpu, &ws.seq_lens),
        };
        // Tokens each sequence gains in this call (compression recomputes at most
        // that many tokens' windows; recomputing a complete window is idempotent).
        let n_new = seqs
            .iter()
            .zip(&new_len)
            .map(|(sq, &l)| l - sq.len)
            .max()
            .unwrap_or(0);
        let new_windows = new_len
            .iter()
            .map(|&t| budget.windows(t) - budget.windows(t.saturating_sub(n_new)))
            .max()
            .unwrap_or(0);
        if self.record_selections {
            self.last_selections = vec![Vec::new(); nl];
            self.last_queries = vec![Vec::new(); nl];
        }
        let w = self.qkv_cols;
        let ptrs = dptr(&gpu, &ws.ptrs);
        // A sequence prefilled for offload writes this call's completed
        // blocks to host memory layer by layer (begin_offload).
        let spill = if ns == 1 {
            self.spill_tables(&seqs[0], new_len[0])?
        } else {
            None
        };
        let r = (|| -> Result<()> {
            for l in 0..nl {
                let tab = Tables::new(ptrs + (l * per_layer * 8) as u64, n, ns);
                let comp = (sparse_plan && path == SelectionPath::Gpu && new_windows > 0)
                    .then_some((n_new, new_windows.min(COMPRESS_MAX_GRID_X)));
                self.layer_front(l, &mut ws, n, ns, 0, &inp, &tab, comp, 0)?;
                if let Some(t) = &spill {
                    self.spill_layer(&seqs[0], l, t, new_len[0])?;
                }
                // Selection state and block lists (spec §3–§4).
                if sparse_plan && path == SelectionPath::HostFallback {
                    // The mirror takes every token (dense phases included).
                    let lists = host_select(
                        &gpu,
                        &self.plan,
                        &self.config,
                        &ws,
                        seqs,
                        rows,
                        l,
                        w,
                        any_sparse,
                    )?;
                    if let Some(lists) = lists {
                        let mut sel = vec![-1i32; n * hk * s_max];
                        let mut nsel = vec![0i32; n * hk];
                        for (i, per) in lists.iter().enumerate() {
                            for (h, list) in per.iter().enumerate() {
                                for (j, &m) in list.iter().enumerate() {
                                    sel[(i * hk + h) * s_max + j] = m as i32;
                                }
                                nsel[i * hk + h] = list.len() as i32;
                            }
                        }
                        s.memcpy_htod(&sel, &mut ws.sel.slice_mut(0..sel.len()))
                            .cuda("uploading block lists")?;
                        s.memcpy_htod(&nsel, &mut ws.nsel.slice_mut(0..nsel.len()))
                            .cuda("uploading block counts")?;
                    }
                } else if any_sparse {
                    self.gpu_select(&ws, n, 0, 0, 0, &inp, &tab, &sel_geo)?;
                    if any_dense_in_sparse {
                        self.fill_dense_rows(&ws, n, inp.lens, s_max)?;
                    }
                }
                if self.record_selections {
                    self.record_forward_layer(l, &ws, rows, any_sparse, s_max)?;
                }
                let sp = self.layer_back(
                    l,
                    &mut ws,
                    n,
                    0,
                    0,
                    0,
                    &inp,
                    &tab,
                    &attn_geo,
                    None,
                    SpanId::NONE,
                )?;
                self.tspan_end(self.gpu.stream(), sp)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            self.ws = Some(ws);
            if spill.is_some() {
                // the spill tables are dropped below: no spill may still read them
                self.spill_wait(seqs)?;
            }
            return Err(e);
        }
        let bs = self.plan.budget.block_size;
        for (sq, len) in seqs.iter_mut().zip(new_len) {
            sq.len = len;
            if spill.is_some() {
                if let Some(sp) = sq.spill.as_mut() {
                    sp.advance(len, bs);
                }
            }
        }
        // The spill tables are read by the write-back stream: keep them
        // alive until it is done with them.
        if spill.is_some() {
            self.spill_wait(seqs)?;
        }
        drop(spill);
        let (first, m) = match which {
            LogitRows::None => (0, 0),
            LogitRows::Last => (n - 1, 1),
            LogitRows::All => (0, n),
        };
        let r = self.head(&mut ws, n, first, m);
        self.ws = Some(ws);
        r?;
        self.last = if m == 0 {
            LastLogits::None
        } else {
            LastLogits::Forward(m)
        };
        Ok(())
    }

    /// Records layer `l` of a forward call (queries and lists of sparse
    /// calls; empty lists for dense calls).
    fn record_forward_layer(
        &mut self,
        l: usize,
        ws: &Workspace,
        rows: &[Row],
        any_sparse: bool,
        s_max: usize,
    ) -> Result<()> {
        let (hq, hk, dh) = (
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.config.head_dim,
        );
        let (n, w) = (rows.len(), self.qkv_cols);
        if !any_sparse {
            self.last_selections[l] = vec![vec![Vec::new(); hk]; n];
            return Ok(());
        }
        let qkv = self.gpu.download(&ws.qkv.slice(0..n * w))?;
        self.last_queries[l] = (0..n)
            .map(|i| {
                qkv[i * w..i * w + hq * dh]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect()
            })
            .collect();
        let sel = self.gpu.download(&ws.sel.slice(0..n * hk * s_max))?;
        let nsel = self.gpu.download(&ws.nsel.slice(0..n * hk))?;
        self.last_selections[l] = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (0..hk)
                    .map(|h| {
                        if !r.sparse {
                            return Vec::new();
                        }
                        let k = nsel[i * hk + h].clamp(0, s_max as i32) as usize;
                        let row = &sel[(i * hk + h) * s_max..];
                        row[..k].iter().map(|&m| m.max(0) as usize).collect()
                    })
                    .collect()
            })
            .collect();
        Ok(())
    }
}

/// Device addresses of one layer's pointer tables (see [`PTRS_PER_ROW`],
/// [`PTRS_PER_SEQ`]): u64 arrays of n rows / ns sequences.
struct Tables {
    /// Per row: K cache, V cache, c (state, for the append), c (attention
    /// bias: 0 for dense rows and InfLLM-V2), Kc, p.
    k: u64,
    v: u64,
    c_state: u64,
    c_attn: u64,
    kc: u64,
    p: u64,
    /// Per sequence: K, c, Kc, p (compression).
    seq_k: u64,
    seq_c: u64,
    seq_kc: u64,
    seq_p: u64,
}

impl Tables {
    /// The tables of a layer block starting at device address `base`.
    fn new(base: u64, n: usize, ns: usize) -> Self {
        let at = |i: usize| base + (i * 8) as u64;
        Tables {
            k: at(0),
            v: at(n),
            c_state: at(2 * n),
            c_attn: at(3 * n),
            kc: at(4 * n),
            p: at(5 * n),
            seq_k: at(6 * n),
            seq_c: at(6 * n + ns),
            seq_kc: at(6 * n + 2 * ns),
            seq_p: at(6 * n + 3 * ns),
        }
    }
}

/// Completes each sequence's compressed windows (spec §3) made whole by the
/// last `n_new` tokens: `compress_windows` (kernels/compress.cu) over the
/// per-sequence tables, lengths i32 [ns] at `lens`, `grid_x` blocks per
/// sequence (they loop over further windows). p is written only with
/// eviction heads.
#[allow(clippy::too_many_arguments)]
fn compress(
    gpu: &Gpu,
    budget: &Budget,
    tab: &Tables,
    lens: u64,
    ns: usize,
    n_new: usize,
    grid_x: usize,
    hk: usize,
    dh: usize,
    eviction: bool,
    ring: usize,
) -> Result<()> {
    let ring_ = i32_dim(ring, "ring tokens")?;
    let (nn, hk_, d_, st, ks) = (
        i32_dim(n_new, "new tokens")?,
        i32_dim(hk, "Hkv")?,
        i32_dim(dh, "D")?,
        i32_dim(budget.kernel_stride, "kernel_stride")?,
        i32_dim(budget.kernel_size, "kernel_size")?,
    );
    let inv = 1.0 / budget.kernel_size as f32;
    let (cp, pp) = if eviction {
        (tab.seq_c, tab.seq_p)
    } else {
        (0u64, 0u64)
    };
    let f = gpu.function("compress_windows")?;
    let lc = LaunchConfig {
        grid_dim: (grid(grid_x.max(1), "windows")?, grid(ns, "sequences")?, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&tab.seq_k)
        .arg(&cp)
        .arg(&tab.seq_kc)
        .arg(&pp)
        .arg(&lens)
        .arg(&nn)
        .arg(&hk_)
        .arg(&d_)
        .arg(&st)
        .arg(&ks)
        .arg(&inv)
        .arg(&ring_);
    // SAFETY: argument list matches kernels/compress.cu; every sequence's Kc/p
    // hold Mc(capacity) ≥ Mc(T) windows and its K/c caches T ≤ capacity tokens.
    unsafe { b.launch(lc) }.cuda("compress_windows").map(drop)
}

/// Host selection of the check path ([`SelectionPath::HostFallback`]) for layer
/// `l`: downloads the fused QKV rows (post-RoPE q and k, v) and the new
/// eviction scores, appends them to each sequence's host mirror (which
/// completes Kc and p as [`LayerKv::append`] does), then selects per row
/// and KV head with [`crate::model::select`] (spec §4; for a prompt row at
/// position t only the windows visible to it, Mc(t+1)). Dense rows of a
/// sparse call get every existing block (their attention has no bias).
/// Returns `[row][kv_head]` ascending block ids when `select`, else only
/// appends (a dense call: the mirror must still see every token).
#[allow(clippy::too_many_arguments)]
fn host_select(
    gpu: &Gpu,
    plan: &AttentionPlan,
    cfg: &ModelConfig,
    ws: &Workspace,
    seqs: &mut [GpuSequence],
    rows: &[Row],
    l: usize,
    w: usize,
    select: bool,
) -> Result<Option<Vec<Vec<Vec<usize>>>>> {
    let (hq, hk, dh) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let kvd = hk * dh;
    let n = rows.len();
    let qkv: Vec<f32> = gpu
        .download(&ws.qkv.slice(0..n * w))?
        .into_iter()
        .map(Bf16::to_f32)
        .collect();
    let budget: &Budget = &plan.budget;
    // Append this call's tokens to the mirrors, sequence by sequence.
    for (si, seq) in seqs.iter_mut().enumerate() {
        let mine: Vec<usize> = (0..n).filter(|&i| rows[i].seq == si).collect();
        if mine.is_empty() {
            continue;
        }
        let p0 = rows[mine[0]].pos;
        let cnt = mine.len();
        let c: Vec<f32> = match &seq.layers[l].c {
            Some(cbuf) => gpu.download(&cbuf.slice(p0 * hk..(p0 + cnt) * hk))?,
            None => vec![0.0; cnt * hk],
        };
        let (mut k, mut v) = (Vec::with_capacity(cnt * kvd), Vec::with_capacity(cnt * kvd));
        for &i in &mine {
            let row = &qkv[i * w..(i + 1) * w];
            k.extend_from_slice(&row[hq * dh..hq * dh + kvd]);
            v.extend_from_slice(&row[hq * dh + kvd..hq * dh + 2 * kvd]);
        }
        let mirror = seq.mirror.as_mut().ok_or_else(|| {
            Error::Input("sequence has no host mirror for fallback selection".into())
        })?;
        mirror[l].append(budget, &k, &v, &c);
    }
    if !select {
        return Ok(None);
    }
    let rule = plan.rule();
    let g = hq / hk;
    let mut out = Vec::with_capacity(n);
    for (i, r) in rows.iter().enumerate() {
        let t = r.pos;
        let nb = budget.blocks(t);
        let rule = match rule {
            Some(rule) if r.sparse => rule,
            _ => {
                out.push(vec![(0..nb).collect::<Vec<usize>>(); hk]);
                continue;
            }
        };
        let kv = &seqs[r.seq].mirror.as_ref().expect("mirror checked above")[l];
        let q = &qkv[i * w..i * w + hq * dh];
        let mc = budget.windows(t + 1);
        let mut per = Vec::with_capacity(hk);
        for h in 0..hk {
            let qh = &q[h * g * dh..(h + 1) * g * dh];
            let kch = if mc > 0 { &kv.kc[h * dh..] } else { &[][..] };
            let s = select::query_window_scores(qh, dh, kch, kvd, mc);
            let rr = select::pool_blocks(budget, &s, nb);
            let p: Vec<f32> = (0..mc).map(|x| kv.p[x * hk + h]).collect();
            let e = select::pool_blocks(budget, &p, nb);
            per.push(select::select(budget, rule, &rr, &e));
        }
        out.push(per);
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_tables_are_laid_out_back_to_back() {
        let (n, ns) = (5usize, 3usize);
        let t = Tables::new(1000, n, ns);
        let got = [
            t.k, t.v, t.c_state, t.c_attn, t.kc, t.p, t.seq_k, t.seq_c, t.seq_kc, t.seq_p,
        ];
        let want: Vec<u64> = [0, n, 2 * n, 3 * n, 4 * n, 5 * n]
            .into_iter()
            .chain((0..PTRS_PER_SEQ).map(|j| PTRS_PER_ROW * n + j * ns))
            .map(|i| 1000 + 8 * i as u64)
            .collect();
        assert_eq!(got.to_vec(), want);
    }

    #[test]
    fn selection_path_follows_the_environment_variable() {
        // Only reads the variable; the default (unset or any other value) is the GPU path.
        let p = default_selection_path();
        match std::env::var("SPARDA_SELECTION").as_deref() {
            Ok("host") => assert_eq!(p, SelectionPath::HostFallback),
            _ => assert_eq!(p, SelectionPath::Gpu),
        }
    }

    #[test]
    fn decode_mode_follows_the_environment_variable() {
        let m = DecodeMode::from_env();
        match std::env::var("SPARDA_DECODE").as_deref() {
            Ok("eager") => assert_eq!(m, DecodeMode::Eager),
            Ok("forward") => assert_eq!(m, DecodeMode::Forward),
            _ => assert_eq!(m, DecodeMode::Graph),
        }
    }

    #[test]
    fn step_keys_differ_when_a_sequence_moves_or_the_capacity_changes() {
        let k = StepKey {
            seqs: vec![(1, 0), (2, 0)],
            sparse: true,
            cap: 4096,
            rope_rows: 8192,
            offload: false,
        };
        let mut grown = k.clone();
        grown.seqs[1].1 = 1;
        assert_ne!(k, grown);
        let mut cap = k.clone();
        cap.cap = 8192;
        assert_ne!(k, cap);
        assert_eq!(k, k.clone());
    }
}
