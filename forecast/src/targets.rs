//! What the forecast of a layer is regressed onto (spec §4 "Forecast mode":
//! layer l's forecast f = RoPE(q_future_proj_l · x̂_l), one vector per KV
//! head of layer l+1, scores layer l+1's compressed keys by f_h · Kc\[i,h\]).
//! Two definitions, both pre-RoPE vectors of [Hkv·D]:
//!
//! - [`QMEAN`]: the group mean of layer l+1's pre-RoPE queries over the G
//!   query heads of each KV head. Ranking windows by mean_g q_g · Kc is
//!   ranking by the mean over heads of the log-softmax scores, which the
//!   real score Σ_g softmax_g approximates when the heads agree.
//! - [`SCORE`]: per position, the vector whose dot products with the
//!   centred compressed keys best fit (least squares) the centred logarithm
//!   of the real query-aware window scores log Σ_g softmax_i(q_g·Kc_i/√D),
//!   rotated back to pre-RoPE coordinates: the linear scorer closest to the
//!   real scores, not to the queries.

/// Name of the group-mean pre-RoPE query target.
pub const QMEAN: &str = "qmean";
/// Name of the window-score fit target.
pub const SCORE: &str = "score";
/// Every target `collect` records, in record order.
pub const ALL: [&str; 2] = [QMEAN, SCORE];

use crate::{Error, Result};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par, Side};

/// Group mean of pre-RoPE queries: q is [H·D] (query head j belongs to KV
/// head j / G, G = H / Hkv); returns [Hkv·D].
///
/// Errors: [`Error::Format`] when H is not a multiple of Hkv or q's length
/// is not H·D.
pub fn group_mean(q: &[f32], heads: usize, kv_heads: usize, head_dim: usize) -> Result<Vec<f32>> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || q.len() != heads * head_dim {
        return Err(Error::Format(format!(
            "group mean: {} query values for {heads} heads of {head_dim} over {kv_heads} KV heads",
            q.len()
        )));
    }
    let g = heads / kv_heads;
    let mut out = vec![0.0f32; kv_heads * head_dim];
    for (j, qj) in q.chunks_exact(head_dim).enumerate() {
        let o = &mut out[(j / g) * head_dim..(j / g + 1) * head_dim];
        for (a, b) in o.iter_mut().zip(qj) {
            *a += b / g as f32;
        }
    }
    Ok(out)
}

/// The least-squares linear scorer of one KV head: f minimising
/// Σ_i (f · (k_i − k̄) − (s_i − s̄))² + ε‖f‖², with ε = `rel_eps` · tr(A)/D
/// (A = Σ (k_i − k̄)(k_i − k̄)ᵀ), over `mc` windows whose keys are the rows
/// of `kc` (row i at offset i·`stride`, `head_dim` values) and whose target
/// scores are `s` (e.g. log of the real query-aware window scores).
/// Returns \[D\] in the keys' (post-RoPE) coordinates; all zeros when mc < 2.
///
/// Errors: [`Error::Format`] for lengths that do not fit or non-finite
/// scores; [`Error::Solve`] when the Cholesky solve fails.
pub fn score_fit(
    kc: &[f32],
    stride: usize,
    head_dim: usize,
    s: &[f32],
    rel_eps: f64,
) -> Result<Vec<f32>> {
    let mc = s.len();
    if mc > 0 && (mc - 1) * stride + head_dim > kc.len() {
        return Err(Error::Format(format!(
            "score fit: {mc} windows at stride {stride} need {} key values, got {}",
            (mc - 1) * stride + head_dim,
            kc.len()
        )));
    }
    if let Some(i) = s.iter().position(|v| !v.is_finite()) {
        return Err(Error::Format(format!(
            "score fit: window score {i} is not finite"
        )));
    }
    if mc < 2 {
        return Ok(vec![0.0; head_dim]);
    }
    let mut mean_k = vec![0.0f64; head_dim];
    for i in 0..mc {
        for (m, v) in mean_k
            .iter_mut()
            .zip(&kc[i * stride..i * stride + head_dim])
        {
            *m += *v as f64 / mc as f64;
        }
    }
    let mean_s = s.iter().map(|&v| v as f64).sum::<f64>() / mc as f64;
    let k = Mat::<f64>::from_fn(mc, head_dim, |i, j| kc[i * stride + j] as f64 - mean_k[j]);
    let y = Mat::<f64>::from_fn(mc, 1, |i, _| s[i] as f64 - mean_s);
    let mut a = Mat::<f64>::zeros(head_dim, head_dim);
    matmul(&mut a, Accum::Replace, k.transpose(), &k, 1.0, Par::Seq);
    let mut b = Mat::<f64>::zeros(head_dim, 1);
    matmul(&mut b, Accum::Replace, k.transpose(), &y, 1.0, Par::Seq);
    let tr = (0..head_dim).map(|i| a[(i, i)]).sum::<f64>() / head_dim as f64;
    let eps = (rel_eps * tr).max(1e-12);
    for i in 0..head_dim {
        a[(i, i)] += eps;
    }
    let llt = a.llt(Side::Lower).map_err(|e| {
        Error::Solve(format!(
            "score fit: Cholesky of the {head_dim}×{head_dim} key Gram: {e:?}"
        ))
    })?;
    let f = faer::linalg::solvers::Solve::solve(&llt, &b);
    Ok((0..head_dim).map(|i| f[(i, 0)] as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_mean_averages_each_kv_heads_queries() {
        // H = 4, Hkv = 2, D = 2: heads 0,1 → KV 0; heads 2,3 → KV 1
        let q = [1.0, 2.0, 3.0, 4.0, 10.0, 0.0, 0.0, 10.0];
        assert_eq!(group_mean(&q, 4, 2, 2).unwrap(), vec![2.0, 3.0, 5.0, 5.0]);
        assert!(group_mean(&q, 3, 2, 2).is_err());
    }

    #[test]
    fn score_fit_recovers_a_linear_scorer_up_to_an_offset() {
        // s_i = f·k_i + 7 exactly: the fit returns f (the offset is centred away)
        let f = [0.5f32, -1.0, 2.0];
        let (mc, stride) = (40, 5);
        let kc: Vec<f32> = (0..mc * stride)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let s: Vec<f32> = (0..mc)
            .map(|i| (0..3).map(|j| f[j] * kc[i * stride + j]).sum::<f32>() + 7.0)
            .collect();
        let got = score_fit(&kc, stride, 3, &s, 1e-9).unwrap();
        for (g, w) in got.iter().zip(&f) {
            assert!((g - w).abs() < 1e-4, "{got:?} vs {f:?}");
        }
        assert_eq!(
            score_fit(&kc, stride, 3, &s[..1], 1e-9).unwrap(),
            vec![0.0; 3]
        );
        assert!(score_fit(&kc[..10], stride, 3, &s, 1e-9).is_err());
    }
}
