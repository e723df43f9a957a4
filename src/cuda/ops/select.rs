//! NOSA block selection on the GPU at decode (spec/nosa-model.md §3–§4): one
//! query token per sequence, B sequences of different lengths, per KV head.
//! It selects exactly what [`crate::model::select::select`] selects on the
//! same scores (f32 ranking, ties to the lower block index), and writes the
//! result in the layout [`attention_sparse_decode`](super::attention_sparse_decode)
//! reads ([`BlockSelection`]).
//!
//! Per (layer, sequence) the engine keeps, besides K (bf16 [T, Hkv, D]) and
//! c (f32 [T, Hkv]):
//! - **Kc**, f32 [cap, Hkv, D]: compressed keys, window i = mean of K over
//!   tokens [16i, 16i+32). Kept in **f32** (not bf16): the means of bf16
//!   keys are then bitwise those of the CPU reference, and query-aware
//!   scores match to f32 rounding. It costs Hkv·D·4/16 bytes per token,
//!   1/8 of the bf16 K cache.
//! - **p**, f32 [cap, Hkv]: mean of c over the same windows (NOSA only).
//!
//! `cap` is a capacity in windows that the engine chooses (and grows); the
//! wrappers check Mc(T) = ⌊(T−32)/16⌋+1 ≤ cap and fail with
//! [`Error::Input`] otherwise, before launching anything.
//!
//! A decode step per layer, after K and c of the new token are in the caches:
//! 1. [`compress_append`] (new_tokens = 1) completes the window the token
//!    closed, if any ([`compress_prefill`] / `compress_append(n)` after a
//!    prompt or a prefill chunk);
//! 2. [`select_decode`] = [`window_scores`] (s\[i,h\] = Σ_g softmax_i(q_g·Kc\[i,h\]/√D))
//!    then [`select_from_scores`] (pooling, forced blocks, shortlist, top-S),
//!    giving a [`BlockSelection`] for the sparse attention kernel.
//!
//! Kernels: `kernels/compress.cu` (`compress_windows`), `kernels/select.cu`
//! (`qa_window_logits`, `qa_window_scores`, `select_blocks`). Work per
//! (sequence, KV head) is O(Mc·G·D) for the scores and O(blocks) for the
//! selection (radix select in shared memory: 4 passes of 8 bits per top-k).
//! The kernels read sequence lengths from the device (`SelectBatch`'s lens),
//! and skip windows and blocks past each sequence's own length.

use super::prefill_scores::{launch_prefill_scores, split_kc_scratch_f32, PrefillScores};
use super::BlockSelection;
use crate::cuda::context::{dptr, dptr_mut, grid, i32_dim, CudaResultExt};
use crate::cuda::device_error::ErrorSink;
use crate::cuda::{Bf16, Gpu};
use crate::model::select::{Budget, SelectionRule};
use crate::{Error, Result};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

/// Windows per thread block of the scoring kernels (`QA_TILE` in
/// `kernels/select.cu`; both must agree).
pub const QA_TILE: usize = 64;
/// Threads per block of `qa_window_logits` (a multiple of [`QA_TILE`]:
/// thread t scores window t % QA_TILE for its share of the query heads).
pub const QA_THREADS: u32 = 256;
/// Largest head dimension the scoring kernel handles.
pub const MAX_HEAD_DIM: usize = 256;

/// Dynamic shared memory of `qa_window_logits` in bytes for group size `g`
/// and head dim `d`: q [G, Dp], the Kc tile [QA_TILE, Dp + 4] and the tile's
/// logits [G, QA_TILE] in f32, Dp = `d` rounded up to a multiple of 4 (the
/// layout of `kernels/select.cu`; both must agree).
pub fn qa_logits_smem_bytes(g: usize, d: usize) -> usize {
    let dp = d.div_ceil(4) * 4;
    (g * dp + QA_TILE * (dp + 4) + g * QA_TILE) * 4
}
/// Threads per block of the selection kernel for a launch of few blocks
/// (fewer than [`SELECT_MANY_FROM_BLOCKS_PER_SM`] per SM, decode steps of
/// small batches): each row's radix passes spread over 16 warps.
pub const SELECT_THREADS: u32 = 512;
/// Threads per block of the selection kernel for a launch of many blocks
/// (a prefill chunk's rows): more, smaller blocks resident per SM hide each
/// other's barriers. Synthetic NOSA-8B 127K prefill (a chunk's launch is
/// 1,024 rows × 2 KV heads) ran at 19,501 / 19,450 tokens/s against 19,147
/// / 19,052 with 512 threads and 19,386 / 19,394 with 256 in one call (H100,
/// 186b6a1); its traced selection took 250 ms, against 386 ms at 512 in a
/// trace of an earlier commit (bc25be8).
pub const SELECT_THREADS_MANY: u32 = 128;
/// Blocks per SM from which a `select_blocks` launch takes
/// [`SELECT_THREADS_MANY`] threads a block: below it the launch does not
/// fill the SMs at 512 threads (4 blocks of 512 per SM).
pub const SELECT_MANY_FROM_BLOCKS_PER_SM: usize = 4;
// select_blocks: a multiple of 32 threads, at most 1,024 (its ws[32] and warp-0 scans)
const _: () = assert!(
    SELECT_THREADS.is_multiple_of(32)
        && SELECT_THREADS <= 1024
        && SELECT_THREADS_MANY.is_multiple_of(32)
        && SELECT_THREADS_MANY <= 1024
);
/// The environment variable that sets the threads of every `select_blocks`
/// block: 128, 256 or 512 (a tuning choice; the kernel takes any multiple
/// of 32 up to 1,024).
pub const ENV_SELECT_THREADS: &str = "SPARDA_SELECT_THREADS";

/// Threads per block of a `select_blocks` launch of `blocks` blocks on a
/// GPU of `sm_count` SMs: [`select_threads_forced`] when set, else
/// [`SELECT_THREADS_MANY`] from [`SELECT_MANY_FROM_BLOCKS_PER_SM`] blocks
/// per SM on and [`SELECT_THREADS`] below.
pub fn select_threads(blocks: usize, sm_count: usize) -> u32 {
    threads_for(select_threads_forced(), blocks, sm_count)
}

/// `$SPARDA_SELECT_THREADS` when it is 128, 256 or 512 (read once; another
/// value is refused with a warning): the threads of every `select_blocks`
/// block; None: chosen per launch ([`select_threads`]).
pub fn select_threads_forced() -> Option<u32> {
    static THREADS: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        let v = std::env::var(ENV_SELECT_THREADS).ok()?;
        let t = select_threads_from(&v);
        if t.is_none() {
            tracing::warn!(
                "{ENV_SELECT_THREADS}={v:?}: takes 128, 256 or 512; choosing by the launch's size"
            );
        }
        t
    })
}

/// [`select_threads`]'s rule: `forced` when set, else by blocks per SM.
fn threads_for(forced: Option<u32>, blocks: usize, sm_count: usize) -> u32 {
    forced.unwrap_or(
        if blocks >= SELECT_MANY_FROM_BLOCKS_PER_SM * sm_count.max(1) {
            SELECT_THREADS_MANY
        } else {
            SELECT_THREADS
        },
    )
}

