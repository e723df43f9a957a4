//! Offloaded KV for the decode engine (runtime.md §1–§4): the full
//! K/V of every offloaded layer lives in pinned, device-mapped host memory
//! in the block-major layout of [`crate::kv::HostLayout`]; the GPU keeps per
//! (sequence, offloaded layer)
//! - a tail ring of [`RING_BLOCKS`] blocks (token-major, token t at row
//!   t mod ring) that the append writes, the compression reads and the
//!   write-back copies from;
//! - a slot pool of S = the attended budget (plus the cache slots of
//!   [`OffloadOptions::cache_slots`]) slots per KV head,
//!   bf16 [Hkv, S, 2, block, D] (a slot's K tile then its V tile, so one
//!   (block, head) miss is one contiguous chunk on both sides);
//! - the slot map i32 [Hkv, S] (block id or −1), with cache slots followed
//!   by the slot ages i32 [Hkv, S] (least-recently-selected reuse);
//! - c, Kc and p in full (small; selection reads them, never offloaded).
//!
//! A decode step per offloaded layer: append into the ring → compression →
//! selection (unchanged) → `slot_diff` (hits keep their slot, misses take
//! freed slots, ring blocks need none; [`crate::kv::plan_slots`] is its
//! oracle) → fetch the misses (the persistent UVA copy kernel
//! `kv_fetch_sm` on N CTAs, or the copy engines through one
//! `cuMemcpyBatchAsync` per layer) → attention over slots and ring in the
//! selection's ascending block order, so the arithmetic is that of the
//! GPU-resident sparse step bit for bit. After the last layer, blocks that
//! the step completed are written back to host memory by `kv_store_blocks`
//! on a write-back stream (no host synchronisation, runtime.md §3 fault 5);
//! the compute stream waits for it at the start of the next step, long
//! before the ring slot or the host copy is needed again.
//!
//! Prefill is the GPU-resident one (same code path, so the decode state is
//! bitwise that of the resident engine) on one sequence at a time: after
//! [`GpuModel::begin_offload`] each prefill chunk writes the blocks it
//! completes to the pinned store layer by layer, on a write-back stream,
//! while the next layers compute; [`GpuModel::offload_sequence`] then
//! writes what is left, keeps the last blocks in the ring and frees the
//! full cache, so GPU memory during a batch's prefill is bounded by one
//! sequence, not by the batch.

use super::fetch_table::{auto_engine, auto_whole_sms, FetchMode, FetchTable, ENV_TABLE};
use super::{Footprint, RING_BLOCKS};
use crate::cuda::context::{dptr, i32_dim, CudaResultExt};
use crate::cuda::{Bf16, Gpu};
use crate::pipeline::*;
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use std::sync::Arc;

/// Offload settings of a model (`--kv offload`, runtime.md §1, §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadOptions {
    /// Fetch engine.
    pub fetch: FetchEngine,
    /// Offload layer 0 too (default: resident, runtime.md §2 decision).
    pub offload_layer0: bool,
    /// Cache slots: GPU slots per (sequence, offloaded layer, KV head)
    /// beyond the attended budget S (`--cache-slots`, default 0). Blocks
    /// that leave the selection stay in them, least recently selected
    /// reused first ([`crate::kv::plan_slots_lru`]), so a block selected
    /// again soon is a hit instead of a fetch; each slot costs
    /// 2 · block_size · head_dim · 2 bytes per (sequence, layer, KV head).
    pub cache_slots: usize,
}

impl Default for OffloadOptions {
    fn default() -> Self {
        OffloadOptions {
            fetch: FetchEngine::Sm { ctas: 16 },
            offload_layer0: false,
            cache_slots: 0,
        }
    }
}

/// Offload counters since the last [`GpuModel::reset_offload_stats`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OffloadStats {
    /// Per layer: selected blocks (summed over steps, rows and KV heads);
    /// 0 for resident layers.
    pub selected: Vec<u64>,
    /// Per layer: blocks fetched from host memory.
    pub fetched: Vec<u64>,
    /// Bytes of one fetched (block, head) chunk (K and V tiles).
    pub chunk_bytes: usize,
    /// Fetch time measured by CUDA events around each fetch, ms (only
    /// while fetch timing is on, see [`GpuModel::set_fetch_timing`]).
    pub fetch_ms: f64,
    /// Bytes fetched while fetch timing was on.
    pub timed_bytes: u64,
    /// Decode steps counted.
    pub steps: u64,
}

