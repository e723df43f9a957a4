//! Closed-form ridge regression for forecast projections: per layer,
//! W = argmin Σ‖y − W x‖² + λ‖W‖², from Gram matrices XᵀX and XᵀY
//! accumulated in f64 over streamed rows; λ is chosen on held-out positions
//! from one symmetric eigendecomposition of the training Gram (every λ of
//! the grid costs one d×d×k product), then the weights are refitted on
//! training and held-out rows together.
//!
//! Shapes: x is \[d\] (x̂_l, spec §4 "Forecast mode"), y is \[k\] (k = Hkv·D);
//! W is [k, d] row-major, the layout of `q_future_proj.weight`.

use crate::{Error, Result};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par, Side};
use serde::Serialize;

/// Rows buffered before they are folded into the Gram matrices.
const BATCH: usize = 256;

/// Σ xxᵀ, Σ xyᵀ and Σ‖y‖² over the rows added, in f64.
#[derive(Clone)]
pub struct Accumulator {
    d: usize,
    k: usize,
    gram: Mat<f64>,
    cross: Mat<f64>,
    yy: f64,
    rows: u64,
    xb: Vec<f64>,
    yb: Vec<f64>,
}

impl std::fmt::Debug for Accumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Accumulator(d {}, k {}, rows {})",
            self.d, self.k, self.rows
        )
    }
}

fn par() -> Par {
    Par::rayon(0)
}

impl Accumulator {
    /// An empty accumulator for x of length `d` and y of length `k`.
    pub fn new(d: usize, k: usize) -> Self {
        Accumulator {
            d,
            k,
            gram: Mat::zeros(d, d),
            cross: Mat::zeros(d, k),
            yy: 0.0,
            rows: 0,
            xb: Vec::with_capacity(BATCH * d),
            yb: Vec::with_capacity(BATCH * k),
        }
    }

    /// Rows added.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Adds one row (x: \[d\], y: \[k\]).
    ///
    /// Errors: [`Error::Format`] for wrong lengths or a non-finite value
    /// (with its index).
    pub fn add(&mut self, x: &[f32], y: &[f32]) -> Result<()> {
        if x.len() != self.d || y.len() != self.k {
            return Err(Error::Format(format!(
                "ridge row: x has {} values and y {}, expected {} and {}",
                x.len(),
                y.len(),
                self.d,
                self.k
            )));
        }
        if let Some(i) = x.iter().chain(y).position(|v| !v.is_finite()) {
            return Err(Error::Format(format!(
                "ridge row {}: value {i} of [x, y] is not finite",
                self.rows
            )));
        }
        self.xb.extend(x.iter().map(|&v| v as f64));
        self.yb.extend(y.iter().map(|&v| v as f64));
        self.yy += y.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
        self.rows += 1;
        if self.xb.len() == BATCH * self.d {
            self.flush();
        }
        Ok(())
    }

    /// Folds the buffered rows into the Gram matrices.
    fn flush(&mut self) {
        let n = self.xb.len() / self.d;
        if n == 0 {
            return;
        }
        let x = MatRef::from_row_major_slice(&self.xb, n, self.d);
        let y = MatRef::from_row_major_slice(&self.yb, n, self.k);
        matmul(&mut self.gram, Accum::Add, x.transpose(), x, 1.0, par());
        matmul(&mut self.cross, Accum::Add, x.transpose(), y, 1.0, par());
        self.xb.clear();
        self.yb.clear();
    }

    /// Adds `other`'s rows to this one.
    ///
    /// Errors: [`Error::Format`] when the shapes differ.
    pub fn merge(&mut self, other: &Accumulator) -> Result<()> {
        if (self.d, self.k) != (other.d, other.k) {
            return Err(Error::Format(format!(
                "ridge: cannot merge accumulators of (d, k) = ({}, {}) and ({}, {})",
                self.d, self.k, other.d, other.k
            )));
        }
        let mut o = other.clone();
        o.flush();
        self.flush();
        self.gram += &o.gram;
        self.cross += &o.cross;
        self.yy += o.yy;
        self.rows += o.rows;
        Ok(())
    }
}

/// Held-out error of one λ of the grid.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LambdaScore {
    /// λ relative to the mean eigenvalue of the training Gram (tr G / d).
    pub rel: f64,
    /// Held-out Σ‖y − W x‖² / Σ‖y‖² (1 = no better than predicting 0).
    pub held_rel_err: f64,
}

