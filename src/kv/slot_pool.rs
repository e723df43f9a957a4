//! The per-layer GPU slot pools of an offloaded batch and their set
//! difference (runtime.md §1 step 4): which selected blocks are resident
//! (hits), which need a slot (misses), and the slot lists attention reads.

use super::offload::*;
use crate::cuda::context::{dptr, grid, i32_dim, CudaResultExt};
use crate::pipeline::*;
use crate::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

impl GpuModel {
    /// Per-step offload buffers for a batch of offloaded `seqs`.
    pub(crate) fn build_step_offload(
        &self,
        seqs: &[GpuSequence],
        s_max: usize,
    ) -> Result<StepOffload> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (hk, nl) = (c.num_key_value_heads, c.num_hidden_layers);
        let n = seqs.len();
        let slots = self.pool_slots();
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
            if let Some(o) = sq
                .off
                .as_ref()
                .filter(|o| o.cache_slots != self.cache_slots())
            {
                return Err(Error::Input(format!(
                    "decode: a sequence was offloaded with {} cache slots per KV head, the settings now give {} (--cache-slots): offload it again",
                    o.cache_slots,
                    self.cache_slots()
                )));
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
            split: None,
        })
    }

    /// Offload work of layer `l` between selection and attention in the
    /// synchronous mode: the set difference, then the fetch of the misses,
    /// both on the compute stream. Returns the attention's slot arguments.
    pub(crate) fn offload_layer(
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
    pub(crate) fn offload_attn_slots(
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
    /// `sel_off`/`nsel_off` (rows attending to `lens` tokens); more misses
    /// than free slots are reported to the model's device error record.
    /// Returns false (nothing launched) when the layer is resident.
    pub(crate) fn offload_diff(
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
        let (err, layer) = (self.device_errors.device_ptr(), i32_dim(l, "layer")?);
        // with cache slots each slot map is followed by its ages (LRU reuse)
        let aged = i32::from(self.cache_slots() > 0);
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
            .arg(&stats)
            .arg(&err)
            .arg(&layer)
            .arg(&aged);
        let cfg = LaunchConfig {
            grid_dim: (grid(n, "rows")?, grid(hk, "Hkv")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument list matches kernels/kv_offload.cu slot_diff; the lists
        // hold n·Hkv·s_max entries, the slot maps Hkv·S, fetch n·Hkv·S pairs; the
        // error record is the model's (more misses than free slots are reported).
        unsafe { b.launch(cfg) }.cuda("slot_diff")?;
        Ok(true)
    }
}
