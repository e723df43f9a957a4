//! GPU spans of the decode engine for `--trace` (src/trace/mod.rs,
//! src/trace/timeline.rs).
//!
//! With tracing on ([`GpuModel::set_trace`]) decode steps run eagerly (a
//! replayed CUDA graph shows no spans) and every layer records, with CUDA
//! events on the stream that runs it: `qkv` (input norm, fused QKV GEMM),
//! `rope_append` (RoPE, KV append, eviction score; forecast mode's RoPE of
//! the forecast query too), `compress` (when windows complete), `select`
//! (query-aware or forecast selection, PREP of the next layer included),
//! `diff`, `fetch` (on the copy track: with prefetch it runs on the copy
//! stream, in the synchronous modes on the compute stream — a transfer all
//! the same, exposed by construction), `wait` (the compute stream waiting
//! for a prefetch), `attention` (+ split-K combine), `o_proj`, `ffn`
//! (post-attention norm, gate|up, SwiGLU, down) and `write-back` (its own
//! track). Span args carry layer and step; fetch spans also the bytes and
//! (block, head) tiles fetched (each traced step copies its fetch counts on
//! the device; they are read when the trace is flushed). With tracing off
//! the timeline is disabled: no events, no CUDA calls.

use super::*;
use crate::trace::timeline::{GpuTimeline, SpanId, SpanMeta};
use crate::trace::Track;
use cudarc::driver::{CudaSlice, CudaStream};

/// Upper bound of the spans one layer records in a decode step (qkv,
/// rope_append, compress, select, diff, fetch, wait, attention, o_proj, ffn,
/// write-back, and the layer-0 fetch of forecast mode).
pub const SPANS_PER_LAYER: usize = 12;

/// Fetch counts of one traced step, read when the trace is flushed.
pub(crate) struct PendingFetch {
    /// i32 [L, rows, Hkv]: the step's per-(layer, row, head) fetches.
    pub(crate) nfetch: CudaSlice<i32>,
    pub(crate) layers: usize,
    pub(crate) step: u32,
    /// Layers that recorded a fetch span in that step.
    pub(crate) fetch_layers: Vec<usize>,
}

impl GpuModel {
    /// Records GPU spans from now on when `on` and a trace session is
    /// recording ([`crate::trace::is_recording`]); anchors the timeline
    /// (drains the compute stream). Decode steps then run without CUDA
    /// graphs.
    ///
    /// Errors: CUDA failures while anchoring.
    pub fn set_trace(&mut self, on: bool) -> Result<()> {
        let enabled = on && crate::trace::is_recording();
        if enabled == self.timeline.borrow().is_enabled() {
            return Ok(());
        }
        let tl = GpuTimeline::new(&self.gpu, enabled)?;
        *self.timeline.borrow_mut() = tl;
        self.fetch_spans.borrow_mut().clear();
        self.trace_fetches.borrow_mut().clear();
        self.step = None;
        Ok(())
    }

    /// Pre-creates the CUDA events of `steps` traced decode steps
    /// (`SPANS_PER_LAYER` spans per layer), so that timed traced steps do
    /// not create events between launches. No-op when tracing is off.
    ///
    /// Errors: CUDA failures creating events.
    pub fn reserve_trace(&mut self, steps: usize) -> Result<()> {
        let spans = steps * self.layers.len() * SPANS_PER_LAYER;
        self.timeline.borrow_mut().reserve(spans)
    }

    /// The host cost of a GPU span on the compute stream, measured over
    /// `n` spans ([`GpuTimeline::host_cost`]); `None` when not tracing.
    ///
    /// Errors: CUDA failures while recording or timing events.
    pub fn trace_host_cost(
        &mut self,
        n: usize,
    ) -> Result<Option<crate::trace::timeline::SpanHostCost>> {
        self.gpu.synchronize()?;
        let stream = self.gpu.stream().clone();
        self.timeline.borrow_mut().host_cost(&stream, n)
    }

    /// Whether GPU spans are being recorded.
    pub fn trace_on(&self) -> bool {
        self.timeline.borrow().is_enabled()
    }

