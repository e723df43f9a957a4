//! Writing completed blocks back to pinned host memory on the write-back
//! stream (runtime.md §1, §3 fault 5: never a host stall): after every
//! offloaded decode step, and chunk by chunk during a prefill for offload
//! (the spill).

use super::offload::*;
use crate::cuda::context::{dptr, grid, i32_dim, CudaResultExt};
use crate::pipeline::*;
use crate::Result;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

impl GpuModel {
    /// The compute stream waits for the spills of `seqs` enqueued so far:
    /// at the start of a forward call, before anything may replace (grow)
    /// the K/V buffers or the block ranges they read.
    pub(crate) fn spill_wait(&self, seqs: &[GpuSequence]) -> Result<()> {
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
    pub(crate) fn spill_tables(
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
    pub(crate) fn spill_layer(
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

    /// Enqueues the write-back of the blocks this step completes (rows whose
    /// length after the step is a multiple of the block size) on the
    /// write-back stream, after the compute stream's work so far.
    pub(crate) fn offload_write_back(&self, st: &mut DecodeStep, lens: u64) -> Result<()> {
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

    /// Makes the compute stream wait for the last write-back (start of a step).
    pub(crate) fn offload_wait_write_back(&self, st: &mut DecodeStep) -> Result<()> {
        if let Some(ev) = st.off.as_mut().and_then(|o| o.wb_done.take()) {
            self.gpu
                .stream()
                .wait(&ev)
                .cuda("cuStreamWaitEvent (write-back)")?;
        }
        Ok(())
    }

    /// `kv_store_blocks` (kernels/kv_offload.cu) on `stream` over `rows`
    /// rows: lens mode (`lens` ≠ 0: the block each row just completed) or
    /// range mode (blocks [lo[r], hi[r])). `work` sizes the grid.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_store_blocks(
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
pub(crate) fn step_completes_block(seqs: &[GpuSequence], block_size: usize) -> bool {
    seqs.iter().any(|s| (s.len + 1) % block_size == 0)
}
