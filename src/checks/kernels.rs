//! `gpu_check`: every GPU kernel against the CPU reference on fresh random
//! inputs at the shapes of spec/testing.md ("Shapes every kernel test
//! covers"), compared by relative L2 error (≤ 2e-2 for the bf16 paths),
//! with a JSON report (GPU, driver, date, commit, each case's shape and
//! error).
//!
//! The oracles are the CPU reference's own functions ([`crate::cpu::ops`],
//! [`crate::cpu::dense_attention`], [`crate::cpu::sparse_attention`]) fed
//! with the same bf16-rounded inputs, converted to f32. Outputs are poisoned
//! with NaN before each launch, so an element the kernel fails to write
//! fails the case.

use crate::config::{AttentionMode, RopeScaling, SparseConfig};
use crate::cpu::ops as cpu_ops;
use crate::cuda::context::dptr;
use crate::cuda::device_error::DeviceErrors;
use crate::cuda::ops::{self, BlockSelection, EvictionWeights, KvBatch, RopeTables, SeqKv};
use crate::cuda::{Bf16, Gpu};
use crate::model::select::Budget;
use crate::model::state::LayerKv;
use crate::model::AttentionPlan;
use crate::{Error, Result};
use cudarc::driver::CudaSlice;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use serde_json::{json, Value};
use std::path::Path;

/// Relative L2 tolerance of every bf16 GPU path against the CPU reference
/// (spec/testing.md "Tolerances").
pub const TOLERANCE_BF16: f64 = 2e-2;

/// The outcome of one check case.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CaseResult {
    /// Kernel (or wrapper) under test.
    pub kernel: String,
    /// The case's shape and settings.
    pub shape: Value,
    /// ‖gpu − cpu‖₂ / ‖cpu‖₂ (NaN when the case did not run or produced NaN).
    pub rel_l2: f64,
    /// max |gpu − cpu|.
    pub max_abs_err: f64,
    /// The tolerance applied to `rel_l2`.
    pub tolerance: f64,
    /// Finite output, every element written, and rel_l2 ≤ tolerance.
    pub pass: bool,
    /// Why the case failed to run, if it did.
    pub error: Option<String>,
}

impl CaseResult {
    /// A case that could not run (or compare): `error` says why; NaN
    /// errors, not passed, under `tolerance`.
    pub fn failed(kernel: &str, shape: Value, tolerance: f64, error: String) -> CaseResult {
        CaseResult {
            kernel: kernel.into(),
            shape,
            rel_l2: f64::NAN,
            max_abs_err: f64::NAN,
            tolerance,
            pass: false,
            error: Some(error),
        }
    }
}

/// Relative L2 error and max abs error of `got` against `want` (f64 sums).
/// Any non-finite `got` element gives NaN (a fail).
pub fn rel_l2(got: &[f32], want: &[f32]) -> (f64, f64) {
    if got.len() != want.len() {
        return (f64::NAN, f64::NAN);
    }
    let (mut num, mut den, mut mx) = (0.0f64, 0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if !g.is_finite() {
            return (f64::NAN, f64::NAN);
        }
        let e = g as f64 - w as f64;
        num += e * e;
        den += (w as f64) * (w as f64);
        mx = mx.max(e.abs());
    }
    let r = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    (r, mx)
}

/// Current UTC time as `YYYY-MM-DDTHH:MM:SSZ` (civil-from-days on the Unix clock).
pub fn utc_now_iso() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 → (y, m, d), proleptic Gregorian (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Random inputs for the checks: normal values rounded to bf16, kept both as
/// device bits and as the exact f32 the oracle sees.
struct Inputs {
    rng: SmallRng,
}

/// n values drawn from N(0, std²).
pub(super) fn normal(rng: &mut SmallRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| StandardNormal.sample(&mut *rng))
        .map(|x: f32| x * std)
        .collect()
}

/// bf16-rounded N(0, std²) values: (device bits, exact f32 values).
pub(super) fn bf16_normal(rng: &mut SmallRng, n: usize, std: f32) -> (Vec<Bf16>, Vec<f32>) {
    let bits: Vec<Bf16> = normal(rng, n, std)
        .into_iter()
        .map(Bf16::from_f32)
        .collect();
    let f = bits.iter().map(|b| b.to_f32()).collect();
    (bits, f)
}

impl Inputs {
    fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        normal(&mut self.rng, n, std)
    }
    /// bf16-rounded normal values: (device bits, exact f32 values).
    fn bf16(&mut self, n: usize, std: f32) -> (Vec<Bf16>, Vec<f32>) {
        bf16_normal(&mut self.rng, n, std)
    }
    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }
}

/// NaN-filled device buffer (poison), so unwritten outputs fail.
fn poison_bf16(gpu: &Gpu, n: usize) -> Result<CudaSlice<Bf16>> {
    gpu.upload(&vec![Bf16(0x7fc0); n])
}

fn poison_f32(gpu: &Gpu, n: usize) -> Result<CudaSlice<f32>> {
    gpu.upload(&vec![f32::NAN; n])
}

fn to_f32(x: &[Bf16]) -> Vec<f32> {
    x.iter().map(|b| b.to_f32()).collect()
}

/// Runs the cases and collects results; a case that errors is recorded as a
/// failure and the rest still run.
struct Checker<'g> {
    gpu: &'g Gpu,
    inp: Inputs,
    results: Vec<CaseResult>,
}

impl Checker<'_> {
    fn record(
        &mut self,
        kernel: &str,
        shape: Value,
        run: impl FnOnce(&Gpu, &mut Inputs) -> Result<(Vec<f32>, Vec<f32>)>,
    ) {
        let r = run(self.gpu, &mut self.inp).and_then(|v| self.gpu.synchronize().map(|()| v));
        self.push(kernel, shape, TOLERANCE_BF16, r);
    }

    /// Records one compared output (`r`: got, want) under `tol`.
    fn push(&mut self, kernel: &str, shape: Value, tol: f64, r: Result<(Vec<f32>, Vec<f32>)>) {
        let res = match r {
            Ok((got, want)) => {
                let (e, mx) = rel_l2(&got, &want);
                CaseResult {
                    kernel: kernel.into(),
                    shape,
                    rel_l2: e,
                    max_abs_err: mx,
                    tolerance: tol,
                    pass: e.is_finite() && e <= tol,
                    error: None,
                }
            }
            Err(err) => CaseResult::failed(kernel, shape, tol, err.to_string()),
        };
        println!(
            "{:<26} {:<70} rel_l2 {:>10.3e}  {}",
            res.kernel,
            compact(&res.shape),
            res.rel_l2,
            if res.pass { "ok" } else { "FAIL" }
        );
        if let Some(e) = &res.error {
            println!("    error: {e}");
        }
        self.results.push(res);
    }
}

/// One-line rendering of a shape object, cut to 70 characters.
fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 70 {
        s.chars().take(67).collect::<String>() + "..."
    } else {
        s
    }
}

