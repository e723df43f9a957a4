//! Prefill (spec §6): prompt chunks through the model, any number of rows
//! per sequence, one call per chunk; synthetic KV fill for benchmarks
//! (runtime.md §5).

use super::*;

/// The hook [`GpuModel::prefill_observed`] calls after each chunk.
type ChunkHook<'a> = &'a mut dyn FnMut(&mut GpuModel, &GpuSequence) -> Result<()>;

impl GpuModel {
    /// Prefills `prompt` into `seq` (positions T … T+n−1), in chunks of at
    /// most [`prefill_chunk`] tokens (fewer for long contexts), calling
    /// `progress(done, total)` after each chunk. Afterwards
    /// [`GpuModel::logits`] holds the last prompt token's logits ([1, V]).
    ///
    /// Dense or sparse as the CPU reference decides (spec §6): sparse iff the
    /// plan is sparse, the whole prompt (T + n tokens) reaches dense_len, and
    /// the prefill mode is not `Dense`. Chunks attend with the kernel
    /// [`GpuModel::set_prefill_attention`] chose (the dense tensor-core
    /// kernel takes chunks of [`prefill_chunk`] rows at any context; the
    /// sparse one builds each tile's union of block lists on the device,
    /// without synchronising).
    ///
    /// Synchronises once at the end and checks the device error record (see
    /// [`GpuModel::check_device_errors`]).
    ///
    /// Errors: an empty prompt, a token id ≥ V, a length past
    /// `max_position_embeddings` ([`Error::Input`] / [`Error::Limit`]); a
    /// device error raised by one of the prompt's kernels ([`Error::Limit`]);
    /// [`Error::Cuda`] on a device failure; [`Error::Interrupted`] when
    /// Ctrl-C was pressed ([`crate::interrupt`], checked before each chunk).
    pub fn prefill(
        &mut self,
        seq: &mut GpuSequence,
        prompt: &[u32],
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        self.prefill_with(seq, prompt, &mut progress, None)
    }

    /// [`GpuModel::prefill`], calling `after_chunk(model, seq)` after each
    /// chunk's forward call (and its `progress`), before the next chunk is
    /// launched: a caller can read what the chunk left (the rows
    /// [`GpuModel::set_capture`] captured, through [`GpuModel::drain_capture`];
    /// the selection state) without keeping the whole prompt's. The same
    /// computation as `prefill`: the chunks, the dense or sparse choice and
    /// the RoPE table are those of the whole prompt. Before each call the
    /// chunk's device error record is checked (one synchronisation per
    /// chunk), and the hook sees the decode RoPE table in force, as outside
    /// a prefill.
    ///
    /// Errors: those of [`GpuModel::prefill`] (a chunk's device error before
    /// its hook runs), and the first error `after_chunk` returns (no
    /// further chunk runs).
    pub fn prefill_observed(
        &mut self,
        seq: &mut GpuSequence,
        prompt: &[u32],
        mut progress: impl FnMut(usize, usize),
        mut after_chunk: impl FnMut(&mut GpuModel, &GpuSequence) -> Result<()>,
    ) -> Result<()> {
        self.prefill_with(seq, prompt, &mut progress, Some(&mut after_chunk))
    }

