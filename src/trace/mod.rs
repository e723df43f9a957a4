//! Chrome/Perfetto traces that show copy/compute overlap, and their summary
//! (runtime.md §3 fault 10: idle waiting is not transfer time).
//!
//! A trace is the Chrome trace-event JSON (`{"traceEvents": [...]}`) that
//! Perfetto and chrome://tracing read. Host spans come from `tracing` +
//! `tracing-chrome`; GPU spans are measured with CUDA events and placed on
//! one track per stream ([`Track`]), aligned to the host clock through an
//! anchor: a CUDA event recorded at a known host time (µs).
//!
//! Recording: [`init_subscriber`] installs the process's `tracing`
//! subscriber (stderr logging filtered by `$SPARDA_LOG`, and with `--trace
//! FILE` a tracing-chrome layer writing host spans to `FILE.host.tmp`); the
//! CUDA engine records GPU spans with `trace::timeline::GpuTimeline` and
//! hands them over with [`submit_gpu_spans`]; [`TraceSession::finish`]
//! merges both into `FILE`. tracing-chrome 0.7 stamps every event with µs
//! since its layer was built (a private `Instant`), so the GPU clock is tied
//! to the host one through a host instant event named [`ANCHOR_EVENT`],
//! emitted right after the anchor CUDA event is recorded on an idle stream;
//! its `ts` is the anchor's host time (exact up to the few µs between the
//! record call and the GPU executing it).
//!
//! The summary works on intervals, so it counts what really happened:
//! - **H2D total**: the union of `fetch` spans on the copy track (the copy
//!   itself, measured by events around it, never the time anyone waited);
//! - **hidden**: the part of that union during which the compute track was
//!   busy with any span other than `wait`;
//! - **exposed**: the rest (transfer while compute was idle or waiting);
//! - **overlap %** = hidden / H2D total;
//! - **beside a fetch** ([`BesideFetch`]): per compute phase, the mean
//!   duration of its spans that ran alongside a fetch (at least
//!   [`UNDER_FETCH`] of the span covered by the fetch union) against those
//!   that ran without one (at most [`WITHOUT_FETCH`] covered), e.g. the
//!   last layer's, which prefetches nothing: how much the fetch slows the
//!   compute it overlaps (runtime.md §4).
//!
//! Per-step means divide by the number of decode steps ([`Summary::steps`]):
//! the steps of the GPU spans when the trace has any, else those of the host
//! decode-step spans (a `generate --backend cpu --trace` run).

pub mod cta;
pub mod timeline;

use crate::{Error, Result};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Where a span ran. GPU tracks get fixed thread ids in the trace so that
/// viewers show one row per stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Track {
    /// The compute stream.
    Compute,
    /// The host-to-device fetch (prefetch) stream.
    Copy,
    /// The device-to-host write-back stream.
    WriteBack,
}

impl Track {
    /// Thread id used for this track in the trace (host threads use small ids).
    pub fn tid(self) -> u64 {
        match self {
            Track::Compute => 1_000_001,
            Track::Copy => 1_000_002,
            Track::WriteBack => 1_000_003,
        }
    }
    /// Track name shown by the viewer.
    pub fn name(self) -> &'static str {
        match self {
            Track::Compute => "gpu: compute stream",
            Track::Copy => "gpu: copy stream (H2D fetch)",
            Track::WriteBack => "gpu: write-back stream (D2H)",
        }
    }
    fn from_tid(tid: u64) -> Option<Track> {
        [Track::Compute, Track::Copy, Track::WriteBack]
            .into_iter()
            .find(|t| t.tid() == tid)
    }
}

/// One GPU span, timed by CUDA events relative to the anchor event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuSpan {
    /// Stream it ran on.
    pub track: Track,
    /// Phase: qkv (input norm and QKV GEMM), rope_append (RoPE, K/V append,
    /// eviction score), compress, prep, select, diff, fetch, wait, attention,
    /// o_proj, ffn, write-back, …
    pub name: String,
    /// Start, ms after the anchor event (`cuEventElapsedTime(anchor, start)`).
    pub start_ms: f64,
    /// Duration, ms.
    pub dur_ms: f64,
    /// Decoder layer, if any.
    pub layer: Option<u32>,
    /// Decode step, if any.
    pub step: Option<u32>,
    /// Bytes moved (fetch / write-back), if any.
    pub bytes: Option<u64>,
    /// Blocks fetched, if any.
    pub blocks: Option<u32>,
}

/// Process id of the GPU tracks (tracing-chrome writes every host event
/// under [`HOST_PID`]).
pub const GPU_PID: u64 = 2;

