//! Attention wrappers (kernels/attn_decode.cu, spec §5): the split-K
//! tensor-core kernel `attn_partial` over dense rows or listed blocks, its
//! `attn_combine`, the launch geometry (splits, head blocks, shared memory),
//! and the typed decode entry points the GPU checks call. The prefill
//! kernels on the tensor cores are in `prefill_attention.rs`.

use super::expect_len;
use crate::cuda::context::{dptr, dptr_mut, grid, i32_dim, CudaResultExt};
use crate::cuda::{Bf16, Gpu};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceSlice, LaunchConfig};

/// One sequence's KV state for decode attention: post-RoPE K and V, bf16
/// [T, Hkv, D] (at least `len` tokens), and the eviction scores c, f32
/// [T, Hkv], when the attention uses the bias.
#[derive(Debug)]
pub struct SeqKv<'a> {
    /// K, [≥ len, Hkv, D].
    pub k: CudaView<'a, Bf16>,
    /// V, [≥ len, Hkv, D].
    pub v: CudaView<'a, Bf16>,
    /// c, [≥ len, Hkv] (NOSA bias), or none.
    pub c: Option<CudaView<'a, f32>>,
    /// Tokens to attend to: 0 … len−1 (the current token, at len−1, included).
    pub len: usize,
}

/// A batch of B sequences' KV state, as device pointer tables the attention
/// kernels read (built once per call here; an engine can keep one per layer).
#[derive(Debug)]
pub struct KvBatch<'a> {
    kptr: CudaSlice<u64>,
    vptr: CudaSlice<u64>,
    cptr: Option<CudaSlice<u64>>,
    lens: CudaSlice<i32>,
    host_lens: Vec<usize>,
    /// Device addresses of each sequence's K and V (per-row tables of the prefill kernel).
    pub(super) host_k: Vec<u64>,
    pub(super) host_v: Vec<u64>,
    /// Device addresses of each sequence's c (empty without bias).
    pub(super) host_c: Vec<u64>,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    _borrow: std::marker::PhantomData<&'a ()>,
}

impl<'a> KvBatch<'a> {
    /// Validates the sequences and uploads their pointer tables.
    ///
    /// Errors: [`Error::Input`] for an empty batch, head_dim of 0 or above
    /// 128 (the attention kernels' limit), a K/V/c view shorter than its
    /// `len`, or c given for some sequences only; [`Error::Cuda`] on a copy
    /// failure.
    pub fn new(gpu: &Gpu, seqs: &[SeqKv<'a>], kv_heads: usize, head_dim: usize) -> Result<Self> {
        const OP: &str = "kv batch";
        if seqs.is_empty() {
            return Err(Error::Input(format!("{OP}: no sequences")));
        }
        if head_dim == 0 || head_dim > 128 || kv_heads == 0 {
            return Err(Error::Input(format!(
                "{OP}: head_dim {head_dim} (1 … 128) and Hkv {kv_heads} (≥ 1) unsupported"
            )));
        }
        let with_c = seqs.iter().filter(|s| s.c.is_some()).count();
        if with_c != 0 && with_c != seqs.len() {
            return Err(Error::Input(format!(
                "{OP}: eviction scores given for {with_c} of {} sequences",
                seqs.len()
            )));
        }
        let kvd = kv_heads * head_dim;
        let (mut kp, mut vp, mut cp, mut lens) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, s) in seqs.iter().enumerate() {
            i32_dim(s.len, "sequence length")?;
            if s.k.len() < s.len * kvd || s.v.len() < s.len * kvd {
                return Err(Error::Input(format!(
                    "{OP}: sequence {i} of {} tokens needs {} K and V elements, has {} and {}",
                    s.len,
                    s.len * kvd,
                    s.k.len(),
                    s.v.len()
                )));
            }
            kp.push(dptr(gpu, &s.k));
            vp.push(dptr(gpu, &s.v));
            if let Some(c) = &s.c {
                if c.len() < s.len * kv_heads {
                    return Err(Error::Input(format!(
                        "{OP}: sequence {i} of {} tokens needs {} eviction scores, has {}",
                        s.len,
                        s.len * kv_heads,
                        c.len()
                    )));
                }
                cp.push(dptr(gpu, c));
            }
            lens.push(s.len as i32);
        }
        Ok(KvBatch {
            kptr: gpu.upload(&kp)?,
            vptr: gpu.upload(&vp)?,
            cptr: if with_c > 0 {
                Some(gpu.upload(&cp)?)
            } else {
                None
            },
            lens: gpu.upload(&lens)?,
            host_lens: seqs.iter().map(|s| s.len).collect(),
            host_k: kp,
            host_v: vp,
            host_c: cp,
            kv_heads,
            head_dim,
            _borrow: std::marker::PhantomData,
        })
    }