fn check_gemm(c: &mut Checker<'_>) {
    for &(n, k, out, f32_out) in &[
        (1usize, 256usize, 384usize, false),
        (5, 576, 1728, false),
        (16, 2048, 4608, false),
        (64, 4096, 512, false),
        (3, 576, 4000, true),
    ] {
        c.record(
            "linear (cuBLAS gemm_ex)",
            json!({"n": n, "in": k, "out": out, "y": if f32_out {"f32"} else {"bf16"}}),
            |gpu, inp| {
                let (xb, xf) = inp.bf16(n * k, 1.0);
                let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
                let (x, w) = (gpu.upload(&xb)?, gpu.upload(&wb)?);
                let want = cpu_ops::linear(&xf, n, &wf, None, out);
                let got = if f32_out {
                    let mut y = poison_f32(gpu, n * out)?;
                    gpu.linear(&x, n, k, &w, out, &mut y)?;
                    gpu.download(&y)?
                } else {
                    let mut y = poison_bf16(gpu, n * out)?;
                    gpu.linear(&x, n, k, &w, out, &mut y)?;
                    to_f32(&gpu.download(&y)?)
                };
                Ok((got, want))
            },
        );
    }

    // the add into an f32 residual stream (β = 1), compared as the added amount
    for &(n, k, out) in &[(1usize, 14_336usize, 4096usize), (3, 2048, 515)] {
        c.record(
            "linear into residual",
            json!({"n": n, "in": k, "out": out, "y": "f32 += scale·y"}),
            |gpu, inp| {
                let scale = 1.4 / (32.0f32).sqrt();
                let (xb, xf) = inp.bf16(n * k, 1.0);
                let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
                let r0 = inp.normal(n * out, 1.0);
                let (x, w, r) = (gpu.upload(&xb)?, gpu.upload(&wb)?, gpu.upload(&r0)?);
                let want: Vec<f32> = cpu_ops::linear(&xf, n, &wf, None, out)
                    .iter()
                    .map(|y| y * scale)
                    .collect();
                // SAFETY: x n·k bf16, W out·k bf16, r n·out f32, distinct buffers.
                unsafe {
                    gpu.linear_into_residual(
                        dptr(gpu, &x),
                        n,
                        k,
                        dptr(gpu, &w),
                        out,
                        dptr(gpu, &r),
                        scale,
                    )
                }?;
                let got = gpu.download(&r)?;
                Ok((got.iter().zip(&r0).map(|(g, r)| g - r).collect(), want))
            },
        );
    }
}

/// The small-batch `gemv` (kernels/gemv.cu) in each of its input and output
/// modes against the CPU reference: plain bf16 rows to bf16 and f32, the
/// RMSNorm of an f32 residual stream, SwiGLU on the gate|up outputs, and
/// the add into a residual stream (compared as the added amount).
fn check_gemv(c: &mut Checker<'_>) {
    let eps = 1e-5f32;
    for &(n, k, out) in &[
        (1usize, 256usize, 384usize),
        (2, 576, 1731),
        (3, 2048, 515),
        (4, 4096, 512),
        (1, 4096, 6144),
        // 2,048 groups of four: the RMSNorm staging past the groups a thread keeps in registers
        (1, 8192, 258),
    ] {
        let shape = |x: &str, y: &str| json!({"n": n, "in": k, "out": out, "x": x, "y": y});
        for f32_out in [false, true] {
            let y = if f32_out { "f32" } else { "bf16" };
            c.record("gemv", shape("bf16", y), |gpu, inp| {
                let (xb, xf) = inp.bf16(n * k, 1.0);
                let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
                let (x, w) = (gpu.upload(&xb)?, gpu.upload(&wb)?);
                let want = cpu_ops::linear(&xf, n, &wf, None, out);
                let (xp, wp) = (dptr(gpu, &x), dptr(gpu, &w));
                let args = |y| ops::GemvArgs {
                    x: ops::GemvInput::Bf16(xp),
                    w: wp,
                    y,
                    n,
                    in_features: k,
                    out_features: out,
                };
                let got = if f32_out {
                    let yb = poison_f32(gpu, n * out)?;
                    // SAFETY: x n·k, W out·k, y n·out, distinct buffers.
                    unsafe { ops::launch_gemv(gpu, &args(ops::GemvOutput::F32(dptr(gpu, &yb)))) }?;
                    gpu.download(&yb)?
                } else {
                    let yb = poison_bf16(gpu, n * out)?;
                    // SAFETY: as above.
                    unsafe { ops::launch_gemv(gpu, &args(ops::GemvOutput::Bf16(dptr(gpu, &yb)))) }?;
                    to_f32(&gpu.download(&yb)?)
                };
                Ok((got, want))
            });
        }
        c.record("gemv", shape("rmsnorm", "bf16"), |gpu, inp| {
            let resid = inp.normal(n * k, 1.0);
            let (gb, gf) = inp.bf16(k, 1.0);
            let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
            let (r, g, w) = (gpu.upload(&resid)?, gpu.upload(&gb)?, gpu.upload(&wb)?);
            let xn = cpu_ops::rms_norm_rounded(&resid, &gf, eps, true, true);
            let want = cpu_ops::linear(&xn, n, &wf, None, out);
            let yb = poison_bf16(gpu, n * out)?;
            let args = ops::GemvArgs {
                x: ops::GemvInput::RmsNorm {
                    resid: dptr(gpu, &r),
                    weight: dptr(gpu, &g),
                    eps,
                },
                w: dptr(gpu, &w),
                y: ops::GemvOutput::Bf16(dptr(gpu, &yb)),
                n,
                in_features: k,
                out_features: out,
            };
            // SAFETY: resid n·k f32, norm k, W out·k, y n·out, distinct buffers.
            unsafe { ops::launch_gemv(gpu, &args) }?;
            Ok((to_f32(&gpu.download(&yb)?), want))
        });
        c.record("gemv", shape("bf16", "residual"), |gpu, inp| {
            let scale = 1.4 / (32.0f32).sqrt();
            let (xb, xf) = inp.bf16(n * k, 1.0);
            let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
            let resid = inp.normal(n * out, 1.0);
            let (x, w, r) = (gpu.upload(&xb)?, gpu.upload(&wb)?, gpu.upload(&resid)?);
            let want: Vec<f32> = cpu_ops::linear(&xf, n, &wf, None, out)
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32() * scale)
                .collect();
            let args = ops::GemvArgs {
                x: ops::GemvInput::Bf16(dptr(gpu, &x)),
                w: dptr(gpu, &w),
                y: ops::GemvOutput::Residual {
                    resid: dptr(gpu, &r),
                    scale,
                },
                n,
                in_features: k,
                out_features: out,
            };
            // SAFETY: x n·k, W out·k, resid n·out f32, distinct buffers.
            unsafe { ops::launch_gemv(gpu, &args) }?;
            let got: Vec<f32> = gpu
                .download(&r)?
                .iter()
                .zip(&resid)
                .map(|(g, r0)| g - r0)
                .collect();
            Ok((got, want))
        });
        if out.is_multiple_of(2) {
            c.record("gemv", shape("rmsnorm", "swiglu"), |gpu, inp| {
                let inter = out / 2;
                let resid = inp.normal(n * k, 1.0);
                let (gb, gf) = inp.bf16(k, 1.0);
                let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
                let (r, g, w) = (gpu.upload(&resid)?, gpu.upload(&gb)?, gpu.upload(&wb)?);
                let xn = cpu_ops::rms_norm_rounded(&resid, &gf, eps, true, true);
                let rb = |v: f32| half::bf16::from_f32(v).to_f32();
                let gu = cpu_ops::linear(&xn, n, &wf, None, out);
                let want: Vec<f32> = (0..n * inter)
                    .map(|i| {
                        let (row, j) = (i / inter, i % inter);
                        let (g, u) = (rb(gu[row * out + j]), rb(gu[row * out + inter + j]));
                        cpu_ops::silu(g) * u
                    })
                    .collect();
                let yb = poison_bf16(gpu, n * inter)?;
                let args = ops::GemvArgs {
                    x: ops::GemvInput::RmsNorm {
                        resid: dptr(gpu, &r),
                        weight: dptr(gpu, &g),
                        eps,
                    },
                    w: dptr(gpu, &w),
                    y: ops::GemvOutput::Swiglu(dptr(gpu, &yb)),
                    n,
                    in_features: k,
                    out_features: out,
                };
                // SAFETY: resid n·k f32, norm k, W out·k, y n·out/2, distinct buffers.
                unsafe { ops::launch_gemv(gpu, &args) }?;
                Ok((to_f32(&gpu.download(&yb)?), want))
            });
        }
    }
    // the down projection of NOSA-8B at B = 1: 14,336 inputs (28 KiB staged)
    c.record(
        "gemv",
        json!({"n": 1, "in": 14336, "out": 320, "x": "bf16", "y": "residual"}),
        |gpu, inp| {
            let (n, k, out) = (1usize, 14_336usize, 320usize);
            let (xb, xf) = inp.bf16(k, 1.0);
            let (wb, wf) = inp.bf16(out * k, 1.0 / (k as f32).sqrt());
            let (x, w) = (gpu.upload(&xb)?, gpu.upload(&wb)?);
            let r = gpu.upload(&vec![0.0f32; out])?;
            let want: Vec<f32> = cpu_ops::linear(&xf, n, &wf, None, out)
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect();
            let args = ops::GemvArgs {
                x: ops::GemvInput::Bf16(dptr(gpu, &x)),
                w: dptr(gpu, &w),
                y: ops::GemvOutput::Residual {
                    resid: dptr(gpu, &r),
                    scale: 1.0,
                },
                n,
                in_features: k,
                out_features: out,
            };
            // SAFETY: x k, W out·k, resid out f32, distinct buffers.
            unsafe { ops::launch_gemv(gpu, &args) }?;
            Ok((gpu.download(&r)?, want))
        },
    );
}

