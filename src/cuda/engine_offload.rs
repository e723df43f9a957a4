//! Offloaded KV for the decode engine (issue 4; runtime.md §1–§4): the full
//! K/V of every offloaded layer lives in pinned, device-mapped host memory
//! in the block-major layout of [`crate::kv::HostLayout`]; the GPU keeps per
//! (sequence, offloaded layer)
//! - a tail ring of [`RING_BLOCKS`] blocks (token-major, token t at row
//!   t mod ring) that the append writes, the compression reads and the
//!   write-back copies from;
//! - a slot pool of S = the attended budget slots per KV head,
//!   bf16 [Hkv, S, 2, block, D] (a slot's K tile then its V tile, so one
//!   (block, head) miss is one contiguous chunk on both sides);
//! - the slot map i32 [Hkv, S] (block id or −1);
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

use super::*;
use crate::kv::{Footprint, RING_BLOCKS};
use cudarc::driver::{CudaEvent, CudaStream};

/// How misses are fetched from host memory (runtime.md §4; `--fetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchEngine {
    /// The persistent UVA copy kernel on a fixed grid of `ctas` CTAs
    /// (`--fetch sm --prefetch-ctas N`).
    Sm {
        /// CTAs of the copy kernel (SparDA's default for the H200: 16).
        ctas: usize,
    },
    /// The copy engines: one `cuMemcpyBatchAsync` per layer per step over
    /// the misses (32 KiB chunks at D = 128). The host reads each layer's
    /// fetch lists first, so this engine synchronises once per layer.
    Dma,
    /// Chosen per batch size and GPU by [`fetch_rule`] (the default).
    Auto,
}

/// The default fetch engine for `batch` sequences on the GPU named
/// `gpu_name` (runtime.md §2, §4; issue 5 item 5), used by
/// [`FetchEngine::Auto`] until a tuning table exists:
/// - the SM copy kernel everywhere: on the H200 (2026-11-30,
///   benches/results/issue4_offload_*.json) it moved 49.5–50.8 GB/s on 16
///   CTAs at B = 16–64 against 19.5–24.3 GB/s for the copy engines (32 KiB
///   chunks, one host sync per layer for the fetch list);
/// - its CTA count as SparDA's authors set it: H100 16 for B ≤ 16 else 32,
///   A100 16 for B ≤ 32 else 32, every other GPU (the H200 included) 16 —
///   on the H200 8–32 CTAs all reach 51 GB/s alone (gpu-check), so more
///   CTAs would only take SMs from the compute stream.
pub fn fetch_rule(gpu_name: &str, batch: usize) -> FetchEngine {
    let name = gpu_name.to_ascii_uppercase();
    let ctas = if name.contains("H100") {
        if batch <= 16 {
            16
        } else {
            32
        }
    } else if name.contains("A100") {
        if batch <= 32 {
            16
        } else {
            32
        }
    } else {
        16
    };
    FetchEngine::Sm { ctas }
}

impl FetchEngine {
    /// Name used in reports: `sm` or `dma`.
    pub fn name(&self) -> &'static str {
        match self {
            FetchEngine::Sm { .. } => "sm",
            FetchEngine::Dma => "dma",
            FetchEngine::Auto => "auto",
        }
    }
}

/// Offload settings of a model (`--kv offload`, runtime.md §1, §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadOptions {
    /// Fetch engine.
    pub fetch: FetchEngine,
    /// Offload layer 0 too (default: resident, runtime.md §2 decision).
    pub offload_layer0: bool,
}

