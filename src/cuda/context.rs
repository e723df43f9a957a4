//! The GPU context of the CUDA backend (spec/device.md): one device
//! context with cudarc's event tracking turned off, one compute stream, the
//! `kernels/*.cu` sources compiled at run time with NVRTC for the device's
//! architecture (cubins cached on disk), and a cuBLAS handle on that stream
//! with the bf16 GEMM of every linear layer.

use super::Bf16;
use crate::{Error, Result};
use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Turns any cudarc error into [`Error::Cuda`] naming what was being done.
pub(crate) trait CudaResultExt<T> {
    /// `Err(e)` → `Error::Cuda("{what}: {e}")`.
    fn cuda(self, what: &str) -> Result<T>;
}

impl<T, E: std::fmt::Display> CudaResultExt<T> for std::result::Result<T, E> {
    fn cuda(self, what: &str) -> Result<T> {
        self.map_err(|e| Error::Cuda(format!("{what}: {e}")))
    }
}

/// One kernel source file: compiled as `common.cuh`, then the listed
/// preludes, then the file's own text, into one module.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name under `kernels/` (also the NVRTC program name).
    pub file: &'static str,
    /// The file's text (embedded at build time).
    pub text: &'static str,
    /// Shared headers prepended after `common.cuh`, in order.
    pub preludes: &'static [&'static str],
    /// The `extern "C"` kernels the file defines.
    pub functions: &'static [&'static str],
}

/// `kernels/common.cuh`: bf16 conversions and reductions, prepended to every source.
pub const COMMON_PRELUDE: &str = include_str!("../../kernels/common.cuh");

/// `kernels/mma.cuh`: the tensor-core helpers (cp.async, ldmatrix,
/// mma.sync m16n8k16 bf16) of the attention kernels, a prelude of each.
pub const MMA_PRELUDE: &str = include_str!("../../kernels/mma.cuh");

/// `kernels/wgmma.cuh`: warpgroup tensor-core helpers (wgmma.mma_async,
/// its fences and shared-memory descriptors; sm_90a), a prelude of the
/// sources whose kernels use them.
pub const WGMMA_PRELUDE: &str = include_str!("../../kernels/wgmma.cuh");

/// Every kernel source of the backend (one concern per file).
pub const KERNEL_SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "embedding.cu",
        text: include_str!("../../kernels/embedding.cu"),
        preludes: &[],
        functions: &["embed_gather"],
    },
    KernelSource {
        file: "rmsnorm.cu",
        text: include_str!("../../kernels/rmsnorm.cu"),
        preludes: &[],
        functions: &["rmsnorm_residual", "rmsnorm_residual_v4"],
    },
    KernelSource {
        file: "rope.cu",
        text: include_str!("../../kernels/rope.cu"),
        preludes: &[],
        functions: &["rope_neox"],
    },
    KernelSource {
        file: "swiglu.cu",
        text: include_str!("../../kernels/swiglu.cu"),
        preludes: &[],
        functions: &["swiglu", "swiglu_v8"],
    },
    KernelSource {
        file: "eviction.cu",
        text: include_str!("../../kernels/eviction.cu"),
        preludes: &[],
        functions: &["eviction_score"],
    },
    KernelSource {
        file: "attn_decode.cu",
        text: include_str!("../../kernels/attn_decode.cu"),
        preludes: &[MMA_PRELUDE],
        functions: &["attn_partial"],
    },
    KernelSource {
        file: "attn_prefill.cu",
        text: include_str!("../../kernels/attn_prefill.cu"),
        preludes: &[MMA_PRELUDE],
        functions: &[
            "attn_prefill_d64",
            "attn_prefill_d80",
            "attn_prefill_d128",
            "attn_prefill_sparse_d64",
            "attn_prefill_sparse_d80",
            "attn_prefill_sparse_d128",
            "prefill_sel_union",
        ],
    },
    KernelSource {
        file: "attn_combine.cu",
        text: include_str!("../../kernels/attn_combine.cu"),
        preludes: &[],
        functions: &["attn_combine"],
    },
    KernelSource {
        file: "kv_append.cu",
        text: include_str!("../../kernels/kv_append.cu"),
        preludes: &[],
        functions: &["qkv_rope_append"],
    },
    KernelSource {
        file: "argmax.cu",
        text: include_str!("../../kernels/argmax.cu"),
        preludes: &[],
        functions: &["argmax_rows", "argmax_advance"],
    },
    KernelSource {
        file: "bias.cu",
        text: include_str!("../../kernels/bias.cu"),
        preludes: &[],
        functions: &["bias_add"],
    },
    KernelSource {
        file: "sel_fill.cu",
        text: include_str!("../../kernels/sel_fill.cu"),
        preludes: &[],
        functions: &["sel_fill_dense"],
    },
    KernelSource {
        file: "compress.cu",
        text: include_str!("../../kernels/compress.cu"),
        preludes: &[],
        functions: &["compress_windows"],
    },
    KernelSource {
        file: "select.cu",
        text: include_str!("../../kernels/select.cu"),
        preludes: &[],
        functions: &[
            "qa_window_logits",
            "qa_q_f32",
            "qa_tile_stats",
            "qa_window_scores",
            "select_blocks",
        ],
    },
    KernelSource {
        file: "qa_prefill.cu",
        text: include_str!("../../kernels/qa_prefill.cu"),
        preludes: &[MMA_PRELUDE, WGMMA_PRELUDE],
        functions: &[
            "qa_prefill_scores_wg_g4_d64",
            "qa_prefill_scores_wg_g4_d128",
            "qa_prefill_scores_wg_g8_d64",
            "qa_prefill_scores_wg_g8_d128",
            "qa_prefill_scores_wg_g16_d64",
            "qa_prefill_scores_wg_g16_d128",
            "qa_prefill_scores_d64",
            "qa_prefill_scores_d80",
            "qa_prefill_scores_d128",
            "qa_prefill_scores_bf16x2_d64",
            "qa_prefill_scores_bf16x2_d80",
            "qa_prefill_scores_bf16x2_d128",
            "qa_prefill_scores_m32_g4_d64",
            "qa_prefill_scores_m32_g4_d80",
            "qa_prefill_scores_m32_g4_d128",
            "qa_prefill_scores_m32_g8_d64",
            "qa_prefill_scores_m32_g8_d80",
            "qa_prefill_scores_m32_g8_d128",
            "qa_prefill_scores_m32_g16_d64",
            "qa_prefill_scores_m32_g16_d80",
            "qa_prefill_scores_m32_g16_d128",
            "qa_prefill_scores_m32s_g4_d64",
            "qa_prefill_scores_m32s_g4_d80",
            "qa_prefill_scores_m32s_g4_d128",
            "qa_prefill_scores_m32s_g8_d64",
            "qa_prefill_scores_m32s_g8_d80",
            "qa_prefill_scores_m32s_g8_d128",
            "qa_prefill_scores_m32s_g16_d64",
            "qa_prefill_scores_m32s_g16_d80",
            "qa_prefill_scores_m32s_g16_d128",
            "qa_prefill_scores_m32s_bf16x2_g4_d64",
            "qa_prefill_scores_m32s_bf16x2_g4_d80",
            "qa_prefill_scores_m32s_bf16x2_g4_d128",
            "qa_prefill_scores_m32s_bf16x2_g8_d64",
            "qa_prefill_scores_m32s_bf16x2_g8_d80",
            "qa_prefill_scores_m32s_bf16x2_g8_d128",
            "qa_prefill_scores_m32s_bf16x2_g16_d64",
            "qa_prefill_scores_m32s_bf16x2_g16_d80",
            "qa_prefill_scores_m32s_bf16x2_g16_d128",
            "qa_split_kc",
        ],
    },
    KernelSource {
        file: "gemv.cu",
        text: include_str!("../../kernels/gemv.cu"),
        preludes: &[],
        functions: &["gemv1", "gemv2", "gemv3", "gemv4"],
    },
    KernelSource {
        file: "forecast.cu",
        text: include_str!("../../kernels/forecast.cu"),
        preludes: &[],
        functions: &["forecast_scores", "spin_wait"],
    },
    KernelSource {
        file: "kv_offload.cu",
        text: include_str!("../../kernels/kv_offload.cu"),
        preludes: &[],
        functions: &["slot_diff", "kv_fetch_sm", "kv_store_blocks"],
    },
    KernelSource {
        file: "sample.cu",
        text: include_str!("../../kernels/sample.cu"),
        // argmax_row, for greedy rows
        preludes: &[include_str!("../../kernels/argmax.cu")],
        functions: &["sample_rows"],
    },
    KernelSource {
        file: "synth.cu",
        text: include_str!("../../kernels/synth.cu"),
        preludes: &[],
        functions: &["fill_normal_bf16"],
    },
];