    /// B.
    pub fn batch(&self) -> usize {
        self.host_lens.len()
    }

    /// Each sequence's length.
    pub fn lens(&self) -> &[usize] {
        &self.host_lens
    }

    /// Whether eviction scores (the NOSA bias) are attached.
    pub fn has_bias(&self) -> bool {
        self.cptr.is_some()
    }
}

/// The blocks each (sequence, KV head) attends to, on the device:
/// i32 [B, Hkv, s_max] ids (ascending per row, padded with −1) and i32
/// [B, Hkv] counts.
#[derive(Debug)]
pub struct BlockSelection {
    pub(super) sel: CudaSlice<i32>,
    pub(super) nsel: CudaSlice<i32>,
    pub(super) batch: usize,
    pub(super) kv_heads: usize,
    pub(super) s_max: usize,
}

impl BlockSelection {
    /// From host lists `blocks[b][h]` (ascending block ids, as
    /// [`crate::model::select::select`] returns them), checked against each
    /// sequence's length: every id must be an existing block,
    /// id·block_size < lens\[b\].
    ///
    /// Errors: [`Error::Input`] on a ragged batch, a non-ascending list or a
    /// block past the sequence; [`Error::Cuda`] on a copy failure.
    pub fn from_host(
        gpu: &Gpu,
        blocks: &[Vec<Vec<usize>>],
        lens: &[usize],
        block_size: usize,
    ) -> Result<Self> {
        const OP: &str = "block selection";
        if blocks.len() != lens.len() || blocks.is_empty() || block_size == 0 {
            return Err(Error::Input(format!(
                "{OP}: {} selection rows for {} sequences (block size {block_size})",
                blocks.len(),
                lens.len()
            )));
        }
        let kv_heads = blocks[0].len();
        let s_max = blocks
            .iter()
            .flatten()
            .map(Vec::len)
            .max()
            .unwrap_or(0)
            .max(1);
        let mut sel = vec![-1i32; blocks.len() * kv_heads * s_max];
        let mut nsel = vec![0i32; blocks.len() * kv_heads];
        for (b, per_head) in blocks.iter().enumerate() {
            if per_head.len() != kv_heads {
                return Err(Error::Input(format!(
                    "{OP}: sequence {b} has {} KV heads, sequence 0 has {kv_heads}",
                    per_head.len()
                )));
            }
            for (h, list) in per_head.iter().enumerate() {
                for (i, &m) in list.iter().enumerate() {
                    if i > 0 && list[i - 1] >= m {
                        return Err(Error::Input(format!(
                            "{OP}: sequence {b} head {h}: block ids not ascending ({list:?})"
                        )));
                    }
                    if m * block_size >= lens[b] {
                        return Err(Error::Input(format!(
                            "{OP}: sequence {b} head {h}: block {m} starts past the {} tokens",
                            lens[b]
                        )));
                    }
                    sel[(b * kv_heads + h) * s_max + i] = i32_dim(m, "block id")?;
                }
                nsel[b * kv_heads + h] = list.len() as i32;
            }
        }
        Ok(BlockSelection {
            sel: gpu.upload(&sel)?,
            nsel: gpu.upload(&nsel)?,
            batch: blocks.len(),
            kv_heads,
            s_max,
        })
    }