impl Default for OffloadOptions {
    fn default() -> Self {
        OffloadOptions {
            fetch: FetchEngine::Sm { ctas: 16 },
            offload_layer0: false,
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
pub(super) struct OffloadLayer {
    /// bf16 [Hkv, S, 2, block, D].
    pool: CudaSlice<Bf16>,
    /// i32 [Hkv, S]: block id or −1.
    slots: CudaSlice<i32>,
    /// Device-visible address of block 0 of this (sequence, layer) in the
    /// pinned store.
    host: u64,
}

/// The offload state of one sequence.
pub(super) struct SeqOffload {
    /// The pinned store (kept alive while the sequence is).
    _store: crate::cuda::offload::PinnedKv,
    /// Capacity of the store, blocks per layer.
    blocks: usize,
    /// Per layer; None for resident layers.
    layers: Vec<Option<OffloadLayer>>,
}

impl SeqOffload {
    /// Tokens the host store holds.
    pub(super) fn capacity_tokens(&self, block_size: usize) -> usize {
        self.blocks * block_size
    }
    /// Whether layer `l` is offloaded (else resident: full K/V on the GPU).
    pub(super) fn offloaded(&self, l: usize) -> bool {
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
pub(super) struct Spill {
    /// The store (taken by offload_sequence).
    store: Option<crate::cuda::offload::PinnedKv>,
    /// Capacity of the store, blocks per layer.
    blocks: usize,
    /// Blocks already written to the store (every offloaded layer).
    done: usize,
    /// First offloaded layer when the store was sized.
    first: usize,
    /// The stream the spills run on.
    wb: Arc<CudaStream>,
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
    pub(super) fn advance(&mut self, new_len: usize, block_size: usize) {
        self.done = self.done.max((new_len / block_size).min(self.blocks));
    }
}

/// Per-step buffers of an offloaded batch.
pub(super) struct StepOffload {
    /// Pool slots per (sequence, layer, KV head).
    slots: usize,
    /// Tokens of a tail ring.
    ring: usize,
    /// Per layer: offloaded.
    offloaded: Vec<bool>,
    /// u64 [L][3][n]: pool, slot map, host base per row.
    tabs: CudaSlice<u64>,
    /// The same tables on the host (the copy-engine fetch reads them).
    tabs_host: Vec<u64>,
    /// i32 [L, n, Hkv, s_max]: slot of each list entry (−1 ring).
    slot_list: CudaSlice<i32>,
    /// i32 [L, n, Hkv, S, 2]: (slot, block) misses.
    fetch: CudaSlice<i32>,
    /// i32 [L, n, Hkv]: misses per (row, head).
    nfetch: CudaSlice<i32>,
    /// i32 [n]: the lengths the write-back reads (copied before the step ends).
    wb_lens: CudaSlice<i32>,
    /// The write-back stream and its last event (the next step waits on it).
    wb_stream: Arc<CudaStream>,
    wb_done: Option<CudaEvent>,
    /// Fetch timing events, one pair per layer.
    timing: Vec<(CudaEvent, CudaEvent)>,
    /// Some row completes a block in the step being enqueued (set by the host).
    pub(super) completes: bool,
    /// The copy (prefetch) stream and, per layer, its ready / fetched events
    /// (forecast mode with prefetch; runtime.md §2).
    copy_stream: Arc<CudaStream>,
    ready: Vec<CudaEvent>,
    fetched: Vec<CudaEvent>,
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
    pub(super) fn nfetch_buffer(&self) -> &CudaSlice<i32> {
        &self.nfetch
    }

    /// Whether layer `l` is offloaded.
    pub(super) fn offloaded(&self, l: usize) -> bool {
        self.offloaded[l]
    }

    /// Ring tokens of layer `l` (0 when it is resident).
    pub(super) fn ring_of(&self, l: usize) -> usize {
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
/// (benches/results/issue5_copy_priority_*): no difference with the
/// persistent 16-CTA fetch kernel (14.53 vs 14.44 ms/step at 64K, B = 16).
fn copy_stream(gpu: &Gpu) -> Result<Arc<CudaStream>> {
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
fn sync_events(gpu: &Gpu, n: usize, what: &str) -> Result<Vec<CudaEvent>> {
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

/// Tokens a tail ring holds.
pub(super) fn ring_tokens(block_size: usize) -> usize {
    RING_BLOCKS * block_size
}

impl GpuModel {
    /// Turns offloaded decode on (`Some`) or off for sequences offloaded
    /// from now on ([`GpuModel::offload_sequence`]).
    ///
    /// Errors: [`Error::Input`] unless the plan is sparse with GPU
    /// selection (offload keeps only the selected blocks on the GPU), a
    /// dense phase (dense_len > 0) that would need every block, or an SM
    /// fetch with 0 CTAs.
    pub fn set_offload(&mut self, opts: Option<OffloadOptions>) -> Result<()> {
        if let Some(o) = &opts {
            if !self.sparse_plan() || self.selection != SelectionPath::Gpu {
                return Err(Error::Input(
                    "--kv offload needs sparse attention with GPU selection (the model runs dense: add --attention sparse)".into(),
                ));
            }
            if self.plan.sparse.dense_len > 0 {
                return Err(Error::Input(format!(
                    "--kv offload: sparse_config.dense_len = {} makes the first steps dense; offloaded decode runs sparse steps only (set dense_len 0)",
                    self.plan.sparse.dense_len
                )));
            }
            let b = &self.plan.budget;
            if b.attended > crate::cuda::offload::SLOT_DIFF_MAX_SLOTS {
                return Err(Error::Input(format!(
                    "--kv offload: {} attended blocks exceed the slot pool limit {}",
                    b.attended,
                    crate::cuda::offload::SLOT_DIFF_MAX_SLOTS
                )));
            }
            if b.kernel_size > b.block_size {
                return Err(Error::Input(format!(
                    "--kv offload: kernel_size {} > block_size {}: the compression window would reach past the {}-block tail ring",
                    b.kernel_size, b.block_size, RING_BLOCKS
                )));
            }
            if let FetchEngine::Sm { ctas } = o.fetch {
                if ctas == 0 || ctas > 1024 {
                    return Err(Error::Input(format!(
                        "--prefetch-ctas {ctas}: give 1 … 1024 CTAs"
                    )));
                }
            }
        }
        self.offload = opts;
        self.step = None;
        Ok(())
    }

    /// The fetch engine for a batch of `batch` rows ([`FetchEngine::Auto`]
    /// resolved by [`fetch_rule`]).
    pub fn fetch_engine(&self, batch: usize) -> FetchEngine {
        match self.offload.map_or(FetchEngine::Auto, |o| o.fetch) {
            FetchEngine::Auto => fetch_rule(&self.gpu.info().name, batch),
            e => e,
        }
    }

    /// The offload settings in force.
    pub fn offload_options(&self) -> Option<OffloadOptions> {
        self.offload
    }

    /// First offloaded layer (0 with `--offload-layer0`, else 1).
    fn first_offloaded(&self) -> usize {
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
            self.plan.budget.attended,
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
        let s_slots = self.plan.budget.attended.max(1);
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
            let mut rk: CudaSlice<Bf16> =
                s.alloc_zeros(ring * kvd).cuda("allocating a tail ring")?;
            let mut rv: CudaSlice<Bf16> =
                s.alloc_zeros(ring * kvd).cuda("allocating a tail ring")?;
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
            let pool = s
                .alloc_zeros(hk * s_slots * 2 * bs * dh)
                .cuda("allocating a slot pool")?;
            let slots = gpu.upload(&vec![-1i32; hk * s_slots])?;
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
        });
        seq.generation += 1;
        self.step = None;
        Ok(())
    }

    /// A pinned store for one sequence of up to `capacity_tokens` tokens
    /// (every offloaded layer), after checking the host has room.
    ///
    /// Errors: [`Error::Limit`] with the bytes needed and available.
    fn new_store(&self, capacity_tokens: usize) -> Result<crate::cuda::offload::PinnedKv> {
        let c = &self.config;
        let bs = self.plan.budget.block_size;
        let blocks = capacity_tokens.div_ceil(bs);
        let block_bytes = c.num_key_value_heads * 2 * bs * c.head_dim * 2;
        let host_bytes = (self.layers.len() - self.first_offloaded()) * blocks * block_bytes;
        let host_avail = crate::cuda::offload::host_available_bytes()?;
        if host_bytes > host_avail {
            return Err(Error::Limit(format!(
                "offloading a sequence of up to {capacity_tokens} tokens needs {:.2} GiB of pinned host memory, {:.2} GiB available",
                host_bytes as f64 / (1u64 << 30) as f64,
                host_avail as f64 / (1u64 << 30) as f64
            )));
        }
        crate::cuda::offload::PinnedKv::new(&self.gpu, host_bytes.max(1))
    }

    /// Prepares `seq` (empty or partly prefilled, GPU-resident) to be
    /// offloaded with room for `capacity_tokens` tokens: allocates its
    /// pinned store now, so that [`GpuModel::prefill`] writes each chunk's
    /// completed blocks to host memory layer by layer, on a write-back
    /// stream, while the next layers compute (issue 4 item 6);
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

    /// The compute stream waits for the spills of `seqs` enqueued so far:
    /// at the start of a forward call, before anything may replace (grow)
    /// the K/V buffers or the block ranges they read.
    pub(super) fn spill_wait(&self, seqs: &[GpuSequence]) -> Result<()> {
        for sp in seqs.iter().filter_map(|s| s.spill.as_ref()) {
            let ev = sp.wb.record_event(None).cuda("cuEventRecord (spill)")?;
            self.gpu
                .stream()
                .wait(&ev)
                .cuda("cuStreamWaitEvent (spill)")?;
        }
        Ok(())
    }

    /// Per-layer spill tables of a prefill call on `seq` that grows it to
    /// `new_len` tokens: u64 [L][3] (K, V, host base) and i32 [2] (first,
    /// end block), uploaded on the compute stream (after
    /// [`GpuModel::spill_wait`]); None when the call completes no block.
    pub(super) fn spill_tables(
        &self,
        seq: &GpuSequence,
        new_len: usize,
    ) -> Result<Option<(CudaSlice<u64>, CudaSlice<i32>)>> {
        let Some((sp, store)) = seq
            .spill
            .as_ref()
            .and_then(|sp| sp.store.as_ref().map(|st| (sp, st)))
        else {
            return Ok(None);
        };
        let bs = self.plan.budget.block_size;
        let end = new_len / bs;
        if end <= sp.done || end > sp.blocks {
            return Ok(None);
        }
        let c = &self.config;
        let block_bytes = c.num_key_value_heads * 2 * bs * c.head_dim * 2;
        let first = sp.first;
        let gpu = &*self.gpu;
        let mut t = vec![0u64; 3 * self.layers.len()];
        for (l, sl) in seq.layers.iter().enumerate().skip(first) {
            t[3 * l] = dptr(gpu, &sl.k);
            t[3 * l + 1] = dptr(gpu, &sl.v);
            t[3 * l + 2] = store.device_ptr() + ((l - first) * sp.blocks * block_bytes) as u64;
        }
        let range = [i32_dim(sp.done, "blocks")?, i32_dim(end, "blocks")?];
        Ok(Some((gpu.upload(&t)?, gpu.upload(&range)?)))
    }

    /// Spills layer `l`'s blocks completed by this prefill call (after its
    /// KV append) on the sequence's write-back stream, which first waits
    /// for the compute stream's work so far.
    pub(super) fn spill_layer(
        &self,
        seq: &GpuSequence,
        l: usize,
        tabs: &(CudaSlice<u64>, CudaSlice<i32>),
        new_len: usize,
    ) -> Result<()> {
        let Some(sp) = seq.spill.as_ref() else {
            return Ok(());
        };
        if l < sp.first {
            return Ok(());
        }
        let gpu = &*self.gpu;
        let ev = gpu
            .stream()
            .record_event(None)
            .cuda("cuEventRecord (spill)")?;
        sp.wb.wait(&ev).cuda("cuStreamWaitEvent (spill)")?;
        let t = dptr(gpu, &tabs.0) + (3 * l * 8) as u64;
        let r = dptr(gpu, &tabs.1);
        let n_blocks = new_len / self.plan.budget.block_size - sp.done;
        self.launch_store_blocks(
            &sp.wb,
            t,
            t + 8,
            t + 16,
            0,
            r,
            r + 4,
            1,
            0,
            n_blocks * self.config.num_key_value_heads * 2,
        )
    }

    /// Per-step offload buffers for a batch of offloaded `seqs`.
    pub(super) fn build_step_offload(
        &self,
        seqs: &[GpuSequence],
        s_max: usize,
    ) -> Result<StepOffload> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (hk, nl) = (c.num_key_value_heads, c.num_hidden_layers);
        let n = seqs.len();
        let slots = self.plan.budget.attended.max(1);
        let offloaded: Vec<bool> = (0..nl)
            .map(|l| seqs[0].off.as_ref().is_some_and(|o| o.layers[l].is_some()))
            .collect();
        for sq in seqs {
            let same = sq.off.as_ref().is_some_and(|o| {
                o.layers
                    .iter()
                    .zip(&offloaded)
                    .all(|(x, &f)| x.is_some() == f)
            });
            if !same {
                return Err(Error::Input(
                    "decode: a batch must be all offloaded (with the same layers) or all GPU-resident".into(),
                ));
            }
        }
        let mut tabs = vec![0u64; nl * 3 * n];
        for l in 0..nl {
            for (i, sq) in seqs.iter().enumerate() {
                if let Some(ol) = sq.off.as_ref().and_then(|o| o.layers[l].as_ref()) {
                    tabs[(l * 3) * n + i] = dptr(gpu, &ol.pool);
                    tabs[(l * 3 + 1) * n + i] = dptr(gpu, &ol.slots);
                    tabs[(l * 3 + 2) * n + i] = ol.host;
                }
            }
        }
        let s = gpu.stream();
        let what = "allocating the offload step buffers";
        let timing = if self.fetch_timing {
            (0..nl)
                .map(|_| Ok((gpu.timing_event()?, gpu.timing_event()?)))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok(StepOffload {
            slots,
            ring: ring_tokens(self.plan.budget.block_size),
            offloaded,
            tabs: gpu.upload(&tabs)?,
            tabs_host: tabs,
            slot_list: s.alloc_zeros((nl * n * hk * s_max).max(1)).cuda(what)?,
            fetch: s.alloc_zeros((nl * n * hk * slots * 2).max(1)).cuda(what)?,
            nfetch: s.alloc_zeros((nl * n * hk).max(1)).cuda(what)?,
            wb_lens: s.alloc_zeros(n.max(1)).cuda(what)?,
            wb_stream: gpu
                .context()
                .new_stream()
                .cuda("cuStreamCreate (write-back)")?,
            wb_done: None,
            timing,
            completes: false,
            copy_stream: copy_stream(gpu)?,
            ready: sync_events(gpu, nl, "cuEventCreate (ready)")?,
            fetched: sync_events(gpu, nl, "cuEventCreate (fetched)")?,
        })
    }

    /// Offload work of layer `l` between selection and attention in the
    /// synchronous mode: the set difference, then the fetch of the misses,
    /// both on the compute stream. Returns the attention's slot arguments.
    pub(super) fn offload_layer(
        &self,
        st: &mut DecodeStep,
        l: usize,
        sel_off: usize,
        nsel_off: usize,
        lens: u64,
    ) -> Result<Option<(u64, u64, usize, usize)>> {
        let stream = self.gpu.stream().clone();
        let sp = self.tspan(&stream, crate::trace::Track::Compute, "diff", l)?;
        let offloaded = self.offload_diff(st, l, sel_off, nsel_off, lens)?;
        self.tspan_end(&stream, sp)?;
        if !offloaded {
            return Ok(None);
        }
        self.offload_fetch(st, l, &stream)?;
        Ok(self.offload_attn_slots(st, l))
    }

    /// The attention's (slot list, pool table, pool slots, ring tokens) of
    /// layer `l`, or None when it is resident.
    pub(super) fn offload_attn_slots(
        &self,
        st: &DecodeStep,
        l: usize,
    ) -> Option<(u64, u64, usize, usize)> {
        let off = st.off.as_ref()?;
        if !off.offloaded[l] {
            return None;
        }
        let gpu = &*self.gpu;
        let (n, hk, s_max) = (st.n, self.config.num_key_value_heads, st.attn.s_max);
        Some((
            dptr(gpu, &off.slot_list) + ((l * n * hk * s_max) * 4) as u64,
            dptr(gpu, &off.tabs) + (l * 3 * n * 8) as u64,
            off.slots,
            ring_tokens(self.plan.budget.block_size),
        ))
    }

    /// `slot_diff` of layer `l` on the compute stream over the lists at
    /// `sel_off`/`nsel_off` (rows attending to `lens` tokens). Returns
    /// false (nothing launched) when the layer is resident.
    pub(super) fn offload_diff(
        &self,
        st: &mut DecodeStep,
        l: usize,
        sel_off: usize,
        nsel_off: usize,
        lens: u64,
    ) -> Result<bool> {
        let gpu = &*self.gpu;
        let hk = self.config.num_key_value_heads;
        let n = st.n;
        let s_max = st.attn.s_max;
        let bs = self.plan.budget.block_size;
        let Some(off) = st.off.as_ref() else {
            return Ok(false);
        };
        if !off.offloaded[l] {
            return Ok(false);
        }
        let sl_slots = off.slots;
        let tab = dptr(gpu, &off.tabs) + (l * 3 * n * 8) as u64;
        let slot_tab = tab + (n * 8) as u64;
        let slot_list = dptr(gpu, &off.slot_list) + ((l * n * hk * s_max) * 4) as u64;
        let fetch = dptr(gpu, &off.fetch) + ((l * n * hk * sl_slots * 2) * 4) as u64;
        let nfetch = dptr(gpu, &off.nfetch) + ((l * n * hk) * 4) as u64;
        let stats = dptr(gpu, &self.offload_counters) + ((l * 2) * 8) as u64;
        let sel = dptr(gpu, &st.ws.sel) + (sel_off * 4) as u64;
        let nsel = dptr(gpu, &st.ws.nsel) + (nsel_off * 4) as u64;
        let (sm_, ss_, bs_, hk_) = (
            i32_dim(s_max, "s_max")?,
            i32_dim(sl_slots, "pool slots")?,
            i32_dim(bs, "block size")?,
            i32_dim(hk, "Hkv")?,
        );
        let f = gpu.function("slot_diff")?;
        let mut b = gpu.stream().launch_builder(f);
        b.arg(&sel)
            .arg(&nsel)
            .arg(&sm_)
            .arg(&lens)
            .arg(&slot_tab)
            .arg(&ss_)
            .arg(&bs_)
            .arg(&hk_)
            .arg(&slot_list)
            .arg(&fetch)
            .arg(&nfetch)
            .arg(&stats);
        let cfg = LaunchConfig {
            grid_dim: (grid(n, "rows")?, grid(hk, "Hkv")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument list matches kernels/kv_offload.cu slot_diff; the lists
        // hold n·Hkv·s_max entries, the slot maps Hkv·S, fetch n·Hkv·S pairs.
        unsafe { b.launch(cfg) }.cuda("slot_diff")?;
        Ok(true)
    }

    /// Enqueues the fetch of layer `l`'s misses (as its last `slot_diff`
    /// listed them) on `stream` with the configured engine, timed by events
    /// when fetch timing is on; with an injected copy delay
    /// ([`GpuModel::set_copy_delay_us`]) a spin kernel runs first.
    pub(super) fn offload_fetch(
        &self,
        st: &mut DecodeStep,
        l: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (hk, dh) = (c.num_key_value_heads, c.head_dim);
        let n = st.n;
        let bs = self.plan.budget.block_size;
        let Some(off) = st.off.as_mut() else {
            return Ok(());
        };
        let sl_slots = off.slots;
        let tab = dptr(gpu, &off.tabs) + (l * 3 * n * 8) as u64;
        let (pool_tab, host_tab) = (tab, tab + (2 * n * 8) as u64);
        let fetch = dptr(gpu, &off.fetch) + ((l * n * hk * sl_slots * 2) * 4) as u64;
        let nfetch = dptr(gpu, &off.nfetch) + ((l * n * hk) * 4) as u64;
        let (ss_, bs_, hk_, d_, n_) = (
            i32_dim(sl_slots, "pool slots")?,
            i32_dim(bs, "block size")?,
            i32_dim(hk, "Hkv")?,
            i32_dim(dh, "D")?,
            i32_dim(n, "rows")?,
        );
        if self.copy_delay_us > 0 {
            let f = gpu.function("spin_wait")?;
            let ns = self.copy_delay_us as u64 * 1000;
            let mut b = stream.launch_builder(f);
            b.arg(&ns);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches spin_wait (kernels/forecast.cu).
            unsafe { b.launch(cfg) }.cuda("spin_wait")?;
        }
        let timed = self.fetch_timing && !off.timing.is_empty();
        if timed {
            off.timing[l]
                .0
                .record(stream)
                .cuda("cuEventRecord (fetch)")?;
        }
        let span = self.tspan(stream, crate::trace::Track::Copy, "fetch", l)?;
        self.note_fetch_span(l, span);
        match self.fetch_engine(n) {
            FetchEngine::Sm { ctas } => {
                let f = gpu.function("kv_fetch_sm")?;
                let mut b = stream.launch_builder(f);
                b.arg(&fetch)
                    .arg(&nfetch)
                    .arg(&ss_)
                    .arg(&n_)
                    .arg(&hk_)
                    .arg(&host_tab)
                    .arg(&pool_tab)
                    .arg(&bs_)
                    .arg(&d_);
                let cfg = LaunchConfig {
                    grid_dim: (grid(ctas, "CTAs")?, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: argument list matches kv_fetch_sm; host tables point at
                // stores of ≥ the blocks listed (blocks < the sequence's length),
                // pool tables at Hkv·S slots.
                unsafe { b.launch(cfg) }.cuda("kv_fetch_sm")?;
            }
            FetchEngine::Dma => self.fetch_dma_layer(off, l, n, stream)?,
            FetchEngine::Auto => {
                return Err(Error::Input(
                    "fetch engine left unresolved (fetch_rule never returns Auto)".into(),
                ))
            }
        }
        self.tspan_end(stream, span)?;
        if timed {
            off.timing[l]
                .1
                .record(stream)
                .cuda("cuEventRecord (fetch)")?;
        }
        Ok(())
    }

    /// The copy-engine fetch of layer `l`: waits for the layer's fetch
    /// lists (one host synchronisation of the compute stream), then one
    /// `cuMemcpyBatchAsync` on `stream`.
    fn fetch_dma_layer(
        &self,
        off: &StepOffload,
        l: usize,
        n: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let hk = self.config.num_key_value_heads;
        let s_slots = off.slots;
        let nf = gpu.download(&off.nfetch.slice(l * n * hk..(l + 1) * n * hk))?;
        if nf.iter().all(|&x| x <= 0) {
            return Ok(());
        }
        let base = l * n * hk * s_slots * 2;
        let fl = gpu.download(&off.fetch.slice(base..base + n * hk * s_slots * 2))?;
        let tabs = &off.tabs_host[l * 3 * n..(l + 1) * 3 * n];
        let rows: Vec<crate::cuda::offload::DmaRow> = (0..n)
            .map(|r| crate::cuda::offload::DmaRow {
                host: tabs[2 * n + r],
                pool: tabs[r],
            })
            .collect();
        crate::cuda::offload::fetch_dma(
            gpu,
            stream,
            &fl,
            &nf,
            s_slots,
            hk,
            &rows,
            self.plan.budget.block_size,
            self.config.head_dim,
        )
        .map(drop)
    }

    /// Enqueues the write-back of the blocks this step completes (rows whose
    /// length after the step is a multiple of the block size) on the
    /// write-back stream, after the compute stream's work so far.
    pub(super) fn offload_write_back(&self, st: &mut DecodeStep, lens: u64) -> Result<()> {
        let gpu = &*self.gpu;
        let n = st.n;
        let hk = self.config.num_key_value_heads;
        let Some(off) = st.off.as_mut() else {
            return Ok(());
        };
        if !off.completes {
            return Ok(());
        }
        let stream = gpu.stream();
        // The lengths advance at the end of the step: copy them first.
        let wb = dptr(gpu, &off.wb_lens);
        // SAFETY: both ranges hold n i32 on this context's device.
        unsafe { cudarc::driver::result::memcpy_dtod_async(wb, lens, n * 4, stream.cu_stream()) }
            .cuda("copying the write-back lengths")?;
        let ev = stream
            .record_event(None)
            .cuda("cuEventRecord (write-back)")?;
        off.wb_stream
            .wait(&ev)
            .cuda("cuStreamWaitEvent (write-back)")?;
        let ptrs = dptr(gpu, &st.ws.ptrs);
        let per_layer = PTRS_PER_ROW * n + PTRS_PER_SEQ * n;
        let wbs = off.wb_stream.clone();
        let span = self.tspan(&wbs, crate::trace::Track::WriteBack, "write-back", 0)?;
        for l in 0..self.layers.len() {
            if !off.offloaded[l] {
                continue;
            }
            let tab = Tables::new(ptrs + (l * per_layer * 8) as u64, n, n);
            let host_tab = dptr(gpu, &off.tabs) + ((l * 3 + 2) * n * 8) as u64;
            self.launch_store_blocks(
                &wbs,
                tab.k,
                tab.v,
                host_tab,
                wb,
                0,
                0,
                n,
                ring_tokens(self.plan.budget.block_size),
                hk * 2,
            )?;
        }
        self.tspan_end(&wbs, span)?;
        off.wb_done = Some(
            wbs.record_event(None)
                .cuda("cuEventRecord (write-back done)")?,
        );
        Ok(())
    }

    /// Prefetch of layer `l` (forecast mode, runtime.md §2): records
    /// ready(l) on the compute stream after its diff; the copy stream waits
    /// for it, fetches the misses and records fetched(l).
    pub(super) fn offload_prefetch(&self, st: &mut DecodeStep, l: usize) -> Result<()> {
        let Some(off) = st.off.as_ref() else {
            return Ok(());
        };
        let cs = off.copy_stream.clone();
        off.ready[l]
            .record(self.gpu.stream())
            .cuda("cuEventRecord (ready)")?;
        cs.wait(&off.ready[l]).cuda("cuStreamWaitEvent (ready)")?;
        self.offload_fetch(st, l, &cs)?;
        let off = st.off.as_ref().expect("offloaded");
        off.fetched[l].record(&cs).cuda("cuEventRecord (fetched)")?;
        Ok(())
    }

    /// The compute stream waits for fetched(l) before layer `l`'s attention.
    pub(super) fn offload_wait_fetched(&self, st: &DecodeStep, l: usize) -> Result<()> {
        match st.off.as_ref() {
            Some(off) if off.offloaded[l] => self
                .gpu
                .stream()
                .wait(&off.fetched[l])
                .cuda("cuStreamWaitEvent (fetched)"),
            _ => Ok(()),
        }
    }

    /// Makes the compute stream wait for the last write-back (start of a step).
    pub(super) fn offload_wait_write_back(&self, st: &mut DecodeStep) -> Result<()> {
        if let Some(ev) = st.off.as_mut().and_then(|o| o.wb_done.take()) {
            self.gpu
                .stream()
                .wait(&ev)
                .cuda("cuStreamWaitEvent (write-back)")?;
        }
        Ok(())
    }

    /// Adds the fetch times of the last step (synchronises).
    pub(super) fn offload_collect_timing(&mut self) -> Result<()> {
        if !self.fetch_timing {
            return Ok(());
        }
        let Some(off) = self.step.as_ref().and_then(|s| s.off.as_ref()) else {
            return Ok(());
        };
        let mut ms = 0.0f64;
        for (l, (a, b)) in off.timing.iter().enumerate() {
            if off.offloaded[l] {
                ms += a.elapsed_ms(b).cuda("cuEventElapsedTime (fetch)")? as f64;
            }
        }
        self.fetch_ms += ms;
        let counters = self.gpu.download(&self.offload_counters)?;
        let fetched: u64 = counters.iter().skip(1).step_by(2).sum();
        self.timed_bytes += (fetched - self.fetched_at_timing) * self.chunk_bytes() as u64;
        self.fetched_at_timing = fetched;
        Ok(())
    }

    fn chunk_bytes(&self) -> usize {
        2 * self.plan.budget.block_size * self.config.head_dim * 2
    }

    /// Times every fetch with CUDA events from the next step on (each
    /// step then synchronises once to read them), for the fetch GB/s of
    /// [`OffloadStats`]. Off by default: throughput runs stay free of it.
    pub fn set_fetch_timing(&mut self, on: bool) -> Result<()> {
        if on != self.fetch_timing {
            self.fetch_timing = on;
            self.step = None;
        }
        let counters = self.gpu.download(&self.offload_counters)?;
        self.fetched_at_timing = counters.iter().skip(1).step_by(2).sum();
        Ok(())
    }

    /// The offload counters (synchronises).
    pub fn offload_stats(&self) -> Result<OffloadStats> {
        let counters = self.gpu.download(&self.offload_counters)?;
        Ok(OffloadStats {
            selected: counters.iter().step_by(2).copied().collect(),
            fetched: counters.iter().skip(1).step_by(2).copied().collect(),
            chunk_bytes: self.chunk_bytes(),
            fetch_ms: self.fetch_ms,
            timed_bytes: self.timed_bytes,
            steps: self.offload_steps,
        })
    }

    /// Zeroes the offload counters.
    pub fn reset_offload_stats(&mut self) -> Result<()> {
        self.gpu
            .stream()
            .memset_zeros(&mut self.offload_counters)
            .cuda("zeroing the offload counters")?;
        self.fetch_ms = 0.0;
        self.timed_bytes = 0;
        self.fetched_at_timing = 0;
        self.offload_steps = 0;
        Ok(())
    }

    /// `kv_store_blocks` (kernels/kv_offload.cu) on `stream` over `rows`
    /// rows: lens mode (`lens` ≠ 0: the block each row just completed) or
    /// range mode (blocks [lo[r], hi[r])). `work` sizes the grid.
    #[allow(clippy::too_many_arguments)]
    fn launch_store_blocks(
        &self,
        stream: &Arc<CudaStream>,
        kptr: u64,
        vptr: u64,
        host_tab: u64,
        lens: u64,
        lo: u64,
        hi: u64,
        rows: usize,
        ring: usize,
        work: usize,
    ) -> Result<()> {
        let c = &self.config;
        let (hk_, d_, bs_, rg) = (
            i32_dim(c.num_key_value_heads, "Hkv")?,
            i32_dim(c.head_dim, "D")?,
            i32_dim(self.plan.budget.block_size, "block size")?,
            i32_dim(ring, "ring tokens")?,
        );
        let f = self.gpu.function("kv_store_blocks")?;
        let mut b = stream.launch_builder(f);
        b.arg(&kptr)
            .arg(&vptr)
            .arg(&host_tab)
            .arg(&lens)
            .arg(&lo)
            .arg(&hi)
            .arg(&hk_)
            .arg(&d_)
            .arg(&bs_)
            .arg(&rg);
        let cfg = LaunchConfig {
            grid_dim: (grid(work.clamp(1, 1024), "blocks")?, grid(rows, "rows")?, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument list matches kv_store_blocks; the host tables point at
        // stores holding every block written (checked against the capacity).
        unsafe { b.launch(cfg) }.cuda("kv_store_blocks").map(drop)
    }
}

/// Whether any row completes a block this step (its length after the step
/// is a multiple of the block size).
pub(super) fn step_completes_block(seqs: &[GpuSequence], block_size: usize) -> bool {
    seqs.iter().any(|s| (s.len + 1) % block_size == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locality_is_one_minus_fetched_over_selected_per_offloaded_layer() {
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
    fn the_ring_holds_the_current_and_previous_block() {
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
    fn the_default_fetch_rule_follows_sparda_per_gpu_and_batch() {
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