fn check_embedding(c: &mut Checker<'_>) {
    for &(vocab, d, n, scale) in &[(1000usize, 576usize, 7usize, 1.0f32), (4099, 4096, 3, 12.0)] {
        c.record(
            "embed_gather",
            json!({"vocab": vocab, "d": d, "n": n, "scale": scale}),
            |gpu, inp| {
                let (tb, tf) = inp.bf16(vocab * d, 0.05);
                let ids: Vec<u32> = (0..n)
                    .map(|_| inp.rng.random_range(0..vocab as u32))
                    .collect();
                let (table, idd) = (gpu.upload(&tb)?, gpu.upload(&ids)?);
                let mut out = poison_bf16(gpu, n * d)?;
                ops::embed_gather(gpu, &table, vocab, d, &idd, scale, &mut out)?;
                let want: Vec<f32> = ids
                    .iter()
                    .flat_map(|&i| {
                        tf[i as usize * d..(i as usize + 1) * d]
                            .iter()
                            .map(|v| v * scale)
                    })
                    .collect();
                Ok((to_f32(&gpu.download(&out)?), want))
            },
        );
    }
}

fn check_rmsnorm(c: &mut Checker<'_>) {
    let eps = 1e-6f32;
    // 12,288: a row wider than the widest block (1,024 threads) takes in 4 values per thread;
    // 578: not a multiple of 4 (rmsnorm_residual_v4 does not take it: the element kernel only)
    for &(n, d, fused) in &[
        (1usize, 576usize, false),
        (4, 4096, true),
        (3, 2560, true),
        (2, 12_288, true),
        (3, 578, true),
    ] {
        let kernels: &[(bool, &str)] = if d % 4 == 0 {
            &[(false, "rmsnorm_residual"), (true, "rmsnorm_residual_v4")]
        } else {
            &[(false, "rmsnorm_residual")]
        };
        let dscale = if fused { 1.4 / (32.0f32).sqrt() } else { 1.0 };
        let shape =
            json!({"n": n, "d": d, "residual_add": fused, "delta_scale": dscale, "eps": eps});
        for &(v4, name) in kernels {
            // the buffers' addresses: whether the v4 kernel takes the row (else the case would test
            // the element kernel under the v4 name)
            let takes = |r: u64, dl: u64, w: u64, o: u64| -> Result<()> {
                if v4 && !ops::rmsnorm_takes_v4(d, r, dl, w, o) {
                    return Err(Error::Input(format!(
                        "rmsnorm_residual_v4 does not take d {d} at these buffers: the case would test the element kernel"
                    )));
                }
                Ok(())
            };
            // the residual add and norm on this case's kernel, after `takes`
            let fused_launch = |gpu: &Gpu,
                                r: &mut CudaSlice<f32>,
                                delta: &CudaSlice<Bf16>,
                                w: &CudaSlice<Bf16>,
                                out: &mut CudaSlice<Bf16>|
             -> Result<()> {
                takes(
                    dptr(gpu, &*r),
                    dptr(gpu, delta),
                    dptr(gpu, w),
                    dptr(gpu, &*out),
                )?;
                ops::add_rmsnorm_with(gpu, r, delta, dscale, w, eps, out, v4)
            };
            // The normalised output.
            c.record(&format!("{name} (out)"), shape.clone(), |gpu, inp| {
                let resid = inp.normal(n * d, 1.0);
                let (wb, wf) = inp.bf16(d, 1.0);
                let (db, df) = inp.bf16(n * d, 0.5);
                let mut r = gpu.upload(&resid)?;
                let w = gpu.upload(&wb)?;
                let mut out = poison_bf16(gpu, n * d)?;
                let mut x = resid.clone();
                if fused {
                    fused_launch(gpu, &mut r, &gpu.upload(&db)?, &w, &mut out)?;
                    x.iter_mut().zip(&df).for_each(|(a, b)| *a += b * dscale);
                } else {
                    takes(dptr(gpu, &r), 0, dptr(gpu, &w), dptr(gpu, &out))?;
                    ops::rmsnorm_with(gpu, &r, &w, eps, &mut out, v4)?;
                }
                let want = cpu_ops::rms_norm(&x, &wf, eps);
                Ok((to_f32(&gpu.download(&out)?), want))
            });
            if fused {
                // The updated f32 residual stream.
                c.record(&format!("{name} (resid)"), shape.clone(), |gpu, inp| {
                    let resid = inp.normal(n * d, 1.0);
                    let (wb, _) = inp.bf16(d, 1.0);
                    let (db, df) = inp.bf16(n * d, 0.5);
                    let (mut r, w, delta) =
                        (gpu.upload(&resid)?, gpu.upload(&wb)?, gpu.upload(&db)?);
                    let mut out = poison_bf16(gpu, n * d)?;
                    fused_launch(gpu, &mut r, &delta, &w, &mut out)?;
                    let want: Vec<f32> =
                        resid.iter().zip(&df).map(|(a, b)| a + b * dscale).collect();
                    Ok((gpu.download(&r)?, want))
                });
            }
        }
    }
}

