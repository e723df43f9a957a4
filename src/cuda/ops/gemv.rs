//! The small-batch linear layer `gemv` (kernels/gemv.cu): y = x · Wᵀ for
//! n ≤ [`GEMV_MAX_N`] rows, memory-bound, with the decode step's
//! neighbours of a GEMM folded in — the RMSNorm before the QKV and gate|up
//! projections, SwiGLU after the gate|up projection, the residual add after
//! the O and down projections (spec/nosa-model.md §7; runtime.md §1's
//! step). Each fold computes what the separate kernel (rmsnorm.cu,
//! swiglu.cu) computes, with the same roundings; the dot products sum in
//! another order than cuBLAS.

use crate::cuda::context::CudaResultExt;
use crate::cuda::Gpu;
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;

/// Largest batch `gemv` takes (`GEMV_MAX_N` in kernels/gemv.cu).
pub const GEMV_MAX_N: usize = 4;
/// Warps per block (at most `GEMV_WARPS` of kernels/gemv.cu, its launch
/// bound), unless `$SPARDA_GEMV_WARPS` sets 4; each warp computes two output
/// rows at a time.
const GEMV_WARPS: usize = 8;
/// Output rows a warp computes at a time (`GEMV_ROWS`).
const GEMV_ROWS: usize = 2;
/// Shared memory the staged input may take, bytes (n · in · 2; the static
/// limit, no opt-in).
pub const GEMV_MAX_STAGED_BYTES: usize = 48 * 1024;
/// Warps per SM of the grid (the warps stride over the row pairs; at 128
/// registers a thread, 16 warps fit an SM): blocks per SM = this / warps per
/// block, unless `$SPARDA_GEMV_BLOCKS_PER_SM` sets another count (1–16).
const GEMV_WARPS_PER_SM: usize = 16;

/// Where `gemv`'s input rows (bf16 [n, in] once staged) come from.
#[derive(Debug, Clone, Copy)]
pub enum GemvInput {
    /// bf16 [n, in] at this device address, as is.
    Bf16(u64),
    /// RMSNorm of the f32 residual stream [n, in] at `resid`:
    /// x = bf16(bf16(r / √(mean(r²) + eps)) · w), `weight` bf16 \[in\]
    /// (what `ops::rmsnorm` writes).
    RmsNorm {
        /// f32 [n, in] device address.
        resid: u64,
        /// bf16 \[in\] device address.
        weight: u64,
        /// ε of the norm.
        eps: f32,
    },
}

/// Where `gemv` writes y [n, out].
#[derive(Debug, Clone, Copy)]
pub enum GemvOutput {
    /// bf16 [n, out], rounded to nearest even.
    Bf16(u64),
    /// f32 [n, out].
    F32(u64),
    /// Added to the f32 residual stream [n, out]: r += bf16(y) · scale
    /// (what `ops::add_rmsnorm`'s residual add does with a bf16 GEMM output).
    Residual {
        /// f32 [n, out] device address, read and written.
        resid: u64,
        /// Factor of the added output.
        scale: f32,
    },
    /// W is the fused [gate; up] weight (out = 2·I rows, I = out/2): bf16
    /// [n, I] at this address gets bf16(silu(g) · u) of the rounded gate and
    /// up outputs g, u (what the gate|up GEMM and `ops::swiglu` write).
    Swiglu(u64),
}

