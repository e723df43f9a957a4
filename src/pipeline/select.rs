//! Block selection for a layer (spec §4): query-aware scoring and
//! `select_blocks` on the GPU, dense rows' full lists, and the host
//! selection of the check path.

use super::*;
use crate::cuda::ops::prefill_scores::{launch_prefill_scores, prefill_scores};
use crate::cuda::ops::select::{
    launch_window_logits, launch_window_scores, qa_logits_shared_kc, ScoreDims,
};

impl GpuModel {
    /// GPU block selection of every row (spec §4) of layer `l` through the
    /// per-row tables: window logits over up to `geo.mc` windows (grids sized
    /// by it; each row scores the Mc(pos+1) windows it sees) — with
    /// `qa_window_logits`, or, when every row reads the one Kc at
    /// `shared_kc` (a prefill chunk), with cuBLAS ([`qa_logits_shared_kc`],
    /// queries widened into `ws.qa_qf`, then the tile statistics) — then
    /// `qa_window_scores`; or, for a prefill chunk under a tensor-core
    /// `SPARDA_PREFILL_SCORES` ([`GpuModel::prefill_scores_tc`]), all three
    /// in `qa_prefill_scores`; then `select_blocks` over up to `geo.nb_cap`
    /// blocks into the lists at `sel_off` / `nsel_off` (width `geo.s_max`).
    /// `span` (a traced
    /// prefill's open span, else [`SpanId::NONE`]) is ended and followed by
    /// one span per phase; the last one open is returned.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gpu_select(
        &self,
        l: usize,
        ws: &Workspace,
        n: usize,
        qkv_off: usize,
        sel_off: usize,
        nsel_off: usize,
        inp: &RowInputs,
        tab: &Tables,
        geo: &SelGeometry,
        shared_kc: Option<u64>,
        span: SpanId,
    ) -> Result<SpanId> {
        let gpu = &*self.gpu;
        // A traced prefill passes its open span: the phases then follow as
        // "window_logits", "window_scores", "select" (the decode step's
        // caller keeps its own single "select" span and passes NONE).
        let mut span = span;
        let mut phase = |name: &'static str| -> Result<()> {
            if !span.is_none() {
                span = self.tspan_next(gpu.stream(), span, name, l)?;
            }
            Ok(())
        };
        let cfg = &self.config;
        let (hq, hk, dh) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qp = dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64;
        let lp = inp.lens;
        if geo.mc > 0 && self.on(StepPart::WindowScores) {
            let dims = ScoreDims {
                logits: dptr(gpu, &ws.qa_logits),
                stats: dptr(gpu, &ws.qa_stats),
                lens: lp,
                scores: dptr(gpu, &ws.qa_scores),
                rows: n,
                heads: hq,
                kv_heads: hk,
                tiles: geo.mc.div_ceil(crate::cuda::ops::select::QA_TILE),
                w_stride: geo.w_stride,
                budget: self.plan.budget,
            };
            let tc = self.prefill_scores_tc();
            match shared_kc {
                // Rows of one sequence (a prefill chunk) on the tensor cores:
                // logits, softmax and scores in one kernel.
                Some(kc) if tc => {
                    phase("window_scores")?;
                    let kernels = prefill_scores();
                    // (split kernels: Kc's parts in the logits buffer the
                    // tensor-core kernels do not otherwise use; prefill sizes it)
                    let split = kernels
                        .splits_kc(hq / hk)
                        .then(|| (dptr(gpu, &ws.qa_logits), geo.mc));
                    launch_prefill_scores(gpu, &dims, qp, self.qkv_cols, dh, kc, kernels, split)?;
                }
                // Rows of one sequence: cuBLAS reads each Kc tile once.
                Some(kc) => {
                    phase("window_logits")?;
                    qa_logits_shared_kc(
                        gpu,
                        &dims,
                        qp,
                        self.qkv_cols,
                        dh,
                        kc,
                        geo.mc,
                        dptr(gpu, &ws.qa_qf),
                    )?;
                    phase("window_scores")?;
                    launch_window_scores(gpu, &dims)?;
                }
                None => {
                    phase("window_logits")?;
                    launch_window_logits(gpu, &dims, qp, self.qkv_cols, dh, tab.kc)?;
                    phase("window_scores")?;
                    launch_window_scores(gpu, &dims)?;
                }
            }
        }
        if !self.on(StepPart::Select) {
            return Ok(span);
        }
        phase("select")?;
        self.select_from_scores(
            l,
            ws,
            n,
            tab,
            sel_off,
            nsel_off,
            lp,
            0,
            geo,
            "select_blocks",
        )?;
        Ok(span)
    }

    /// `select_blocks` (spec §4 steps 2–6) of n rows from the window scores
    /// in `ws.qa_scores` and the p of layer `l`, whose tables are `tab`, into
    /// the lists at `sel_off` / `nsel_off`; windows Mc(`win_lens`) (0: Mc of
    /// the rows' lengths `lens`). A row past `geo.nb_cap` blocks is reported
    /// to the model's device error record for layer `l`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn select_from_scores(
        &self,
        l: usize,
        ws: &Workspace,
        n: usize,
        tab: &Tables,
        sel_off: usize,
        nsel_off: usize,
        lens: u64,
        win_lens: u64,
        geo: &SelGeometry,
        op: &str,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let nosa = self.plan.mode == AttentionMode::Nosa;
        let args = SelectBlocksArgs {
            scores: dptr(gpu, &ws.qa_scores),
            p: if nosa { tab.p } else { 0 },
            lens,
            sel: dptr(gpu, &ws.sel) + (sel_off * 4) as u64,
            nsel: dptr(gpu, &ws.nsel) + (nsel_off * 4) as u64,
            pooled_r: 0,
            pooled_e: 0,
            w_stride: geo.w_stride,
            s_max: geo.s_max,
            nb_stride: 0,
            blocks: geo.nb_cap,
            kv_heads: self.config.num_key_value_heads,
            rows: n,
            nosa,
            win_lens,
            err: self.device_errors.sink(l),
        };
        // SAFETY: every row has ≤ nb_cap blocks (the kernel clears and reports
        // rows with more) and Mc(win_lens or lens) ≤ w_stride scored windows,
        // its p (NOSA) holds them; the lists hold n·Hkv·s_max / n·Hkv entries.
        unsafe { launch_select_blocks(gpu, &self.plan.budget, &args, op) }
    }

    /// Every sequence carries the selection state of this model's path (a
    /// host mirror on [`SelectionPath::HostFallback`], compressed keys on the
    /// GPU otherwise), so that no kernel reads a missing buffer and no mirror
    /// falls out of step.
    ///
    /// Errors: [`Error::Input`] naming the sequence and the path.
    pub(crate) fn check_selection_state(&self, seqs: &[GpuSequence]) -> Result<()> {
        if !self.sparse_plan() {
            return Ok(());
        }
        let path = self.selection;
        for (i, sq) in seqs.iter().enumerate() {
            let ok = match path {
                SelectionPath::HostFallback => sq.mirror.is_some(),
                SelectionPath::Gpu => sq.layers.iter().all(|l| l.kc.is_some()),
            };
            if !ok {
                return Err(Error::Input(format!(
                    "sequence {i} was not made by this model's selection path {path:?} (create sequences after with_selection_path)"
                )));
            }
        }
        Ok(())
    }

    /// The host selection of the check path ([`SelectionPath::HostFallback`])
    /// for layer `l` of a call over `rows`: appends the layer's new tokens
    /// (the fused QKV rows at element `qkv_off`) to the sequences' host
    /// mirrors with [`host_select`] and, when `select`, uploads each row's
    /// lists into the lists at `sel_off` / `nsel_off` (width `s_max`).
    /// Synchronises (downloads the rows first).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn host_select_lists(
        &self,
        ws: &mut Workspace,
        seqs: &mut [GpuSequence],
        rows: &[Row],
        l: usize,
        qkv_off: usize,
        sel_off: usize,
        nsel_off: usize,
        s_max: usize,
        select: bool,
    ) -> Result<()> {
        let hk = self.config.num_key_value_heads;
        let n = rows.len();
        let lists = host_select(
            &self.gpu,
            &self.plan,
            &self.config,
            ws,
            seqs,
            rows,
            l,
            self.qkv_cols,
            qkv_off,
            select,
        )?;
        let Some(lists) = lists else {
            return Ok(());
        };
        let mut sel = vec![-1i32; n * hk * s_max];
        let mut nsel = vec![0i32; n * hk];
        for (i, per) in lists.iter().enumerate() {
            for (h, list) in per.iter().enumerate() {
                if list.len() > s_max {
                    return Err(Error::Limit(format!(
                        "host selection: row {i}, layer {l}, KV head {h} lists {} blocks, more than the {s_max} the step has room for",
                        list.len()
                    )));
                }
                for (j, &m) in list.iter().enumerate() {
                    sel[(i * hk + h) * s_max + j] = m as i32;
                }
                nsel[i * hk + h] = list.len() as i32;
            }
        }
        let s = self.gpu.stream();
        s.memcpy_htod(&sel, &mut ws.sel.slice_mut(sel_off..sel_off + sel.len()))
            .cuda("uploading block lists")?;
        s.memcpy_htod(
            &nsel,
            &mut ws.nsel.slice_mut(nsel_off..nsel_off + nsel.len()),
        )
        .cuda("uploading block counts")
    }

    /// Dense rows (T < dense_len) of a call or step over block lists get
    /// every existing block (`sel_fill_dense`) in the lists at `sel_off` /
    /// `nsel_off`; `s_max` ≥ their block counts. Part of
    /// [`StepPart::Select`] in [`GpuModel::profile_step`].
    pub(crate) fn fill_dense_rows(
        &self,
        ws: &Workspace,
        n: usize,
        lens: u64,
        s_max: usize,
        sel_off: usize,
        nsel_off: usize,
    ) -> Result<()> {
        if !self.on(StepPart::Select) {
            return Ok(());
        }
        let gpu = &*self.gpu;
        let hk = self.config.num_key_value_heads;
        let (hk_, sm, bs) = (
            i32_dim(hk, "Hkv")?,
            i32_dim(s_max, "s_max")?,
            i32_dim(self.plan.budget.block_size, "block size")?,
        );
        let (selp, nselp, dp) = (
            dptr(gpu, &ws.sel) + (sel_off * 4) as u64,
            dptr(gpu, &ws.nsel) + (nsel_off * 4) as u64,
            dptr(gpu, &ws.dense),
        );
        let f = gpu.function("sel_fill_dense")?;
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&selp)
            .arg(&nselp)
            .arg(&dp)
            .arg(&lens)
            .arg(&hk_)
            .arg(&sm)
            .arg(&bs);
        let cfg = LaunchConfig {
            grid_dim: (grid(n, "rows")?, grid(hk, "Hkv")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument list matches kernels/sel_fill.cu; s_max ≥ every dense
        // row's block count (sized by the caller).
        unsafe { b.launch(cfg) }.cuda("sel_fill_dense").map(drop)
    }
}

