//! Typed wrappers of the `kernels/*.cu` kernels, one per kernel. Each checks
//! shapes at the boundary (an [`Error::Input`] with the numbers on a
//! mismatch, before anything is launched) and enqueues the kernel on
//! [`Gpu::stream`]; nothing synchronises (asynchronous kernel errors show at
//! the next [`Gpu::synchronize`] or download).
//!
//! Conventions: row-major tensors; bf16 as [`Bf16`]; buffers are any cudarc
//! `CudaSlice` or view (`DevicePtr` / `DevicePtrMut`), whose element count
//! must match the shape exactly unless a stride is given.
//! Spec sections refer to spec/nosa-model.md.

pub mod offload;
pub mod select;

use crate::cuda::context::{dptr, dptr_mut, grid, i32_dim, CudaResultExt};
use crate::cuda::device_error::ErrorSink;
use crate::cuda::{Bf16, Gpu};
use crate::{Error, Result};
use cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceSlice, LaunchConfig, PushKernelArg,
};

/// `Err(Error::Input)` unless `got == want`.
fn expect_len(op: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::Input(format!(
            "{op}: {what} has {got} elements, expected {want}"
        )));
    }
    Ok(())
}

/// Embedding gather (spec §1 `scale_emb`): out[i, :] = bf16(table[ids\[i\], :] · scale).
///
/// - `table`: [vocab, d] bf16; `ids`: \[n\] u32; `out`: [n, d] bf16.
/// - Ids are not read on the host: the caller validates them (< vocab)
///   before they reach the device; an out-of-range id yields a NaN row,
///   never an out-of-bounds read.
///
/// Errors: [`Error::Input`] on a shape mismatch.
pub fn embed_gather<T, I, O>(
    gpu: &Gpu,
    table: &T,
    vocab: usize,
    d: usize,
    ids: &I,
    scale: f32,
    out: &mut O,
) -> Result<()>
where
    T: DevicePtr<Bf16>,
    I: DevicePtr<u32>,
    O: DevicePtrMut<Bf16>,
{
    const OP: &str = "embed_gather";
    expect_len(OP, "table", table.len(), vocab * d)?;
    let n = ids.len();
    expect_len(OP, "out", out.len(), n * d)?;
    if n == 0 {
        return Ok(());
    }
    let (n_, d_, v_) = (i32_dim(n, "n")?, i32_dim(d, "d")?, i32_dim(vocab, "vocab")?);
    let (tp, ip, op) = (dptr(gpu, table), dptr(gpu, ids), dptr_mut(gpu, out));
    let f = gpu.function("embed_gather")?;
    let cfg = LaunchConfig {
        grid_dim: (grid(n, "n")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&tp)
        .arg(&ip)
        .arg(&op)
        .arg(&n_)
        .arg(&d_)
        .arg(&v_)
        .arg(&scale);
    // SAFETY: argument list matches kernels/embedding.cu; sizes checked above.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Shared launcher of `rmsnorm_residual`; `delta` = (address, scale) or none.
#[allow(clippy::too_many_arguments)]
fn rmsnorm_launch(
    gpu: &Gpu,
    resid: u64,
    delta: Option<(u64, f32)>,
    w: u64,
    out: u64,
    n: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let d_ = i32_dim(d, "d")?;
    let (dp, ds) = delta.unwrap_or((0, 0.0));
    let f = gpu.function("rmsnorm_residual")?;
    // About four elements per thread (one block per row: at batch 1 the
    // whole kernel is one block, so its width sets the latency).
    let threads = (d.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid(n, "rows")?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&resid)
        .arg(&dp)
        .arg(&ds)
        .arg(&w)
        .arg(&out)
        .arg(&d_)
        .arg(&eps);
    // SAFETY: argument list matches kernels/rmsnorm.cu; sizes checked by the callers.
    unsafe { b.launch(cfg) }.cuda("rmsnorm_residual").map(drop)
}

/// RMSNorm (spec §7) of each row of the f32 stream `x` ([n, d], d =
/// `weight.len()`): out = bf16(bf16(x / √(mean(x²) + eps)) · w). `x` is not
/// modified.
///
/// Errors: [`Error::Input`] when x is not a multiple of d or out ≠ x in size.
pub fn rmsnorm<X, W, O>(gpu: &Gpu, x: &X, weight: &W, eps: f32, out: &mut O) -> Result<()>
where
    X: DevicePtr<f32>,
    W: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    let d = weight.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(Error::Input(format!(
            "rmsnorm: x has {} elements, not a multiple of d = {d}",
            x.len()
        )));
    }
    expect_len("rmsnorm", "out", out.len(), x.len())?;
    let n = x.len() / d;
    let (xp, wp, op) = (dptr(gpu, x), dptr(gpu, weight), dptr_mut(gpu, out));
    rmsnorm_launch(gpu, xp, None, wp, op, n, d, eps)
}

