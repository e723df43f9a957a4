//! GPU sampling (kernels/sample.cu, [`ops::sample_rows`]) against the CPU
//! rule [`sample::sample_with_u`], called from
//! [`gpu_check`](super::kernels::gpu_check) (group `sample`). Each case
//! samples several rows of random logits with random draws and compares the
//! token ids: equal, or a difference where the draw (or the top-p cut) lies
//! within [`NEAR_BOUNDARY`] of a cumulative boundary
//! ([`sample::sample_margin`]), since the two sides sum in different
//! orders. `rel_l2` is the fraction of rows that differ without that
//! excuse; tolerance 0.
//!
//! Vocabularies 1,000 / 49,152 (SmolLM2) / 128,256 (Llama 3); logits of
//! spread 1 and 8 (flat and peaked), with ties (values rounded to 1/8) and
//! with −inf / +inf / NaN entries (rows with a NaN or a +inf, which no token
//! can be chosen from, must get their argmax: the kernel reports them to the
//! device error record, checked in group `guards`); parameters: temperature only, top-k, top-p,
//! both, top-k past the vocabulary, greedy (T = 0 and top-k 1); draws
//! including 0 and 1 − 2⁻⁵³.
//!
//! The greedy argmax kernel (`argmax_rows`, kernels/argmax.cu, the same
//! row reduction as the decode step's `argmax_advance`) against
//! [`sample::argmax`]: the same logits kinds over vocabularies whose rows
//! start at 16-byte aligned addresses (a multiple of 4 values: the 16-byte
//! load path and its tail) and at unaligned ones (1,001 and 49,157: the
//! scalar path from row 1 on); ids equal, tolerance 0.

use super::kernels::CaseResult;
use crate::cuda::device_error::ErrorSink;
use crate::cuda::{ops, Gpu};
use crate::sample::{self, SamplingParams};
use rand::rngs::SmallRng;
use rand::Rng;
use serde_json::json;

/// Distance (relative to the kept mass) under which a differing token is
/// put down to summation order, not a fault.
pub const NEAR_BOUNDARY: f64 = 1e-9;

/// Logits of one case: `rows` × `vocab` values.
fn logits(rng: &mut SmallRng, rows: usize, vocab: usize, spread: f32, kind: &str) -> Vec<f32> {
    let mut x: Vec<f32> = super::kernels::normal(rng, rows * vocab, spread);
    match kind {
        "ties" => x.iter_mut().for_each(|v| *v = (*v * 8.0).round() / 8.0),
        "nonfinite" => {
            for r in 0..rows {
                for _ in 0..8 {
                    let j = rng.random_range(0..vocab);
                    x[r * vocab + j] = [f32::NEG_INFINITY, f32::NAN][rng.random_range(0..2)];
                }
            }
        }
        "inf" => {
            for r in 0..rows {
                let j = rng.random_range(0..vocab);
                x[r * vocab + j] = f32::INFINITY;
            }
        }
        _ => {}
    }
    x
}

/// The greedy argmax cases (group `sample` of gpu-check): `argmax_rows`
/// against [`sample::argmax`], every id equal.
fn check_argmax(gpu: &Gpu, rng: &mut SmallRng) -> Vec<CaseResult> {
    let mut out = Vec::new();
    for &vocab in &[1000usize, 1001, 4099, 49_157, 128_256] {
        for (spread, kind) in [
            (1.0f32, "plain"),
            (2.0, "ties"),
            (2.0, "nonfinite"),
            (2.0, "inf"),
        ] {
            let rows = 5;
            let mut x = logits(rng, rows, vocab, spread, kind);
            if kind == "ties" {
                // row 0's largest value a second time, in its last element (or
                // the one before, when the largest is already last)
                let (mx, at) = x[..vocab]
                    .iter()
                    .enumerate()
                    .fold((f32::MIN, 0), |b, (i, &v)| if v > b.0 { (v, i) } else { b });
                let copy = if at == vocab - 1 {
                    vocab - 2
                } else {
                    vocab - 1
                };
                x[copy] = mx;
            }
            let shape = json!({"vocab": vocab, "rows": rows, "spread": spread, "logits": kind});
            let r = gpu
                .upload(&x)
                .and_then(|dev| ops::argmax_rows(gpu, &dev, rows, vocab, ErrorSink::NONE));
            out.push(match r {
                Ok(got) => {
                    let mut bad = 0usize;
                    let mut first = None;
                    for (r, &g) in got.iter().enumerate() {
                        let want = sample::argmax(&x[r * vocab..(r + 1) * vocab]);
                        if g != want {
                            bad += 1;
                            first.get_or_insert(format!("row {r}: GPU {g} vs CPU {want}"));
                        }
                    }
                    CaseResult {
                        kernel: "argmax_rows".into(),
                        shape,
                        rel_l2: bad as f64 / rows as f64,
                        max_abs_err: bad as f64,
                        tolerance: 0.0,
                        pass: bad == 0 && got.len() == rows,
                        error: first,
                    }
                }
                Err(e) => CaseResult::failed("argmax_rows", shape, 0.0, e.to_string()),
            });
        }
    }
    out
}

