//! Per-(layer, sequence) state that grows with every token (spec §3):
//! post-RoPE K, V, eviction scores c, compressed keys Kc and pooled c (p).
//! Nothing here is sized once: generations of any length keep it correct
//! (runtime.md §3 fault 1).

use super::select::Budget;

/// The §3 state of one layer of one sequence, f32, row-major.
#[derive(Debug, Clone, Default)]
pub struct LayerKv {
    /// Hkv · D (floats per token in `k` and `v`).
    pub kv_dim: usize,
    /// Hkv.
    pub kv_heads: usize,
    /// Post-RoPE keys, [T, Hkv, D].
    pub k: Vec<f32>,
    /// Values, [T, Hkv, D].
    pub v: Vec<f32>,
    /// Eviction scores c, [T, Hkv] (empty rows of zeros when the model has no eviction head).
    pub c: Vec<f32>,
    /// Compressed keys Kc, [Mc, Hkv, D]: mean of K over each window.
    pub kc: Vec<f32>,
    /// Pooled eviction scores p, [Mc, Hkv]: mean of c over each window.
    pub p: Vec<f32>,
}

impl LayerKv {
    /// Empty state for `kv_heads` heads of `head_dim`.
    pub fn new(kv_heads: usize, head_dim: usize) -> Self {
        LayerKv {
            kv_dim: kv_heads * head_dim,
            kv_heads,
            ..Default::default()
        }
    }

    /// T: tokens stored.
    pub fn len(&self) -> usize {
        self.k.len().checked_div(self.kv_dim).unwrap_or(0)
    }

    /// Whether no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Mc: compressed windows stored.
    pub fn windows(&self) -> usize {
        self.kc.len().checked_div(self.kv_dim).unwrap_or(0)
    }

    /// Appends tokens (k, v: [n, Hkv, D]; c: [n, Hkv]) and completes every
    /// compressed window that the new length makes whole (spec §3).
    pub fn append(&mut self, budget: &Budget, k: &[f32], v: &[f32], c: &[f32]) {
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        self.c.extend_from_slice(c);
        self.compress(budget);
    }

    /// Completes the compressed windows up to Mc(T).
    fn compress(&mut self, budget: &Budget) {
        let (kvd, hk) = (self.kv_dim, self.kv_heads);
        let want = budget.windows(self.len());
        let inv = 1.0 / budget.kernel_size as f32;
        for i in self.windows()..want {
            let start = i * budget.kernel_stride;
            let mut kc = vec![0.0f32; kvd];
            let mut p = vec![0.0f32; hk];
            for t in start..start + budget.kernel_size {
                for (a, b) in kc.iter_mut().zip(&self.k[t * kvd..(t + 1) * kvd]) {
                    *a += b;
                }
                for (a, b) in p.iter_mut().zip(&self.c[t * hk..(t + 1) * hk]) {
                    *a += b;
                }
            }
            self.kc.extend(kc.iter().map(|x| x * inv));
            self.p.extend(p.iter().map(|x| x * inv));
        }
    }
}
