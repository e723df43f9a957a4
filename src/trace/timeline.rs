//! GPU spans timed with CUDA events, for `--trace FILE`.
//!
//! A [`GpuTimeline`] records a pair of timing events around work enqueued on
//! any stream of the [`Gpu`]'s context (compute, copy, write-back) and turns
//! them into [`GpuSpan`]s: ms after an anchor event that is tied to the host
//! trace's clock by [`trace::mark_anchor`] (see the `trace` module doc).
//!
//! Cost (host time, printed by the GPU test in `tests/trace.rs`; H200 VM,
//! 2026-11-30, three runs): disabled, every method returns at once (≈ 6 ns
//! a span) and no event exists. Enabled, a span costs two `cuEventRecord`s
//! (1.05–1.35 µs each) and two capture-status queries (≈ 0.03 µs each):
//! 2.0–2.8 µs a span with a warm pool ([`GpuTimeline::reserve`], or the
//! events of an earlier run returned by [`GpuTimeline::collect`]), 2.5–4.9
//! µs while the pool grows. Timing the spans (two `cuEventElapsedTime`s
//! each, 2.5–3.7 µs a span) happens in `collect`, outside the timed loop;
//! inside a run, events of finished spans are reused only past
//! [`HARVEST_ABOVE`] events.
//!
//! Graphs: spans are recorded on eager (non-captured) runs only. `begin` and
//! `end` on a stream that is capturing record nothing (the span is dropped),
//! so tracing never breaks a capture, but a replayed graph shows no GPU
//! spans: the engine should run eagerly while [`GpuTimeline::is_enabled`].
//!
//! Cross-stream waits: the timeline's events are its own; the engine keeps
//! its own events for `cuStreamWaitEvent`. A `wait` span is begun and ended
//! on the waiting stream around the wait, so it measures the time that
//! stream stood idle.

use crate::cuda::context::{CudaResultExt, Gpu};
use crate::trace::{self, GpuBatch, GpuSpan, Track};
use crate::{Error, Result};
use cudarc::driver::result::event;
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;

/// Events a timeline creates before it reuses those of finished spans
/// inside a run. Below it, timing is left to `collect`, since creating an
/// event costs less host time than timing a finished span (see the module
/// doc); above it, memory stays bounded on runs that never collect (64 Ki
/// events = 32 Ki spans, about 90 decode steps of NOSA-8B at 11 spans per
/// layer).
pub const HARVEST_ABOVE: usize = 1 << 16;

/// Arguments of a GPU span (all optional): decoder layer, decode step,
/// bytes moved and KV blocks fetched. They become the span's trace args.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpanMeta {
    /// Decoder layer (0-based).
    pub layer: Option<u32>,
    /// Decode step (0-based).
    pub step: Option<u32>,
    /// Bytes moved (fetch, write-back).
    pub bytes: Option<u64>,
    /// (block, head) tiles fetched.
    pub blocks: Option<u32>,
}

/// Host cost of tracing, measured by [`GpuTimeline::host_cost`]
/// (microseconds of host wall time per call).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct SpanHostCost {
    /// Spans (and bare records, and capture queries) measured.
    pub spans: usize,
    /// One span begun and ended (two event records, the capture checks and
    /// the bookkeeping), µs.
    pub span_us: f64,
    /// One bare `cuEventRecord`, µs.
    pub record_us: f64,
    /// GPU time per bare record on the idle stream (first to last of the
    /// `spans` records, by two more events), µs: an upper bound when the
    /// host issues them slower than the GPU retires them.
    pub record_gpu_us: f64,
    /// One capture-status query (`cuStreamIsCapturing`), µs.
    pub capture_query_us: f64,
}

impl SpanMeta {
    /// Meta of layer `layer` at decode step `step`.
    pub fn at(layer: u32, step: u32) -> Self {
        SpanMeta {
            layer: Some(layer),
            step: Some(step),
            ..Self::default()
        }
    }
    /// The same with `bytes` moved and `blocks` fetched.
    pub fn moved(self, bytes: u64, blocks: u32) -> Self {
        SpanMeta {
            bytes: Some(bytes),
            blocks: Some(blocks),
            ..self
        }
    }
}