/// The sampling cases (group `sample` of gpu-check).
pub fn check_sampling(gpu: &Gpu, rng: &mut SmallRng) -> Vec<CaseResult> {
    let params = [
        (0.7f32, 0usize, 1.0f32),
        (1.0, 50, 1.0),
        (0.8, 0, 0.9),
        (1.3, 40, 0.95),
        (1.0, 200_000, 0.5),
        (1.0, 0, 0.05),
        (0.0, 0, 1.0),
        (1.0, 1, 1.0),
    ];
    let mut out = check_argmax(gpu, rng);
    for &vocab in &[1000usize, 49_152, 128_256] {
        for (spread, kind) in [
            (1.0f32, "plain"),
            (8.0, "plain"),
            (2.0, "ties"),
            (2.0, "nonfinite"),
            (2.0, "inf"),
        ] {
            for &(temperature, top_k, top_p) in &params {
                let rows = 6;
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: 0,
                };
                let x = logits(rng, rows, vocab, spread, kind);
                let mut u: Vec<f64> = (0..rows).map(|_| rng.random::<f64>()).collect();
                u[0] = 0.0;
                u[1] = 1.0 - f64::EPSILON / 2.0;
                let shape = json!({"vocab": vocab, "rows": rows, "spread": spread, "logits": kind,
                                   "temperature": temperature, "top_k": top_k, "top_p": top_p});
                let r = (|| {
                    let dev = gpu.upload(&x)?;
                    ops::sample_rows(gpu, &dev, rows, vocab, &p, &u, ErrorSink::NONE)
                })();
                out.push(match r {
                    Ok(got) => {
                        let (mut bad, mut near, mut first) = (0usize, 0usize, None);
                        for r in 0..rows {
                            let row = &x[r * vocab..(r + 1) * vocab];
                            // a row no token can be chosen from gets its argmax
                            // (and is reported where a record is given: group
                            // `guards`, `sample_rows (non-finite)`)
                            let want = match sample::check_logits(row) {
                                Ok(()) => sample::sample_with_u(&p, row, u[r]),
                                Err(_) => sample::argmax(row),
                            };
                            if got[r] == want {
                                continue;
                            }
                            if sample::sample_margin(&p, row, u[r]) < NEAR_BOUNDARY {
                                near += 1;
                            } else {
                                bad += 1;
                                first.get_or_insert(format!(
                                    "row {r}: GPU {} vs CPU {want} (u {})",
                                    got[r], u[r]
                                ));
                            }
                        }
                        let mut shape = shape;
                        shape["near_boundary"] = json!(near);
                        CaseResult {
                            kernel: "sample_rows".into(),
                            shape,
                            rel_l2: bad as f64 / rows as f64,
                            max_abs_err: bad as f64,
                            tolerance: 0.0,
                            pass: bad == 0,
                            error: first,
                        }
                    }
                    Err(e) => CaseResult::failed("sample_rows", shape, 0.0, e.to_string()),
                });
            }
        }
    }
    out
}
