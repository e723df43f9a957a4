//! Times the prefill layer GEMMs of a model shape (y[n, out] = x[n, in] ·
//! W[out, in]ᵀ, bf16, f32 accumulation) through the engine's cuBLAS
//! `gemm_ex` and through every cuBLASLt algorithm its heuristic offers, and
//! prints TFLOP/s per (shape, rows, algorithm) as JSON lines.
//!
//! A study, not part of the engine: it tells whether choosing the cuBLASLt
//! algorithm per shape would pay.
//! Usage: `prefill_gemm_algos [rows …]` (default 1024 2048); the shapes are
//! NOSA-8B's (hidden 4096, QKV 4608, gate|up 28672, down in 14336).
use cudarc::cublaslt::sys as lt;
use sparda::cuda::Gpu;
use std::ffi::c_void;

fn check(s: lt::cublasStatus_t, what: &str) {
    assert_eq!(s, lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS, "{what}");
}

/// `n` values uniform in [-0.5, 0.5) from an xorshift generator seeded by `seed`.
fn random_bf16(n: usize, seed: u64) -> Vec<sparda::cuda::Bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            sparda::cuda::Bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        })
        .collect()
}

fn main() {
    let rows: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("rows"))
        .collect();
    let rows = if rows.is_empty() {
        vec![1024, 2048]
    } else {
        rows
    };
    let gpu = Gpu::new(0).expect("gpu");
    let stream = gpu.stream().clone();
    let shapes = [
        ("qkv", 4096usize, 4608usize),
        ("o_proj", 4096, 4096),
        ("gate_up", 4096, 28672),
        ("down", 14336, 4096),
    ];
    let max_n = *rows.iter().max().unwrap();
    // random values: tensor cores switch less (and clock higher) on zeros
    let x = gpu.upload(&random_bf16(max_n * 14336, 1)).unwrap();
    let w = gpu.upload(&random_bf16(28672 * 4096, 2)).unwrap();
    let mut y = gpu.zeros::<sparda::cuda::Bf16>(max_n * 28672).unwrap();
    let ws_bytes = 64usize << 20;
    let ws = gpu.zeros::<u8>(ws_bytes).unwrap();
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let (xp, _g1) = x.device_ptr(&stream);
    let (wp, _g2) = w.device_ptr(&stream);
    let yp = {
        let (p, _g) = y.device_ptr_mut(&stream);
        p
    };
    let (wsp, _g4) = ws.device_ptr(&stream);
    let cu_stream = stream.cu_stream() as lt::cudaStream_t;
    let mut handle: lt::cublasLtHandle_t = std::ptr::null_mut();
    unsafe { check(lt::cublasLtCreate(&mut handle), "create") };
    let time = |f: &mut dyn FnMut()| -> f64 {
        for _ in 0..3 {
            f();
        }
        let (a, b) = (gpu.timing_event().unwrap(), gpu.timing_event().unwrap());
        let reps = 20;
        a.record(&stream).unwrap();
        for _ in 0..reps {
            f();
        }
        b.record(&stream).unwrap();
        b.synchronize().unwrap();
        a.elapsed_ms(&b).unwrap() as f64 / reps as f64
    };
    for &n in &rows {
        for &(name, k, m) in &shapes {
            let flop = 2.0 * n as f64 * k as f64 * m as f64;
            let ms = time(&mut || {
                gpu.linear(
                    &x.slice(0..n * k),
                    n,
                    k,
                    &w.slice(0..m * k),
                    m,
                    &mut y.slice_mut(0..n * m),
                )
                .unwrap()
            });
            println!(
                "{{\"gemm\":\"{name}\",\"rows\":{n},\"in\":{k},\"out\":{m},\"algo\":\"gemm_ex\",\"ms\":{ms:.4},\"tflops\":{:.1}}}",
                flop / ms / 1e9
            );
            unsafe {
                let mut desc: lt::cublasLtMatmulDesc_t = std::ptr::null_mut();
                check(
                    lt::cublasLtMatmulDescCreate(
                        &mut desc,
                        lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        lt::cudaDataType_t::CUDA_R_32F,
                    ),
                    "desc",
                );
                let t: i32 = 1; // CUBLAS_OP_T
                check(
                    lt::cublasLtMatmulDescSetAttribute(
                        desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                        &t as *const _ as *const c_void,
                        std::mem::size_of_val(&t),
                    ),
                    "transa",
                );
                let bf = lt::cudaDataType_t::CUDA_R_16BF;
                let mut la = std::ptr::null_mut();
                let mut lb = std::ptr::null_mut();
                let mut lc = std::ptr::null_mut();
                check(
                    lt::cublasLtMatrixLayoutCreate(&mut la, bf, k as u64, m as u64, k as i64),
                    "la",
                );
                check(
                    lt::cublasLtMatrixLayoutCreate(&mut lb, bf, k as u64, n as u64, k as i64),
                    "lb",
                );
                check(
                    lt::cublasLtMatrixLayoutCreate(&mut lc, bf, m as u64, n as u64, m as i64),
                    "lc",
                );
                let mut pref = std::ptr::null_mut();
                check(lt::cublasLtMatmulPreferenceCreate(&mut pref), "pref");
                check(lt::cublasLtMatmulPreferenceSetAttribute(pref, lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes as *const _ as *const c_void, 8), "pref ws");
                let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> =
                    vec![std::mem::zeroed(); 32];
                let mut cnt = 0;
                check(
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        handle,
                        desc,
                        la,
                        lb,
                        lc,
                        lc,
                        pref,
                        32,
                        res.as_mut_ptr(),
                        &mut cnt,
                    ),
                    "heuristic",
                );
                let (alpha, beta) = (1.0f32, 0.0f32);
                for (i, r) in res.iter().take(cnt as usize).enumerate() {
                    let cfg = |attr: lt::cublasLtMatmulAlgoConfigAttributes_t| -> i64 {
                        let mut v: i64 = 0;
                        let mut written = 0usize;
                        lt::cublasLtMatmulAlgoConfigGetAttribute(
                            &r.algo,
                            attr,
                            &mut v as *mut i64 as *mut c_void,
                            8,
                            &mut written,
                        );
                        v
                    };
                    use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
                    let (id, tile, splitk, stages, cluster) = (
                        cfg(A::CUBLASLT_ALGO_CONFIG_ID) as i32,
                        cfg(A::CUBLASLT_ALGO_CONFIG_TILE_ID) as i32,
                        cfg(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM) as i32,
                        cfg(A::CUBLASLT_ALGO_CONFIG_STAGES_ID) as i32,
                        cfg(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) as i32,
                    );
                    let mut ok = true;
                    let ms = time(&mut || {
                        let s = lt::cublasLtMatmul(
                            handle,
                            desc,
                            &alpha as *const f32 as *const c_void,
                            wp as *const c_void,
                            la,
                            xp as *const c_void,
                            lb,
                            &beta as *const f32 as *const c_void,
                            yp as *const c_void,
                            lc,
                            yp as *mut c_void,
                            lc,
                            &r.algo,
                            wsp as *mut c_void,
                            ws_bytes,
                            cu_stream,
                        );
                        if s != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                            ok = false;
                        }
                    });
                    println!(
                        "{{\"gemm\":\"{name}\",\"rows\":{n},\"in\":{k},\"out\":{m},\"algo\":\"lt{i}\",\"id\":{id},\"tile\":{tile},\"splitk\":{splitk},\"stages\":{stages},\"cluster\":{cluster},\"waves\":{:.2},\"ok\":{ok},\"ms\":{ms:.4},\"tflops\":{:.1}}}",
                        r.wavesCount,
                        flop / ms / 1e9
                    );
                }
                lt::cublasLtMatmulPreferenceDestroy(pref);
                lt::cublasLtMatrixLayoutDestroy(la);
                lt::cublasLtMatrixLayoutDestroy(lb);
                lt::cublasLtMatrixLayoutDestroy(lc);
                lt::cublasLtMatmulDescDestroy(desc);
            }
        }
    }
}