/// Residual add fused with RMSNorm (spec §7), per row of [n, d] (d =
/// `weight.len()`):
/// `resid += delta · delta_scale` (f32 residual stream; `delta_scale` is
/// scale_depth/√L under muP, else 1), then
/// `out = bf16(bf16(resid / √(mean(resid²) + eps)) · w)`.
/// For layer 0, a zeroed `resid` plus the embedding output as `delta`
/// starts the stream.
///
/// Errors: [`Error::Input`] when resid is not a multiple of d, or delta/out
/// differ from resid in size.
pub fn add_rmsnorm<R, D, W, O>(
    gpu: &Gpu,
    resid: &mut R,
    delta: &D,
    delta_scale: f32,
    weight: &W,
    eps: f32,
    out: &mut O,
) -> Result<()>
where
    R: DevicePtrMut<f32>,
    D: DevicePtr<Bf16>,
    W: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    let d = weight.len();
    if d == 0 || !resid.len().is_multiple_of(d) {
        return Err(Error::Input(format!(
            "add_rmsnorm: resid has {} elements, not a multiple of d = {d}",
            resid.len()
        )));
    }
    expect_len("add_rmsnorm", "delta", delta.len(), resid.len())?;
    expect_len("add_rmsnorm", "out", out.len(), resid.len())?;
    let n = resid.len() / d;
    let (rp, dp, wp, op) = (
        dptr_mut(gpu, resid),
        dptr(gpu, delta),
        dptr(gpu, weight),
        dptr_mut(gpu, out),
    );
    rmsnorm_launch(gpu, rp, Some((dp, delta_scale)), wp, op, n, d, eps)
}

/// Precomputed f32 RoPE tables on the device: cos and sin, [rows, D/2],
/// row p for position p (spec §1: NeoX layout, cos/sin in f32, attention
/// factor folded in).
#[derive(Debug)]
pub struct RopeTables {
    /// cos, [rows, half].
    pub cos: CudaSlice<f32>,
    /// sin, [rows, half].
    pub sin: CudaSlice<f32>,
    /// Positions covered (0 … rows−1).
    pub rows: usize,
    /// D/2.
    pub half: usize,
}

impl RopeTables {
    /// Tables for positions 0 … `positions`−1 from the model's RoPE, at
    /// sequence length `seq_len` (only dynamic scaling depends on it; see
    /// [`crate::config::Rope::cos_sin`]).
    ///
    /// Errors: [`Error::Cuda`] on a copy failure.
    pub fn from_rope(
        gpu: &Gpu,
        rope: &crate::config::Rope,
        head_dim: usize,
        positions: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let half = head_dim / 2;
        let (mut cos, mut sin) = (
            vec![0.0f32; positions * half],
            vec![0.0f32; positions * half],
        );
        for p in 0..positions {
            rope.cos_sin(
                p,
                seq_len,
                &mut cos[p * half..(p + 1) * half],
                &mut sin[p * half..(p + 1) * half],
            );
        }
        Self::from_host(gpu, &cos, &sin, half)
    }

    /// Tables from host arrays cos/sin, [rows, half] each.
    ///
    /// Errors: [`Error::Input`] when the lengths differ or are not a
    /// multiple of `half`; [`Error::Cuda`] on a copy failure.
    pub fn from_host(gpu: &Gpu, cos: &[f32], sin: &[f32], half: usize) -> Result<Self> {
        if half == 0 || cos.len() != sin.len() || !cos.len().is_multiple_of(half) {
            return Err(Error::Input(format!(
                "rope tables: cos {} and sin {} values must be equal multiples of D/2 = {half}",
                cos.len(),
                sin.len()
            )));
        }
        Ok(RopeTables {
            cos: gpu.upload(cos)?,
            sin: gpu.upload(sin)?,
            rows: cos.len() / half,
            half,
        })
    }
}