    /// The body of [`GpuModel::prefill`] and [`GpuModel::prefill_observed`].
    fn prefill_with(
        &mut self,
        seq: &mut GpuSequence,
        prompt: &[u32],
        progress: &mut dyn FnMut(usize, usize),
        after_chunk: Option<ChunkHook<'_>>,
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::Input("empty prompt: give at least one token".into()));
        }
        let t0 = seq.len;
        let prompt_len = t0 + prompt.len();
        self.check_tokens(prompt, prompt_len)?;
        let _ = super::union_stats::finish(); // counts of earlier calls are not this prefill's
        let sparse = self.plan.sparse_at(prompt_len) && self.prefill_mode != PrefillMode::Dense;
        // Dynamic NTK RoPE past its original maximum: the prompt rotates at
        // its whole length (the CPU reference's rule), not with the decode
        // table's per-position lengths; the decode table comes back after.
        let mut decode_table = if self.prefill_needs_own_rope(prompt_len) {
            self.ensure_rope(prompt_len + 1)?;
            let t = self.prefill_rope(prompt_len)?;
            Some(self.rope_tables.replace(t))
        } else {
            None
        };
        let r = self.prefill_chunks(
            seq,
            prompt,
            sparse,
            progress,
            after_chunk,
            &mut decode_table,
        );
        if let Some(d) = decode_table {
            // the prefill table's last readers finish before it is freed
            let synced = self.gpu.synchronize();
            self.rope_tables = d;
            synced?;
        }
        r?;
        if let Some(line) = super::union_stats::finish() {
            eprintln!("{line}");
        }
        self.check_device_errors()
    }

    /// The chunk loop of [`GpuModel::prefill`].
    fn prefill_chunks(
        &mut self,
        seq: &mut GpuSequence,
        prompt: &[u32],
        sparse: bool,
        progress: &mut dyn FnMut(usize, usize),
        mut after_chunk: Option<ChunkHook<'_>>,
        decode_table: &mut Option<Option<RopeTables>>,
    ) -> Result<()> {
        let t0 = seq.len;
        let mut done = 0;
        while done < prompt.len() {
            crate::interrupt::check(|| {
                format!("prefill, {done} of {} prompt tokens done", prompt.len())
            })?;
            let t_end = t0 + done;
            let n = self
                .prefill_rows(t_end + prefill_chunk(), sparse)
                .min(prompt.len() - done);
            let rows: Vec<Row> = prompt[done..done + n]
                .iter()
                .enumerate()
                .map(|(i, &token)| Row {
                    seq: 0,
                    token,
                    pos: t0 + done + i,
                    sparse,
                })
                .collect();
            done += n;
            let which = if done == prompt.len() {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            self.forward(std::slice::from_mut(seq), &rows, which)?;
            progress(done, prompt.len());
            if let Some(hook) = after_chunk.as_mut() {
                self.check_device_errors()?;
                // the hook sees the model as outside a prefill: the decode table
                if let Some(d) = decode_table.as_mut() {
                    std::mem::swap(&mut self.rope_tables, d);
                }
                let r = hook(self, seq);
                if let Some(d) = decode_table.as_mut() {
                    std::mem::swap(&mut self.rope_tables, d);
                }
                r?;
            }
        }
        Ok(())
    }

    /// Rows per prefill chunk so the attention partials of a context of up
    /// to `t_len` tokens stay within [`PARTIALS_BUDGET_BYTES`]
    /// ([`prefill_rows_for`] with this model's configuration, budget,
    /// prefill attention, selection path and window-scoring kernels).
    pub(crate) fn prefill_rows(&self, t_len: usize, sparse: bool) -> usize {
        prefill_rows_for(
            &self.config,
            &self.plan.budget,
            t_len,
            sparse,
            self.prefill_attention,
            self.selection == SelectionPath::Gpu,
            self.prefill_scores_tc(),
            prefill_chunk(),
        )
    }

    /// Whether this model's prefill chunks score their windows with
    /// `qa_prefill_scores` (GPU selection, `SPARDA_PREFILL_SCORES` other than
    /// `cublas`, and a head dim and group the kernel takes; a chunk of fewer than
    /// `QA_GEMM_MIN_ROWS` rows still takes `qa_window_logits`).
    pub(crate) fn prefill_scores_tc(&self) -> bool {
        use crate::cuda::ops::prefill_scores::{
            prefill_scores, prefill_scores_tc_supported, PrefillScores,
        };
        let c = &self.config;
        self.selection == SelectionPath::Gpu
            && prefill_scores() != PrefillScores::Cublas
            && prefill_scores_tc_supported(
                c.head_dim,
                c.num_attention_heads / c.num_key_value_heads.max(1),
            )
    }

    /// Fills the empty sequence `seq` with `len` tokens of synthetic state
    /// (runtime.md §5 `--prefill synthetic`, for decode benchmarks on
    /// random-weight models): every layer's K and V random bf16 N(0, 1)
    /// (kernels/synth.cu, from `seed`, the layer and the sequence's uid), the
    /// eviction scores c = A·softplus(δ·v + b) of those values with the
    /// layer's own eviction head (kernels/eviction.cu), and, for GPU
    /// selection, Kc and p completed from K and c (kernels/compress.cu) —
    /// the state a prefill would leave, minus the model. The next decode
    /// token goes to position `len`. No logits are produced.
    ///
    /// Errors: [`Error::Input`] when `seq` is not empty, `len` is 0 or past
    /// max_position_embeddings, or the sequence mirrors its state on the
    /// host ([`SelectionPath::HostFallback`]); [`Error::Cuda`] on a device
    /// failure (e.g. out of memory when growing).
    pub fn fill_synthetic(&mut self, seq: &mut GpuSequence, len: usize, seed: u64) -> Result<()> {
        if seq.len != 0 || len == 0 || seq.mirror.is_some() {
            return Err(Error::Input(format!(
                "fill_synthetic: needs an empty sequence on the GPU selection path and len ≥ 1 (sequence has {} tokens, len {len})",
                seq.len
            )));
        }
        if len >= self.config.max_position_embeddings {
            return Err(Error::Limit(format!(
                "synthetic context of {len} tokens leaves no position for decoding below max_position_embeddings {}",
                self.config.max_position_embeddings
            )));
        }
        self.ensure_capacity(seq, len)?;
        let c = &self.config;
        let (hk, dh) = (c.num_key_value_heads, c.head_dim);
        let kvd = hk * dh;
        let gpu = self.gpu.clone();
        let s = gpu.stream().clone();
        let fill = gpu.function("fill_normal_bf16")?;
        let n_u64 = (len * kvd) as u64;
        let blocks = (len * kvd).div_ceil(256).clamp(1, 16_384) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = 1.0f32;
        let budget = self.plan.budget;
        // Per-sequence table for compression: K, c, Kc, p, and its length.
        let mut tab_host = vec![0u64; PTRS_PER_SEQ];
        let lens_dev = gpu.upload(&[i32_dim(len, "len")?])?;
        let mut tab_dev: CudaSlice<u64> = gpu.zeros(PTRS_PER_SEQ)?;
        for (l, sl) in seq.layers.iter_mut().enumerate() {
            for (which, buf) in [(0u64, &sl.k), (1u64, &sl.v)] {
                let ptr = dptr(&gpu, buf);
                let sd = seed
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .wrapping_add(seq.uid << 20)
                    .wrapping_add((l as u64) << 2)
                    .wrapping_add(which);
                let mut b = s.launch_builder(fill);
                b.arg(&ptr).arg(&n_u64).arg(&sd).arg(&scale);
                // SAFETY: argument list matches kernels/synth.cu; the cache holds
                // capacity ≥ len tokens of Hkv·D values.
                unsafe { b.launch(cfg) }.cuda("fill_normal_bf16")?;
            }
            if let (Some(head), Some(cbuf)) = (&self.layers[l].evict_head, &mut sl.c) {
                ops::eviction_score(
                    &gpu,
                    &sl.v.slice(0..len * kvd),
                    len,
                    kvd,
                    head,
                    &mut cbuf.slice_mut(0..len * hk),
                )?;
            }
            if let Some(kc) = &sl.kc {
                let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |b| dptr(&gpu, b));
                tab_host[0] = dptr(&gpu, &sl.k);
                tab_host[1] = opt(&sl.c);
                tab_host[2] = dptr(&gpu, kc);
                tab_host[3] = opt(&sl.p);
                s.memcpy_htod(&tab_host, &mut tab_dev)
                    .cuda("uploading a compression table")?;
                let base = dptr(&gpu, &tab_dev);
                let tab = Tables::new(base, 0, 1);
                let windows = budget.windows(len);
                if windows > 0 {
                    compress(
                        &gpu,
                        &budget,
                        &tab,
                        dptr(&gpu, &lens_dev),
                        1,
                        len,
                        windows.min(COMPRESS_MAX_GRID_X),
                        hk,
                        dh,
                        self.eviction,
                        0,
                    )?;
                }
                // The table is rewritten for the next layer: finish this one first.
                gpu.synchronize()?;
            }
        }
        seq.len = len;
        gpu.synchronize()
    }

    /// One forward call over `rows` (see [`Row`]) of `seqs`: appends every
    /// row's token to its sequence and computes the logits `which` asks for.
    /// Rows of one sequence must be at consecutive positions starting at its
    /// length (the public entry points guarantee it). Grids are sized by the
    /// call's own lengths; pointer tables and row inputs are uploaded per
    /// call. Prefill chunks only: every decode step goes through
    /// [`super::step`].
    pub(crate) fn forward(
        &mut self,
        seqs: &mut [GpuSequence],
        rows: &[Row],
        which: LogitRows,
    ) -> Result<()> {
        let n = rows.len();
        if n == 0 {
            return Err(Error::Input("forward called with no tokens".into()));
        }
        let (d, hq, hk, dh, vocab, nl) = (
            self.config.hidden_size,
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.config.head_dim,
            self.config.vocab_size,
            self.config.num_hidden_layers,
        );
        let ns = seqs.len();
        if seqs.iter().any(|s| s.off.is_some()) {
            return Err(Error::Input(
                "an offloaded sequence takes decode steps only (prefill before offload_sequence; every row sparse)".into(),
            ));
        }
        let sparse_plan = self.sparse_plan();
        let path = self.selection;
        // Each row extends its sequence; every sequence carries its path's state.
        let mut new_len = seqs.iter().map(|s| s.len).collect::<Vec<_>>();
        for r in rows {
            if r.seq >= ns || r.pos != new_len[r.seq] {
                return Err(Error::Input(format!(
                    "forward: row for sequence {} at position {} does not extend it (length {})",
                    r.seq,
                    r.pos,
                    new_len.get(r.seq).copied().unwrap_or(0)
                )));
            }
            new_len[r.seq] += 1;
        }
        self.check_selection_state(seqs)?;
        // Room for every row, RoPE tables, workspace (after the spills of
        // earlier calls, which read the K/V buffers growth may replace).
        self.spill_wait(seqs)?;
        for (sq, &len) in seqs.iter_mut().zip(&new_len) {
            self.ensure_capacity(sq, len)?;
        }
        let max_pos = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        self.ensure_rope(max_pos)?;
        self.ensure_workspace(n)?;
        let any_sparse = rows.iter().any(|r| r.sparse);
        let any_dense_in_sparse = any_sparse && rows.iter().any(|r| !r.sparse);
        let budget = self.plan.budget;
        // Block-list width: S for sparse rows; a dense row of a sparse call lists all its blocks.
        let s_max = if any_sparse {
            rows.iter()
                .map(|r| {
                    if r.sparse {
                        budget.attended
                    } else {
                        budget.blocks(r.pos)
                    }
                })
                .max()
                .unwrap_or(1)
                .max(budget.attended)
                .max(1)
        } else {
            1
        };
        let hb = ops::attn_head_blocks(hq, hk);
        let (span, nsplit) = if any_sparse {
            ops::attn_sparse_split(n, hb, s_max)
        } else {
            ops::attn_dense_split(n, hb, max_pos)
        };
        // Prefill attention on the tensor cores when asked: dense calls take
        // the dense kernel, sparse calls whose rows are all sparse the
        // block-sparse one over each tile's union of block lists (a sparse
        // call with dense rows among them keeps the split-K kernel). Work
        // items over the call's rows, uploaded once for every layer.
        let tc_call = self.prefill_attention == PrefillAttention::TensorCore
            && (!any_sparse || !any_dense_in_sparse);
        let (tc_tiles, union_cap) = if tc_call {
            let rr: Vec<(usize, usize)> = rows.iter().map(|r| (r.seq, r.pos)).collect();
            let t = ops::prefill_tiles(&rr, hq / hk)?;
            let cap = if any_sparse {
                if super::union_stats::enabled() {
                    super::union_stats::set_tiles(&t);
                }
                ops::prefill_union_capacity(&rr, &t, hq / hk, hk, s_max, budget.block_size)?
            } else {
                0
            };
            (Some((self.gpu.upload(&t)?, t.len() / 3)), cap)
        } else {
            (None, 0)
        };
        let attn_geo = AttnGeometry {
            sparse: any_sparse,
            span,
            nsplit,
            s_max,
            prefill_tiles: tc_tiles
                .as_ref()
                .map(|(t, count)| (dptr(&self.gpu, t), *count)),
            union_cap,
        };
        // Query-aware scoring workspace (GPU selection): every row of a sparse
        // call is scored (dense rows' lists are overwritten afterwards), so
        // the widths cover them all.
        let mc_max = if any_sparse {
            rows.iter()
                .map(|r| budget.windows(r.pos + 1))
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let qa_tile = crate::cuda::ops::select::QA_TILE;
        let w_stride = mc_max.max(1).div_ceil(qa_tile) * qa_tile;
        let ntiles = w_stride / qa_tile;
        let nb_max = rows
            .iter()
            .map(|r| budget.blocks(r.pos))
            .max()
            .unwrap_or(1)
            .max(1);
        let sel_geo = SelGeometry {
            mc: mc_max,
            w_stride,
            nb_cap: nb_max,
            s_max,
        };
        // Rows of one sequence score their windows with cuBLAS (one Kc for all).
        // (every layer's Kc present: the selection path guarantees it, and the
        // workspace below is sized on this, so the layer loop must agree)
        let shared_kc_rows = any_sparse
            && path == SelectionPath::Gpu
            && ns == 1
            && n >= crate::cuda::ops::select::QA_GEMM_MIN_ROWS
            && seqs[0].layers.iter().all(|sl| sl.kc.is_some());
        let gpu = self.gpu.clone();
        let s = gpu.stream().clone();
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * ns;
        let table = self.pointer_tables(seqs, rows);
        let mut ws = self.ws.take().expect("workspace allocated above");
        let r = (|| -> Result<Option<()>> {
            // (no split-K partials on the tensor-core path)
            let part = if tc_tiles.is_some() {
                0
            } else {
                n * hq * nsplit
            };
            // SAFETY (each `alloc` below): written by a kernel or copy before it is read.
            if ws.part_o.len() < part * dh {
                ws.part_o = unsafe { s.alloc(part * dh) }.cuda("allocating attention partials")?;
            }
            if ws.part_ml.len() < part * 2 {
                ws.part_ml = unsafe { s.alloc(part * 2) }.cuda("allocating attention partials")?;
            }
            if let (Some((_, ntiles)), true) = (&tc_tiles, union_cap > 0) {
                let (entries, what) = (ntiles * hk * union_cap, "allocating sparse prefill unions");
                if ws.union_blk.len() < entries {
                    ws.union_blk = unsafe { s.alloc(entries) }.cuda(what)?;
                }
                if ws.union_mask.len() < entries {
                    ws.union_mask = unsafe { s.alloc(entries) }.cuda(what)?;
                }
                if ws.union_n.len() < ntiles * hk {
                    ws.union_n = unsafe { s.alloc(ntiles * hk) }.cuda(what)?;
                }
            }
            if ws.sel.len() < n * hk * s_max {
                ws.sel = unsafe { s.alloc(n * hk * s_max) }.cuda("allocating block lists")?;
            }
            if ws.ptrs.len() < nl * per_layer {
                ws.ptrs = unsafe { s.alloc(nl * per_layer) }.cuda("allocating pointer tables")?;
            }
            if ws.seq_lens.len() < ns {
                ws.seq_lens = unsafe { s.alloc(ns) }.cuda("allocating sequence lengths")?;
            }
            // (qa_prefill_scores keeps the logits and statistics on chip)
            let logits_in_memory = !(shared_kc_rows && self.prefill_scores_tc());
            if any_sparse && path == SelectionPath::Gpu {
                if logits_in_memory && ws.qa_logits.len() < n * hq * w_stride {
                    ws.qa_logits = unsafe { s.alloc(n * hq * w_stride) }
                        .cuda("allocating the window-score workspace")?;
                }
                // split kernels (tensor-core-split, tensor-core-bf16x2): the logits buffer holds Kc's bf16 parts
                let parts =
                    crate::cuda::ops::prefill_scores::split_kc_scratch_f32(hk, w_stride, dh);
                if !logits_in_memory
                    && crate::cuda::ops::prefill_scores::prefill_scores().splits_kc(hq / hk)
                    && ws.qa_logits.len() < parts
                {
                    ws.qa_logits =
                        unsafe { s.alloc(parts) }.cuda("allocating the window-score workspace")?;
                }
                if logits_in_memory && ws.qa_stats.len() < n * hq * ntiles * 2 {
                    ws.qa_stats = unsafe { s.alloc(n * hq * ntiles * 2) }
                        .cuda("allocating the window-score workspace")?;
                }
                if ws.qa_scores.len() < n * hk * w_stride {
                    ws.qa_scores = unsafe { s.alloc(n * hk * w_stride) }
                        .cuda("allocating the window-score workspace")?;
                }
                let scratch = crate::cuda::ops::select::shared_kc_scratch_f32(n, hq, dh);
                if shared_kc_rows && logits_in_memory && ws.qa_qf.len() < scratch {
                    ws.qa_qf = unsafe { s.alloc(scratch) }
                        .cuda("allocating the window-score workspace")?;
                }
            }
            // Row inputs and pointer tables.
            let ids: Vec<u32> = rows.iter().map(|r| r.token).collect();
            let pos: Vec<i32> = rows.iter().map(|r| r.pos as i32).collect();
            let lens: Vec<i32> = rows.iter().map(|r| r.pos as i32 + 1).collect();
            let dense: Vec<i32> = rows.iter().map(|r| i32::from(!r.sparse)).collect();
            let slens: Vec<i32> = new_len.iter().map(|&l| l as i32).collect();
            s.memcpy_htod(&ids, &mut ws.ids.slice_mut(0..n))
                .cuda("uploading token ids")?;
            s.memcpy_htod(&pos, &mut ws.pos.slice_mut(0..n))
                .cuda("uploading positions")?;
            s.memcpy_htod(&lens, &mut ws.lens.slice_mut(0..n))
                .cuda("uploading lengths")?;
            s.memcpy_htod(&dense, &mut ws.dense.slice_mut(0..n))
                .cuda("uploading row modes")?;
            s.memcpy_htod(&slens, &mut ws.seq_lens.slice_mut(0..ns))
                .cuda("uploading sequence lengths")?;
            s.memcpy_htod(&table, &mut ws.ptrs.slice_mut(0..nl * per_layer))
                .cuda("uploading KV pointer tables")?;
            // Embedding; the residual stream starts at zero and takes it as layer 0's delta.
            ops::embed_gather(
                &gpu,
                &self.embed,
                vocab,
                d,
                &ws.ids.slice(0..n),
                self.config.embed_scale(),
                &mut ws.delta.slice_mut(0..n * d),
            )?;
            s.memset_zeros(&mut ws.resid.slice_mut(0..n * d))
                .cuda("zeroing the residual stream")?;
            Ok(Some(()))
        })();
        if let Err(e) = r {
            self.ws = Some(ws);
            return Err(e);
        }
        let inp = RowInputs {
            pos: dptr(&gpu, &ws.pos),
            lens: dptr(&gpu, &ws.lens),
            seq_lens: dptr(&gpu, &ws.seq_lens),
        };
        // Tokens each sequence gains in this call (compression recomputes at most
        // that many tokens' windows; recomputing a complete window is idempotent).
        let n_new = seqs
            .iter()
            .zip(&new_len)
            .map(|(sq, &l)| l - sq.len)
            .max()
            .unwrap_or(0);
        let new_windows = new_len
            .iter()
            .map(|&t| budget.windows(t) - budget.windows(t.saturating_sub(n_new)))
            .max()
            .unwrap_or(0);
        if self.record_selections {
            self.last_selections = vec![Vec::new(); nl];
            self.last_queries = vec![Vec::new(); nl];
        }
        let ptrs = dptr(&gpu, &ws.ptrs);
        // A sequence prefilled for offload writes this call's completed
        // blocks to host memory layer by layer (begin_offload).
        let spill = if ns == 1 {
            self.spill_tables(&seqs[0], new_len[0])?
        } else {
            None
        };
        let r = (|| -> Result<()> {
            for l in 0..nl {
                let tab = Tables::new(ptrs + (l * per_layer * 8) as u64, n, ns);
                let comp = (sparse_plan && path == SelectionPath::Gpu && new_windows > 0)
                    .then_some((n_new, new_windows.min(COMPRESS_MAX_GRID_X)));
                // Traced as the decode step is: "qkv" (input norm, QKV GEMM)
                // and layer_front's spans, the selection's phases
                // (gpu_select), then layer_back's spans.
                let open = self.tspan(&s, crate::trace::Track::Compute, "qkv", l)?;
                let mut open = self.layer_front(l, &mut ws, n, ns, 0, &inp, &tab, comp, 0, open)?;
                if let Some(t) = &spill {
                    self.spill_layer(&seqs[0], l, t, new_len[0])?;
                }
                // Selection state and block lists (spec §3–§4).
                if sparse_plan && path == SelectionPath::HostFallback {
                    // The mirror takes every token (dense phases included).
                    self.host_select_lists(&mut ws, seqs, rows, l, 0, 0, 0, s_max, any_sparse)?;
                } else if any_sparse {
                    let shared_kc = match (&seqs[0].layers[l].kc, shared_kc_rows) {
                        (Some(kc), true) => Some(dptr(&gpu, kc)),
                        _ => None,
                    };
                    open =
                        self.gpu_select(l, &ws, n, 0, 0, 0, &inp, &tab, &sel_geo, shared_kc, open)?;
                    if any_dense_in_sparse {
                        self.fill_dense_rows(&ws, n, inp.lens, s_max, 0, 0)?;
                    }
                }
                if self.record_selections {
                    self.record_forward_layer(l, &ws, rows, any_sparse, s_max)?;
                }
                self.capture_layer(l, &ws, rows)?;
                let sp =
                    self.layer_back(l, &mut ws, n, 0, 0, 0, &inp, &tab, &attn_geo, None, open)?;
                self.tspan_end(self.gpu.stream(), sp)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            self.ws = Some(ws);
            if spill.is_some() {
                // the spill tables are dropped below: no spill may still read them
                self.spill_wait(seqs)?;
            }
            return Err(e);
        }
        let bs = self.plan.budget.block_size;
        for (sq, len) in seqs.iter_mut().zip(new_len) {
            sq.len = len;
            if spill.is_some() {
                if let Some(sp) = sq.spill.as_mut() {
                    sp.advance(len, bs);
                }
            }
        }
        // The spill tables are read by the write-back stream: keep them
        // alive until it is done with them.
        if spill.is_some() {
            self.spill_wait(seqs)?;
        }
        drop(spill);
        let (first, m) = match which {
            LogitRows::None => (0, 0),
            LogitRows::Last => (n - 1, 1),
        };
        let r = self.head(&mut ws, n, first, m);
        self.ws = Some(ws);
        r?;
        self.last = if m == 0 {
            LastLogits::None
        } else {
            LastLogits::Forward(m)
        };
        Ok(())
    }

    /// Records layer `l` of a forward call (queries and lists of sparse
    /// calls; empty lists for dense calls).
    pub(crate) fn record_forward_layer(
        &mut self,
        l: usize,
        ws: &Workspace,
        rows: &[Row],
        any_sparse: bool,
        s_max: usize,
    ) -> Result<()> {
        let (hq, hk, dh) = (
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.config.head_dim,
        );
        let (n, w) = (rows.len(), self.qkv_cols);
        if !any_sparse {
            self.last_selections[l] = vec![vec![Vec::new(); hk]; n];
            return Ok(());
        }
        let qkv = self.gpu.download(&ws.qkv.slice(0..n * w))?;
        self.last_queries[l] = (0..n)
            .map(|i| {
                qkv[i * w..i * w + hq * dh]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect()
            })
            .collect();
        let sel = self.gpu.download(&ws.sel.slice(0..n * hk * s_max))?;
        let nsel = self.gpu.download(&ws.nsel.slice(0..n * hk))?;
        self.last_selections[l] = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (0..hk)
                    .map(|h| {
                        if !r.sparse {
                            return Vec::new();
                        }
                        let k = nsel[i * hk + h].clamp(0, s_max as i32) as usize;
                        let row = &sel[(i * hk + h) * s_max..];
                        row[..k].iter().map(|&m| m.max(0) as usize).collect()
                    })
                    .collect()
            })
            .collect();
        Ok(())
    }
}