impl OffloadStats {
    /// Locality γ per layer: 1 − fetched / selected (None for resident layers).
    pub fn locality(&self) -> Vec<Option<f64>> {
        self.selected
            .iter()
            .zip(&self.fetched)
            .map(|(&s, &f)| (s > 0).then(|| 1.0 - f as f64 / s as f64))
            .collect()
    }
    /// γ over all offloaded layers.
    pub fn locality_all(&self) -> f64 {
        let s: u64 = self.selected.iter().sum();
        let f: u64 = self.fetched.iter().sum();
        if s == 0 {
            1.0
        } else {
            1.0 - f as f64 / s as f64
        }
    }
    /// Bytes fetched in all.
    pub fn bytes_fetched(&self) -> u64 {
        self.fetched.iter().sum::<u64>() * self.chunk_bytes as u64
    }
    /// Achieved fetch bandwidth while timed, GB/s (0 when nothing was timed).
    pub fn fetch_gb_s(&self) -> f64 {
        if self.fetch_ms > 0.0 {
            self.timed_bytes as f64 / (self.fetch_ms * 1e6)
        } else {
            0.0
        }
    }
}

/// One offloaded layer of one sequence.
pub(crate) struct OffloadLayer {
    /// bf16 [Hkv, S, 2, block, D].
    pub(crate) pool: CudaSlice<Bf16>,
    /// i32 [Hkv, S]: block id or −1; with cache slots followed by the
    /// slot ages i32 [Hkv, S] (`slot_diff`'s `aged`).
    pub(crate) slots: CudaSlice<i32>,
    /// Device-visible address of block 0 of this (sequence, layer) in the
    /// pinned store.
    pub(crate) host: u64,
}

/// The offload state of one sequence.
pub(crate) struct SeqOffload {
    /// The pinned store (kept alive while the sequence is).
    pub(crate) _store: crate::kv::host_store::PinnedKv,
    /// Capacity of the store, blocks per layer.
    pub(crate) blocks: usize,
    /// Per layer; None for resident layers.
    pub(crate) layers: Vec<Option<OffloadLayer>>,
    /// Cache slots of its pools when it was offloaded (S = the budget plus
    /// these; with any, its slot maps carry ages): a step with other
    /// settings refuses it.
    pub(crate) cache_slots: usize,
}

impl SeqOffload {
    /// Tokens the host store holds.
    pub(crate) fn capacity_tokens(&self, block_size: usize) -> usize {
        self.blocks * block_size
    }
    /// Whether layer `l` is offloaded (else resident: full K/V on the GPU).
    pub(crate) fn offloaded(&self, l: usize) -> bool {
        self.layers.get(l).is_some_and(Option::is_some)
    }
}

impl Drop for SeqOffload {
    /// The last write-back of a step may still read this sequence's ring
    /// and write its store (the next step would wait for it): wait for all
    /// work before the store and the ring are freed.
    fn drop(&mut self) {
        if let Err(e) = self._store.synchronize_context() {
            tracing::warn!("synchronising before freeing an offloaded sequence failed: {e}");
        }
    }
}

/// A sequence being prefilled for offload ([`GpuModel::begin_offload`]).
pub(crate) struct Spill {
    /// The store (taken by offload_sequence).
    pub(crate) store: Option<crate::kv::host_store::PinnedKv>,
    /// Capacity of the store, blocks per layer.
    pub(crate) blocks: usize,
    /// Blocks already written to the store (every offloaded layer).
    pub(crate) done: usize,
    /// First offloaded layer when the store was sized.
    pub(crate) first: usize,
    /// The stream the spills run on.
    pub(crate) wb: Arc<CudaStream>,
}

impl Drop for Spill {
    /// The store and the K/V buffers its spills read must outlive them.
    fn drop(&mut self) {
        if let Err(e) = self.wb.synchronize() {
            tracing::warn!("waiting for the prefill spills failed: {e}");
        }
    }
}

impl Spill {
    /// Marks the blocks completed at `new_len` tokens as written.
    pub(crate) fn advance(&mut self, new_len: usize, block_size: usize) {
        self.done = self.done.max((new_len / block_size).min(self.blocks));
    }
}

