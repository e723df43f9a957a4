//! The decode step: its buffers, pointer tables and key, and how it is
//! launched. Every decode step goes through [`GpuModel::decode`] /
//! [`GpuModel::decode_greedy`] → `run_step` → the per-layer schedule of
//! [`super::schedule`], captured as a CUDA graph or launched eagerly.

use super::*;

/// What a captured decode step depends on besides its per-step inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepKey {
    /// (uid, generation) of each row's sequence, in row order.
    pub(crate) seqs: Vec<(u64, u64)>,
    /// Attention over block lists (some row is sparse, or the KV is
    /// offloaded: offloaded attention always reads slot lists); else every
    /// row attends densely to its whole cache.
    pub(crate) sparse: bool,
    /// Per row: dense (T < dense_len, spec §1: every existing block, no
    /// eviction bias) rather than sparse.
    pub(crate) dense_rows: Vec<bool>,
    /// The selection needs the host in the middle of the step
    /// ([`SelectionPath::HostFallback`]): never captured.
    pub(crate) host_selection: bool,
    /// The batch's largest capacity, tokens: sizes every grid.
    pub(crate) cap: usize,
    /// Rows of the RoPE tables (their buffers move when they grow).
    pub(crate) rope_rows: usize,
    /// Offloaded KV (a step with slot pools and fetches).
    pub(crate) offload: bool,
}

/// The device-resident decode step of one batch (see the module doc).
pub(crate) struct DecodeStep {
    /// Slot lists, fetch lists and tables of an offloaded batch. First field:
    /// dropped first, its `Drop` waits for the last write-back, which reads
    /// the workspace's pointer tables.
    pub(crate) off: Option<crate::kv::offload::StepOffload>,
    pub(crate) key: StepKey,
    /// B: rows = sequences.
    pub(crate) n: usize,
    pub(crate) attn: AttnGeometry,
    pub(crate) sel: SelGeometry,
    /// Step inputs, u32 [ids n | pos n | lens n | seq_lens n]; advanced on the
    /// device by the step's last kernel (`argmax_advance`).
    pub(crate) io: CudaSlice<u32>,
    pub(crate) ws: Workspace,
    /// The captured step: [0] without a write-back, [1] with the
    /// write-back of completed blocks (offloaded steps where a row's
    /// length reaches a multiple of the block size; GPU-resident steps use
    /// [0] only).
    pub(crate) graphs: [Option<CudaGraph>; 2],
    /// The last step replayed one of `graphs`.
    pub(crate) replayed: bool,
    /// Capture of that variant failed once: it stays eager for this build.
    pub(crate) capture_failed: [bool; 2],
    /// The sequence lengths the device inputs describe (the next step's positions).
    pub(crate) dev_lens: Vec<usize>,
    /// Steps run since the build.
    pub(crate) steps: usize,
}

impl GpuModel {
    /// One decode step for a batch: `tokens[b]` goes to `seqs[b]` at its
    /// next position; afterwards [`GpuModel::logits`] holds [B, V] and the
    /// step's greedy argmax is computed (see [`GpuModel::argmax`]). Each
    /// sequence is sparse or dense by its own length (dense_len, spec §1).
    ///
    /// Every batch runs on the device-resident step of [`super::step`]: one
    /// upload of the B token ids, positions and lengths, then the per-layer
    /// schedule of [`super::schedule`] — replayed as a CUDA graph
    /// ([`DecodeMode::Graph`]) or launched eagerly (tracing, the host
    /// selection path, [`DecodeMode::Eager`]; offloaded KV when the copy
    /// engines take part in the fetch or fetch timing is on). Dense and
    /// sparse rows mix freely in one step.
    ///
    /// Errors: B = 0, `tokens.len() != seqs.len()`, a token id ≥ V, a length
    /// past `max_position_embeddings`; [`Error::Cuda`] on a device failure.
    pub fn decode(&mut self, seqs: &mut [GpuSequence], tokens: &[u32]) -> Result<()> {
        if seqs.is_empty() || tokens.len() != seqs.len() {
            return Err(Error::Input(format!(
                "decode: {} tokens for {} sequences (need one per sequence, at least one)",
                tokens.len(),
                seqs.len()
            )));
        }
        for (s, &t) in seqs.iter().zip(tokens) {
            self.check_tokens(&[t], s.len + 1)?;
        }
        self.run_step(seqs, Some(tokens))
    }