/// Process id that tracing-chrome 0.7 gives every host event.
pub const HOST_PID: u64 = 1;

/// Name of the host instant event that marks a GPU anchor (see the module doc).
pub const ANCHOR_EVENT: &str = "gpu-anchor";

/// Metadata events naming the GPU process and its three tracks (Perfetto and
/// chrome://tracing show "gpu: compute stream" etc., in this order).
pub fn gpu_metadata() -> Vec<Value> {
    let mut out = vec![
        json!({"ph": "M", "name": "process_name", "pid": GPU_PID, "args": {"name": "gpu (CUDA events)"}}),
    ];
    for (i, t) in [Track::Compute, Track::Copy, Track::WriteBack]
        .iter()
        .enumerate()
    {
        out.push(json!({"ph": "M", "name": "thread_name", "pid": GPU_PID, "tid": t.tid(), "args": {"name": t.name()}}));
        out.push(json!({"ph": "M", "name": "thread_sort_index", "pid": GPU_PID, "tid": t.tid(), "args": {"sort_index": i}}));
    }
    out
}

/// µs rounded to whole ns (CUDA events resolve ≈ 0.5 µs; keeps files small).
fn ns(us: f64) -> f64 {
    (us * 1e3).round() / 1e3
}

/// One complete event (`ph: "X"`, µs) for a GPU span whose anchor is at
/// `anchor_host_us` on the host clock; args carry layer/step/bytes/blocks.
fn span_event(s: &GpuSpan, anchor_host_us: f64) -> Value {
    let mut args = serde_json::Map::new();
    for (k, v) in [
        ("layer", s.layer.map(u64::from)),
        ("step", s.step.map(u64::from)),
        ("bytes", s.bytes),
        ("blocks", s.blocks.map(u64::from)),
    ] {
        if let Some(v) = v {
            args.insert(k.into(), json!(v));
        }
    }
    json!({
        "ph": "X", "cat": "gpu", "name": s.name, "pid": GPU_PID, "tid": s.track.tid(),
        "ts": ns(anchor_host_us + s.start_ms * 1e3), "dur": ns(s.dur_ms * 1e3), "args": Value::Object(args),
    })
}

/// Chrome trace events (`ph: "X"`, times in µs) for GPU spans, placed on the
/// host clock: ts = `anchor_host_us` + start_ms·1000, dur = dur_ms·1000.
/// Starts with [`gpu_metadata`].
pub fn gpu_events(spans: &[GpuSpan], anchor_host_us: f64) -> Vec<Value> {
    let mut out = gpu_metadata();
    out.extend(spans.iter().map(|s| span_event(s, anchor_host_us)));
    out
}

/// The event list of a host trace: `{"traceEvents": [...]}` or a bare array.
fn host_events(host: Value) -> Result<Vec<Value>> {
    Ok(match host {
        Value::Array(a) => a,
        Value::Object(mut o) => match o.remove("traceEvents") {
            Some(Value::Array(a)) => a,
            _ => {
                return Err(Error::Input(
                    "host trace: object without a `traceEvents` array".into(),
                ))
            }
        },
        _ => {
            return Err(Error::Input(
                "host trace: expected a JSON array or {\"traceEvents\": [...]}".into(),
            ))
        }
    })
}

/// Merges GPU spans into a host trace (the JSON that tracing-chrome wrote,
/// either `{"traceEvents": [...]}` or a bare array), with the anchor at
/// `anchor_host_us` (µs on the host trace's clock).
///
/// Errors: a host trace that is neither form.
pub fn merge(host: Value, spans: &[GpuSpan], anchor_host_us: f64) -> Result<Value> {
    let mut events = host_events(host)?;
    events.extend(gpu_events(spans, anchor_host_us));
    Ok(json!({"traceEvents": events, "displayTimeUnit": "ms"}))
}

/// GPU spans measured against one anchor (one `GpuTimeline`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GpuBatch {
    /// Id of the anchor: the `anchor` argument of the host
    /// [`ANCHOR_EVENT`] instant event that [`mark_anchor`] emitted.
    pub anchor: u64,
    /// Spans, `start_ms` relative to that anchor.
    pub spans: Vec<GpuSpan>,
}

/// Host time (µs, the trace's clock) of the [`ANCHOR_EVENT`] instant event
/// whose `anchor` argument is `id` (a number, or the string tracing-chrome
/// writes for it); `None` when the trace has none.
pub fn anchor_ts(events: &[Value], id: u64) -> Option<f64> {
    events.iter().find_map(|e| {
        let instant = matches!(e.get("ph").and_then(Value::as_str), Some("i" | "I"));
        let named = e.get("name").and_then(Value::as_str) == Some(ANCHOR_EVENT);
        let arg = e.get("args").and_then(|a| a.get("anchor"));
        let matches = match arg {
            Some(Value::Number(n)) => n.as_u64() == Some(id),
            Some(Value::String(s)) => s.parse::<u64>().ok() == Some(id),
            _ => false,
        };
        if instant && named && matches {
            e.get("ts").and_then(Value::as_f64)
        } else {
            None
        }
    })
}

