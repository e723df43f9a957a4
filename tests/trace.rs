//! Trace merge and summary on synthetic event lists with known overlap
//! (the definitions of traces/README.md "Summaries").

use serde_json::json;
use sparda::trace::{self, GpuSpan, Track};

fn span(
    track: Track,
    name: &str,
    start_ms: f64,
    dur_ms: f64,
    layer: u32,
    step: u32,
    bytes: Option<u64>,
) -> GpuSpan {
    GpuSpan {
        track,
        name: name.into(),
        start_ms,
        dur_ms,
        layer: Some(layer),
        step: Some(step),
        bytes,
        blocks: None,
    }
}

/// Two steps; per step: compute busy [0,4) ms, then waits [4,5), busy [5,8);
/// fetch of layer 1 runs [2,6): 2 ms hidden under compute ([2,4)), 1 ms exposed
/// while compute waits ([4,5)), 1 ms hidden again ([5,6)).
fn two_steps() -> Vec<GpuSpan> {
    let mut v = Vec::new();
    for step in 0..2u32 {
        let t = step as f64 * 10.0;
        v.push(span(Track::Compute, "attention", t, 4.0, 0, step, None));
        v.push(span(Track::Compute, "wait", t + 4.0, 1.0, 1, step, None));
        v.push(span(Track::Compute, "ffn", t + 5.0, 3.0, 1, step, None));
        v.push(span(
            Track::Copy,
            "fetch",
            t + 2.0,
            4.0,
            1,
            step,
            Some(4_000_000),
        ));
    }
    v
}

#[test]
fn overlap_counts_real_transfer_only() {
    let merged = trace::merge(json!({"traceEvents": []}), &two_steps(), 1000.0).unwrap();
    let s = trace::summarize(&merged).unwrap();
    assert_eq!(s.steps, 2);
    assert!((s.h2d_total_ms - 8.0).abs() < 1e-9, "{}", s.h2d_total_ms);
    // [4,5) is waiting, not busy: exposed 1 ms per step
    assert!((s.h2d_hidden_ms - 6.0).abs() < 1e-9, "{}", s.h2d_hidden_ms);
    assert!((s.h2d_exposed_ms - 2.0).abs() < 1e-9);
    assert!((s.overlap_pct - 75.0).abs() < 1e-9);
    assert!((s.compute_wait_ms - 2.0).abs() < 1e-9);
    assert_eq!(s.h2d_bytes, 8_000_000);
    assert!((s.h2d_gb_per_s - 1.0).abs() < 1e-9); // 8 MB in 8 ms
    let l1 = &s.layers[&1];
    assert!(
        (l1.h2d_ms - 8.0).abs() < 1e-9
            && (l1.hidden_ms - 6.0).abs() < 1e-9
            && (l1.wait_ms - 2.0).abs() < 1e-9
    );
    let attn = &s.phases["attention"];
    assert_eq!(attn.count, 2);
    assert!((attn.total_ms - 8.0).abs() < 1e-9 && (attn.per_step_ms - 4.0).abs() < 1e-9);
}

#[test]
fn overlapping_fetches_are_not_double_counted() {
    // Two fetches [0,3) and [2,5) on the copy track, compute busy [1,2).
    let v = vec![
        span(Track::Copy, "fetch", 0.0, 3.0, 0, 0, Some(100)),
        span(Track::Copy, "fetch", 2.0, 3.0, 1, 0, Some(100)),
        span(Track::Compute, "qkv", 1.0, 1.0, 0, 0, None),
    ];
    let s = trace::summarize(&trace::merge(json!([]), &v, 0.0).unwrap()).unwrap();
    assert!((s.h2d_total_ms - 5.0).abs() < 1e-9);
    assert!((s.h2d_hidden_ms - 1.0).abs() < 1e-9);
    assert!((s.overlap_pct - 20.0).abs() < 1e-9);
}

#[test]
fn gpu_spans_are_aligned_to_the_host_clock_and_host_spans_kept() {
    let host = json!({"traceEvents": [
        {"ph": "B", "name": "decode_step", "pid": 7, "tid": 1, "ts": 100.0},
        {"ph": "E", "name": "decode_step", "pid": 7, "tid": 1, "ts": 2100.0},
    ]});
    let v = vec![span(Track::Compute, "qkv", 0.5, 0.25, 0, 0, None)];
    let merged = trace::merge(host, &v, 100.0).unwrap();
    let evs = merged["traceEvents"].as_array().unwrap();
    let qkv = evs.iter().find(|e| e["name"] == "qkv").unwrap();
    assert_eq!(qkv["ts"].as_f64().unwrap(), 600.0); // 100 µs anchor + 0.5 ms
    assert_eq!(qkv["dur"].as_f64().unwrap(), 250.0);
    assert_eq!(qkv["tid"].as_u64().unwrap(), Track::Compute.tid());
    let s = trace::summarize(&merged).unwrap();
    assert!((s.phases["host:decode_step"].total_ms - 2.0).abs() < 1e-9);
    assert_eq!(s.h2d_total_ms, 0.0);
    assert_eq!(s.overlap_pct, 0.0);
}

#[test]
fn malformed_traces_are_errors() {
    assert!(trace::summarize(&json!({"events": []})).is_err());
    assert!(trace::summarize(&json!(3)).is_err());
    let bad = json!([{"ph": "X", "name": "fetch", "pid": 1, "tid": 1}]);
    let err = trace::summarize(&bad).unwrap_err().to_string();
    assert!(err.contains("fetch"), "{err}");
    assert!(trace::merge(json!("x"), &[], 0.0).is_err());
}

// ---- Summary on synthetic lists with known overlap -------------------------