    /// One greedy decode step fed on the device: each sequence's next token
    /// is the argmax of its row of the previous step's logits, which that
    /// step left in the device-resident step inputs — nothing is copied
    /// between host and device (the benchmark loop, runtime.md §5).
    /// Afterwards [`GpuModel::logits`] / [`GpuModel::argmax`] are as after
    /// [`GpuModel::decode`].
    ///
    /// Errors: [`Error::Input`] unless the previous call was a
    /// device-resident decode step of exactly these sequences with nothing
    /// run on them since (call [`GpuModel::decode`] with tokens first), or
    /// when the step must be rebuilt (a capacity grew, or a row crossed
    /// dense_len); a length past `max_position_embeddings` ([`Error::Limit`]);
    /// [`Error::Cuda`] on a device failure.
    pub fn decode_greedy(&mut self, seqs: &mut [GpuSequence]) -> Result<()> {
        let ok = matches!(self.last, LastLogits::Step(n) if n == seqs.len())
            && self.step.as_ref().is_some_and(|st| {
                st.dev_lens.len() == seqs.len()
                    && st
                        .key
                        .seqs
                        .iter()
                        .zip(seqs.iter())
                        .all(|(&(uid, _), s)| uid == s.uid)
                    && st
                        .dev_lens
                        .iter()
                        .zip(seqs.iter())
                        .all(|(&l, s)| l == s.len)
            });
        if !ok {
            return Err(Error::Input(
                "decode_greedy: the previous call was not a device-resident decode step of these sequences; call decode with tokens first".into(),
            ));
        }
        for s in seqs.iter() {
            self.check_tokens(&[], s.len + 1)?;
        }
        self.run_step(seqs, None)
    }

    /// Token ids < V and the length `t_len` within max_position_embeddings.
    pub(crate) fn check_tokens(&self, tokens: &[u32], t_len: usize) -> Result<()> {
        let c = &self.config;
        if t_len > c.max_position_embeddings {
            return Err(Error::Limit(format!(
                "sequence of {t_len} tokens exceeds max_position_embeddings {} (override with --max-position / --rope-theta)",
                c.max_position_embeddings
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {} ids",
                c.vocab_size
            )));
        }
        Ok(())
    }

    /// The RoPE rows a step over `seqs` needs: positions up to the batch's
    /// capacity (device-fed steps advance without the host).
    pub(crate) fn step_rope_need(&self, seqs: &[GpuSequence], cap: usize) -> usize {
        let next = seqs.iter().map(|s| s.len + 1).max().unwrap_or(1);
        cap.min(self.config.max_position_embeddings).max(next)
    }

