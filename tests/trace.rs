//! Trace merge and summary on synthetic event lists with known overlap (issue 6 item 5).

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