/// A fitted projection.
#[derive(Debug, Clone, Serialize)]
pub struct Fit {
    /// W, [k, d] row-major, f32.
    #[serde(skip)]
    pub w: Vec<f32>,
    /// The chosen λ relative to tr(G)/d.
    pub lambda_rel: f64,
    /// Held-out relative error at the chosen λ (`None` without held-out rows).
    pub held_rel_err: Option<f64>,
    /// The grid's scores.
    pub grid: Vec<LambdaScore>,
    /// Training rows; held-out rows.
    pub rows: (u64, u64),
    /// Relative error of the final fit on all its rows.
    pub train_rel_err: f64,
}

/// The default λ grid, relative to tr(G)/d.
pub const DEFAULT_GRID: [f64; 11] = [
    1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 0.3, 1.0, 3.0, 10.0,
];

/// Σ_ij A_ij B_ij.
fn dot(a: MatRef<'_, f64>, b: MatRef<'_, f64>) -> f64 {
    let mut s = 0.0;
    for j in 0..a.ncols() {
        for i in 0..a.nrows() {
            s += a[(i, j)] * b[(i, j)];
        }
    }
    s
}

/// Σ‖y − W x‖² from the sums: tr(WᵀᵀG Wᵀ) − 2 tr(Wᵀᵀ C) + Σ‖y‖², with Wt = Wᵀ [d, k].
fn sse(acc: &Accumulator, wt: MatRef<'_, f64>) -> f64 {
    let mut gw = Mat::<f64>::zeros(acc.d, acc.k);
    matmul(&mut gw, Accum::Replace, &acc.gram, wt, 1.0, par());
    dot(wt, gw.as_ref()) - 2.0 * dot(wt, acc.cross.as_ref()) + acc.yy
}

