//! Window scores of a prefill chunk on the tensor cores (spec/nosa-model.md
//! §4.1): the rows of one chunk share one Kc, so their query-aware window
//! scores s[i, h] = Σ_g softmax_i(q_g·Kc[i, h]/√D) are a matrix product
//! followed by a softmax per row and head. [`PrefillScores`] names the
//! kernels that compute them (`kernels/qa_prefill.cu`, or the cuBLAS path
//! of [`super::select`]); `launch_prefill_scores` launches the chosen
//! one over the `ScoreDims` of a chunk.
//!
//! Kc is kept in f32 (see [`super::select`]); the tensor-core kernels split
//! it into bf16 parts: three whose sum is the f32 value (the logits equal
//! the CPU reference's to f32 rounding), or the first two (each Kc value
//! within 2^-16 of itself; the default, [`DEFAULT_PREFILL_SCORES`];
//! README's prefill section gives what that costs in KL and speed).

use super::select::{ensure_smem, ScoreDims};
use crate::cuda::context::{grid, i32_dim, CudaResultExt};
use crate::cuda::Gpu;
use crate::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Which kernels score the windows of a prefill chunk's rows (rows that
/// share one Kc, spec §4.1): read once from `SPARDA_PREFILL_SCORES`
/// ([`prefill_scores`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillScores {
    /// `cublas`: the f32 logits of all rows and windows as SGEMMs into
    /// device memory (`qa_logits_shared_kc`), then the tile statistics and
    /// `qa_window_scores` over them; the path of head dims and groups the
    /// tensor-core kernel does not take.
    Cublas,
    /// `tensor-core`: the logits on the tensor cores from Kc split into
    /// three exact bf16 parts and the softmax and scores in the same kernel,
    /// with no logits in device memory (kernels/qa_prefill.cu); head dims
    /// 64, 80 and 128 and 1 ≤ G ≤ 64 (others take `Cublas`):
    /// `qa_prefill_scores`, 16 M-rows per warp, the heads summed through a
    /// shared-memory P tile.
    TensorCore,
    /// `tensor-core-m32`: for G of 4, 8 and 16 `qa_prefill_scores_m32_g*`
    /// (32 M-rows per warp, pairs of warps on half tiles: each shared-memory
    /// B fragment serves two A tiles; the heads summed in registers), other
    /// G as `tensor-core`. Selectable for comparison (README's prefill
    /// section records its speed: within noise of `tensor-core`).
    TensorCoreM32,
    /// `tensor-core-split`: as `tensor-core-m32`, with Kc split into its
    /// three bf16 parts once per chunk (`qa_split_kc`, into a scratch of
    /// [`split_kc_scratch_f32`]) and the part tiles copied into shared
    /// memory by cp.async, the next tile's during this tile's products
    /// (`qa_prefill_scores_m32s_g*`; other G as `tensor-core`). The fastest
    /// choice with exact logits; its softmax, like every m32 kernel's, is in
    /// base 2 unless `SPARDA_NVRTC_OPTIONS=-DQP_FAST_EXP=0`.
    TensorCoreSplit,
    /// `tensor-core-bf16x2`: the
    /// logits from the first two bf16 parts of Kc only (each value within
    /// 2^-16 of itself instead of exact; a third fewer tensor-core
    /// products): for G of 4, 8 and 16 `tensor-core-split`'s kernels on two
    /// parts (`qa_split_kc`, then `qa_prefill_scores_m32s_bf16x2_g*`), other
    /// G `qa_prefill_scores_bf16x2_d*` (the `tensor-core` kernel on two
    /// parts). Scores within 1e-5 relative L2 of the CPU reference's
    /// (gpu-check's select group); on SmolLM2 at 8K (G 3) KL 3.1e-4 mean
    /// against the cuBLAS f32 logits' selections, where the exact kernels'
    /// summation order alone gives 1.6e-4 (README, prefill section).
    TensorCoreBf16x2,
    /// `tensor-core-wgmma` (the default, [`DEFAULT_PREFILL_SCORES`]):
    /// `tensor-core-bf16x2`'s scores (Kc's first two bf16 parts, split once
    /// per chunk; base-2 softmax) with the products on Hopper's warpgroup
    /// MMA (`qa_prefill_scores_wg_g*`, sm_90a: two warpgroups of 64 M-rows
    /// per block, each multiplying whole 64-window tiles from shared memory
    /// in the 128-byte swizzle, the heads summed by a shuffle tree) where
    /// [`prefill_scores_wg_takes`] the device, D and G; elsewhere
    /// `tensor-core-bf16x2`'s kernels (for G other than 4, 8, 16 those are
    /// the 16-M-row two-part kernel with expf and no split of Kc), so off a
    /// compute capability 9.0 device it is `tensor-core-bf16x2`.
    TensorCoreWgmma,
}