/// A span begun with [`GpuTimeline::begin`], to pass to
/// [`GpuTimeline::end`]. [`SpanId::NONE`] when nothing was recorded
/// (timeline disabled, or the stream was capturing).
#[must_use = "pass it to GpuTimeline::end"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanId(u32);

impl SpanId {
    /// The id of a span that records nothing; `end` accepts it as a no-op.
    pub const NONE: SpanId = SpanId(u32::MAX);
    /// Whether this is [`SpanId::NONE`].
    pub fn is_none(self) -> bool {
        self == Self::NONE
    }
}

struct Slot {
    track: Track,
    name: &'static str,
    meta: SpanMeta,
    /// Shared with the previous span's end when begun by [`GpuTimeline::next`].
    start: Rc<CudaEvent>,
    /// Shared with the next span's start when that one was begun by `next`.
    end: Option<Rc<CudaEvent>>,
}

/// Returns an event to `pool` once no span holds it any more.
fn give_back(pool: &mut Vec<CudaEvent>, ev: Rc<CudaEvent>) {
    if let Ok(e) = Rc::try_unwrap(ev) {
        pool.push(e);
    }
}

/// The state of an enabled timeline.
struct Recorder {
    gpu_ctx: Arc<cudarc::driver::CudaContext>,
    compute: Arc<CudaStream>,
    /// Reference event; spans are timed from it.
    anchor: CudaEvent,
    /// Time of `anchor` after the first anchor, ms (grows at re-anchoring).
    anchor_ms: f64,
    /// Id of the first anchor's host event.
    anchor_id: u64,
    pool: Vec<CudaEvent>,
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    /// Ended spans not yet converted, in `end` order.
    closed: VecDeque<u32>,
    open: usize,
    done: Vec<GpuSpan>,
    created: usize,
}

/// GPU spans of one engine, timed with CUDA events (see the module doc).
///
/// Typical use: create it once with `enabled = trace::is_recording()`, wrap
/// each phase in [`begin`](Self::begin)/[`end`](Self::end) (or
/// [`span`](Self::span)), and call [`submit`](Self::submit) at the end of a
/// run (it blocks; keep it out of timed loops).
pub struct GpuTimeline {
    rec: Option<Box<Recorder>>,
}

impl std::fmt::Debug for GpuTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.rec {
            None => f.write_str("GpuTimeline(disabled)"),
            Some(r) => f
                .debug_struct("GpuTimeline")
                .field("anchor_id", &r.anchor_id)
                .field("open", &r.open)
                .field("pending", &r.closed.len())
                .field("events", &r.created)
                .finish(),
        }
    }
}

