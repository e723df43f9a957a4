//! cuBLASLt GEMMs for prefill-sized linear layers, with the algorithm chosen
//! per shape by timing (opt-in: `SPARDA_GEMM=lt`).
//!
//! cuBLAS's `gemm_ex` picks one kernel per shape by heuristic. For the
//! prefill GEMMs of a chunk (rows = the chunk, 1024 tokens by default) the
//! tile it picks may leave a partial last wave on the SMs; cuBLASLt offers
//! several algorithms (tile, split-K, stages, cluster) per shape. The first
//! time [`super::Gpu::linear`] meets a shape of at least
//! [`LT_MIN_ROWS`] rows outside a graph capture, the GPU times `gemm_ex`
//! and each algorithm of the heuristic's list on the real inputs (into a
//! scratch output) and keeps the fastest; `gemm_ex` stays where it wins.
//! The products are equal up to f32 summation order (split-K reorders the
//! sums), so a run's choice is fixed for the life of the [`super::Gpu`].

use super::context::CudaResultExt;
use crate::{Error, Result};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Fewest rows (tokens) a GEMM needs to go through cuBLASLt; fewer stay on
/// `gemm_ex` (decode steps, and everything captured into CUDA graphs).
pub const LT_MIN_ROWS: usize = 256;

/// Bytes of cuBLASLt's own workspace, 32 MiB (split-K partial sums).
pub const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// Algorithms of the heuristic's list timed per shape.
const LT_CANDIDATES: usize = 8;

/// Whether `SPARDA_GEMM` asks for cuBLASLt: `lt` yes, unset/empty or `cublas`
/// no.
///
/// Errors: [`Error::Input`] naming `SPARDA_GEMM` and its value otherwise.
pub fn lt_from_env(v: Option<&str>) -> Result<bool> {
    match v.map(str::trim) {
        None | Some("") | Some("cublas") => Ok(false),
        Some("lt") => Ok(true),
        Some(o) => Err(Error::Input(format!(
            "SPARDA_GEMM = {o:?}: expected \"lt\" (cuBLASLt, algorithm timed per shape) or \"cublas\""
        ))),
    }
}

/// One GEMM shape: rows n, in k, out m, and whether y is f32 (else bf16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    n: usize,
    k: usize,
    m: usize,
    f32_out: bool,
}

/// The descriptors and chosen algorithm of one shape.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