impl PrefillScores {
    /// The [`ENV_PREFILL_SCORES`] value that chooses `self`
    /// ([`parse_prefill_scores`] reads it back).
    pub fn name(self) -> &'static str {
        match self {
            PrefillScores::Cublas => "cublas",
            PrefillScores::TensorCore => "tensor-core",
            PrefillScores::TensorCoreM32 => "tensor-core-m32",
            PrefillScores::TensorCoreSplit => "tensor-core-split",
            PrefillScores::TensorCoreBf16x2 => "tensor-core-bf16x2",
            PrefillScores::TensorCoreWgmma => "tensor-core-wgmma",
        }
    }

    /// Whether these kernels split Kc into its bf16 parts once per chunk
    /// at `group` query heads per KV head (`qa_split_kc` before
    /// `qa_prefill_scores_m32s{,_bf16x2}_g*` or `qa_prefill_scores_wg_g*`):
    /// [`PrefillScores::TensorCoreSplit`], [`PrefillScores::TensorCoreBf16x2`]
    /// and [`PrefillScores::TensorCoreWgmma`] where [`prefill_scores_m32_takes`] G. Only then does
    /// `launch_prefill_scores` take a scratch of [`split_kc_scratch_f32`].
    pub fn splits_kc(self, group: usize) -> bool {
        matches!(
            self,
            PrefillScores::TensorCoreSplit
                | PrefillScores::TensorCoreBf16x2
                | PrefillScores::TensorCoreWgmma
        ) && prefill_scores_m32_takes(group)
    }

    /// Kc parts the tensor-core kernel sums (0 for [`PrefillScores::Cublas`]).
    pub fn kc_parts(self) -> usize {
        match self {
            PrefillScores::Cublas => 0,
            PrefillScores::TensorCore
            | PrefillScores::TensorCoreM32
            | PrefillScores::TensorCoreSplit => 3,
            PrefillScores::TensorCoreBf16x2 | PrefillScores::TensorCoreWgmma => 2,
        }
    }
}

/// The window-scoring kernels when `SPARDA_PREFILL_SCORES` is unset: the
/// fastest choice checked on a GPU (README, prefill section).
/// [`PrefillScores::TensorCoreWgmma`] ran synthetic NOSA-8B (G 16, D 128)
/// sparse prefill at 127K at 18,891 / 18,846 tokens/s on an H100 against
/// 17,126 / 17,176 for [`PrefillScores::TensorCoreBf16x2`] in the same call
/// (08fe5fa, alternating rounds). Where the wg kernel does not take the
/// device or shape ([`prefill_scores_wg_takes`]: off compute capability
/// 9.0, at D 80, at G other than 4, 8, 16) it runs the bf16x2 kernels, so
/// there the default is `tensor-core-bf16x2`. Where it does, it computes
/// the scores of `tensor-core-bf16x2`'s G 4/8/16 kernels (Kc's first two
/// bf16 parts, base-2 softmax) in another summation order: gpu-check's
/// select group puts both within 3.1e-7 relative L2 of the CPU reference,
/// and gpu-check-e2e's tensor-core prefill cases pass with it.
/// The bf16x2 kernels ran at 21,358 tokens/s at 32K and 16,528 at 127K on
/// an H100 with the base-2 softmax, against 20,385 and 14,486 for the exact
/// [`PrefillScores::TensorCoreSplit`] with expf in the same call (157d6fe).
/// Quality on real weights is recorded for the G 3 path (SmolLM2 at 8K, the
/// 16-M-row two-part kernel, expf): selections cost KL 3.1e-4 against the
/// cuBLAS logits', where the exact kernels' summation order alone gives
/// 1.6e-4. The G 4/8/16 paths (base 2) are checked against the CPU
/// reference (gpu-check's select group, and end to end on a synthetic G 8
/// model); no real-weights model with those G was at hand.
pub const DEFAULT_PREFILL_SCORES: PrefillScores = PrefillScores::TensorCoreWgmma;

/// The environment variable that chooses [`PrefillScores`].
pub const ENV_PREFILL_SCORES: &str = "SPARDA_PREFILL_SCORES";