/// [`select_threads`]'s reading of the variable's value: 128, 256 or 512.
fn select_threads_from(v: &str) -> Option<u32> {
    match v.trim() {
        "128" => Some(128),
        "256" => Some(256),
        "512" => Some(512),
        _ => None,
    }
}
/// Static shared memory of `select_blocks` (hist 256 + ws 32 + bc 2 u32,
/// and ws2 32 u32 when it is compiled with `-DSEL_WARP_SCAN=1`: counted
/// either way, so a launch near the 48 KiB limit opts in for both), bytes.
const SELECT_STATIC_SMEM: usize = (256 + 32 + 32 + 2) * 4;
/// Shared memory a block may use without opting in, bytes.
const DEFAULT_SMEM: usize = 48 * 1024;
/// Cap on the grid of `compress_windows` (it loops over further windows).
const COMPRESS_MAX_GRID_X: usize = 8192;

/// Device addresses and sizes of one `select_blocks` launch
/// (kernels/select.cu), one CTA per (KV head, row). Shared by
/// [`select_from_scores`] and the engine's device-resident step.
pub(crate) struct SelectBlocksArgs {
    /// f32 window scores, rows of `w_stride`.
    pub scores: u64,
    /// Per-row pointer table of pooled eviction inputs p (0 unless NOSA).
    pub p: u64,
    /// i32 lengths (T, the current token included) per row.
    pub lens: u64,
    /// i32 selected block ids out, rows of `s_max`.
    pub sel: u64,
    /// i32 selection counts out, one per (row, KV head).
    pub nsel: u64,
    /// Optional pooled-score outputs (0 = not written), rows of `nb_stride`.
    pub pooled_r: u64,
    /// As `pooled_r`, for the eviction scores.
    pub pooled_e: u64,
    /// Windows per score row.
    pub w_stride: usize,
    /// Entries per selection row.
    pub s_max: usize,
    /// Pooled row stride (0 when not written).
    pub nb_stride: usize,
    /// Most blocks a row may have (sizes the shared memory).
    pub blocks: usize,
    /// Hkv.
    pub kv_heads: usize,
    /// Rows (sequences or queries).
    pub rows: usize,
    /// NOSA rule (else InfLLM-V2).
    pub nosa: bool,
    /// i32 [rows]: token counts whose windows Mc(·) are pooled instead of
    /// Mc(lens) (forecast mode, spec §4: the previous step's state); 0 = lens.
    pub win_lens: u64,
    /// Where a row with more blocks than `blocks` is reported (its
    /// selection is cleared either way).
    pub err: ErrorSink,
}

/// Launches `select_blocks` for `a` on the GPU's stream (spec §4 steps 3–6).
///
/// # Safety
/// Every address in `a` must point to a live buffer of the sizes its fields
/// state, for all `a.rows` rows.
///
/// Errors: a size past the i32/grid range or the device's shared memory; a
/// launch failure.
pub(crate) unsafe fn launch_select_blocks(
    gpu: &Gpu,
    budget: &Budget,
    a: &SelectBlocksArgs,
    op: &str,
) -> Result<()> {
    let f = gpu.function("select_blocks")?;
    let smem = ensure_smem(gpu, f, a.blocks * 8, SELECT_STATIC_SMEM, op)?;
    let ints = [
        (a.w_stride, "w_stride"),
        (a.s_max, "s_max"),
        (a.nb_stride, "nb_stride"),
        (a.blocks, "blocks"),
        (a.kv_heads, "Hkv"),
        (budget.block_size, "block_size"),
        (budget.kernel_stride, "kernel_stride"),
        (budget.kernel_size, "kernel_size"),
        (budget.init_blocks, "init_blocks"),
        (budget.window_blocks, "window_blocks"),
        (budget.attended, "attended"),
        (budget.shortlist, "shortlist"),
    ]
    .iter()
    .map(|&(x, w)| i32_dim(x, w))
    .collect::<Result<Vec<i32>>>()?;
    let nosa_i = i32::from(a.nosa);
    let layer = a.err.layer_arg()?;
    let cfg = LaunchConfig {
        grid_dim: (grid(a.kv_heads, "Hkv")?, grid(a.rows, "rows")?, 1),
        block_dim: (
            select_threads(a.rows * a.kv_heads, gpu.info().sm_count.max(0) as usize),
            1,
            1,
        ),
        shared_mem_bytes: smem,
    };
    let mut l = gpu.stream().launch_builder(f);
    l.arg(&a.scores)
        .arg(&ints[0])
        .arg(&a.p)
        .arg(&a.lens)
        .arg(&a.sel)
        .arg(&a.nsel)
        .arg(&ints[1])
        .arg(&a.pooled_r)
        .arg(&a.pooled_e)
        .arg(&ints[2])
        .arg(&ints[3])
        .arg(&ints[4])
        .arg(&ints[5])
        .arg(&ints[6])
        .arg(&ints[7])
        .arg(&ints[8])
        .arg(&ints[9])
        .arg(&ints[10])
        .arg(&ints[11])
        .arg(&nosa_i)
        .arg(&a.win_lens)
        .arg(&a.err.record)
        .arg(&layer);
    // SAFETY: argument list matches select_blocks in kernels/select.cu; the
    // buffers are live and sized as the caller promised.
    unsafe { l.launch(cfg) }.cuda(op).map(drop)
}

/// Mc(T): compressed windows that exist once `t_len` tokens are stored (spec §3).
fn windows(budget: &Budget, t_len: usize) -> usize {
    budget.windows(t_len)
}

/// Blocks 0 … q that exist for a sequence of `t_len` tokens (its query at
/// t_len − 1); 0 for an empty sequence.
fn blocks(budget: &Budget, t_len: usize) -> usize {
    if t_len == 0 {
        0
    } else {
        budget.blocks(t_len - 1)
    }
}

/// Checks the budget's geometry the kernels rely on (spec §1 "Validation").
fn check_budget(op: &str, budget: &Budget) -> Result<()> {
    let ok = budget.kernel_stride > 0
        && budget.kernel_size >= budget.kernel_stride
        && budget.block_size > 0
        && budget.block_size.is_multiple_of(budget.kernel_stride)
        && budget.attended >= 1
        && budget.shortlist <= budget.attended;
    if !ok {
        return Err(Error::Input(format!(
            "{op}: unsupported budget {budget:?} (need kernel_stride > 0, kernel_size ≥ kernel_stride, \
             kernel_stride | block_size, S ≥ 1 and shortlist n ≤ S)"
        )));
    }
    Ok(())
}

/// Makes `f` accept `dynamic` bytes of dynamic shared memory next to
/// `static_bytes` of static, opting in above 48 KiB.
///
/// Errors: [`Error::Input`] when the device's opt-in limit is exceeded.
pub(crate) fn ensure_smem(
    gpu: &Gpu,
    f: &CudaFunction,
    dynamic: usize,
    static_bytes: usize,
    op: &str,
) -> Result<u32> {
    if dynamic + static_bytes <= DEFAULT_SMEM {
        return Ok(dynamic as u32);
    }
    let optin = gpu
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .cuda("cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)")? as usize;
    if dynamic + static_bytes > optin {
        return Err(Error::Input(format!(
            "{op}: needs {} bytes of shared memory per block, the device allows {optin}",
            dynamic + static_bytes
        )));
    }
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        dynamic as i32,
    )
    .cuda("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")?;
    Ok(dynamic as u32)
}