    /// From device arrays (e.g. written by a GPU selection kernel): `sel`
    /// [batch, kv_heads, s_max] and `nsel` [batch, kv_heads]. Contents are
    /// not read on the host; the attention kernel skips negative ids and
    /// tokens past each sequence's length.
    ///
    /// Errors: [`Error::Input`] on a size mismatch.
    pub fn from_device(
        sel: CudaSlice<i32>,
        nsel: CudaSlice<i32>,
        batch: usize,
        kv_heads: usize,
        s_max: usize,
    ) -> Result<Self> {
        expect_len(
            "block selection",
            "sel",
            sel.len(),
            batch * kv_heads * s_max,
        )?;
        expect_len("block selection", "nsel", nsel.len(), batch * kv_heads)?;
        Ok(BlockSelection {
            sel,
            nsel,
            batch,
            kv_heads,
            s_max,
        })
    }

    /// Capacity per (sequence, KV head).
    pub fn s_max(&self) -> usize {
        self.s_max
    }
}

/// Tokens per shared-memory tile of the attention kernel (`ATT_TILE` in
/// kernels/attn_decode.cu); dense splits are whole numbers of tiles.
pub const ATTN_TILE: usize = 64;
/// Largest head dimension of the attention kernel (a multiple of 16 is needed).
pub const ATTN_MAX_HEAD_DIM: usize = 128;
/// Query heads of one KV head that one thread block of the attention kernel
/// serves (the M dimension of its mma tiles); larger groups take several blocks.
pub const ATTN_GROUP_HEADS: usize = 16;
/// Threads per block of `attn_partial`.
const ATTN_THREADS: u32 = 128;
/// Thread blocks a split-K attention launch aims at at most (three resident
/// per SM on the H200's 132 SMs make about four waves, so the last wave's
/// tail costs little); splits grow (by powers of two) until rows × head
/// blocks × splits fits. Batch 1 at 4K tokens gets 132 blocks of one tile.
pub const ATTN_TARGET_CTAS: usize = 1536;
/// Most splits per row: each split costs the combine a pass over D values,
/// so at batch 1 a long context takes longer splits rather than more.
pub const ATTN_MAX_SPLITS: usize = 128;

/// The split cap in force: [`ATTN_MAX_SPLITS`], or `SPARDA_ATTN_MAX_SPLITS`
/// (1 ..= [`ATTN_MAX_SPLITS`], read once) for the batch-1 geometry sweep of
/// `scripts/device/offload.sh b1`. Changes timing only: the combine merges
/// any number of splits to the same softmax (up to f32 rounding).
pub fn attn_max_splits() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("SPARDA_ATTN_MAX_SPLITS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| (1..=ATTN_MAX_SPLITS).contains(&n))
            .unwrap_or(ATTN_MAX_SPLITS)
    })
}

/// Dynamic shared memory of `attn_partial` at head dim `d`, bytes: two
/// stages of K and V tiles of [`ATTN_TILE`] rows of d + 8 bf16, plus the
/// per-token bias and validity of both stages.
pub const fn attn_smem_bytes(d: usize) -> usize {
    4 * ATTN_TILE * (d + 8) * 2 + 2 * ATTN_TILE * 8
}

/// Checks that the attention kernel supports head dim `d` (a multiple of
/// 16, at most [`ATTN_MAX_HEAD_DIM`]).
///
/// Errors: [`Error::Input`] otherwise.
pub fn check_attn_head_dim(op: &str, d: usize) -> Result<()> {
    if d == 0 || !d.is_multiple_of(16) || d > ATTN_MAX_HEAD_DIM {
        return Err(Error::Input(format!(
            "{op}: head dim {d} unsupported by the attention kernel (a multiple of 16, at most {ATTN_MAX_HEAD_DIM})"
        )));
    }
    Ok(())
}