/// Merges GPU batches into a tracing-chrome host trace: each batch is placed
/// at the `ts` of its own [`ANCHOR_EVENT`] (see [`anchor_ts`]); adds
/// [`gpu_metadata`] once and names the host process ([`HOST_PID`]).
///
/// Errors: a host trace that is not a trace; a batch with spans whose anchor
/// event is missing (e.g. the timeline was created before tracing started).
pub fn merge_batches(host: Value, batches: &[GpuBatch]) -> Result<Value> {
    let mut events = host_events(host)?;
    let mut gpu = gpu_metadata();
    for b in batches.iter().filter(|b| !b.spans.is_empty()) {
        let at = anchor_ts(&events, b.anchor).ok_or_else(|| {
            Error::Input(format!(
                "host trace has no `{ANCHOR_EVENT}` instant event with anchor {} for {} GPU spans (was the GPU timeline created before tracing started?)",
                b.anchor,
                b.spans.len()
            ))
        })?;
        gpu.extend(b.spans.iter().map(|s| span_event(s, at)));
    }
    events.push(json!({"ph": "M", "name": "process_name", "pid": HOST_PID, "args": {"name": "sparda (host)"}}));
    events.extend(gpu);
    Ok(json!({"traceEvents": events, "displayTimeUnit": "ms"}))
}

static NEXT_ANCHOR: AtomicU64 = AtomicU64::new(1);

/// GPU batches submitted while a [`TraceSession`] records (`None`: none does).
static SINK: Mutex<Option<Vec<GpuBatch>>> = Mutex::new(None);

fn sink() -> std::sync::MutexGuard<'static, Option<Vec<GpuBatch>>> {
    SINK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Emits the host instant event [`ANCHOR_EVENT`] (target `sparda::trace`,
/// level INFO, argument `anchor` = the returned id, unique in the process)
/// at the moment of the call. `GpuTimeline` calls it right after recording
/// its anchor CUDA event; without a trace session the event goes nowhere.
pub fn mark_anchor() -> u64 {
    let id = NEXT_ANCHOR.fetch_add(1, Ordering::Relaxed);
    tracing::event!(name: ANCHOR_EVENT, target: "sparda::trace", tracing::Level::INFO, anchor = id);
    id
}

/// Whether a [`TraceSession`] is recording (`--trace FILE` was given): the
/// engine creates its `GpuTimeline` enabled exactly then.
pub fn is_recording() -> bool {
    sink().is_some()
}

/// Hands GPU spans to the recording [`TraceSession`], which merges them at
/// [`TraceSession::finish`]. Returns `false` (and drops them) when no
/// session records.
pub fn submit_gpu_spans(batch: GpuBatch) -> bool {
    match sink().as_mut() {
        Some(v) => {
            v.push(batch);
            true
        }
        None => false,
    }
}

/// A `--trace FILE` recording: host spans stream to `FILE.host.tmp` through
/// tracing-chrome while it runs; [`TraceSession::finish`] writes `FILE`.
/// At most one records at a time. Dropping it without `finish` stops the
/// recording and leaves the temporary file.
pub struct TraceSession {
    path: PathBuf,
    host_path: PathBuf,
    guard: Option<tracing_chrome::FlushGuard>,
}

impl std::fmt::Debug for TraceSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceSession")
            .field("path", &self.path)
            .field("host_path", &self.host_path)
            .finish()
    }
}

impl TraceSession {
    /// Starts recording: creates `path.host.tmp` (so a bad path fails now,
    /// not after the run) and returns the tracing-chrome layer to install
    /// (spans and events of targets `sparda*`, with their fields as args).
    fn start<S>(path: &Path) -> Result<(impl tracing_subscriber::Layer<S>, TraceSession)>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
    {
        use tracing_subscriber::Layer;
        let mut host = path.as_os_str().to_owned();
        host.push(".host.tmp");
        let host_path = PathBuf::from(host);
        {
            let mut s = sink();
            if s.is_some() {
                return Err(Error::Input(format!(
                    "{}: another trace session is already recording",
                    path.display()
                )));
            }
            *s = Some(Vec::new());
        }
        let file = std::fs::File::create(&host_path).map_err(|e| {
            sink().take();
            Error::Input(format!(
                "--trace {}: cannot write there ({e}; host spans go to {} during the run)",
                path.display(),
                host_path.display()
            ))
        })?;
        let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
            .writer(file)
            .include_args(true)
            .include_locations(false)
            .build();
        let filter =
            tracing_subscriber::filter::Targets::new().with_target("sparda", tracing::Level::TRACE);
        let session = TraceSession {
            path: path.to_path_buf(),
            host_path,
            guard: Some(guard),
        };
        Ok((layer.with_filter(filter), session))
    }