/// One sequence's selection state of one layer, as device views (spec §3).
///
/// Layouts, row-major: `k` bf16 [≥ len, Hkv, D] (post-RoPE keys), `c` f32
/// [≥ len, Hkv] (eviction scores), `kc` f32 [cap, Hkv, D], `p` f32 [cap,
/// Hkv]; cap (in windows) = `kc.len() / (Hkv·D)`, and for `p`
/// `p.len() / Hkv`.
#[derive(Debug)]
pub struct SeqSelectState<'a> {
    /// Post-RoPE K cache, bf16 [≥ len, Hkv, D]: read by the compression
    /// kernels only (selection alone may leave it out, e.g. with K offloaded).
    pub k: Option<CudaView<'a, Bf16>>,
    /// Eviction scores c, f32 [≥ len, Hkv]: read by the compression kernels
    /// to build `p` (NOSA); none for InfLLM-V2.
    pub c: Option<CudaView<'a, f32>>,
    /// Compressed keys Kc, f32 [cap, Hkv, D] (written by compression, read by scoring).
    pub kc: CudaViewMut<'a, f32>,
    /// Pooled eviction scores p, f32 [cap, Hkv] (written by compression,
    /// read by NOSA selection); none for InfLLM-V2.
    pub p: Option<CudaViewMut<'a, f32>>,
    /// T: tokens stored, the current one included (its query sits at T − 1).
    pub len: usize,
}

/// A batch of B sequences' selection state for one layer: device pointer
/// tables and lengths (i32 \[B\]) that every kernel here reads. It borrows the
/// buffers mutably for `'a`; build one per layer and step, or keep one and
/// update the lengths with [`SelectBatch::set_lens`].
#[derive(Debug)]
pub struct SelectBatch<'a> {
    kptr: Option<CudaSlice<u64>>,
    cptr: Option<CudaSlice<u64>>,
    kcptr: CudaSlice<u64>,
    pptr: Option<CudaSlice<u64>>,
    lens: CudaSlice<i32>,
    host_lens: Vec<usize>,
    /// Capacity of K (and c, when present) in tokens, per sequence.
    k_tokens: Vec<usize>,
    /// Capacity of Kc in windows, per sequence.
    kc_windows: Vec<usize>,
    /// Capacity of p in windows, per sequence.
    p_windows: Vec<usize>,
    kv_heads: usize,
    head_dim: usize,
    _borrow: std::marker::PhantomData<&'a mut ()>,
}

impl<'a> SelectBatch<'a> {
    /// Validates the sequences and uploads their pointer tables and lengths.
    ///
    /// Errors: [`Error::Input`] for an empty batch, Hkv = 0, head_dim 0 or
    /// above [`MAX_HEAD_DIM`], `k`, `c` or `p` given for some sequences
    /// only, a K or c view shorter than its `len`, or a length beyond i32;
    /// [`Error::Cuda`] on a copy failure. Window capacities are checked by
    /// each operation (they depend on the budget).
    pub fn new(
        gpu: &Gpu,
        mut seqs: Vec<SeqSelectState<'a>>,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        const OP: &str = "select batch";
        if seqs.is_empty() {
            return Err(Error::Input(format!("{OP}: no sequences")));
        }
        if kv_heads == 0 || head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(Error::Input(format!(
                "{OP}: Hkv {kv_heads} (≥ 1) and head_dim {head_dim} (1 … {MAX_HEAD_DIM}) unsupported"
            )));
        }
        let n = seqs.len();
        let count = |f: &dyn Fn(&SeqSelectState<'a>) -> bool| seqs.iter().filter(|s| f(s)).count();
        for (what, c) in [
            ("K", count(&|s| s.k.is_some())),
            ("c", count(&|s| s.c.is_some())),
            ("p", count(&|s| s.p.is_some())),
        ] {
            if c != 0 && c != n {
                return Err(Error::Input(format!(
                    "{OP}: {what} given for {c} of {n} sequences"
                )));
            }
        }
        let kvd = kv_heads * head_dim;
        let (mut kp, mut cp, mut kcp, mut pp) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut k_tokens, mut kc_windows, mut p_windows) = (Vec::new(), Vec::new(), Vec::new());
        let mut lens = Vec::with_capacity(n);
        for (i, s) in seqs.iter_mut().enumerate() {
            i32_dim(s.len, "sequence length")?;
            let mut ktok = usize::MAX;
            if let Some(k) = &s.k {
                ktok = k.len() / kvd;
                kp.push(dptr(gpu, k));
            }
            if let Some(c) = &s.c {
                ktok = ktok.min(c.len() / kv_heads);
                cp.push(dptr(gpu, c));
            }
            if ktok != usize::MAX && ktok < s.len {
                return Err(Error::Input(format!(
                    "{OP}: sequence {i} of {} tokens: its K/c views hold only {ktok} tokens",
                    s.len
                )));
            }
            k_tokens.push(ktok);
            kc_windows.push(s.kc.len() / kvd);
            kcp.push(dptr_mut(gpu, &mut s.kc));
            if let Some(p) = &mut s.p {
                p_windows.push(p.len() / kv_heads);
                pp.push(dptr_mut(gpu, p));
            } else {
                p_windows.push(0);
            }
            lens.push(s.len as i32);
        }
        let opt = |v: Vec<u64>| -> Result<Option<CudaSlice<u64>>> {
            if v.is_empty() {
                Ok(None)
            } else {
                Ok(Some(gpu.upload(&v)?))
            }
        };
        Ok(SelectBatch {
            kptr: opt(kp)?,
            cptr: opt(cp)?,
            kcptr: gpu.upload(&kcp)?,
            pptr: opt(pp)?,
            lens: gpu.upload(&lens)?,
            host_lens: seqs.iter().map(|s| s.len).collect(),
            k_tokens,
            kc_windows,
            p_windows,
            kv_heads,
            head_dim,
            _borrow: std::marker::PhantomData,
        })
    }

    /// Sets every sequence's length T (e.g. +1 after a decode step) and
    /// copies the lengths to the device (stream-ordered).
    ///
    /// Errors: [`Error::Input`] for a different number of lengths, a length
    /// past the K/c views, or beyond i32; [`Error::Cuda`] on a copy failure.
    pub fn set_lens(&mut self, gpu: &Gpu, lens: &[usize]) -> Result<()> {
        if lens.len() != self.host_lens.len() {
            return Err(Error::Input(format!(
                "select batch: {} lengths for {} sequences",
                lens.len(),
                self.host_lens.len()
            )));
        }
        let mut dev = Vec::with_capacity(lens.len());
        for (i, &l) in lens.iter().enumerate() {
            if l > self.k_tokens[i] {
                return Err(Error::Input(format!(
                    "select batch: sequence {i}: length {l} past its K/c views of {} tokens",
                    self.k_tokens[i]
                )));
            }
            dev.push(i32_dim(l, "sequence length")?);
        }
        gpu.stream()
            .memcpy_htod(&dev, &mut self.lens)
            .cuda("copying sequence lengths")?;
        self.host_lens = lens.to_vec();
        Ok(())
    }

    /// B.
    pub fn batch(&self) -> usize {
        self.host_lens.len()
    }

    /// Each sequence's length T.
    pub fn lens(&self) -> &[usize] {
        &self.host_lens
    }

    /// Hkv.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// D.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The largest Mc over the batch, after checking that each sequence's
    /// Mc fits the capacities named (`kc`, `p`).
    fn max_windows(&self, op: &str, budget: &Budget, kc: bool, p: bool) -> Result<usize> {
        let mut mx = 0;
        for (i, &l) in self.host_lens.iter().enumerate() {
            let mc = windows(budget, l);
            if kc && mc > self.kc_windows[i] {
                return Err(Error::Input(format!(
                    "{op}: sequence {i} of {l} tokens has {mc} windows, its Kc holds {}",
                    self.kc_windows[i]
                )));
            }
            if p && mc > self.p_windows[i] {
                return Err(Error::Input(format!(
                    "{op}: sequence {i} of {l} tokens has {mc} windows, its p holds {}",
                    self.p_windows[i]
                )));
            }
            mx = mx.max(mc);
        }
        Ok(mx)
    }
}

