//! GPU-resident KV of one sequence (spec/nosa-model.md §3): every layer's
//! post-RoPE K and V, eviction scores c, compressed keys Kc and pooled
//! scores p on the device, grown by reallocation whenever a call needs
//! more room (runtime.md §3 fault 1: nothing is sized once).

use crate::cuda::context::CudaResultExt;
use crate::cuda::Bf16;
use crate::model::state::LayerKv;
use crate::pipeline::*;
use crate::{Error, Result};
use cudarc::driver::CudaSlice;
use std::sync::atomic::Ordering;

/// One layer's state of one sequence on the GPU (spec §3): post-RoPE K and V,
/// bf16 [cap, Hkv, D]; eviction scores c, f32 [cap, Hkv] (eviction heads
/// only); for sparse plans on [`SelectionPath::Gpu`], compressed keys Kc,
/// f32 [capw, Hkv, D], and pooled eviction scores p, f32 [capw, Hkv]
/// (eviction heads only), capw = Mc(cap) windows.
pub(crate) struct SeqLayer {
    pub(crate) k: CudaSlice<Bf16>,
    pub(crate) v: CudaSlice<Bf16>,
    pub(crate) c: Option<CudaSlice<f32>>,
    pub(crate) kc: Option<CudaSlice<f32>>,
    pub(crate) p: Option<CudaSlice<f32>>,
}

/// One sequence's state on the GPU: every layer's K/V/c cache with room for
/// `capacity()` tokens (a multiple of the block size), grown by reallocation
/// (double, copy) whenever a forward call needs more — never silently
/// overflowed (runtime.md §3 fault 1). Create with
/// [`GpuModel::new_sequence`]; a sequence belongs to the model that made it.
pub struct GpuSequence {
    /// Offloaded KV: the host store, slot pools and slot maps.
    /// Offloaded layers' `k`/`v` are then tail rings of
    /// [`crate::kv::RING_BLOCKS`] blocks. Declared first: dropped first, its
    /// `Drop` waits for in-flight write-backs before the rings are freed.
    pub(crate) off: Option<crate::kv::offload::SeqOffload>,
    /// Being prefilled for offload: its store, written chunk by chunk
    /// (dropped early too: its `Drop` waits for the spills).
    pub(crate) spill: Option<crate::kv::offload::Spill>,
    pub(crate) len: usize,
    pub(crate) cap: usize,
    pub(crate) layers: Vec<SeqLayer>,
    /// Host mirror of K, V, c, Kc, p per layer for [`SelectionPath::HostFallback`].
    pub(crate) mirror: Option<Vec<LayerKv>>,
    /// Unique per sequence object (never reused).
    pub(crate) uid: u64,
    /// Bumped whenever the device buffers move (growth).
    pub(crate) generation: u64,
}

impl std::fmt::Debug for GpuSequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSequence")
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish_non_exhaustive()
    }
}

impl GpuSequence {
    /// T: tokens processed so far.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no token was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Tokens the caches hold without growing.
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// Whether this sequence's KV lives in pinned host memory
    /// ([`GpuModel::offload_sequence`]).
    pub fn is_offloaded(&self) -> bool {
        self.off.is_some()
    }
}

impl GpuModel {
    /// The selection state of `layer` of `seq` on the GPU, for checks:
    /// compressed keys Kc (f32 [windows, Hkv, D]) and pooled eviction
    /// scores p (f32 [windows, Hkv]; empty without eviction heads) of its
    /// first `windows` windows, as a [`LayerKv`] holding only `kc` and `p`
    /// (the layout of the CPU reference's, spec §3). Synchronises.
    ///
    /// Errors: [`Error::Input`] for a layer past the model's, a sequence
    /// without GPU selection state (host selection path), or more windows
    /// than the sequence has; [`Error::Cuda`] on a copy failure.
    pub fn selection_state(
        &self,
        seq: &GpuSequence,
        layer: usize,
        windows: usize,
    ) -> Result<LayerKv> {
        let hk = self.config.num_key_value_heads;
        let mut kv = LayerKv::new(hk, self.config.head_dim);
        kv.kc = self.compressed_keys(seq, layer, 0..windows)?;
        if let Some(p) = &seq.layers[layer].p {
            kv.p = self.gpu.download(&p.slice(0..windows * hk))?;
        }
        Ok(kv)
    }

