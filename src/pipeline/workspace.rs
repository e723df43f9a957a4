//! Scratch buffers of a prefill call or of a decode step, and the small
//! descriptors (row inputs, attention and selection geometry) the kernels
//! of one call read.

use super::*;

/// Scratch buffers of a forward call or of a decode step, sized for `rows`
/// query rows. A forward call grows (reallocates) its workspace when it needs
/// more; a decode step's is allocated once per (re)build and holds
/// per-layer copies of `qkv`, `sel` and `nsel`.
pub(crate) struct Workspace {
    pub(crate) rows: usize,
    /// f32 residual stream, [rows, d].
    pub(crate) resid: CudaSlice<f32>,
    /// Branch output (embedding, o_proj, down_proj), bf16 [rows, d].
    pub(crate) delta: CudaSlice<Bf16>,
    /// Normed activations, bf16 [rows, d].
    pub(crate) xn: CudaSlice<Bf16>,
    /// Fused QKV output (forecast columns after q|k|v when on), bf16
    /// [layers, rows, qkv_cols] (layers = 1 in a forward call).
    pub(crate) qkv: CudaSlice<Bf16>,
    /// Attention output, bf16 [rows, H·D].
    pub(crate) attn: CudaSlice<Bf16>,
    /// gate|up output, bf16 [rows, 2I].
    pub(crate) gu: CudaSlice<Bf16>,
    /// SwiGLU output, bf16 [rows, I].
    pub(crate) act: CudaSlice<Bf16>,
    /// Logits, f32 [rows, V].
    pub(crate) logits: CudaSlice<f32>,
    /// Token ids, [rows] (forward calls).
    pub(crate) ids: CudaSlice<u32>,
    /// Positions, [rows] (forward calls).
    pub(crate) pos: CudaSlice<i32>,
    /// pos + 1, [rows] (forward calls).
    pub(crate) lens: CudaSlice<i32>,
    /// Argmax output, [rows].
    pub(crate) argmax: CudaSlice<u32>,
    /// Per-layer pointer tables, u64 [L, PTRS_PER_ROW·rows + PTRS_PER_SEQ·sequences].
    pub(crate) ptrs: CudaSlice<u64>,
    /// Split-K partial outputs, f32.
    pub(crate) part_o: CudaSlice<f32>,
    /// Split-K partial (max, sum) pairs, f32.
    pub(crate) part_ml: CudaSlice<f32>,
    /// Selected block ids, i32 [layers, rows, Hkv, s_max].
    pub(crate) sel: CudaSlice<i32>,
    /// Selected counts, i32 [layers, rows, Hkv].
    pub(crate) nsel: CudaSlice<i32>,
    /// 1 for dense rows of a sparse call, i32 [rows].
    pub(crate) dense: CudaSlice<i32>,
    /// Each sequence's length after the call, i32 [sequences] (compression; forward calls).
    pub(crate) seq_lens: CudaSlice<i32>,
    /// Query-aware window logits, f32 [rows, H, w_stride] (GPU selection).
    pub(crate) qa_logits: CudaSlice<f32>,
    /// Per-tile softmax statistics, f32 [rows, H, tiles, 2].
    pub(crate) qa_stats: CudaSlice<f32>,
    /// Window scores s, f32 [rows, Hkv, w_stride].
    pub(crate) qa_scores: CudaSlice<f32>,
    /// The rows' queries widened to f32 [rows, H, D] for the cuBLAS window
    /// logits of prefill chunks (grown by forward calls that use them).
    pub(crate) qa_qf: CudaSlice<f32>,
    /// Sparse prefill on the tensor cores: each (tile, KV head)'s union of
    /// its rows' selected blocks, i32 [tiles, Hkv, u_max] ids …
    pub(crate) union_blk: CudaSlice<i32>,
    /// … u64 [tiles, Hkv, u_max] masks of the tile rows that selected each …
    pub(crate) union_mask: CudaSlice<u64>,
    /// … and i32 [tiles, Hkv] counts (grown by forward calls that need them).
    pub(crate) union_n: CudaSlice<i32>,
}