/// NeoX RoPE in place (spec §1): in each of `rows` rows of `x` (bf16, row i
/// at i·`row_stride`), the `n_heads` heads of `head_dim` starting at column
/// `col_off` are rotated at position `pos[i]`: (x1, x2) → (x1·cos − x2·sin,
/// x2·cos + x1·sin) in f32, rounded to bf16. With a fused [q | k | v] row,
/// q and k are contiguous: `col_off = 0`, `n_heads = H + Hkv`.
///
/// Positions are not read on the host; one outside the table yields NaN.
///
/// Errors: [`Error::Input`] when head_dim is odd or ≠ 2·tables.half, the
/// heads overrun the row, x is not rows·row_stride, or pos is not \[rows\].
#[allow(clippy::too_many_arguments)]
pub fn rope_neox<X, P>(
    gpu: &Gpu,
    x: &mut X,
    rows: usize,
    row_stride: usize,
    col_off: usize,
    n_heads: usize,
    head_dim: usize,
    pos: &P,
    tables: &RopeTables,
) -> Result<()>
where
    X: DevicePtrMut<Bf16>,
    P: DevicePtr<i32>,
{
    const OP: &str = "rope_neox";
    if !head_dim.is_multiple_of(2) || head_dim != 2 * tables.half {
        return Err(Error::Input(format!(
            "{OP}: head_dim {head_dim} must be even and equal 2 × table half {}",
            tables.half
        )));
    }
    if col_off + n_heads * head_dim > row_stride {
        return Err(Error::Input(format!(
            "{OP}: {n_heads} heads of {head_dim} from column {col_off} overrun the row of {row_stride}"
        )));
    }
    expect_len(OP, "x", x.len(), rows * row_stride)?;
    expect_len(OP, "pos", pos.len(), rows)?;
    if rows == 0 || n_heads == 0 {
        return Ok(());
    }
    let (rs, co, hd, tr) = (
        i32_dim(row_stride, "row_stride")?,
        i32_dim(col_off, "col_off")?,
        i32_dim(head_dim, "head_dim")?,
        i32_dim(tables.rows, "table rows")?,
    );
    let (xp, pp, cp, sp) = (
        dptr_mut(gpu, x),
        dptr(gpu, pos),
        dptr(gpu, &tables.cos),
        dptr(gpu, &tables.sin),
    );
    let f = gpu.function("rope_neox")?;
    let threads = (tables.half.div_ceil(32) * 32).clamp(32, 256) as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid(rows, "rows")?, grid(n_heads, "heads")?, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&xp)
        .arg(&rs)
        .arg(&co)
        .arg(&hd)
        .arg(&pp)
        .arg(&cp)
        .arg(&sp)
        .arg(&tr);
    // SAFETY: argument list matches kernels/rope.cu; sizes checked above.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// SwiGLU on the fused gate|up GEMM output: `gate_up` is [n, 2·inter]
/// (gate in columns [0, inter), up in [inter, 2·inter)); out[n, inter] =
/// bf16(silu(gate) · up), computed in f32.
///
/// Errors: [`Error::Input`] on a shape mismatch.
pub fn swiglu<G, O>(gpu: &Gpu, gate_up: &G, n: usize, inter: usize, out: &mut O) -> Result<()>
where
    G: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    expect_len("swiglu", "gate_up", gate_up.len(), n * 2 * inter)?;
    expect_len("swiglu", "out", out.len(), n * inter)?;
    if n * inter == 0 {
        return Ok(());
    }
    let (n_, i_) = (i32_dim(n, "n")?, i32_dim(inter, "inter")?);
    let (gp, op) = (dptr(gpu, gate_up), dptr_mut(gpu, out));
    let f = gpu.function("swiglu")?;
    let blocks = (n * inter).div_ceil(256).min(65_535 * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&gp).arg(&op).arg(&n_).arg(&i_);
    // SAFETY: argument list matches kernels/swiglu.cu; sizes checked above.
    unsafe { b.launch(cfg) }.cuda("swiglu").map(drop)
}

