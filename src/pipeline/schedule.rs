//! The per-layer schedule of one decode step (runtime.md §1–§2), for every
//! mode in one place: GPU-resident or offloaded KV, sync or forecast
//! selection, prefetch on or off, any mix of dense and sparse rows.
//!
//! Sync (NOSA's path), per layer l on the compute stream:
//! `qkv` (norm, QKV GEMM, RoPE + append, compression) → `select` (layer l's
//! blocks from its real query) → `diff` + `fetch` (offloaded layers: misses
//! into their slots, in the layer) → `attention` → `o_proj` → `ffn`.
//!
//! Forecast (SparDA's path), per layer l: `qkv` (the same GEMM also yields
//! the forecast of layer l+1, and for l = 0 layer 0's own) → `select`
//! (layer 0: its own blocks; every layer: PREP(l+1), layer l+1's blocks
//! from the forecast over its state as of the previous step) → `diff` of
//! layer l+1 → with prefetch, the copy stream waits for "ready(l+1)",
//! fetches layer l+1's misses and records "fetched(l+1)" while this layer
//! computes; the compute stream waits for "fetched(l)" before layer l's
//! attention (without prefetch the fetch of layer l runs in the layer) →
//! `attention` → `o_proj` → `ffn`.
//!
//! Dense rows (T < dense_len) of a step over block lists (some row sparse,
//! or offloaded KV) get every existing block after the selection (and no
//! eviction bias); the host
//! selection path replaces the GPU's (it needs the host in the middle of
//! the layer, so such steps are never captured). The quoted names are the
//! trace spans of the compute stream.

use super::*;

impl GpuModel {
    /// Enqueues a whole decode step on the stream (no host work besides
    /// launches, so it can be captured): embedding of the ids in `st.io`,
    /// every layer, final norm, lm_head, argmax, and the advance of the step
    /// inputs for the next step. `seqs` are the step's sequences (the host
    /// selection path appends to their host mirrors; nothing else reads
    /// them here).
    ///
    /// Steps of few enough rows run on the fused small-batch GEMVs
    /// ([`GpuModel::gemv_fusion_applies`]).
    pub(crate) fn enqueue_step(&self, st: &mut DecodeStep, seqs: &mut [GpuSequence]) -> Result<()> {
        self.fused_gemv.set(self.gemv_fusion_applies(st.n));
        let r = self.enqueue_step_launches(st, seqs);
        self.fused_gemv.set(false);
        r
    }