/// Per-step buffers of an offloaded batch.
pub(crate) struct StepOffload {
    /// Pool slots per (sequence, layer, KV head).
    pub(crate) slots: usize,
    /// Tokens of a tail ring.
    pub(crate) ring: usize,
    /// Per layer: offloaded.
    pub(crate) offloaded: Vec<bool>,
    /// u64 [L][3][n]: pool, slot map, host base per row.
    pub(crate) tabs: CudaSlice<u64>,
    /// The same tables on the host (the copy-engine fetch reads them).
    pub(crate) tabs_host: Vec<u64>,
    /// i32 [L, n, Hkv, s_max]: slot of each list entry (−1 ring).
    pub(crate) slot_list: CudaSlice<i32>,
    /// i32 [L, n, Hkv, S, 2]: (slot, block) misses.
    pub(crate) fetch: CudaSlice<i32>,
    /// i32 [L, n, Hkv]: misses per (row, head).
    pub(crate) nfetch: CudaSlice<i32>,
    /// i32 [n]: the lengths the write-back reads (copied before the step ends).
    pub(crate) wb_lens: CudaSlice<i32>,
    /// The write-back stream and its last event (the next step waits on it).
    pub(crate) wb_stream: Arc<CudaStream>,
    pub(crate) wb_done: Option<CudaEvent>,
    /// Fetch timing events, one pair per layer.
    pub(crate) timing: Vec<(CudaEvent, CudaEvent)>,
    /// Some row completes a block in the step being enqueued (set by the host).
    pub(crate) completes: bool,
    /// The copy (prefetch) stream and, per layer, its ready / fetched events
    /// (forecast mode with prefetch; runtime.md §2).
    pub(crate) copy_stream: Arc<CudaStream>,
    pub(crate) ready: Vec<CudaEvent>,
    pub(crate) fetched: Vec<CudaEvent>,
    /// The split fetch's side stream, events and counts, made the first
    /// time a layer of this step is fetched by [`FetchEngine::Split`].
    pub(crate) split: Option<SplitSide>,
}

/// What the split fetch ([`FetchEngine::Split`]) adds to a step: the side
/// stream the copy engines' share runs on, per layer the fork / join events
/// that order it against the fetch stream, and per layer the SM kernel's
/// counts (one region per layer, so that a layer's upload never overwrites
/// counts an earlier layer's kernel has yet to read).
pub(crate) struct SplitSide {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) fork: Vec<CudaEvent>,
    pub(crate) join: Vec<CudaEvent>,
    /// i32 [L, n, Hkv].
    pub(crate) sm_counts: CudaSlice<i32>,
}

impl SplitSide {
    /// A side stream, 2·`layers` events and `layers`·`lists` counts.
    ///
    /// Errors: [`Error::Cuda`] when a stream, an event or the buffer
    /// cannot be made.
    pub(crate) fn new(gpu: &Gpu, layers: usize, lists: usize) -> Result<SplitSide> {
        Ok(SplitSide {
            stream: gpu
                .context()
                .new_stream()
                .cuda("cuStreamCreate (split fetch)")?,
            fork: sync_events(gpu, layers, "cuEventCreate (split fork)")?,
            join: sync_events(gpu, layers, "cuEventCreate (split join)")?,
            sm_counts: gpu.zeros((layers * lists).max(1))?,
        })
    }
}

impl Drop for StepOffload {
    /// A step rebuilt (growth, another batch) must not leave a write-back
    /// in flight that a later step could race with: wait for it here.
    fn drop(&mut self) {
        if let Some(ev) = self.wb_done.take() {
            if let Err(e) = ev.synchronize() {
                tracing::warn!("waiting for the last KV write-back failed: {e}");
            }
        }
    }
}

impl StepOffload {
    /// The per-(layer, row, KV head) fetch counts of the last step, i32
    /// [L, n, Hkv] on the device.
    pub(crate) fn nfetch_buffer(&self) -> &CudaSlice<i32> {
        &self.nfetch
    }

    /// Whether layer `l` is offloaded.
    pub(crate) fn offloaded(&self, l: usize) -> bool {
        self.offloaded[l]
    }

    /// Ring tokens of layer `l` (0 when it is resident).
    pub(crate) fn ring_of(&self, l: usize) -> usize {
        if self.offloaded[l] {
            self.ring
        } else {
            0
        }
    }
}

/// The copy (prefetch) stream: created with the context's greatest stream
/// priority, so that the fetch kernel's CTAs are scheduled as soon as SMs
/// free up instead of queueing behind the compute stream's GEMM tiles
/// (`SPARDA_COPY_PRIORITY=0` gives it the default priority, for comparison).
/// Priority changes timing only, never results. Measured on the H200
/// (benches/results/copy_stream_priority_*): no difference with the
/// persistent 16-CTA fetch kernel (14.53 vs 14.44 ms/step at 64K, B = 16).
pub(crate) fn copy_stream(gpu: &Gpu) -> Result<Arc<CudaStream>> {
    let high = std::env::var("SPARDA_COPY_PRIORITY").map_or(true, |v| v != "0");
    if !high {
        return gpu.context().new_stream().cuda("cuStreamCreate (copy)");
    }
    gpu.context()
        .bind_to_thread()
        .cuda("binding the context (copy stream)")?;
    let (_least, greatest) =
        cudarc::driver::result::stream::get_priority_range().cuda("cuCtxGetStreamPriorityRange")?;
    gpu.context()
        .new_stream_with_priority(greatest)
        .cuda("cuStreamCreateWithPriority (copy)")
}