/// Rows per prefill chunk of a model `c` with selection budget `budget`, for
/// a context of up to `t_len` tokens, at most `chunk`: the rows whose
/// attention and selection workspaces fit [`PARTIALS_BUDGET_BYTES`]. Dense
/// chunks on the tensor cores ([`PrefillAttention::TensorCore`]) have no
/// partials and take `chunk` rows at any context; rowwise chunks count their
/// split-K partials (at the finest split, one per [`ops::ATTN_TILE`] tokens,
/// or one per attended block); sparse chunks on the tensor cores count their
/// union lists instead; sparse chunks with GPU selection add the window-score
/// workspace — f32 logits, tile statistics, widened queries and scores for
/// the cuBLAS path, the scores alone when `tc_scores` (`qa_prefill_scores`
/// keeps the logits on chip).
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_rows_for(
    c: &crate::config::ModelConfig,
    budget: &crate::model::select::Budget,
    t_len: usize,
    sparse: bool,
    attention: PrefillAttention,
    gpu_selection: bool,
    tc_scores: bool,
    chunk: usize,
) -> usize {
    let tc = attention == PrefillAttention::TensorCore;
    if !sparse && tc {
        return chunk;
    }
    let mut per_row = if sparse && tc {
        // A tile of 64 (row, head) pairs serves 64 / G rows: about G / 64
        // union lists per row of min(blocks, 64·S) entries per KV head.
        let g = c.num_attention_heads / c.num_key_value_heads.max(1);
        let cap = budget
            .blocks(t_len)
            .min(ops::PREFILL_TILE_M * budget.attended.max(1));
        (c.num_key_value_heads * ops::PREFILL_UNION_ENTRY_BYTES * cap * g)
            .div_ceil(ops::PREFILL_TILE_M)
    } else {
        let nsplit = if sparse {
            budget.attended
        } else {
            t_len.div_ceil(ops::ATTN_TILE)
        }
        .max(1);
        c.num_attention_heads * nsplit * (c.head_dim + 2) * 4
    };
    if sparse && gpu_selection {
        let qa_tile = crate::cuda::ops::select::QA_TILE;
        let w_stride = budget.windows(t_len).max(1).div_ceil(qa_tile) * qa_tile;
        let tiles = w_stride / qa_tile;
        per_row += if tc_scores {
            c.num_key_value_heads * w_stride * 4
        } else {
            (c.num_attention_heads * (w_stride + 2 * tiles + c.head_dim)
                + c.num_key_value_heads * w_stride)
                * 4
        };
    }
    (PARTIALS_BUDGET_BYTES / per_row.max(1)).clamp(1, chunk)
}

