//! SparDA forecast mode on the GPU (spec/nosa-model.md §4
//! "Forecast mode", runtime.md §2).
//!
//! Weights: each layer's fused QKV GEMM gains 2·Hkv·D rows — layer l's
//! `q_future_proj` (the forecast of layer l+1; zero rows for the last
//! layer) and, for layer 0, `q_curr_proj` (zero rows elsewhere) — so the
//! forecasts cost no extra GEMM. They are RoPE'd at the current position
//! (`rope_neox` on those columns).
//!
//! Selection: layer 0 scores its own current-step windows with f₀ (after
//! its compression); layer l (l ≥ 0) then prepares layer l+1 — PREP(l+1):
//! `forecast_scores` (f_{l+1} · Kc_{l+1}[i, h], a plain dot product) over
//! layer l+1's windows as of the previous step (Mc(T−1)), `select_blocks`
//! with layer l+1's p over the same windows, and, offloaded, `slot_diff`.
//! Layer l ≥ 1 runs no selection of its own.
//!
//! Pipeline with prefetch (offloaded KV): after PREP(l+1) the compute
//! stream records ready(l+1); the copy stream waits for it, fetches layer
//! l+1's misses and records fetched(l+1); layer l+1's attention waits for
//! fetched(l+1). One event per layer (never one shared event re-recorded,
//! runtime.md §3 fault 9). The copy of a step cannot overwrite a slot that
//! is still read: slots it fills were freed by the diff, and the diff runs
//! on the compute stream after the previous step's attention of that
//! layer. Attention cannot read a slot before its fetch lands: it waits on
//! that layer's fetched event. Without prefetch (`--prefetch off`) the same
//! selection and diff run at the same point and the fetch runs on the
//! compute stream right before the layer's attention.

use super::*;
use crate::model::forecast::ForecastWeights;

impl GpuModel {
    /// Turns SparDA forecast selection on (`Some`) or off for decode steps
    /// (spec §4): rebuilds every layer's fused QKV weight with the forecast
    /// rows. `prefetch` (offloaded KV only) fetches layer l+1's blocks on a
    /// copy stream while layer l computes; off, the fetch is synchronous in
    /// the layer (the same selection).
    ///
    /// Errors: [`Error::Input`] unless the plan is sparse with GPU selection;
    /// [`Error::Checkpoint`]-style shape errors naming the layer; device
    /// failures.
    pub fn set_forecast(&mut self, fw: Option<&ForecastWeights>, prefetch: bool) -> Result<()> {
        if fw.is_some() && (!self.sparse_plan() || self.selection != SelectionPath::Gpu) {
            return Err(Error::Input(
                "--forecast selects blocks for sparse attention with GPU selection, but this model runs dense: add --attention sparse".into(),
            ));
        }
        let c = &self.config;
        let (d, nl) = (c.hidden_size, c.num_hidden_layers);
        let fd = c.num_key_value_heads * c.head_dim;
        if let Some(fw) = fw {
            if fw.curr0.len() != fd * d || fw.future.len() + 1 < nl {
                return Err(Error::Input(format!(
                    "forecast weights: need q_curr_proj [{fd}, {d}] and q_future_proj for layers 0…{}",
                    nl.saturating_sub(2)
                )));
            }
            if let Some(l) = fw
                .future
                .iter()
                .take(nl - 1)
                .position(|w| w.len() != fd * d)
            {
                return Err(Error::Input(format!(
                    "forecast weights: layer {l} q_future_proj has {} values, expected [{fd}, {d}]",
                    fw.future[l].len()
                )));
            }
        }
        let base = self.qkv_base_cols;
        let new_cols = if fw.is_some() { base + 2 * fd } else { base };
        let gpu = self.gpu.clone();
        let s = gpu.stream().clone();
        for (l, lw) in self.layers.iter_mut().enumerate() {
            let mut w: CudaSlice<Bf16> = s
                .alloc_zeros(new_cols * d)
                .cuda("allocating the fused QKV(+forecast) weight")?;
            s.memcpy_dtod(&lw.wqkv.slice(0..base * d), &mut w.slice_mut(0..base * d))
                .cuda("copying the fused QKV weight")?;
            if let Some(fw) = fw {
                let mut rows = vec![Bf16::default(); 2 * fd * d];
                if l + 1 < nl {
                    for (o, &x) in rows[..fd * d].iter_mut().zip(&fw.future[l]) {
                        *o = Bf16::from_f32(x);
                    }
                }
                if l == 0 {
                    for (o, &x) in rows[fd * d..].iter_mut().zip(&fw.curr0) {
                        *o = Bf16::from_f32(x);
                    }
                }
                s.memcpy_htod(&rows, &mut w.slice_mut(base * d..new_cols * d))
                    .cuda("uploading the forecast rows")?;
            }
            lw.wqkv = w;
            if let Some(b) = &lw.bqkv {
                let mut nb: CudaSlice<f32> = s
                    .alloc_zeros(new_cols)
                    .cuda("allocating the fused QKV bias")?;
                s.memcpy_dtod(&b.slice(0..base), &mut nb.slice_mut(0..base))
                    .cuda("copying the fused QKV bias")?;
                lw.bqkv = Some(nb);
            }
        }
        self.qkv_cols = new_cols;
        self.forecast_cols = fw.map(|_| (base, base + fd));
        self.prefetch = prefetch;
        self.ws = None;
        self.step = None;
        gpu.synchronize()
    }