/// Device addresses of the per-row inputs the kernels read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowInputs {
    /// i32 [rows]: each row's position.
    pub(crate) pos: u64,
    /// i32 [rows]: pos + 1, the tokens each row attends to.
    pub(crate) lens: u64,
    /// i32 [sequences]: each sequence's length after the call (compression).
    pub(crate) seq_lens: u64,
}

/// Geometry of the attention launch of one call or step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttnGeometry {
    /// Sparse rows (block lists) or dense rows.
    pub(crate) sparse: bool,
    /// Tokens (dense) or list entries (sparse) per split.
    pub(crate) span: usize,
    /// Splits.
    pub(crate) nsplit: usize,
    /// Block-list width (sparse).
    pub(crate) s_max: usize,
    /// Prefill on the tensor cores ([`super::PrefillAttention::TensorCore`]):
    /// the device address of the call's i32 work items
    /// ([`crate::cuda::ops::prefill_tiles`]) and their count; the split
    /// fields are then unused (no partials). Dense calls take
    /// `attn_prefill_d*`; sparse calls (`sparse`) build each tile's union of
    /// block lists into the workspace and take `attn_prefill_sparse_d*`.
    /// `None`: the split-K kernel.
    pub(crate) prefill_tiles: Option<(u64, usize)>,
    /// Union capacity per (tile, KV head) of a sparse call on the tensor
    /// cores ([`crate::cuda::ops::prefill_union_capacity`]); 0 otherwise.
    pub(crate) union_cap: usize,
}

/// Geometry of GPU selection: query-aware scoring over up to `mc` windows
/// (`w_stride` = mc rounded up to whole tiles) and pooling/selection over
/// up to `nb_cap` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SelGeometry {
    pub(crate) mc: usize,
    pub(crate) w_stride: usize,
    pub(crate) nb_cap: usize,
    pub(crate) s_max: usize,
}

/// One query row of a forward call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    /// Index into the call's sequences.
    pub(crate) seq: usize,
    pub(crate) token: u32,
    /// Position in its sequence (0-based).
    pub(crate) pos: usize,
    /// Sparse attention for this row (else dense, no bias).
    pub(crate) sparse: bool,
}

/// Which rows a forward call computes logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogitRows {
    /// None (a prefill chunk before the last).
    None,
    /// The last row only (end of a prefill).
    Last,
}

/// Where the logits of the last call are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LastLogits {
    /// No logits (no call yet, or a prefill chunk before the last).
    None,
    /// The first n rows of the forward workspace.
    Forward(usize),
    /// The decode step's buffers (n rows; the argmax is computed too).
    Step(usize),
}

impl GpuModel {
    /// A workspace for `rows` rows, with `layers` per-layer copies of the
    /// QKV output and the block lists (of width `s_max`).
    pub(crate) fn new_workspace(
        &self,
        rows: usize,
        layers: usize,
        s_max: usize,
    ) -> Result<Workspace> {
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
                sel: s.alloc((layers * rows * hk * s_max).max(1)).cuda(&what)?,
                nsel: s.alloc(layers * rows * hk).cuda(&what)?,
                dense: s.alloc(rows).cuda(&what)?,
                seq_lens: s.alloc(rows.max(1)).cuda(&what)?,
                qa_logits: s.alloc(1).cuda(&what)?,
                qa_stats: s.alloc(1).cuda(&what)?,
                qa_scores: s.alloc(1).cuda(&what)?,
                qa_qf: s.alloc(1).cuda(&what)?,
                union_blk: s.alloc(1).cuda(&what)?,
                union_mask: s.alloc(1).cuda(&what)?,
                union_n: s.alloc(1).cuda(&what)?,
            })
        }
    }

    /// Makes the forward workspace hold `rows` rows.
    pub(crate) fn ensure_workspace(&mut self, rows: usize) -> Result<()> {
        if self.ws.as_ref().is_some_and(|w| w.rows >= rows) {
            return Ok(());
        }
        self.ws = None;
        self.ws = Some(self.new_workspace(rows, 1, 1)?);
        Ok(())
    }
}