fn summary_of(v: &[GpuSpan]) -> trace::Summary {
    trace::summarize(&trace::merge(json!([]), v, 0.0).unwrap()).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn fetch_fully_hidden_under_compute() {
    // compute [0,10) busy; fetch [2,6) entirely inside it.
    let v = vec![
        span(Track::Compute, "attention", 0.0, 10.0, 0, 0, None),
        span(Track::Copy, "fetch", 2.0, 4.0, 0, 0, Some(1000)),
    ];
    let s = summary_of(&v);
    assert!(close(s.h2d_total_ms, 4.0) && close(s.h2d_hidden_ms, 4.0));
    assert!(close(s.h2d_exposed_ms, 0.0) && close(s.overlap_pct, 100.0));
    assert!(close(s.compute_wait_ms, 0.0));
}

#[test]
fn fetch_fully_exposed_while_compute_idle() {
    // compute [0,2) then nothing; fetch [3,7) while the compute stream is idle.
    let v = vec![
        span(Track::Compute, "qkv", 0.0, 2.0, 0, 0, None),
        span(Track::Copy, "fetch", 3.0, 4.0, 0, 0, Some(2_000_000)),
    ];
    let s = summary_of(&v);
    assert!(close(s.h2d_total_ms, 4.0) && close(s.h2d_hidden_ms, 0.0));
    assert!(close(s.h2d_exposed_ms, 4.0) && close(s.overlap_pct, 0.0));
    assert!(close(s.h2d_gb_per_s, 0.5)); // 2 MB in 4 ms
}

#[test]
fn waiting_is_neither_transfer_nor_hiding() {
    // The compute stream waits [0,5) for a fetch [0,5): all of it exposed,
    // 5 ms of waiting, and the wait span adds nothing to the H2D total.
    let v = vec![
        span(Track::Compute, "wait", 0.0, 5.0, 3, 0, None),
        span(Track::Copy, "fetch", 0.0, 5.0, 3, 0, Some(500)),
        span(Track::Compute, "attention", 5.0, 1.0, 3, 0, None),
    ];
    let s = summary_of(&v);
    assert!(close(s.h2d_total_ms, 5.0), "{}", s.h2d_total_ms);
    assert!(close(s.h2d_hidden_ms, 0.0) && close(s.h2d_exposed_ms, 5.0));
    assert!(close(s.compute_wait_ms, 5.0));
    assert!(close(s.layers[&3].wait_ms, 5.0) && close(s.layers[&3].h2d_ms, 5.0));
    assert_eq!(s.phases["wait"].count, 1);
}

#[test]
fn write_back_and_compute_named_fetch_are_not_h2d() {
    // Only `fetch` on the copy track is H2D; a write-back span and a span
    // named `fetch` on another track are not.
    let v = vec![
        span(Track::WriteBack, "write-back", 0.0, 3.0, 0, 0, Some(64)),
        span(Track::Compute, "fetch", 0.0, 3.0, 0, 0, Some(64)),
        span(Track::Copy, "fetch", 1.0, 1.0, 0, 0, Some(64)),
    ];
    let s = summary_of(&v);
    assert!(close(s.h2d_total_ms, 1.0));
    assert_eq!(s.h2d_bytes, 64);
    // The compute-track span still counts as compute being busy.
    assert!(close(s.h2d_hidden_ms, 1.0));
    assert!(close(s.phases["write-back"].total_ms, 3.0));
}

/// Three steps of three layers, 10 ms apart. Per step: compute busy [0,3)
/// and [5,6), waits [3,5); fetches: layer 0 [1,2) (hidden), layer 1 [3,5)
/// (exposed: compute waits), layer 2 [5.5,6.5) (half hidden).
fn three_layers_three_steps() -> Vec<GpuSpan> {
    let mut v = Vec::new();
    for step in 0..3u32 {
        let t = step as f64 * 10.0;
        v.push(span(Track::Compute, "attention", t, 3.0, 0, step, None));
        v.push(span(Track::Compute, "wait", t + 3.0, 2.0, 1, step, None));
        v.push(span(Track::Compute, "ffn", t + 5.0, 1.0, 2, step, None));
        v.push(span(
            Track::Copy,
            "fetch",
            t + 1.0,
            1.0,
            0,
            step,
            Some(1_000),
        ));
        v.push(span(
            Track::Copy,
            "fetch",
            t + 3.0,
            2.0,
            1,
            step,
            Some(2_000),
        ));
        v.push(span(
            Track::Copy,
            "fetch",
            t + 5.5,
            1.0,
            2,
            step,
            Some(3_000),
        ));
    }
    v
}

#[test]
fn per_layer_and_per_step_figures() {
    let s = summary_of(&three_layers_three_steps());
    assert_eq!(s.steps, 3);
    assert!(close(s.h2d_total_ms, 12.0), "{}", s.h2d_total_ms);
    assert!(close(s.h2d_hidden_ms, 4.5), "{}", s.h2d_hidden_ms);
    assert!(close(s.h2d_exposed_ms, 7.5));
    assert!(close(s.overlap_pct, 37.5));
    assert!(close(s.compute_wait_ms, 6.0));
    assert_eq!(s.h2d_bytes, 18_000);
    let want = [
        (0u64, 3.0, 3.0, 3_000u64, 0.0),
        (1, 6.0, 0.0, 6_000, 6.0),
        (2, 3.0, 1.5, 9_000, 0.0),
    ];
    for (l, h2d, hidden, bytes, wait) in want {
        let x = &s.layers[&l];
        assert!(
            close(x.h2d_ms, h2d) && close(x.hidden_ms, hidden),
            "layer {l}: {x:?}"
        );
        assert_eq!(x.bytes, bytes, "layer {l}");
        assert!(close(x.wait_ms, wait), "layer {l}: {x:?}");
    }
    let f = &s.phases["fetch"];
    assert_eq!(f.count, 9);
    assert!(close(f.total_ms, 12.0) && close(f.per_step_ms, 4.0));
    let text = s.to_text();
    assert!(text.contains("steps: 3"), "{text}");
    assert!(
        text.contains(
            "H2D: total 12.000 ms, hidden 4.500 ms, exposed 7.500 ms, overlap 37.5%, 18000 bytes"
        ),
        "{text}"
    );
    assert!(
        text.contains("     0      3.000      3.000         3000      0.000"),
        "{text}"
    );
    assert!(
        text.contains("     1      6.000      0.000         6000      6.000"),
        "{text}"
    );
    assert!(
        text.contains("     2      3.000      1.500         9000      0.000"),
        "{text}"
    );
    assert!(
        text.contains("fetch                               9       12.000        4.000"),
        "{text}"
    );
}

#[test]
fn merged_trace_names_the_gpu_tracks() {
    let merged = trace::merge(json!([]), &[], 0.0).unwrap();
    let evs = merged["traceEvents"].as_array().unwrap();
    for t in [Track::Compute, Track::Copy, Track::WriteBack] {
        let m = evs
            .iter()
            .find(|e| e["name"] == "thread_name" && e["tid"].as_u64() == Some(t.tid()))
            .unwrap();
        assert_eq!(m["pid"].as_u64(), Some(trace::GPU_PID));
        assert_eq!(m["args"]["name"], t.name());
    }
    assert_eq!(Track::Compute.name(), "gpu: compute stream");
    assert_ne!(trace::GPU_PID, trace::HOST_PID);
}

// ---- Recording through tracing-chrome ---------------------------------------

mod common;

/// Sessions share one process-wide sink: one test records at a time.
static SESSIONS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SESSIONS.lock().unwrap_or_else(|p| p.into_inner())
}