/// Thread blocks per (row, split) of the attention kernel: one per KV head
/// and group of up to [`ATTN_GROUP_HEADS`] of its query heads.
pub fn attn_head_blocks(heads: usize, kv_heads: usize) -> usize {
    kv_heads * (heads / kv_heads.max(1)).div_ceil(ATTN_GROUP_HEADS).max(1)
}

/// Dense split-K geometry for `rows` query rows over contexts of at most
/// `max_len` tokens: (tokens per split, a multiple of [`ATTN_TILE`];
/// number of splits ≥ 1). Sizing it by a capacity rather than the current
/// lengths keeps the grid fixed (splits past a row's length exit at once).
pub fn attn_dense_split(rows: usize, head_blocks: usize, max_len: usize) -> (usize, usize) {
    let mut span = ATTN_TILE;
    while (rows * head_blocks * max_len.div_ceil(span) > ATTN_TARGET_CTAS
        || max_len.div_ceil(span) > attn_max_splits())
        && span < max_len
    {
        span *= 2;
    }
    (span, max_len.div_ceil(span).max(1))
}

/// Sparse split-K geometry for lists of at most `s_max` blocks: (list
/// entries per split, number of splits ≥ 1).
pub fn attn_sparse_split(rows: usize, head_blocks: usize, s_max: usize) -> (usize, usize) {
    let mut span = 1;
    while (rows * head_blocks * s_max.div_ceil(span) > ATTN_TARGET_CTAS
        || s_max.div_ceil(span) > attn_max_splits())
        && span < s_max
    {
        span *= 2;
    }
    (span, s_max.div_ceil(span).max(1))
}

/// Device addresses and geometry of one `attn_partial` launch (the
/// argument list of kernels/attn_decode.cu). `sel = 0` selects dense
/// attention; `cptr = 0` means no bias.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnArgs {
    pub q: u64,
    pub q_stride: usize,
    pub kptr: u64,
    pub vptr: u64,
    pub cptr: u64,
    pub lens: u64,
    pub sel: u64,
    pub nsel: u64,
    pub s_max: usize,
    pub block_size: usize,
    /// Tokens (dense) or list entries (sparse) per split.
    pub span: usize,
    pub nsplit: usize,
    pub part_o: u64,
    pub part_ml: u64,
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// The attention output, bf16 [rows, H, D] with rows at `out_stride`
    /// elements: written by `attn_combine` from the partials, or directly by
    /// the tensor-core prefill kernels (`attn_partial` writes partials only).
    pub out: u64,
    pub out_stride: usize,
    /// Offloaded rows (kv/mod.rs): i32 [rows, Hkv, s_max] slot of
    /// each list entry (−1: the tail ring), or 0 for GPU-resident rows.
    pub slot_list: u64,
    /// Per row: the slot pool, bf16 [Hkv, pool_slots, 2, block_size, D]
    /// (u64 table of `rows` device addresses); 0 without `slot_list`.
    pub pool_ptr: u64,
    /// Slots per (sequence, layer, KV head) in the pool.
    pub pool_slots: usize,
    /// Tokens in the tail ring that `kptr`/`vptr` point to (token j at row
    /// j mod ring); 0 for a full cache.
    pub ring: usize,
    /// Per-CTA timeline, u64 \[rows\]\[head blocks\]\[nsplit\]\[3\] (start ns,
    /// end ns, SM id: kernels/common.cuh `cta_log_start`), or 0 (none, the
    /// default; [`crate::trace::cta`]).
    pub cta_log: u64,
}