/// Reads a [`ENV_PREFILL_SCORES`] value: `cublas`, `tensor-core`,
/// `tensor-core-m32`, `tensor-core-split`, `tensor-core-bf16x2` or
/// `tensor-core-wgmma`.
///
/// Errors: [`Error::Input`] naming the variable, the value and the choices.
pub fn parse_prefill_scores(v: &str) -> Result<PrefillScores> {
    match v.trim() {
        "cublas" => Ok(PrefillScores::Cublas),
        "tensor-core" => Ok(PrefillScores::TensorCore),
        "tensor-core-m32" => Ok(PrefillScores::TensorCoreM32),
        "tensor-core-split" => Ok(PrefillScores::TensorCoreSplit),
        "tensor-core-bf16x2" => Ok(PrefillScores::TensorCoreBf16x2),
        "tensor-core-wgmma" => Ok(PrefillScores::TensorCoreWgmma),
        _ => Err(Error::Input(format!(
            "{ENV_PREFILL_SCORES}={v}: give cublas, tensor-core, tensor-core-m32, tensor-core-split, tensor-core-bf16x2 or tensor-core-wgmma (the kernels that score a prefill chunk's windows)"
        ))),
    }
}

/// The prefill window-scoring kernels of this process: `$SPARDA_PREFILL_SCORES`
/// when set to a valid value ([`parse_prefill_scores`]), else
/// [`DEFAULT_PREFILL_SCORES`]; another value is refused with a one-line
/// warning.
pub fn prefill_scores() -> PrefillScores {
    static CHOICE: std::sync::OnceLock<PrefillScores> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var(ENV_PREFILL_SCORES) {
        Err(_) => DEFAULT_PREFILL_SCORES,
        Ok(v) => parse_prefill_scores(&v).unwrap_or_else(|e| {
            eprintln!(
                "warning: {e}; scoring prefill windows with the default, {}",
                DEFAULT_PREFILL_SCORES.name()
            );
            DEFAULT_PREFILL_SCORES
        }),
    })
}

/// Whether `qa_prefill_scores` takes head dim `head_dim` and `group` query
/// heads per KV head: D of 64, 80 or 128 (its entry points) and 1 ≤ G ≤ 64
/// (`QP_MAX_G`: at least two rows per block).
pub fn prefill_scores_tc_supported(head_dim: usize, group: usize) -> bool {
    matches!(head_dim, 64 | 80 | 128) && (1..=QP_MAX_G).contains(&group)
}

/// (row, query head) pairs per `qa_prefill_scores` block (8 warps of 16).
const QP_BM: usize = 128;
/// Threads per `qa_prefill_scores` block: a warp per 16 M-rows, as the
/// kernel's QP_THREADS = 32 * QP_WARPS.
const QP_THREADS: u32 = (QP_BM / 16 * 32) as u32;
/// The most query heads per KV head `qa_prefill_scores` takes (a block
/// holds at least 2 rows).
const QP_MAX_G: usize = 64;

/// Whether [`PrefillScores::TensorCoreM32`] takes `qa_prefill_scores_m32`
/// (32 M-rows per warp) for `group` query heads per KV head: G of 4, 8 or
/// 16, its entry points (G a compile-time constant; a row's heads lie in
/// one A tile of a warp).
pub fn prefill_scores_m32_takes(group: usize) -> bool {
    matches!(group, 4 | 8 | 16)
}

/// Whether [`PrefillScores::TensorCoreWgmma`] takes `qa_prefill_scores_wg`
/// on a device of architecture `arch` (as [`crate::cuda::Gpu::info`]
/// names it) at head dim `head_dim` and `group` query heads per KV head:
/// wgmma ([`crate::cuda::context::has_wgmma`]: compute capability 9.0),
/// D of 64 or 128 (whole rows of the 128-byte swizzle) and G of 4, 8 or 16
/// ([`prefill_scores_m32_takes`]). Elsewhere it takes the bf16x2 kernels.
pub fn prefill_scores_wg_takes(arch: &str, head_dim: usize, group: usize) -> bool {
    crate::cuda::context::has_wgmma(arch)
        && matches!(head_dim, 64 | 128)
        && prefill_scores_m32_takes(group)
}

/// Threads per `qa_prefill_scores_m32` block: 8 warps, pairs of warps on
/// 32 M-rows (the kernel's QP_M32_THREADS).
const QP_M32_THREADS: u32 = 256;