    /// Whether forecast selection is on.
    pub fn forecast_on(&self) -> bool {
        self.forecast_cols.is_some()
    }

    /// Prefetch on the copy stream (forecast mode with offloaded KV) or
    /// fetch inside the layer; the selection is the same either way.
    pub fn set_prefetch(&mut self, on: bool) {
        if on != self.prefetch {
            self.prefetch = on;
            self.step = None;
        }
    }

    /// Whether forecast mode prefetches on the copy stream.
    pub fn prefetch_on(&self) -> bool {
        self.prefetch
    }

    /// Forecast mode with prefetch through the SM copy kernel (alone or in a
    /// split): while on, each decode step has cuBLAS size its GEMMs for the
    /// device's SMs less the copy kernel's CTAs (one SM each), so that they
    /// do not run a second wave on the SMs the copy kernel holds
    /// (runtime.md §4: SM copies take SMs from the GEMMs they overlap).
    /// Off by default, and never turned on by the fetch table; other steps
    /// keep every SM. Not timing only: cuBLAS picks other kernels for the
    /// smaller SM count, whose sums run in another order, so the logits
    /// differ from GPU-resident decode in their last bits (measured on the
    /// H200: synthetic NOSA-8B, B = 8, 4,096-token prompts, `--fetch sm:8`:
    /// first logits mismatch at step 8, first token mismatch at step 17;
    /// without it the run is bitwise identical). Measured gain with whole
    /// SMs, 32K B 8 prefetch: 8.24 vs 8.36 ms per step.
    /// A change drops the built step (the next decode call passes tokens).
    pub fn set_reserve_fetch_sms(&mut self, on: bool) {
        if on != self.reserve_fetch_sms {
            self.reserve_fetch_sms = on;
            // a captured offloaded step holds the old launches
            self.step = None;
        }
    }

    /// Offloaded KV through the SM copy kernel (alone or in a split): while
    /// on, each of its CTAs also asks for all the shared memory a block may
    /// have, so that it holds its SM alone and compute blocks run only on
    /// the other SMs, instead of sharing SMs with the copy and running slower
    /// there (runtime.md §4; `kv_fetch_sm`'s `whole_sms`). With
    /// [`GpuModel::set_reserve_fetch_sms`] the GEMMs are also sized for those
    /// other SMs. A copy kernel on more than half the SMs shares them as
    /// usual (whole SMs would leave compute too few). Off by default.
    /// Changes timing only (the same copies and kernels, on other SMs).
    /// A change drops the built step (the next decode call passes tokens).
    pub fn set_fetch_whole_sms(&mut self, on: bool) {
        if on != self.fetch_whole_sms {
            self.fetch_whole_sms = on;
            // a captured offloaded step holds the old launches
            self.step = None;
        }
    }

    /// Whether the copy kernel on `ctas` CTAs takes whole SMs in a step of
    /// `n` rows: [`GpuModel::set_fetch_whole_sms`], or the fetch table's
    /// choice for `n` ([`GpuModel::fetch_table_whole_sms`]), while `ctas` is
    /// at most half the SMs.
    pub(crate) fn fetch_whole_sms_for(&self, n: usize, ctas: usize) -> bool {
        (self.fetch_whole_sms || self.fetch_table_whole_sms(n))
            && self.sms_left_by_copy(ctas).is_some()
    }

    /// Whether a step of `batch` rows runs its SM copy kernel (alone or in a
    /// split) on whole SMs: the flag or the fetch table's choice, for the
    /// engine [`GpuModel::fetch_engine`] gives (false without offload or
    /// with the copy engines). For reports.
    pub fn fetch_on_whole_sms(&self, batch: usize) -> bool {
        if self.offload_options().is_none() {
            return false;
        }
        match self.fetch_engine(batch) {
            FetchEngine::Sm { ctas } | FetchEngine::Split { ctas, .. } => {
                self.fetch_whole_sms_for(batch, ctas)
            }
            _ => false,
        }
    }

    /// [`crate::kv::offload::sms_left_by_copy`] on this GPU.
    fn sms_left_by_copy(&self, ctas: usize) -> Option<usize> {
        crate::kv::offload::sms_left_by_copy(ctas, self.gpu.info().sm_count.max(1) as usize)
    }