impl KernelSource {
    /// The full text NVRTC compiles: common prelude, preludes, the file.
    pub fn full_text(&self) -> String {
        let mut s = String::with_capacity(COMMON_PRELUDE.len() + self.text.len() + 4096);
        s.push_str(COMMON_PRELUDE);
        for p in self.preludes {
            s.push('\n');
            s.push_str(p);
        }
        s.push('\n');
        s.push_str(self.text);
        s
    }
}

/// What the device and its software are.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// `cuDeviceGetName`, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (i32, i32),
    /// The NVRTC target, e.g. "sm_90".
    pub arch: String,
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// Device memory in bytes.
    pub total_mem_bytes: usize,
    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0).
    pub driver_version: i32,
    /// `nvrtcVersion` (major, minor).
    pub nvrtc_version: (i32, i32),
}

impl DeviceInfo {
    /// The driver's CUDA version as "major.minor".
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// How one kernel source was obtained when the context was built.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelBuild {
    /// File under `kernels/`.
    pub file: String,
    /// Loaded from the disk cache (true) or compiled with NVRTC (false).
    pub cached: bool,
    /// Wall time of compile (or cache read) plus module load, milliseconds.
    pub ms: f64,
    /// The cache file, when a cache directory is in use.
    pub cache_path: Option<PathBuf>,
}

/// The output element type of [`Gpu::linear`]: [`Bf16`] activations or f32
/// (logits, spec §7). Sealed: only these two.
pub trait GemmOut: DeviceRepr + private::Sealed {
    /// The cuBLAS data type of the output matrix.
    const DTYPE: cublas_sys::cudaDataType;
    /// Whether the output is f32 (else bf16).
    const IS_F32: bool;
}

impl GemmOut for Bf16 {
    const DTYPE: cublas_sys::cudaDataType = cublas_sys::cudaDataType::CUDA_R_16BF;
    const IS_F32: bool = false;
}

impl GemmOut for f32 {
    const DTYPE: cublas_sys::cudaDataType = cublas_sys::cudaDataType::CUDA_R_32F;
    const IS_F32: bool = true;
}

mod private {
    pub trait Sealed {}
    impl Sealed for super::Bf16 {}
    impl Sealed for f32 {}
}

/// Whether programmatic dependent launch may be used on a device of NVRTC
/// target `arch` ("sm_90") given `$SPARDA_PDL` (`env`): only from sm_90 on
/// (`griddepcontrol` needs it), and not when the variable is `0`.
pub fn pdl_from_env(env: Option<&str>, arch: &str) -> bool {
    let sm = arch
        .strip_prefix("sm_")
        .and_then(|v| v.trim_end_matches(char::is_alphabetic).parse::<u32>().ok())
        .unwrap_or(0);
    sm >= 90 && env != Some("0")
}

/// The most decode rows the small-batch kernel `gemv` (kernels/gemv.cu)
/// takes by default. One: on the H200 (synthetic NOSA-8B, 4K, 2026-12-04)
/// the fused GEMVs took the B = 1 dense step from 5.07 to 4.85 ms, while at
/// B = 4 cuBLAS was faster (6.56 against 7.81 ms sparse).
pub const DEFAULT_SMALL_GEMV_ROWS: usize = 1;

/// The row limit of the small-batch kernel from `$SPARDA_GEMV` (`env`):
/// unset or empty gives [`DEFAULT_SMALL_GEMV_ROWS`], `0` turns it off
/// (cuBLAS for every GEMM), `1` … [`super::ops::GEMV_MAX_N`] sets the
/// limit.
///
/// Errors: [`Error::Input`] naming the variable for anything else.
pub fn small_gemv_rows_from_env(env: Option<&str>) -> Result<usize> {
    let max = super::ops::GEMV_MAX_N;
    match env.map(str::trim) {
        None | Some("") => Ok(DEFAULT_SMALL_GEMV_ROWS),
        Some(v) => v.parse::<usize>().ok().filter(|&r| r <= max).ok_or_else(|| {
            Error::Input(format!(
                "SPARDA_GEMV={v:?}: expected the most rows the small-batch GEMV takes, 0 (off) to {max}"
            ))
        }),
    }
}