    /// The compressed keys Kc of windows `range` of `layer` of `seq` (f32
    /// [range.len(), Hkv, D], spec §3), e.g. only the windows completed
    /// since an earlier read: a complete window's Kc never changes.
    /// Synchronises.
    ///
    /// Errors: as [`GpuModel::selection_state`] (a range past the
    /// sequence's complete windows).
    pub fn compressed_keys(
        &self,
        seq: &GpuSequence,
        layer: usize,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let w = c.num_key_value_heads * c.head_dim;
        let sl = seq.layers.get(layer).ok_or_else(|| {
            Error::Input(format!(
                "compressed keys: layer {layer} of a {}-layer model",
                seq.layers.len()
            ))
        })?;
        let kc = sl.kc.as_ref().ok_or_else(|| {
            Error::Input(
                "compressed keys: the sequence keeps none on the GPU (host selection path)".into(),
            )
        })?;
        let have = self.plan.budget.windows(seq.len);
        if range.start > range.end || range.end > have || range.end * w > kc.len() {
            return Err(Error::Input(format!(
                "compressed keys: windows {range:?} asked, the sequence of {} tokens has {have}",
                seq.len
            )));
        }
        if range.is_empty() {
            return Ok(Vec::new());
        }
        self.gpu.download(&kc.slice(range.start * w..range.end * w))
    }

    /// Bytes of device memory one sequence with room for `capacity_tokens`
    /// tokens takes under the current plan and selection path (K, V, c,
    /// and Kc/p for GPU selection), every layer
    /// ([`crate::memory::KvLayout::sequence_bytes`]).
    pub fn sequence_bytes(&self, capacity_tokens: usize) -> usize {
        self.kv_layout().sequence_bytes(capacity_tokens)
    }

    /// How this engine lays out a sequence's KV on the GPU, for
    /// [`crate::memory::estimate`].
    pub fn kv_layout(&self) -> crate::memory::KvLayout {
        let c = &self.config;
        crate::memory::KvLayout {
            layers: self.layers.len(),
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            budget: self.plan.budget,
            eviction: self.eviction,
            gpu_selection: self.gpu_selection(),
        }
    }

    /// What `batch` sequences of `capacity_tokens` tokens need on this
    /// engine ([`crate::memory::estimate`]; weights 0, they are resident):
    /// all KV on the GPU (`offload` None) or offloaded with `offload`'s
    /// settings; `prefill`: they are prefilled for real.
    pub fn memory_need(
        &self,
        batch: usize,
        capacity_tokens: usize,
        offload: Option<crate::kv::offload::OffloadOptions>,
        prefill: bool,
    ) -> crate::memory::Need {
        let resident = offload.map(|o| usize::from(!o.offload_layer0).min(self.layers.len()));
        crate::memory::estimate(
            &self.config,
            &self.kv_layout(),
            &crate::memory::Workload {
                batch,
                capacity_tokens,
                offload_resident_layers: resident,
                cache_slots: offload.map_or(0, |o| o.cache_slots),
                prefill,
                prefill_chunk: crate::pipeline::prefill_chunk(),
                partials_budget_bytes: crate::pipeline::PARTIALS_BUDGET_BYTES,
            },
        )
    }

    /// Refuses, before anything is allocated, `batch` sequences of
    /// `capacity_tokens` tokens that do not fit what the machine has now
    /// ([`GpuModel::memory_need`] against [`crate::memory::available`],
    /// decided by [`crate::memory::check`]); `change` ends the message
    /// (what to change).
    ///
    /// Errors: [`Error::Limit`] with the GiB needed (and their parts) and
    /// available; [`Error::Cuda`] when the device cannot be queried;
    /// /proc/meminfo errors when pinned memory is needed.
    pub fn check_memory(
        &self,
        batch: usize,
        capacity_tokens: usize,
        offload: Option<crate::kv::offload::OffloadOptions>,
        prefill: bool,
        change: &str,
    ) -> Result<()> {
        let need = self.memory_need(batch, capacity_tokens, offload, prefill);
        self.gpu.synchronize()?;
        let avail = crate::memory::available(&self.gpu, need.host_pinned > 0)?;
        crate::memory::check(&need, &avail, change)
    }

    /// A new, empty sequence with room for `capacity_tokens` tokens (rounded
    /// up to whole blocks; e.g. prompt + max_new_tokens). It grows when a
    /// call needs more.
    ///
    /// Errors: [`Error::Cuda`] when device memory runs out.
    pub fn new_sequence(&self, capacity_tokens: usize) -> Result<GpuSequence> {
        let bs = self.plan.budget.block_size.max(1);
        let cap = capacity_tokens.max(1).div_ceil(bs) * bs;
        let layers = (0..self.layers.len())
            .map(|_| self.alloc_layer(cap))
            .collect::<Result<Vec<_>>>()?;
        let c = &self.config;
        let mirror =
            (self.sparse_plan() && self.selection == SelectionPath::HostFallback).then(|| {
                (0..c.num_hidden_layers)
                    .map(|_| LayerKv::new(c.num_key_value_heads, c.head_dim))
                    .collect()
            });
        Ok(GpuSequence {
            len: 0,
            cap,
            layers,
            mirror,
            uid: NEXT_SEQ_UID.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            off: None,
            spill: None,
        })
    }