    /// The final trace file (`--trace FILE`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops recording, merges the host spans with every batch given to
    /// [`submit_gpu_spans`] ([`merge_batches`]), writes `{"traceEvents":
    /// [...]}` to the trace file, removes the temporary file and returns the
    /// merged trace (ready for [`summarize`]).
    ///
    /// Errors: the temporary or final file cannot be read or written
    /// ([`Error::Io`]); it is not JSON or a batch's anchor is missing
    /// ([`Error::Input`] naming the file).
    pub fn finish(mut self) -> Result<Value> {
        // Dropping the guard makes tracing-chrome write the closing `]` and
        // joins its writer thread.
        drop(self.guard.take());
        let batches = sink().take().unwrap_or_default();
        let hp = &self.host_path;
        let text = std::fs::read_to_string(hp).map_err(|e| Error::io(hp, e))?;
        let in_file = |m: String| Error::Input(format!("{}: {m}", hp.display()));
        let host: Value = serde_json::from_str(&text)
            .map_err(|e| in_file(format!("tracing-chrome output is not JSON: {e}")))?;
        let merged = merge_batches(host, &batches).map_err(|e| match e {
            Error::Input(m) => in_file(m),
            other => other,
        })?;
        let p = &self.path;
        let f = std::fs::File::create(p).map_err(|e| Error::io(p, e))?;
        let mut w = std::io::BufWriter::new(f);
        serde_json::to_writer(&mut w, &merged)
            .map_err(|e| Error::io(p, std::io::Error::other(e)))?;
        std::io::Write::flush(&mut w).map_err(|e| Error::io(p, e))?;
        std::fs::remove_file(hp).map_err(|e| Error::io(hp, e))?;
        Ok(merged)
    }
}

impl Drop for TraceSession {
    fn drop(&mut self) {
        drop(self.guard.take());
        sink().take();
    }
}

/// Builds the process's subscriber without installing it: stderr logging
/// (filter from `$SPARDA_LOG`, default `warn`) and, with `trace_path`, a
/// recording [`TraceSession`] whose tracing-chrome layer takes every span
/// and event of targets `sparda*` at any level. Without `trace_path` no
/// chrome layer exists and nothing is written. Use with
/// `tracing::dispatcher::with_default` (tests) or [`init_subscriber`].
///
/// Errors: as [`init_subscriber`].
pub fn subscriber(trace_path: Option<&Path>) -> Result<(tracing::Dispatch, Option<TraceSession>)> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let log = EnvFilter::try_from_env("SPARDA_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(log);
    let registry = tracing_subscriber::registry().with(fmt);
    let (chrome, session) = match trace_path {
        Some(p) => {
            let (layer, session) = TraceSession::start(p)?;
            (Some(layer), Some(session))
        }
        None => (None, None),
    };
    Ok((tracing::Dispatch::new(registry.with(chrome)), session))
}

/// Installs the process's global subscriber (see [`subscriber`]); main
/// calls it once with `--trace FILE` (or `None`) and, at the end, calls
/// [`TraceSession::finish`] on the session it returns.
///
/// Errors: the temporary file `FILE.host.tmp` cannot be created
/// ([`Error::Io`]); a session already records or a global subscriber is
/// already installed ([`Error::Input`]).
pub fn init_subscriber(trace_path: Option<&Path>) -> Result<Option<TraceSession>> {
    let (dispatch, session) = subscriber(trace_path)?;
    if let Err(e) = tracing::dispatcher::set_global_default(dispatch) {
        if let Some(s) = session {
            let tmp = s.host_path.clone();
            drop(s);
            let _ = std::fs::remove_file(tmp);
        }
        return Err(Error::Input(format!("tracing subscriber: {e}")));
    }
    Ok(session)
}

/// One complete span read back from a trace, µs.
#[derive(Debug, Clone, PartialEq)]
struct Ev {
    track: Option<Track>,
    name: String,
    ts: f64,
    dur: f64,
    layer: Option<u64>,
    step: Option<u64>,
    bytes: Option<u64>,
    /// Read from a B/E pair (tracing-chrome's host spans) rather than a
    /// complete (`X`) event; only its `step` arg is kept.
    paired: bool,
}