fn check_rope(c: &mut Checker<'_>) {
    let positions = [0usize, 17, 4095];
    for &(hq, hk, d) in &[
        (6usize, 2usize, 64usize),
        (16, 2, 80),
        (32, 2, 128),
        (16, 1, 128),
    ] {
        let row = (hq + 2 * hk) * d;
        c.record(
            "rope_neox (fused q|k|v row)",
            json!({"H": hq, "Hkv": hk, "D": d, "rows": positions.len(), "positions": positions, "theta": 10000.0}),
            |gpu, inp| {
                let rope = crate::config::Rope::new(d, 10_000.0, 8192, RopeScaling::Default);
                let tables = RopeTables::from_rope(gpu, &rope, d, 4096, 4096)?;
                let (xb, xf) = inp.bf16(positions.len() * row, 1.0);
                let mut x = gpu.upload(&xb)?;
                let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
                let pd = gpu.upload(&pos)?;
                ops::rope_neox(gpu, &mut x, positions.len(), row, 0, hq + hk, d, &pd, &tables)?;
                let mut want = xf.clone();
                let (mut cs, mut sn) = (vec![0.0f32; d / 2], vec![0.0f32; d / 2]);
                for (i, &p) in positions.iter().enumerate() {
                    rope.cos_sin(p, 4096, &mut cs, &mut sn);
                    cpu_ops::rope_in_place(&mut want[i * row..i * row + (hq + hk) * d], &cs, &sn);
                }
                Ok((to_f32(&gpu.download(&x)?), want))
            },
        );
    }
}

fn check_swiglu(c: &mut Checker<'_>) {
    // the element kernel at every shape; swiglu_v8 (8 columns a thread)
    // where I is a multiple of 8 (at 1003 it would fall back to the element kernel)
    for &(n, inter) in &[(1usize, 1536usize), (3, 16384), (64, 14336), (7, 1003)] {
        let kernels: &[(bool, &str)] = if inter % 8 == 0 {
            &[(false, "swiglu"), (true, "swiglu_v8")]
        } else {
            &[(false, "swiglu")]
        };
        for &(v8, name) in kernels {
            c.record(name, json!({"n": n, "I": inter}), |gpu, inp| {
                let (gb, gf) = inp.bf16(n * 2 * inter, 2.0);
                let g = gpu.upload(&gb)?;
                let mut out = poison_bf16(gpu, n * inter)?;
                if v8 && !ops::swiglu_takes_v8(n, inter, dptr(gpu, &g), dptr(gpu, &out)) {
                    return Err(Error::Input(format!(
                        "swiglu_v8 does not take n {n}, I {inter} at these buffers: the case would test the element kernel"
                    )));
                }
                ops::swiglu_with(gpu, &g, n, inter, &mut out, v8)?;
                let got = gpu.download(&out)?;
                if v8 {
                    // the same arithmetic per element as the element kernel: the same bits
                    let mut elem = poison_bf16(gpu, n * inter)?;
                    ops::swiglu_with(gpu, &g, n, inter, &mut elem, false)?;
                    let elem = gpu.download(&elem)?;
                    if let Some(i) = (0..got.len()).find(|&i| got[i].0 != elem[i].0) {
                        return Err(Error::Input(format!(
                            "swiglu_v8 element {i} (row {}, column {}) is {:#06x}, the element kernel's {:#06x}",
                            i / inter,
                            i % inter,
                            got[i].0,
                            elem[i].0
                        )));
                    }
                }
                let want: Vec<f32> = (0..n * inter)
                    .map(|i| {
                        let (r, j) = (i / inter, i % inter);
                        cpu_ops::silu(gf[r * 2 * inter + j]) * gf[r * 2 * inter + inter + j]
                    })
                    .collect();
                Ok((to_f32(&got), want))
            });
        }
    }
}

fn check_eviction(c: &mut Checker<'_>) {
    for &(n, hq, hk, d, bias) in &[
        (1usize, 32usize, 2usize, 128usize, false),
        (4, 16, 2, 64, true),
        (3, 24, 8, 80, true),
    ] {
        c.record(
            "eviction_score",
            json!({"n": n, "Hkv": hk, "D": d, "bias": bias, "v_row_stride": (hq + 2 * hk) * d}),
            |gpu, inp| {
                let kvd = hk * d;
                let row = (hq + 2 * hk) * d;
                let v_off = (hq + hk) * d;
                let (qkv_b, qkv_f) = inp.bf16(n * row, 1.0);
                // δ in f32, not bf16-representable: the kernel must use it as given.
                let df = inp.normal(hk * kvd, 1.0 / (kvd as f32).sqrt());
                let a = inp.uniform(hk, 0.2, 2.0);
                let b = if bias {
                    Some(inp.uniform(hk, -1.0, 1.0))
                } else {
                    None
                };
                let head = EvictionWeights::new(gpu, &a, &df, b.as_deref(), hk, d)?;
                let qkv = gpu.upload(&qkv_b)?;
                let mut cc = poison_f32(gpu, n * hk)?;
                ops::eviction_score(gpu, &qkv.slice(v_off..), n, row, &head, &mut cc)?;
                let v: Vec<f32> = (0..n)
                    .flat_map(|i| {
                        qkv_f[i * row + v_off..i * row + v_off + kvd]
                            .iter()
                            .copied()
                    })
                    .collect();
                let want = cpu_ops::eviction_scores(&v, n, &df, b.as_deref(), &a);
                Ok((gpu.download(&cc)?, want))
            },
        );
    }
}

/// Relative L2 tolerance of the eviction scores of `qkv_rope_append`: f32
/// arithmetic on the same bf16 values and f32 weights as the oracle, so
/// only the summation order differs.
const TOLERANCE_EVICTION_F32: f64 = 1e-4;

/// Where the rows of a `qkv_rope_append` case go: each to its own sequence
/// (a decode batch), or all to one sequence at consecutive positions (a
/// prefill chunk); `ring` > 0: an offloaded layer's tail ring.
#[derive(Debug, Clone, Copy, serde::Serialize)]
enum AppendLayout {
    Decode,
    Chunk,
}

