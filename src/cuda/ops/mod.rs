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

pub mod attention;
pub mod gemv;
pub mod offload;
pub mod prefill_attention;
pub mod prefill_scores;
pub mod select;

pub use attention::*;
pub use gemv::*;
pub use prefill_attention::*;

use crate::cuda::context::{dptr, dptr_mut, grid, i32_dim, CudaResultExt};
use crate::cuda::device_error::ErrorSink;
use crate::cuda::{Bf16, Gpu};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

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

/// The environment variable that chooses the RMSNorm kernel
/// ([`rmsnorm_vec4`]): `v4` (the default) or `element`.
pub const ENV_RMSNORM: &str = "SPARDA_RMSNORM";

/// Whether the RMSNorms ([`rmsnorm`], [`add_rmsnorm`]) run
/// `rmsnorm_residual_v4` (4 columns a thread in 16- and 8-byte accesses)
/// where [`rmsnorm_takes_v4`] the row: yes unless `$SPARDA_RMSNORM` =
/// `element` (read once). Another value is refused with a warning and
/// leaves the default. Measured: benches/results/prefill_vector_swiglu_rmsnorm_sparse_128k_h100_2026-12-07_0dd4863/.
pub fn rmsnorm_vec4() -> bool {
    static V4: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V4.get_or_init(|| env_kernel(ENV_RMSNORM, "v4", "element"))
}

/// Whether `rmsnorm_residual_v4` takes rows of `d` columns at these device
/// addresses: d a multiple of 4, the f32 residual `resid` 16-byte aligned
/// (and so every row), the bf16 `delta` (0: none), `w` and `out` 8-byte
/// aligned.
pub fn rmsnorm_takes_v4(d: usize, resid: u64, delta: u64, w: u64, out: u64) -> bool {
    d.is_multiple_of(4)
        && resid.is_multiple_of(16)
        && delta.is_multiple_of(8)
        && w.is_multiple_of(8)
        && out.is_multiple_of(8)
}

/// Shared launcher of `rmsnorm_residual`, or `rmsnorm_residual_v4` when
/// `vec4` and [`rmsnorm_takes_v4`] the row; `delta` = (address, scale) or
/// none.
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
    vec4: bool,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let d_ = i32_dim(d, "d")?;
    let (dp, ds) = delta.unwrap_or((0, 0.0));
    let v4 = vec4 && rmsnorm_takes_v4(d, resid, dp, w, out);
    let f = gpu.function(if v4 {
        "rmsnorm_residual_v4"
    } else {
        "rmsnorm_residual"
    })?;
    // About four elements per thread (one block per row: at batch 1 the
    // whole kernel is one block, so its width sets the latency).
    let threads = (d.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid(n, "rows")?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.launch_builder(f);
    b.arg(&resid)
        .arg(&dp)
        .arg(&ds)
        .arg(&w)
        .arg(&out)
        .arg(&d_)
        .arg(&eps);
    // SAFETY: argument list matches both kernels of kernels/rmsnorm.cu; sizes
    // checked by the callers, alignment (v4) by rmsnorm_takes_v4.
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
    rmsnorm_with(gpu, x, weight, eps, out, rmsnorm_vec4())
}

/// [`rmsnorm`] with the kernel chosen by the caller: `vec4` allows
/// `rmsnorm_residual_v4` where [`rmsnorm_takes_v4`] the row (gpu-check
/// runs both kernels).
///
/// Errors: as [`rmsnorm`].
pub fn rmsnorm_with<X, W, O>(
    gpu: &Gpu,
    x: &X,
    weight: &W,
    eps: f32,
    out: &mut O,
    vec4: bool,
) -> Result<()>
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
    rmsnorm_launch(gpu, xp, None, wp, op, n, d, eps, vec4)
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
    add_rmsnorm_with(
        gpu,
        resid,
        delta,
        delta_scale,
        weight,
        eps,
        out,
        rmsnorm_vec4(),
    )
}