/// Per-phase totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PhaseStats {
    /// Spans seen.
    pub count: usize,
    /// Sum of durations, ms.
    pub total_ms: f64,
    /// total_ms / [`Summary::steps`] (ms per step; 0 when no steps).
    pub per_step_ms: f64,
}

/// Per-layer fetch/overlap figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LayerStats {
    /// Union of this layer's fetch spans, ms.
    pub h2d_ms: f64,
    /// Part of it overlapped by compute, ms.
    pub hidden_ms: f64,
    /// Bytes fetched.
    pub bytes: u64,
    /// Compute-stream `wait` time attributed to this layer, ms.
    pub wait_ms: f64,
}

/// A span counts as run beside a fetch when at least this share of it is
/// covered by the union of the copy track's fetch spans.
pub const UNDER_FETCH: f64 = 0.95;
/// A span counts as run without a fetch when at most this share of it is
/// covered by the union of the copy track's fetch spans.
pub const WITHOUT_FETCH: f64 = 0.05;

/// One compute phase's spans by whether a fetch ran beside them (see the
/// module doc): a phase that takes longer beside a fetch shares the GPU
/// with it (SMs, memory system).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BesideFetch {
    /// Spans at least [`UNDER_FETCH`] covered by fetches.
    pub under_fetch: usize,
    /// Their mean duration, µs (0 when none).
    pub under_fetch_mean_us: f64,
    /// Spans at most [`WITHOUT_FETCH`] covered by fetches.
    pub without_fetch: usize,
    /// Their mean duration, µs (0 when none).
    pub without_fetch_mean_us: f64,
    /// The other spans (partly covered), not in either mean.
    pub partial: usize,
}

impl BesideFetch {
    /// under_fetch_mean_us / without_fetch_mean_us, when both sides have spans.
    pub fn slowdown(&self) -> Option<f64> {
        (self.under_fetch > 0 && self.without_fetch > 0 && self.without_fetch_mean_us > 0.0)
            .then(|| self.under_fetch_mean_us / self.without_fetch_mean_us)
    }
}

/// What `sparda trace summarize` prints.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Distinct decode steps seen (from `args.step`). In a trace with GPU
    /// spans: the `step` args of complete (`X`) events. In a host-only trace
    /// (e.g. `generate --backend cpu --trace`): the `step` args of its host
    /// spans, B/E pairs included, or, when none carries one, the number of
    /// host spans named `decode step` / `decode_step`.
    pub steps: usize,
    /// Per phase (span name, GPU and host alike; host names prefixed `host:`).
    pub phases: BTreeMap<String, PhaseStats>,
    /// Union of fetch spans on the copy track, ms.
    pub h2d_total_ms: f64,
    /// Transfer time during which compute was busy, ms.
    pub h2d_hidden_ms: f64,
    /// Transfer time during which compute was idle or waiting, ms.
    pub h2d_exposed_ms: f64,
    /// hidden / total, percent (0 when no transfer).
    pub overlap_pct: f64,
    /// Union of compute-stream `wait` spans, ms (idle waiting; not transfer).
    pub compute_wait_ms: f64,
    /// Bytes fetched in all.
    pub h2d_bytes: u64,
    /// Achieved H2D rate over the real transfer time, GB/s (1e9 bytes/s).
    pub h2d_gb_per_s: f64,
    /// Per layer (from `args.layer`).
    pub layers: BTreeMap<u64, LayerStats>,
    /// Per compute phase (not `wait`), its spans beside and without a
    /// fetch; empty when the trace has no fetch span on the copy track.
    pub beside_fetch: BTreeMap<String, BesideFetch>,
}