    /// Runs one device-resident decode step (see the module doc): grows
    /// caches, (re)builds the step when its key changed, uploads the step
    /// inputs (when `tokens` is given), then replays the graph (capturing it
    /// on the second step of a build, or the first later step that needs
    /// it: an offloaded step with a write-back has its own) or launches the
    /// kernels eagerly.
    pub(crate) fn run_step(
        &mut self,
        seqs: &mut [GpuSequence],
        tokens: Option<&[u32]>,
    ) -> Result<()> {
        let n = seqs.len();
        for sq in seqs.iter_mut() {
            let need = sq.len + 1;
            self.ensure_capacity(sq, need)?;
        }
        let cap = seqs.iter().map(|s| s.cap).max().unwrap_or(1);
        let need = self.step_rope_need(seqs, cap);
        self.ensure_rope(need)?;
        let rope_rows = self.rope_tables.as_ref().map_or(0, |t| t.rows);
        let offload = seqs[0].off.is_some();
        if seqs.iter().any(|s| s.off.is_some() != offload) {
            return Err(Error::Input(
                "decode: a batch must be all offloaded or all GPU-resident".into(),
            ));
        }
        let dense_rows: Vec<bool> = seqs
            .iter()
            .map(|s| !self.plan.sparse_at(s.len + 1))
            .collect();
        let any_sparse = dense_rows.iter().any(|&d| !d);
        let host_selection = self.sparse_plan() && self.selection == SelectionPath::HostFallback;
        if host_selection && any_sparse && self.forecast_cols.is_some() {
            return Err(Error::Input(
                "decode: forecast selection runs on the GPU only; the host selection path (SPARDA_SELECTION=host) selects by the real query".into(),
            ));
        }
        let key = StepKey {
            seqs: seqs.iter().map(|s| (s.uid, s.generation)).collect(),
            sparse: any_sparse || offload,
            dense_rows,
            host_selection,
            cap,
            rope_rows,
            offload,
        };
        if self.step.as_ref().is_none_or(|st| st.key != key) {
            self.check_selection_state(seqs)?;
            if tokens.is_none() {
                return Err(Error::Input(
                    "decode_greedy: the step must be rebuilt (a capacity grew, the batch changed, or a row crossed dense_len); call decode with tokens".into(),
                ));
            }
            self.step = None;
            let st = self.build_step(seqs, key)?;
            self.step = Some(st);
        }
        let gpu = self.gpu.clone();
        let mut st = self.step.take().expect("built above");
        st.replayed = false;
        // PDL for a GPU-resident step's launches (captured into its graph);
        // an offloaded step's kernels also wait on the copy streams' events,
        // so they launch plainly (cuda/launch.rs)
        let pdl = crate::cuda::PdlScope::new(&gpu, st.off.is_none());
        let r = (|| -> Result<()> {
            if let Some(toks) = tokens {
                let mut io = Vec::with_capacity(4 * n);
                io.extend_from_slice(toks);
                io.extend(seqs.iter().map(|s| s.len as u32));
                io.extend(seqs.iter().map(|s| s.len as u32 + 1));
                io.extend(seqs.iter().map(|s| s.len as u32 + 1));
                gpu.stream()
                    .memcpy_htod(&io, &mut st.io)
                    .cuda("uploading the decode step inputs")?;
            }
            if let Some(off) = st.off.as_mut() {
                off.completes =
                    crate::kv::write_back::step_completes_block(seqs, self.plan.budget.block_size);
            }
            // An offloaded step replays a graph when its fetch runs on the
            // device alone and fetch timing is off
            // (crate::kv::offload::offloaded_step_graphable); one that writes
            // a completed block back replays a second graph that holds the
            // write-back (kv_store_blocks picks the rows that completed one).
            let graph_now = self.decode_mode == DecodeMode::Graph
                && !st.key.host_selection
                && !self.trace_on()
                && !self.cta_log_on()
                && (st.off.is_none()
                    || crate::kv::offload::offloaded_step_graphable(
                        self.fetch_engine(n),
                        self.fetch_timing,
                    ));
            let variant = usize::from(st.off.as_ref().is_some_and(|o| o.completes));
            // with --reserve-fetch-sms, the GEMMs of an offloaded prefetch
            // step are sized for the SMs the copy kernel leaves (captured
            // so, or set around the launches)
            let sms = st.off.as_ref().and(self.gemm_sm_target(n));
            if graph_now {
                // the write-back of an earlier eager step: waited for outside
                // the graphs, which hold only their own
                self.offload_wait_write_back(&mut st)?;
            }
            let capture = graph_now
                && st.graphs[variant].is_none()
                && !st.capture_failed[variant]
                && st.steps >= 1;
            if capture {
                if let Some(sms) = sms {
                    gpu.set_gemm_sm_target(sms)?;
                }
                let captured = gpu.capture(|| {
                    let r = self.enqueue_step(&mut st, seqs);
                    // the write-back stream rejoins the capture (also after
                    // an error): the graph ends when the step's write-back
                    // has, as an eager step's successor waits for it first
                    let joined = self.offload_wait_write_back(&mut st);
                    r.and(joined)
                });
                // reset before the outcome is handled (an error here is
                // reported after it)
                let reset = if sms.is_some() {
                    gpu.set_gemm_sm_target(0)
                } else {
                    Ok(())
                };
                match captured {
                    Ok(g) => st.graphs[variant] = Some(g),
                    Err(e) => {
                        tracing::warn!(
                            "decode step: CUDA graph capture failed ({e}); running eagerly"
                        );
                        st.capture_failed[variant] = true;
                        // a write-back recorded in the failed capture never
                        // ran (the eager step below enqueues its own), and
                        // its event may not be waited for outside a capture
                        if let Some(o) = st.off.as_mut() {
                            o.wb_done = None;
                        }
                    }
                }
                reset?;
            }
            match st.graphs[variant].as_ref().filter(|_| graph_now) {
                Some(g) => {
                    g.launch().cuda("cuGraphLaunch (decode step)")?;
                    st.replayed = true;
                    Ok(())
                }
                None => match sms {
                    // eager: the target applies to the GEMMs this step
                    // launches, and is undone after
                    Some(sms) => {
                        gpu.set_gemm_sm_target(sms)?;
                        let r = self.enqueue_step(&mut st, seqs);
                        let reset = gpu.set_gemm_sm_target(0);
                        r.and(reset)
                    }
                    None => self.enqueue_step(&mut st, seqs),
                },
            }
        })();
        drop(pdl);
        let ok = r.is_ok();
        if !ok {
            // spans the failed step began and never ended
            self.timeline.borrow_mut().drop_open();
            self.fetch_spans.borrow_mut().clear();
        }
        st.steps += 1;
        if st.off.is_some() {
            self.offload_steps += 1;
        }
        st.dev_lens = seqs.iter().map(|s| s.len + 1).collect();
        self.step = Some(st);
        r?;
        if ok {
            for sq in seqs.iter_mut() {
                sq.len += 1;
            }
            self.last = LastLogits::Step(n);
            if self.record_selections {
                self.record_step()?;
            }
            self.offload_collect_timing()?;
            self.finish_traced_step()?;
        }
        Ok(())
    }