/// Enqueues `attn_partial` (no host work beyond the launch, so it can be
/// captured into a graph). The partials hold rows·H·nsplit slots.
///
/// Errors: [`Error::Input`] for a head dim the kernel does not support, an
/// odd q stride or dimensions past i32; [`Error::Cuda`] on a launch failure.
pub(crate) fn launch_attn_partial(gpu: &Gpu, a: &AttnArgs) -> Result<()> {
    const OP: &str = "attn_partial";
    check_attn_head_dim(OP, a.head_dim)?;
    if a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) || !a.q_stride.is_multiple_of(2) {
        return Err(Error::Input(format!(
            "{OP}: H {} / Hkv {} / q stride {} (need H a multiple of Hkv, an even stride)",
            a.heads, a.kv_heads, a.q_stride
        )));
    }
    if a.rows == 0 {
        return Ok(());
    }
    let (qs, sm, bs, sp, h_, hk, d_, ns) = (
        i32_dim(a.q_stride, "q_stride")?,
        i32_dim(a.s_max, "s_max")?,
        i32_dim(a.block_size.max(1), "block_size")?,
        i32_dim(a.span, "span")?,
        i32_dim(a.heads, "H")?,
        i32_dim(a.kv_heads, "Hkv")?,
        i32_dim(a.head_dim, "D")?,
        i32_dim(a.nsplit, "splits")?,
    );
    if a.slot_list != 0 && (a.sel == 0 || a.pool_ptr == 0 || a.pool_slots == 0) {
        return Err(Error::Input(format!(
            "{OP}: a slot list needs block lists, a pool table and pool slots ({})",
            a.pool_slots
        )));
    }
    let (ps, rg) = (
        i32_dim(a.pool_slots, "pool slots")?,
        i32_dim(a.ring, "ring tokens")?,
    );
    let f = gpu.function("attn_partial")?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid(a.nsplit, "splits")?,
            grid(attn_head_blocks(a.heads, a.kv_heads), "head blocks")?,
            grid(a.rows, "rows")?,
        ),
        block_dim: (ATTN_THREADS, 1, 1),
        shared_mem_bytes: attn_smem_bytes(a.head_dim) as u32,
    };
    let mut b = gpu.launch_builder(f);
    b.arg(&a.q)
        .arg(&qs)
        .arg(&a.kptr)
        .arg(&a.vptr)
        .arg(&a.cptr)
        .arg(&a.lens)
        .arg(&a.sel)
        .arg(&a.nsel)
        .arg(&sm)
        .arg(&bs)
        .arg(&sp)
        .arg(&a.part_o)
        .arg(&a.part_ml)
        .arg(&h_)
        .arg(&hk)
        .arg(&d_)
        .arg(&ns)
        .arg(&a.scale)
        .arg(&a.slot_list)
        .arg(&a.pool_ptr)
        .arg(&ps)
        .arg(&rg)
        .arg(&a.cta_log);
    // SAFETY: argument list matches kernels/attn_decode.cu; the callers size the
    // partials (rows·H·nsplit slots), the tables (rows entries), the lists and
    // the CTA log (one record per CTA of this grid, or none).
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Largest rows·H for which `attn_combine` gets wide blocks (several split
/// groups per dimension): fewer blocks than the H200 has SMs.
const COMBINE_WIDE_ROWS: usize = 128;

/// Enqueues the split-K combine: out [rows, H, D] (rows at `out_stride`)
/// from rows·H·nsplit partials.
///
/// Errors: [`Error::Input`] for dimensions past i32; [`Error::Cuda`] on a
/// launch failure.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_attn_combine(
    gpu: &Gpu,
    part_o: u64,
    part_ml: u64,
    out: u64,
    out_stride: usize,
    rows: usize,
    h: usize,
    d: usize,
    nsplit: usize,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let (os, h_, d_, ns) = (
        i32_dim(out_stride, "out_stride")?,
        i32_dim(h, "H")?,
        i32_dim(d, "D")?,
        i32_dim(nsplit, "splits")?,
    );
    let f = gpu.function("attn_combine")?;
    // Enough threads for every dimension. When the rows are too few to give
    // each SM a block (batch 1: rows·H = 32 for NOSA-8B), also split groups
    // enough that each thread reads about eight splits: the row's sum is then
    // latency-bound, and more loads in flight pay (H200, B = 1, 4K: 7.8 →
    // 4.5 µs per layer); with many rows 256 threads measured better.
    let groups = if rows * h <= COMBINE_WIDE_ROWS {
        nsplit.div_ceil(8).max(1)
    } else {
        1
    };
    let threads = (d.saturating_mul(groups).div_ceil(32) * 32).clamp(256, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid(rows * h, "rows·H")?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut bld = gpu.launch_builder(f);
    bld.arg(&part_o)
        .arg(&part_ml)
        .arg(&out)
        .arg(&os)
        .arg(&h_)
        .arg(&d_)
        .arg(&ns);
    // SAFETY: argument list matches kernels/attn_combine.cu; sizes checked by the callers.
    unsafe { bld.launch(cfg) }.cuda("attn_combine").map(drop)
}

/// Checks the q/out layout shared by both attention entry points; returns
/// (B, H, D).
fn attn_shapes<Q: DeviceSlice<Bf16>, O: DeviceSlice<Bf16>>(
    op: &str,
    q: &Q,
    q_stride: usize,
    heads: usize,
    kv: &KvBatch<'_>,
    out: &O,
    out_stride: usize,
) -> Result<(usize, usize, usize)> {
    let (b, d, hk) = (kv.batch(), kv.head_dim, kv.kv_heads);
    if heads == 0 || !heads.is_multiple_of(hk) {
        return Err(Error::Input(format!(
            "{op}: {heads} query heads is not a multiple of {hk} KV heads"
        )));
    }
    check_attn_head_dim(op, d)?;
    let row = heads * d;
    if q_stride < row || out_stride < row || !q_stride.is_multiple_of(2) {
        return Err(Error::Input(format!(
            "{op}: q stride {q_stride} / out stride {out_stride} below H·D = {row} (or an odd q stride)"
        )));
    }
    let need_q = (b - 1) * q_stride + row;
    let need_o = (b - 1) * out_stride + row;
    if q.len() < need_q || out.len() < need_o {
        return Err(Error::Input(format!(
            "{op}: q has {} and out {} elements; {b} sequences need {need_q} and {need_o}",
            q.len(),
            out.len()
        )));
    }
    Ok((b, heads, d))
}

/// Allocates the split-K partials of `slots` (row, head, split) slots of D values.
fn alloc_partials(gpu: &Gpu, slots: usize, d: usize) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
    // SAFETY: every slot's (max, sum) is written by attn_partial before attn_combine
    // reads it; its D values are read only when the max is finite, i.e. written.
    let what =
        format!("allocating attention partials for {slots} (row, head, split) slots of D = {d}");
    let part_o = unsafe { gpu.stream().alloc(slots * d) }.cuda(&what)?;
    let part_ml = unsafe { gpu.stream().alloc(slots * 2) }.cuda(&what)?;
    Ok((part_o, part_ml))
}