    pub(crate) fn alloc_layer(&self, cap: usize) -> Result<SeqLayer> {
        self.alloc_layer_state(cap, true)
    }

    /// As [`GpuModel::alloc_layer`]; without `with_kv` the K/V caches are
    /// one-element placeholders (an offloaded layer keeps its ring).
    pub(crate) fn alloc_layer_state(&self, cap: usize, with_kv: bool) -> Result<SeqLayer> {
        let kv_cap = if with_kv { cap } else { 0 };
        let c = &self.config;
        let kvd = c.num_key_value_heads * c.head_dim;
        let what = |x: &str| format!("allocating the {x} cache of {cap} tokens");
        let s = self.gpu.stream();
        let gpu_sel = self.gpu_selection();
        let capw = self.plan.budget.windows(cap).max(1);
        Ok(SeqLayer {
            kc: if gpu_sel {
                Some(s.alloc_zeros(capw * kvd).cuda(&what("compressed-key"))?)
            } else {
                None
            },
            p: if gpu_sel && self.eviction {
                Some(
                    s.alloc_zeros(capw * c.num_key_value_heads)
                        .cuda(&what("pooled-score"))?,
                )
            } else {
                None
            },
            k: s.alloc_zeros((kv_cap * kvd).max(1)).cuda(&what("K"))?,
            v: s.alloc_zeros((kv_cap * kvd).max(1)).cuda(&what("V"))?,
            c: if self.eviction {
                Some(
                    s.alloc_zeros(cap * c.num_key_value_heads)
                        .cuda(&what("eviction-score"))?,
                )
            } else {
                None
            },
        })
    }

    /// Grows `seq`'s caches to hold at least `need` tokens (capacity
    /// doubled, at least `need`, whole blocks), copying the stored tokens.
    /// An offloaded sequence grows only its GPU state (c, Kc, p; resident
    /// layers' K/V): its tail rings move over as they are, its pools never
    /// grow, and it may not pass its host store's capacity.
    ///
    /// Errors: [`Error::Limit`] past an offloaded sequence's host store;
    /// device memory errors.
    pub(crate) fn ensure_capacity(&self, seq: &mut GpuSequence, need: usize) -> Result<()> {
        let bs = self.plan.budget.block_size.max(1);
        if let Some(off) = &seq.off {
            let host = off.capacity_tokens(bs);
            if need > host {
                return Err(Error::Limit(format!(
                    "offloaded sequence: {need} tokens exceed the host KV store's {host} tokens (offload with a larger capacity: prompt + max new tokens)"
                )));
            }
        }
        if need <= seq.cap {
            return Ok(());
        }
        let cap = need.max(2 * seq.cap).div_ceil(bs) * bs;
        let c = &self.config;
        let (kvd, hk) = (c.num_key_value_heads * c.head_dim, c.num_key_value_heads);
        let s = self.gpu.stream();
        let len = seq.len;
        let offloaded: Vec<bool> = (0..seq.layers.len())
            .map(|l| seq.off.as_ref().is_some_and(|o| o.offloaded(l)))
            .collect();
        for (sl, &off) in seq.layers.iter_mut().zip(&offloaded) {
            let mut n = self.alloc_layer_state(cap, !off)?;
            if off {
                std::mem::swap(&mut n.k, &mut sl.k);
                std::mem::swap(&mut n.v, &mut sl.v);
            }
            if len > 0 {
                if !off {
                    let used = len * kvd;
                    s.memcpy_dtod(&sl.k.slice(0..used), &mut n.k.slice_mut(0..used))
                        .cuda("growing the K cache")?;
                    s.memcpy_dtod(&sl.v.slice(0..used), &mut n.v.slice_mut(0..used))
                        .cuda("growing the V cache")?;
                }
                if let (Some(old), Some(new)) = (&sl.c, &mut n.c) {
                    s.memcpy_dtod(&old.slice(0..len * hk), &mut new.slice_mut(0..len * hk))
                        .cuda("growing the eviction-score cache")?;
                }
                let mc = self.plan.budget.windows(len);
                if mc > 0 {
                    if let (Some(old), Some(new)) = (&sl.kc, &mut n.kc) {
                        s.memcpy_dtod(&old.slice(0..mc * kvd), &mut new.slice_mut(0..mc * kvd))
                            .cuda("growing the compressed-key cache")?;
                    }
                    if let (Some(old), Some(new)) = (&sl.p, &mut n.p) {
                        s.memcpy_dtod(&old.slice(0..mc * hk), &mut new.slice_mut(0..mc * hk))
                            .cuda("growing the pooled-score cache")?;
                    }
                }
            }
            *sl = n;
        }
        seq.cap = cap;
        seq.generation += 1;
        Ok(())
    }
}