/// The GPU: context, one compute stream, compiled kernels, cuBLAS handle.
///
/// Everything the backend launches goes on [`Gpu::stream`], in order, so no
/// cross-stream synchronisation is needed; cudarc's per-buffer event
/// tracking is off (spec/device.md: with it on, cuBLAS on a non-default
/// stream failed on the H200, and it would get in the way of graph capture).
pub struct Gpu {
    functions: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
    /// cuBLAS's workspace, set explicitly so that GEMMs captured into a CUDA
    /// graph never allocate ([`CUBLAS_WORKSPACE_BYTES`]).
    _blas_workspace: CudaSlice<u8>,
    /// cuBLASLt with the algorithm timed per shape, for GEMMs of at least
    /// [`super::gemm_lt::LT_MIN_ROWS`] rows (`SPARDA_GEMM=lt`); `None`: all
    /// GEMMs on `gemm_ex`.
    lt: Option<super::gemm_lt::LtGemm>,
    /// The most rows [`Gpu::linear`] and the decode step give the
    /// small-batch kernel ([`Gpu::small_gemv_rows`]); 0: none.
    small_gemv_rows: std::sync::atomic::AtomicUsize,
    /// Whether [`super::KernelLaunch`] launches with PDL now.
    pdl: std::sync::atomic::AtomicBool,
    /// Whether the decode step may turn PDL on ([`Gpu::pdl_allowed`]).
    pdl_allowed: bool,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    builds: Vec<KernelBuild>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// Bytes of the workspace handed to cuBLAS (`cublasSetWorkspace`), 32 MiB.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// The disk cache of compiled kernels: `$SPARDA_KERNEL_CACHE` if set, else
/// `$HOME/.cache/sparda-rt/kernels`; `None` when neither can be formed (the
/// kernels are then compiled every time).
pub fn kernel_cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("SPARDA_KERNEL_CACHE") {
        if !d.is_empty() {
            return Some(PathBuf::from(d));
        }
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache/sparda-rt/kernels"))
}

/// The CUDA include directory handed to NVRTC: `$CUDA_HOME/include` or
/// `$CUDA_PATH/include` when set, else `/usr/local/cuda/include`. (The
/// current kernels need no CUDA header; the path is there for later ones.)
pub fn cuda_include_dir() -> String {
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = std::env::var_os(var) {
            if !d.is_empty() {
                return PathBuf::from(d)
                    .join("include")
                    .to_string_lossy()
                    .into_owned();
            }
        }
    }
    "/usr/local/cuda/include".to_string()
}

/// The compute stream of a [`Gpu`]: the default stream priority, or the
/// context's greatest with `SPARDA_COMPUTE_PRIORITY=high`. With the copy
/// stream at the default priority (`SPARDA_COPY_PRIORITY=0`) and a fetch
/// grid of many short CTAs (`--prefetch-ctas` in the hundreds), the block
/// scheduler then starts pending GEMM and attention CTAs before further
/// fetch CTAs: an experiment against the wave of compute CTAs that waits
/// for SMs held by a persistent fetch kernel (traces/README.md). Priority
/// changes timing only, never results.
///
/// Errors: [`Error::Cuda`] when the stream cannot be created.
fn compute_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
    if std::env::var("SPARDA_COMPUTE_PRIORITY").as_deref() != Ok("high") {
        return ctx.new_stream().cuda("cuStreamCreate");
    }
    ctx.bind_to_thread()
        .cuda("binding the context (compute stream)")?;
    let (_least, greatest) =
        cudarc::driver::result::stream::get_priority_range().cuda("cuCtxGetStreamPriorityRange")?;
    ctx.new_stream_with_priority(greatest)
        .cuda("cuStreamCreateWithPriority (compute)")
}

/// NVRTC options for `arch` (e.g. "sm_90"): a real architecture, so NVRTC
/// emits a cubin and the driver does no JIT at load time ([`nvrtc_target`]:
/// sm_90 as sm_90a, whose wgmma the Hopper kernels use); then the options
/// of `$SPARDA_NVRTC_OPTIONS` ([`extra_nvrtc_options`]).
pub fn compile_options(arch: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={}", nvrtc_target(arch)),
        format!("--include-path={}", cuda_include_dir()),
        "-std=c++17".to_string(),
    ];
    o.extend(env_nvrtc_options());
    o
}

/// The NVRTC target of device architecture `arch`: "sm_90" compiles as
/// "sm_90a" (the same code for every instruction sm_90 has, plus the
/// architecture-specific wgmma of `kernels/wgmma.cuh`, which a cubin for
/// sm_90a runs only on a compute capability 9.0 device, the one it is
/// compiled for); every other architecture as itself.
pub fn nvrtc_target(arch: &str) -> &str {
    if arch == "sm_90" {
        "sm_90a"
    } else {
        arch
    }
}

/// Whether kernels compiled for `arch` have the sm_90a wgmma entry points
/// (`qa_prefill_scores_wg_*`; elsewhere they trap).
pub fn has_wgmma(arch: &str) -> bool {
    nvrtc_target(arch) == "sm_90a"
}

/// The extra NVRTC options of `$SPARDA_NVRTC_OPTIONS` ([`extra_nvrtc_options`]),
/// what [`compile_options`] appends and what the bench and gpu-check JSON
/// record.
pub fn env_nvrtc_options() -> Vec<String> {
    extra_nvrtc_options(std::env::var("SPARDA_NVRTC_OPTIONS").ok().as_deref())
}

/// Extra NVRTC options, whitespace-separated, appended to every kernel
/// source's compile: `-lineinfo` for Nsight source views, or `-DNAME=VALUE`
/// for a kernel's tuning constants that allow it (e.g. `GEMV_UNROLL` in
/// kernels/gemv.cu). They are part of the kernel cache's key, so a cubin
/// built with other options is never reused. An option NVRTC rejects fails
/// the compile with NVRTC's log and the options named.
pub fn extra_nvrtc_options(var: Option<&str>) -> Vec<String> {
    var.map_or_else(Vec::new, |v| {
        v.split_whitespace().map(str::to_string).collect()
    })
}