/// Completes the compressed windows (spec §3) that the last `new_tokens`
/// tokens of each sequence made whole: window i ∈ [Mc(T − new_tokens),
/// Mc(T)) gets Kc\[i\] = mean of K over tokens [16i, 16i+32) and, when the
/// batch carries c and p, p\[i\] = mean of c. T is each sequence's current
/// length (the new tokens included, already written to K and c).
/// `new_tokens` = 1 at decode; ≥ T rebuilds every window
/// ([`compress_prefill`]). Sums run over tokens in ascending order in f32,
/// as the CPU reference does (bitwise equal on the same inputs).
///
/// Errors: [`Error::Input`] when the batch has no K views, a bad budget, or
/// a sequence whose Mc(T) exceeds its Kc or p capacity; [`Error::Cuda`] on
/// a launch failure.
pub fn compress_append(
    gpu: &Gpu,
    batch: &SelectBatch<'_>,
    budget: &Budget,
    new_tokens: usize,
) -> Result<()> {
    const OP: &str = "compress_append";
    check_budget(OP, budget)?;
    let Some(kptr) = &batch.kptr else {
        return Err(Error::Input(format!("{OP}: the batch has no K views")));
    };
    let with_p = batch.cptr.is_some() && batch.pptr.is_some();
    batch.max_windows(OP, budget, true, with_p)?;
    let max_new = batch
        .host_lens
        .iter()
        .map(|&t| windows(budget, t) - windows(budget, t.saturating_sub(new_tokens)))
        .max()
        .unwrap_or(0);
    if max_new == 0 {
        return Ok(());
    }
    let n_new = i32::try_from(new_tokens).unwrap_or(i32::MAX);
    let (hk, d, st, ks) = (
        i32_dim(batch.kv_heads, "Hkv")?,
        i32_dim(batch.head_dim, "D")?,
        i32_dim(budget.kernel_stride, "kernel_stride")?,
        i32_dim(budget.kernel_size, "kernel_size")?,
    );
    let inv = 1.0 / budget.kernel_size as f32;
    let kp = dptr(gpu, kptr);
    let (cp, pp) = if with_p {
        (
            batch.cptr.as_ref().map_or(0, |c| dptr(gpu, c)),
            batch.pptr.as_ref().map_or(0, |p| dptr(gpu, p)),
        )
    } else {
        (0u64, 0u64)
    };
    let (kcp, lp) = (dptr(gpu, &batch.kcptr), dptr(gpu, &batch.lens));
    let f = gpu.function("compress_windows")?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid(max_new.min(COMPRESS_MAX_GRID_X), "windows")?,
            grid(batch.batch(), "B")?,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&kp)
        .arg(&cp)
        .arg(&kcp)
        .arg(&pp)
        .arg(&lp)
        .arg(&n_new)
        .arg(&hk)
        .arg(&d)
        .arg(&st)
        .arg(&ks)
        .arg(&inv)
        .arg(&0i32);
    // SAFETY: argument list matches kernels/compress.cu; every window written
    // lies below Mc(T) ≤ the Kc/p capacity and reads tokens < T ≤ the K/c views
    // (checked above and by SelectBatch).
    unsafe { b.launch(cfg) }.cuda(OP).map(drop)
}

/// Builds every compressed window of each sequence's current length T from
/// scratch (spec §3; after a prompt is in the K/c caches): Kc and p for
/// windows 0 … Mc(T) − 1. Same as [`compress_append`] with new_tokens ≥ T.
///
/// Errors: as [`compress_append`].
pub fn compress_prefill(gpu: &Gpu, batch: &SelectBatch<'_>, budget: &Budget) -> Result<()> {
    let all = batch.host_lens.iter().copied().max().unwrap_or(0);
    compress_append(gpu, batch, budget, all)
}

/// Device scratch of the query-aware scoring ([`window_scores`]): per
/// (sequence, KV head, query head) logits and per-tile softmax statistics,
/// and the window scores s, f32 [B, Hkv, w_stride]. Reusable across steps
/// and layers of the same shape; [`SelectWorkspace::ensure`] grows it.
#[derive(Debug)]
pub struct SelectWorkspace {
    logits: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    batch: usize,
    kv_heads: usize,
    group: usize,
    w_stride: usize,
}

impl SelectWorkspace {
    /// Scratch for `batch` sequences, `kv_heads` KV heads of `group` query
    /// heads each (G), and up to `max_windows` windows per sequence.
    ///
    /// Errors: [`Error::Input`] on a zero dimension; [`Error::Cuda`] when
    /// the allocation fails.
    pub fn new(
        gpu: &Gpu,
        batch: usize,
        kv_heads: usize,
        group: usize,
        max_windows: usize,
    ) -> Result<Self> {
        if batch == 0 || kv_heads == 0 || group == 0 {
            return Err(Error::Input(format!(
                "select workspace: B {batch}, Hkv {kv_heads}, G {group} must be ≥ 1"
            )));
        }
        let w_stride = max_windows.max(1).div_ceil(QA_TILE) * QA_TILE;
        let rows = batch * kv_heads;
        let ntiles = w_stride / QA_TILE;
        Ok(SelectWorkspace {
            logits: gpu.zeros(rows * group * w_stride)?,
            stats: gpu.zeros(rows * group * ntiles * 2)?,
            scores: gpu.zeros(rows * w_stride)?,
            batch,
            kv_heads,
            group,
            w_stride,
        })
    }

    /// Reallocates (to 1.5× the windows asked for) unless the workspace
    /// already fits this shape.
    ///
    /// Errors: as [`SelectWorkspace::new`].
    pub fn ensure(
        &mut self,
        gpu: &Gpu,
        batch: usize,
        kv_heads: usize,
        group: usize,
        max_windows: usize,
    ) -> Result<()> {
        if !self.fits(batch, kv_heads, group, max_windows) {
            *self = Self::new(gpu, batch, kv_heads, group, max_windows + max_windows / 2)?;
        }
        Ok(())
    }

    fn fits(&self, batch: usize, kv_heads: usize, group: usize, max_windows: usize) -> bool {
        self.batch == batch
            && self.kv_heads == kv_heads
            && self.group == group
            && self.w_stride >= max_windows
    }

    /// Window scores s, f32 [B, Hkv, w_stride] (row (b, h) at (b·Hkv + h)·w_stride;
    /// entries i < Mc of sequence b are valid after [`window_scores`]).
    pub fn scores(&self) -> &CudaSlice<f32> {
        &self.scores
    }

    /// Sets every entry of [`SelectWorkspace::scores`] to `v` (a check fills
    /// it with NaN to see that a kernel writes nothing past each row's Mc).
    ///
    /// Errors: [`Error::Cuda`] on a copy failure.
    pub fn fill_scores(&mut self, gpu: &Gpu, v: f32) -> Result<()> {
        let host = vec![v; self.scores.len()];
        gpu.stream()
            .memcpy_htod(&host, &mut self.scores)
            .cuda("filling the window scores")?;
        gpu.synchronize()
    }