    /// Allocates a decode step for `seqs` under `key` and uploads its
    /// pointer tables (the only host→device copy besides the step inputs).
    pub(crate) fn build_step(&self, seqs: &[GpuSequence], key: StepKey) -> Result<DecodeStep> {
        let c = &self.config;
        let (hq, hk, dh, nl) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.num_hidden_layers,
        );
        let n = seqs.len();
        let budget = self.plan.budget;
        let hb = ops::attn_head_blocks(hq, hk);
        let attn = if key.sparse {
            let any_dense = key.dense_rows.iter().any(|&d| d);
            let s_max = list_width(&budget, self.plan.sparse.dense_len, key.cap, any_dense);
            let (span, nsplit) = ops::attn_sparse_split(n, hb, s_max);
            AttnGeometry {
                sparse: true,
                span,
                nsplit,
                s_max,
                prefill_tiles: None,
                union_cap: 0,
            }
        } else {
            let (span, nsplit) = ops::attn_dense_split(n, hb, key.cap);
            AttnGeometry {
                sparse: false,
                span,
                nsplit,
                s_max: 1,
                prefill_tiles: None,
                union_cap: 0,
            }
        };
        let mc = budget.windows(key.cap);
        let qa_tile = crate::cuda::ops::select::QA_TILE;
        let sel = SelGeometry {
            mc,
            w_stride: mc.max(1).div_ceil(qa_tile) * qa_tile,
            nb_cap: budget.blocks(key.cap.saturating_sub(1)).max(1),
            s_max: attn.s_max,
        };
        let mut ws = self.new_workspace(n, nl, attn.s_max)?;
        let s = self.gpu.stream();
        let part = n * hq * attn.nsplit;
        // SAFETY (each `alloc`): written by a kernel before it is read.
        unsafe {
            ws.part_o = s.alloc(part * dh).cuda("allocating attention partials")?;
            ws.part_ml = s.alloc(part * 2).cuda("allocating attention partials")?;
            if key.sparse {
                let tiles = sel.w_stride / qa_tile;
                ws.qa_logits = s
                    .alloc(n * hq * sel.w_stride)
                    .cuda("allocating the window-score workspace")?;
                ws.qa_stats = s
                    .alloc(n * hq * tiles * 2)
                    .cuda("allocating the window-score workspace")?;
                ws.qa_scores = s
                    .alloc(n * hk * sel.w_stride)
                    .cuda("allocating the window-score workspace")?;
            }
        }
        let rows: Vec<Row> = (0..n)
            .map(|b| Row {
                seq: b,
                token: 0,
                pos: seqs[b].len,
                sparse: !key.dense_rows[b],
            })
            .collect();
        let table = self.pointer_tables(seqs, &rows);
        s.memcpy_htod(&table, &mut ws.ptrs.slice_mut(0..table.len()))
            .cuda("uploading KV pointer tables")?;
        let dense: Vec<i32> = key.dense_rows.iter().map(|&d| i32::from(d)).collect();
        s.memcpy_htod(&dense, &mut ws.dense.slice_mut(0..n))
            .cuda("uploading row modes")?;
        let io: CudaSlice<u32> = self.gpu.zeros(4 * n)?;
        let off = if key.offload {
            Some(self.build_step_offload(seqs, attn.s_max)?)
        } else {
            None
        };
        Ok(DecodeStep {
            key,
            n,
            attn,
            sel,
            io,
            ws,
            graphs: [None, None],
            replayed: false,
            capture_failed: [false; 2],
            dev_lens: Vec::new(),
            steps: 0,
            off,
        })
    }

    /// Per-layer pointer tables of a call over `rows` of `seqs` (see
    /// [`Tables`]): [L][PTRS_PER_ROW·n + PTRS_PER_SEQ·ns] u64.
    pub(crate) fn pointer_tables(&self, seqs: &[GpuSequence], rows: &[Row]) -> Vec<u64> {
        let gpu = &*self.gpu;
        let (n, ns, nl) = (rows.len(), seqs.len(), self.layers.len());
        let nosa = self.plan.mode == AttentionMode::Nosa;
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * ns;
        let opt = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0u64, |c| dptr(gpu, c));
        let mut table = vec![0u64; nl * per_layer];
        for l in 0..nl {
            let t = &mut table[l * per_layer..(l + 1) * per_layer];
            for (i, r) in rows.iter().enumerate() {
                let sl = &seqs[r.seq].layers[l];
                let c = opt(&sl.c);
                t[i] = dptr(gpu, &sl.k);
                t[n + i] = dptr(gpu, &sl.v);
                t[2 * n + i] = c;
                t[3 * n + i] = if r.sparse && nosa { c } else { 0 };
                t[4 * n + i] = opt(&sl.kc);
                t[5 * n + i] = opt(&sl.p);
            }
            for (j, sq) in seqs.iter().enumerate() {
                let sl = &sq.layers[l];
                t[6 * n + j] = dptr(gpu, &sl.k);
                t[6 * n + ns + j] = opt(&sl.c);
                t[6 * n + 2 * ns + j] = opt(&sl.kc);
                t[6 * n + 3 * ns + j] = opt(&sl.p);
            }
        }
        table
    }

    /// Copies the last step's per-layer queries and block lists (empty for
    /// dense rows, as in a prefill call) and, in forecast mode, the forecasts
    /// to the recording ([`GpuModel::last_selections`],
    /// [`GpuModel::last_queries`], [`GpuModel::last_forecasts`]).
    pub(crate) fn record_step(&mut self) -> Result<()> {
        let st = self.step.as_ref().expect("a step ran");
        let c = &self.config;
        let (hq, hk, dh, nl) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.num_hidden_layers,
        );
        let (n, w, s_max) = (st.n, self.qkv_cols, st.attn.s_max);
        self.last_forecasts = Vec::new();
        if st.key.dense_rows.iter().all(|&d| d) {
            // no row selected anything (an offloaded all-dense step lists every block)
            self.last_selections = vec![vec![vec![Vec::new(); hk]; n]; nl];
            self.last_queries = vec![Vec::new(); nl];
            return Ok(());
        }
        let qkv = self.gpu.download(&st.ws.qkv.slice(0..nl * n * w))?;
        let sel = self
            .gpu
            .download(&st.ws.sel.slice(0..nl * n * hk * s_max))?;
        let nsel = self.gpu.download(&st.ws.nsel.slice(0..nl * n * hk))?;
        self.last_queries = (0..nl)
            .map(|l| {
                (0..n)
                    .map(|i| {
                        let o = (l * n + i) * w;
                        qkv[o..o + hq * dh].iter().map(|x| x.to_f32()).collect()
                    })
                    .collect()
            })
            .collect();
        if let Some((fut, cur)) = self.forecast_cols {
            // layer 0's own forecast sits in its own rows; layer l's in layer l−1's
            self.last_forecasts = (0..nl)
                .map(|l| {
                    (0..n)
                        .map(|i| {
                            let o = if l == 0 {
                                i * w + cur
                            } else {
                                ((l - 1) * n + i) * w + fut
                            };
                            qkv[o..o + hk * dh].iter().map(|x| x.to_f32()).collect()
                        })
                        .collect()
                })
                .collect();
        }
        self.last_selections = (0..nl)
            .map(|l| {
                (0..n)
                    .map(|i| {
                        (0..hk)
                            .map(|h| {
                                if st.key.dense_rows[i] {
                                    // a dense row attends to everything: no selection
                                    return Vec::new();
                                }
                                let r = (l * n + i) * hk + h;
                                let k = nsel[r].clamp(0, s_max as i32) as usize;
                                sel[r * s_max..r * s_max + k]
                                    .iter()
                                    .map(|&m| m.max(0) as usize)
                                    .collect()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Ok(())
    }
}

/// Width of a step's block lists (entries per row and KV head): the
/// attended budget S, or, when some row is dense (T < `dense_len`), every
/// block such a row can have while it stays dense within a capacity of
/// `cap` tokens (positions ≤ min(cap, dense_len − 1) − 1).
pub(crate) fn list_width(budget: &Budget, dense_len: usize, cap: usize, any_dense: bool) -> usize {
    let dense_blocks = if any_dense {
        let last_pos = cap.saturating_sub(1).min(dense_len.saturating_sub(2));
        budget.blocks(last_pos)
    } else {
        0
    };
    budget.attended.max(dense_blocks).max(1)
}

/// Device addresses of one layer's pointer tables (see [`PTRS_PER_ROW`],
/// [`PTRS_PER_SEQ`]): u64 arrays of n rows / ns sequences.
pub(crate) struct Tables {
    /// Per row: K cache, V cache, c (state, for the append), c (attention
    /// bias: 0 for dense rows and InfLLM-V2), Kc, p.
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) c_state: u64,
    pub(crate) c_attn: u64,
    pub(crate) kc: u64,
    pub(crate) p: u64,
    /// Per sequence: K, c, Kc, p (compression).
    pub(crate) seq_k: u64,
    pub(crate) seq_c: u64,
    pub(crate) seq_kc: u64,
    pub(crate) seq_p: u64,
}

impl Tables {
    /// The tables of a layer block starting at device address `base`.
    pub(crate) fn new(base: u64, n: usize, ns: usize) -> Self {
        let at = |i: usize| base + (i * 8) as u64;
        Tables {
            k: at(0),
            v: at(n),
            c_state: at(2 * n),
            c_attn: at(3 * n),
            kc: at(4 * n),
            p: at(5 * n),
            seq_k: at(6 * n),
            seq_c: at(6 * n + ns),
            seq_kc: at(6 * n + 2 * ns),
            seq_p: at(6 * n + 3 * ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn pointer_tables_are_laid_out_back_to_back() {
        let (n, ns) = (5usize, 3usize);
        let t = Tables::new(1000, n, ns);
        let got = [
            t.k, t.v, t.c_state, t.c_attn, t.kc, t.p, t.seq_k, t.seq_c, t.seq_kc, t.seq_p,
        ];
        let want: Vec<u64> = [0, n, 2 * n, 3 * n, 4 * n, 5 * n]
            .into_iter()
            .chain((0..PTRS_PER_SEQ).map(|j| PTRS_PER_ROW * n + j * ns))
            .map(|i| 1000 + 8 * i as u64)
            .collect();
        assert_eq!(got.to_vec(), want);
    }

    #[test]
    pub(crate) fn selection_path_follows_the_environment_variable() {
        // Only reads the variable; the default (unset or any other value) is the GPU path.
        let p = default_selection_path();
        match std::env::var("SPARDA_SELECTION").as_deref() {
            Ok("host") => assert_eq!(p, SelectionPath::HostFallback),
            _ => assert_eq!(p, SelectionPath::Gpu),
        }
    }

    #[test]
    pub(crate) fn decode_mode_follows_the_environment_variable() {
        let m = DecodeMode::from_env();
        match std::env::var("SPARDA_DECODE").as_deref() {
            Ok("eager") | Ok("forward") => assert_eq!(m, DecodeMode::Eager),
            _ => assert_eq!(m, DecodeMode::Graph),
        }
    }

    #[test]
    fn a_dense_row_lists_every_block_it_can_have_while_dense() {
        let sc = crate::config::SparseConfig::default();
        let budget = Budget::new(&sc);
        assert_eq!(budget.attended, 64);
        // no dense row: the budget
        assert_eq!(list_width(&budget, 8192, 100_000, false), 64);
        // dense_len 8192 (MiniCPM4-style): T ≤ 8191, position ≤ 8190, 128 blocks
        assert_eq!(list_width(&budget, 8192, 100_000, true), 128);
        assert_eq!(budget.blocks(8190), 128);
        // a smaller capacity bounds it: positions < 1000 → 16 blocks < S
        assert_eq!(list_width(&budget, 8192, 1000, true), 64);
        // offload's rule dense_len ≤ S·block_size keeps dense rows within S
        assert_eq!(list_width(&budget, 64 * 64, 100_000, true), 64);
        assert_eq!(list_width(&budget, 64 * 64 + 64, 100_000, true), 65);
    }

    #[test]
    pub(crate) fn step_keys_differ_when_a_sequence_moves_the_capacity_changes_or_a_row_crosses_dense_len(
    ) {
        let k = StepKey {
            seqs: vec![(1, 0), (2, 0)],
            sparse: true,
            dense_rows: vec![false, true],
            host_selection: false,
            cap: 4096,
            rope_rows: 8192,
            offload: false,
        };
        let mut crossed = k.clone();
        crossed.dense_rows[1] = false;
        assert_ne!(k, crossed, "a row crossing dense_len rebuilds the step");
        let mut grown = k.clone();
        grown.seqs[1].1 = 1;
        assert_ne!(k, grown);
        let mut cap = k.clone();
        cap.cap = 8192;
        assert_ne!(k, cap);
        assert_eq!(k, k.clone());
    }
}