#[cfg(test)]
mod chunk_rows_tests {
    use super::*;
    use crate::model::select::Budget;

    fn nosa8b() -> (crate::config::ModelConfig, Budget) {
        let c = crate::synth::Preset::Nosa8b.config();
        let b = Budget::new(c.sparse.as_ref().expect("NOSA-8B is sparse"));
        (c, b)
    }

    #[test]
    fn dense_tensor_core_chunks_take_the_whole_chunk_at_any_context() {
        let (c, b) = nosa8b();
        for t in [4096, 130_048, 1 << 20] {
            let r = prefill_rows_for(
                &c,
                &b,
                t,
                false,
                PrefillAttention::TensorCore,
                true,
                false,
                1024,
            );
            assert_eq!(r, 1024, "t {t}");
        }
    }

    #[test]
    fn sparse_rows_at_127k_shrink_with_the_cublas_logits_and_not_with_tensor_core_scores() {
        let (c, b) = nosa8b();
        let t = 130_048 + 1024;
        let rows = |tc_scores| {
            prefill_rows_for(
                &c,
                &b,
                t,
                true,
                PrefillAttention::TensorCore,
                true,
                tc_scores,
                1024,
            )
        };
        // cuBLAS path: 32 heads of f32 logits over 8,192 windows per row,
        // 32·(8192 + 256 + 128)·4 + 2·8192·4 bytes plus 12 KB of union lists
        // (≈ 1.2 MB): 456 rows.
        let cublas = rows(false);
        assert!((400..=500).contains(&cublas), "{cublas}");
        // Tensor-core scores keep only Hkv score rows per query row.
        assert_eq!(rows(true), 1024);
        // At 32K both fit a whole chunk of 1024 rows.
        let r32 = prefill_rows_for(
            &c,
            &b,
            32_768,
            true,
            PrefillAttention::TensorCore,
            true,
            false,
            1024,
        );
        assert_eq!(r32, 1024);
    }

    #[test]
    fn rowwise_dense_rows_fall_with_the_context_and_never_reach_zero() {
        let (c, b) = nosa8b();
        let mut last = usize::MAX;
        for t in [1024, 8192, 32_768, 130_048, 1 << 22] {
            let r = prefill_rows_for(
                &c,
                &b,
                t,
                false,
                PrefillAttention::Rowwise,
                true,
                false,
                1024,
            );
            assert!(r >= 1 && r <= last, "t {t}: {r} after {last}");
            last = r;
        }
        assert_eq!(last, 1);
    }
}