/// 128-bit FNV-1a (two 64-bit lanes with different offsets) of the parts,
/// each part length-prefixed; hex. Stable across Rust versions, unlike
/// `DefaultHasher`.
fn cache_key(parts: &[&[u8]]) -> String {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut a: u64 = 0xcbf2_9ce4_8422_2325;
    let mut b: u64 = 0x6c62_272e_07bb_0142;
    let mut feed = |bytes: &[u8]| {
        for &x in bytes {
            a = (a ^ x as u64).wrapping_mul(PRIME);
            b = (b ^ (x as u64).rotate_left(3)).wrapping_mul(PRIME);
            b = b.rotate_left(17);
        }
    };
    for p in parts {
        feed(&(p.len() as u64).to_le_bytes());
        feed(p);
    }
    format!("{a:016x}{b:016x}")
}

/// Compiles `src` with NVRTC and returns the cubin. Errors carry the NVRTC log.
fn nvrtc_compile(src: &str, name: &str, options: &[String]) -> Result<Vec<u8>> {
    let csrc = CString::new(src)
        .map_err(|_| Error::Cuda(format!("{name}: kernel source contains a NUL byte")))?;
    let cname = CString::new(name).map_err(|_| Error::Cuda(format!("{name}: bad program name")))?;
    let prog = nvrtc_result::create_program(&csrc, Some(&cname))
        .cuda(&format!("nvrtcCreateProgram({name})"))?;
    // SAFETY: `prog` was just created and is destroyed once below, on every path.
    let out = unsafe {
        let compiled = nvrtc_result::compile_program(prog, options);
        let log = nvrtc_result::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(Error::Cuda(format!(
                "NVRTC failed to compile kernels/{name} ({e}) with options {options:?}:\n{log}"
            ))),
            Ok(()) => {
                let mut size = 0usize;
                let r = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size);
                if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                    Err(Error::Cuda(format!(
                        "nvrtcGetCUBINSize({name}): {r:?}, size {size}"
                    )))
                } else {
                    let mut bin = vec![0u8; size];
                    let r = nvrtc_sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast());
                    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                        Err(Error::Cuda(format!("nvrtcGetCUBIN({name}): {r:?}")))
                    } else {
                        Ok(bin)
                    }
                }
            }
        }
    };
    // SAFETY: created above, not destroyed yet.
    unsafe { nvrtc_result::destroy_program(prog) }.cuda("nvrtcDestroyProgram")?;
    out
}

/// The NVRTC library version (major, minor).
fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: two valid out-pointers.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Cuda(format!("nvrtcVersion: {r:?}")));
    }
    Ok((major, minor))
}