/// Host selection of the check path ([`SelectionPath::HostFallback`]) for layer
/// `l`: downloads the fused QKV rows (at element `qkv_off` of `ws.qkv`) (post-RoPE q and k, v) and the new
/// eviction scores, appends them to each sequence's host mirror (which
/// completes Kc and p as [`LayerKv::append`] does), then selects per row
/// and KV head with [`crate::model::select`] (spec §4; for a prompt row at
/// position t only the windows visible to it, Mc(t+1)). Dense rows of a
/// sparse call get every existing block (their attention has no bias).
/// Returns `[row][kv_head]` ascending block ids when `select`, else only
/// appends (a dense call: the mirror must still see every token).
#[allow(clippy::too_many_arguments)]
pub(crate) fn host_select(
    gpu: &Gpu,
    plan: &AttentionPlan,
    cfg: &ModelConfig,
    ws: &Workspace,
    seqs: &mut [GpuSequence],
    rows: &[Row],
    l: usize,
    w: usize,
    qkv_off: usize,
    select: bool,
) -> Result<Option<Vec<Vec<Vec<usize>>>>> {
    let (hq, hk, dh) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let kvd = hk * dh;
    let n = rows.len();
    let qkv: Vec<f32> = gpu
        .download(&ws.qkv.slice(qkv_off..qkv_off + n * w))?
        .into_iter()
        .map(Bf16::to_f32)
        .collect();
    let budget: &Budget = &plan.budget;
    // Append this call's tokens to the mirrors, sequence by sequence.
    for (si, seq) in seqs.iter_mut().enumerate() {
        let mine: Vec<usize> = (0..n).filter(|&i| rows[i].seq == si).collect();
        if mine.is_empty() {
            continue;
        }
        let p0 = rows[mine[0]].pos;
        let cnt = mine.len();
        let c: Vec<f32> = match &seq.layers[l].c {
            Some(cbuf) => gpu.download(&cbuf.slice(p0 * hk..(p0 + cnt) * hk))?,
            None => vec![0.0; cnt * hk],
        };
        let (mut k, mut v) = (Vec::with_capacity(cnt * kvd), Vec::with_capacity(cnt * kvd));
        for &i in &mine {
            let row = &qkv[i * w..(i + 1) * w];
            k.extend_from_slice(&row[hq * dh..hq * dh + kvd]);
            v.extend_from_slice(&row[hq * dh + kvd..hq * dh + 2 * kvd]);
        }
        let mirror = seq.mirror.as_mut().ok_or_else(|| {
            Error::Input("sequence has no host mirror for fallback selection".into())
        })?;
        mirror[l].append(budget, &k, &v, &c);
    }
    if !select {
        return Ok(None);
    }
    let rule = plan.rule();
    let g = hq / hk;
    let mut out = Vec::with_capacity(n);
    for (i, r) in rows.iter().enumerate() {
        let t = r.pos;
        let nb = budget.blocks(t);
        let rule = match rule {
            Some(rule) if r.sparse => rule,
            _ => {
                out.push(vec![(0..nb).collect::<Vec<usize>>(); hk]);
                continue;
            }
        };
        let kv = &seqs[r.seq].mirror.as_ref().expect("mirror checked above")[l];
        let q = &qkv[i * w..i * w + hq * dh];
        let mc = budget.windows(t + 1);
        let mut per = Vec::with_capacity(hk);
        for h in 0..hk {
            let qh = &q[h * g * dh..(h + 1) * g * dh];
            let kch = if mc > 0 { &kv.kc[h * dh..] } else { &[][..] };
            let s = crate::model::select::query_window_scores(qh, dh, kch, kvd, mc);
            let rr = crate::model::select::pool_blocks(budget, &s, nb);
            let p: Vec<f32> = (0..mc).map(|x| kv.p[x * hk + h]).collect();
            let e = crate::model::select::pool_blocks(budget, &p, nb);
            per.push(crate::model::select::select(budget, rule, &rr, &e));
        }
        out.push(per);
    }
    Ok(Some(out))
}