fn capturing(stream: &CudaStream) -> Result<bool> {
    let s = stream
        .capture_status()
        .cuda("cuStreamIsCapturing (trace span)")?;
    Ok(s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl GpuTimeline {
    /// A timeline on `gpu`'s context. Disabled: no CUDA call now or later.
    /// Enabled: anchors at once — waits for the compute stream
    /// ([`Gpu::stream`]) to drain, records the anchor event on it and emits
    /// the host [`trace::ANCHOR_EVENT`] — so create it while tracing
    /// already records and the GPU is idle (engine setup).
    ///
    /// Errors: [`Error::Cuda`] when an event cannot be created, recorded or
    /// waited for.
    pub fn new(gpu: &Gpu, enabled: bool) -> Result<Self> {
        if !enabled {
            return Ok(GpuTimeline { rec: None });
        }
        let compute = gpu.stream().clone();
        compute
            .synchronize()
            .cuda("cuStreamSynchronize (trace anchor)")?;
        let anchor = gpu.timing_event()?;
        anchor
            .record(&compute)
            .cuda("cuEventRecord (trace anchor)")?;
        let anchor_id = trace::mark_anchor();
        anchor
            .synchronize()
            .cuda("cuEventSynchronize (trace anchor)")?;
        Ok(GpuTimeline {
            rec: Some(Box::new(Recorder {
                gpu_ctx: gpu.context().clone(),
                compute,
                anchor,
                anchor_ms: 0.0,
                anchor_id,
                pool: Vec::new(),
                slots: Vec::new(),
                free: Vec::new(),
                closed: VecDeque::new(),
                open: 0,
                done: Vec::new(),
                created: 1,
            })),
        })
    }

    /// Whether spans are recorded (when so, the engine should not replay
    /// CUDA graphs: captured work shows no spans).
    pub fn is_enabled(&self) -> bool {
        self.rec.is_some()
    }

    /// Id of the anchor's host event ([`GpuBatch::anchor`]); `None` when
    /// disabled.
    pub fn anchor_id(&self) -> Option<u64> {
        self.rec.as_ref().map(|r| r.anchor_id)
    }

    /// CUDA events created so far (anchor included; 0 when disabled): stays
    /// flat once the pool covers the spans in flight.
    pub fn events_created(&self) -> usize {
        self.rec.as_ref().map_or(0, |r| r.created)
    }

    /// Pre-creates events so that the next `spans` spans take theirs from
    /// the pool (2 events a span) instead of creating or harvesting them
    /// inside the timed loop; their timing then happens in
    /// [`collect`](Self::collect). E.g. layers × phases × steps of a run.
    /// No-op when disabled.
    ///
    /// Errors: [`Error::Cuda`] when an event cannot be created.
    pub fn reserve(&mut self, spans: usize) -> Result<()> {
        let Some(r) = self.rec.as_deref_mut() else {
            return Ok(());
        };
        while r.pool.len() < 2 * spans {
            let e = r.new_event()?;
            r.pool.push(e);
        }
        Ok(())
    }

    /// Before a traced step of about `spans` spans: when the pool holds
    /// fewer than `2 · spans` events, converts the spans that have finished
    /// (non-blocking, returning their events to the pool), then tops the
    /// pool up to `2 · spans` events, so that the step's `begin`/`end` calls
    /// only record (no `cuEventCreate` between kernel launches). A pool that
    /// is already full (e.g. after [`reserve`](Self::reserve)) costs
    /// nothing. No-op when disabled.
    ///
    /// Errors: [`Error::Cuda`] when an event cannot be queried, timed or
    /// created.
    pub fn prepare(&mut self, spans: usize) -> Result<()> {
        let Some(r) = self.rec.as_deref_mut() else {
            return Ok(());
        };
        if r.pool.len() < 2 * spans {
            r.harvest()?;
        }
        self.reserve(spans)
    }

    /// Starts a span named `name` on `track`: records a start event on
    /// `stream` (after the work already enqueued there). Returns
    /// [`SpanId::NONE`] and records nothing when disabled or when `stream`
    /// is capturing a graph.
    ///
    /// Errors: [`Error::Cuda`] when an event cannot be created or recorded
    /// (e.g. `stream` belongs to another context).
    pub fn begin(
        &mut self,
        stream: &CudaStream,
        track: Track,
        name: &'static str,
        meta: SpanMeta,
    ) -> Result<SpanId> {
        let Some(r) = self.rec.as_deref_mut() else {
            return Ok(SpanId::NONE);
        };
        if capturing(stream)? {
            return Ok(SpanId::NONE);
        }
        let start = r.take_event()?;
        if let Err(e) = start.record(stream) {
            r.pool.push(start);
            return Err(Error::Cuda(format!(
                "cuEventRecord (trace span `{name}` start): {e}"
            )));
        }
        Ok(r.open_slot(track, name, meta, Rc::new(start)))
    }

    /// Ends span `id` and begins the next one (`name` on `track`) on the
    /// same `stream` with one event, which is both the end of `id` and the
    /// start of the new span: back-to-back phases of one stream cost one
    /// `cuEventRecord` each instead of two. Work enqueued on `stream`
    /// between the two calls would count in neither span, so call it where
    /// one phase directly follows the other. With `id` = [`SpanId::NONE`]
    /// it is [`begin`](Self::begin); on a capturing stream it ends `id` as
    /// [`end`](Self::end) does and records nothing.
    ///
    /// Errors: as [`end`](Self::end) and [`begin`](Self::begin).
    pub fn next(
        &mut self,
        stream: &CudaStream,
        id: SpanId,
        track: Track,
        name: &'static str,
        meta: SpanMeta,
    ) -> Result<SpanId> {
        if self.rec.is_none() {
            return Ok(SpanId::NONE);
        }
        if id.is_none() || capturing(stream)? {
            self.end(stream, id)?;
            return self.begin(stream, track, name, meta);
        }
        let r = self.rec.as_deref_mut().expect("checked above");
        let i = r.open_index(id)?;
        let ev = r.take_event()?;
        if let Err(e) = ev.record(stream) {
            r.pool.push(ev);
            return Err(Error::Cuda(format!(
                "cuEventRecord (trace span `{name}` start): {e}"
            )));
        }
        let ev = Rc::new(ev);
        r.close_slot(i, ev.clone());
        Ok(r.open_slot(track, name, meta, ev))
    }

    /// Ends span `id`: records its end event on `stream` (normally the
    /// stream it began on; otherwise the span covers the time between the
    /// two recording points). [`SpanId::NONE`] is a no-op; on a capturing
    /// stream the span is dropped.
    ///
    /// Errors: [`Error::Cuda`] for an id that is not open (ended twice, or
    /// from another timeline), or when the event cannot be recorded.
    pub fn end(&mut self, stream: &CudaStream, id: SpanId) -> Result<()> {
        let Some(r) = self.rec.as_deref_mut() else {
            return Ok(());
        };
        if id.is_none() {
            return Ok(());
        }
        let i = r.open_index(id)?;
        if capturing(stream)? {
            let slot = r.slots[i].take().expect("checked above");
            give_back(&mut r.pool, slot.start);
            r.free.push(id.0);
            r.open -= 1;
            return Ok(());
        }
        let name = r.slots[i].as_ref().expect("checked above").name;
        let end = r.take_event()?;
        if let Err(e) = end.record(stream) {
            r.pool.push(end);
            return Err(Error::Cuda(format!(
                "cuEventRecord (trace span `{name}` end): {e}"
            )));
        }
        r.close_slot(i, Rc::new(end));
        Ok(())
    }

    /// Runs `enqueue` (which puts work on `stream`) inside a span: `begin`,
    /// `enqueue()`, `end`. The span is ended also when `enqueue` fails.
    ///
    /// Errors: `enqueue`'s error first, then those of `begin`/`end`.
    pub fn span<T>(
        &mut self,
        stream: &CudaStream,
        track: Track,
        name: &'static str,
        meta: SpanMeta,
        enqueue: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let id = self.begin(stream, track, name, meta)?;
        let out = enqueue();
        let ended = self.end(stream, id);
        let out = out?;
        ended?;
        Ok(out)
    }

    /// Measures the host cost of tracing on `stream` (idle, nothing else
    /// enqueued meanwhile): `n` spans begun and ended back to back (two
    /// `cuEventRecord`s and the capture checks each), then `n` bare
    /// `cuEventRecord`s of one event (also timed on the GPU), then `n`
    /// capture-status queries; microseconds per call of each, host wall time. The measuring spans
    /// are timed and dropped (not submitted). `None` when disabled.
    ///
    /// Errors: [`Error::Cuda`] when an event cannot be recorded or timed.
    pub fn host_cost(&mut self, stream: &CudaStream, n: usize) -> Result<Option<SpanHostCost>> {
        if self.rec.is_none() || n == 0 {
            return Ok(None);
        }
        // spans already ended stay in the trace: time them first
        let kept = self.collect()?;
        self.reserve(n)?; // no cuEventCreate inside the timed loop
        let t = std::time::Instant::now();
        for _ in 0..n {
            let id = self.begin(stream, Track::Compute, "host-cost", SpanMeta::default())?;
            self.end(stream, id)?;
        }
        let span_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        drop(self.collect()?); // the measuring spans
        let r = self.rec.as_deref_mut().expect("checked above");
        r.done = kept;
        let (first, ev, last) = (r.take_event()?, r.take_event()?, r.take_event()?);
        first
            .record(stream)
            .cuda("cuEventRecord (trace host cost)")?;
        let t = std::time::Instant::now();
        for _ in 0..n {
            ev.record(stream).cuda("cuEventRecord (trace host cost)")?;
        }
        let record_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        last.record(stream)
            .cuda("cuEventRecord (trace host cost)")?;
        last.synchronize()
            .cuda("cuEventSynchronize (trace host cost)")?;
        let gpu_ms = first
            .elapsed_ms(&last)
            .cuda("cuEventElapsedTime (trace host cost)")?;
        let record_gpu_us = f64::from(gpu_ms) * 1e3 / n as f64;
        r.pool.extend([first, ev, last]);
        let t = std::time::Instant::now();
        for _ in 0..n {
            capturing(stream)?;
        }
        let capture_query_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        Ok(Some(SpanHostCost {
            spans: n,
            span_us,
            record_us,
            record_gpu_us,
            capture_query_us,
        }))
    }

    /// Drops every span that was begun but not ended (after a failed
    /// step, whose error path skipped the `end` calls), so that
    /// [`collect`](Self::collect) re-anchors again. Returns how many were
    /// dropped. Their recorded start events go back to the pool unless an
    /// ended span shares them.
    pub fn drop_open(&mut self) -> usize {
        let Some(r) = self.rec.as_deref_mut() else {
            return 0;
        };
        let mut dropped = 0;
        for i in 0..r.slots.len() {
            if r.slots[i].as_ref().is_some_and(|s| s.end.is_none()) {
                let slot = r.slots[i].take().expect("checked");
                give_back(&mut r.pool, slot.start);
                r.free.push(i as u32);
                dropped += 1;
            }
        }
        r.open -= dropped;
        dropped
    }

    /// Waits for every ended span and returns all spans not returned before,
    /// `start_ms` after the anchor (f64 ms; CUDA's event resolution is about
    /// 0.5 µs). Open spans stay open. When none is open, re-anchors on the
    /// compute stream (waiting for it to drain) so that later offsets keep
    /// f32 precision over long runs. Blocking: call outside timed loops.
    /// Empty when disabled.
    ///
    /// Errors: [`Error::Cuda`] when an event cannot be waited for or timed
    /// (an earlier kernel or copy failed).
    pub fn collect(&mut self) -> Result<Vec<GpuSpan>> {
        let Some(r) = self.rec.as_deref_mut() else {
            return Ok(Vec::new());
        };
        r.bind()?;
        while let Some(i) = r.closed.pop_front() {
            r.convert(i)?;
        }
        if r.open == 0 {
            r.reanchor()?;
        }
        Ok(std::mem::take(&mut r.done))
    }

    /// [`collect`](Self::collect)s and hands the spans to the recording
    /// trace session ([`trace::submit_gpu_spans`]) under this timeline's
    /// anchor. Returns the number of spans accepted (0 when disabled or no
    /// session records).
    ///
    /// Errors: as `collect`.
    pub fn submit(&mut self) -> Result<usize> {
        self.submit_with(|_| {})
    }

    /// As [`submit`](Self::submit), letting `patch` complete the collected
    /// spans first (e.g. bytes known only after the run).
    ///
    /// Errors: as [`collect`](Self::collect).
    pub fn submit_with(&mut self, patch: impl FnOnce(&mut [GpuSpan])) -> Result<usize> {
        let mut spans = self.collect()?;
        patch(&mut spans);
        let (Some(anchor), n) = (self.anchor_id(), spans.len()) else {
            return Ok(0);
        };
        if n == 0 || !trace::submit_gpu_spans(GpuBatch { anchor, spans }) {
            return Ok(0);
        }
        Ok(n)
    }
}

impl Recorder {
    /// Index of open span `id`.
    fn open_index(&self, id: SpanId) -> Result<usize> {
        let i = id.0 as usize;
        match self.slots.get(i) {
            Some(Some(s)) if s.end.is_none() => Ok(i),
            _ => Err(Error::Cuda(format!(
                "trace span {}: end() without an open begin() (ended twice, or from another timeline)",
                id.0
            ))),
        }
    }

    /// Stores a new open span starting at `start`.
    fn open_slot(
        &mut self,
        track: Track,
        name: &'static str,
        meta: SpanMeta,
        start: Rc<CudaEvent>,
    ) -> SpanId {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[idx as usize] = Some(Slot {
            track,
            name,
            meta,
            start,
            end: None,
        });
        self.open += 1;
        SpanId(idx)
    }

    /// Marks open span `i` ended at `end` (recorded).
    fn close_slot(&mut self, i: usize, end: Rc<CudaEvent>) {
        self.slots[i].as_mut().expect("an open span").end = Some(end);
        self.open -= 1;
        self.closed.push_back(i as u32);
    }

    /// Makes the context current on this thread (for the raw event calls).
    fn bind(&self) -> Result<()> {
        self.gpu_ctx
            .bind_to_thread()
            .cuda("cuCtxSetCurrent (trace)")
    }

    /// An event from the pool, else a new one. Past [`HARVEST_ABOVE`]
    /// events, first refills the pool from finished spans (non-blocking).
    fn take_event(&mut self) -> Result<CudaEvent> {
        if let Some(e) = self.pool.pop() {
            return Ok(e);
        }
        if self.created >= HARVEST_ABOVE {
            self.harvest()?;
            if let Some(e) = self.pool.pop() {
                return Ok(e);
            }
        }
        self.new_event()
    }

    fn new_event(&mut self) -> Result<CudaEvent> {
        self.created += 1;
        self.gpu_ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .cuda("cuEventCreate (trace span)")
    }

    /// Converts the oldest ended spans whose end event has completed; stops
    /// at the first that has not (one query when the GPU is behind).
    fn harvest(&mut self) -> Result<()> {
        if !self.closed.is_empty() {
            self.bind()?;
        }
        while let Some(&i) = self.closed.front() {
            let slot = self.slots[i as usize].as_ref().expect("closed span");
            let end = slot.end.as_ref().expect("closed span has an end event");
            if !end.try_is_complete().cuda("cuEventQuery (trace span)")? {
                break;
            }
            self.closed.pop_front();
            self.convert(i)?;
        }
        Ok(())
    }

    /// Times span `i` (waiting for its events), stores it in `done` and
    /// returns its events to the pool.
    fn convert(&mut self, i: u32) -> Result<()> {
        let slot = self.slots[i as usize].take().expect("closed span");
        let end = slot.end.expect("closed span has an end event");
        let what = |e: cudarc::driver::DriverError| {
            Error::Cuda(format!(
                "cuEventSynchronize / cuEventElapsedTime (trace span `{}`): {e}",
                slot.name
            ))
        };
        // SAFETY: live events of this context (made current by the caller),
        // all recorded: the anchor completed before any span began, and the
        // two syncs make sure start and end have completed.
        let (from_anchor, dur) = unsafe {
            event::synchronize(end.cu_event()).map_err(what)?;
            event::synchronize(slot.start.cu_event()).map_err(what)?;
            (
                event::elapsed(self.anchor.cu_event(), slot.start.cu_event()).map_err(what)?,
                event::elapsed(slot.start.cu_event(), end.cu_event()).map_err(what)?,
            )
        };
        self.done.push(GpuSpan {
            track: slot.track,
            name: slot.name.to_string(),
            start_ms: self.anchor_ms + f64::from(from_anchor),
            dur_ms: f64::from(dur),
            layer: slot.meta.layer,
            step: slot.meta.step,
            bytes: slot.meta.bytes,
            blocks: slot.meta.blocks,
        });
        give_back(&mut self.pool, slot.start);
        give_back(&mut self.pool, end);
        self.free.push(i);
        Ok(())
    }

    /// Moves the reference event to now (compute stream drained), so every
    /// event recorded later completes after it.
    fn reanchor(&mut self) -> Result<()> {
        let ev = self.take_event()?;
        ev.record(&self.compute)
            .cuda("cuEventRecord (trace re-anchor)")?;
        ev.synchronize()
            .cuda("cuEventSynchronize (trace re-anchor)")?;
        let gap = self
            .anchor
            .elapsed_ms(&ev)
            .cuda("cuEventElapsedTime (trace re-anchor)")?;
        self.anchor_ms += f64::from(gap);
        let old = std::mem::replace(&mut self.anchor, ev);
        self.pool.push(old);
        Ok(())
    }
}