    /// Entries per (sequence, KV head) row of [`SelectWorkspace::scores`]
    /// (a multiple of [`QA_TILE`]).
    pub fn w_stride(&self) -> usize {
        self.w_stride
    }
}

/// Query-aware window scores (spec §4.1) for one query token per sequence:
/// s[b, h, i] = Σ over the G query heads g of KV head h of
/// softmax_i(q_g · Kc[i, h] / √D), the softmax over all Mc(T_b) windows,
/// written to `ws.scores()`. Any G = `heads` / Hkv; D ≤ [`MAX_HEAD_DIM`].
///
/// - `q`: bf16, sequence b's H·D post-RoPE query values at b·`q_stride`
///   (query head h·G + g at offset (h·G + g)·D), as the attention kernels take it.
///
/// Errors: [`Error::Input`] when H is not a multiple of Hkv, q is too short
/// for its stride, a sequence's Mc exceeds its Kc capacity, or `ws` does
/// not fit (B, Hkv, G, max Mc); [`Error::Cuda`] on a launch failure.
#[allow(clippy::too_many_arguments)]
pub fn window_scores<Q: DevicePtr<Bf16>>(
    gpu: &Gpu,
    q: &Q,
    q_stride: usize,
    heads: usize,
    batch: &SelectBatch<'_>,
    budget: &Budget,
    ws: &mut SelectWorkspace,
) -> Result<()> {
    const OP: &str = "window_scores";
    check_budget(OP, budget)?;
    let (b, hk, d) = (batch.batch(), batch.kv_heads, batch.head_dim);
    if heads == 0 || !heads.is_multiple_of(hk) {
        return Err(Error::Input(format!(
            "{OP}: {heads} query heads is not a multiple of {hk} KV heads"
        )));
    }
    let g = heads / hk;
    let row = heads * d;
    if q_stride < row || q.len() < (b - 1) * q_stride + row {
        return Err(Error::Input(format!(
            "{OP}: q has {} elements at stride {q_stride}; {b} sequences of H·D = {row} need {}",
            q.len(),
            (b - 1) * q_stride + row
        )));
    }
    let mc = batch.max_windows(OP, budget, true, false)?;
    if !ws.fits(b, hk, g, mc) {
        return Err(Error::Input(format!(
            "{OP}: workspace for B {} Hkv {} G {} and {} windows; the call needs B {b} Hkv {hk} G {g} and {mc}",
            ws.batch, ws.kv_heads, ws.group, ws.w_stride
        )));
    }
    if mc == 0 {
        return Ok(());
    }
    let dims = ScoreDims {
        logits: dptr_mut(gpu, &mut ws.logits),
        stats: dptr_mut(gpu, &mut ws.stats),
        lens: dptr(gpu, &batch.lens),
        scores: dptr_mut(gpu, &mut ws.scores),
        rows: b,
        heads,
        kv_heads: hk,
        tiles: mc.div_ceil(QA_TILE),
        w_stride: ws.w_stride,
        budget: *budget,
    };
    launch_window_logits(
        gpu,
        &dims,
        dptr(gpu, q),
        q_stride,
        d,
        dptr(gpu, &batch.kcptr),
    )?;
    launch_window_scores(gpu, &dims)
}

/// Query-aware window scores (spec §4.1) of `lens.len()` query rows that
/// all read one sequence's `kc` — the rows of a prefill chunk, row b's query
/// seeing the first `lens[b]` tokens — with the prefill kernels `kernels`
/// chooses ([`PrefillScores`]: the cuBLAS logits of `qa_logits_shared_kc`
/// and `qa_window_scores`, or `qa_prefill_scores` on the tensor cores):
/// the values [`window_scores`] gives for the same rows, up to the
/// summation order of the dot products, written to `ws.scores()` (row b at
/// b·Hkv·w_stride).
///
/// - `q`: bf16 [rows, H, D] post-RoPE queries (contiguous rows);
/// - `kc`: f32 [≥ Mc(max lens), Hkv, D] compressed keys.
///
/// Errors: [`Error::Input`] when H is not a multiple of Hkv, `q` or `kc` is
/// too short, a length exceeds i32, `ws` does not fit (rows, Hkv, G, max
/// Mc), or the tensor-core kernel does not take the shape
/// ([`super::prefill_scores::prefill_scores_tc_supported`]); [`Error::Cuda`] on an allocation,
/// launch or cuBLAS failure.
#[allow(clippy::too_many_arguments)]
pub fn window_scores_shared_kc(
    gpu: &Gpu,
    q: &CudaSlice<Bf16>,
    heads: usize,
    kc: &CudaSlice<f32>,
    kv_heads: usize,
    head_dim: usize,
    lens: &[usize],
    budget: &Budget,
    kernels: PrefillScores,
    ws: &mut SelectWorkspace,
) -> Result<()> {
    const OP: &str = "window_scores_shared_kc";
    check_budget(OP, budget)?;
    let (n, hk, d) = (lens.len(), kv_heads, head_dim);
    if hk == 0 || heads == 0 || !heads.is_multiple_of(hk) || d == 0 || n == 0 {
        return Err(Error::Input(format!(
            "{OP}: {n} rows, H {heads}, Hkv {hk}, D {d}: need rows, D ≥ 1 and H a multiple of Hkv"
        )));
    }
    let mc = lens.iter().map(|&l| budget.windows(l)).max().unwrap_or(0);
    if q.len() < n * heads * d {
        return Err(Error::Input(format!(
            "{OP}: q has {} elements; {n} rows of H·D = {} need {}",
            q.len(),
            heads * d,
            n * heads * d
        )));
    }
    if kc.len() < mc * hk * d {
        return Err(Error::Input(format!(
            "{OP}: Kc has {} elements; {mc} windows of Hkv·D = {} need {}",
            kc.len(),
            hk * d,
            mc * hk * d
        )));
    }
    if !ws.fits(n, hk, heads / hk, mc) {
        return Err(Error::Input(format!(
            "{OP}: workspace for B {} Hkv {} G {} and {} windows; the call needs B {n} Hkv {hk} G {} and {mc}",
            ws.batch,
            ws.kv_heads,
            ws.group,
            ws.w_stride,
            heads / hk
        )));
    }
    if mc == 0 {
        return Ok(());
    }
    let lens_i32 = lens
        .iter()
        .map(|&l| i32_dim(l, "length"))
        .collect::<Result<Vec<_>>>()?;
    let lens_dev = gpu.upload(&lens_i32)?;
    let dims = ScoreDims {
        logits: dptr_mut(gpu, &mut ws.logits),
        stats: dptr_mut(gpu, &mut ws.stats),
        lens: dptr(gpu, &lens_dev),
        scores: dptr_mut(gpu, &mut ws.scores),
        rows: n,
        heads,
        kv_heads: hk,
        tiles: mc.div_ceil(QA_TILE),
        w_stride: ws.w_stride,
        budget: *budget,
    };
    if kernels != PrefillScores::Cublas {
        // SAFETY: written by qa_split_kc before the scoring kernel reads it.
        let parts = if kernels.splits_kc(heads / hk) {
            Some(
                unsafe {
                    gpu.stream()
                        .alloc::<f32>(split_kc_scratch_f32(hk, ws.w_stride, d))
                }
                .cuda(OP)?,
            )
        } else {
            None
        };
        launch_prefill_scores(
            gpu,
            &dims,
            dptr(gpu, q),
            heads * d,
            d,
            dptr(gpu, kc),
            kernels,
            parts.as_ref().map(|p| (dptr(gpu, p), mc)),
        )?;
        // the uploads live until the kernel that reads them is done
        return gpu.synchronize();
    }
    // SAFETY: written by qa_q_f32 before the GEMMs read it.
    let mut qf = unsafe {
        gpu.stream()
            .alloc::<f32>(shared_kc_scratch_f32(n, heads, d))
    }
    .cuda(OP)?;
    qa_logits_shared_kc(
        gpu,
        &dims,
        dptr(gpu, q),
        heads * d,
        d,
        dptr(gpu, kc),
        mc,
        dptr_mut(gpu, &mut qf),
    )?;
    launch_window_scores(gpu, &dims)?;
    // the uploads and scratch live until the kernels that read them are done
    gpu.synchronize()
}