/// Dense decode attention without bias (spec §5 "Dense"): for each of the B
/// sequences one query token (at position len−1), each query head g
/// attending to all tokens 0 … len−1 of KV head g / G (any GQA group G =
/// H / Hkv), softmax(q·k·scale) · V: S and P·V on the tensor cores (bf16
/// operands, P rounded to bf16, f32 accumulation and softmax), split-K over
/// groups of [`ATTN_TILE`] tokens ([`attn_dense_split`]), combined in
/// split order. Each thread block reads a KV head's keys and values once
/// for up to [`ATTN_GROUP_HEADS`] of its query heads.
///
/// - `q`: bf16, sequence b's H·D query values at b·`q_stride` (post-RoPE;
///   q_stride even);
/// - `out`: bf16, sequence b's H·D outputs at b·`out_stride`;
/// - `scale`: 1/√D normally.
///
/// A sequence of length 0 gets zeros.
///
/// Errors: [`Error::Input`] when H is not a multiple of Hkv, D is not a
/// multiple of 16 or above 128, or q/out are too short for their strides;
/// [`Error::Cuda`] on a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn attention_dense_decode<Q, O>(
    gpu: &Gpu,
    q: &Q,
    q_stride: usize,
    heads: usize,
    kv: &KvBatch<'_>,
    scale: f32,
    out: &mut O,
    out_stride: usize,
) -> Result<()>
where
    Q: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    const OP: &str = "attention_dense_decode";
    let (b, h, d) = attn_shapes(OP, q, q_stride, heads, kv, out, out_stride)?;
    let max_len = kv.lens().iter().copied().max().unwrap_or(0).max(1);
    let (span, nsplit) = attn_dense_split(b, attn_head_blocks(h, kv.kv_heads), max_len);
    let (part_o, part_ml) = alloc_partials(gpu, b * h * nsplit, d)?;
    let args = AttnArgs {
        q: dptr(gpu, q),
        q_stride,
        kptr: dptr(gpu, &kv.kptr),
        vptr: dptr(gpu, &kv.vptr),
        cptr: 0,
        lens: dptr(gpu, &kv.lens),
        sel: 0,
        nsel: 0,
        s_max: 0,
        block_size: 1,
        span,
        nsplit,
        part_o: dptr(gpu, &part_o),
        part_ml: dptr(gpu, &part_ml),
        rows: b,
        heads: h,
        kv_heads: kv.kv_heads,
        head_dim: d,
        scale,
        out: 0,
        out_stride: 0,
        slot_list: 0,
        pool_ptr: 0,
        pool_slots: 0,
        ring: 0,
        cta_log: 0,
    };
    launch_attention(gpu, args, out, out_stride)
}