/// `qkv_rope_append` (RoPE + K/V append + eviction score) against the CPU
/// reference: rotated q|k (in place) and the K / V cache rows within the
/// bf16 tolerance, and the eviction scores c = A·softplus(δ·v + b) (f32 δ,
/// not bf16-representable; v the row's bf16 values) within
/// [`TOLERANCE_EVICTION_F32`] of [`cpu_ops::eviction_scores`].
fn check_qkv_append(c: &mut Checker<'_>) {
    let hk = 2usize;
    let mut cases: Vec<(usize, usize, AppendLayout, Vec<usize>, usize, bool)> = Vec::new();
    for &g in &[3usize, 8, 16] {
        for &d in &[64usize, 80, 128] {
            cases.push((g, d, AppendLayout::Decode, vec![17], 0, g == 8));
            cases.push((
                g,
                d,
                AppendLayout::Decode,
                vec![5, 31, 48, 63, 64, 65, 1500, 4095],
                0,
                g != 8,
            ));
        }
    }
    // A prefill chunk (one sequence, consecutive positions across a 16- and a
    // 64-token boundary), an offloaded tail ring, and Llama-3-8B-like grouping.
    cases.push((16, 128, AppendLayout::Chunk, (40..72).collect(), 0, true));
    cases.push((
        8,
        64,
        AppendLayout::Decode,
        vec![100, 255, 256, 4000],
        128,
        true,
    ));
    cases.push((4, 128, AppendLayout::Decode, vec![7, 700], 0, false));
    for (g, d, layout, positions, ring, bias) in cases {
        let hq = g * hk;
        let kvd = hk * d;
        // Extra columns past q|k|v (forecast rows in the engine): never touched.
        let row = (hq + 2 * hk) * d + 16;
        let n = positions.len();
        let shape = json!({"G": g, "H": hq, "Hkv": hk, "D": d, "layout": layout,
            "positions": positions, "ring": ring, "bias": bias, "row_stride": row});
        let r = (|| -> Result<[(Vec<f32>, Vec<f32>); 2]> {
            let gpu = c.gpu;
            let inp = &mut c.inp;
            let rope = crate::config::Rope::new(d, 10_000.0, 8192, RopeScaling::Default);
            let tables = RopeTables::from_rope(gpu, &rope, d, 4096, 4096)?;
            let (xb, xf) = inp.bf16(n * row, 1.0);
            let df = inp.normal(hk * kvd, 1.0 / (kvd as f32).sqrt());
            let a = inp.uniform(hk, 0.2, 2.0);
            let b = bias.then(|| inp.uniform(hk, -1.0, 1.0));
            let head = EvictionWeights::new(gpu, &a, &df, b.as_deref(), hk, d)?;
            // One cache per sequence, NaN-poisoned.
            let seqs = match layout {
                AppendLayout::Decode => n,
                AppendLayout::Chunk => 1,
            };
            let seq_of = |i: usize| match layout {
                AppendLayout::Decode => i,
                AppendLayout::Chunk => 0,
            };
            let cap = if ring > 0 {
                ring
            } else {
                positions.iter().max().copied().unwrap_or(0) + 1
            };
            let c_cap = positions.iter().max().copied().unwrap_or(0) + 1;
            let mut caches = Vec::with_capacity(seqs);
            for _ in 0..seqs {
                caches.push((
                    poison_bf16(gpu, cap * kvd)?,
                    poison_bf16(gpu, cap * kvd)?,
                    poison_f32(gpu, c_cap * hk)?,
                ));
            }
            let rows: Vec<ops::AppendRow<'_>> = positions
                .iter()
                .enumerate()
                .map(|(i, &p)| {
                    let (k, v, cc) = &caches[seq_of(i)];
                    ops::AppendRow {
                        pos: p,
                        k,
                        v,
                        c: Some(cc),
                    }
                })
                .collect();
            let mut x = gpu.upload(&xb)?;
            // Positions inside the table raise no device error (checked below).
            let errs = DeviceErrors::new(gpu)?;
            ops::qkv_rope_append(
                gpu,
                &mut x,
                row,
                hq,
                hk,
                d,
                &rows,
                &tables,
                Some(&head),
                ring,
                errs.sink(3),
            )?;
            let got_x = to_f32(&gpu.download(&x)?);
            let mut host = Vec::with_capacity(seqs);
            for (k, v, cc) in &caches {
                host.push((
                    to_f32(&gpu.download(k)?),
                    to_f32(&gpu.download(v)?),
                    gpu.download(cc)?,
                ));
            }
            // Oracle: the CPU reference's RoPE on the same bf16 inputs, V as
            // given, c from the row's bf16 v with the f32 eviction head.
            let (mut got, mut want) = (Vec::new(), Vec::new());
            let (mut got_c, mut v_rows) = (Vec::new(), Vec::new());
            let (mut cs, mut sn) = (vec![0.0f32; d / 2], vec![0.0f32; d / 2]);
            for (i, &p) in positions.iter().enumerate() {
                let xr = &xf[i * row..(i + 1) * row];
                let mut qk = xr[..(hq + hk) * d].to_vec();
                rope.cos_sin(p, 4096, &mut cs, &mut sn);
                cpu_ops::rope_in_place(&mut qk, &cs, &sn);
                let v = &xr[(hq + hk) * d..(hq + 2 * hk) * d];
                let slot = if ring > 0 { p % ring } else { p };
                let (kh, vh, ch) = &host[seq_of(i)];
                // The row in place: rotated q|k, v and the extra columns untouched.
                got.extend_from_slice(&got_x[i * row..(i + 1) * row]);
                want.extend_from_slice(&qk);
                want.extend_from_slice(&xr[(hq + hk) * d..]);
                // The caches at the token's row.
                got.extend_from_slice(&kh[slot * kvd..(slot + 1) * kvd]);
                want.extend_from_slice(&qk[hq * d..]);
                got.extend_from_slice(&vh[slot * kvd..(slot + 1) * kvd]);
                want.extend_from_slice(v);
                got_c.extend_from_slice(&ch[p * hk..(p + 1) * hk]);
                v_rows.extend_from_slice(v);
            }
            let want_c = cpu_ops::eviction_scores(&v_rows, n, &df, b.as_deref(), &a);
            gpu.synchronize()?;
            errs.take()?;
            Ok([(got, want), (got_c, want_c)])
        })();
        let (r1, r2) = match r {
            Ok([x, y]) => (Ok(x), Ok(y)),
            Err(e) => {
                let m = e.to_string();
                (Err(Error::Cuda(m.clone())), Err(Error::Cuda(m)))
            }
        };
        c.push(
            "qkv_rope_append (q|k, K/V)",
            shape.clone(),
            TOLERANCE_BF16,
            r1,
        );
        c.push("qkv_rope_append (c)", shape, TOLERANCE_EVICTION_F32, r2);
    }
}

/// One sequence's random KV state for the attention checks: the CPU
/// reference's [`LayerKv`] (f32 of the bf16-rounded values, compressed
/// state completed) plus the device copies.
struct SeqData {
    kv: LayerKv,
    k: CudaSlice<Bf16>,
    v: CudaSlice<Bf16>,
    c: CudaSlice<f32>,
}

fn make_seq(
    gpu: &Gpu,
    inp: &mut Inputs,
    budget: &Budget,
    len: usize,
    hk: usize,
    d: usize,
) -> Result<SeqData> {
    let (kb, kf) = inp.bf16(len * hk * d, 1.0);
    let (vb, vf) = inp.bf16(len * hk * d, 1.0);
    // c = A·softplus(z): positive, a few units at most, as the eviction head makes it.
    let z = inp.normal(len * hk, 1.5);
    let a = inp.uniform(hk, 0.5, 2.0);
    let cvals: Vec<f32> = z
        .iter()
        .enumerate()
        .map(|(i, &x)| a[i % hk] * cpu_ops::softplus(x))
        .collect();
    let mut kv = LayerKv::new(hk, d);
    kv.append(budget, &kf, &vf, &cvals);
    Ok(SeqData {
        kv,
        k: gpu.upload(&kb)?,
        v: gpu.upload(&vb)?,
        c: gpu.upload(&cvals)?,
    })
}