/// Fits W on `train`, choosing λ from `grid` (relative to tr(G)/d) by the
/// error on `held`, then refits on both with that λ. Without held-out rows,
/// the λ of `grid` nearest 1e-3 is used.
///
/// Errors: [`Error::Format`] for no training rows or mismatched shapes;
/// [`Error::Solve`] when the eigendecomposition or the Cholesky solve fails
/// (with the layer context added by the caller).
pub fn fit(train: &Accumulator, held: &Accumulator, grid: &[f64]) -> Result<Fit> {
    if train.rows == 0 {
        return Err(Error::Format("ridge: no training rows".into()));
    }
    if grid.is_empty() || grid.iter().any(|g| !(g.is_finite() && *g > 0.0)) {
        return Err(Error::Format(format!(
            "ridge: the λ grid must be finite values > 0, got {grid:?}"
        )));
    }
    let mut train = train.clone();
    train.flush();
    let mut held = held.clone();
    held.flush();
    let (d, k) = (train.d, train.k);
    let mut scores = Vec::new();
    let chosen = if held.rows > 0 {
        let evd = train
            .gram
            .self_adjoint_eigen(Side::Lower)
            .map_err(|e| Error::Solve(format!("eigendecomposition of the {d}×{d} Gram: {e:?}")))?;
        let u = evd.U();
        let s: Vec<f64> = (0..d).map(|i| evd.S()[i].max(0.0)).collect();
        let mean = train.gram.diagonal().column_vector().iter().sum::<f64>() / d as f64;
        let mut z = Mat::<f64>::zeros(d, k);
        matmul(
            &mut z,
            Accum::Replace,
            u.transpose(),
            &train.cross,
            1.0,
            par(),
        );
        let mut best = (f64::INFINITY, grid[0]);
        for &rel in grid {
            let lam = rel * mean.max(f64::MIN_POSITIVE);
            let zs = Mat::<f64>::from_fn(d, k, |i, j| z[(i, j)] / (s[i] + lam));
            let mut wt = Mat::<f64>::zeros(d, k);
            matmul(&mut wt, Accum::Replace, u, &zs, 1.0, par());
            let e = sse(&held, wt.as_ref()) / held.yy.max(f64::MIN_POSITIVE);
            scores.push(LambdaScore {
                rel,
                held_rel_err: e,
            });
            if e < best.0 {
                best = (e, rel);
            }
        }
        best.1
    } else {
        *grid
            .iter()
            .min_by(|a, b| (a.log10() + 3.0).abs().total_cmp(&(b.log10() + 3.0).abs()))
            .unwrap()
    };
    let mut all = train.clone();
    all.merge(&held)?;
    let mean = all.gram.diagonal().column_vector().iter().sum::<f64>() / d as f64;
    let lam = chosen * mean.max(f64::MIN_POSITIVE);
    let mut a = all.gram.clone();
    for i in 0..d {
        a[(i, i)] += lam;
    }
    let llt = a.llt(Side::Lower).map_err(|e| {
        Error::Solve(format!(
            "Cholesky of the {d}×{d} Gram + λI (λ {lam:.3e}): {e:?}"
        ))
    })?;
    let wt = faer::linalg::solvers::Solve::solve(&llt, &all.cross);
    let train_rel_err = sse(&all, wt.as_ref()) / all.yy.max(f64::MIN_POSITIVE);
    let mut w = vec![0.0f32; k * d];
    for j in 0..k {
        for i in 0..d {
            w[j * d + i] = wt[(i, j)] as f32;
        }
    }
    Ok(Fit {
        w,
        lambda_rel: chosen,
        held_rel_err: scores
            .iter()
            .find(|s| s.rel == chosen)
            .map(|s| s.held_rel_err),
        grid: scores,
        rows: (train.rows, held.rows),
        train_rel_err,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [−1, 1) (splitmix64).
    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_add(0x9e3779b97f4a7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// A known linear map is recovered from noisy samples, λ is chosen
    /// small on held-out rows, and the held-out error is near the noise floor.
    #[test]
    fn recovers_a_known_linear_map() {
        let (d, k) = (24, 7);
        let mut r = rng(7);
        let w_true: Vec<f32> = (0..k * d).map(|_| r()).collect();
        let mut train = Accumulator::new(d, k);
        let mut held = Accumulator::new(d, k);
        for i in 0..1500 {
            let x: Vec<f32> = (0..d).map(|_| r()).collect();
            let y: Vec<f32> = (0..k)
                .map(|j| {
                    let clean: f32 = (0..d).map(|c| w_true[j * d + c] * x[c]).sum();
                    clean + 0.01 * r()
                })
                .collect();
            if i % 5 == 0 {
                held.add(&x, &y).unwrap()
            } else {
                train.add(&x, &y).unwrap()
            }
        }
        assert_eq!((train.rows(), held.rows()), (1200, 300));
        let f = fit(&train, &held, &DEFAULT_GRID).unwrap();
        let max_err =
            f.w.iter()
                .zip(&w_true)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
        assert!(max_err < 5e-3, "max |W − W_true| = {max_err}");
        assert!(f.lambda_rel <= 1e-3, "λ {}", f.lambda_rel);
        let e = f.held_rel_err.unwrap();
        assert!(e < 1e-3, "held-out relative error {e}");
        // a large λ is worse on held-out rows than the chosen one
        let big = f.grid.iter().find(|s| s.rel == 1.0).unwrap().held_rel_err;
        assert!(big > 10.0 * e, "λ = 1: {big} vs chosen {e}");
    }

    /// With fewer rows than inputs, ridge still solves (λ > 0 keeps the
    /// system positive definite) and bad rows are refused by number.
    #[test]
    fn underdetermined_and_bad_rows() {
        let mut a = Accumulator::new(10, 2);
        for i in 0..4 {
            let x: Vec<f32> = (0..10).map(|j| ((i * 10 + j) % 7) as f32).collect();
            a.add(&x, &[x[0], -x[1]]).unwrap();
        }
        let f = fit(&a, &Accumulator::new(10, 2), &DEFAULT_GRID).unwrap();
        assert_eq!(f.lambda_rel, 1e-3);
        assert!(f.w.iter().all(|v| v.is_finite()));
        assert!(f.train_rel_err < 1e-2, "{}", f.train_rel_err);
        assert!(a
            .add(&[0.0; 9], &[0.0; 2])
            .unwrap_err()
            .to_string()
            .contains("x has 9"));
        let mut x = vec![0.0; 10];
        x[3] = f32::NAN;
        assert!(a
            .add(&x, &[0.0; 2])
            .unwrap_err()
            .to_string()
            .contains("value 3"));
        assert!(fit(
            &Accumulator::new(3, 1),
            &Accumulator::new(3, 1),
            &DEFAULT_GRID
        )
        .is_err());
    }
}