/// [`add_rmsnorm`] with the kernel chosen by the caller: `vec4` allows
/// `rmsnorm_residual_v4` where [`rmsnorm_takes_v4`] the row (gpu-check
/// runs both kernels).
///
/// Errors: as [`add_rmsnorm`].
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_with<R, D, W, O>(
    gpu: &Gpu,
    resid: &mut R,
    delta: &D,
    delta_scale: f32,
    weight: &W,
    eps: f32,
    out: &mut O,
    vec4: bool,
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
    rmsnorm_launch(gpu, rp, Some((dp, delta_scale)), wp, op, n, d, eps, vec4)
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

/// Host cos/sin tables, [positions, D/2] each: row p from
/// [`crate::config::Rope::cos_sin`] at sequence length `seq_len`, or, when
/// `None`, at p + 1 (the decode table, [`RopeTables::for_decode`]).
pub fn rope_rows(
    rope: &crate::config::Rope,
    head_dim: usize,
    positions: usize,
    seq_len: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let (mut cos, mut sin) = (
        vec![0.0f32; positions * half],
        vec![0.0f32; positions * half],
    );
    for p in 0..positions {
        rope.cos_sin(
            p,
            seq_len.unwrap_or(p + 1),
            &mut cos[p * half..(p + 1) * half],
            &mut sin[p * half..(p + 1) * half],
        );
    }
    (cos, sin)
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
        let (cos, sin) = rope_rows(rope, head_dim, positions, Some(seq_len));
        Self::from_host(gpu, &cos, &sin, head_dim / 2)
    }

    /// The decode table: row p at sequence length p + 1, the length a
    /// sequence has when its token at position p is decoded — with dynamic
    /// NTK RoPE the base grows with it past the original maximum, as the
    /// CPU reference rotates each decoded token (spec §1); for every other
    /// RoPE type the same as [`RopeTables::from_rope`].
    ///
    /// Errors: [`Error::Cuda`] on a copy failure.
    pub fn for_decode(
        gpu: &Gpu,
        rope: &crate::config::Rope,
        head_dim: usize,
        positions: usize,
    ) -> Result<Self> {
        let (cos, sin) = rope_rows(rope, head_dim, positions, None);
        Self::from_host(gpu, &cos, &sin, head_dim / 2)
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
/// bf16(silu(gate) · up), computed in f32: [`swiglu_with`], `swiglu_v8`
/// allowed unless [`swiglu_vec8`] is off.
///
/// Errors: [`Error::Input`] on a shape mismatch or n, inter past i32;
/// [`Error::Cuda`] on a launch failure.
pub fn swiglu<G, O>(gpu: &Gpu, gate_up: &G, n: usize, inter: usize, out: &mut O) -> Result<()>
where
    G: DevicePtr<Bf16>,
    O: DevicePtrMut<Bf16>,
{
    swiglu_with(gpu, gate_up, n, inter, out, swiglu_vec8())
}

/// The environment variable that chooses the SwiGLU kernel
/// ([`swiglu_vec8`]): `v8` (the default) or `element`.
pub const ENV_SWIGLU: &str = "SPARDA_SWIGLU";

/// Whether [`swiglu`] runs `swiglu_v8` where it takes the shape: yes unless
/// `$SPARDA_SWIGLU` = `element` (read once). Another value is refused with
/// a warning and leaves the default. Measured:
/// benches/results/prefill_vector_swiglu_rmsnorm_sparse_128k_h100_2026-12-07_0dd4863/.
pub fn swiglu_vec8() -> bool {
    static V8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V8.get_or_init(|| env_kernel(ENV_SWIGLU, "v8", "element"))
}

/// The kernel choice of the variable `var` (trimmed): `vector` (the
/// default when unset) gives true, `element` false; another value is
/// refused with a warning naming the variable, the value and both choices,
/// and gives the default.
fn env_kernel(var: &str, vector: &str, element: &str) -> bool {
    match std::env::var(var) {
        Ok(v) if v.trim() == vector => true,
        Ok(v) if v.trim() == element => false,
        Ok(v) => {
            tracing::warn!("{var}={v:?}: takes {vector} (the default) or {element}; {vector} runs");
            true
        }
        Err(_) => true,
    }
}

/// [`swiglu`] with the kernel chosen by the caller (kernels/swiglu.cu):
/// `vec8` and [`swiglu_takes_v8`] the shape and addresses: `swiglu_v8`, 8
/// columns a thread in 16-byte loads and 32-bit indices; else `swiglu`,
/// one element a thread. The same arithmetic per element, so the same
/// bits (gpu-check compares them).
///
/// Errors: [`Error::Input`] on a shape mismatch or n, inter past i32;
/// [`Error::Cuda`] on a launch failure.
pub fn swiglu_with<G, O>(
    gpu: &Gpu,
    gate_up: &G,
    n: usize,
    inter: usize,
    out: &mut O,
    vec8: bool,
) -> Result<()>
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
    let v8 = vec8 && swiglu_takes_v8(n, inter, gp, op);
    let f = gpu.function(if v8 { "swiglu_v8" } else { "swiglu" })?;
    let work = if v8 { n * inter / 8 } else { n * inter };
    let blocks = work.div_ceil(256).min(65_535 * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.launch_builder(f);
    b.arg(&gp).arg(&op).arg(&n_).arg(&i_);
    // SAFETY: argument list matches kernels/swiglu.cu; sizes checked above.
    unsafe { b.launch(cfg) }.cuda("swiglu").map(drop)
}

/// Whether `swiglu_v8` takes SwiGLU over `n` rows of `inter` columns with
/// the gate|up input at device address `gu` and the output at `out`: inter
/// a multiple of 8 (whole 16-byte groups in both halves of a row), both
/// addresses 16-byte aligned, and fewer than 2^31 groups of 8 (its 32-bit
/// indices).
pub fn swiglu_takes_v8(n: usize, inter: usize, gu: u64, out: u64) -> bool {
    inter.is_multiple_of(8)
        && gu.is_multiple_of(16)
        && out.is_multiple_of(16)
        && (n * inter / 8) < (1usize << 31)
}

/// Enqueues `argmax_rows` (kernels/argmax.cu): out\[r\] = the index of the
/// largest of the `vocab` f32 logits of row r (rows at r·vocab from the
/// device address `logits`; ties to the lower index, NaN never wins: the
/// rule of [`crate::sample::argmax`] on finite rows), `out` a device
/// address of `rows` u32. A row no token can be chosen from
/// ([`crate::sample::check_logits`]) is reported to the device record
/// `record` (0: not reported) and still gets its id.
///
/// Errors: [`Error::Input`] for dimensions past i32; [`Error::Cuda`] on a
/// launch failure.
pub(crate) fn launch_argmax_rows(
    gpu: &Gpu,
    logits: u64,
    rows: usize,
    vocab: usize,
    out: u64,
    record: u64,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let (n_, v_) = (i32_dim(rows, "rows")?, i32_dim(vocab, "vocab")?);
    let f = gpu.function("argmax_rows")?;
    let cfg = LaunchConfig {
        grid_dim: (grid(rows, "rows")?, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&logits).arg(&n_).arg(&v_).arg(&out).arg(&record);
    // SAFETY: argument list matches kernels/argmax.cu; the callers give rows·vocab
    // logits and rows outputs; the record is null or RECORD_WORDS i32.
    unsafe { b.launch(cfg) }.cuda("argmax_rows").map(drop)
}

/// Greedy ids of `rows` f32 logits rows of `vocab` values on the device
/// (kernels/argmax.cu `argmax_rows`), downloaded (synchronises).
///
/// Errors: [`Error::Input`] when `logits` holds fewer than rows·vocab
/// values; [`Error::Cuda`] on a launch or copy failure.
pub fn argmax_rows<L>(
    gpu: &Gpu,
    logits: &L,
    rows: usize,
    vocab: usize,
    err: crate::cuda::device_error::ErrorSink,
) -> Result<Vec<u32>>
where
    L: DevicePtr<f32>,
{
    if logits.len() < rows * vocab {
        return Err(Error::Input(format!(
            "argmax_rows: logits hold {} values, {rows} rows of {vocab} need {}",
            logits.len(),
            rows * vocab
        )));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    let mut out = gpu.zeros::<u32>(rows)?;
    let op = dptr_mut(gpu, &mut out);
    launch_argmax_rows(gpu, dptr(gpu, logits), rows, vocab, op, err.record)?;
    gpu.download(&out)
}

/// Temperature / top-k / top-p sampling of `rows` f32 logits rows of
/// `vocab` values (row r at r·vocab of `logits`), one token per row, with
/// the uniform draws `u01` (\[rows\], f64 in [0, 1)): the rule of
/// [`crate::sample::sample_with_u`] (kernels/sample.cu).
/// Greedy parameters give the argmax. A row no token can be chosen from
/// ([`crate::sample::check_logits`]: a NaN, a +∞, no finite logit) gets
/// its argmax and is reported to `err`'s record (one of them when several
/// are: the first to claim the record; kind
/// [`crate::cuda::device_error::DeviceErrorKind::LogitsNan`] and siblings;
/// `err.layer` is not used), for the caller to read after this call.
/// Returns the ids (synchronises: only rows ids travel back, not the
/// logits).
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
    err: crate::cuda::device_error::ErrorSink,
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
        .arg(&op)
        .arg(&err.record);
    // SAFETY: argument list matches kernels/sample.cu; logits hold rows·vocab
    // values, u and out rows each; the record is null or RECORD_WORDS i32.
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

/// Block of `qkv_rope_append` at head dim `head_dim`: (threads per head, heads
/// per block). A head's row is half the head dim rounded up to whole warps
/// (32 … 128 threads); rows are stacked to about 256 threads, so a prefill
/// chunk of 1,024 rows and 36 heads is 9,216 blocks, not 36,864 blocks of 64.
pub(crate) fn rope_append_block(head_dim: usize) -> (u32, u32) {
    let tx = ((head_dim / 2).div_ceil(32) * 32).clamp(32, 128) as u32;
    (tx, (256 / tx).max(1))
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
    let (tx, hpb) = rope_append_block(a.head_dim);
    let cfg = LaunchConfig {
        grid_dim: (
            grid(a.rows, "rows")?,
            grid(
                (a.heads + 2 * a.kv_heads).div_ceil(hpb as usize),
                "head groups",
            )?,
            1,
        ),
        block_dim: (tx, hpb, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.launch_builder(f);
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

#[cfg(test)]
mod tests {
    use super::{rmsnorm_takes_v4, rope_append_block, swiglu_takes_v8};

    #[test]
    fn vector_kernels_take_whole_aligned_groups_only() {
        // SwiGLU: I a multiple of 8, 16-byte aligned input and output, < 2^31 groups
        assert!(swiglu_takes_v8(1024, 16_384, 0x1000, 0x2000));
        assert!(!swiglu_takes_v8(7, 1003, 0x1000, 0x2000));
        assert!(!swiglu_takes_v8(4, 1004, 0x1000, 0x2000));
        assert!(!swiglu_takes_v8(4, 1024, 0x1008, 0x2000));
        assert!(!swiglu_takes_v8(4, 1024, 0x1000, 0x2008));
        assert!(swiglu_takes_v8((1 << 31) / 1024 - 1, 8192, 0, 0));
        assert!(!swiglu_takes_v8((1 << 31) / 1024, 8192, 0, 0));
        // RMSNorm: d a multiple of 4, resid 16-byte, the bf16 rows 8-byte aligned, no delta (0)
        assert!(rmsnorm_takes_v4(4096, 0x1000, 0x2008, 0x3000, 0x4008));
        assert!(rmsnorm_takes_v4(2560, 0x1000, 0, 0x3000, 0x4000));
        assert!(!rmsnorm_takes_v4(578, 0x1000, 0, 0x3000, 0x4000));
        assert!(!rmsnorm_takes_v4(4096, 0x1008, 0, 0x3000, 0x4000));
        assert!(!rmsnorm_takes_v4(4096, 0x1000, 0x2004, 0x3000, 0x4000));
        assert!(!rmsnorm_takes_v4(4096, 0x1000, 0, 0x3002, 0x4000));
        assert!(!rmsnorm_takes_v4(4096, 0x1000, 0, 0x3000, 0x4004));
    }

    #[test]
    fn rope_append_blocks_hold_whole_warps_per_head_and_about_256_threads() {
        assert_eq!(rope_append_block(128), (64, 4));
        assert_eq!(rope_append_block(64), (32, 8));
        assert_eq!(rope_append_block(80), (64, 4));
        assert_eq!(rope_append_block(256), (128, 2));
        assert_eq!(rope_append_block(512), (128, 2));
        for d in [32, 64, 80, 96, 128, 256] {
            let (tx, hpb) = rope_append_block(d);
            assert_eq!(tx % 32, 0, "D {d}");
            assert!(tx as usize >= d / 2 || tx == 128, "D {d}");
            assert!(tx * hpb <= 256, "D {d}");
        }
    }

    use super::rope_rows;
    use crate::config::{Rope, RopeScaling};

    /// The decode table rotates row p at length p + 1 (dynamic NTK grows
    /// its base past the original maximum), a prefill table every row at
    /// the prompt's length; below the original maximum both are the plain
    /// table.
    #[test]
    fn decode_rows_use_their_own_length_and_prefill_rows_the_prompts() {
        let rope = Rope::new(
            16,
            10_000.0,
            4096,
            RopeScaling::Dynamic {
                factor: 2.0,
                original_max_position_embeddings: 64,
            },
        );
        let half = 8;
        let (dc, ds) = rope_rows(&rope, 16, 200, None);
        let (pc, ps) = rope_rows(&rope, 16, 200, Some(200));
        let (mut c, mut s) = (vec![0.0; half], vec![0.0; half]);
        for p in [0usize, 63, 64, 65, 150, 199] {
            rope.cos_sin(p, p + 1, &mut c, &mut s);
            assert_eq!(&dc[p * half..(p + 1) * half], &c[..], "decode row {p}");
            assert_eq!(&ds[p * half..(p + 1) * half], &s[..], "decode row {p}");
            rope.cos_sin(p, 200, &mut c, &mut s);
            assert_eq!(&pc[p * half..(p + 1) * half], &c[..], "prefill row {p}");
            assert_eq!(&ps[p * half..(p + 1) * half], &s[..], "prefill row {p}");
        }
        // below the original maximum the rows agree; past it they differ
        assert_eq!(
            dc[10 * half + 3],
            rope_rows(&rope, 16, 64, Some(64)).0[10 * half + 3]
        );
        assert_ne!(dc[150 * half + 3], pc[150 * half + 3]);
    }
}