fn events_named<'a>(v: &'a serde_json::Value, name: &str) -> Vec<&'a serde_json::Value> {
    v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == name)
        .collect()
}

#[test]
fn host_trace_from_tracing_chrome_merges_gpu_spans_at_the_anchor() {
    let _g = lock();
    let dir = common::TmpDir::new("trace-merge");
    let path = dir.path().join("run.json");
    let (dispatch, session) = trace::subscriber(Some(&path)).unwrap();
    let session = session.expect("a session with --trace");
    assert!(trace::is_recording());
    let host_tmp = dir.path().join("run.json.host.tmp");
    assert!(host_tmp.exists());
    let anchor = tracing::dispatcher::with_default(&dispatch, || {
        let span = tracing::info_span!(target: "sparda::bench", "decode_step", step = 0u32);
        assert!(!span.is_disabled());
        let _e = span.enter();
        std::thread::sleep(std::time::Duration::from_millis(3));
        let id = trace::mark_anchor();
        std::thread::sleep(std::time::Duration::from_millis(3));
        id
    });
    let spans = vec![
        span(Track::Compute, "qkv", 0.5, 0.25, 0, 0, None),
        span(Track::Copy, "fetch", 1.0, 2.0, 0, 0, Some(4096)),
    ];
    assert!(trace::submit_gpu_spans(trace::GpuBatch { anchor, spans }));
    let merged = session.finish().unwrap();
    assert!(!trace::is_recording());
    assert!(!host_tmp.exists(), "temporary host file removed");
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(on_disk, merged);

    let a = events_named(&merged, trace::ANCHOR_EVENT);
    assert_eq!(a.len(), 1);
    assert_eq!(a[0]["ph"], "i");
    assert_eq!(a[0]["args"]["anchor"], anchor.to_string());
    let at = a[0]["ts"].as_f64().unwrap();
    // The anchor lies inside the host span, 3 ms after it began.
    let step = events_named(&merged, "decode_step");
    let b = step.iter().find(|e| e["ph"] == "B").unwrap()["ts"]
        .as_f64()
        .unwrap();
    let e = step.iter().find(|e| e["ph"] == "E").unwrap()["ts"]
        .as_f64()
        .unwrap();
    assert!(
        b + 3000.0 <= at && at + 3000.0 <= e,
        "B {b} anchor {at} E {e}"
    );
    assert_eq!(step[0]["pid"].as_u64(), Some(trace::HOST_PID));

    let qkv = events_named(&merged, "qkv");
    assert!((qkv[0]["ts"].as_f64().unwrap() - (at + 500.0)).abs() < 1e-6);
    assert!((qkv[0]["dur"].as_f64().unwrap() - 250.0).abs() < 1e-6);
    assert_eq!(qkv[0]["pid"].as_u64(), Some(trace::GPU_PID));
    let fetch = events_named(&merged, "fetch");
    assert!((fetch[0]["ts"].as_f64().unwrap() - (at + 1000.0)).abs() < 1e-6);
    assert_eq!(fetch[0]["args"]["bytes"].as_u64(), Some(4096));
    assert_eq!(fetch[0]["tid"].as_u64(), Some(Track::Copy.tid()));
    let proc_names: Vec<_> = events_named(&merged, "process_name")
        .iter()
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        proc_names.contains(&(trace::HOST_PID, "sparda (host)".into())),
        "{proc_names:?}"
    );
    assert!(
        proc_names.contains(&(trace::GPU_PID, "gpu (CUDA events)".into())),
        "{proc_names:?}"
    );

    let s = trace::summarize_file(&path).unwrap();
    assert!(s.phases["host:decode_step"].total_ms >= 6.0);
    assert!((s.h2d_total_ms - 2.0).abs() < 1e-9);
    assert_eq!(s.h2d_bytes, 4096);
}

#[test]
fn batches_sit_at_their_own_anchors() {
    let host = json!([
        {"ph": "i", "s": "t", "name": "gpu-anchor", "pid": 1, "tid": 0, "ts": 100.0, "args": {"anchor": "7"}},
        {"ph": "i", "s": "t", "name": "gpu-anchor", "pid": 1, "tid": 0, "ts": 5000.0, "args": {"anchor": 9}},
    ]);
    let batches = [
        trace::GpuBatch {
            anchor: 9,
            spans: vec![span(Track::Compute, "ffn", 1.0, 1.0, 0, 0, None)],
        },
        trace::GpuBatch {
            anchor: 7,
            spans: vec![span(Track::Compute, "qkv", 1.0, 1.0, 0, 0, None)],
        },
    ];
    let m = trace::merge_batches(host, &batches).unwrap();
    assert_eq!(events_named(&m, "qkv")[0]["ts"].as_f64(), Some(1100.0));
    assert_eq!(events_named(&m, "ffn")[0]["ts"].as_f64(), Some(6000.0));
    let missing = [trace::GpuBatch {
        anchor: 8,
        spans: vec![span(Track::Compute, "qkv", 0.0, 1.0, 0, 0, None)],
    }];
    let err = trace::merge_batches(json!([]), &missing)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gpu-anchor") && err.contains("anchor 8"),
        "{err}"
    );
    // A batch without spans needs no anchor.
    assert!(trace::merge_batches(
        json!([]),
        &[trace::GpuBatch {
            anchor: 8,
            spans: vec![]
        }]
    )
    .is_ok());
}