/// Sorted, merged union of intervals [start, end).
fn union(mut iv: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    iv.retain(|(a, b)| b > a);
    iv.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(iv.len());
    for (a, b) in iv {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn length(iv: &[(f64, f64)]) -> f64 {
    iv.iter().fold(0.0, |acc, (a, b)| acc + (b - a))
}

/// Length of the intersection of two unions (each sorted and disjoint).
fn intersect_len(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

fn parse_events(trace: &Value) -> Result<Vec<Ev>> {
    let arr = match trace {
        Value::Array(a) => a,
        Value::Object(o) => o
            .get("traceEvents")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::Input("trace: object without a `traceEvents` array".into()))?,
        _ => {
            return Err(Error::Input(
                "trace: expected a JSON array or {\"traceEvents\": [...]}".into(),
            ))
        }
    };
    let mut out = Vec::new();
    // tracing-chrome may write B/E pairs; pair them per (pid, tid, name),
    // keeping the `step` arg of the B event (or else of the E event).
    type Begun = Vec<(f64, Option<u64>)>;
    let mut open: BTreeMap<(u64, u64, String), Begun> = BTreeMap::new();
    for (i, e) in arr.iter().enumerate() {
        let ph = e.get("ph").and_then(Value::as_str).unwrap_or("");
        let name = e
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let pid = e.get("pid").and_then(Value::as_u64).unwrap_or(0);
        let tid = e.get("tid").and_then(Value::as_u64).unwrap_or(0);
        let ts = e.get("ts").and_then(Value::as_f64);
        // GPU spans carry numbers; tracing-chrome writes host span fields as strings.
        let arg = |k: &str| match e.get("args").and_then(|a| a.get(k)) {
            Some(Value::Number(n)) => n.as_u64(),
            Some(Value::String(s)) => s.parse::<u64>().ok(),
            _ => None,
        };
        let track = if pid == GPU_PID {
            Track::from_tid(tid)
        } else {
            None
        };
        let shown = if track.is_some() {
            name.clone()
        } else {
            format!("host:{name}")
        };
        match ph {
            "X" => {
                let (Some(ts), Some(dur)) = (ts, e.get("dur").and_then(Value::as_f64)) else {
                    return Err(Error::Input(format!(
                        "trace event {i} (`{name}`): complete event without ts/dur"
                    )));
                };
                out.push(Ev {
                    track,
                    name: shown,
                    ts,
                    dur,
                    layer: arg("layer"),
                    step: arg("step"),
                    bytes: arg("bytes"),
                    paired: false,
                });
            }
            "B" => open
                .entry((pid, tid, name))
                .or_default()
                .push((ts.unwrap_or(0.0), arg("step"))),
            "E" => {
                if let Some((start, step)) =
                    open.get_mut(&(pid, tid, name.clone())).and_then(Vec::pop)
                {
                    let end = ts.unwrap_or(start);
                    out.push(Ev {
                        track,
                        name: shown,
                        ts: start,
                        dur: end - start,
                        layer: None,
                        step: step.or_else(|| arg("step")),
                        bytes: None,
                        paired: true,
                    });
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Host span names that mark one decode step (`generate`'s `decode step`;
/// `decode_step` in older traces and the tests).
const HOST_STEP_SPANS: [&str; 2] = ["host:decode step", "host:decode_step"];

/// [`Summary::steps`]: with GPU spans, the distinct `step` args of complete
/// events (B/E pairs not counted, as before); in a host-only trace, those of
/// every host span, else the number of host decode-step spans.
fn count_steps(evs: &[Ev]) -> usize {
    let has_gpu = evs.iter().any(|e| e.track.is_some());
    let steps: std::collections::BTreeSet<u64> = evs
        .iter()
        .filter(|e| !(has_gpu && e.paired))
        .filter_map(|e| e.step)
        .collect();
    if has_gpu || !steps.is_empty() {
        return steps.len();
    }
    evs.iter()
        .filter(|e| HOST_STEP_SPANS.contains(&e.name.as_str()))
        .count()
}

/// Summarizes a trace (see the module doc for the definitions).
///
/// Errors: a JSON value that is not a trace, complete events without times,
/// or fetch `bytes` that add up past `u64::MAX`.
pub fn summarize(trace: &Value) -> Result<Summary> {
    let evs = parse_events(trace)?;
    let mut s = Summary {
        steps: count_steps(&evs),
        ..Summary::default()
    };
    for e in &evs {
        let p = s.phases.entry(e.name.clone()).or_default();
        p.count += 1;
        p.total_ms += e.dur / 1e3;
    }
    for p in s.phases.values_mut() {
        p.per_step_ms = if s.steps > 0 {
            p.total_ms / s.steps as f64
        } else {
            0.0
        };
    }
    let is_fetch = |e: &Ev| e.track == Some(Track::Copy) && e.name == "fetch";
    let is_wait = |e: &Ev| e.track == Some(Track::Compute) && e.name == "wait";
    let fetch = spans(&evs, &is_fetch);
    let busy = spans(&evs, &|e: &Ev| {
        e.track == Some(Track::Compute) && e.name != "wait"
    });
    let wait = spans(&evs, &is_wait);
    s.h2d_total_ms = length(&fetch) / 1e3;
    s.h2d_hidden_ms = intersect_len(&fetch, &busy) / 1e3;
    s.h2d_exposed_ms = s.h2d_total_ms - s.h2d_hidden_ms;
    s.overlap_pct = if s.h2d_total_ms > 0.0 {
        100.0 * s.h2d_hidden_ms / s.h2d_total_ms
    } else {
        0.0
    };
    s.compute_wait_ms = length(&wait) / 1e3;
    s.beside_fetch = beside_fetch(&evs, &fetch);
    s.h2d_bytes = fetch_bytes(evs.iter().filter(|e| is_fetch(e)))?;
    s.h2d_gb_per_s = if s.h2d_total_ms > 0.0 {
        s.h2d_bytes as f64 / (s.h2d_total_ms * 1e6)
    } else {
        0.0
    };
    // Each layer's spans, gathered in one pass (not one pass per layer).
    let mut by_layer: BTreeMap<u64, Vec<&Ev>> = BTreeMap::new();
    for e in &evs {
        if let Some(l) = e.layer {
            by_layer.entry(l).or_default().push(e);
        }
    }
    for (l, es) in by_layer {
        let f = spans(es.iter().copied(), &is_fetch);
        let w = spans(es.iter().copied(), &is_wait);
        s.layers.insert(
            l,
            LayerStats {
                h2d_ms: length(&f) / 1e3,
                hidden_ms: intersect_len(&f, &busy) / 1e3,
                bytes: fetch_bytes(es.iter().copied().filter(|e| is_fetch(e)))?,
                wait_ms: length(&w) / 1e3,
            },
        );
    }
    Ok(s)
}

/// How much of [a, b) the sorted, disjoint intervals `iv` cover.
fn covered_len(iv: &[(f64, f64)], a: f64, b: f64) -> f64 {
    let first = iv.partition_point(|&(_, hi)| hi <= a);
    iv[first..]
        .iter()
        .take_while(|&&(lo, _)| lo < b)
        .map(|&(lo, hi)| (hi.min(b) - lo.max(a)).max(0.0))
        .sum()
}

/// [`Summary::beside_fetch`]: each compute span (not `wait`) sorted by how
/// much of it the fetch union `fetch` covers.
fn beside_fetch(evs: &[Ev], fetch: &[(f64, f64)]) -> BTreeMap<String, BesideFetch> {
    let mut out: BTreeMap<String, BesideFetch> = BTreeMap::new();
    if fetch.is_empty() {
        return out;
    }
    for e in evs {
        if e.track != Some(Track::Compute) || e.name == "wait" {
            continue;
        }
        let b = out.entry(e.name.clone()).or_default();
        let covered = covered_len(fetch, e.ts, e.ts + e.dur);
        if e.dur > 0.0 && covered >= UNDER_FETCH * e.dur {
            b.under_fetch += 1;
            b.under_fetch_mean_us += e.dur;
        } else if covered <= WITHOUT_FETCH * e.dur {
            b.without_fetch += 1;
            b.without_fetch_mean_us += e.dur;
        } else {
            b.partial += 1;
        }
    }
    for b in out.values_mut() {
        b.under_fetch_mean_us /= b.under_fetch.max(1) as f64;
        b.without_fetch_mean_us /= b.without_fetch.max(1) as f64;
    }
    out
}

/// The union of the spans of `evs` that `keep` accepts.
fn spans<'a>(evs: impl IntoIterator<Item = &'a Ev>, keep: &dyn Fn(&Ev) -> bool) -> Vec<(f64, f64)> {
    union(
        evs.into_iter()
            .filter(|e| keep(e))
            .map(|e| (e.ts, e.ts + e.dur))
            .collect(),
    )
}

/// The sum of the `bytes` args of `fetches`.
///
/// Errors: a sum past `u64::MAX` ([`Error::Input`]).
fn fetch_bytes<'a>(fetches: impl Iterator<Item = &'a Ev>) -> Result<u64> {
    fetches
        .filter_map(|e| e.bytes)
        .try_fold(0u64, u64::checked_add)
        .ok_or_else(|| {
            Error::Input(format!(
                "trace: the `bytes` args of the fetch spans add up to more than {} (u64::MAX)",
                u64::MAX
            ))
        })
}

/// A trace file's text as JSON, in every form the Trace Event Format
/// allows: the object form (`{"traceEvents": [...]}`) or the array form,
/// whose closing `]` is optional — the form a crashed or interrupted run
/// leaves behind, possibly with a trailing comma and a last event cut off
/// mid-way (that event is dropped; every complete one is kept).
///
/// Errors: a message saying why the text is not a trace (not JSON, or an
/// array with no complete event).
pub fn parse_trace_text(text: &str) -> std::result::Result<Value, String> {
    let first = match serde_json::from_str::<Value>(text) {
        Ok(v) => return Ok(v),
        Err(e) => e,
    };
    let body = text.trim_start();
    if !body.starts_with('[') {
        return Err(format!("not JSON: {first}"));
    }
    // The array form without its closing bracket: close it after the last
    // complete event (each try cuts back to an earlier `}`).
    let mut end = body.len();
    for _ in 0..64 {
        let Some(close) = body[..end].rfind('}') else {
            break;
        };
        let candidate = format!("{}]", body[..=close].trim_end().trim_end_matches(','));
        if let Ok(v) = serde_json::from_str::<Value>(&candidate) {
            return Ok(v);
        }
        end = close;
    }
    Err(format!(
        "not JSON, and no complete event of an unclosed trace array ({first})"
    ))
}

/// Reads and summarizes a trace file.
///
/// Errors: the file cannot be read ([`Error::Io`]) or is not a trace JSON
/// ([`Error::Input`] naming the file).
pub fn summarize_file(path: &Path) -> Result<Summary> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    summarize_text(&text, path)
}

/// Parses ([`parse_trace_text`]) and summarizes the text of a trace file;
/// `path` only names the file in errors.
///
/// Errors: [`Error::Input`] naming the file when the text is not a trace
/// JSON or holds no complete span.
pub fn summarize_text(text: &str, path: &Path) -> Result<Summary> {
    let v = parse_trace_text(text).map_err(|e| Error::Input(format!("{}: {e}", path.display())))?;
    let in_file = |m: String| Error::Input(format!("{}: {m}", path.display()));
    let s = summarize(&v).map_err(|e| match e {
        Error::Input(m) => in_file(m),
        other => other,
    })?;
    if s.phases.is_empty() {
        return Err(in_file(
            "no complete spans (ph X, or B/E pairs) in the trace".into(),
        ));
    }
    Ok(s)
}

impl Summary {
    /// Human-readable report: phase table, transfer figures, per-layer table.
    pub fn to_text(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ = writeln!(o, "steps: {}", self.steps);
        let _ = writeln!(
            o,
            "{:<28} {:>8} {:>12} {:>12}",
            "phase", "count", "total ms", "ms/step"
        );
        for (name, p) in &self.phases {
            let _ = writeln!(
                o,
                "{:<28} {:>8} {:>12.3} {:>12.3}",
                name, p.count, p.total_ms, p.per_step_ms
            );
        }
        if self.h2d_total_ms > 0.0 {
            let _ = writeln!(
                o,
                "H2D: total {:.3} ms, hidden {:.3} ms, exposed {:.3} ms, overlap {:.1}%, {} bytes, {:.1} GB/s; compute waited {:.3} ms",
                self.h2d_total_ms, self.h2d_hidden_ms, self.h2d_exposed_ms, self.overlap_pct, self.h2d_bytes, self.h2d_gb_per_s, self.compute_wait_ms
            );
        } else {
            let _ = writeln!(
                o,
                "H2D: no fetch spans on the copy track (KV on the GPU, or a CPU trace); compute waited {:.3} ms",
                self.compute_wait_ms
            );
        }
        if !self.beside_fetch.is_empty() {
            let _ = writeln!(
                o,
                "beside a fetch (spans ≥ {:.0} % / ≤ {:.0} % covered by the copy track's fetches):",
                100.0 * UNDER_FETCH,
                100.0 * WITHOUT_FETCH
            );
            let _ = writeln!(
                o,
                "{:<12} {:>11} {:>10} {:>11} {:>10} {:>8} {:>9}",
                "phase", "beside", "mean µs", "without", "mean µs", "partial", "slowdown"
            );
            for (name, b) in &self.beside_fetch {
                let slow = b.slowdown().map_or("–".to_string(), |x| format!("{x:.2}×"));
                let _ = writeln!(
                    o,
                    "{:<12} {:>11} {:>10.1} {:>11} {:>10.1} {:>8} {:>9}",
                    name,
                    b.under_fetch,
                    b.under_fetch_mean_us,
                    b.without_fetch,
                    b.without_fetch_mean_us,
                    b.partial,
                    slow
                );
            }
        }
        // The per-layer transfer table, when some layer fetched or waited (a
        // trace with KV on the GPU, a prefill, would print only zeros).
        let any_transfer = self
            .layers
            .values()
            .any(|s| s.h2d_ms > 0.0 || s.wait_ms > 0.0 || s.bytes > 0);
        if any_transfer {
            let _ = writeln!(
                o,
                "{:>6} {:>10} {:>10} {:>12} {:>10}",
                "layer", "h2d ms", "hidden ms", "bytes", "wait ms"
            );
            for (l, s) in &self.layers {
                let _ = writeln!(
                    o,
                    "{:>6} {:>10.3} {:>10.3} {:>12} {:>10.3}",
                    l, s.h2d_ms, s.hidden_ms, s.bytes, s.wait_ms
                );
            }
        }
        o
    }
}