/// Compiles every kernel source for `arch` (e.g. "sm_90") with NVRTC alone
/// (no driver or GPU needed) and returns (file, cubin) pairs. Used to check
/// the sources on machines with libnvrtc but no GPU.
///
/// Errors: [`Error::Cuda`] when libnvrtc is absent, or NVRTC's log for the
/// first source that fails.
pub fn compile_all(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    if !super::libraries().nvrtc {
        return Err(Error::Cuda("libnvrtc not found".into()));
    }
    let options = compile_options(arch);
    KERNEL_SOURCES
        .iter()
        .map(|s| Ok((s.file, nvrtc_compile(&s.full_text(), s.file, &options)?)))
        .collect()
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// concurrent reader never sees a partial cubin.
fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

impl Gpu {
    /// Opens device `ordinal`: context (event tracking off), one stream,
    /// every kernel of [`KERNEL_SOURCES`] (from the disk cache, or compiled
    /// for the device's `sm_XY` and cached), and a cuBLAS handle.
    ///
    /// Errors ([`Error::Cuda`]): a missing CUDA library (checked before any
    /// CUDA call, so never a panic), no such device, an NVRTC error (with its
    /// log), a module or cuBLAS failure. A cache directory that cannot be
    /// written is only a warning.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let missing = super::missing_libraries();
        if !missing.is_empty() {
            return Err(Error::Cuda(format!(
                "the GPU backend needs the CUDA 13 libraries; not found: {} (on a GPU machine set LD_LIBRARY_PATH=/usr/local/cuda/lib64)",
                missing.join(", ")
            )));
        }
        let ctx = CudaContext::new(ordinal)
            .cuda(&format!("creating a context on CUDA device {ordinal}"))?;
        // SAFETY: nothing was allocated or launched on this context yet, and this
        // backend keeps all work on one stream (spec/device.md).
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx
            .compute_capability()
            .cuda("cuDeviceGetAttribute(compute capability)")?;
        let mut driver_version = 0i32;
        // SAFETY: one valid out-pointer; the driver is loaded (context created).
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .cuda("cuDriverGetVersion")?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().cuda("cuDeviceGetName")?,
            compute_capability: cc,
            arch: format!("sm_{}{}", cc.0, cc.1),
            sm_count: ctx
                .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .cuda("cuDeviceGetAttribute(SM count)")?,
            total_mem_bytes: ctx.total_mem().cuda("cuDeviceTotalMem")?,
            driver_version,
            nvrtc_version: nvrtc_version()?,
        };
        let stream = compute_stream(&ctx)?;
        let (functions, builds) = Self::load_kernels(&ctx, &info)?;
        // The decode attention kernel takes more than the default 48 KiB of shared
        // memory at D = 128 (double-buffered K/V tiles): opt in once, here.
        if let Some(f) = functions.get("attn_partial") {
            let bytes = super::ops::attn_smem_bytes(super::ops::ATTN_MAX_HEAD_DIM);
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .cuda(&format!(
                "cuFuncSetAttribute(attn_partial, {bytes} bytes of dynamic shared memory)"
            ))?;
        }
        // The prefill attention kernels too (PF_STAGES stages of K/V tiles at D = 128;
        // the sparse ones add the bias tiles): past 48 KiB a launch needs the opt-in.
        for (name, bytes) in super::ops::prefill_smem_opt_ins() {
            if let Some(f) = functions.get(name) {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .cuda(&format!(
                    "cuFuncSetAttribute({name}, {bytes} bytes of dynamic shared memory)"
                ))?;
            }
        }
        // Every kernel of this backend prefers the largest shared-memory carveout:
        // the attention kernel needs it, and one carveout for all of them spares the
        // SMs a reconfiguration between consecutive kernels of a decode step.
        for f in functions.values() {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .cuda("cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)")?;
        }
        let blas = CudaBlas::new(stream.clone()).cuda("cublasCreate")?;
        // After CudaBlas::new (cublasSetStream resets the workspace to the default pool).
        let blas_workspace: CudaSlice<u8> = stream
            .alloc_zeros(CUBLAS_WORKSPACE_BYTES)
            .cuda("allocating the cuBLAS workspace")?;
        {
            let (wp, _g) = blas_workspace.device_ptr(&stream);
            // SAFETY: a live device buffer of the stated size, owned by the Gpu for
            // as long as the handle; the handle is bound to `stream`.
            unsafe {
                cublas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    wp as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()
            .cuda("cublasSetWorkspace")?;
        }
        let lt = if super::gemm_lt::lt_from_env(std::env::var("SPARDA_GEMM").ok().as_deref())? {
            Some(super::gemm_lt::LtGemm::new(stream.clone())?)
        } else {
            None
        };
        Ok(Gpu {
            functions,
            blas,
            _blas_workspace: blas_workspace,
            lt,
            small_gemv_rows: std::sync::atomic::AtomicUsize::new(small_gemv_rows_from_env(
                std::env::var("SPARDA_GEMV").ok().as_deref(),
            )?),
            pdl: std::sync::atomic::AtomicBool::new(false),
            pdl_allowed: pdl_from_env(std::env::var("SPARDA_PDL").ok().as_deref(), &info.arch),
            stream,
            ctx,
            info,
            builds,
        })
    }

    /// Compiles (or reads from the cache) and loads every kernel source.
    fn load_kernels(
        ctx: &Arc<CudaContext>,
        info: &DeviceInfo,
    ) -> Result<(HashMap<&'static str, CudaFunction>, Vec<KernelBuild>)> {
        let options = compile_options(&info.arch);
        let cache = kernel_cache_dir();
        let nvrtc = format!("nvrtc {}.{}", info.nvrtc_version.0, info.nvrtc_version.1);
        let mut functions = HashMap::new();
        let mut builds = Vec::new();
        for src in KERNEL_SOURCES {
            let t = Instant::now();
            let text = src.full_text();
            let opts = options.join("\u{1f}");
            let key = cache_key(&[
                text.as_bytes(),
                info.arch.as_bytes(),
                opts.as_bytes(),
                nvrtc.as_bytes(),
            ]);
            let stem = src.file.trim_end_matches(".cu");
            let path = cache
                .as_ref()
                .map(|d| d.join(format!("{stem}-{}-{key}.cubin", info.arch)));
            let mut cached = false;
            let mut module: Option<Arc<CudaModule>> = None;
            if let Some(p) = &path {
                if let Ok(bytes) = std::fs::read(p) {
                    match ctx.load_module(Ptx::from_binary(bytes)) {
                        Ok(m) => {
                            module = Some(m);
                            cached = true;
                        }
                        Err(e) => tracing::warn!(
                            "kernel cache {}: unusable ({e}); recompiling",
                            p.display()
                        ),
                    }
                }
            }
            let module = match module {
                Some(m) => m,
                None => {
                    let cubin = nvrtc_compile(&text, src.file, &options)?;
                    if let Some(p) = &path {
                        if let Err(e) = write_atomic(p, &cubin) {
                            tracing::warn!("kernel cache {}: cannot write ({e})", p.display());
                        }
                    }
                    ctx.load_module(Ptx::from_binary(cubin))
                        .cuda(&format!("cuModuleLoadData(kernels/{})", src.file))?
                }
            };
            for &f in src.functions {
                let func = module
                    .load_function(f)
                    .cuda(&format!("cuModuleGetFunction({f} in kernels/{})", src.file))?;
                functions.insert(f, func);
            }
            builds.push(KernelBuild {
                file: src.file.to_string(),
                cached,
                ms: t.elapsed().as_secs_f64() * 1e3,
                cache_path: path,
            });
        }
        Ok((functions, builds))
    }

    /// Has cuBLAS size its GEMMs for `sms` SMs (`cublasSetSmCountTarget`;
    /// 0 = all of the device's, the default): for GEMMs that run while
    /// another kernel holds some SMs (the prefetch copy kernel), so that
    /// a grid sized for the whole GPU does not spill into a second wave.
    /// Applies to GEMMs launched after the call.
    ///
    /// Errors: [`Error::Cuda`] when cuBLAS refuses the value (it must be
    /// 0 … the SM count).
    pub fn set_gemm_sm_target(&self, sms: usize) -> Result<()> {
        let n = i32::try_from(sms.min(self.info.sm_count.max(0) as usize)).unwrap_or(0);
        // SAFETY: the handle is live for as long as `self`; the value is
        // within 0 ..= the SM count.
        unsafe { cublas_sys::cublasSetSmCountTarget(*self.blas.handle(), n) }
            .result()
            .cuda(&format!("cublasSetSmCountTarget({n})"))
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// How each kernel source was obtained (cache hit or compile, time).
    pub fn kernel_builds(&self) -> &[KernelBuild] {
        &self.builds
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The one compute stream every operation of this backend runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cuBLAS handle (bound to [`Gpu::stream`]).
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// A loaded kernel by its `extern "C"` name.
    ///
    /// Errors: [`Error::Cuda`] for an unknown name.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| Error::Cuda(format!("no kernel named `{name}` is loaded")))
    }

    /// Waits for all work on the stream; surfaces asynchronous kernel errors.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .cuda("cuStreamSynchronize (an earlier kernel or copy failed)")
    }

    /// Sets the most rows (0 … [`super::ops::GEMV_MAX_N`]) that
    /// [`Gpu::linear`] and the decode step give the small-batch kernel
    /// `gemv` instead of cuBLAS; 0 sends every GEMM to cuBLAS. The default,
    /// [`DEFAULT_SMALL_GEMV_ROWS`], or `$SPARDA_GEMV`, is read when the
    /// context is created.
    pub fn set_small_gemv_rows(&self, rows: usize) {
        self.small_gemv_rows.store(
            rows.min(super::ops::GEMV_MAX_N),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The most rows the small-batch kernel takes now (0: it is off).
    pub fn small_gemv_rows(&self) -> usize {
        self.small_gemv_rows
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a GEMM of `n` rows may go to the small-batch kernel
    /// (1 ≤ n ≤ [`Gpu::small_gemv_rows`]; the shape is checked apart).
    pub fn small_gemv_takes(&self, n: usize) -> bool {
        n >= 1 && n <= self.small_gemv_rows()
    }

    /// Whether launches through [`super::KernelLaunch`] use programmatic
    /// dependent launch now (module [`super::launch`]).
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns PDL on or off for the launches that follow (on only where
    /// [`Gpu::pdl_allowed`]). The decode step turns it on around a
    /// GPU-resident step's launches and off after them.
    pub fn set_pdl(&self, on: bool) {
        self.pdl
            .store(on && self.pdl_allowed, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether PDL may be used: the device is sm_90 or later and
    /// `$SPARDA_PDL` is not `0` ([`pdl_from_env`]).
    pub fn pdl_allowed(&self) -> bool {
        self.pdl_allowed
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    ///
    /// Errors: [`Error::Cuda`] on a driver failure.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().cuda("cuMemGetInfo")
    }

    /// An event that records timing (for [`CudaEvent::elapsed_ms`]).
    ///
    /// Errors: [`Error::Cuda`] on a driver failure.
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .cuda("cuEventCreate")
    }

    /// Captures everything `enqueue` puts on [`Gpu::stream`], and on other
    /// streams that wait for its events and are waited for again before it
    /// returns (an offloaded step's copy stream), into a CUDA graph (relaxed
    /// capture mode) and instantiates it with each kernel at the priority of
    /// the stream it was captured on; nothing runs until the graph is
    /// launched. `enqueue` must not allocate, copy from the
    /// host or synchronise. The capture is always ended, also when
    /// `enqueue` fails.
    ///
    /// Errors: `enqueue`'s error; [`Error::Cuda`] when capture or
    /// instantiation fails (e.g. an operation that cannot be captured).
    pub fn capture(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .cuda("cuStreamBeginCapture")?;
        let r = enqueue();
        let g = self
            .stream
            // kernels keep the priority of the stream they were captured on
            // (the copy stream's prefetch above compute)
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)
            .cuda("cuStreamEndCapture / cuGraphInstantiate");
        r?;
        g?.ok_or_else(|| Error::Cuda("stream capture produced an empty graph".into()))
    }

    /// Copies host data to a new device buffer (stream-ordered).
    ///
    /// Errors: [`Error::Cuda`] naming the copy, its elements and bytes (e.g.
    /// out of device memory).
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).cuda(&format!(
            "host→device copy of {}",
            elements::<T>(host.len())
        ))
    }

    /// A new zero-filled device buffer of `len` elements.
    ///
    /// Errors: [`Error::Cuda`] naming the allocation, its elements and
    /// bytes (e.g. out of device memory).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(len)
            .cuda(&format!("allocating {}", elements::<T>(len)))
    }

    /// Copies a device buffer (or view) to the host, after all earlier work
    /// on the stream; synchronises.
    ///
    /// Errors: [`Error::Cuda`] naming the copy and its elements (an earlier
    /// kernel's failure surfaces here too).
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, dev: &S) -> Result<Vec<T>> {
        let v = self
            .stream
            .clone_dtoh(dev)
            .cuda(&format!("device→host copy of {}", elements::<T>(dev.len())))?;
        self.synchronize()?;
        Ok(v)
    }

    /// bf16 linear layer through cuBLAS `gemm_ex`, f32 accumulation:
    /// y[n, out] = x[n, in] · W[out, in]ᵀ, all row-major (W in the Hugging
    /// Face `[out_features, in_features]` layout, as stored).
    ///
    /// cuBLAS is column-major. A row-major [r, c] matrix is the column-major
    /// [c, r] matrix with leading dimension c, i.e. its transpose. So the
    /// call computes yᵀ[out, n] = W[out, in] · xᵀ[in, n] in column-major
    /// terms: A = W seen as column-major [in, out] (lda = in) with op(A) = Aᵀ
    /// (CUBLAS_OP_T), B = x seen as column-major [in, n] (ldb = in) with
    /// op(B) = B (CUBLAS_OP_N), C = y seen as column-major [out, n]
    /// (ldc = out); m = out, n = n, k = in. No copy or transpose is made.
    ///
    /// `y` is [`Bf16`] (activations, rounded from the f32 accumulator) or
    /// f32 (logits). `n = 0` is a no-op.
    ///
    /// When [`Gpu::small_gemv_takes`] n rows, small batches that `gemv` takes
    /// ([`super::ops::gemv_fits`]: n ≤ [`super::ops::GEMV_MAX_N`], `in` a
    /// multiple of 8, the input within its shared memory) with 16-byte
    /// aligned x and W go to the memory-bound kernel `gemv`
    /// (kernels/gemv.cu; same result up to summation order).
    ///
    /// Errors: [`Error::Input`] when x is not n·in, W not out·in or y not
    /// n·out elements, or a dimension exceeds i32; [`Error::Cuda`] on a
    /// cuBLAS failure.
    pub fn linear<O: GemmOut, X: DevicePtr<Bf16>, W: DevicePtr<Bf16>, Y: DevicePtrMut<O>>(
        &self,
        x: &X,
        n: usize,
        in_features: usize,
        w: &W,
        out_features: usize,
        y: &mut Y,
    ) -> Result<()> {
        let bad = |what: &str, got: usize, want: usize| {
            Error::Input(format!(
                "linear [{n}, {in_features}] x [{out_features}, {in_features}]^T: {what} has {got} elements, expected {want}"
            ))
        };
        if x.len() != n * in_features {
            return Err(bad("x", x.len(), n * in_features));
        }
        if w.len() != out_features * in_features {
            return Err(bad("W", w.len(), out_features * in_features));
        }
        if y.len() != n * out_features {
            return Err(bad("y", y.len(), n * out_features));
        }
        if n == 0 || out_features == 0 {
            return Ok(());
        }
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (yp, _gy) = y.device_ptr_mut(&self.stream);
        if self.small_gemv_takes(n)
            && super::ops::gemv_fits(n, in_features)
            && xp.is_multiple_of(16)
            && wp.is_multiple_of(16)
        {
            let y = if O::IS_F32 {
                super::ops::GemvOutput::F32(yp)
            } else {
                super::ops::GemvOutput::Bf16(yp)
            };
            let args = super::ops::GemvArgs {
                x: super::ops::GemvInput::Bf16(xp),
                w: wp,
                y,
                n,
                in_features,
                out_features,
            };
            // SAFETY: x holds n·in, W out·in and y n·out elements (checked
            // above), y is a distinct output buffer.
            return unsafe { super::ops::launch_gemv(self, &args) };
        }
        // SAFETY: the pointers are live device buffers of the checked sizes.
        unsafe {
            self.gemm_ex_bf16(
                xp,
                wp,
                yp,
                O::DTYPE,
                (n, in_features, out_features),
                1.0,
                0.0,
                "",
            )
        }
    }

    /// The one cuBLAS `gemm_ex` of [`Gpu::linear`] and
    /// [`Gpu::linear_into_residual`]: y = α · x · Wᵀ + β · y, x bf16
    /// [n, in] and W bf16 [out, in] row-major, y [n, out] of `y_type`, f32
    /// accumulation (the column-major reading is [`Gpu::linear`]'s); `what`
    /// ends the error's description. n = 0 or out = 0 is a no-op.
    ///
    /// Errors: [`Error::Input`] when a dimension exceeds i32;
    /// [`Error::Cuda`] on a cuBLAS failure.
    ///
    /// # Safety
    /// x, W and y must be live device buffers of those sizes, y distinct
    /// from x and W.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_ex_bf16(
        &self,
        x: u64,
        w: u64,
        y: u64,
        y_type: cublas_sys::cudaDataType,
        (n, in_features, out_features): (usize, usize, usize),
        alpha: f32,
        beta: f32,
        what: &str,
    ) -> Result<()> {
        if n == 0 || out_features == 0 {
            return Ok(());
        }
        let (m, rows, k) = (
            i32_dim(out_features, "out_features")?,
            i32_dim(n, "n")?,
            i32_dim(in_features, "in_features")?,
        );
        if let Some(lt) = &self.lt {
            let f32_out = y_type == cublas_sys::cudaDataType::CUDA_R_32F;
            // SAFETY: forwarded from this function's contract; the timing
            // candidate writes a scratch output of the same shape and type.
            let ex = |y: u64| unsafe {
                self.cublas_gemm_ex(x, w, y, y_type, (m, rows, k), 1.0, 0.0, what)
            };
            // SAFETY: forwarded from this function's contract.
            if unsafe {
                lt.run(
                    self,
                    (x, w, y),
                    (n, in_features, out_features),
                    f32_out,
                    alpha,
                    beta,
                    &ex,
                )
            }? {
                return Ok(());
            }
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { self.cublas_gemm_ex(x, w, y, y_type, (m, rows, k), alpha, beta, what) }
    }

    /// cuBLAS `gemm_ex` itself for [`Gpu::gemm_ex_bf16`], with the
    /// dimensions (out, rows, in) already checked to fit i32.
    ///
    /// # Safety
    /// As [`Gpu::gemm_ex_bf16`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn cublas_gemm_ex(
        &self,
        x: u64,
        w: u64,
        y: u64,
        y_type: cublas_sys::cudaDataType,
        (m, rows, k): (i32, i32, i32),
        alpha: f32,
        beta: f32,
        what: &str,
    ) -> Result<()> {
        // SAFETY: the caller vouches for the buffers; alpha/beta are host f32
        // as the default pointer mode and the 32F compute type expect; the
        // handle is bound to our stream.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                rows,
                k,
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k,
                x as *const std::ffi::c_void,
                cublas_sys::cudaDataType::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                y as *mut std::ffi::c_void,
                y_type,
                m,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .cuda(&format!(
            "cublasGemmEx bf16 [{rows}, {k}] x [{m}, {k}]^T{what}"
        ))
    }

    /// Adds a bf16 linear layer into the f32 residual stream through one
    /// cuBLAS `gemm_ex` with β = 1: r[n, out] += scale · (x[n, in] ·
    /// W[out, in]ᵀ), f32 accumulation, row-major as in [`Gpu::linear`]. The
    /// product is added unrounded (the `gemv` residual fold and the unfused
    /// step round it to bf16 first; spec/nosa-model.md §7).
    ///
    /// Errors: [`Error::Input`] when a dimension exceeds i32;
    /// [`Error::Cuda`] on a cuBLAS failure.
    ///
    /// # Safety
    /// `x` must be a live device buffer of n·in bf16, `w` of out·in bf16 and
    /// `resid` of n·out f32, `resid` overlapping neither.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear_into_residual(
        &self,
        x: u64,
        n: usize,
        in_features: usize,
        w: u64,
        out_features: usize,
        resid: u64,
        scale: f32,
    ) -> Result<()> {
        // SAFETY: the caller vouches for the buffers (this function's contract).
        unsafe {
            self.gemm_ex_bf16(
                x,
                w,
                resid,
                cublas_sys::cudaDataType::CUDA_R_32F,
                (n, in_features, out_features),
                scale,
                1.0,
                " added into the f32 residual",
            )
        }
    }
}