/// Temperature / top-k / top-p sampling of `rows` f32 logits rows of
/// `vocab` values (row r at r·vocab of `logits`), one token per row, with
/// the uniform draws `u01` (\[rows\], f64 in [0, 1)): the rule of
/// [`crate::sample::sample_with_u`] (kernels/sample.cu).
/// Greedy parameters give the argmax. Returns the ids (synchronises: only
/// rows ids travel back, not the logits).
///
/// Errors: [`Error::Input`] on a length mismatch, a draw outside [0, 1) or
/// invalid parameters ([`crate::sample::SamplingParams::validate`]);
/// [`Error::Cuda`] on a launch or copy failure.
pub fn sample_rows<L>(
    gpu: &Gpu,
    logits: &L,
    rows: usize,
    vocab: usize,
    params: &crate::sample::SamplingParams,
    u01: &[f64],
) -> Result<Vec<u32>>
where
    L: DevicePtr<f32>,
{
    params.validate()?;
    if logits.len() < rows * vocab {
        return Err(Error::Input(format!(
            "sample_rows: logits hold {} values, {rows} rows of {vocab} need {}",
            logits.len(),
            rows * vocab
        )));
    }
    expect_len("sample_rows", "u01", u01.len(), rows)?;
    if let Some(bad) = u01.iter().find(|u| !(0.0..1.0).contains(*u)) {
        return Err(Error::Input(format!(
            "sample_rows: draw {bad} outside [0, 1)"
        )));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let u = gpu.upload(u01)?;
    let mut out = gpu.zeros::<u32>(rows)?;
    let (lp, up, op) = (dptr(gpu, logits), dptr(gpu, &u), dptr_mut(gpu, &mut out));
    let ld = vocab as i64;
    let (r_, v_) = (i32_dim(rows, "rows")?, i32_dim(vocab, "vocab")?);
    let k_ = i32::try_from(params.top_k.min(vocab + 1))
        .map_err(|_| Error::Input(format!("sample_rows: top_k {} too large", params.top_k)))?;
    let f = gpu.function("sample_rows")?;
    let cfg = LaunchConfig {
        grid_dim: (grid(rows, "rows")?, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&lp)
        .arg(&ld)
        .arg(&r_)
        .arg(&v_)
        .arg(&params.temperature)
        .arg(&k_)
        .arg(&params.top_p)
        .arg(&up)
        .arg(&op);
    // SAFETY: argument list matches kernels/sample.cu; logits hold rows·vocab
    // values, u and out rows each.
    unsafe { b.launch(cfg) }.cuda("sample_rows")?;
    gpu.download(&out)
}

/// One layer's NOSA eviction head on the device (spec §2–§3), all f32: the
/// checkpoint's values exactly (bf16 checkpoints widen without rounding),
/// as the CPU reference uses them.
#[derive(Debug)]
pub struct EvictionWeights {
    /// A, \[Hkv\] f32.
    pub a: CudaSlice<f32>,
    /// δ, [Hkv, Hkv·D] f32.
    pub delta: CudaSlice<f32>,
    /// b, \[Hkv\] f32 (only with `attention_bias`).
    pub bias: Option<CudaSlice<f32>>,
    /// Hkv.
    pub kv_heads: usize,
    /// D.
    pub head_dim: usize,
}

impl EvictionWeights {
    /// Uploads A \[Hkv\], δ [Hkv, Hkv·D] and the optional bias \[Hkv\].
    ///
    /// Errors: [`Error::Input`] on a shape mismatch; [`Error::Cuda`] on a copy failure.
    pub fn new(
        gpu: &Gpu,
        a: &[f32],
        delta: &[f32],
        bias: Option<&[f32]>,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        const OP: &str = "eviction weights";
        expect_len(OP, "A", a.len(), kv_heads)?;
        expect_len(OP, "delta", delta.len(), kv_heads * kv_heads * head_dim)?;
        if let Some(b) = bias {
            expect_len(OP, "delta.bias", b.len(), kv_heads)?;
        }
        Ok(EvictionWeights {
            a: gpu.upload(a)?,
            delta: gpu.upload(delta)?,
            bias: bias.map(|b| gpu.upload(b)).transpose()?,
            kv_heads,
            head_dim,
        })
    }
}

/// Eviction scores (spec §3): c[i, h] = A\[h\] · softplus(δ_h · v_i + b_h),
/// softplus linear above 20, f32 out [n, Hkv]. `v`: n rows of Hkv·D bf16
/// values at stride `ld_v` (a view into a fused QKV output works: pass the
/// view starting at the first row's v and its row width as `ld_v`).
///
/// Errors: [`Error::Input`] when ld_v < Hkv·D, v is shorter than
/// (n−1)·ld_v + Hkv·D, or c is not [n, Hkv].
pub fn eviction_score<V, C>(
    gpu: &Gpu,
    v: &V,
    n: usize,
    ld_v: usize,
    head: &EvictionWeights,
    c: &mut C,
) -> Result<()>
where
    V: DevicePtr<Bf16>,
    C: DevicePtrMut<f32>,
{
    const OP: &str = "eviction_score";
    let kvd = head.kv_heads * head.head_dim;
    if ld_v < kvd {
        return Err(Error::Input(format!(
            "{OP}: row stride {ld_v} < Hkv·D = {kvd}"
        )));
    }
    expect_len(OP, "c", c.len(), n * head.kv_heads)?;
    if n == 0 {
        return Ok(());
    }
    let need = (n - 1) * ld_v + kvd;
    if v.len() < need {
        return Err(Error::Input(format!(
            "{OP}: v has {} elements, needs at least {need} for {n} rows at stride {ld_v}",
            v.len()
        )));
    }
    let (ld, n_, hk, kd) = (
        i32_dim(ld_v, "ld_v")?,
        i32_dim(n, "n")?,
        i32_dim(head.kv_heads, "Hkv")?,
        i32_dim(kvd, "Hkv·D")?,
    );
    let vp = dptr(gpu, v);
    let dp = dptr(gpu, &head.delta);
    let bp = head.bias.as_ref().map_or(0u64, |b| dptr(gpu, b));
    let ap = dptr(gpu, &head.a);
    let cp = dptr_mut(gpu, c);
    let warps = n * head.kv_heads;
    let f = gpu.function("eviction_score")?;
    let cfg = LaunchConfig {
        grid_dim: (grid(warps.div_ceil(4), "warps")?, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&vp)
        .arg(&ld)
        .arg(&dp)
        .arg(&bp)
        .arg(&ap)
        .arg(&cp)
        .arg(&n_)
        .arg(&hk)
        .arg(&kd);
    // SAFETY: argument list matches kernels/eviction.cu; sizes checked above.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Device addresses and geometry of one `qkv_rope_append` launch
/// (kernels/kv_append.cu), one thread block per (row, head). Shared by
/// [`qkv_rope_append`] and the engine's layers (per-row pointer tables).
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvAppendArgs {
    /// bf16 fused rows [q | k | v | …] at `row_stride`; q and k rotated in place.
    pub qkv: u64,
    /// Elements per fused row.
    pub row_stride: usize,
    /// H.
    pub heads: usize,
    /// Hkv.
    pub kv_heads: usize,
    /// D.
    pub head_dim: usize,
    /// i32 \[rows\]: each row's position.
    pub pos: u64,
    /// f32 RoPE tables, [table_rows, D/2] each.
    pub cos: u64,
    /// As `cos`.
    pub sin: u64,
    /// Positions the tables cover.
    pub table_rows: usize,
    /// u64 \[rows\]: each row's K cache, bf16 [cap, Hkv, D].
    pub kptr: u64,
    /// u64 \[rows\]: each row's V cache, bf16 [cap, Hkv, D].
    pub vptr: u64,
    /// u64 \[rows\] (0 = no c anywhere): each row's c cache, f32 [cap, Hkv] (0 = none).
    pub cptr: u64,
    /// Eviction head (0 = none): A f32 \[Hkv\].
    pub evict_a: u64,
    /// δ f32 [Hkv, Hkv·D] (with `evict_a`).
    pub evict_delta: u64,
    /// b f32 \[Hkv\], 0 = no bias.
    pub evict_b: u64,
    /// Tail-ring tokens of an offloaded layer (token t at row t mod ring), 0 = none.
    pub ring: usize,
    /// Rows.
    pub rows: usize,
    /// Where a position outside the RoPE table is reported.
    pub err: ErrorSink,
}

/// Launches `qkv_rope_append` for `a` on the GPU's stream (see
/// [`qkv_rope_append`] for what it computes). `rows = 0` is a no-op.
///
/// # Safety
/// Every address in `a` must point to a live buffer of the sizes its fields
/// state for all `a.rows` rows, and each row's position must be below its
/// caches' capacity (ring slot below the ring).
///
/// Errors: a size past the i32/grid range; a launch failure.
pub(crate) unsafe fn launch_qkv_rope_append(gpu: &Gpu, a: &QkvAppendArgs) -> Result<()> {
    const OP: &str = "qkv_rope_append";
    if a.rows == 0 {
        return Ok(());
    }
    let (w_, h_, hk_, d_, tr, ring_) = (
        i32_dim(a.row_stride, "qkv row")?,
        i32_dim(a.heads, "H")?,
        i32_dim(a.kv_heads, "Hkv")?,
        i32_dim(a.head_dim, "D")?,
        i32_dim(a.table_rows, "rope rows")?,
        i32_dim(a.ring, "ring tokens")?,
    );
    let layer = a.err.layer_arg()?;
    let f = gpu.function(OP)?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid(a.rows, "rows")?,
            grid(a.heads + 2 * a.kv_heads, "heads")?,
            1,
        ),
        block_dim: (
            ((a.head_dim / 2).div_ceil(32) * 32).clamp(32, 128) as u32,
            1,
            1,
        ),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&a.qkv)
        .arg(&w_)
        .arg(&h_)
        .arg(&hk_)
        .arg(&d_)
        .arg(&a.pos)
        .arg(&a.cos)
        .arg(&a.sin)
        .arg(&tr)
        .arg(&a.kptr)
        .arg(&a.vptr)
        .arg(&a.cptr)
        .arg(&a.evict_a)
        .arg(&a.evict_delta)
        .arg(&a.evict_b)
        .arg(&ring_)
        .arg(&a.err.record)
        .arg(&layer);
    // SAFETY: argument list matches kernels/kv_append.cu; the caller promises
    // live buffers of the stated sizes.
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// One row of [`qkv_rope_append`]: its token's position and the caches the
/// token is appended to (the kernel writes into them; rows of one sequence
/// share its caches).
#[derive(Debug, Clone, Copy)]
pub struct AppendRow<'a> {
    /// Position of the row's token (its RoPE angle; its cache row, or ring
    /// slot `pos mod ring`).
    pub pos: usize,
    /// K cache, bf16 [cap, Hkv, D].
    pub k: &'a CudaSlice<Bf16>,
    /// V cache, bf16 [cap, Hkv, D].
    pub v: &'a CudaSlice<Bf16>,
    /// Eviction scores c, f32 [cap, Hkv] (row `pos`, not the ring slot);
    /// none: not written.
    pub c: Option<&'a CudaSlice<f32>>,
}

/// RoPE + KV append + eviction score (spec §1, §3) of the fused QKV rows
/// of one layer, as the engine runs it after the QKV GEMM: in each of the
/// `rows.len()` rows of `qkv` (bf16, row i at i·`row_stride`, q | k | v =
/// H, Hkv, Hkv heads of D from column 0) the q and k heads are rotated in
/// place at the row's position (f32, rounded to bf16); the rotated k and
/// the v heads are written to the row's K / V caches at its position (ring
/// slot `pos mod ring` when `ring` > 0); with `evict`, c[pos, h] =
/// A\[h\]·softplus(Σ_j δ\[h, j\]·v\[j\] + b\[h\]) over the row's whole v (Hkv·D
/// values as stored, bf16 widened to f32; all f32) is written to the row's c
/// cache when it has one.
///
/// A row whose position lies outside `tables` is not checked here: the
/// kernel skips it (nothing rotated, appended or scored) and reports it to
/// `err` ([`DeviceErrorKind::RopePosition`](crate::cuda::device_error::DeviceErrorKind::RopePosition):
/// the row, `err.layer`, the position and the table's rows);
/// [`ErrorSink::NONE`] reports nothing.
///
/// Errors: [`Error::Input`] when H is not a multiple of Hkv, D is odd or ≠
/// 2·tables.half, the heads overrun `row_stride`, `qkv` is not
/// rows·row_stride, a row's cache is too short for its position (or ring
/// slot), the eviction head's shape differs, or a position exceeds i32;
/// [`Error::Cuda`] on a copy or launch failure.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_append<Q: DevicePtrMut<Bf16>>(
    gpu: &Gpu,
    qkv: &mut Q,
    row_stride: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rows: &[AppendRow<'_>],
    tables: &RopeTables,
    evict: Option<&EvictionWeights>,
    ring: usize,
    err: ErrorSink,
) -> Result<()> {
    const OP: &str = "qkv_rope_append";
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(Error::Input(format!(
            "{OP}: {heads} query heads is not a positive multiple of {kv_heads} KV heads"
        )));
    }
    if !head_dim.is_multiple_of(2) || head_dim != 2 * tables.half {
        return Err(Error::Input(format!(
            "{OP}: head_dim {head_dim} must be even and equal 2 × table half {}",
            tables.half
        )));
    }
    let kvd = kv_heads * head_dim;
    if (heads + 2 * kv_heads) * head_dim > row_stride {
        return Err(Error::Input(format!(
            "{OP}: {heads} + 2 × {kv_heads} heads of {head_dim} overrun the row of {row_stride}"
        )));
    }
    let n = rows.len();
    expect_len(OP, "qkv", qkv.len(), n * row_stride)?;
    if let Some(e) = evict {
        if e.kv_heads != kv_heads || e.head_dim != head_dim {
            return Err(Error::Input(format!(
                "{OP}: eviction head for Hkv {} × D {}, rows have Hkv {kv_heads} × D {head_dim}",
                e.kv_heads, e.head_dim
            )));
        }
    }
    if n == 0 {
        return Ok(());
    }
    let (mut kp, mut vp, mut cp, mut pos) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (i, r) in rows.iter().enumerate() {
        let slot = if ring > 0 { r.pos % ring } else { r.pos };
        if r.k.len() < (slot + 1) * kvd || r.v.len() < (slot + 1) * kvd {
            return Err(Error::Input(format!(
                "{OP}: row {i} writes cache row {slot}, its K/V caches hold {} / {} elements ({} needed)",
                r.k.len(),
                r.v.len(),
                (slot + 1) * kvd
            )));
        }
        if let Some(c) = r.c {
            if c.len() < (r.pos + 1) * kv_heads {
                return Err(Error::Input(format!(
                    "{OP}: row {i} at position {} needs {} eviction scores, its c cache holds {}",
                    r.pos,
                    (r.pos + 1) * kv_heads,
                    c.len()
                )));
            }
        }
        kp.push(dptr(gpu, r.k));
        vp.push(dptr(gpu, r.v));
        cp.push(r.c.map_or(0u64, |c| dptr(gpu, c)));
        pos.push(i32_dim(r.pos, "position")?);
    }
    let (kd, vd, cd, pd) = (
        gpu.upload(&kp)?,
        gpu.upload(&vp)?,
        gpu.upload(&cp)?,
        gpu.upload(&pos)?,
    );
    let args = QkvAppendArgs {
        qkv: dptr_mut(gpu, qkv),
        row_stride,
        heads,
        kv_heads,
        head_dim,
        pos: dptr(gpu, &pd),
        cos: dptr(gpu, &tables.cos),
        sin: dptr(gpu, &tables.sin),
        table_rows: tables.rows,
        kptr: dptr(gpu, &kd),
        vptr: dptr(gpu, &vd),
        cptr: dptr(gpu, &cd),
        evict_a: evict.map_or(0, |e| dptr(gpu, &e.a)),
        evict_delta: evict.map_or(0, |e| dptr(gpu, &e.delta)),
        evict_b: evict
            .and_then(|e| e.bias.as_ref())
            .map_or(0, |b| dptr(gpu, b)),
        ring,
        rows: n,
        err,
    };
    // SAFETY: shapes checked above; the pointer tables live until their
    // stream-ordered free after the launch.
    unsafe { launch_qkv_rope_append(gpu, &args) }
}

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
    kv_heads: usize,
    head_dim: usize,
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
    sel: CudaSlice<i32>,
    nsel: CudaSlice<i32>,
    batch: usize,
    kv_heads: usize,
    s_max: usize,
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
    /// Output of the fused combine (bf16 [rows, H, D], rows at `out_stride`);
    /// used only when `counters` is set.
    pub out: u64,
    pub out_stride: usize,
    /// Zeroed u32 [rows · head blocks] arrival counters: set, the kernel
    /// merges the splits itself (no `attn_combine` launch); 0, it only
    /// writes the partials.
    pub counters: u64,
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
}

