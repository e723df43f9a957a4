//! Decode-time block selection, as pure functions (spec/nosa-model.md §3–§4).
//!
//! Everything here works on one (sequence, KV head) at a time and on f32
//! scores, so the CPU reference, the GPU kernels' tests and the offload
//! set-difference logic can all share it.

use crate::config::SparseConfig;

/// Which selection rule runs (spec §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum SelectionRule {
    /// Query-aware shortlist of n, then the S highest eviction scores.
    Nosa,
    /// The S highest query-aware scores (no eviction head).
    InfLlmV2,
}

/// The budget of spec §1 in blocks, derived once from a [`SparseConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Tokens per block (64).
    pub block_size: usize,
    /// Compression stride in tokens (16).
    pub kernel_stride: usize,
    /// Compression window in tokens (32 = 2 · stride).
    pub kernel_size: usize,
    /// Sink blocks (forced).
    pub init_blocks: usize,
    /// W: window blocks before the current one (forced).
    pub window_blocks: usize,
    /// S: attended blocks per (sequence, KV head).
    pub attended: usize,
    /// n: query-aware shortlist size.
    pub shortlist: usize,
}

impl Budget {
    /// The budget table of spec §1 for `sc`.
    pub fn new(sc: &SparseConfig) -> Self {
        Budget {
            block_size: sc.block_size,
            kernel_stride: sc.kernel_stride,
            kernel_size: sc.kernel_size,
            init_blocks: sc.init_blocks,
            window_blocks: sc.window_blocks(),
            attended: sc.budget_blocks(),
            shortlist: sc.shortlist_blocks(),
        }
    }

    /// Windows per block (block_size / kernel_stride).
    pub fn windows_per_block(&self) -> usize {
        self.block_size / self.kernel_stride
    }

    /// Mc: compressed windows that exist once `t_len` tokens are known
    /// (window i covers [stride·i, stride·i + kernel) and exists iff
    /// t_len ≥ stride·i + kernel), spec §3.
    pub fn windows(&self, t_len: usize) -> usize {
        if t_len < self.kernel_size {
            0
        } else {
            (t_len - self.kernel_size) / self.kernel_stride + 1
        }
    }

    /// Number of blocks 0 … q that exist when the query sits at position
    /// `t` (q = t div block_size), i.e. q + 1.
    pub fn blocks(&self, t: usize) -> usize {
        t / self.block_size + 1
    }

    /// The windows overlapping block `m`, as a half-open range clipped to
    /// [0, mc): [wpb·m − 1, wpb·m + wpb) with wpb = windows per block
    /// (for the defaults: [4m−1, 4m+3]), spec §3.
    pub fn block_windows(&self, m: usize, mc: usize) -> std::ops::Range<usize> {
        let wpb = self.windows_per_block();
        let lo = (wpb * m).saturating_sub(self.kernel_size / self.kernel_stride - 1);
        let hi = (wpb * m + wpb).min(mc);
        lo.min(hi)..hi
    }

    /// Whether block `m` is forced for a query in block `q`: a sink block
    /// (m < init_blocks) or in the window q − W ≤ m ≤ q (spec §4.3).
    pub fn is_forced(&self, m: usize, q: usize) -> bool {
        m < self.init_blocks || (m + self.window_blocks >= q && m <= q)
    }
}

/// Pools per-window scores to blocks: block m gets the max over the windows
/// overlapping it ([`Budget::block_windows`]), −∞ when none exists (spec §3).
///
/// `window_scores` has one entry per existing window (length Mc); the result
/// has `n_blocks` entries.
pub fn pool_blocks(budget: &Budget, window_scores: &[f32], n_blocks: usize) -> Vec<f32> {
    let mc = window_scores.len();
    (0..n_blocks)
        .map(|m| {
            window_scores[budget.block_windows(m, mc)]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

/// Indices of the `k` highest entries of `scores` (f32 ranking, ties broken
/// by the lower index, spec §4.7), in ranking order. NaN ranks lowest.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let key = |i: usize| {
        if scores[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            scores[i]
        }
    };
    let cmp = |a: &usize, b: &usize| key(*b).total_cmp(&key(*a)).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

/// Selects the attended blocks of one (sequence, KV head) for a query in
/// block `q` (spec §4 steps 3–6).
///
/// - `r`: pooled query-aware scores of blocks 0 … q (length q + 1);
/// - `e`: pooled eviction scores of blocks 0 … q (ignored for InfLLM-V2).
///
/// Returns the selected block ids in ascending order (at most S of them;
/// every existing block when q + 1 ≤ S).
pub fn select(budget: &Budget, rule: SelectionRule, r: &[f32], e: &[f32]) -> Vec<usize> {
    let n_blocks = r.len();
    if n_blocks <= budget.attended {
        return (0..n_blocks).collect();
    }
    let q = n_blocks - 1;
    let forced = |m: usize| budget.is_forced(m, q);
    let r: Vec<f32> = (0..n_blocks)
        .map(|m| if forced(m) { f32::INFINITY } else { r[m] })
        .collect();
    let mut chosen = match rule {
        SelectionRule::InfLlmV2 => top_k(&r, budget.attended),
        SelectionRule::Nosa => {
            assert_eq!(e.len(), n_blocks, "eviction scores must cover blocks 0..=q");
            let mut e: Vec<f32> = (0..n_blocks)
                .map(|m| if forced(m) { f32::INFINITY } else { e[m] })
                .collect();
            for m in top_k(&r, budget.shortlist) {
                e[m] = f32::INFINITY;
            }
            top_k(&e, budget.attended)
        }
    };
    chosen.sort_unstable();
    chosen
}

/// Query-aware window scores of one KV head for one query position (spec
/// §4.1): s\[i\] = Σ over the G query heads g of softmax_i(q_g · Kc\[i\] / √D).
///
/// - `q`: the G query vectors of this KV head, [G, D] row-major;
/// - `kc`: compressed keys of this head, `mc` rows at stride `kc_stride`
///   floats (row i starts at i·kc_stride), D values each;
/// - returns `mc` scores (empty when mc = 0).
pub fn query_window_scores(
    q: &[f32],
    head_dim: usize,
    kc: &[f32],
    kc_stride: usize,
    mc: usize,
) -> Vec<f32> {
    let mut s = vec![0.0f32; mc];
    if mc == 0 {
        return s;
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut logits = vec![0.0f32; mc];
    for qg in q.chunks_exact(head_dim) {
        let mut mx = f32::NEG_INFINITY;
        for (i, l) in logits.iter_mut().enumerate() {
            *l = crate::cpu::ops::dot(qg, &kc[i * kc_stride..i * kc_stride + head_dim]) * scale;
            mx = mx.max(*l);
        }
        let mut sum = 0.0f32;
        for l in logits.iter_mut() {
            *l = (*l - mx).exp();
            sum += *l;
        }
        for (si, l) in s.iter_mut().zip(&logits) {
            *si += l / sum;
        }
    }
    s
}