fn check_dense_attention(c: &mut Checker<'_>) {
    let budget = Budget::new(&SparseConfig::default());
    // One row (B = 1: 40 and 66 splits of one tile each), two rows whose second
    // has an empty last split, a batch of eight, two long rows
    let batches: [&[usize]; 6] = [
        &[17],
        &[2500],
        &[100, 40],
        &[5, 31, 48, 49, 63, 64, 65, 1500],
        &[4200, 300],
        &[4200],
    ];
    for &g in &[3usize, 8, 16] {
        for &d in &[64usize, 80, 128] {
            for (bi, lens) in batches.iter().enumerate() {
                if bi >= 4 && !(g == 16 && d == 128) {
                    continue; // the long batches once, at NOSA-8B's shape
                }
                let hk = 2usize;
                let hq = g * hk;
                c.record(
                    "attention_dense_decode",
                    json!({"G": g, "H": hq, "Hkv": hk, "D": d, "lens": lens}),
                    |gpu, inp| {
                        let seqs: Vec<SeqData> = lens
                            .iter()
                            .map(|&l| make_seq(gpu, inp, &budget, l, hk, d))
                            .collect::<Result<_>>()?;
                        let (qb, qf) = inp.bf16(lens.len() * hq * d, 1.5);
                        let q = gpu.upload(&qb)?;
                        let views: Vec<SeqKv<'_>> = seqs
                            .iter()
                            .zip(lens.iter())
                            .map(|(s, &l)| SeqKv {
                                k: s.k.as_view(),
                                v: s.v.as_view(),
                                c: None,
                                len: l,
                            })
                            .collect();
                        let batch = KvBatch::new(gpu, &views, hk, d)?;
                        let mut out = poison_bf16(gpu, lens.len() * hq * d)?;
                        let scale = 1.0 / (d as f32).sqrt();
                        ops::attention_dense_decode(
                            gpu,
                            &q,
                            hq * d,
                            hq,
                            &batch,
                            scale,
                            &mut out,
                            hq * d,
                        )?;
                        let mut want = vec![0.0f32; lens.len() * hq * d];
                        for (b, s) in seqs.iter().enumerate() {
                            let qrow = &qf[b * hq * d..(b + 1) * hq * d];
                            crate::cpu::dense_attention(
                                &s.kv,
                                qrow,
                                lens[b] - 1,
                                1,
                                hq,
                                d,
                                &mut want[b * hq * d..(b + 1) * hq * d],
                            );
                        }
                        Ok((to_f32(&gpu.download(&out)?), want))
                    },
                );
            }
        }
    }
}

/// The query chunks of the prefill attention cases: per sequence of a
/// batch (T0, n), n query rows at positions T0 … T0 + n − 1 over a cache of
/// T0 + n tokens. Chunks from 0 and from T0 > 0; lengths below one window
/// (32) and one block (64), at and just past 16-token boundaries (48/49,
/// 64/65), a row-tile boundary of the kernel (n·G past 64) and a few
/// thousand tokens (the long ones run at one shape per head dim).
const PREFILL_BATCHES: [&[(usize, usize)]; 5] = [
    &[(0, 17)],
    &[(0, 5), (0, 31), (0, 48), (0, 49), (0, 63), (0, 64), (0, 65)],
    &[(100, 37), (32, 16), (32, 17), (1000, 1), (7, 200)],
    &[(0, 3000)],
    &[(2500, 512), (4095, 1)],
];

/// Dense causal prefill on the tensor cores ([`ops::attention_dense_prefill`])
/// against [`crate::cpu::dense_attention`], at G ∈ {3, 8, 16} × D ∈ {64,
/// 80, 128} over [`PREFILL_BATCHES`] (the two long batches at (G, D) =
/// (16, 128), (8, 64) and (3, 80) only).
fn check_prefill_attention(c: &mut Checker<'_>) {
    let budget = Budget::new(&SparseConfig::default());
    for &g in &[3usize, 8, 16] {
        for &d in &[64usize, 80, 128] {
            let long_shape = matches!((g, d), (16, 128) | (8, 64) | (3, 80));
            for (bi, chunks) in PREFILL_BATCHES.iter().enumerate() {
                if bi >= 3 && !long_shape {
                    continue;
                }
                let hk = 2usize;
                let hq = g * hk;
                c.record(
                    "attention_dense_prefill",
                    json!({"G": g, "H": hq, "Hkv": hk, "D": d, "chunks_t0_n": chunks}),
                    |gpu, inp| {
                        let seqs: Vec<SeqData> = chunks
                            .iter()
                            .map(|&(t0, n)| make_seq(gpu, inp, &budget, t0 + n, hk, d))
                            .collect::<Result<_>>()?;
                        let rows: usize = chunks.iter().map(|&(_, n)| n).sum();
                        let (qb, qf) = inp.bf16(rows * hq * d, 1.5);
                        let q = gpu.upload(&qb)?;
                        let views: Vec<SeqKv<'_>> = seqs
                            .iter()
                            .zip(chunks.iter())
                            .map(|(s, &(t0, n))| SeqKv {
                                k: s.k.as_view(),
                                v: s.v.as_view(),
                                c: None,
                                len: t0 + n,
                            })
                            .collect();
                        let batch = KvBatch::new(gpu, &views, hk, d)?;
                        let counts: Vec<usize> = chunks.iter().map(|&(_, n)| n).collect();
                        let mut out = poison_bf16(gpu, rows * hq * d)?;
                        let scale = 1.0 / (d as f32).sqrt();
                        ops::attention_dense_prefill(
                            gpu,
                            &q,
                            hq * d,
                            hq,
                            &batch,
                            &counts,
                            scale,
                            &mut out,
                            hq * d,
                        )?;
                        let mut want = vec![0.0f32; rows * hq * d];
                        let mut r0 = 0;
                        for (s, &(t0, n)) in seqs.iter().zip(chunks.iter()) {
                            let span = r0 * hq * d..(r0 + n) * hq * d;
                            crate::cpu::dense_attention(
                                &s.kv,
                                &qf[span.clone()],
                                t0,
                                n,
                                hq,
                                d,
                                &mut want[span],
                            );
                            r0 += n;
                        }
                        Ok((to_f32(&gpu.download(&out)?), want))
                    },
                );
            }
        }
    }
}

/// A sparse case: the CPU reference selects blocks and attends; the GPU
/// attends over the CPU's selection (the selection kernels are later work).
fn sparse_case(
    c: &mut Checker<'_>,
    sc: SparseConfig,
    mode: AttentionMode,
    g: usize,
    d: usize,
    lens: &[usize],
) {
    let hk = 2usize;
    let hq = g * hk;
    let plan = AttentionPlan {
        mode,
        sparse: sc,
        budget: Budget::new(&sc),
    };
    let shape_base = json!({
        "mode": format!("{mode:?}"), "G": g, "H": hq, "Hkv": hk, "D": d, "lens": lens,
        "block_size": sc.block_size, "attended_blocks_S": plan.budget.attended, "shortlist_n": plan.budget.shortlist,
    });
    let lens = lens.to_vec();
    c.record("attention_sparse_decode", shape_base, move |gpu, inp| {
        let seqs: Vec<SeqData> = lens
            .iter()
            .map(|&l| make_seq(gpu, inp, &plan.budget, l, hk, d))
            .collect::<Result<_>>()?;
        let (qb, qf) = inp.bf16(lens.len() * hq * d, 1.5);
        let mut want = vec![0.0f32; lens.len() * hq * d];
        let mut selections = Vec::new();
        for (b, s) in seqs.iter().enumerate() {
            let qrow = &qf[b * hq * d..(b + 1) * hq * d];
            let sel = crate::cpu::sparse_attention(
                &plan,
                &s.kv,
                qrow,
                lens[b] - 1,
                1,
                hq,
                &mut want[b * hq * d..(b + 1) * hq * d],
            );
            selections.push(sel);
        }
        let q = gpu.upload(&qb)?;
        let nosa = mode == AttentionMode::Nosa;
        let views: Vec<SeqKv<'_>> = seqs
            .iter()
            .zip(lens.iter())
            .map(|(s, &l)| SeqKv {
                k: s.k.as_view(),
                v: s.v.as_view(),
                c: if nosa { Some(s.c.as_view()) } else { None },
                len: l,
            })
            .collect();
        let batch = KvBatch::new(gpu, &views, hk, d)?;
        let sel = BlockSelection::from_host(gpu, &selections, &lens, sc.block_size)?;
        let mut out = poison_bf16(gpu, lens.len() * hq * d)?;
        let scale = 1.0 / (d as f32).sqrt();
        ops::attention_sparse_decode(
            gpu,
            &q,
            hq * d,
            hq,
            &batch,
            &sel,
            sc.block_size,
            scale,
            &mut out,
            hq * d,
        )?;
        Ok((to_f32(&gpu.download(&out)?), want))
    });
}