/// Dynamic shared memory of `qa_prefill_scores_m32` at head dim `d` with
/// `parts` Kc parts (3, or 2 for the `m32s_bf16x2` kernels), bytes: the
/// bf16 part tiles of 64 windows (rows of d + 8), once for the `m32`
/// kernels, twice for the `m32s` kernels (`split`: two tiles in flight); no
/// P tile (kernels/qa_prefill.cu).
pub fn qa_prefill_m32_smem_bytes(d: usize, parts: usize, split: bool) -> usize {
    parts * 64 * (d + 8) * 2 * if split { 2 } else { 1 }
}

/// Threads per `qa_prefill_scores_wg` block: two warpgroups of 64 M-rows
/// (the kernel's QW_THREADS).
const QW_THREADS: u32 = 256;

/// Dynamic shared memory of `qa_prefill_scores_wg` at head dim `d`, bytes:
/// three stages of Kc's two bf16 part tiles of 64 windows × `d`, unpadded
/// (in wgmma's K-major layouts; the kernel's QW_STAGES, 3 unless an NVRTC
/// option sets 2, which uses two of them), and 1,024 bytes to align them
/// to the 128-byte swizzle's atoms (kernels/qa_prefill.cu).
pub fn qa_prefill_wg_smem_bytes(d: usize) -> usize {
    3 * 2 * 64 * d * 2 + 1024
}

/// f32 elements of the scratch the kernels that split Kc once per chunk
/// ([`PrefillScores::splits_kc`]) need for Kc's bf16 parts: bf16 [Hkv, 3, `w_stride`, D] (`w_stride` ≥ the
/// windows split), rounded up to whole f32.
pub fn split_kc_scratch_f32(kv_heads: usize, w_stride: usize, head_dim: usize) -> usize {
    (kv_heads * 3 * w_stride * head_dim).div_ceil(2)
}

/// Dynamic shared memory of `qa_prefill_scores` at head dim `d` with
/// `parts` Kc parts (3, or 2 for the bf16x2 entry points), bytes: the bf16
/// part tiles of 64 windows (rows of d + 8) and the f32 P tile [128, 65]
/// (kernels/qa_prefill.cu).
pub fn qa_prefill_smem_bytes(d: usize, parts: usize) -> usize {
    parts * 64 * (d + 8) * 2 + QP_BM * 65 * 4
}

/// The kernel of one window-scoring launch (kernels/qa_prefill.cu), as
/// [`scores_kernel`] chooses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScoresKernel {
    /// The entry point's full name (`…_d<D>`).
    pub entry: String,
    /// Dynamic shared memory, bytes.
    pub smem: usize,
    /// Threads per block.
    pub threads: u32,
    /// Whether Kc is split into its bf16 parts first (`qa_split_kc`, into a
    /// scratch of [`split_kc_scratch_f32`]).
    pub split: bool,
}

/// The kernel that `kernels` runs for `group` query heads per KV head at
/// head dim `head_dim` on a device of architecture `arch` (as
/// [`crate::cuda::Gpu::info`] names it): `qa_prefill_scores_wg_g<G>` where
/// [`PrefillScores::TensorCoreWgmma`] and [`prefill_scores_wg_takes`];
/// where the m32 kernels take G ([`prefill_scores_m32_takes`]) and Kc is
/// split ([`PrefillScores::splits_kc`]) `qa_prefill_scores_m32s_bf16x2_g<G>`
/// (two parts) or `qa_prefill_scores_m32s_g<G>` (three), for
/// [`PrefillScores::TensorCoreM32`] `qa_prefill_scores_m32_g<G>`; other G
/// `qa_prefill_scores_bf16x2` (two parts) or `qa_prefill_scores` (three);
/// each with `_d<D>`, its shared memory and block size.
///
/// Errors: [`Error::Input`] for [`PrefillScores::Cublas`] and for a head
/// dim or G the tensor-core kernels do not take
/// ([`prefill_scores_tc_supported`]).
pub fn scores_kernel(
    kernels: PrefillScores,
    arch: &str,
    head_dim: usize,
    group: usize,
) -> Result<ScoresKernel> {
    const OP: &str = "qa_prefill_scores";
    if kernels == PrefillScores::Cublas {
        return Err(Error::Input(format!(
            "{OP}: {kernels:?} is not a tensor-core choice (tensor-core, tensor-core-m32, tensor-core-split, tensor-core-bf16x2 or tensor-core-wgmma)"
        )));
    }
    if !prefill_scores_tc_supported(head_dim, group) {
        return Err(Error::Input(format!(
            "{OP}: G {group} at head dim {head_dim}: the kernel takes head dims 64, 80, 128 and 1 ≤ G ≤ {QP_MAX_G} query heads per KV head"
        )));
    }
    let g = group;
    let parts = kernels.kc_parts();
    let split = kernels.splits_kc(g);
    let m32 = kernels != PrefillScores::TensorCore && prefill_scores_m32_takes(g);
    let two = parts == 2;
    let (entry, smem, threads) = if kernels == PrefillScores::TensorCoreWgmma
        && prefill_scores_wg_takes(arch, head_dim, g)
    {
        (
            format!("qa_prefill_scores_wg_g{g}"),
            qa_prefill_wg_smem_bytes(head_dim),
            QW_THREADS,
        )
    } else if m32 {
        let name = match (split, two) {
            (true, true) => format!("qa_prefill_scores_m32s_bf16x2_g{g}"),
            (true, false) => format!("qa_prefill_scores_m32s_g{g}"),
            (false, _) => format!("qa_prefill_scores_m32_g{g}"),
        };
        (
            name,
            qa_prefill_m32_smem_bytes(head_dim, parts, split),
            QP_M32_THREADS,
        )
    } else {
        let name = if two { "qa_prefill_scores_bf16x2" } else { OP };
        (
            name.to_string(),
            qa_prefill_smem_bytes(head_dim, parts),
            QP_THREADS,
        )
    };
    Ok(ScoresKernel {
        entry: format!("{entry}_d{head_dim}"),
        smem,
        threads,
        split,
    })
}