/// Raw device address of a buffer a kernel reads (event tracking is off on
/// this backend's context, so the guard cudarc returns does nothing).
pub(crate) fn dptr<T, S: DevicePtr<T>>(gpu: &Gpu, s: &S) -> u64 {
    let (p, _guard) = s.device_ptr(gpu.stream());
    p
}

/// Raw device address of a buffer a kernel writes.
pub(crate) fn dptr_mut<T, S: DevicePtrMut<T>>(gpu: &Gpu, s: &mut S) -> u64 {
    let (p, _guard) = s.device_ptr_mut(gpu.stream());
    p
}

/// A grid dimension as u32, or [`Error::Input`] naming it.
pub(crate) fn grid(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::Input(format!("{what} = {x} exceeds the CUDA grid limit")))
}

/// "N elements of B bytes (X GiB)", for allocation and copy errors.
pub(crate) fn elements<T>(n: usize) -> String {
    let b = std::mem::size_of::<T>();
    format!(
        "{n} elements of {b} bytes ({} GiB)",
        crate::memory::gib(n.saturating_mul(b))
    )
}

/// `x` as an i32 kernel/cuBLAS argument, or [`Error::Input`] naming it.
pub(crate) fn i32_dim(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| {
        Error::Input(format!(
            "{what} = {x} exceeds the i32 range of the GPU kernels"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sm_90_compiles_as_sm_90a_and_only_it_has_wgmma() {
        assert_eq!(nvrtc_target("sm_90"), "sm_90a");
        assert!(compile_options("sm_90")
            .iter()
            .any(|o| o == "--gpu-architecture=sm_90a"));
        for a in ["sm_80", "sm_86", "sm_89", "sm_100", "sm_120"] {
            assert_eq!(nvrtc_target(a), a);
            assert!(!has_wgmma(a), "{a}");
        }
        assert!(has_wgmma("sm_90"));
    }

    #[test]
    fn pdl_needs_sm_90_and_is_off_only_when_the_variable_is_zero() {
        assert!(pdl_from_env(None, "sm_90"));
        assert!(pdl_from_env(Some("1"), "sm_90a"));
        assert!(pdl_from_env(Some("1"), "sm_100"));
        assert!(!pdl_from_env(Some("0"), "sm_90"));
        assert!(!pdl_from_env(None, "sm_89"));
        assert!(!pdl_from_env(Some("1"), "sm_80"));
        assert!(!pdl_from_env(None, "compute"));
    }

    #[test]
    fn small_gemv_rows_default_to_one_and_reject_what_the_kernel_cannot_take() {
        assert_eq!(
            small_gemv_rows_from_env(None).unwrap(),
            DEFAULT_SMALL_GEMV_ROWS
        );
        assert_eq!(small_gemv_rows_from_env(Some("")).unwrap(), 1);
        assert_eq!(small_gemv_rows_from_env(Some("0")).unwrap(), 0);
        assert_eq!(small_gemv_rows_from_env(Some(" 4 ")).unwrap(), 4);
        for bad in ["5", "on", "-1"] {
            let e = small_gemv_rows_from_env(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains("SPARDA_GEMV") && e.contains("0 (off) to 4"),
                "{e}"
            );
        }
    }

    #[test]
    fn cache_key_depends_on_every_part() {
        let k = cache_key(&[b"src", b"sm_90", b"opts"]);
        assert_eq!(k.len(), 32);
        assert_eq!(k, cache_key(&[b"src", b"sm_90", b"opts"]));
        assert_ne!(k, cache_key(&[b"src", b"sm_80", b"opts"]));
        assert_ne!(k, cache_key(&[b"src ", b"sm_90", b"opts"]));
        // Length prefixes keep part boundaries apart.
        assert_ne!(cache_key(&[b"ab", b"c"]), cache_key(&[b"a", b"bc"]));
    }

    #[test]
    fn extra_nvrtc_options_split_on_whitespace() {
        assert!(extra_nvrtc_options(None).is_empty());
        assert!(extra_nvrtc_options(Some("  ")).is_empty());
        assert_eq!(
            extra_nvrtc_options(Some(" -DGEMV_UNROLL=8\t-lineinfo ")),
            vec!["-DGEMV_UNROLL=8".to_string(), "-lineinfo".to_string()]
        );
    }

    /// Needs libnvrtc (a CUDA machine, or LD_LIBRARY_PATH pointing at an
    /// NVRTC install such as the `nvidia-cuda-nvrtc` wheel's lib folder), so
    /// it is ignored by default instead of passing without checking:
    /// `cargo test --release --lib nvrtc -- --ignored`.
    #[test]
    #[ignore = "needs libnvrtc: run with --ignored where it loads"]
    fn nvrtc_compiles_every_kernel() {
        assert!(
            crate::cuda::libraries().nvrtc,
            "libnvrtc does not load here (set LD_LIBRARY_PATH)"
        );
        let bins = compile_all("sm_90").expect("kernels compile for sm_90");
        assert_eq!(bins.len(), KERNEL_SOURCES.len());
        // scripts/nvrtc.sh --resources: the cubins, for cuobjdump's register and
        // shared-memory counts per kernel
        let dump = std::env::var_os("SPARDA_CUBIN_DIR")
            .filter(|d| !d.is_empty())
            .map(std::path::PathBuf::from);
        for (f, b) in bins {
            // ELF magic: a cubin, not PTX text.
            assert_eq!(&b[..4], b"\x7fELF", "{f} did not produce a cubin");
            if let Some(dir) = &dump {
                let path = dir.join(f.replace(".cu", ".cubin"));
                std::fs::write(&path, &b).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }

    /// Whether `text` defines the kernel `f` ([`kernels_defined`]).
    fn defines_kernel(text: &str, f: &str) -> bool {
        kernels_defined(text).iter().any(|k| k == f)
    }

    #[test]
    fn a_kernel_stamped_by_a_macro_counts_and_a_missing_one_does_not() {
        let text = "#define K(NAME, N) void NAME(int)\nK(gemv1, 1)\nK(gemv2, 2)\nfoo(gemv3, 3)\n";
        assert!(defines_kernel(text, "gemv1"));
        assert!(defines_kernel(text, "gemv2"));
        assert!(!defines_kernel(text, "gemv3"));
        assert!(!defines_kernel(text, "gemv4"));
        assert!(defines_kernel("extern \"C\" __global__ void f(int x)", "f"));
    }

    #[test]
    fn every_kernel_source_is_embedded_and_names_its_functions() {
        for s in KERNEL_SOURCES {
            for f in s.functions {
                assert!(defines_kernel(s.text, f), "{} lacks {f}", s.file);
            }
            assert!(s.full_text().starts_with(COMMON_PRELUDE));
        }
    }

    /// The kernels `text` defines: `extern "C" __global__ … void f(` (a
    /// macro's upper-case parameter left out) and lines stamping one by a
    /// macro (`GEMV_KERNEL(f, 1, false)`).
    fn kernels_defined(text: &str) -> Vec<String> {
        let ident = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        let mut out = Vec::new();
        for part in text.split("extern \"C\" __global__").skip(1) {
            if let Some((_, after)) = part.split_once("void ") {
                let f = ident(after.trim_start());
                if f.chars().any(|c| c.is_ascii_lowercase()) {
                    out.push(f);
                }
            }
        }
        for l in text.lines() {
            if let Some((name, rest)) = l.split_once('(') {
                let f = ident(rest);
                if !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                    && rest[f.len()..].starts_with(',')
                    && f.starts_with(|c: char| c.is_ascii_lowercase())
                {
                    out.push(f);
                }
            }
        }
        out
    }

    #[test]
    fn every_kernel_a_source_defines_is_loaded() {
        let text = "#define K(NAME, N) extern \"C\" __global__ void NAME(int)\nK(gemv1, 1)\n\
                    extern \"C\" __global__ __launch_bounds__(64) void f(int x)\n";
        assert_eq!(kernels_defined(text), ["f", "gemv1"]);
        for s in KERNEL_SOURCES {
            for f in kernels_defined(s.text) {
                assert!(
                    s.functions.contains(&f.as_str()),
                    "{} defines {f}, which its functions do not list (it would not load)",
                    s.file
                );
            }
        }
    }
}