#[test]
fn finish_names_the_file_when_an_anchor_is_missing() {
    let _g = lock();
    let dir = common::TmpDir::new("trace-noanchor");
    let path = dir.path().join("t.json");
    let (_d, session) = trace::subscriber(Some(&path)).unwrap();
    assert!(trace::submit_gpu_spans(trace::GpuBatch {
        anchor: u64::MAX,
        spans: vec![span(Track::Compute, "qkv", 0.0, 1.0, 0, 0, None)],
    }));
    let err = session.unwrap().finish().unwrap_err().to_string();
    assert!(
        err.contains("t.json.host.tmp") && err.contains("gpu-anchor"),
        "{err}"
    );
    assert!(!path.exists());
    assert!(!trace::is_recording());
}

#[test]
fn one_session_at_a_time_and_bad_paths_fail_at_start() {
    let _g = lock();
    let dir = common::TmpDir::new("trace-one");
    let (_d, first) = trace::subscriber(Some(&dir.path().join("a.json"))).unwrap();
    let err = trace::subscriber(Some(&dir.path().join("b.json")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("b.json") && err.contains("already recording"),
        "{err}"
    );
    assert!(!dir.path().join("b.json.host.tmp").exists());
    drop(first);
    assert!(!trace::is_recording());
    let bad = dir.path().join("no-such-dir").join("c.json");
    let err = trace::subscriber(Some(&bad)).unwrap_err().to_string();
    assert!(err.contains("c.json.host.tmp"), "{err}");
    assert!(
        !trace::is_recording(),
        "a failed start leaves nothing recording"
    );
}

#[test]
fn without_trace_nothing_is_recorded_or_written() {
    let _g = lock();
    let dir = common::TmpDir::new("trace-off");
    let cwd_traces = || {
        std::fs::read_dir(".")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("trace-"))
            .count()
    };
    let before = cwd_traces();
    let (dispatch, session) = trace::subscriber(None).unwrap();
    assert!(session.is_none());
    assert!(!trace::is_recording());
    tracing::dispatcher::with_default(&dispatch, || {
        let span = tracing::info_span!(target: "sparda::bench", "decode_step", step = 0u32);
        if std::env::var_os("SPARDA_LOG").is_none() {
            // Default log filter is `warn`: an INFO span is disabled, so
            // instrumented code produces no events at all.
            assert!(span.is_disabled());
        }
        let _e = span.enter();
        trace::mark_anchor();
    });
    assert!(!trace::submit_gpu_spans(trace::GpuBatch {
        anchor: 1,
        spans: vec![span(Track::Compute, "qkv", 0.0, 1.0, 0, 0, None)],
    }));
    assert_eq!(cwd_traces(), before, "no tracing-chrome default file");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn init_subscriber_installs_once_and_cleans_up_after_a_refusal() {
    let _g = lock();
    let dir = common::TmpDir::new("trace-init");
    // The first install in this process wins (other tests only use scoped
    // dispatchers); a second one is refused, leaving nothing behind.
    let first = trace::init_subscriber(None);
    let path = dir.path().join("late.json");
    let err = trace::init_subscriber(Some(&path)).unwrap_err().to_string();
    assert!(first.is_ok_and(|s| s.is_none()));
    assert!(err.contains("tracing subscriber"), "{err}");
    assert!(!trace::is_recording());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

// ---- GPU timeline on the device ---------------------------------------------

/// One decode-like step: per layer a fetch on the copy stream, attention on
/// the compute stream, then the compute stream waits for the fetch.
#[allow(clippy::too_many_arguments)]
fn gpu_step(
    tl: &mut sparda::trace::timeline::GpuTimeline,
    compute: &std::sync::Arc<cudarc::driver::CudaStream>,
    copy: &std::sync::Arc<cudarc::driver::CudaStream>,
    fetched: &cudarc::driver::CudaEvent,
    work: &mut cudarc::driver::CudaSlice<u8>,
    src: &cudarc::driver::CudaSlice<u8>,
    dst: &mut cudarc::driver::CudaSlice<u8>,
    step: u32,
    layers: u32,
) {
    use sparda::trace::timeline::SpanMeta;
    let _host = tracing::info_span!(target: "sparda::test", "decode_step", step).entered();
    for l in 0..layers {
        let meta = SpanMeta::at(l, step);
        let f = tl
            .begin(copy, Track::Copy, "fetch", meta.moved(src.len() as u64, 16))
            .unwrap();
        copy.memcpy_dtod(src, dst).unwrap();
        tl.end(copy, f).unwrap();
        fetched.record(copy).unwrap();
        tl.span(compute, Track::Compute, "attention", meta, || {
            compute.memset_zeros(work).unwrap();
            Ok(())
        })
        .unwrap();
        let w = tl.begin(compute, Track::Compute, "wait", meta).unwrap();
        compute.wait(fetched).unwrap();
        tl.end(compute, w).unwrap();
    }
}

/// Records real spans on two streams with cross-stream waits, a graph capture
/// in between, and checks the merged trace. Needs a GPU, so it is ignored by
/// default (it must not pass where it cannot run): on the GPU machine,
/// `cargo test --release --test trace -- --ignored`. Prints the host cost of
/// a span (not asserted: tests never assert on time).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn gpu_timeline_records_streams_waits_and_skips_capture() {
    use sparda::trace::timeline::{GpuTimeline, SpanMeta};
    let _g = lock();
    let gpu = sparda::cuda::Gpu::new(0).unwrap_or_else(|e| panic!("Gpu::new: {e}"));
    // Disabled: no events, NONE ids, nothing collected.
    let mut off = GpuTimeline::new(&gpu, false).unwrap();
    let id = off
        .begin(gpu.stream(), Track::Compute, "qkv", SpanMeta::default())
        .unwrap();
    assert!(id.is_none() && !off.is_enabled() && off.anchor_id().is_none());
    off.end(gpu.stream(), id).unwrap();
    assert!(off.collect().unwrap().is_empty());
    assert_eq!(off.events_created(), 0);

    let dir = common::TmpDir::new("trace-gpu");
    let path = dir.path().join("gpu.json");
    let (dispatch, session) = trace::subscriber(Some(&path)).unwrap();
    let session = session.unwrap();
    let (layers, steps) = (4u32, 6u32);
    let (first, host_cost) = tracing::dispatcher::with_default(&dispatch, || {
        let mut tl = GpuTimeline::new(&gpu, trace::is_recording()).unwrap();
        assert!(tl.is_enabled());
        let ctx = gpu.context();
        let compute = gpu.stream().clone();
        let copy = ctx.new_stream().unwrap();
        let fetched = ctx.new_event(None).unwrap();
        let mut work = gpu.zeros::<u8>(1 << 30).unwrap();
        let src = gpu.zeros::<u8>(256 << 20).unwrap();
        let mut dst = gpu.zeros::<u8>(256 << 20).unwrap();
        let mut captured = gpu.zeros::<u8>(1 << 20).unwrap();
        gpu.synchronize().unwrap();
        let mut run = |tl: &mut GpuTimeline, s| {
            gpu_step(
                tl, &compute, &copy, &fetched, &mut work, &src, &mut dst, s, layers,
            )
        };
        run(&mut tl, 0);
        let first = tl.collect().unwrap();
        let mut submitted = 0;
        for s in 1..3 {
            run(&mut tl, s);
            submitted += tl.submit().unwrap();
        }
        // Pooled: one step never holds more than 2 events per span (+ the
        // anchor, + one while re-anchoring), however many steps run.
        assert!(
            tl.events_created() <= 2 + 6 * layers as usize,
            "{}",
            tl.events_created()
        );
        // A capture in the middle: the span is skipped, the capture succeeds.
        let graph = gpu
            .capture(|| {
                let id = tl.begin(&compute, Track::Compute, "captured", SpanMeta::default())?;
                assert!(id.is_none());
                compute.memset_zeros(&mut captured).unwrap();
                tl.end(&compute, id)
            })
            .unwrap();
        graph.launch().unwrap();
        for s in 3..steps {
            run(&mut tl, s);
        }
        submitted += tl.submit().unwrap();
        assert_eq!(submitted, (steps - 1) as usize * layers as usize * 3);
        // `next`: back-to-back spans share their boundary event, so each
        // starts exactly where the previous one ended; the events come back
        // to the pool (a second chain creates none).
        let mut chain = |tl: &mut GpuTimeline| {
            let m = SpanMeta::at(0, 99);
            let a = tl.begin(&compute, Track::Compute, "a", m).unwrap();
            compute.memset_zeros(&mut work).unwrap();
            let b = tl.next(&compute, a, Track::Compute, "b", m).unwrap();
            compute.memset_zeros(&mut work).unwrap();
            let c = tl.next(&compute, b, Track::Compute, "c", m).unwrap();
            compute.memset_zeros(&mut work).unwrap();
            tl.end(&compute, c).unwrap();
            let mut got = tl.collect().unwrap();
            got.sort_by(|x, y| x.name.cmp(&y.name));
            got
        };
        let got = chain(&mut tl);
        let names: Vec<&str> = got.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        for w in got.windows(2) {
            assert!(w[0].dur_ms > 0.0, "{:?}", w[0]);
            assert!(
                (w[0].start_ms + w[0].dur_ms - w[1].start_ms).abs() < 1e-6,
                "{:?} then {:?}",
                w[0],
                w[1]
            );
        }
        let created = tl.events_created();
        assert_eq!(chain(&mut tl).len(), 3);
        assert_eq!(tl.events_created(), created);
        // A span left open (a failed step) is dropped; collection goes on.
        let m = SpanMeta::at(0, 98);
        let a = tl.begin(&compute, Track::Compute, "open", m).unwrap();
        let b = tl.next(&compute, a, Track::Compute, "left", m).unwrap();
        assert!(!b.is_none());
        assert_eq!(tl.drop_open(), 1);
        let got = tl.collect().unwrap();
        assert_eq!(
            got.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["open"]
        );
        assert_eq!(tl.drop_open(), 0);
        // Host cost of a span on an idle stream: first while the pool grows
        // (events created or harvested in the loop), then with a full pool,
        // and the conversion that `collect` does per span.
        let n = 2000;
        let spans = |tl: &mut GpuTimeline| {
            let t = std::time::Instant::now();
            for _ in 0..n {
                let id = tl
                    .begin(&compute, Track::Compute, "empty", SpanMeta::default())
                    .unwrap();
                tl.end(&compute, id).unwrap();
            }
            t.elapsed().as_secs_f64() * 1e6 / n as f64
        };
        let growing_us = spans(&mut tl);
        assert_eq!(tl.collect().unwrap().len(), n);
        // The events of the collected spans serve the next run: none created.
        let created = tl.events_created();
        tl.reserve(n).unwrap();
        let per_span_us = spans(&mut tl);
        assert_eq!(tl.events_created(), created);
        let t = std::time::Instant::now();
        let got = tl.collect().unwrap().len();
        let collect_us = t.elapsed().as_secs_f64() * 1e6 / got as f64;
        let t = std::time::Instant::now();
        for _ in 0..n {
            let id = off
                .begin(&compute, Track::Compute, "empty", SpanMeta::default())
                .unwrap();
            off.end(&compute, id).unwrap();
        }
        let off_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        eprintln!(
            "GpuTimeline host µs per span: {growing_us:.3} while the pool grows, {per_span_us:.3} with a warm pool, {collect_us:.3} to collect ({got} spans), {off_us:.4} disabled; events created {}",
            tl.events_created()
        );
        assert_eq!(got, n);
        host_call_costs(&compute);
        (first, per_span_us)
    });
    assert!(host_cost > 0.0);
    // Step 0 as collected: per layer fetch, attention, wait.
    assert_eq!(first.len(), layers as usize * 3);
    for s in &first {
        assert!(s.start_ms >= 0.0 && s.dur_ms >= 0.0, "{s:?}");
    }
    for l in 0..layers {
        let get = |n: &str| {
            first
                .iter()
                .find(|s| s.name == n && s.layer == Some(l))
                .unwrap()
        };
        let (f, a, w) = (get("fetch"), get("attention"), get("wait"));
        assert!(f.dur_ms > 0.0 && a.dur_ms > 0.0, "{f:?} {a:?}");
        // The wait ends only once the fetch has (same GPU clock, ±1 µs).
        assert!(
            w.start_ms + w.dur_ms >= f.start_ms + f.dur_ms - 1e-3,
            "{w:?} {f:?}"
        );
        // In-stream order on the compute track: attention, then wait.
        assert!(w.start_ms >= a.start_ms + a.dur_ms - 1e-3, "{a:?} {w:?}");
        assert_eq!(f.bytes, Some(256 << 20));
    }
    let merged = session.finish().unwrap();
    // Step 0 was collected before submit, so it is not in the trace; steps 1..
    let s = trace::summarize(&merged).unwrap();
    assert_eq!(
        s.phases["fetch"].count,
        (steps - 1) as usize * layers as usize
    );
    assert!(!s.phases.contains_key("captured"));
    assert!(
        s.h2d_total_ms > 0.0 && s.h2d_bytes == (steps - 1) as u64 * layers as u64 * (256 << 20)
    );
    // Alignment: no GPU span of a step starts before the host began that step
    // (the anchor may be off by a few µs; allow 50).
    let evs = merged["traceEvents"].as_array().unwrap();
    for step in 1..steps {
        let host_b = evs
            .iter()
            .find(|e| {
                e["name"] == "decode_step"
                    && e["ph"] == "B"
                    && e["args"]["step"].as_str() == Some(step.to_string().as_str())
            })
            .unwrap()["ts"]
            .as_f64()
            .unwrap();
        let gpu_first = evs
            .iter()
            .filter(|e| {
                e["pid"].as_u64() == Some(trace::GPU_PID)
                    && e["args"]["step"].as_u64() == Some(step as u64)
            })
            .map(|e| e["ts"].as_f64().unwrap())
            .fold(f64::INFINITY, f64::min);
        eprintln!("step {step}: host begins {host_b:.1} µs, first GPU span {gpu_first:.1} µs");
        assert!(
            gpu_first >= host_b - 50.0,
            "step {step}: GPU {gpu_first} before host {host_b}"
        );
    }
    if let Ok(out) = std::env::var("SPARDA_TRACE_OUT") {
        std::fs::copy(&path, out).unwrap();
    }
}

/// Prints the host cost of the driver calls a span makes (diagnostic only).
fn host_call_costs(stream: &std::sync::Arc<cudarc::driver::CudaStream>) {
    use cudarc::driver::sys;
    let n = 5000;
    let per = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let ev = stream
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    stream.synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..n {
        ev.record(stream).unwrap();
    }
    let safe_record = per(t);
    stream.synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..n {
        // SAFETY: a live event and stream of the current context.
        unsafe { sys::cuEventRecord(ev.cu_event(), stream.cu_stream()) }
            .result()
            .unwrap();
    }
    let raw_record = per(t);
    stream.synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..n {
        stream.capture_status().unwrap();
    }
    let capture = per(t);
    let t = std::time::Instant::now();
    for _ in 0..n {
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream and a valid out-pointer.
        unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut st) }
            .result()
            .unwrap();
    }
    let raw_capture = per(t);
    let t = std::time::Instant::now();
    for _ in 0..n {
        stream.context().bind_to_thread().unwrap();
    }
    let bind = per(t);
    let t = std::time::Instant::now();
    for _ in 0..n {
        let _ = ev.is_complete();
    }
    let query = per(t);
    eprintln!(
        "host µs per call: record {safe_record:.3} (raw {raw_record:.3}), capture status {capture:.3} (raw {raw_capture:.3}), bind_to_thread {bind:.3}, event query {query:.3}"
    );
}