/// Steps 1a and 1b for `d.rows` rows that all read one Kc (a prefill
/// chunk) on the tensor cores, with the kernel [`scores_kernel`] picks for
/// `kernels` on this device (`qa_split_kc` first where it splits Kc, with
/// `split` = (the scratch for Kc's parts, [`split_kc_scratch_f32`] f32 at
/// `d.w_stride`; the windows to split, ≥ every row's Mc));
/// kernels/qa_prefill.cu): writes `d.scores` (the windows below each row's
/// Mc) from the bf16 queries at `q` (row b at b·`q_stride`) and the f32 Kc
/// at `kc` (≥ max Mc windows of Hkv·`head_dim`); `d.logits` and `d.stats`
/// are not used.
///
/// Errors: [`Error::Input`] for [`PrefillScores::Cublas`], when H is not a
/// multiple of Hkv or the shape is not one the kernel takes
/// ([`prefill_scores_tc_supported`]), `q_stride` is odd, `q` is not 4-byte or `kc` not 16-byte aligned, a
/// dimension exceeds i32, the shared memory does not fit, or the split
/// kernels lack `split` or its windows exceed `d.w_stride`;
/// [`Error::Cuda`] on a launch failure.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_prefill_scores(
    gpu: &Gpu,
    d: &ScoreDims,
    q: u64,
    q_stride: usize,
    head_dim: usize,
    kc: u64,
    kernels: PrefillScores,
    split: Option<(u64, usize)>,
) -> Result<()> {
    const OP: &str = "qa_prefill_scores";
    if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) {
        return Err(Error::Input(format!(
            "{OP}: H {} is not a multiple of Hkv {}",
            d.heads, d.kv_heads
        )));
    }
    let g = d.heads / d.kv_heads;
    let k = scores_kernel(kernels, &gpu.info().arch, head_dim, g)?;
    let split = match (k.split, split) {
        (true, Some(sp)) => Some(sp),
        (true, None) => {
            return Err(Error::Input(format!(
                "{OP}: {} needs a Kc part scratch (split_kc_scratch_f32)",
                kernels.name()
            )))
        }
        (false, _) => None,
    };
    if !q_stride.is_multiple_of(2) || !q.is_multiple_of(4) || !kc.is_multiple_of(16) {
        return Err(Error::Input(format!(
            "{OP}: q stride {q_stride} (need even), q address {q:#x} (need 4-byte aligned), Kc address {kc:#x} (need 16-byte aligned)"
        )));
    }
    if d.rows == 0 {
        return Ok(());
    }
    let [h_, hk_, wst, _, st, ks] = d.i32s()?;
    let f = gpu.function(&k.entry)?;
    let smem = ensure_smem(gpu, f, k.smem, QP_BM * 4, OP)?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid(d.rows.div_ceil(QP_BM / g), "row blocks")?,
            grid(d.kv_heads, "Hkv")?,
            1,
        ),
        block_dim: (k.threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let (qs, rows) = (i32_dim(q_stride, "q_stride")?, i32_dim(d.rows, "rows")?);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut l = gpu.stream().launch_builder(f);
    l.arg(&q)
        .arg(&qs)
        .arg(&kc)
        .arg(&d.lens)
        .arg(&d.scores)
        .arg(&rows)
        .arg(&h_)
        .arg(&hk_)
        .arg(&wst)
        .arg(&st)
        .arg(&ks)
        .arg(&scale);
    let (parts, pst) = match split {
        Some((parts, mc)) => {
            // Kc's parts first (the same stream): windows < mc, the most any
            // row reads; p_stride = w_stride ≥ mc.
            let sf = gpu.function("qa_split_kc")?;
            let n4 = mc * d.kv_heads * head_dim / 4;
            let (mc_, d_) = (i32_dim(mc, "Mc")?, i32_dim(head_dim, "D")?);
            if mc > d.w_stride {
                return Err(Error::Input(format!(
                    "{OP}: {mc} windows to split exceed w_stride {}",
                    d.w_stride
                )));
            }
            let scfg = LaunchConfig {
                grid_dim: (grid(n4.div_ceil(256).clamp(1, 4096), "split blocks")?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut sl = gpu.stream().launch_builder(sf);
            sl.arg(&kc)
                .arg(&parts)
                .arg(&mc_)
                .arg(&hk_)
                .arg(&d_)
                .arg(&wst);
            // SAFETY: matches qa_split_kc(kc, parts, mc, hkv, D, p_stride):
            // Kc holds ≥ mc windows of Hkv·D f32 (the caller's contract), the
            // scratch Hkv·3·w_stride·D bf16 (split_kc_scratch_f32).
            if mc > 0 {
                unsafe { sl.launch(scfg) }.cuda("qa_split_kc")?;
            }
            (parts, wst)
        }
        None => (0u64, 0i32),
    };
    if split.is_some() {
        l.arg(&parts).arg(&pst);
    }
    // SAFETY: argument list matches qa_prefill_scores{,_m32_g*,_m32s{,_bf16x2}_g*,_wg_g*,_bf16x2}_d* in
    // kernels/qa_prefill.cu; q holds rows rows of H·D bf16 at q_stride, Kc
    // the windows below every row's Mc, the scores rows·Hkv·w_stride f32
    // with w_stride ≥ every row's Mc (the caller's contract, ScoreDims).
    unsafe { l.launch(cfg) }.cuda(OP).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_scores_values_and_errors() {
        assert_eq!(
            parse_prefill_scores("cublas").unwrap(),
            PrefillScores::Cublas
        );
        assert_eq!(
            parse_prefill_scores(" tensor-core ").unwrap(),
            PrefillScores::TensorCore
        );
        assert_eq!(
            parse_prefill_scores("tensor-core-bf16x2").unwrap(),
            PrefillScores::TensorCoreBf16x2
        );
        assert_eq!(
            parse_prefill_scores("tensor-core-m32").unwrap(),
            PrefillScores::TensorCoreM32
        );
        assert_eq!(PrefillScores::TensorCore.kc_parts(), 3);
        assert_eq!(PrefillScores::TensorCoreM32.kc_parts(), 3);
        assert_eq!(
            parse_prefill_scores("tensor-core-split").unwrap(),
            PrefillScores::TensorCoreSplit
        );
        assert_eq!(PrefillScores::TensorCoreSplit.kc_parts(), 3);
        assert_eq!(PrefillScores::TensorCoreBf16x2.kc_parts(), 2);
        assert_eq!(
            parse_prefill_scores("tensor-core-wgmma").unwrap(),
            PrefillScores::TensorCoreWgmma
        );
        assert_eq!(PrefillScores::TensorCoreWgmma.kc_parts(), 2);
        for k in [
            PrefillScores::Cublas,
            PrefillScores::TensorCore,
            PrefillScores::TensorCoreM32,
            PrefillScores::TensorCoreSplit,
            PrefillScores::TensorCoreBf16x2,
            PrefillScores::TensorCoreWgmma,
        ] {
            assert_eq!(parse_prefill_scores(k.name()).unwrap(), k);
        }
        for bad in [
            "",
            "tc",
            "TENSOR-CORE",
            "cuBLAS",
            "tensor-core-bf16x3",
            "tensor-core-m16",
        ] {
            let e = parse_prefill_scores(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{ENV_PREFILL_SCORES}={bad}"))
                    && e.contains(
                        "cublas, tensor-core, tensor-core-m32, tensor-core-split, tensor-core-bf16x2 or tensor-core-wgmma"
                    ),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn tensor_core_scores_take_the_kernel_head_dims_and_groups() {
        for d in [64, 80, 128] {
            for g in [1, 3, 4, 8, 16, 64] {
                assert!(prefill_scores_tc_supported(d, g), "D {d} G {g}");
            }
            assert!(!prefill_scores_tc_supported(d, 0));
            assert!(!prefill_scores_tc_supported(d, 65));
        }
        for d in [0, 32, 96, 112, 256] {
            assert!(!prefill_scores_tc_supported(d, 4), "D {d}");
        }
        let m32: Vec<usize> = (0..=64).filter(|&g| prefill_scores_m32_takes(g)).collect();
        assert_eq!(m32, [4, 8, 16]);
        for k in [
            PrefillScores::TensorCoreSplit,
            PrefillScores::TensorCoreBf16x2,
            PrefillScores::TensorCoreWgmma,
        ] {
            let split: Vec<usize> = (0..=64).filter(|&g| k.splits_kc(g)).collect();
            assert_eq!(split, [4, 8, 16], "{k:?}");
        }
        for k in [
            PrefillScores::Cublas,
            PrefillScores::TensorCore,
            PrefillScores::TensorCoreM32,
        ] {
            assert!((0..=64).all(|g| !k.splits_kc(g)), "{k:?}");
        }
        // the wgmma kernels: compute capability 9.0 only, D 64 and 128, G 4, 8, 16
        let mut wg = Vec::new();
        for arch in ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"] {
            for d in [64, 80, 128] {
                for g in 0..=64 {
                    if prefill_scores_wg_takes(arch, d, g) {
                        wg.push((arch, d, g));
                    }
                }
            }
        }
        let want: Vec<_> = [64, 128]
            .into_iter()
            .flat_map(|d| [4, 8, 16].map(|g| ("sm_90", d, g)))
            .collect();
        assert_eq!(wg, want);
    }

    #[test]
    fn wgmma_scores_run_the_bf16x2_kernels_wherever_the_wg_kernel_does_not_take_the_shape() {
        let known: Vec<&str> = crate::cuda::context::KERNEL_SOURCES
            .iter()
            .flat_map(|k| k.functions.iter().copied())
            .collect();
        let all = [
            PrefillScores::TensorCore,
            PrefillScores::TensorCoreM32,
            PrefillScores::TensorCoreSplit,
            PrefillScores::TensorCoreBf16x2,
            PrefillScores::TensorCoreWgmma,
        ];
        let mut wg = 0;
        for arch in ["sm_80", "sm_89", "sm_90", "sm_100"] {
            for d in [64, 80, 128] {
                for g in [1, 2, 3, 4, 6, 8, 12, 16, 32, 64] {
                    for k in all {
                        // every choice names an entry point that exists
                        let sk = scores_kernel(k, arch, d, g).unwrap();
                        assert!(
                            known.contains(&sk.entry.as_str()),
                            "{k:?} {arch} D {d} G {g}: {sk:?}"
                        );
                    }
                    let w = scores_kernel(PrefillScores::TensorCoreWgmma, arch, d, g).unwrap();
                    let b = scores_kernel(PrefillScores::TensorCoreBf16x2, arch, d, g).unwrap();
                    if prefill_scores_wg_takes(arch, d, g) {
                        wg += 1;
                        assert_eq!(w.entry, format!("qa_prefill_scores_wg_g{g}_d{d}"));
                        assert_eq!(
                            (w.smem, w.threads, w.split),
                            (qa_prefill_wg_smem_bytes(d), 256, true)
                        );
                    } else {
                        assert_eq!(w, b, "{arch} D {d} G {g}");
                    }
                }
            }
        }
        assert_eq!(wg, 6); // sm_90 x D 64, 128 x G 4, 8, 16
                           // the D 128 kernels of NOSA-8B (G 16), and a G 3 fallback
        for (k, arch, g, entry) in [
            (
                PrefillScores::TensorCoreBf16x2,
                "sm_90",
                16,
                "qa_prefill_scores_m32s_bf16x2_g16_d128",
            ),
            (
                PrefillScores::TensorCoreSplit,
                "sm_90",
                16,
                "qa_prefill_scores_m32s_g16_d128",
            ),
            (
                PrefillScores::TensorCoreM32,
                "sm_90",
                16,
                "qa_prefill_scores_m32_g16_d128",
            ),
            (
                PrefillScores::TensorCore,
                "sm_90",
                16,
                "qa_prefill_scores_d128",
            ),
            (
                PrefillScores::TensorCoreWgmma,
                "sm_80",
                16,
                "qa_prefill_scores_m32s_bf16x2_g16_d128",
            ),
            (
                PrefillScores::TensorCoreWgmma,
                "sm_90",
                3,
                "qa_prefill_scores_bf16x2_d128",
            ),
        ] {
            assert_eq!(
                scores_kernel(k, arch, 128, g).unwrap().entry,
                entry,
                "{k:?} {arch} G {g}"
            );
        }
        // refused: cuBLAS, head dims and G the kernels do not take
        for (k, d, g) in [
            (PrefillScores::Cublas, 128, 16),
            (PrefillScores::TensorCoreWgmma, 96, 16),
            (PrefillScores::TensorCoreWgmma, 128, 65),
            (PrefillScores::TensorCore, 128, 0),
        ] {
            assert!(
                scores_kernel(k, "sm_90", d, g).is_err(),
                "{k:?} D {d} G {g}"
            );
        }
    }

    #[test]
    fn tensor_core_scores_fit_two_blocks_per_h200_sm() {
        // 228 KB of shared memory per SM on the H100/H200, 1 KB reserved per
        // block, the kernel's 512 bytes of static Mc values; and 2 blocks of
        // QP_THREADS at the 128 registers __launch_bounds__(QP_THREADS, 2)
        // allows fill the 64K-register file.
        for d in [64, 80, 128] {
            for parts in [2, 3] {
                let per_block = qa_prefill_smem_bytes(d, parts) + 1024 + QP_BM * 4;
                assert!(2 * per_block <= 228 * 1024, "D {d}: {per_block} bytes");
            }
        }
        assert_eq!(2 * QP_THREADS as usize * 128, 65536);
        // qa_prefill_scores_m32: 2 blocks of QP_M32_THREADS at the 128
        // registers __launch_bounds__(QP_M32_THREADS, 2) allows, and their
        // shared memory (which also holds the warp pairs' statistics, 8 KB).
        assert_eq!(2 * QP_M32_THREADS as usize * 128, 65536);
        for d in [64, 80, 128] {
            for parts in [2, 3] {
                for split in [false, true] {
                    let bytes = qa_prefill_m32_smem_bytes(d, parts, split);
                    let per_block = bytes + 1024 + QP_BM * 4;
                    assert!(2 * per_block <= 228 * 1024, "m32 D {d}: {per_block} bytes");
                    assert!(bytes >= 2 * 4 * 32 * 8 * 4, "m32 D {d} parts {parts}");
                }
            }
        }
        assert_eq!(qa_prefill_m32_smem_bytes(128, 3, false), 3 * 64 * 136 * 2);
        assert_eq!(
            qa_prefill_m32_smem_bytes(128, 3, true),
            2 * 3 * 64 * 136 * 2
        );
        assert_eq!(qa_prefill_m32_smem_bytes(64, 2, true), 2 * 2 * 64 * 72 * 2);
        assert_eq!(qa_prefill_m32_smem_bytes(80, 2, false), 2 * 64 * 88 * 2);
        // qa_prefill_scores_wg: 2 blocks of QW_THREADS at 128 registers, and
        // three stages of two unpadded part tiles
        assert_eq!(2 * QW_THREADS as usize * 128, 65536);
        for d in [64, 128] {
            let per_block = qa_prefill_wg_smem_bytes(d) + 1024 + QP_BM * 4;
            assert!(2 * per_block <= 228 * 1024, "wg D {d}: {per_block} bytes");
        }
        assert_eq!(qa_prefill_wg_smem_bytes(128), 98304 + 1024);
        assert_eq!(qa_prefill_wg_smem_bytes(64), 3 * 2 * 64 * 64 * 2 + 1024);
        // bf16 [Hkv, 3, w_stride, D] as f32, rounded up
        assert_eq!(split_kc_scratch_f32(2, 4096, 128), 2 * 3 * 4096 * 128 / 2);
        assert_eq!(split_kc_scratch_f32(1, 1, 1), 2);
        assert_eq!(
            qa_prefill_smem_bytes(128, 3),
            3 * 64 * 136 * 2 + 128 * 65 * 4
        );
    }
}