/// Launches step 1a, `qa_window_logits` (kernels/select.cu): logits and
/// tile statistics of `d.rows` rows, row b's queries (bf16 H·D values) at
/// `q` + b·`q_stride` elements, its Kc (f32 [cap, Hkv, D]) at the address
/// in `kcptr` (u64 [rows] on the device).
///
/// Errors: [`Error::Input`] when a dimension exceeds i32 or the shared
/// memory does not fit; [`Error::Cuda`] on a launch failure.
pub(crate) fn launch_window_logits(
    gpu: &Gpu,
    d: &ScoreDims,
    q: u64,
    q_stride: usize,
    head_dim: usize,
    kcptr: u64,
) -> Result<()> {
    let [h_, hk_, wst, nt, st, ks] = d.i32s()?;
    let (qs, d_) = (i32_dim(q_stride, "q_stride")?, i32_dim(head_dim, "D")?);
    let g = d.heads / d.kv_heads.max(1);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let f1 = gpu.function("qa_window_logits")?;
    let smem1 = ensure_smem(
        gpu,
        f1,
        qa_logits_smem_bytes(g, head_dim),
        0,
        "qa_window_logits",
    )?;
    let cfg1 = LaunchConfig {
        grid_dim: d.grid()?,
        block_dim: (QA_THREADS, 1, 1),
        shared_mem_bytes: smem1,
    };
    let mut l1 = gpu.stream().launch_builder(f1);
    l1.arg(&q)
        .arg(&qs)
        .arg(&kcptr)
        .arg(&d.lens)
        .arg(&d.logits)
        .arg(&d.stats)
        .arg(&h_)
        .arg(&hk_)
        .arg(&d_)
        .arg(&wst)
        .arg(&nt)
        .arg(&st)
        .arg(&ks)
        .arg(&scale);
    // SAFETY: argument list matches qa_window_logits in kernels/select.cu; the
    // caller guarantees each row's Kc holds ≥ Mc(lens[b]) windows and the
    // buffers the sizes ScoreDims documents.
    unsafe { l1.launch(cfg1) }
        .cuda("qa_window_logits")
        .map(drop)
}

/// Shapes and device addresses of step 1b (`qa_window_scores`) and of the
/// shared-Kc step 1a: `rows` rows of `heads` query heads over `kv_heads` KV
/// heads; `logits` f32 [rows, H, w_stride], `stats` f32 [rows, H, w_stride
/// / QA_TILE, 2], `scores` f32 [rows, Hkv, w_stride], `lens` i32 [rows]
/// (the tokens each row's query sees); `tiles` = ⌈max Mc / QA_TILE⌉.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScoreDims {
    pub(crate) logits: u64,
    pub(crate) stats: u64,
    pub(crate) lens: u64,
    pub(crate) scores: u64,
    pub(crate) rows: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) tiles: usize,
    pub(crate) w_stride: usize,
    pub(crate) budget: Budget,
}

impl ScoreDims {
    /// (H, Hkv, w_stride, tiles of w_stride, kernel_stride, kernel_size) as
    /// the kernels take them.
    pub(crate) fn i32s(&self) -> Result<[i32; 6]> {
        Ok([
            i32_dim(self.heads, "H")?,
            i32_dim(self.kv_heads, "Hkv")?,
            i32_dim(self.w_stride, "w_stride")?,
            i32_dim(self.w_stride / QA_TILE, "tiles")?,
            i32_dim(self.budget.kernel_stride, "kernel_stride")?,
            i32_dim(self.budget.kernel_size, "kernel_size")?,
        ])
    }

    pub(crate) fn grid(&self) -> Result<(u32, u32, u32)> {
        Ok((
            grid(self.tiles, "tiles")?,
            grid(self.kv_heads, "Hkv")?,
            grid(self.rows, "rows")?,
        ))
    }
}

/// Launches step 1b, `qa_window_scores` (kernels/select.cu), on the
/// logits and tile statistics step 1a wrote.
///
/// Errors: [`Error::Input`] when a dimension exceeds i32; [`Error::Cuda`] on
/// a launch failure.
pub(crate) fn launch_window_scores(gpu: &Gpu, d: &ScoreDims) -> Result<()> {
    let [h_, hk_, wst, nt, st, ks] = d.i32s()?;
    let g = d.heads / d.kv_heads.max(1);
    let f2 = gpu.function("qa_window_scores")?;
    let smem2 = ensure_smem(gpu, f2, 2 * g * 4, 0, "qa_window_scores")?;
    let cfg2 = LaunchConfig {
        grid_dim: d.grid()?,
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem2,
    };
    let mut l2 = gpu.stream().launch_builder(f2);
    l2.arg(&d.logits)
        .arg(&d.stats)
        .arg(&d.lens)
        .arg(&d.scores)
        .arg(&h_)
        .arg(&hk_)
        .arg(&wst)
        .arg(&nt)
        .arg(&st)
        .arg(&ks);
    // SAFETY: argument list matches qa_window_scores in kernels/select.cu; it
    // reads what step 1a wrote for windows < Mc of each row; the caller sized
    // the buffers as ScoreDims documents.
    unsafe { l2.launch(cfg2) }
        .cuda("qa_window_scores")
        .map(drop)
}

/// Rows of one sequence from which window scoring computes its logits with
/// cuBLAS (`qa_logits_shared_kc`) instead of `qa_window_logits`: a prefill
/// chunk reads one Kc for all its rows, and a GEMM reads each Kc tile once
/// for many rows where the kernel reads it once per row.
pub const QA_GEMM_MIN_ROWS: usize = 16;

/// f32 elements of the scratch `qa_logits_shared_kc` needs for `rows`
/// rows of `heads` query heads and head dim `head_dim`: the widened
/// queries, f32 [rows, H, D].
pub fn shared_kc_scratch_f32(rows: usize, heads: usize, head_dim: usize) -> usize {
    rows * heads * head_dim
}