    /// The SMs the step's GEMMs are sized for at batch `n`: `Some(sm_count −
    /// CTAs)` when [`GpuModel::set_reserve_fetch_sms`] is on and this step
    /// prefetches through the SM copy kernel on at most half the SMs, else
    /// `None` (all of them). The fetch table's whole-SM choice does not turn
    /// it on: GEMMs sized for fewer SMs change the logits' last bits, and
    /// the default configuration decodes bitwise as GPU-resident KV does.
    pub(crate) fn gemm_sm_target(&self, n: usize) -> Option<usize> {
        self.offload_options()?;
        crate::kv::offload::gemm_sm_target_rule(
            self.reserve_fetch_sms,
            self.forecast_on() && self.prefetch_on(),
            self.fetch_engine(n),
            self.gpu.info().sm_count.max(1) as usize,
        )
    }

    /// Injects a delay of `us` µs (a spin kernel) before every fetch on its
    /// stream: the prefetch stress check. 0 = off.
    /// A change drops the built step (the next decode call passes tokens).
    pub fn set_copy_delay_us(&mut self, us: u32) {
        if us != self.copy_delay_us {
            self.copy_delay_us = us;
            // a captured offloaded step holds the old launches
            self.step = None;
        }
    }

    /// RoPE on the 2·Hkv forecast heads of n rows at `qkv_off` (positions
    /// `pos`), after the fused GEMM.
    pub(crate) fn rope_forecast(
        &self,
        ws: &Workspace,
        n: usize,
        qkv_off: usize,
        pos: u64,
    ) -> Result<()> {
        let Some((fut, _)) = self.forecast_cols else {
            return Ok(());
        };
        let gpu = &*self.gpu;
        let c = &self.config;
        let t = self.rope_tables.as_ref().expect("rope tables ensured");
        let (cosp, sinp) = (dptr(gpu, &t.cos), dptr(gpu, &t.sin));
        let xp = dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64;
        let (w_, off_, d_, tr) = (
            i32_dim(self.qkv_cols, "qkv row")?,
            i32_dim(fut, "forecast column")?,
            i32_dim(c.head_dim, "D")?,
            i32_dim(t.rows, "rope rows")?,
        );
        let f = gpu.function("rope_neox")?;
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&xp)
            .arg(&w_)
            .arg(&off_)
            .arg(&d_)
            .arg(&pos)
            .arg(&cosp)
            .arg(&sinp)
            .arg(&tr);
        let cfg = LaunchConfig {
            grid_dim: (
                grid(n, "rows")?,
                grid(2 * c.num_key_value_heads, "heads")?,
                1,
            ),
            block_dim: (
                ((c.head_dim / 2).div_ceil(32) * 32).clamp(32, 128) as u32,
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument list matches kernels/rope.cu; the rows hold qkv_cols
        // columns, the forecast heads at [fut, fut + 2·Hkv·D).
        unsafe { b.launch(cfg) }
            .cuda("rope_neox (forecast)")
            .map(drop)
    }

    /// Forecast selection (spec §4) of layer `l`, whose tables are `target`,
    /// into the lists at `sel_off`/`nsel_off`: `forecast_scores` of the
    /// forecast at element `f_off` of the QKV rows over the target's Kc,
    /// then `select_blocks` with the target's p; windows Mc(`win_lens`)
    /// (0: the rows' lengths, the current step's windows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forecast_select(
        &self,
        l: usize,
        ws: &Workspace,
        n: usize,
        f_off: usize,
        target: &Tables,
        sel_off: usize,
        nsel_off: usize,
        lens: u64,
        win_lens: u64,
        geo: &SelGeometry,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (hk, dh) = (c.num_key_value_heads, c.head_dim);
        let budget = &self.plan.budget;
        let sp = dptr(gpu, &ws.qa_scores);
        if geo.mc > 0 {
            let fp = dptr(gpu, &ws.qkv) + (f_off * 2) as u64;
            let wl = if win_lens != 0 { win_lens } else { lens };
            let (fs, ws_, hk_, d_, st, ks) = (
                i32_dim(self.qkv_cols, "forecast stride")?,
                i32_dim(geo.w_stride, "w_stride")?,
                i32_dim(hk, "Hkv")?,
                i32_dim(dh, "D")?,
                i32_dim(budget.kernel_stride, "kernel_stride")?,
                i32_dim(budget.kernel_size, "kernel_size")?,
            );
            let f = gpu.function("forecast_scores")?;
            let mut b = gpu.stream().launch_builder(f);
            b.arg(&fp)
                .arg(&fs)
                .arg(&target.kc)
                .arg(&wl)
                .arg(&sp)
                .arg(&ws_)
                .arg(&hk_)
                .arg(&d_)
                .arg(&st)
                .arg(&ks);
            let cfg = LaunchConfig {
                grid_dim: (
                    grid(geo.mc.div_ceil(8).min(1024), "windows")?,
                    grid(hk, "Hkv")?,
                    grid(n, "rows")?,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches kernels/forecast.cu; each row's Kc holds
            // ≥ Mc(win_lens) windows, the scores n·Hkv·w_stride ≥ Mc.
            unsafe { b.launch(cfg) }.cuda("forecast_scores")?;
        }
        self.select_from_scores(
            l,
            ws,
            n,
            target,
            sel_off,
            nsel_off,
            lens,
            win_lens,
            geo,
            "select_blocks (forecast)",
        )
    }
}