/// `n` events without timing, for ordering streams (one per layer).
pub(crate) fn sync_events(gpu: &Gpu, n: usize, what: &str) -> Result<Vec<CudaEvent>> {
    (0..n)
        .map(|_| {
            gpu.context()
                .new_event(Some(
                    cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                ))
                .cuda(what)
        })
        .collect()
}

/// Whether an offloaded decode step may be captured and replayed as a
/// CUDA graph: its fetch runs on the device alone (the SM copy kernel;
/// the copy engines, alone or in a split, take the fetch lists to the host
/// first) and fetch timing is off (it reads events back every step). The
/// prefetch's copy-stream work joins the capture through the ready and
/// fetched events, a write-back through its done event (runtime.md §2).
pub(crate) fn offloaded_step_graphable(engine: FetchEngine, fetch_timing: bool) -> bool {
    matches!(engine, FetchEngine::Sm { .. }) && !fetch_timing
}

/// Tokens a tail ring holds.
pub(crate) fn ring_tokens(block_size: usize) -> usize {
    RING_BLOCKS * block_size
}

impl GpuModel {
    /// Turns offloaded decode on (`Some`) or off for sequences offloaded
    /// from now on ([`GpuModel::offload_sequence`]).
    ///
    /// Errors: [`Error::Input`] unless the plan is sparse with GPU
    /// selection (offload keeps only the selected blocks on the GPU), an
    /// SM fetch with 0 or more than 1024 CTAs, or a split fetch with such a
    /// CTA count or a copy-engine share outside 1 … 99 %; [`Error::Config`] for a dense
    /// phase that does not fit the slot pool (dense_len > S·block_size,
    /// spec §1; dense rows then attend to every block through the pool).
    pub fn set_offload(&mut self, opts: Option<OffloadOptions>) -> Result<()> {
        if let Some(o) = &opts {
            if !self.sparse_plan() || self.selection != SelectionPath::Gpu {
                return Err(Error::Input(
                    "--kv offload needs sparse attention with GPU selection (the model runs dense: add --attention sparse)".into(),
                ));
            }
            // spec §1: the dense phase (T < dense_len) must fit the slot pool
            self.plan.sparse.validate_offload(std::path::Path::new(
                "config.json (with --budget-blocks / --dense-len applied)",
            ))?;
            let b = &self.plan.budget;
            if b.attended + o.cache_slots > crate::cuda::ops::offload::SLOT_DIFF_MAX_SLOTS {
                return Err(Error::Input(format!(
                    "--kv offload: {} attended blocks + {} cache slots (--cache-slots) exceed the slot pool limit {}",
                    b.attended,
                    o.cache_slots,
                    crate::cuda::ops::offload::SLOT_DIFF_MAX_SLOTS
                )));
            }
            if b.kernel_size > b.block_size {
                return Err(Error::Input(format!(
                    "--kv offload: kernel_size {} > block_size {}: the compression window would reach past the {}-block tail ring",
                    b.kernel_size, b.block_size, RING_BLOCKS
                )));
            }
            match o.fetch {
                FetchEngine::Sm { ctas } if ctas == 0 || ctas > 1024 => {
                    return Err(Error::Input(format!(
                        "--prefetch-ctas {ctas}: give 1 … 1024 CTAs"
                    )));
                }
                FetchEngine::Split { .. } => o.fetch.validate()?,
                _ => {}
            }
        }
        if opts.is_some_and(|o| o.fetch == FetchEngine::Auto) && self.fetch_table.is_none() {
            let name = &self.gpu.info().name;
            let env = std::env::var_os(ENV_TABLE).map(std::path::PathBuf::from);
            match FetchTable::for_gpu(name, env.as_deref())? {
                Some((t, _)) => self.fetch_table = Some(Arc::new(t)),
                None => {
                    static SHOWN: std::sync::atomic::AtomicBool =
                        std::sync::atomic::AtomicBool::new(false);
                    if !SHOWN.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        eprintln!(
                            "note: no fetch table for the {name}: fetching by SparDA's rule (SM kernel, 16 or 32 CTAs); `sparda tune-ctas` measures one for this GPU"
                        );
                    }
                }
            }
        }
        self.offload = opts;
        self.step = None;
        Ok(())
    }

    /// The fetch engine for a batch of `batch` rows: the configured one, or
    /// for [`FetchEngine::Auto`] the fetch table's choice for this GPU, the
    /// batch and the schedule (forecast prefetch, else the synchronous
    /// fetch; [`crate::kv::fetch_table`]), or SparDA's rule ([`fetch_rule`])
    /// when the GPU has no table.
    pub fn fetch_engine(&self, batch: usize) -> FetchEngine {
        match self.offload.map_or(FetchEngine::Auto, |o| o.fetch) {
            FetchEngine::Auto => auto_engine(
                self.fetch_table.as_deref(),
                &self.gpu.info().name,
                self.fetch_mode(),
                batch,
            ),
            e => e,
        }
    }

    /// Whether the fetch table's choice for a batch of `batch` rows puts the
    /// SM copy kernel's CTAs on whole SMs
    /// ([`crate::kv::fetch_table::FetchChoice::SmWhole`]; the GEMMs keep
    /// every SM): only with [`FetchEngine::Auto`] and a table for this GPU.
    /// The flag [`GpuModel::set_fetch_whole_sms`] turns the same on for any
    /// engine.
    pub fn fetch_table_whole_sms(&self, batch: usize) -> bool {
        self.offload.is_some_and(|o| o.fetch == FetchEngine::Auto)
            && auto_whole_sms(self.fetch_table.as_deref(), self.fetch_mode(), batch)
    }

    /// The schedule the fetch table is read for: forecast prefetch, else the
    /// synchronous fetch.
    fn fetch_mode(&self) -> FetchMode {
        if self.forecast_on() && self.prefetch_on() {
            FetchMode::Prefetch
        } else {
            FetchMode::Sync
        }
    }

    /// Where the fetch table in use came from (`None` without offload or
    /// with an explicit `--fetch`): for reports.
    pub fn fetch_table(&self) -> Option<&FetchTable> {
        self.fetch_table.as_deref()
    }

    /// The offload settings in force.
    pub fn offload_options(&self) -> Option<OffloadOptions> {
        self.offload
    }

    /// Slots per (sequence, offloaded layer, KV head): the attended budget
    /// plus the cache slots ([`OffloadOptions::cache_slots`]).
    pub fn pool_slots(&self) -> usize {
        self.plan.budget.attended.max(1) + self.cache_slots()
    }

    /// Cache slots beyond the budget (0 without offload).
    pub(crate) fn cache_slots(&self) -> usize {
        self.offload.map_or(0, |o| o.cache_slots)
    }

    /// First offloaded layer (0 with `--offload-layer0`, else 1).
    pub(crate) fn first_offloaded(&self) -> usize {
        match self.offload {
            Some(o) if o.offload_layer0 => 0,
            _ => 1,
        }
        .min(self.layers.len())
    }

    /// Host and GPU KV bytes of `batch` offloaded sequences of up to
    /// `capacity_tokens` tokens (runtime.md §4), for refusing a request
    /// before anything is allocated.
    pub fn offload_footprint(&self, batch: usize, capacity_tokens: usize) -> Footprint {
        Footprint::new(
            &self.config,
            self.pool_slots(),
            self.first_offloaded(),
            batch,
            capacity_tokens,
        )
    }

    /// Moves a prefilled GPU-resident sequence's KV to pinned host memory
    /// (runtime.md §1): every completed block of each offloaded layer is
    /// copied to a new block-major store with room for `capacity_tokens`
    /// tokens (prompt + new tokens), the last [`RING_BLOCKS`] blocks go to
    /// the layer's tail ring, the slot pool starts empty, and the full
    /// K/V caches are freed. c, Kc and p stay on the GPU as they are.
    ///
    /// Errors: [`Error::Input`] without [`GpuModel::set_offload`], for an
    /// empty or already offloaded sequence, or a capacity below its length;
    /// [`Error::Limit`] when the pinned store or the pools do not fit (the
    /// numbers are in the message); [`Error::Cuda`] on a device failure.
    pub fn offload_sequence(
        &mut self,
        seq: &mut GpuSequence,
        capacity_tokens: usize,
    ) -> Result<()> {
        if self.offload.is_none() {
            return Err(Error::Input(
                "offload_sequence: offload is off (set_offload)".into(),
            ));
        }
        if seq.off.is_some() || seq.len == 0 || seq.mirror.is_some() {
            return Err(Error::Input(format!(
                "offload_sequence: needs a prefilled, GPU-resident sequence on the GPU selection path (it has {} tokens{})",
                seq.len,
                if seq.off.is_some() { ", already offloaded" } else { "" }
            )));
        }
        if capacity_tokens < seq.len + 1 {
            return Err(Error::Input(format!(
                "offload_sequence: capacity {capacity_tokens} tokens leaves no room past the {} stored",
                seq.len
            )));
        }
        let c = &self.config;
        let (hk, dh) = (c.num_key_value_heads, c.head_dim);
        let kvd = hk * dh;
        let bs = self.plan.budget.block_size;
        let s_slots = self.pool_slots();
        let first = self.first_offloaded();
        let nl = self.layers.len();
        let blocks = capacity_tokens.div_ceil(bs);
        let block_bytes = hk * 2 * bs * dh * 2;
        // The store: made by begin_offload before the prefill (which then
        // wrote each chunk's completed blocks layer by layer), or now.
        if let Some(sp) = seq.spill.as_ref() {
            if sp.blocks < blocks || sp.first != first {
                return Err(Error::Input(format!(
                    "offload_sequence: begin_offload reserved {} tokens from layer {}; asked for {capacity_tokens} tokens from layer {first} (offload settings changed in between?)",
                    sp.blocks * bs,
                    sp.first
                )));
            }
        }
        let (store, blocks, spilled) = match seq.spill.take() {
            Some(mut sp) => {
                self.gpu
                    .stream()
                    .wait(&sp.wb.record_event(None).cuda("cuEventRecord (spill)")?)
                    .cuda("cuStreamWaitEvent (spill)")?;
                let Some(store) = sp.store.take() else {
                    return Err(Error::Input(
                        "offload_sequence: the prepared store is gone".into(),
                    ));
                };
                (store, sp.blocks, sp.done)
            }
            None => (self.new_store(capacity_tokens)?, blocks, 0),
        };
        let gpu = self.gpu.clone();
        let s = gpu.stream().clone();
        let ring = ring_tokens(bs);
        let t = seq.len;
        let full = t / bs;
        // Spill the completed blocks of every offloaded layer in one launch
        // (rows = layers).
        let n_off = nl - first;
        if n_off > 0 && full > spilled {
            let mut kt = Vec::with_capacity(n_off);
            let mut vt = Vec::with_capacity(n_off);
            let mut ht = Vec::with_capacity(n_off);
            for l in first..nl {
                kt.push(dptr(&gpu, &seq.layers[l].k));
                vt.push(dptr(&gpu, &seq.layers[l].v));
                ht.push(store.device_ptr() + ((l - first) * blocks * block_bytes) as u64);
            }
            let lo = vec![i32_dim(spilled, "blocks")?; n_off];
            let hi = vec![i32_dim(full, "blocks")?; n_off];
            let (kt, vt, ht) = (gpu.upload(&kt)?, gpu.upload(&vt)?, gpu.upload(&ht)?);
            let (lo, hi) = (gpu.upload(&lo)?, gpu.upload(&hi)?);
            self.launch_store_blocks(
                &s,
                dptr(&gpu, &kt),
                dptr(&gpu, &vt),
                dptr(&gpu, &ht),
                0,
                dptr(&gpu, &lo),
                dptr(&gpu, &hi),
                n_off,
                0,
                (full - spilled) * hk * 2,
            )?;
            gpu.synchronize()?;
        }
        let mut layers = Vec::with_capacity(nl);
        for l in 0..nl {
            if l < first {
                layers.push(None);
                continue;
            }
            let sl = &mut seq.layers[l];
            // The ring: tokens [64·max(T/64 − 1, 0), T) at rows t mod ring.
            let what = format!("allocating layer {l}'s tail ring of {ring} tokens × {kvd} bf16");
            let mut rk: CudaSlice<Bf16> = s.alloc_zeros(ring * kvd).cuda(&what)?;
            let mut rv: CudaSlice<Bf16> = s.alloc_zeros(ring * kvd).cuda(&what)?;
            let a = (t / bs).saturating_sub(RING_BLOCKS - 1) * bs;
            let mut tok = a;
            while tok < t {
                let row = tok % ring;
                let n = (ring - row).min(t - tok);
                for (src, dst) in [(&sl.k, &mut rk), (&sl.v, &mut rv)] {
                    s.memcpy_dtod(
                        &src.slice(tok * kvd..(tok + n) * kvd),
                        &mut dst.slice_mut(row * kvd..(row + n) * kvd),
                    )
                    .cuda("filling a tail ring")?;
                }
                tok += n;
            }
            sl.k = rk;
            sl.v = rv;
            let pool = s.alloc_zeros(hk * s_slots * 2 * bs * dh).cuda(&format!(
                "allocating layer {l}'s slot pool of {hk} KV heads × {s_slots} slots × {bs} tokens (K and V, D = {dh})"
            ))?;
            // the slot map (every slot empty), then, with cache slots, the
            // slot ages slot_diff keeps for least-recently-selected reuse
            let mut map = vec![-1i32; hk * s_slots];
            if self.cache_slots() > 0 {
                map.resize(2 * hk * s_slots, 0);
            }
            let slots = gpu.upload(&map)?;
            layers.push(Some(OffloadLayer {
                pool,
                slots,
                host: store.device_ptr() + ((l - first) * blocks * block_bytes) as u64,
            }));
        }
        gpu.synchronize()?;
        seq.off = Some(SeqOffload {
            _store: store,
            blocks,
            layers,
            cache_slots: self.cache_slots(),
        });
        seq.generation += 1;
        self.step = None;
        Ok(())
    }

    /// A pinned store for one sequence of up to `capacity_tokens` tokens
    /// (every offloaded layer), after checking the host has room.
    ///
    /// Errors: [`Error::Limit`] with the bytes needed and available.
    pub(crate) fn new_store(
        &self,
        capacity_tokens: usize,
    ) -> Result<crate::kv::host_store::PinnedKv> {
        let c = &self.config;
        let bs = self.plan.budget.block_size;
        let blocks = capacity_tokens.div_ceil(bs);
        let block_bytes = c.num_key_value_heads * 2 * bs * c.head_dim * 2;
        let host_bytes = (self.layers.len() - self.first_offloaded()) * blocks * block_bytes;
        let host_avail = crate::kv::host_store::host_available_bytes()?;
        if host_bytes > host_avail {
            return Err(Error::Limit(format!(
                "offloading a sequence of up to {capacity_tokens} tokens needs {:.2} GiB of pinned host memory, {:.2} GiB available",
                host_bytes as f64 / (1u64 << 30) as f64,
                host_avail as f64 / (1u64 << 30) as f64
            )));
        }
        crate::kv::host_store::PinnedKv::with_pages(
            &self.gpu,
            host_bytes.max(1),
            crate::kv::host_store::HostPages::from_env()?,
        )
    }

    /// Prepares `seq` (empty or partly prefilled, GPU-resident) to be
    /// offloaded with room for `capacity_tokens` tokens: allocates its
    /// pinned store now, so that [`GpuModel::prefill`] writes each chunk's
    /// completed blocks to host memory layer by layer, on a write-back
    /// stream, while the next layers compute (runtime.md §3 fault 5);
    /// [`GpuModel::offload_sequence`] then only moves the tail to the ring.
    ///
    /// Errors: offload off, a sequence already offloaded or already
    /// prepared; host memory as [`GpuModel::offload_sequence`].
    pub fn begin_offload(&mut self, seq: &mut GpuSequence, capacity_tokens: usize) -> Result<()> {
        if self.offload.is_none() || seq.off.is_some() || seq.spill.is_some() {
            return Err(Error::Input(
                "begin_offload: needs offload on (set_offload) and a GPU-resident sequence not yet prepared".into(),
            ));
        }
        let bs = self.plan.budget.block_size;
        let store = self.new_store(capacity_tokens)?;
        let wb = self
            .gpu
            .context()
            .new_stream()
            .cuda("cuStreamCreate (prefill write-back)")?;
        seq.spill = Some(Spill {
            store: Some(store),
            blocks: capacity_tokens.div_ceil(bs),
            // blocks completed before this call go with the next chunk's range
            done: 0,
            first: self.first_offloaded(),
            wb,
        });
        Ok(())
    }
}