/// `generate --trace FILE` on the CPU reference writes a Chrome trace with
/// the host spans of the run (prefill and one span per decode step, with
/// its step number), and no GPU tracks.
#[test]
fn generate_with_trace_writes_host_spans_of_prefill_and_each_decode_step() {
    let dir = std::env::temp_dir().join(format!("sparda-trace-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("run.json");
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".fixtures/smollm2-135m-instruct/tokenizer.json");
    if !tok.exists() {
        panic!("run scripts/fixture.sh first: {} is missing", tok.display());
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args([
            "generate",
            "--backend",
            "cpu",
            "--model",
            "synth:tiny",
            "--ignore-eos",
        ])
        .args(["--prompt", "The quick brown fox", "--max-new-tokens", "5"])
        .arg("--tokenizer")
        .arg(&tok)
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().expect("traceEvents");
    let named = |n: &str| {
        events
            .iter()
            .filter(|e| e["name"] == n && (e["ph"] == "X" || e["ph"] == "B"))
            .count()
    };
    assert_eq!(named("prefill"), 1, "{events:?}");
    // 5 tokens: the first from the prefill's logits, then 4 decode steps
    assert_eq!(named("decode step"), 4);
    assert!(events
        .iter()
        .all(|e| e["tid"].as_u64().is_none_or(|t| t < 1_000_000) || e["ph"] == "M"));
    // `trace summarize` counts those 4 decode steps (host-only trace) and
    // gives per-step means over them.
    let sum = std::process::Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(["trace", "summarize", "--json"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(
        sum.status.success(),
        "{}",
        String::from_utf8_lossy(&sum.stderr)
    );
    let s: serde_json::Value = serde_json::from_slice(&sum.stdout).unwrap();
    assert_eq!(s["steps"].as_u64(), Some(4), "{s}");
    let d = &s["phases"]["host:decode step"];
    assert_eq!(d["count"].as_u64(), Some(4), "{s}");
    let (total, per) = (
        d["total_ms"].as_f64().unwrap(),
        d["per_step_ms"].as_f64().unwrap(),
    );
    assert!(per > 0.0 && (per * 4.0 - total).abs() < 1e-9, "{s}");
    assert!(
        s["phases"]["host:prefill"]["per_step_ms"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Host spans written by tracing-chrome carry their fields as strings
/// (`"step": "3"`): the summary still counts their steps.
#[test]
fn host_span_steps_written_as_strings_are_counted() {
    let trace = serde_json::json!({"traceEvents": [
        {"name": "decode step", "ph": "X", "pid": 1, "tid": 0, "ts": 0.0, "dur": 10.0, "args": {"step": "0"}},
        {"name": "decode step", "ph": "X", "pid": 1, "tid": 0, "ts": 20.0, "dur": 10.0, "args": {"step": "1"}},
        {"name": "decode step", "ph": "X", "pid": 1, "tid": 0, "ts": 40.0, "dur": 10.0, "args": {"step": "2"}},
    ]});
    let s = sparda::trace::summarize(&trace).unwrap();
    assert_eq!(s.steps, 3);
    let p = &s.phases["host:decode step"];
    assert_eq!(p.count, 3);
    assert!((p.total_ms - 0.03).abs() < 1e-12, "{}", p.total_ms);
    assert!((p.per_step_ms - 0.01).abs() < 1e-12, "{}", p.per_step_ms);
}

/// A host-only trace as tracing-chrome writes `generate --backend cpu
/// --trace`: B/E pairs carrying the span's fields as strings on both events,
/// a prefill and N decode steps of known durations. Steps come from the
/// decode-step spans; per-step means are over them.
fn cpu_generate_trace(decode_ms: &[f64], with_step_args: bool) -> serde_json::Value {
    let ev = |ph: &str, name: &str, ts: f64, args: serde_json::Value| json!({"args": args, "cat": "sparda::generate", "name": name, "ph": ph, "pid": 1, "tid": 0, "ts": ts});
    let mut evs = vec![
        json!({"args": {"name": "main"}, "name": "thread_name", "ph": "M", "pid": 1, "tid": 0}),
        ev("B", "prefill", 1000.0, json!({"tokens": "4"})),
        ev("E", "prefill", 7000.0, json!({"tokens": "4"})),
    ];
    let mut t = 7500.0;
    for (i, ms) in decode_ms.iter().enumerate() {
        let args = if with_step_args {
            json!({"step": i.to_string()})
        } else {
            json!({})
        };
        evs.push(ev("B", "decode step", t, args.clone()));
        evs.push(ev("E", "decode step", t + ms * 1e3, args));
        t += ms * 1e3 + 250.0;
    }
    evs.push(
        json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "sparda (host)"}}),
    );
    json!({"traceEvents": evs, "displayTimeUnit": "ms"})
}

#[test]
fn host_only_trace_counts_decode_steps_from_b_e_pairs() {
    let decode = [2.0, 3.0, 4.0, 3.0, 3.0];
    for with_step_args in [true, false] {
        let s = trace::summarize(&cpu_generate_trace(&decode, with_step_args)).unwrap();
        assert_eq!(s.steps, decode.len(), "step args: {with_step_args}");
        let d = &s.phases["host:decode step"];
        assert_eq!(d.count, 5);
        assert!(
            close(d.total_ms, 15.0) && close(d.per_step_ms, 3.0),
            "{d:?}"
        );
        let p = &s.phases["host:prefill"];
        assert_eq!(p.count, 1);
        assert!(close(p.total_ms, 6.0) && close(p.per_step_ms, 1.2), "{p:?}");
        assert_eq!(s.h2d_total_ms, 0.0);
        assert!(s.layers.is_empty());
        let text = s.to_text();
        assert!(text.contains("steps: 5\n"), "{text}");
        assert!(text.contains("H2D: no fetch spans"), "{text}");
        assert!(
            text.contains("host:decode step                    5       15.000        3.000"),
            "{text}"
        );
    }
    // No decode step at all (one token generated): 0 steps, means 0.
    let s = trace::summarize(&cpu_generate_trace(&[], true)).unwrap();
    assert_eq!(s.steps, 0);
    assert_eq!(s.phases["host:prefill"].per_step_ms, 0.0);
}

/// With GPU spans the step count stays that of complete events: the host
/// B/E decode-step spans around them (here one more step than the GPU
/// recorded, as when step 0 is collected before tracing submits) add none.
#[test]
fn gpu_traces_count_steps_from_complete_events_only() {
    let host = cpu_generate_trace(&[10.0, 10.0, 10.0], true);
    let merged = trace::merge(host, &two_steps(), 20_000.0).unwrap();
    let s = trace::summarize(&merged).unwrap();
    assert_eq!(s.steps, 2);
    assert!(close(s.phases["attention"].per_step_ms, 4.0));
    assert!(close(s.phases["host:decode step"].total_ms, 30.0));
    assert!(close(s.phases["host:decode step"].per_step_ms, 15.0));
    assert!(close(s.h2d_total_ms, 8.0) && close(s.overlap_pct, 75.0));
}

#[test]
fn an_unclosed_trace_array_is_summarized_from_its_complete_events() {
    // The array form of the Trace Event Format may omit its closing `]`
    // (a crashed or interrupted run leaves it so, often with a trailing comma
    // and a last event cut off): every complete event counts, the cut one not.
    let events = r#"[
{"ph": "X", "name": "qkv", "pid": 2, "tid": 1, "ts": 0.0, "dur": 100.0, "args": {"step": 0, "layer": 0}},
{"ph": "X", "name": "ffn", "pid": 2, "tid": 1, "ts": 100.0, "dur": 300.0, "args": {"step": 0, "layer": 0}},
"#;
    let closed = format!("{}]", events.trim_end().trim_end_matches(','));
    let want = trace::summarize(&serde_json::from_str(&closed).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("sparda-unclosed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in [
        ("trailing_comma.json", events.to_string()),
        (
            "no_comma.json",
            events.trim_end().trim_end_matches(',').to_string(),
        ),
        (
            "cut_event.json",
            format!("{events}{{\"ph\": \"X\", \"name\": \"attention\", \"pid\": 2, \"ts\": 4"),
        ),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, &text).unwrap();
        let s = trace::summarize_file(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.phases.len(), 2, "{name}");
        let ffn = s
            .phases
            .iter()
            .find(|(k, _)| k.ends_with("ffn"))
            .expect("ffn phase")
            .1;
        assert!((ffn.total_ms - 0.3).abs() < 1e-12, "{name}");
        assert_eq!(
            s.phases.keys().collect::<Vec<_>>(),
            want.phases.keys().collect::<Vec<_>>()
        );
        assert!(
            !s.phases.contains_key("attention"),
            "{name}: the cut event is dropped"
        );
    }
    // not a trace at all: an error naming the file, not a panic
    let p = dir.join("garbage.json");
    std::fs::write(&p, "[ not json").unwrap();
    let err = trace::summarize_file(&p).unwrap_err().to_string();
    assert!(
        err.contains("garbage.json") && err.contains("not JSON"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Fetch `bytes` that add up past u64::MAX are an error naming the limit,
/// not a wrapped total (or an overflow panic). (Found by reading the
/// summary while writing its fuzz target.)
#[test]
fn fetch_bytes_past_u64_are_an_error() {
    let v = vec![
        span(Track::Copy, "fetch", 0.0, 1.0, 0, 0, Some(u64::MAX)),
        span(Track::Copy, "fetch", 2.0, 1.0, 1, 0, Some(1)),
    ];
    let merged = trace::merge(json!([]), &v, 0.0).unwrap();
    assert_eq!(
        trace::summarize(&merged).unwrap_err().to_string(),
        "invalid input: trace: the `bytes` args of the fetch spans add up to more than \
         18446744073709551615 (u64::MAX)"
    );
    // at the limit exactly: summed, per layer too
    let v = vec![
        span(Track::Copy, "fetch", 0.0, 1.0, 0, 0, Some(u64::MAX - 1)),
        span(Track::Copy, "fetch", 2.0, 1.0, 1, 0, Some(1)),
    ];
    let s = summary_of(&v);
    assert_eq!(s.h2d_bytes, u64::MAX);
    assert_eq!(s.layers[&0].bytes, u64::MAX - 1);
    assert_eq!(s.layers[&1].bytes, 1);
}

/// Per-layer figures are gathered in one pass over the events: 16,000
/// layers of one fetch each (1.6 MB of trace) took 2 s when every layer
/// scanned every event.
#[test]
fn many_layers_are_summarized_in_one_pass() {
    let v: Vec<GpuSpan> = (0..16_000u32)
        .map(|l| span(Track::Copy, "fetch", 2.0 * l as f64, 1.0, l, 0, Some(100)))
        .collect();
    let merged = trace::merge(json!([]), &v, 0.0).unwrap();
    let t0 = std::time::Instant::now();
    let s = trace::summarize(&merged).unwrap();
    assert!(t0.elapsed().as_millis() < 500, "{:?}", t0.elapsed());
    assert_eq!(s.layers.len(), 16_000);
    assert_eq!(s.h2d_bytes, 1_600_000);
    assert!(
        close(s.layers[&15_999].h2d_ms, 1.0),
        "{:?}",
        s.layers[&15_999]
    );
}

/// Compute spans by whether a fetch ran beside them: fetches cover [0,10)
/// and [20,21); attention of layers 0 and 1 runs inside them (2 and 4 ms:
/// mean 3), that of layer 2 after them (1 ms); an ffn half covered is
/// partial; `wait` is left out; a span covered exactly 95 % counts as
/// beside, one covered 5 % as without.
#[test]
fn compute_phases_are_split_by_a_concurrent_fetch() {
    let v = vec![
        span(Track::Copy, "fetch", 0.0, 10.0, 1, 0, Some(100)),
        span(Track::Copy, "fetch", 20.0, 1.0, 2, 0, Some(100)),
        span(Track::Compute, "attention", 1.0, 2.0, 0, 0, None),
        span(Track::Compute, "attention", 4.0, 4.0, 1, 0, None),
        span(Track::Compute, "attention", 30.0, 1.0, 2, 0, None),
        span(Track::Compute, "ffn", 9.0, 2.0, 1, 0, None),
        span(Track::Compute, "wait", 8.0, 1.0, 1, 0, None),
        // [19.95, 20.95): 0.95 of 1 ms under the [20,21) fetch
        span(Track::Compute, "o_proj", 19.95, 1.0, 2, 0, None),
        // [20.95, 22.95): 0.05 ms of 2 ms under the [20,21) fetch (2.5 %)
        span(Track::Compute, "qkv", 20.95, 2.0, 2, 0, None),
    ];
    let s = summary_of(&v);
    assert!(!s.beside_fetch.contains_key("wait"));
    let a = &s.beside_fetch["attention"];
    assert_eq!((a.under_fetch, a.without_fetch, a.partial), (2, 1, 0));
    assert!(close(a.under_fetch_mean_us, 3000.0), "{a:?}");
    assert!(close(a.without_fetch_mean_us, 1000.0), "{a:?}");
    assert!(close(a.slowdown().unwrap(), 3.0));
    let f = &s.beside_fetch["ffn"];
    assert_eq!((f.under_fetch, f.without_fetch, f.partial), (0, 0, 1));
    assert_eq!(f.slowdown(), None);
    let o = &s.beside_fetch["o_proj"];
    assert_eq!((o.under_fetch, o.without_fetch), (1, 0), "{o:?}");
    let q = &s.beside_fetch["qkv"];
    assert_eq!((q.under_fetch, q.without_fetch), (0, 1), "{q:?}");
    let text = s.to_text();
    assert!(
        text.contains("beside a fetch") && text.contains("3.00×"),
        "{text}"
    );
    // No fetch span on the copy track: no split at all.
    let resident = summary_of(&[span(Track::Compute, "attention", 0.0, 1.0, 0, 0, None)]);
    assert!(resident.beside_fetch.is_empty());
    assert!(!resident.to_text().contains("beside a fetch"));
    // ... and no per-layer transfer table of zeros (KV on the GPU, a prefill),
    // which the offloaded trace above prints.
    assert!(!resident.layers.is_empty());
    assert!(!resident.to_text().contains("h2d ms"));
    assert!(text.contains("h2d ms"), "{text}");
}

/// `GpuTimeline::host_cost` keeps the spans recorded before it and drops its
/// own. Needs a GPU (ignored by default; `--ignored` on the GPU machine).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn gpu_host_cost_keeps_earlier_spans_and_drops_its_own() {
    use sparda::trace::timeline::{GpuTimeline, SpanMeta};
    let _g = lock();
    let gpu = sparda::cuda::Gpu::new(0).unwrap_or_else(|e| panic!("Gpu::new: {e}"));
    let dir = common::TmpDir::new("trace-host-cost");
    let (dispatch, _session) = trace::subscriber(Some(&dir.path().join("t.json"))).unwrap();
    tracing::dispatcher::with_default(&dispatch, || {
        let mut tl = GpuTimeline::new(&gpu, trace::is_recording()).unwrap();
        let s = gpu.stream().clone();
        let id = tl
            .begin(&s, Track::Compute, "kept", SpanMeta::default())
            .unwrap();
        tl.end(&s, id).unwrap();
        let c = tl.host_cost(&s, 500).unwrap().expect("enabled");
        assert_eq!(c.spans, 500);
        for x in [c.span_us, c.record_us, c.record_gpu_us, c.capture_query_us] {
            assert!(x.is_finite() && x > 0.0, "{c:?}");
        }
        let spans = tl.collect().unwrap();
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["kept"], "{names:?}");
        println!("trace host cost: {c:?}");
    });
}