fn check_sparse_attention(c: &mut Checker<'_>) {
    // A small budget (S = 12 blocks = 768 tokens, W = 4, shortlist 9) so that
    // short contexts already run past it; lengths: < one window, 16-token
    // boundary and just past it, < one block, at and past a block, under the
    // budget, beyond it.
    let small = SparseConfig {
        window_size: 256,
        topk: 8,
        select_blocks: 4,
        ..SparseConfig::default()
    };
    let lens: &[usize] = &[20, 48, 49, 63, 64, 65, 700, 3000];
    for &g in &[3usize, 8, 16] {
        for &d in &[64usize, 80, 128] {
            sparse_case(c, small, AttentionMode::Nosa, g, d, &[20]);
            sparse_case(c, small, AttentionMode::Nosa, g, d, lens);
        }
    }
    // The default budget (S = 64) past it, at NOSA-8B's shape.
    sparse_case(
        c,
        SparseConfig::default(),
        AttentionMode::Nosa,
        16,
        128,
        &[4200, 5000],
    );
    // one row: 64 splits of one block each
    sparse_case(
        c,
        SparseConfig::default(),
        AttentionMode::Nosa,
        16,
        128,
        &[5000],
    );
    // InfLLM-V2 (no bias).
    sparse_case(c, small, AttentionMode::InfLlmV2, 8, 128, &[100, 3000]);
}

/// A sparse prefill case ([`ops::attention_sparse_prefill`]): every query
/// row of every chunk (T0, n) — rows at positions T0 … T0 + n − 1 over a
/// cache of T0 + n tokens — selects its own blocks with the CPU reference
/// ([`crate::cpu::sparse_attention`] per row, spec §4 and §6), and the GPU
/// attends over those per-row lists; the reference's sparse attention
/// output of every row is the oracle.
fn sparse_prefill_case(
    c: &mut Checker<'_>,
    sc: SparseConfig,
    mode: AttentionMode,
    g: usize,
    d: usize,
    chunks: &[(usize, usize)],
) {
    let hk = 2usize;
    let hq = g * hk;
    let plan = AttentionPlan {
        mode,
        sparse: sc,
        budget: Budget::new(&sc),
    };
    let shape = json!({
        "mode": format!("{mode:?}"), "G": g, "H": hq, "Hkv": hk, "D": d, "chunks_t0_n": chunks,
        "block_size": sc.block_size, "attended_blocks_S": plan.budget.attended, "shortlist_n": plan.budget.shortlist,
    });
    let chunks = chunks.to_vec();
    c.record("attention_sparse_prefill", shape, move |gpu, inp| {
        let seqs: Vec<SeqData> = chunks
            .iter()
            .map(|&(t0, n)| make_seq(gpu, inp, &plan.budget, t0 + n, hk, d))
            .collect::<Result<_>>()?;
        let rows: usize = chunks.iter().map(|&(_, n)| n).sum();
        let (qb, qf) = inp.bf16(rows * hq * d, 1.5);
        let row = hq * d;
        let mut want = vec![0.0f32; rows * row];
        let (mut lists, mut lens) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
        let mut r = 0;
        for (s, &(t0, n)) in seqs.iter().zip(chunks.iter()) {
            for t in t0..t0 + n {
                let sel = crate::cpu::sparse_attention(
                    &plan,
                    &s.kv,
                    &qf[r * row..(r + 1) * row],
                    t,
                    1,
                    hq,
                    &mut want[r * row..(r + 1) * row],
                );
                lists.push(sel);
                lens.push(t + 1);
                r += 1;
            }
        }
        let q = gpu.upload(&qb)?;
        let nosa = mode == AttentionMode::Nosa;
        let views: Vec<SeqKv<'_>> = seqs
            .iter()
            .zip(chunks.iter())
            .map(|(s, &(t0, n))| SeqKv {
                k: s.k.as_view(),
                v: s.v.as_view(),
                c: if nosa { Some(s.c.as_view()) } else { None },
                len: t0 + n,
            })
            .collect();
        let batch = KvBatch::new(gpu, &views, hk, d)?;
        let sel = BlockSelection::from_host(gpu, &lists, &lens, sc.block_size)?;
        let counts: Vec<usize> = chunks.iter().map(|&(_, n)| n).collect();
        let mut out = poison_bf16(gpu, rows * row)?;
        let scale = 1.0 / (d as f32).sqrt();
        ops::attention_sparse_prefill(
            gpu,
            &q,
            row,
            hq,
            &batch,
            &counts,
            &sel,
            sc.block_size,
            scale,
            &mut out,
            row,
        )?;
        Ok((to_f32(&gpu.download(&out)?), want))
    });
}

/// Sparse prefill on the tensor cores against the CPU reference's sparse
/// attention, at G ∈ {3, 8, 16} × D ∈ {64, 80, 128}, NOSA (with the bias)
/// and InfLLM-V2 (none), with a small budget (S = 5 blocks = 320 tokens:
/// W = 2, top-k 3, shortlist 5) so a few hundred tokens exceed it. Chunks
/// (T0, n): a prompt shorter than one window and one block (20), just past
/// a 16-token boundary (49) beside a chunk from T0 = 32 just past one
/// (32 + 17), under the budget (200), and past it (700 from 0; 300 from
/// T0 = 500, beside a one-row chunk at T0 = 1000), the long ones at a few
/// shapes; blocks of 32 and 128 tokens once each (key tiles of part of a
/// block, and several per block).
fn check_sparse_prefill_attention(c: &mut Checker<'_>) {
    let small = SparseConfig {
        window_size: 128,
        topk: 3,
        select_blocks: 2,
        ..SparseConfig::default()
    };
    let short: [&[(usize, usize)]; 3] = [&[(0, 20)], &[(0, 49), (32, 17)], &[(0, 200)]];
    let long: [&[(usize, usize)]; 2] = [&[(0, 700)], &[(500, 300), (1000, 1)]];
    for &g in &[3usize, 8, 16] {
        for &d in &[64usize, 80, 128] {
            for chunks in short {
                sparse_prefill_case(c, small, AttentionMode::Nosa, g, d, chunks);
            }
            let long_shape = matches!((g, d), (16, 128) | (8, 64) | (3, 80));
            if long_shape {
                for chunks in long {
                    sparse_prefill_case(c, small, AttentionMode::Nosa, g, d, chunks);
                }
            }
        }
    }
    // InfLLM-V2 (no bias), under and past the budget.
    for &(g, d) in &[(16usize, 128usize), (3, 64), (8, 80)] {
        sparse_prefill_case(
            c,
            small,
            AttentionMode::InfLlmV2,
            g,
            d,
            &[(0, 49), (32, 17)],
        );
        sparse_prefill_case(c, small, AttentionMode::InfLlmV2, g, d, &[(500, 300)]);
    }
    // Other block sizes: 32 (a key tile holds one block and masks the rest)
    // and 128 (two key tiles per block).
    for bs in [32usize, 128] {
        let sc = SparseConfig {
            block_size: bs,
            window_size: 2 * bs,
            ..small
        };
        sparse_prefill_case(c, sc, AttentionMode::Nosa, 8, 128, &[(0, 20), (100, 600)]);
    }
    // The default budget (S = 64) past it, at NOSA-8B's shape: a 512-row
    // chunk at T0 = 4608.
    sparse_prefill_case(
        c,
        SparseConfig::default(),
        AttentionMode::Nosa,
        16,
        128,
        &[(4608, 512)],
    );
}