/// Step 1a for `d.rows` rows that all read one Kc (the rows of a prefill
/// chunk, spec §4.1): logits[b, h, g, w] = (q_g · Kc[w, h]) / √D for the
/// windows w < `mc` (the most any row has; a row's entries past its own Mc
/// are computed but never read), as one GEMM per KV head over its G query
/// heads (cuBLAS, strided batched), then the tile statistics
/// (`qa_tile_stats`): an f32 SGEMM on the widened queries, no TF32. Same
/// values as `qa_window_logits` up to the summation order of the dot
/// products. (A bf16 tensor-core GEMM over the query three times against
/// Kc split into three exact bf16 parts passed the same checks and was
/// 3.6–5.6 % slower in NOSA-8B sparse prefill on the H200:
/// benches/results/prefill_qa_logits_bf16x3_vs_f32_nosa8b_b1_h200_2026-12-01_b4c5685/.)
///
/// - `q`: bf16 queries, row b's H·D values at b·`q_stride`;
/// - `kc`: f32 [≥ mc, Hkv, `head_dim`] compressed keys of the sequence;
/// - `qf`: scratch of [`shared_kc_scratch_f32`] f32 elements (for the
///   rows, H and D).
///
/// Errors: [`Error::Input`] when a dimension exceeds i32; [`Error::Cuda`] on
/// a launch or cuBLAS failure.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qa_logits_shared_kc(
    gpu: &Gpu,
    d: &ScoreDims,
    q: u64,
    q_stride: usize,
    head_dim: usize,
    kc: u64,
    mc: usize,
    qf: u64,
) -> Result<()> {
    if mc == 0 || d.rows == 0 {
        return Ok(());
    }
    let (hq, hk, dh) = (d.heads, d.kv_heads, head_dim);
    let g = hq / hk.max(1);
    let hd = hq * dh;
    let (qs, n_, hd_) = (
        i32_dim(q_stride, "q_stride")?,
        i32_dim(d.rows, "rows")?,
        i32_dim(hd, "H·D")?,
    );
    let f0 = gpu.function("qa_q_f32")?;
    let cfg0 = LaunchConfig {
        grid_dim: (grid((d.rows * hd).div_ceil(256).min(8192), "blocks")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l0 = gpu.stream().launch_builder(f0);
    l0.arg(&q).arg(&qs).arg(&qf).arg(&n_).arg(&hd_);
    // SAFETY: argument list matches qa_q_f32 in kernels/select.cu; q holds
    // rows rows at q_stride ≥ H·D, qf rows·H·D f32 (the caller's contract).
    unsafe { l0.launch(cfg0) }.cuda("qa_q_f32")?;
    let (m_, k_) = (i32_dim(mc, "windows")?, i32_dim(dh, "D")?);
    let (lda, ldb, ldc) = (
        i32_dim(hk * dh, "Hkv·D")?,
        i32_dim(hd, "H·D")?,
        i32_dim(hq * d.w_stride, "H·w_stride")?,
    );
    let (alpha, beta) = (1.0 / (dh as f32).sqrt(), 0.0f32);
    for h in 0..hk {
        // Column-major: C[w, b] (ldc = H·w_stride) = Kc_h[w, :] · qf[b, hG + g, :],
        // op(A) = Aᵀ of Kc_h seen as [D, windows] (lda = Hkv·D), B = qf seen as
        // [D, rows] (ldb = H·D); batch g: B and C advance by D and w_stride.
        // SAFETY: Kc holds ≥ mc windows of Hkv·D, qf rows·H·D and the logits
        // rows·H·w_stride f32 (w_stride ≥ mc); alpha and beta are host f32 in
        // the default pointer mode; the handle is bound to the GPU's stream.
        unsafe {
            cudarc::cublas::result::sgemm_strided_batched(
                *gpu.blas().handle(),
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                m_,
                n_,
                k_,
                &alpha,
                (kc + (h * dh * 4) as u64) as *const f32,
                lda,
                0,
                (qf + (h * g * dh * 4) as u64) as *const f32,
                ldb,
                dh as i64,
                &beta,
                (d.logits + (h * g * d.w_stride * 4) as u64) as *mut f32,
                ldc,
                d.w_stride as i64,
                i32_dim(g, "G")?,
            )
        }
        .cuda(&format!(
            "cublasSgemmStridedBatched window logits [{mc} windows, {} rows, D {dh}] KV head {h}",
            d.rows
        ))?;
    }
    qa_tile_stats(gpu, d)
}

/// The tile statistics of the logits just written (`qa_tile_stats`).
fn qa_tile_stats(gpu: &Gpu, d: &ScoreDims) -> Result<()> {
    let [h_, hk_, wst, nt, st, ks] = d.i32s()?;
    let f1 = gpu.function("qa_tile_stats")?;
    let cfg1 = LaunchConfig {
        grid_dim: d.grid()?,
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l1 = gpu.stream().launch_builder(f1);
    l1.arg(&d.logits)
        .arg(&d.lens)
        .arg(&d.stats)
        .arg(&h_)
        .arg(&hk_)
        .arg(&wst)
        .arg(&nt)
        .arg(&st)
        .arg(&ks);
    // SAFETY: argument list matches qa_tile_stats in kernels/select.cu; it
    // reads the logits just written for windows < Mc of each row.
    unsafe { l1.launch(cfg1) }.cuda("qa_tile_stats").map(drop)
}

/// Pooled block scores as the selection saw them, before forcing (for
/// checks and debugging): r and e, f32 [B, Hkv, nb_stride]; row (b, h)
/// entries m < q_b + 1 are written, −∞ for a block without windows (and
/// for e in InfLLM-V2 mode).
#[derive(Debug)]
pub struct PooledScores {
    /// Pooled query-aware scores r (spec §3–§4.1).
    pub r: CudaSlice<f32>,
    /// Pooled eviction scores e (spec §4.2).
    pub e: CudaSlice<f32>,
    /// Entries per (sequence, KV head) row.
    pub nb_stride: usize,
}

impl PooledScores {
    /// NaN-filled buffers for `batch` × `kv_heads` rows of `nb_stride` blocks.
    ///
    /// Errors: [`Error::Cuda`] on an allocation failure.
    pub fn new(gpu: &Gpu, batch: usize, kv_heads: usize, nb_stride: usize) -> Result<Self> {
        let n = batch * kv_heads * nb_stride;
        Ok(PooledScores {
            r: gpu.upload(&vec![f32::NAN; n])?,
            e: gpu.upload(&vec![f32::NAN; n])?,
            nb_stride,
        })
    }
}

/// Block selection from window scores (spec §3–§4 steps 2–7), per
/// (sequence b, KV head h), for the query at t = T_b − 1 in block q = t div
/// block_size:
/// r = pooled `scores` (max over windows [4m−1, 4m+3] ∩ [0, Mc), −∞ if
/// none), e = pooled p; sink, window and current blocks forced (+∞);
/// NOSA: the `shortlist` highest r get e = +∞, then the S = `attended`
/// highest e; InfLLM-V2: the S highest r; every block when q + 1 ≤ S.
/// f32 ranking, ties to the lower block index, NaN as −∞ — exactly
/// [`crate::model::select::select`] on the same r and e.
///
/// Writes `sel` i32 [B, Hkv, s_max] (ascending block ids, then −1) and
/// `nsel` i32 [B, Hkv] (count, min(q + 1, S)); ready for
/// [`BlockSelection::from_device`] with this s_max. `pooled`, if given,
/// receives r and e. A sequence with more blocks than the launch is sized
/// for (its device length past `batch`'s host lengths) gets an empty row
/// and is reported to `err` ([`DeviceErrorKind::SelectBlocksCap`](crate::cuda::device_error::DeviceErrorKind::SelectBlocksCap));
/// [`ErrorSink::NONE`] reports nothing.
///
/// - `scores`: f32 [B, Hkv, w_stride] window scores (e.g.
///   [`SelectWorkspace::scores`] after [`window_scores`]), w_stride ≥ Mc.
///
/// Errors: [`Error::Input`] on a bad budget, s_max < S, wrong `sel`/`nsel`
/// sizes, `scores` too short, a NOSA rule without p in the batch, a
/// sequence whose Mc exceeds its p capacity, `pooled` rows shorter than the
/// blocks, or more blocks than fit in shared memory (8 bytes per block:
/// about 29,000 blocks = 1.8M tokens on an H200); [`Error::Cuda`] on a
/// launch failure.
#[allow(clippy::too_many_arguments)]
pub fn select_from_scores<S, O, N>(
    gpu: &Gpu,
    batch: &SelectBatch<'_>,
    budget: &Budget,
    rule: SelectionRule,
    scores: &S,
    w_stride: usize,
    sel: &mut O,
    nsel: &mut N,
    s_max: usize,
    pooled: Option<&mut PooledScores>,
    err: ErrorSink,
) -> Result<()>
where
    S: DevicePtr<f32>,
    O: DevicePtrMut<i32>,
    N: DevicePtrMut<i32>,
{
    const OP: &str = "select_from_scores";
    check_budget(OP, budget)?;
    let (b, hk) = (batch.batch(), batch.kv_heads);
    let nosa = rule == SelectionRule::Nosa;
    if nosa && batch.pptr.is_none() {
        return Err(Error::Input(format!(
            "{OP}: NOSA selection needs the pooled eviction scores p in the batch"
        )));
    }
    if s_max < budget.attended {
        return Err(Error::Input(format!(
            "{OP}: s_max {s_max} below the budget S = {}",
            budget.attended
        )));
    }
    if sel.len() != b * hk * s_max || nsel.len() != b * hk {
        return Err(Error::Input(format!(
            "{OP}: sel has {} and nsel {} elements; B {b} × Hkv {hk} × s_max {s_max} needs {} and {}",
            sel.len(),
            nsel.len(),
            b * hk * s_max,
            b * hk
        )));
    }
    let mc = batch.max_windows(OP, budget, false, nosa)?;
    if w_stride < mc || scores.len() < b * hk * w_stride {
        return Err(Error::Input(format!(
            "{OP}: scores of {} elements at row stride {w_stride}; B {b} × Hkv {hk} rows of ≥ {mc} windows needed",
            scores.len()
        )));
    }
    let nb_max = batch
        .host_lens
        .iter()
        .map(|&l| blocks(budget, l))
        .max()
        .unwrap_or(0)
        .max(1);
    let (pr, pe, nb_stride) = match pooled {
        Some(ps) => {
            if ps.nb_stride < nb_max
                || ps.r.len() < b * hk * ps.nb_stride
                || ps.e.len() < b * hk * ps.nb_stride
            {
                return Err(Error::Input(format!(
                    "{OP}: pooled-score rows of {} for {nb_max} blocks (B {b} × Hkv {hk})",
                    ps.nb_stride
                )));
            }
            (
                dptr_mut(gpu, &mut ps.r),
                dptr_mut(gpu, &mut ps.e),
                ps.nb_stride,
            )
        }
        None => (0u64, 0u64, 0usize),
    };
    let args = SelectBlocksArgs {
        scores: dptr(gpu, scores),
        p: if nosa {
            batch.pptr.as_ref().map_or(0, |p| dptr(gpu, p))
        } else {
            0
        },
        lens: dptr(gpu, &batch.lens),
        sel: dptr_mut(gpu, sel),
        nsel: dptr_mut(gpu, nsel),
        pooled_r: pr,
        pooled_e: pe,
        w_stride,
        s_max,
        nb_stride,
        blocks: nb_max,
        kv_heads: hk,
        rows: b,
        nosa,
        win_lens: 0,
        err,
    };
    // SAFETY: every size checked above (blocks ≤ nb_max, windows ≤ w_stride
    // and the p capacity, pooled rows of nb_stride, lists of B·Hkv·s_max).
    unsafe { launch_select_blocks(gpu, budget, &args, OP) }
}

/// The whole decode-time selection of one layer (spec §4): [`window_scores`]
/// into `ws` (grown with [`SelectWorkspace::ensure`] when needed), then
/// [`select_from_scores`] into fresh buffers, returned as a
/// [`BlockSelection`] with s_max = S for
/// [`attention_sparse_decode`](super::attention_sparse_decode). `err`: as
/// for [`select_from_scores`].
///
/// Errors: as [`window_scores`] and [`select_from_scores`].
#[allow(clippy::too_many_arguments)]
pub fn select_decode<Q: DevicePtr<Bf16>>(
    gpu: &Gpu,
    q: &Q,
    q_stride: usize,
    heads: usize,
    batch: &SelectBatch<'_>,
    budget: &Budget,
    rule: SelectionRule,
    ws: &mut SelectWorkspace,
    err: ErrorSink,
) -> Result<BlockSelection> {
    let (b, hk) = (batch.batch(), batch.kv_heads);
    if heads == 0 || !heads.is_multiple_of(hk) {
        return Err(Error::Input(format!(
            "select_decode: {heads} query heads is not a multiple of {hk} KV heads"
        )));
    }
    let mc = batch.max_windows("select_decode", budget, true, false)?;
    ws.ensure(gpu, b, hk, heads / hk, mc)?;
    window_scores(gpu, q, q_stride, heads, batch, budget, ws)?;
    let s_max = budget.attended;
    // SAFETY: select_blocks writes every element of both buffers.
    let what = format!("allocating the block selection of {b} rows × {hk} KV heads × S = {s_max}");
    let mut sel: CudaSlice<i32> = unsafe { gpu.stream().alloc(b * hk * s_max) }.cuda(&what)?;
    let mut nsel: CudaSlice<i32> = unsafe { gpu.stream().alloc(b * hk) }.cuda(&what)?;
    let w_stride = ws.w_stride;
    select_from_scores(
        gpu, batch, budget, rule, &ws.scores, w_stride, &mut sel, &mut nsel, s_max, None, err,
    )?;
    BlockSelection::from_device(sel, nsel, b, hk, s_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_threads_take_128_256_or_512() {
        assert_eq!(select_threads_from("128"), Some(128));
        assert_eq!(select_threads_from(" 256 "), Some(256));
        assert_eq!(select_threads_from("512"), Some(512));
        for bad in ["", "64", "100", "1024", "two hundred"] {
            assert_eq!(select_threads_from(bad), None, "{bad}");
        }
        // by blocks per SM: a decode step of 16 rows x 8 KV heads on 132 SMs;
        // a prefill chunk of 1,024 rows x 2
        assert_eq!(threads_for(None, 16 * 8, 132), SELECT_THREADS);
        assert_eq!(threads_for(None, 1024 * 2, 132), SELECT_THREADS_MANY);
        assert_eq!(threads_for(None, 4 * 132 - 1, 132), SELECT_THREADS);
        assert_eq!(threads_for(None, 4 * 132, 132), SELECT_THREADS_MANY);
        assert_eq!(threads_for(None, 1, 0), SELECT_THREADS);
        assert_eq!(threads_for(Some(256), 1024 * 2, 132), 256);
        assert_eq!(threads_for(Some(128), 1, 132), 128);
    }
}
