//! One decoder layer's launches: the front half (norm, fused QKV GEMM,
//! RoPE + KV append + eviction score, compression) and the back half
//! (attention, O projection, FFN), and the final norm + lm_head.

use super::cta_log::CtaKernel;
use super::*;

impl GpuModel {
    /// Adds an f32 bias to the first `cols` columns of `n` bf16 rows at stride `ld`.
    pub(crate) fn bias_add(
        gpu: &Gpu,
        y: u64,
        ld: usize,
        b: &CudaSlice<f32>,
        n: usize,
        cols: usize,
    ) -> Result<()> {
        let (ld_, n_, c_) = (i32_dim(ld, "ld")?, i32_dim(n, "n")?, i32_dim(cols, "cols")?);
        let bp = dptr(gpu, b);
        let f = gpu.function("bias_add")?;
        let blocks = (n * cols).div_ceil(256).clamp(1, 65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut bl = gpu.launch_builder(f);
        bl.arg(&y).arg(&ld_).arg(&bp).arg(&n_).arg(&c_);
        // SAFETY: argument list matches kernels/bias.cu; y holds n rows of ld ≥ cols.
        unsafe { bl.launch(cfg) }.cuda("bias_add").map(drop)
    }

    /// First half of layer `l` over n rows: residual add + input RMSNorm,
    /// the fused QKV GEMM (+bias) into `ws.qkv` at element `qkv_off`,
    /// RoPE and the KV append (+ eviction score from v), and — `comp` = (new
    /// tokens, grid width) — the compression of the windows this call
    /// completes (GPU selection).
    ///
    /// Traced: `open` (the caller's "qkv" span) ends after the QKV GEMM,
    /// "rope_append" covers RoPE, the KV append and the eviction score, and
    /// "compress" the compression when it runs; the open span is returned.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_front(
        &self,
        l: usize,
        ws: &mut Workspace,
        n: usize,
        ns: usize,
        qkv_off: usize,
        inp: &RowInputs,
        tab: &Tables,
        comp: Option<(usize, usize)>,
        ring: usize,
        open: SpanId,
    ) -> Result<SpanId> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, hq, hk, dh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let lw = &self.layers[l];
        let w = self.qkv_cols;
        // Fused: past layer 0 the previous down projection has added its
        // output to the residual stream, and the QKV GEMV normalises it.
        let fused = self.fused_gemv.get() && l > 0;
        if !fused && self.on(StepPart::NormIn) {
            ops::add_rmsnorm(
                gpu,
                &mut ws.resid.slice_mut(0..n * d),
                &ws.delta.slice(0..n * d),
                if l == 0 { 1.0 } else { cfg.residual_scale() },
                &lw.input_norm,
                cfg.rms_norm_eps,
                &mut ws.xn.slice_mut(0..n * d),
            )?;
        }
        let qp = dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64;
        if fused && self.on(StepPart::Qkv) {
            let args = ops::GemvArgs {
                x: ops::GemvInput::RmsNorm {
                    resid: dptr(gpu, &ws.resid),
                    weight: dptr(gpu, &lw.input_norm),
                    eps: cfg.rms_norm_eps,
                },
                w: dptr(gpu, &lw.wqkv),
                y: ops::GemvOutput::Bf16(qp),
                n,
                in_features: d,
                out_features: w,
            };
            // SAFETY: resid holds n·d f32, the norm d and W w·d bf16, and the
            // QKV rows at qp n·w bf16 (the workspace's step sizes); no bias
            // (gemv_fusion_applies).
            unsafe { ops::launch_gemv(gpu, &args) }?;
        } else if self.on(StepPart::Qkv) {
            gpu.linear(
                &ws.xn.slice(0..n * d),
                n,
                d,
                &lw.wqkv,
                w,
                &mut ws.qkv.slice_mut(qkv_off..qkv_off + n * w),
            )?;
            if let Some(b) = &lw.bqkv {
                Self::bias_add(gpu, qp, w, b, n, w)?;
            }
        }
        // RoPE + append (+ eviction score).
        let mut open = self.tspan_next(gpu.stream(), open, "rope_append", l)?;
        let t = self.rope_tables.as_ref().expect("rope tables ensured");
        let eh = lw.evict_head.as_ref();
        let args = ops::QkvAppendArgs {
            qkv: qp,
            row_stride: w,
            heads: hq,
            kv_heads: hk,
            head_dim: dh,
            pos: inp.pos,
            cos: dptr(gpu, &t.cos),
            sin: dptr(gpu, &t.sin),
            table_rows: t.rows,
            kptr: tab.k,
            vptr: tab.v,
            cptr: if self.eviction { tab.c_state } else { 0 },
            evict_a: eh.map_or(0, |e| dptr(gpu, &e.a)),
            evict_delta: eh.map_or(0, |e| dptr(gpu, &e.delta)),
            evict_b: eh.and_then(|e| e.bias.as_ref()).map_or(0, |b| dptr(gpu, b)),
            ring,
            rows: n,
            err: self.device_errors.sink(l),
        };
        if self.on(StepPart::RopeAppend) {
            // SAFETY: every row's position is below its sequence's capacity
            // (ensure_capacity; ring slots below the ring) and the kernel skips
            // (and reports) positions past the RoPE table; pointer tables hold
            // n rows; the eviction head is [Hkv] / [Hkv, Hkv·D] f32.
            unsafe { ops::launch_qkv_rope_append(gpu, &args) }?;
        }
        if let Some((n_new, gx)) = comp {
            if gx > 0 && self.on(StepPart::Compress) {
                open = self.tspan_next(gpu.stream(), open, "compress", l)?;
                compress(
                    gpu,
                    &self.plan.budget,
                    tab,
                    inp.seq_lens,
                    ns,
                    n_new,
                    gx,
                    hk,
                    dh,
                    self.eviction,
                    ring,
                )?;
            }
        }
        Ok(open)
    }

    /// Second half of layer `l`: attention (dense, or sparse over the lists
    /// at `sel_off` / `nsel_off`) and its combine into `ws.attn`, O
    /// projection (+bias), residual add + post-attention RMSNorm, gate|up
    /// GEMM (+bias), SwiGLU, down projection (+bias) into `ws.delta`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_back(
        &self,
        l: usize,
        ws: &mut Workspace,
        n: usize,
        qkv_off: usize,
        sel_off: usize,
        nsel_off: usize,
        inp: &RowInputs,
        tab: &Tables,
        geo: &AttnGeometry,
        slots: Option<(u64, u64, usize, usize)>,
        open: SpanId,
    ) -> Result<SpanId> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, hq, hk, dh, inter) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        );
        let budget = &self.plan.budget;
        let (part_o, part_ml) = (dptr(gpu, &ws.part_o), dptr(gpu, &ws.part_ml));
        let args = AttnArgs {
            q: dptr(gpu, &ws.qkv) + (qkv_off * 2) as u64,
            q_stride: self.qkv_cols,
            kptr: tab.k,
            vptr: tab.v,
            cptr: if geo.sparse { tab.c_attn } else { 0 },
            lens: inp.lens,
            sel: if geo.sparse {
                dptr(gpu, &ws.sel) + (sel_off * 4) as u64
            } else {
                0
            },
            nsel: if geo.sparse {
                dptr(gpu, &ws.nsel) + (nsel_off * 4) as u64
            } else {
                0
            },
            s_max: geo.s_max,
            block_size: budget.block_size,
            span: geo.span,
            nsplit: geo.nsplit,
            part_o,
            part_ml,
            rows: n,
            heads: hq,
            kv_heads: hk,
            head_dim: dh,
            scale: cfg.attn_scale(),
            out: dptr(gpu, &ws.attn),
            out_stride: hq * dh,
            slot_list: slots.map_or(0, |s| s.0),
            pool_ptr: slots.map_or(0, |s| s.1),
            pool_slots: slots.map_or(0, |s| s.2),
            ring: slots.map_or(0, |s| s.3),
            cta_log: self.cta_log_ptr(
                CtaKernel::Attention,
                l,
                geo.nsplit * ops::attn_head_blocks(hq, hk) * n,
            ),
        };
        let cs = gpu.stream();
        let sp = self.tspan_next(cs, open, "attention", l)?;
        if let Some((tiles, ntiles)) = geo.prefill_tiles {
            // Prefill rows on the tensor cores: the output directly.
            if self.on(StepPart::Attention) {
                let base = ops::PrefillAttnArgs {
                    q: args.q,
                    q_stride: args.q_stride,
                    kptr: args.kptr,
                    vptr: args.vptr,
                    lens: args.lens,
                    tiles,
                    ntiles,
                    out: args.out,
                    out_stride: args.out_stride,
                    heads: hq,
                    kv_heads: hk,
                    head_dim: dh,
                    scale: args.scale,
                };
                if geo.sparse {
                    ops::launch_attn_prefill_sparse(
                        gpu,
                        &ops::PrefillSparseArgs {
                            base,
                            cptr: args.cptr,
                            sel: args.sel,
                            nsel: args.nsel,
                            s_max: geo.s_max,
                            block_size: budget.block_size,
                            ublk: dptr(gpu, &ws.union_blk),
                            umask: dptr(gpu, &ws.union_mask),
                            un: dptr(gpu, &ws.union_n),
                            u_max: geo.union_cap,
                        },
                    )?;
                    if union_stats::enabled() && l.is_multiple_of(union_stats::SAMPLE_EVERY) {
                        let pairs = ntiles * hk;
                        let un = gpu.download(&ws.union_n.slice(0..pairs))?;
                        let umask = gpu.download(&ws.union_mask.slice(0..pairs * geo.union_cap))?;
                        union_stats::add_layer(&un, &umask, hk, geo.union_cap, hq / hk);
                    }
                } else {
                    ops::launch_attn_prefill(gpu, &base)?;
                }
            }
        } else if self.on(StepPart::Attention) {
            ops::launch_attn_partial(gpu, &args)?;
        }
        if geo.prefill_tiles.is_none() && self.on(StepPart::Combine) {
            ops::launch_attn_combine(
                gpu,
                part_o,
                part_ml,
                dptr(gpu, &ws.attn),
                hq * dh,
                n,
                hq,
                dh,
                geo.nsplit,
            )?;
        }
        let sp = self.tspan_next(cs, sp, "o_proj", l)?;
        let lw = &self.layers[l];
        if self.fused_gemv.get() {
            return self.layer_back_fused(l, ws, n, sp);
        }
        if self.on(StepPart::OProj) {
            gpu.linear(
                &ws.attn.slice(0..n * hq * dh),
                n,
                hq * dh,
                &lw.wo,
                d,
                &mut ws.delta.slice_mut(0..n * d),
            )?;
            if let Some(b) = &lw.bo {
                Self::bias_add(gpu, dptr(gpu, &ws.delta), d, b, n, d)?;
            }
        }
        let sp = self.tspan_next(cs, sp, "ffn", l)?;
        if self.on(StepPart::NormPost) {
            ops::add_rmsnorm(
                gpu,
                &mut ws.resid.slice_mut(0..n * d),
                &ws.delta.slice(0..n * d),
                cfg.residual_scale(),
                &lw.post_norm,
                cfg.rms_norm_eps,
                &mut ws.xn.slice_mut(0..n * d),
            )?;
        }
        if self.on(StepPart::GateUp) {
            gpu.linear(
                &ws.xn.slice(0..n * d),
                n,
                d,
                &lw.wgu,
                2 * inter,
                &mut ws.gu.slice_mut(0..n * 2 * inter),
            )?;
            if let Some(b) = &lw.bgu {
                Self::bias_add(gpu, dptr(gpu, &ws.gu), 2 * inter, b, n, 2 * inter)?;
            }
        }
        if self.on(StepPart::Swiglu) {
            ops::swiglu(
                gpu,
                &ws.gu.slice(0..n * 2 * inter),
                n,
                inter,
                &mut ws.act.slice_mut(0..n * inter),
            )?;
        }
        if self.on(StepPart::Down) {
            gpu.linear(
                &ws.act.slice(0..n * inter),
                n,
                inter,
                &lw.wdown,
                d,
                &mut ws.delta.slice_mut(0..n * d),
            )?;
            if let Some(b) = &lw.bdown {
                Self::bias_add(gpu, dptr(gpu, &ws.delta), d, b, n, d)?;
            }
        }
        Ok(sp)
    }

    /// The O projection and FFN of layer `l` on the fused small-batch
    /// GEMVs ([`GpuModel::gemv_fusion_applies`]): O adds into the residual
    /// stream, gate|up normalises it and applies SwiGLU to its outputs, down
    /// adds. The `ffn` span follows `open` (the `o_proj` span).
    fn layer_back_fused(
        &self,
        l: usize,
        ws: &mut Workspace,
        n: usize,
        open: SpanId,
    ) -> Result<SpanId> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, hdim, inter) = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.intermediate_size,
        );
        let lw = &self.layers[l];
        let resid = dptr(gpu, &ws.resid);
        let act = dptr(gpu, &ws.act);
        let launch = |part: StepPart, args: ops::GemvArgs| -> Result<()> {
            if !self.on(part) {
                return Ok(());
            }
            // SAFETY: the workspace holds the step's n rows of every buffer
            // named (resid n·d f32, attn n·H·D, act n·I bf16); the weights
            // are the layer's own, of the shapes given; outputs do not
            // overlap inputs.
            unsafe { ops::launch_gemv(gpu, &args) }
        };
        let scale = cfg.residual_scale();
        launch(
            StepPart::OProj,
            ops::GemvArgs {
                x: ops::GemvInput::Bf16(dptr(gpu, &ws.attn)),
                w: dptr(gpu, &lw.wo),
                y: ops::GemvOutput::Residual { resid, scale },
                n,
                in_features: hdim,
                out_features: d,
            },
        )?;
        let sp = self.tspan_next(gpu.stream(), open, "ffn", l)?;
        launch(
            StepPart::GateUp,
            ops::GemvArgs {
                x: ops::GemvInput::RmsNorm {
                    resid,
                    weight: dptr(gpu, &lw.post_norm),
                    eps: cfg.rms_norm_eps,
                },
                w: dptr(gpu, &lw.wgu),
                y: ops::GemvOutput::Swiglu(act),
                n,
                in_features: d,
                out_features: 2 * inter,
            },
        )?;
        if ops::down_on_cublas() {
            if self.on(StepPart::Down) {
                // SAFETY: act holds n·I bf16 and resid n·d f32 rows of the
                // workspace, W the layer's [d, I] down weight.
                unsafe {
                    gpu.linear_into_residual(act, n, inter, dptr(gpu, &lw.wdown), d, resid, scale)?
                };
            }
            return Ok(sp);
        }
        launch(
            StepPart::Down,
            ops::GemvArgs {
                x: ops::GemvInput::Bf16(act),
                w: dptr(gpu, &lw.wdown),
                y: ops::GemvOutput::Residual { resid, scale },
                n,
                in_features: inter,
                out_features: d,
            },
        )?;
        Ok(sp)
    }

    /// Final residual add + norm (÷ logit divisor folded into its weight)
    /// over n rows, then the lm_head GEMM (f32) of rows first … first+m−1
    /// into `ws.logits` rows 0 … m−1.
    pub(crate) fn head(&self, ws: &mut Workspace, n: usize, first: usize, m: usize) -> Result<()> {
        let gpu = &*self.gpu;
        let cfg = &self.config;
        let (d, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if self.fused_gemv.get() {
            // the last down projection has added into the residual stream;
            // the lm_head GEMV normalises it
            if m == 0 || !self.on(StepPart::LmHead) {
                return Ok(());
            }
            let args = ops::GemvArgs {
                x: ops::GemvInput::RmsNorm {
                    resid: dptr(gpu, &ws.resid) + (first * d * 4) as u64,
                    weight: dptr(gpu, &self.final_norm),
                    eps: cfg.rms_norm_eps,
                },
                w: dptr(gpu, head),
                y: ops::GemvOutput::F32(dptr(gpu, &ws.logits)),
                n: m,
                in_features: d,
                out_features: vocab,
            };
            // SAFETY: rows first … first+m−1 of the n·d f32 residual stream,
            // the [vocab, d] head and the logits' m·vocab f32 rows.
            return unsafe { ops::launch_gemv(gpu, &args) };
        }
        if self.on(StepPart::FinalNorm) {
            ops::add_rmsnorm(
                gpu,
                &mut ws.resid.slice_mut(0..n * d),
                &ws.delta.slice(0..n * d),
                cfg.residual_scale(),
                &self.final_norm,
                cfg.rms_norm_eps,
                &mut ws.xn.slice_mut(0..n * d),
            )?;
        }
        if m == 0 || !self.on(StepPart::LmHead) {
            return Ok(());
        }
        gpu.linear(
            &ws.xn.slice(first * d..(first + m) * d),
            m,
            d,
            head,
            vocab,
            &mut ws.logits.slice_mut(0..m * vocab),
        )
    }
}