/// Runs every kernel of the CUDA backend against the CPU reference on fresh
/// random inputs at the shapes of spec/testing.md (GQA G ∈ {3, 8, 16}, D ∈
/// {64, 80, 128}, batch 1 and > 1 with different lengths, T < 32, T < 64,
/// at and past 16- and 64-token boundaries, shorter and longer than the
/// attended budget), prints one line per case, and writes a JSON report to
/// `out_json`: GPU name, compute capability, driver and NVRTC versions, UTC
/// date, `$SPARDA_COMMIT` (if set), the RNG seed (`$SPARDA_CHECK_SEED`
/// reproduces a run; otherwise drawn from the clock), kernel build info, and
/// per case: kernel, shape, rel_l2, max_abs_err, tolerance, pass. Groups
/// (`$SPARDA_CHECK_ONLY`, comma-separated; unset: all): `kernels`, `select`
/// ([`super::select`]), `sample` ([`super::sample`]), `offload`
/// ([`super::offload`]), `guards` (kernel guards provoked on purpose,
/// [`super::guards`]).
///
/// Returns whether every case passed (relative L2 within its tolerance —
/// [`TOLERANCE_BF16`] unless the case says otherwise — finite, fully
/// written).
///
/// Errors: [`Error::Cuda`] when CUDA is absent (never a panic) or the
/// context cannot be set up; [`Error::Io`] when the report cannot be
/// written. Kernel failures are not errors: they are failed cases.
pub fn gpu_check(out_json: &Path) -> Result<bool> {
    let missing = crate::cuda::missing_libraries();
    if !missing.is_empty() {
        return Err(Error::Cuda(format!(
            "gpu-check needs an NVIDIA GPU with the CUDA 13 libraries; not found: {} (on a GPU machine set LD_LIBRARY_PATH=/usr/local/cuda/lib64)",
            missing.join(", ")
        )));
    }
    let gpu = std::sync::Arc::new(Gpu::new(0)?);
    let seed = std::env::var("SPARDA_CHECK_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    let info = gpu.info().clone();
    println!(
        "gpu-check on {} ({}, {} SMs, driver CUDA {}, NVRTC {}.{}), seed {seed}",
        info.name,
        info.arch,
        info.sm_count,
        info.driver_version_string(),
        info.nvrtc_version.0,
        info.nvrtc_version.1
    );
    let builds = gpu.kernel_builds();
    println!(
        "kernels: {} sources, {} from the disk cache, {:.0} ms to compile/load",
        builds.len(),
        builds.iter().filter(|b| b.cached).count(),
        builds.iter().map(|b| b.ms).sum::<f64>()
    );
    let mut c = Checker {
        gpu: &gpu,
        inp: Inputs {
            rng: SmallRng::seed_from_u64(seed),
        },
        results: Vec::new(),
    };
    // `$SPARDA_CHECK_ONLY` (comma-separated group names: kernels, select,
    // sample, offload, guards) runs only those groups; unset, all of them.
    let only = std::env::var("SPARDA_CHECK_ONLY").ok();
    let group = |g: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|x| x.trim() == g))
    };
    if group("kernels") {
        check_gemm(&mut c);
        check_gemv(&mut c);
        check_embedding(&mut c);
        check_rmsnorm(&mut c);
        check_rope(&mut c);
        check_swiglu(&mut c);
        check_eviction(&mut c);
        check_qkv_append(&mut c);
        check_dense_attention(&mut c);
        check_prefill_attention(&mut c);
        check_sparse_attention(&mut c);
        check_sparse_prefill_attention(&mut c);
    }
    if group("select") {
        c.results
            .extend(super::select::check_selection(&gpu, &mut c.inp.rng));
    }
    if group("sample") {
        c.results
            .extend(super::sample::check_sampling(&gpu, &mut c.inp.rng));
    }
    if group("offload") {
        c.results
            .extend(super::offload::check_offload(&gpu, &mut c.inp.rng));
    }
    if group("guards") {
        c.results
            .extend(super::guards::check_guards(&gpu, &mut c.inp.rng));
    }
    let results = c.results;
    let failed = results.iter().filter(|r| !r.pass).count();
    let mut by_kernel: std::collections::BTreeMap<String, (usize, usize, f64)> = Default::default();
    for r in &results {
        let e = by_kernel.entry(r.kernel.clone()).or_insert((0, 0, 0.0));
        e.0 += 1;
        e.1 += usize::from(r.pass);
        e.2 = if r.rel_l2.is_nan() {
            f64::NAN
        } else {
            e.2.max(r.rel_l2)
        };
    }
    let summary: Value = by_kernel
        .iter()
        .map(|(k, (n, p, mx))| {
            (
                k.clone(),
                json!({"cases": n, "passed": p, "max_rel_l2": mx}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    let report = json!({
        "what": "sparda gpu-check: CUDA kernels vs the CPU reference (spec/testing.md)",
        "gpu": info.name,
        "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
        "arch": info.arch,
        "sm_count": info.sm_count,
        "total_mem_bytes": info.total_mem_bytes,
        "driver_cuda_version": info.driver_version_string(),
        "driver_version_raw": info.driver_version,
        "nvrtc_version": format!("{}.{}", info.nvrtc_version.0, info.nvrtc_version.1),
        "date_utc": utc_now_iso(),
        "commit": std::env::var("SPARDA_COMMIT").ok(),
        "seed": seed,
        "tolerance_rel_l2": TOLERANCE_BF16,
        "kernel_builds": gpu.kernel_builds(),
        "nvrtc_options": crate::cuda::context::env_nvrtc_options(),
        "summary": summary,
        "cases_total": results.len(),
        "cases_failed": failed,
        "passed": failed == 0,
        "cases": results,
    });
    println!("{} cases, {} failed", results.len(), failed);
    for (k, (n, p, mx)) in &by_kernel {
        println!("  {k:<26} {p}/{n} passed, max rel_l2 {mx:.3e}");
    }
    let text = serde_json::to_string_pretty(&report)
        .map_err(|e| Error::Cuda(format!("serialising the report: {e}")))?;
    if let Some(dir) = out_json.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    std::fs::write(out_json, text).map_err(|e| Error::io(out_json, e))?;
    Ok(failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_l2_basics() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]).0, 0.0);
        let (e, mx) = rel_l2(&[1.0, 0.0], &[0.0, 1.0]);
        assert!((e - 2f64.sqrt()).abs() < 1e-12 && mx == 1.0);
        assert!(rel_l2(&[f32::NAN], &[1.0]).0.is_nan());
        assert!(rel_l2(&[1.0], &[1.0, 2.0]).0.is_nan());
    }

    #[test]
    fn iso_date_shape() {
        let s = utc_now_iso();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[10] == b'T');
    }
}