/// Launches the split-K partial attention for `args` and merges the splits
/// into `out` (bf16 [rows, H, D], rows at `out_stride`) with `attn_combine`.
/// Shared by [`attention_dense_decode`] and [`attention_sparse_decode`]; the partial
/// buffers that `args` points to must outlive the launches (the callers own
/// them; frees are stream-ordered).
fn launch_attention<O: DevicePtrMut<Bf16>>(
    gpu: &Gpu,
    args: AttnArgs,
    out: &mut O,
    out_stride: usize,
) -> Result<()> {
    let op = dptr_mut(gpu, out);
    let args = AttnArgs {
        out: op,
        out_stride,
        slot_list: 0,
        pool_ptr: 0,
        pool_slots: 0,
        ring: 0,
        ..args
    };
    launch_attn_partial(gpu, &args)?;
    launch_attn_combine(
        gpu,
        args.part_o,
        args.part_ml,
        op,
        out_stride,
        args.rows,
        args.heads,
        args.head_dim,
        args.nsplit,
    )
}

/// Sparse block attention decode with additive bias (spec §5): for each of
/// the B sequences one query token at t = len−1; query head g (KV head
/// h = g / G) attends to the tokens j ≤ t of the blocks `sel` lists for
/// (sequence, h), in list order (ascending block ids), with logit
/// q·k_j·scale + c[j, h] — the bias added to the *scaled* logit — when `kv`
/// carries eviction scores, no bias otherwise (InfLLM-V2). Arithmetic as
/// [`attention_dense_decode`]; split-K over groups of listed blocks
/// ([`attn_sparse_split`]), combined in list order. Layouts of q/out as
/// [`attention_dense_decode`].
///
/// Errors: [`Error::Input`] on shape mismatches (including a selection of
/// another batch size or KV-head count, or block_size 0); [`Error::Cuda`]
/// on a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn attention_sparse_decode<Q, O>(
    gpu: &Gpu,
    q: &Q,
    q_stride: usize,
    heads: usize,
    kv: &KvBatch<'_>,
    sel: &BlockSelection,
    block_size: usize,
    scale: f32,
    out: &mut O,
    out_stride: usize,
) -> Result<()>
where
    Q: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    const OP: &str = "attention_sparse_decode";
    let (b, h, d) = attn_shapes(OP, q, q_stride, heads, kv, out, out_stride)?;
    if sel.batch != b || sel.kv_heads != kv.kv_heads || block_size == 0 {
        return Err(Error::Input(format!(
            "{OP}: selection for {} sequences × {} KV heads, batch has {b} × {} (block size {block_size})",
            sel.batch, sel.kv_heads, kv.kv_heads
        )));
    }
    let (span, nsplit) = attn_sparse_split(b, attn_head_blocks(h, kv.kv_heads), sel.s_max);
    let (part_o, part_ml) = alloc_partials(gpu, b * h * nsplit, d)?;
    let args = AttnArgs {
        q: dptr(gpu, q),
        q_stride,
        kptr: dptr(gpu, &kv.kptr),
        vptr: dptr(gpu, &kv.vptr),
        cptr: kv.cptr.as_ref().map_or(0u64, |c| dptr(gpu, c)),
        lens: dptr(gpu, &kv.lens),
        sel: dptr(gpu, &sel.sel),
        nsel: dptr(gpu, &sel.nsel),
        s_max: sel.s_max,
        block_size,
        span,
        nsplit,
        part_o: dptr(gpu, &part_o),
        part_ml: dptr(gpu, &part_ml),
        rows: b,
        heads: h,
        kv_heads: kv.kv_heads,
        head_dim: d,
        scale,
        out: 0,
        out_stride: 0,
        slot_list: 0,
        pool_ptr: 0,
        pool_slots: 0,
        ring: 0,
        cta_log: 0,
    };
    launch_attention(gpu, args, out, out_stride)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_split_fills_the_gpu_at_batch_one_and_bounds_the_grid() {
        // NOSA-8B at B = 1, 4K context: 64-token splits, one block per SM.
        let (span, n) = attn_dense_split(1, attn_head_blocks(32, 2), 4224);
        assert_eq!((span, n), (64, 66));
        // B = 64 at 32K: few, long splits; the grid stays within the target.
        let (span, n) = attn_dense_split(64, 2, 32_832);
        assert_eq!(span % ATTN_TILE, 0);
        assert!(64 * 2 * n <= ATTN_TARGET_CTAS && n * span >= 32_832);
        // Tiny contexts: one split.
        assert_eq!(attn_dense_split(3, 2, 5), (64, 1));
        // B = 1 at 32K: longer splits rather than more than ATTN_MAX_SPLITS.
        let (span, n) = attn_dense_split(1, 2, 32_832);
        assert!(n <= ATTN_MAX_SPLITS && span >= 256, "{span} {n}");
    }

    #[test]
    fn sparse_split_covers_every_list_entry() {
        for (rows, s_max) in [(1usize, 64usize), (16, 64), (64, 64), (7, 13), (1, 1)] {
            let (span, n) = attn_sparse_split(rows, 2, s_max);
            assert!(
                span * n >= s_max && span * (n - 1) < s_max,
                "{rows} {s_max}"
            );
        }
        assert_eq!(attn_sparse_split(1, 2, 64), (1, 64));
    }

    #[test]
    fn head_blocks_and_shared_memory() {
        assert_eq!(attn_head_blocks(32, 2), 2);
        assert_eq!(attn_head_blocks(6, 2), 2);
        assert_eq!(attn_head_blocks(64, 2), 4);
        assert_eq!(attn_smem_bytes(128), 70_656);
        assert!(check_attn_head_dim("t", 80).is_ok());
        assert!(check_attn_head_dim("t", 72).is_err());
        assert!(check_attn_head_dim("t", 256).is_err());
    }
}
