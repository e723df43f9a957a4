//! f32 building blocks of the CPU reference (spec/nosa-model.md §3, §5, §7).

/// Dot product of two equal-length slices, 8 partial sums (vectorizes).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a · x` over equal-length slices.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// y[n, out] = x[n, in] · W[out, in]ᵀ (+ bias\[out\]), the layout of HF linear
/// weights; f32 GEMM through `matrixmultiply`.
pub fn linear(x: &[f32], n: usize, w: &[f32], bias: Option<&[f32]>, out: usize) -> Vec<f32> {
    let k = w.len() / out;
    assert_eq!(w.len(), out * k, "weight is not [out, in]");
    assert_eq!(x.len(), n * k, "input is not [n, in]");
    let mut y = vec![0.0f32; n * out];
    if n <= MATVEC_ROWS {
        // Decode shapes: one dot product per (row, output) over contiguous
        // weight rows, outputs split across threads. GEMM packing would copy
        // the whole weight matrix per call.
        matvec(x, n, w, k, out, &mut y);
    } else if out > 0 {
        // SAFETY: the pointers cover n·k, out·k and n·out floats with the given strides.
        unsafe {
            matrixmultiply::sgemm(
                n,
                k,
                out,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                w.as_ptr(),
                1,
                k as isize,
                0.0,
                y.as_mut_ptr(),
                out as isize,
                1,
            );
        }
    }
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(out) {
            for (yi, bi) in row.iter_mut().zip(b) {
                *yi += bi;
            }
        }
    }
    y
}

/// Inputs of at most this many rows go through `matvec` (dot products) instead of GEMM.
pub const MATVEC_ROWS: usize = 4;

/// y[n, out] = x[n, k] · W[out, k]ᵀ by dot products, output columns split
/// over the available cores (each output computed by one thread, in one
/// order: the result does not depend on the thread count).
fn matvec(x: &[f32], n: usize, w: &[f32], k: usize, out: usize, y: &mut [f32]) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(16);
    let per = out.div_ceil(threads).max(256);
    let mut cols: Vec<Vec<f32>> = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..out)
            .step_by(per)
            .map(|o0| {
                let o1 = (o0 + per).min(out);
                s.spawn(move || {
                    let mut part = vec![0.0f32; n * (o1 - o0)];
                    for o in o0..o1 {
                        let wr = &w[o * k..(o + 1) * k];
                        for r in 0..n {
                            part[r * (o1 - o0) + (o - o0)] = dot(&x[r * k..(r + 1) * k], wr);
                        }
                    }
                    part
                })
            })
            .collect();
        cols = handles
            .into_iter()
            .map(|h| h.join().expect("matvec worker"))
            .collect();
    });
    for (ci, part) in cols.iter().enumerate() {
        let o0 = ci * per;
        let width = part.len() / n.max(1);
        for r in 0..n {
            y[r * out + o0..r * out + o0 + width]
                .copy_from_slice(&part[r * width..(r + 1) * width]);
        }
    }
}

/// RMSNorm of each row of `x` ([n, d]): x / sqrt(mean(x²) + eps) · w, in f32 (spec §7).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        y.extend(row.iter().zip(w).map(|(v, wi)| v * r * wi));
    }
    y
}

/// [`rms_norm`] with the bf16 roundings of the CUDA engine's
/// `rmsnorm_residual` (kernels/rmsnorm.cu, spec §7): bf16(bf16(x · inv) · w),
/// each rounding when its flag is set (bf16 emulation of the CPU reference).
pub fn rms_norm_rounded(
    x: &[f32],
    w: &[f32],
    eps: f32,
    round_normed: bool,
    round_out: bool,
) -> Vec<f32> {
    let rb = |v: f32, on: bool| {
        if on {
            half::bf16::from_f32(v).to_f32()
        } else {
            v
        }
    };
    let d = w.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        y.extend(
            row.iter()
                .zip(w)
                .map(|(v, wi)| rb(rb(v * r, round_normed) * wi, round_out)),
        );
    }
    y
}

/// Applies NeoX (rotate-half) RoPE in place to `heads` vectors of `cos.len()·2`
/// values: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), spec §1.
pub fn rope_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for v in x.chunks_exact_mut(2 * half) {
        let (x1, x2) = v.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// SiLU: x · σ(x).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// softplus(x) = ln(1 + eˣ), linear above x = 20 (as torch), spec §3.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// NOSA eviction scores (spec §3) of n tokens: c[i, h] = A\[h\] ·
/// softplus(δ_h · v_i + b\[h\]), all f32, where v_i is token i's value over
/// every KV head (`v`: [n, Hkv·D]), `delta` is [Hkv, Hkv·D], `bias`
/// (optional) and `a` are \[Hkv\]; returns [n, Hkv]. The GPU engine
/// computes the same on the bf16 v it caches (kernels/kv_append.cu).
pub fn eviction_scores(
    v: &[f32],
    n: usize,
    delta: &[f32],
    bias: Option<&[f32]>,
    a: &[f32],
) -> Vec<f32> {
    let hk = a.len();
    let mut z = linear(v, n, delta, bias, hk);
    for row in z.chunks_exact_mut(hk.max(1)) {
        for (zh, &ah) in row.iter_mut().zip(a) {
            *zh = ah * softplus(*zh);
        }
    }
    z
}

/// Softmax-weighted sum over tokens for one query vector: returns
/// Σ_j softmax_j(q·k_j·scale + bias_j) v_j, with `keys` and `values`
/// yielding (k_j, v_j, bias_j). Accumulates in f32 with a running max
/// (online softmax), in the order the iterator gives.
pub fn attend<'a>(
    q: &[f32],
    scale: f32,
    kvb: impl Iterator<Item = (&'a [f32], &'a [f32], f32)>,
    out: &mut [f32],
) {
    out.fill(0.0);
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    for (k, v, b) in kvb {
        let s = dot(q, k) * scale + b;
        if s > m {
            let corr = (m - s).exp();
            for o in out.iter_mut() {
                *o *= corr;
            }
            l *= corr;
            m = s;
        }
        let p = (s - m).exp();
        l += p;
        axpy(out, p, v);
    }
    if l > 0.0 {
        for o in out.iter_mut() {
            *o /= l;
        }
    }
}