/// Whether the split-K combine runs inside `attn_partial` (its last block
/// per row and head group merges the splits) for `nsplit` splits at head
/// dim `d`: only when `SPARDA_FUSED_COMBINE=1` asks for it and the splits'
/// weights fit the kernel's shared memory. Off by default: on the H200
/// (2026-11-30, dense B = 1, 4K) the fused tail made Attention 1.19 ms per
/// step against 0.43 ms + 0.25 ms for the two kernels (one block merging
/// 16 heads' splits is bound by L2 latency).
pub fn attn_fused_combine(nsplit: usize, d: usize) -> bool {
    static FUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let fused =
        *FUSED.get_or_init(|| std::env::var("SPARDA_FUSED_COMBINE").is_ok_and(|v| v == "1"));
    fused && nsplit <= ATTN_MAX_SPLITS && (16 * nsplit + 32) * 4 <= attn_smem_bytes(d)
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
    let os = i32_dim(a.out_stride, "out_stride")?;
    if a.counters != 0 && !attn_fused_combine(a.nsplit, a.head_dim) {
        return Err(Error::Input(format!(
            "{OP}: {} splits at head dim {} cannot be combined inside the kernel",
            a.nsplit, a.head_dim
        )));
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
    let mut b = gpu.stream().launch_builder(f);
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
        .arg(&a.out)
        .arg(&os)
        .arg(&a.counters)
        .arg(&a.slot_list)
        .arg(&a.pool_ptr)
        .arg(&ps)
        .arg(&rg);
    // SAFETY: argument list matches kernels/attn_decode.cu; the callers size the
    // partials (rows·H·nsplit slots), the tables (rows entries) and the lists.
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
    let mut bld = gpu.stream().launch_builder(f);
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
    let part_o = unsafe { gpu.stream().alloc(slots * d) }.cuda("allocating attention partials")?;
    let part_ml = unsafe { gpu.stream().alloc(slots * 2) }.cuda("allocating attention partials")?;
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
        counters: 0,
        slot_list: 0,
        pool_ptr: 0,
        pool_slots: 0,
        ring: 0,
    };
    launch_attention(gpu, args, out, out_stride)
}