/// One `gemv` launch: y = x · Wᵀ, W bf16 [out_features, in_features] at `w`.
#[derive(Debug, Clone, Copy)]
pub struct GemvArgs {
    /// The input rows.
    pub x: GemvInput,
    /// W device address (16-byte aligned).
    pub w: u64,
    /// The output.
    pub y: GemvOutput,
    /// Rows, 1 ≤ n ≤ [`GEMV_MAX_N`].
    pub n: usize,
    /// Input features (a multiple of 8).
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

/// Whether `gemv` takes n rows of `in_features` (n ≤ [`GEMV_MAX_N`],
/// in_features a multiple of 8, the staged input within
/// [`GEMV_MAX_STAGED_BYTES`]). Alignment is the caller's to check.
pub fn gemv_fits(n: usize, in_features: usize) -> bool {
    (1..=GEMV_MAX_N).contains(&n)
        && in_features > 0
        && in_features.is_multiple_of(8)
        && n * in_features * 2 <= GEMV_MAX_STAGED_BYTES
}

/// The grid of a `gemv` over `out_features` rows on `sms` SMs, at most
/// `blocks_per_sm` blocks per SM. Balanced (the default): the row pairs
/// take k = ⌈pairs / most warps⌉ rounds, and the grid has the fewest warps
/// that cover them in k rounds, so every warp computes k or k − 1 pairs —
/// the QKV projection of NOSA-8B (2,304 pairs) runs on 1,152 warps, two
/// pairs each, instead of 2,112 warps of which 192 take a second pair and
/// the others wait. `balanced` false: one warp per pair up to the cap.
/// `block_warps` warps per block.
fn gemv_blocks(
    out_features: usize,
    sms: usize,
    blocks_per_sm: usize,
    block_warps: usize,
    balanced: bool,
) -> usize {
    let pairs = out_features.div_ceil(GEMV_ROWS);
    let most = sms.max(1) * blocks_per_sm * block_warps;
    let warps = if balanced {
        pairs.div_ceil(pairs.div_ceil(most).max(1))
    } else {
        pairs.min(most)
    };
    warps.div_ceil(block_warps).max(1)
}

/// Warps per block of `gemv` launches. `$SPARDA_GEMV_WARPS`: 4 gives
/// blocks of 4 warps (twice the blocks, spread more evenly over the SMs when
/// a grid has few more blocks than SMs, e.g. NOSA-8B's QKV projection: 144
/// blocks of 8 warps on 132 SMs); anything else, or unset, 8 (another value
/// is warned about). Read once, not at every launch.
pub fn block_warps() -> usize {
    static WARPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WARPS.get_or_init(|| {
        let v = std::env::var("SPARDA_GEMV_WARPS").ok();
        let w = block_warps_from(v.as_deref());
        if let Some(v) = v.filter(|v| v.trim() != w.to_string()) {
            tracing::warn!("SPARDA_GEMV_WARPS={v:?}: takes 4 or 8; using {w}");
        }
        w
    })
}

/// [`block_warps`]'s rule on the variable's value.
fn block_warps_from(v: Option<&str>) -> usize {
    match v.map(str::trim) {
        Some("4") => 4,
        _ => GEMV_WARPS,
    }
}

/// `$SPARDA_GEMV_GRID`: `cap` gives every row pair its own warp up to the
/// per-SM cap (the grid before the balanced one, for comparison); anything
/// else, or unset, the balanced grid. Read once, not at every launch.
fn balanced_grid() -> bool {
    static BALANCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BALANCED.get_or_init(|| std::env::var("SPARDA_GEMV_GRID").map_or(true, |v| v != "cap"))
}

/// Whether the fused decode step's down projection goes to cuBLAS instead
/// of `gemv`: `$SPARDA_GEMV_DOWN=cublas` makes it one `cublasGemmEx` that
/// adds scale · (x · Wᵀ) into the f32 residual stream (β = 1,
/// [`crate::cuda::Gpu::linear_into_residual`]); unset or anything else keeps
/// `gemv`. The down projection has the longest input of the step (the
/// intermediate size, e.g. 14,336 for a Llama-3 8B shape), which `gemv`
/// stages whole in shared memory per block. Read once, not at every launch.
pub fn down_on_cublas() -> bool {
    static CUBLAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CUBLAS.get_or_init(|| {
        let v = std::env::var("SPARDA_GEMV_DOWN").ok();
        let on = down_on_cublas_from(v.as_deref());
        if let Some(v) = v.filter(|v| !on && !v.trim().is_empty() && v.trim() != "gemv") {
            tracing::warn!("SPARDA_GEMV_DOWN={v:?}: takes cublas or gemv; using gemv");
        }
        on
    })
}

/// [`down_on_cublas`]'s rule on the variable's value.
fn down_on_cublas_from(v: Option<&str>) -> bool {
    v.is_some_and(|v| v.trim().eq_ignore_ascii_case("cublas"))
}

/// `$SPARDA_GEMV_BLOCKS_PER_SM` if it is a count of 1–16, else the default.
/// Read once, not at every launch.
fn blocks_per_sm() -> usize {
    static PER_SM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PER_SM.get_or_init(|| {
        std::env::var("SPARDA_GEMV_BLOCKS_PER_SM")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|b| (1..=16).contains(b))
            .unwrap_or(GEMV_WARPS_PER_SM / block_warps())
    })
}