/// Completes each sequence's compressed windows (spec §3) made whole by the
/// last `n_new` tokens: `compress_windows` (kernels/compress.cu) over the
/// per-sequence tables, lengths i32 [ns] at `lens`, `grid_x` blocks per
/// sequence (they loop over further windows). p is written only with
/// eviction heads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn compress(
    gpu: &Gpu,
    budget: &Budget,
    tab: &Tables,
    lens: u64,
    ns: usize,
    n_new: usize,
    grid_x: usize,
    hk: usize,
    dh: usize,
    eviction: bool,
    ring: usize,
) -> Result<()> {
    let ring_ = i32_dim(ring, "ring tokens")?;
    let (nn, hk_, d_, st, ks) = (
        i32_dim(n_new, "new tokens")?,
        i32_dim(hk, "Hkv")?,
        i32_dim(dh, "D")?,
        i32_dim(budget.kernel_stride, "kernel_stride")?,
        i32_dim(budget.kernel_size, "kernel_size")?,
    );
    let inv = 1.0 / budget.kernel_size as f32;
    let (cp, pp) = if eviction {
        (tab.seq_c, tab.seq_p)
    } else {
        (0u64, 0u64)
    };
    let f = gpu.function("compress_windows")?;
    let lc = LaunchConfig {
        grid_dim: (grid(grid_x.max(1), "windows")?, grid(ns, "sequences")?, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&tab.seq_k)
        .arg(&cp)
        .arg(&tab.seq_kc)
        .arg(&pp)
        .arg(&lens)
        .arg(&nn)
        .arg(&hk_)
        .arg(&d_)
        .arg(&st)
        .arg(&ks)
        .arg(&inv)
        .arg(&ring_);
    // SAFETY: argument list matches kernels/compress.cu; every sequence's Kc/p
    // hold Mc(capacity) ≥ Mc(T) windows and its K/c caches T ≤ capacity tokens.
    unsafe { b.launch(lc) }.cuda("compress_windows").map(drop)
}