/// Launches the split-K partial attention for `args` and merges the splits
/// into `out` (bf16 [rows, H, D], rows at `out_stride`): in the kernel itself
/// when [`attn_fused_combine`] says so, else with `attn_combine`. Shared by
/// [`attention_dense_decode`] and [`attention_sparse_decode`]; the partial
/// buffers that `args` points to must outlive the launches (the callers own
/// them; frees are stream-ordered).
fn launch_attention<O: DevicePtrMut<Bf16>>(
    gpu: &Gpu,
    args: AttnArgs,
    out: &mut O,
    out_stride: usize,
) -> Result<()> {
    let fused = attn_fused_combine(args.nsplit, args.head_dim);
    let counters = if fused {
        Some(
            gpu.stream()
                .alloc_zeros::<u32>(args.rows * attn_head_blocks(args.heads, args.kv_heads))
                .cuda("allocating attention counters")?,
        )
    } else {
        None
    };
    let op = dptr_mut(gpu, out);
    let args = AttnArgs {
        out: op,
        out_stride,
        counters: counters.as_ref().map_or(0, |c| dptr(gpu, c)),
        slot_list: 0,
        pool_ptr: 0,
        pool_slots: 0,
        ring: 0,
        ..args
    };
    launch_attn_partial(gpu, &args)?;
    if fused {
        return Ok(());
    }
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
        counters: 0,
        slot_list: 0,
        pool_ptr: 0,
        pool_slots: 0,
        ring: 0,
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