/// Enqueues `gemv` (kernels/gemv.cu) on [`Gpu::stream`], through
/// [`Gpu::launch_builder`] (so under programmatic dependent launch when it
/// is on).
///
/// Errors: [`Error::Input`] when the shape does not fit ([`gemv_fits`]) or
/// an address is not 16-byte aligned; [`Error::Cuda`] on a launch failure.
///
/// # Safety
/// Every address must be a live device buffer of the sizes the variants
/// name (x/resid [n, in], weight \[in\], W [out, in], y/resid [n, out], the
/// SwiGLU output [n, out/2]); y must not overlap the input or W.
pub unsafe fn launch_gemv(gpu: &Gpu, a: &GemvArgs) -> Result<()> {
    let (n, k, m) = (a.n, a.in_features, a.out_features);
    let shape = || format!("gemv [{n}, {k}] x [{m}, {k}]^T");
    if !gemv_fits(n, k) {
        return Err(Error::Input(format!(
            "{}: needs 1 ≤ n ≤ {GEMV_MAX_N}, in a multiple of 8 and n·in·2 ≤ {GEMV_MAX_STAGED_BYTES} bytes",
            shape()
        )));
    }
    if m == 0 {
        return Ok(());
    }
    let (xp, xmode, norm, eps) = match a.x {
        GemvInput::Bf16(p) => (p, 0i32, 0u64, 0.0f32),
        GemvInput::RmsNorm { resid, weight, eps } => (resid, 1, weight, eps),
    };
    let (yp, ymode, scale) = match a.y {
        GemvOutput::Bf16(p) => (p, 0i32, 0.0f32),
        GemvOutput::F32(p) => (p, 1, 0.0),
        GemvOutput::Residual { resid, scale } => (resid, 2, scale),
        GemvOutput::Swiglu(p) => (p, 3, 0.0),
    };
    if ymode == 3 && !m.is_multiple_of(2) {
        return Err(Error::Input(format!(
            "{}: a [gate; up] weight needs an even row count",
            shape()
        )));
    }
    if !xp.is_multiple_of(16) || !a.w.is_multiple_of(16) || !norm.is_multiple_of(8) {
        return Err(Error::Input(format!(
            "{}: x at {xp:#x} and W at {:#x} must be 16-byte aligned, the norm weight at {norm:#x} 8-byte",
            shape(),
            a.w
        )));
    }
    let dims = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| Error::Input(format!("{}: {what} {v} exceeds i32", shape())))
    };
    let (k_, m_) = (dims(k, "in")?, dims(m, "out")?);
    let blocks = gemv_blocks(
        m,
        gpu.info().sm_count.max(1) as usize,
        blocks_per_sm(),
        block_warps(),
        balanced_grid(),
    );
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((32 * block_warps()) as u32, 1, 1),
        shared_mem_bytes: (n * k * 2) as u32,
    };
    let f = gpu.function(["gemv1", "gemv2", "gemv3", "gemv4"][n - 1])?;
    let mut b = gpu.launch_builder(f);
    b.arg(&xp)
        .arg(&norm)
        .arg(&eps)
        .arg(&a.w)
        .arg(&yp)
        .arg(&scale)
        .arg(&k_)
        .arg(&m_)
        .arg(&xmode)
        .arg(&ymode);
    // SAFETY: argument list matches kernels/gemv.cu; the caller vouches for
    // the buffers (this function's contract); shape and alignment checked.
    unsafe { b.launch(cfg) }.cuda(&shape()).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_only_small_batches_of_whole_chunks_within_shared_memory() {
        assert!(gemv_fits(1, 4096));
        assert!(gemv_fits(1, 14_336)); // NOSA-8B's down projection input: 28 KiB
        assert!(gemv_fits(4, 4096)); // 32 KiB
        assert!(!gemv_fits(2, 14_336)); // 56 KiB > 48 KiB
        assert!(!gemv_fits(5, 256));
        assert!(!gemv_fits(0, 256));
        assert!(!gemv_fits(1, 100)); // not a multiple of 8
    }

    #[test]
    fn block_warps_are_eight_unless_four_is_asked_for() {
        assert_eq!(block_warps_from(None), 8);
        assert_eq!(block_warps_from(Some("4")), 4);
        assert_eq!(block_warps_from(Some(" 4 ")), 4);
        assert_eq!(block_warps_from(Some("16")), 8);
        assert_eq!(block_warps_from(Some("")), 8);
    }

    #[test]
    fn down_projection_goes_to_cublas_only_when_asked() {
        assert!(!down_on_cublas_from(None));
        assert!(!down_on_cublas_from(Some("")));
        assert!(!down_on_cublas_from(Some("gemv")));
        assert!(!down_on_cublas_from(Some("1")));
        assert!(down_on_cublas_from(Some("cublas")));
        assert!(down_on_cublas_from(Some(" cuBLAS ")));
    }

    #[test]
    fn grid_covers_every_row_pair_up_to_the_per_sm_cap() {
        // 6,144 rows = 3,072 pairs = 384 blocks of 8 warps, below 132·4
        assert_eq!(gemv_blocks(6144, 132, 4, 8, false), 384);
        assert_eq!(gemv_blocks(6144, 132, 4, 8, true), 384);
        // 28,672 rows = 1,792 blocks, capped at 132·2
        assert_eq!(gemv_blocks(28_672, 132, 2, 8, false), 264);
        // an odd row count still gets its last (half) pair
        assert_eq!(gemv_blocks(17, 132, 4, 8, false), 2);
        assert_eq!(gemv_blocks(17, 132, 4, 8, true), 2);
        assert_eq!(gemv_blocks(1, 0, 4, 8, false), 1);
        assert_eq!(gemv_blocks(1, 0, 4, 8, true), 1);
    }

    #[test]
    fn balanced_grid_gives_every_warp_the_same_number_of_pairs_within_one() {
        // (out, sms, blocks per SM, warps per block): NOSA-8B's QKV, O/down, gate|up and
        // lm_head rows, and some in blocks of 4 warps
        for (out, sms, per_sm, bw) in [
            (4608, 132, 2, 8),
            (4096, 132, 2, 8),
            (28_672, 132, 2, 8),
            (73_448, 132, 2, 8),
            (1_000, 132, 2, 8),
            (9, 1, 1, 8),
            (4608, 132, 4, 4),
            (28_672, 132, 4, 4),
            (9, 1, 1, 4),
        ] {
            let pairs = out / 2 + out % 2;
            let cap = gemv_blocks(out, sms, per_sm, bw, false);
            let bal = gemv_blocks(out, sms, per_sm, bw, true);
            assert!(bal <= cap, "{out}: {bal} > {cap}");
            let rounds = |blocks: usize| pairs.div_ceil(blocks * bw);
            // no more rounds than the capped grid, and no warp idle for a whole round
            assert_eq!(rounds(bal), rounds(cap), "{out}");
            let warps = bal * bw;
            assert!(warps >= pairs.div_ceil(rounds(bal)), "{out}");
            assert!(
                (warps - bw) * rounds(bal) < pairs,
                "{out}: a smaller grid would do"
            );
        }
        // QKV: 2,304 pairs over 1,152 warps (144 blocks), two each
        assert_eq!(gemv_blocks(4608, 132, 2, 8, true), 144);
        assert_eq!(gemv_blocks(4608, 132, 2, 8, false), 264);
        // the same warps in blocks of 4: 288 blocks, at most 3 on an SM
        assert_eq!(gemv_blocks(4608, 132, 4, 4, true), 288);
        // gate|up: 14,336 pairs, 7 rounds, 2,048 warps
        assert_eq!(gemv_blocks(28_672, 132, 2, 8, true), 256);
    }
}