    fn enqueue_step_launches(&self, st: &mut DecodeStep, seqs: &mut [GpuSequence]) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (d, vocab, nl) = (c.hidden_size, c.vocab_size, c.num_hidden_layers);
        let n = st.n;
        let w = self.qkv_cols;
        let io = dptr(gpu, &st.io);
        let inp = RowInputs {
            pos: io + (4 * n) as u64,
            lens: io + (8 * n) as u64,
            seq_lens: io + (12 * n) as u64,
        };
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * n;
        let hk = c.num_key_value_heads;
        if self.on(StepPart::Embed) {
            ops::embed_gather(
                gpu,
                &self.embed,
                vocab,
                d,
                &st.io.slice(0..n),
                c.embed_scale(),
                &mut st.ws.delta.slice_mut(0..n * d),
            )?;
            gpu.stream()
                .memset_zeros(&mut st.ws.resid.slice_mut(0..n * d))
                .cuda("zeroing the residual stream")?;
        }
        let ptrs = dptr(gpu, &st.ws.ptrs);
        self.offload_wait_write_back(st)?;
        let any_sparse = st.key.dense_rows.iter().any(|&d| !d);
        // Dense rows of a step over block lists list every block they have.
        let fill_dense = st.attn.sparse && st.key.dense_rows.iter().any(|&d| d);
        let forecast = self.forecast_cols.filter(|_| any_sparse);
        // The host selection path's rows (positions before the step).
        let host_rows: Vec<Row> = if st.key.host_selection {
            (0..n)
                .map(|b| Row {
                    seq: b,
                    token: 0,
                    pos: seqs[b].len,
                    sparse: !st.key.dense_rows[b],
                })
                .collect()
        } else {
            Vec::new()
        };
        let prefetch = forecast.is_some() && self.prefetch && st.off.is_some();
        let s_max = st.attn.s_max;
        let lists = |l: usize| (l * n * hk * s_max, l * n * hk);
        // The open compute-stream span: consecutive phases share their
        // boundary event (`tspan_next`), across layers too.
        let mut open = SpanId::NONE;
        for l in 0..nl {
            let tab = Tables::new(ptrs + (l * per_layer * 8) as u64, n, n);
            let qkv_off = l * n * w;
            let comp = self.gpu_selection().then_some((1usize, 1usize));
            let ring = st.off.as_ref().map_or(0, |o| o.ring_of(l));
            let cs = gpu.stream().clone();
            let sp = self.tspan_next(&cs, open, "qkv", l)?;
            let sp = self.layer_front(l, &mut st.ws, n, n, qkv_off, &inp, &tab, comp, ring, sp)?;
            self.rope_forecast(&st.ws, n, qkv_off, inp.pos)?;
            let (sel_off, nsel_off) = lists(l);
            let (slots, sp) = match forecast {
                None => {
                    // sync: layer l's own selection from its real query
                    let sp = if st.attn.sparse || st.key.host_selection {
                        let sp = self.tspan_next(&cs, sp, "select", l)?;
                        if st.key.host_selection {
                            // lists (dense rows: every block) whenever attention reads them
                            let lists = st.attn.sparse;
                            self.host_select_lists(
                                &mut st.ws, seqs, &host_rows, l, qkv_off, sel_off, nsel_off, s_max,
                                lists,
                            )?;
                        } else if any_sparse {
                            // (this step's own "select" span is open: none in, none back)
                            let _ = self.gpu_select(
                                l,
                                &st.ws,
                                n,
                                qkv_off,
                                sel_off,
                                nsel_off,
                                &inp,
                                &tab,
                                &st.sel,
                                None,
                                SpanId::NONE,
                            )?;
                        }
                        if fill_dense && !st.key.host_selection {
                            self.fill_dense_rows(&st.ws, n, inp.lens, s_max, sel_off, nsel_off)?;
                        }
                        sp
                    } else {
                        sp
                    };
                    self.tspan_end(&cs, sp)?;
                    (
                        self.offload_layer(st, l, sel_off, nsel_off, inp.lens)?,
                        SpanId::NONE,
                    )
                }
                Some((fut, cur)) => {
                    let mut sp = self.tspan_next(&cs, sp, "select", l)?;
                    if l == 0 {
                        // layer 0 scores its own current-step windows with q_curr_proj
                        self.forecast_select(
                            0,
                            &st.ws,
                            n,
                            qkv_off + cur,
                            &tab,
                            sel_off,
                            nsel_off,
                            inp.lens,
                            0,
                            &st.sel,
                        )?;
                        if fill_dense {
                            self.fill_dense_rows(&st.ws, n, inp.lens, s_max, sel_off, nsel_off)?;
                        }
                        if st.off.as_ref().is_some_and(|o| o.offloaded(0)) {
                            // layer 0's own diff and synchronous fetch, in their own spans
                            sp = self.tspan_next(&cs, sp, "diff", 0)?;
                            self.offload_diff(st, 0, sel_off, nsel_off, inp.lens)?;
                            self.tspan_end(&cs, sp)?;
                            self.offload_fetch(st, 0, &cs)?;
                            sp = self.tspan(&cs, crate::trace::Track::Compute, "select", 0)?;
                        }
                    }
                    if l + 1 < nl {
                        // PREP(l+1): layer l+1's selection from this layer's forecast,
                        // over its state as of the previous step
                        let next = Tables::new(ptrs + ((l + 1) * per_layer * 8) as u64, n, n);
                        let (ns_off, nn_off) = lists(l + 1);
                        self.forecast_select(
                            l + 1,
                            &st.ws,
                            n,
                            qkv_off + fut,
                            &next,
                            ns_off,
                            nn_off,
                            inp.lens,
                            inp.pos,
                            &st.sel,
                        )?;
                        if fill_dense {
                            self.fill_dense_rows(&st.ws, n, inp.lens, s_max, ns_off, nn_off)?;
                        }
                        sp = self.tspan_next(&cs, sp, "diff", l + 1)?;
                        let offloaded = self.offload_diff(st, l + 1, ns_off, nn_off, inp.lens)?;
                        if offloaded && prefetch {
                            // The SM kernel's prefetch puts only events on the compute
                            // stream, so the diff span stays open into the wait; the
                            // copy engines' (alone or in a split) reads the fetch lists
                            // back on it first.
                            if matches!(
                                self.fetch_engine(n),
                                FetchEngine::Dma | FetchEngine::Split { .. }
                            ) {
                                self.tspan_end(&cs, sp)?;
                                sp = SpanId::NONE;
                            }
                            self.offload_prefetch(st, l + 1)?;
                        }
                    }
                    if l >= 1 {
                        if prefetch {
                            sp = self.tspan_next(&cs, sp, "wait", l)?;
                            self.offload_wait_fetched(st, l)?;
                        } else if st.off.as_ref().is_some_and(|o| o.offloaded(l)) {
                            self.tspan_end(&cs, sp)?;
                            sp = SpanId::NONE;
                            self.offload_fetch(st, l, &cs)?;
                        }
                    }
                    (self.offload_attn_slots(st, l), sp)
                }
            };
            open = self.layer_back(
                l, &mut st.ws, n, qkv_off, sel_off, nsel_off, &inp, &tab, &st.attn, slots, sp,
            )?;
        }
        self.tspan_end(&gpu.stream().clone(), open)?;
        self.offload_write_back(st, inp.lens)?;
        self.head(&mut st.ws, n, 0, n)?;
        if !self.on(StepPart::Argmax) {
            return Ok(());
        }
        let (v_, n_) = (i32_dim(vocab, "vocab")?, i32_dim(n, "rows")?);
        let (lp, op) = (dptr(gpu, &st.ws.logits), dptr(gpu, &st.ws.argmax));
        let f = gpu.function("argmax_advance")?;
        let cfg = LaunchConfig {
            grid_dim: (grid(n, "rows")?, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(f);
        // a NaN / +inf / all -inf logits row is reported to the model's error
        // record, read where the engine hands ids or logits to the host
        let rec = self.device_errors.device_ptr();
        b.arg(&lp).arg(&n_).arg(&v_).arg(&op).arg(&io).arg(&rec);
        // SAFETY: argument list matches kernels/argmax.cu; logits hold n·V values,
        // argmax n, io 4n; rec is the model's error record (fixed address).
        unsafe { b.launch(cfg) }.cuda("argmax_advance").map(drop)
    }
}