    /// Hands the recorded spans to the trace session (blocks until the GPU
    /// work they cover is done). Returns the spans submitted.
    ///
    /// Errors: CUDA failures while timing the events.
    pub fn flush_trace(&mut self) -> Result<usize> {
        // Fetch spans get their bytes now, from the counts each traced step
        // copied on the device, matched by (layer, step) on the collected
        // spans (span ids may have been reused since).
        let pending: Vec<PendingFetch> = self.trace_fetches.borrow_mut().drain(..).collect();
        let chunk = (2 * self.plan.budget.block_size * self.config.head_dim * 2) as u64;
        let mut tiles = std::collections::HashMap::new();
        for p in pending {
            let nf = self.gpu.download(&p.nfetch)?;
            let per = nf.len() / p.layers.max(1);
            for l in p.fetch_layers {
                let t: u64 = nf[l * per..((l + 1) * per).min(nf.len())]
                    .iter()
                    .map(|&x| x.max(0) as u64)
                    .sum();
                tiles.insert((l as u32, p.step), t);
            }
        }
        self.timeline.borrow_mut().submit_with(|spans| {
            for s in spans.iter_mut().filter(|s| s.name == "fetch") {
                if let (Some(l), Some(st)) = (s.layer, s.step) {
                    if let Some(&t) = tiles.get(&(l, st)) {
                        s.bytes = Some(t * chunk);
                        s.blocks = Some(t as u32);
                    }
                }
            }
        })
    }

    /// Begins a span of `name` at `layer` on `stream` (no-op when tracing is off).
    pub(crate) fn tspan(
        &self,
        stream: &CudaStream,
        track: Track,
        name: &'static str,
        layer: usize,
    ) -> Result<SpanId> {
        self.tspan_after(stream, SpanId::NONE, track, name, layer)
    }

    /// Ends span `id` and begins `name` at `layer` on the same stream with
    /// one shared event ([`GpuTimeline::next`]): for phases that follow each
    /// other directly on `stream`.
    pub(crate) fn tspan_next(
        &self,
        stream: &CudaStream,
        id: SpanId,
        name: &'static str,
        layer: usize,
    ) -> Result<SpanId> {
        self.tspan_after(stream, id, Track::Compute, name, layer)
    }

    /// [`GpuTimeline::next`] at this step (`id` = NONE: a plain begin).
    pub(crate) fn tspan_after(
        &self,
        stream: &CudaStream,
        id: SpanId,
        track: Track,
        name: &'static str,
        layer: usize,
    ) -> Result<SpanId> {
        let mut tl = self.timeline.borrow_mut();
        if !tl.is_enabled() {
            return Ok(SpanId::NONE);
        }
        tl.next(
            stream,
            id,
            track,
            name,
            SpanMeta::at(layer as u32, self.trace_step.get()),
        )
    }

    /// Ends a span begun by [`GpuModel::tspan`].
    pub(crate) fn tspan_end(&self, stream: &CudaStream, id: SpanId) -> Result<()> {
        if id.is_none() {
            return Ok(());
        }
        self.timeline.borrow_mut().end(stream, id)
    }

    /// Notes a fetch span of `layer`, whose bytes are filled in after the step.
    pub(crate) fn note_fetch_span(&self, layer: usize, id: SpanId) {
        if !id.is_none() {
            self.fetch_spans.borrow_mut().push((layer, id));
        }
    }

    /// After a traced step: copies the step's per-layer fetch counts on the
    /// device (no host synchronisation; [`GpuModel::flush_trace`] reads
    /// them and puts bytes and tiles on the fetch spans) and advances the
    /// step counter of the spans.
    pub(crate) fn finish_traced_step(&self) -> Result<()> {
        if !self.trace_on() {
            return Ok(());
        }
        let spans: Vec<(usize, SpanId)> = self.fetch_spans.borrow_mut().drain(..).collect();
        if let (false, Some(st)) = (spans.is_empty(), self.step.as_ref()) {
            if let Some(nfetch) = st.off.as_ref().map(|o| o.nfetch_buffer()) {
                let s = self.gpu.stream();
                let mut copy = s
                    .alloc_zeros::<i32>(nfetch.len())
                    .cuda("allocating a trace fetch-count copy")?;
                s.memcpy_dtod(nfetch, &mut copy)
                    .cuda("copying the fetch counts for the trace")?;
                self.trace_fetches.borrow_mut().push(PendingFetch {
                    nfetch: copy,
                    layers: self.layers.len(),
                    step: self.trace_step.get(),
                    fetch_layers: spans.into_iter().map(|(l, _)| l).collect(),
                });
            }
        }
        self.trace_step.set(self.trace_step.get() + 1);
        // events for the next step, made while the GPU runs this one
        self.timeline
            .borrow_mut()
            .prepare(self.layers.len() * SPANS_PER_LAYER)
    }
}