/// The SMs a forecast-prefetch step's cuBLAS GEMMs are sized for
/// (`cublasSetSmCountTarget`), or `None` for all of them: `Some(sm_count −
/// ctas)` only when `reserve` (`--reserve-fetch-sms`) is on, the step
/// prefetches, and its fetch runs the SM copy kernel (alone or in a split)
/// on `ctas` CTAs that take at most half of the `sm_count` SMs.
///
/// Where the copy CTAs run (whole SMs, from the flag or the fetch table)
/// is not an input: GEMMs sized for fewer SMs run other cuBLAS kernels,
/// whose logits differ from GPU-resident decode in their last bits
/// (measured on NOSA-8B at B 8 from step 8), so only the explicit flag may
/// ask for them.
pub(crate) fn gemm_sm_target_rule(
    reserve: bool,
    prefetching: bool,
    engine: FetchEngine,
    sm_count: usize,
) -> Option<usize> {
    if !(reserve && prefetching) {
        return None;
    }
    match engine {
        FetchEngine::Sm { ctas } | FetchEngine::Split { ctas, .. } => {
            sms_left_by_copy(ctas, sm_count)
        }
        _ => None,
    }
}

/// The SMs a copy kernel on `ctas` CTAs (one SM each) leaves to compute of
/// `sm_count`, when it takes at most half of them (else `None`: so many copy
/// CTAs share SMs as usual, and the GEMMs keep every SM).
pub(crate) fn sms_left_by_copy(ctas: usize, sm_count: usize) -> Option<usize> {
    (2 * ctas <= sm_count).then(|| sm_count - ctas)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn locality_is_one_minus_fetched_over_selected_per_offloaded_layer() {
        let st = OffloadStats {
            selected: vec![0, 200, 100],
            fetched: vec![0, 50, 0],
            chunk_bytes: 32 << 10,
            fetch_ms: 2.0,
            timed_bytes: 100_000_000,
            steps: 4,
        };
        assert_eq!(st.locality(), vec![None, Some(0.75), Some(1.0)]);
        assert!((st.locality_all() - (1.0 - 50.0 / 300.0)).abs() < 1e-12);
        assert_eq!(st.bytes_fetched(), 50 * (32 << 10));
        // 1e8 bytes in 2 ms = 50 GB/s
        assert!((st.fetch_gb_s() - 50.0).abs() < 1e-9);
        assert_eq!(OffloadStats::default().fetch_gb_s(), 0.0);
        assert_eq!(OffloadStats::default().locality_all(), 1.0);
    }

    #[test]
    fn gemms_keep_every_sm_unless_the_reserve_flag_asks() {
        let sm8 = FetchEngine::Sm { ctas: 8 };
        // the default (also when the table puts the copy CTAs on whole SMs): every SM,
        // the GEMM kernels of GPU-resident decode (the soak that found it: B 8, step 8)
        assert_eq!(gemm_sm_target_rule(false, true, sm8, 132), None);
        // --reserve-fetch-sms while prefetching through the SM kernel: the SMs left
        assert_eq!(gemm_sm_target_rule(true, true, sm8, 132), Some(124));
        let split = FetchEngine::Split {
            ctas: 16,
            ce_pct: 50,
        };
        assert_eq!(gemm_sm_target_rule(true, true, split, 132), Some(116));
        // not prefetching, the copy engines, or copy CTAs on more than half the SMs: every SM
        assert_eq!(gemm_sm_target_rule(true, false, sm8, 132), None);
        assert_eq!(gemm_sm_target_rule(true, true, FetchEngine::Dma, 132), None);
        assert_eq!(
            gemm_sm_target_rule(true, true, FetchEngine::Sm { ctas: 66 }, 132),
            Some(66)
        );
        assert_eq!(
            gemm_sm_target_rule(true, true, FetchEngine::Sm { ctas: 67 }, 132),
            None
        );
    }

    #[test]
    pub(crate) fn only_steps_whose_fetch_the_device_runs_alone_replay_a_graph() {
        for ctas in [1, 8, 1024] {
            assert!(offloaded_step_graphable(FetchEngine::Sm { ctas }, false));
            assert!(
                !offloaded_step_graphable(FetchEngine::Sm { ctas }, true),
                "fetch timing"
            );
        }
        assert!(!offloaded_step_graphable(FetchEngine::Dma, false));
        let split = FetchEngine::Split {
            ctas: 8,
            ce_pct: 50,
        };
        assert!(!offloaded_step_graphable(split, false));
    }

    #[test]
    pub(crate) fn the_ring_holds_the_current_and_previous_block() {
        assert_eq!(ring_tokens(64), 128);
        assert_eq!(FetchEngine::Sm { ctas: 16 }.name(), "sm");
        assert_eq!(FetchEngine::Dma.name(), "dma");
        assert_eq!(
            OffloadOptions::default().fetch,
            FetchEngine::Sm { ctas: 16 }
        );
        assert!(!OffloadOptions::default().offload_layer0);
    }

    #[test]
    pub(crate) fn the_default_fetch_rule_follows_sparda_per_gpu_and_batch() {
        assert_eq!(fetch_rule("NVIDIA H200", 1), FetchEngine::Sm { ctas: 16 });
        assert_eq!(fetch_rule("NVIDIA H200", 64), FetchEngine::Sm { ctas: 16 });
        assert_eq!(
            fetch_rule("NVIDIA H100 80GB HBM3", 16),
            FetchEngine::Sm { ctas: 16 }
        );
        assert_eq!(
            fetch_rule("NVIDIA H100 80GB HBM3", 17),
            FetchEngine::Sm { ctas: 32 }
        );
        assert_eq!(
            fetch_rule("NVIDIA A100-SXM4-80GB", 32),
            FetchEngine::Sm { ctas: 16 }
        );
        assert_eq!(
            fetch_rule("NVIDIA A100-SXM4-80GB", 33),
            FetchEngine::Sm { ctas: 32 }
        );
    }
}