impl Plan {
    /// Descriptors of y[n, m] = x[n, k] · W[m, k]ᵀ (column-major: C[m, n] =
    /// op(A)[m, k] · B[k, n], A = W read transposed).
    fn new(s: Shape) -> Result<Self> {
        let st = |r: lt::cublasStatus_t, what: &str| -> Result<()> {
            if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                Ok(())
            } else {
                Err(Error::Cuda(format!("{what}: {r:?}")))
            }
        };
        let bf = lt::cudaDataType_t::CUDA_R_16BF;
        let out = if s.f32_out {
            lt::cudaDataType_t::CUDA_R_32F
        } else {
            bf
        };
        let mut p = Plan {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            // SAFETY: a plain-data struct of integers.
            algo: unsafe { std::mem::zeroed() },
        };
        // SAFETY: out-pointers to fields of `p`, which Drop destroys once set.
        unsafe {
            st(
                lt::cublasLtMatmulDescCreate(
                    &mut p.desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType_t::CUDA_R_32F,
                ),
                "cublasLtMatmulDescCreate",
            )?;
            let t: i32 = 1; // CUBLAS_OP_T
            st(
                lt::cublasLtMatmulDescSetAttribute(
                    p.desc,
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    (&t as *const i32).cast(),
                    std::mem::size_of_val(&t),
                ),
                "cublasLtMatmulDescSetAttribute(TRANSA)",
            )?;
            let (n, k, m) = (s.n as u64, s.k as u64, s.m as u64);
            st(
                lt::cublasLtMatrixLayoutCreate(&mut p.a, bf, k, m, k as i64),
                "layout W",
            )?;
            st(
                lt::cublasLtMatrixLayoutCreate(&mut p.b, bf, k, n, k as i64),
                "layout x",
            )?;
            st(
                lt::cublasLtMatrixLayoutCreate(&mut p.c, out, m, n, m as i64),
                "layout y",
            )?;
        }
        Ok(p)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by Plan::new (or is null, which the
        // destroy functions accept) and is destroyed once.
        unsafe {
            lt::cublasLtMatrixLayoutDestroy(self.a);
            lt::cublasLtMatrixLayoutDestroy(self.b);
            lt::cublasLtMatrixLayoutDestroy(self.c);
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// A cuBLASLt handle bound to the GPU's stream, its workspace, and the plan
/// chosen per shape (`None`: `gemm_ex` won).
pub(crate) struct LtGemm {
    handle: lt::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    plans: parking_lot::Mutex<HashMap<Shape, Option<Plan>>>,
}

// SAFETY: the handle and descriptors are only used under the `plans` lock or
// with the stream they belong to; cuBLASLt handles may be shared by threads.
unsafe impl Send for LtGemm {}
// SAFETY: as for Send.
unsafe impl Sync for LtGemm {}

impl Drop for LtGemm {
    fn drop(&mut self) {
        self.plans.get_mut().clear();
        // SAFETY: created in LtGemm::new, destroyed once, after its plans.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

impl LtGemm {
    /// A handle and its workspace on `stream`.
    ///
    /// Errors: [`Error::Cuda`] when the handle or workspace cannot be made.
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: an out-pointer.
        let r = unsafe { lt::cublasLtCreate(&mut handle) };
        if r != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(Error::Cuda(format!("cublasLtCreate: {r:?}")));
        }
        let workspace = stream
            .alloc_zeros::<u8>(LT_WORKSPACE_BYTES)
            .cuda("allocating the cuBLASLt workspace")?;
        Ok(LtGemm {
            handle,
            workspace,
            stream,
            plans: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    /// Runs y = α · x · Wᵀ + β · y (x bf16 [n, k], W bf16 [m, k], y [n, m]
    /// f32 or bf16) through cuBLASLt when n ≥ [`LT_MIN_ROWS`] and this
    /// shape's timing chose a cuBLASLt algorithm; the first call of a shape
    /// outside a capture times the choice (`gemm_ex` runs the candidate
    /// `gemm_ex` into a scratch output). Returns whether it ran the GEMM;
    /// `false`: the caller runs `gemm_ex`.
    ///
    /// Errors: [`Error::Cuda`] on a cuBLASLt or driver failure.
    ///
    /// # Safety
    /// x, W and y must be live device buffers of those sizes, y distinct
    /// from x and W.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run(
        &self,
        gpu: &super::Gpu,
        (x, w, y): (u64, u64, u64),
        (n, k, m): (usize, usize, usize),
        f32_out: bool,
        alpha: f32,
        beta: f32,
        gemm_ex: &dyn Fn(u64) -> Result<()>,
    ) -> Result<bool> {
        if n < LT_MIN_ROWS {
            return Ok(false);
        }
        let s = Shape { n, k, m, f32_out };
        let mut plans = self.plans.lock();
        if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(s) {
            use cudarc::driver::sys::CUstreamCaptureStatus as C;
            let capturing = self
                .stream
                .capture_status()
                .cuda("cuStreamGetCaptureInfo")?;
            if capturing != C::CU_STREAM_CAPTURE_STATUS_NONE {
                return Ok(false);
            }
            // SAFETY: forwarded from this function's contract.
            let plan = unsafe { self.tune(gpu, s, x, w, gemm_ex)? };
            e.insert(plan);
        }
        let Some(Some(p)) = plans.get(&s) else {
            return Ok(false);
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.matmul(p, x, w, y, alpha, beta) }?;
        Ok(true)
    }

    /// One cuBLASLt matmul of plan `p` on the stream.
    unsafe fn matmul(&self, p: &Plan, x: u64, w: u64, y: u64, alpha: f32, beta: f32) -> Result<()> {
        let (ws, _g) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the caller vouches for x, W and y; the workspace is ours.
        let r = unsafe {
            lt::cublasLtMatmul(
                self.handle,
                p.desc,
                (&alpha as *const f32).cast(),
                w as *const c_void,
                p.a,
                x as *const c_void,
                p.b,
                (&beta as *const f32).cast(),
                y as *const c_void,
                p.c,
                y as *mut c_void,
                p.c,
                &p.algo,
                ws as *mut c_void,
                LT_WORKSPACE_BYTES,
                self.stream.cu_stream() as lt::cudaStream_t,
            )
        };
        if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(Error::Cuda(format!("cublasLtMatmul: {r:?}")))
        }
    }

    /// Times `gemm_ex` and up to [`LT_CANDIDATES`] heuristic algorithms on
    /// shape `s` into a scratch output (β = 0) and returns the plan of the
    /// fastest algorithm, or `None` when `gemm_ex` is as fast (within 1 %),
    /// no algorithm fits, or the scratch output cannot be allocated.
    unsafe fn tune(
        &self,
        gpu: &super::Gpu,
        s: Shape,
        x: u64,
        w: u64,
        gemm_ex: &dyn Fn(u64) -> Result<()>,
    ) -> Result<Option<Plan>> {
        let bytes = s.n * s.m * if s.f32_out { 4 } else { 2 };
        let Ok(scratch) = self.stream.alloc_zeros::<u8>(bytes) else {
            return Ok(None);
        };
        let (yp, _g) = scratch.device_ptr(&self.stream);
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            f()?;
            let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
            a.record(&self.stream).cuda("cuEventRecord")?;
            for _ in 0..5 {
                f()?;
            }
            b.record(&self.stream).cuda("cuEventRecord")?;
            b.synchronize().cuda("cuEventSynchronize")?;
            Ok(a.elapsed_ms(&b).cuda("cuEventElapsedTime")? as f64 / 5.0)
        };
        let base = time(&|| gemm_ex(yp))?;
        let mut plan = Plan::new(s)?;
        let mut pref = std::ptr::null_mut();
        let mut found: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            // SAFETY: plain-data structs.
            vec![unsafe { std::mem::zeroed() }; LT_CANDIDATES];
        let mut count = 0i32;
        // SAFETY: out-pointers and the plan's live descriptors; the preference
        // is destroyed below.
        unsafe {
            if lt::cublasLtMatmulPreferenceCreate(&mut pref)
                != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            {
                return Ok(None);
            }
            let ws = LT_WORKSPACE_BYTES as u64;
            lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            );
            let r = lt::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                pref,
                LT_CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            );
            lt::cublasLtMatmulPreferenceDestroy(pref);
            if r != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Ok(None);
            }
        }
        let mut best: Option<(f64, usize)> = None;
        for (i, h) in found.iter().take(count.max(0) as usize).enumerate() {
            if h.state != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                continue;
            }
            plan.algo = h.algo;
            // SAFETY: scratch holds n·m outputs; x and W are the caller's.
            let Ok(ms) = time(&|| unsafe { self.matmul(&plan, x, w, yp, 1.0, 0.0) }) else {
                continue;
            };
            if best.is_none_or(|(b, _)| ms < b) {
                best = Some((ms, i));
            }
        }
        let chosen = best.filter(|&(ms, _)| ms < 0.99 * base);
        eprintln!(
            "cuBLASLt [{}, {}] x [{}, {}]^T{}: gemm_ex {base:.4} ms, best of {count} algorithms {} → {}",
            s.n,
            s.k,
            s.m,
            s.k,
            if s.f32_out { " (f32 out)" } else { "" },
            best.map_or("none".into(), |b| format!("{:.4} ms", b.0)),
            if chosen.is_some() { "cuBLASLt" } else { "gemm_ex" }
        );
        Ok(chosen.map(|(_, i)| {
            plan.algo = found[i].algo;
            plan
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparda_gemm_values() {
        assert!(!lt_from_env(None).unwrap());
        assert!(!lt_from_env(Some("")).unwrap());
        assert!(!lt_from_env(Some("cublas")).unwrap());
        assert!(lt_from_env(Some("lt")).unwrap());
        assert!(lt_from_env(Some(" lt ")).unwrap());
        let e = lt_from_env(Some("cutlass")).unwrap_err().to_string();
        assert!(e.contains("SPARDA_GEMM") && e.contains("cutlass"), "{e}");
    }
}
