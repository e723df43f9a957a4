//! `sparda report` and `sparda bench --resume` on the CPU: the roofline on
//! hand numbers, resume planning on a temporary directory, the report of
//! hand-made cell files and a baseline, and the committed single-file
//! equivalent-batch report (runtime.md §5).

use serde_json::{json, Value};
use sparda::report::*;
use std::path::{Path, PathBuf};

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sparda_report_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn roofline_on_hand_numbers() {
    // 1 GB over PCIe at 50 GB/s = 20 ms; 37 GB from HBM at 3,700 GB/s = 10 ms
    let mut i = RooflineInput {
        pcie_bytes: 1e9,
        hbm_bytes: 37e9,
        pcie_gb_s: 50.0,
        hbm_gb_s: 3700.0,
        overlapped: false,
    };
    let r = roofline(&i);
    assert!((r.pcie_ms - 20.0).abs() < 1e-9);
    assert!((r.hbm_ms - 10.0).abs() < 1e-9);
    assert!((r.step_ms - 30.0).abs() < 1e-9, "sync: the sum");
    i.overlapped = true;
    assert!(
        (roofline(&i).step_ms - 20.0).abs() < 1e-9,
        "prefetch: the larger"
    );
    i.pcie_bytes = 0.0;
    i.overlapped = false;
    let r = roofline(&i);
    assert_eq!(r.pcie_ms, 0.0);
    assert!((r.step_ms - 10.0).abs() < 1e-9, "GPU-resident: HBM alone");
    i.hbm_gb_s = 0.0;
    assert!(
        roofline(&i).step_ms.is_nan(),
        "a zero rate gives NaN, not a panic"
    );
}

fn nosa8b() -> ModelShape {
    ModelShape {
        weight_bytes: 16_372_638_464.0,
        layers: 32,
        kv_heads: 2,
        head_dim: 128,
        vocab: 73_448,
        hidden: 4096,
        tie_word_embeddings: false,
        budget_blocks: 64,
        block_size: 64,
        kernel_stride: 16,
    }
}

#[test]
fn hbm_bytes_of_a_step_on_the_nosa_8b_shape() {
    let s = nosa8b();
    // weights 16,372,638,464 − 73,448·4,096·2 = 15,770,952,448
    // dense B 32, L 16K: 32·32·2 heads · 16,384 · 128 · 4 = 17,179,869,184
    assert_eq!(hbm_bytes_per_step(&s, 32, 16_384, false), 32_950_821_632.0);
    // sparse B 128: per head 4,096 attended tokens · 512 + 1,024 Kc rows · 256
    // = 2,359,296; × 8,192 heads = 19,327,352,832
    assert_eq!(hbm_bytes_per_step(&s, 128, 16_384, true), 35_098_305_280.0);
    // a context shorter than the budget reads only its own tokens
    assert_eq!(
        hbm_bytes_per_step(&s, 1, 1024, true),
        15_770_952_448.0 + 64.0 * (1024.0 * 512.0 + 64.0 * 256.0)
    );
    let tied = ModelShape {
        tie_word_embeddings: true,
        ..s
    };
    assert_eq!(
        hbm_bytes_per_step(&tied, 1, 64, false),
        16_372_638_464.0 + 64.0 * 64.0 * 512.0
    );
}

fn key(mode: &str, context: usize) -> CellKey {
    CellKey {
        model: "synth:nosa-8b".into(),
        mode: mode.into(),
        context,
        equivalent_batch: 64,
        steps: 64,
        warmup: 2,
        prefill: "synthetic".into(),
        forecast: Some("synth:1".into()),
        fetch: "offload-auto".into(),
        seed: 0,
        budget_blocks: None,
        select_blocks: None,
    }
}

#[test]
fn resume_skips_existing_cells_and_runs_missing_ones() {
    let d = tmp_dir("resume");
    let keys = [
        key("nosa-offload-sync", 65_536),
        key("forecast-prefetch", 65_536),
        key("nosa-offload-sync", 131_072),
    ];
    assert_eq!(keys[0].file_name(), "nosa-offload-sync_L65536_eb64.json");
    let f0 = d.join(keys[0].file_name());
    write_atomic(
        &f0,
        &json!({"cell_key": keys[0], "commit": "abc1234", "case": {}}),
    )
    .unwrap();
    assert!(!d.join("nosa-offload-sync_L65536_eb64.json.tmp").exists());
    let plan = plan_cells(&d, &keys).unwrap();
    assert_eq!(
        plan,
        vec![
            CellPlan::Done(f0.clone()),
            CellPlan::Run(d.join("forecast-prefetch_L65536_eb64.json")),
            CellPlan::Run(d.join("nosa-offload-sync_L131072_eb64.json")),
        ]
    );
    // another commit does not matter; another step count does, and is named
    let mut other = key("forecast-prefetch", 65_536);
    other.steps = 32;
    write_atomic(
        &d.join(other.file_name()),
        &json!({"cell_key": other, "commit": "def"}),
    )
    .unwrap();
    let e = plan_cells(&d, &keys).unwrap_err().to_string();
    assert!(e.contains("forecast-prefetch_L65536_eb64.json"), "{e}");
    assert!(
        e.contains("cell_key.steps") && e.contains("32") && e.contains("64"),
        "{e}"
    );
    // a file that is not a cell file is an error naming it, not a skip
    std::fs::write(d.join(other.file_name()), "{not json").unwrap();
    let e = plan_cells(&d, &keys).unwrap_err().to_string();
    assert!(e.contains("not JSON") && e.contains("line 1"), "{e}");
    // a directory that does not exist yet: everything runs
    let plan = plan_cells(&d.join("new"), &keys).unwrap();
    assert!(plan.iter().all(|p| matches!(p, CellPlan::Run(_))));
    let _ = std::fs::remove_dir_all(&d);
}

fn meta() -> Value {
    json!({
        "gpu": "NVIDIA H200", "driver_cuda_version": "13.0", "commit": "abc1234",
        "date_utc": "2026-12-02T10:00:00Z", "model": "synth:nosa-8b",
        "config": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 2, "head_dim": 128,
                   "intermediate": 16384, "vocab": 73448, "tie_word_embeddings": false,
                   "budget_blocks_S": 64, "block_size": 64, "kernel_stride": 16},
        "weight_bytes": 16_372_638_464u64,
        "gemm_ceiling": [{"batch": 128, "layers_gb_per_s": 3700.0}],
    })
}

#[allow(clippy::too_many_arguments)]
fn cell(
    mode_slug: &str,
    mode: &str,
    kv: &str,
    sel: &str,
    b: u64,
    l: u64,
    asked: u64,
    step: f64,
    fetched: Option<f64>,
) -> Value {
    let mut v = meta();
    v["cell_key"] = serde_json::to_value(key(mode_slug, asked as usize)).unwrap();
    let mut c = json!({"attention": if mode.starts_with("dense") {"dense"} else {"sparse"},
        "kv": kv, "selection": sel, "eb_mode": mode, "equivalent_batch": 64, "batch": b,
        "context": l, "context_asked": asked, "step_ms_median": step, "step_ms_p99": step * 1.1,
        "tokens_per_s": b as f64 * 1e3 / step, "gpu_mem_used_bytes": 40u64 << 30});
    if let Some(f) = fetched {
        c["offload"] = json!({"locality_gamma": 0.8, "bytes_fetched_per_step": f});
        c["host_pinned_bytes"] = json!(60u64 << 30);
    }
    v["case"] = c;
    v
}

/// Dense attention, KV on the GPU, B 4 at 64K, a 20 ms step: 24,360,887,040
/// HBM bytes per step (weights less the embedding + the whole KV).
fn dense_b4_64k() -> Value {
    cell(
        "dense-gpu",
        "dense, KV on GPU",
        "gpu",
        "dense",
        4,
        65_536,
        65_536,
        20.0,
        None,
    )
}

#[test]
fn report_of_hand_made_cells_and_a_baseline() {
    let d = tmp_dir("cells");
    let cells = d.join("cells");
    let c1 = dense_b4_64k();
    let c2 = cell(
        "forecast-prefetch",
        "forecast + prefetch",
        "offload-auto",
        "forecast+prefetch",
        64,
        130_048,
        131_072,
        100.0,
        Some(2.53e9),
    );
    let c3 = cell(
        "nosa-offload-sync",
        "NOSA offloaded (sync)",
        "offload-auto",
        "query-aware (sync NOSA)",
        64,
        65_536,
        65_536,
        80.0,
        Some(2.53e9),
    );
    for (n, c) in [("a.json", &c1), ("b.json", &c2), ("c.json", &c3)] {
        write_atomic(&cells.join(n), c).unwrap();
    }
    std::fs::write(cells.join("leftover.json.tmp"), "{").unwrap(); // an interrupted write: ignored
    let base = d.join("baseline.json");
    std::fs::write(&base, json!({"baseline": "transformers-sdpa", "what": "transformers, PyTorch SDPA, full attention",
        "torch": "2.11", "transformers": "5.17", "gpu": "NVIDIA H200",
        "rows": [{"mode": "transformers SDPA, KV on GPU", "batch": 4, "context": 65536, "equivalent_batch": 64,
                  "tokens_per_s": 40.0, "step_ms_median": 100.0, "step_ms_p99": 104.0,
                  "gpu_mem_used_bytes": 30u64 << 30, "host_mem_bytes": 0}]}).to_string()).unwrap();
    // the same baseline at the bench's capped 128K context, another file
    let base2 = d.join("baseline_127k.json");
    std::fs::write(&base2, json!({"baseline": "transformers-sdpa", "what": "transformers, PyTorch SDPA, full attention",
        "torch": "2.11", "transformers": "5.17", "gpu": "NVIDIA H200",
        "date_utc": "2026-12-01T23:40:20Z", "commit": "abc1234",
        "rows": [{"mode": "transformers SDPA, KV on GPU", "batch": 1, "context": 130048, "equivalent_batch": 64,
                  "tokens_per_s": 11.6, "step_ms_median": 84.7, "step_ms_p99": 95.7,
                  "gpu_mem_used_bytes": 20u64 << 30, "host_mem_bytes": 0}]}).to_string()).unwrap();
    let l = load_inputs(&[cells.clone(), base.clone(), base2.clone()]).unwrap();
    let modes: Vec<&str> = l.rows.iter().map(|r| r.mode.as_str()).collect();
    assert_eq!(
        modes,
        [
            "dense, KV on GPU",
            "NOSA offloaded (sync)",
            "transformers SDPA, KV on GPU",
            "forecast + prefetch",
            "transformers SDPA, KV on GPU"
        ]
    );
    assert_eq!(l.rows[4].commit.as_deref(), Some("abc1234"));
    assert!(l.rows[2].baseline);
    let md = markdown(&l);
    // dense B 4 at 64K: HBM 15,770,952,448 + 4·64·65,536·512 = 24,360,887,040 B at 3,700 GB/s = 6.58 ms
    assert!(md.contains("| 64K | 64 | dense, KV on GPU | 4 | 200 | 20.00 | 22.00 | – | – | 40.0 | 0.0 | 6.58 | 3.04 |\n"), "{md}");
    // sync: 2.53 GB at 50.6 GB/s = 50 ms, + HBM (15,770,952,448 + 4,096·(2,097,152 + 4,096·256)) / 3.7e12 = 7.74 ms
    assert!(md.contains("| 64K | 64 | NOSA offloaded (sync) | 64 | 800 | 80.00 | 88.00 | 0.800 | 31.6 | 40.0 | 60.0 | 57.74 | 1.39 |\n"), "{md}");
    // prefetch: max(50, HBM) = 50 ms; the capped context is stated
    assert!(md.contains("| 127K (128K asked) | 64 | forecast + prefetch | 64 | 640 | 100.00 | 110.00 | 0.800 | 25.3 | 40.0 | 60.0 | 50.00 | 2.00 |\n"), "{md}");
    assert!(md.contains("| 64K | 64 | transformers SDPA, KV on GPU | 4 | 40 | 100.00 | 104.00 | – | – | 30.0 | 0.0 | – | – |\n"), "{md}");
    assert!(md.contains("128K ran as 127K (130048 tokens)"), "{md}");
    // the baseline at the capped context prints under the bench's label
    assert!(
        md.contains(
            "| 127K (128K asked) | 64 | transformers SDPA, KV on GPU | 1 | 12 | 84.70 | 95.70 |"
        ),
        "{md}"
    );
    // one line for the baseline's two files, with the dates and commits they give
    assert_eq!(
        md.matches("Baseline `transformers-sdpa`").count(),
        1,
        "{md}"
    );
    assert!(md.contains("Baseline `transformers-sdpa`: transformers, PyTorch SDPA, full attention (torch 2.11, transformers 5.17, NVIDIA H200; date 2026-12-01; commit abc1234)"), "{md}");
    let prefix = d.join("out/eb64");
    write_report(&l, &prefix).unwrap();
    let svg = std::fs::read_to_string(d.join("out/eb64.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(100)]);
    assert!(svg.contains("forecast + prefetch") && svg.contains("transformers SDPA, KV on GPU"));
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("out/eb64.json")).unwrap()).unwrap();
    assert_eq!(j["rows"].as_array().unwrap().len(), 5);
    assert_eq!(j["runs"][0]["gpu"], "NVIDIA H200");
    assert_eq!(
        j["rows"][3]["roofline"]["step_ms"]
            .as_f64()
            .unwrap()
            .round(),
        50.0
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_inputs_are_errors_naming_the_file() {
    let d = tmp_dir("bad");
    let f = d.join("x.json");
    std::fs::write(&f, r#"{"something": 1}"#).unwrap();
    let e = load_inputs(std::slice::from_ref(&f))
        .unwrap_err()
        .to_string();
    assert!(e.contains("x.json") && e.contains("neither"), "{e}");
    std::fs::write(
        &f,
        r#"{"baseline": "b", "rows": [{"mode": "m", "batch": 1}]}"#,
    )
    .unwrap();
    let e = load_inputs(&[f]).unwrap_err().to_string();
    assert!(e.contains("rows[0]") && e.contains("`context`"), "{e}");
    assert!(load_inputs(&[d.join("empty")]).is_err());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_committed_eb128_report_reads_in_the_old_single_file_format() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/results/equivalent_batch_eb128_16k_2026-11-30_93b82b9.json");
    let l = load_inputs(&[f]).unwrap();
    assert_eq!(l.rows.len(), 6);
    let r = l
        .rows
        .iter()
        .find(|r| r.mode == "NOSA offloaded (sync)")
        .unwrap();
    assert_eq!(
        (r.batch, r.context, r.equivalent_batch),
        (128, 16_384, Some(128))
    );
    assert_eq!(r.tokens_per_s.unwrap().round(), 1450.0);
    // no GEMM ceiling in that run: HBM at device.md's 3.67 TB/s;
    // 3,319,296,000 B / 50.6 GB/s = 65.60 ms + 35,098,305,280 B / 3.67 TB/s = 9.56 ms
    let rl = r.roofline.unwrap();
    assert!((rl.pcie_ms - 65.599).abs() < 0.01, "{rl:?}");
    assert!((rl.hbm_ms - 9.5636).abs() < 0.01, "{rl:?}");
    assert!((r.measured_over_roofline.unwrap() - 88.28 / 75.162).abs() < 0.001);
    assert_eq!(r.step_ms_p99, None, "not recorded then");
    let fp = l
        .rows
        .iter()
        .find(|r| r.mode == "forecast + prefetch")
        .unwrap();
    assert!(
        (fp.roofline.unwrap().step_ms - 65.6).abs() < 0.1,
        "prefetch: PCIe alone bounds it"
    );
}

#[test]
fn readme_section_is_replaced_between_the_markers() {
    let text = format!("# x\n\nbefore\n{README_BEGIN}\nold table\n{README_END}\nafter\n");
    let out = replace_between_markers(&text, "| new |\n", "README.md").unwrap();
    assert_eq!(
        out,
        format!("# x\n\nbefore\n{README_BEGIN}\n| new |\n{README_END}\nafter\n")
    );
    let e = replace_between_markers("no markers", "x", "README.md")
        .unwrap_err()
        .to_string();
    assert!(e.contains("README.md") && e.contains("BEGIN"), "{e}");
}

#[test]
fn prefill_cases_and_a_prefill_baseline_make_their_own_table() {
    let d = tmp_dir("prefill");
    let bench = d.join("prefill_bench.json");
    let report = json!({
        "what": "sparda bench --steps 0: prefill only", "gpu": "NVIDIA H200", "commit": "abc1234",
        "date_utc": "2026-12-01T05:00:00Z", "model": "synth:nosa-8b",
        "cases": [
            {"attention": "sparse", "kv": "gpu", "batch": 1, "context": 32768,
             "prefill_mode": "as the attention mode says", "prefill_tokens_per_s": 20480.0,
             "ttft_ms_median": 1600.25, "gpu_mem_used_bytes": 32.0 * 1073741824.0},
            {"attention": "sparse", "kv": "offload-sm16", "batch": 4, "context": 32768,
             "prefill_mode": "dense", "prefill_tokens_per_s": 9000.0, "ttft_ms_median": 3640.0},
            {"attention": "sparse", "kv": "gpu", "batch": 4, "context": 131072,
             "prefill_only": true, "prefill_mode": "dense", "skipped": "needs 300 GiB"}
        ]
    });
    std::fs::write(&bench, report.to_string()).unwrap();
    let base = d.join("transformers_prefill.json");
    std::fs::write(
        &base,
        json!({"baseline": "transformers-sdpa-prefill", "what": "SDPA", "torch": "2.9", "transformers": "4.57",
               "gpu": "NVIDIA H200",
               "rows": [{"mode": "transformers SDPA prefill", "batch": 1, "context": 32768,
                         "prefill_tokens_per_s": 12550.0, "ttft_ms_median": 2611.0}]})
        .to_string(),
    )
    .unwrap();
    let l = load_inputs(&[bench, base]).unwrap();
    assert_eq!(l.rows.len(), 4);
    assert!(l.rows.iter().all(is_prefill_row));
    let modes: Vec<&str> = l.rows.iter().map(|r| r.mode.as_str()).collect();
    assert!(modes.contains(&"sparse prefill, KV on GPU"), "{modes:?}");
    assert!(
        modes.contains(&"dense prefill (sparse decode), KV offloaded"),
        "{modes:?}"
    );
    let md = markdown(&l);
    assert!(
        !md.contains(TABLE_HEADER),
        "no decode rows, no decode table:\n{md}"
    );
    assert!(md.contains(PREFILL_TABLE_HEADER), "{md}");
    assert!(
        md.contains("| 32K | sparse prefill, KV on GPU | 1 | 20480 | 1600.2 | 32.0 |"),
        "{md}"
    );
    assert!(
        md.contains("| 32K | transformers SDPA prefill | 1 | 12550 | 2611.0 | – |"),
        "{md}"
    );
    assert!(
        md.contains(
            "| 128K | dense prefill (sparse decode), KV on GPU | 4 | skipped: needs 300 GiB | | |"
        ),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_prefill_only_report_writes_its_prefill_chart() {
    let d = tmp_dir("prefill_chart");
    let bench = d.join("p.json");
    std::fs::write(
        &bench,
        json!({"commit": "abc1234", "prefill_attention": "tensor-core", "cases": [
            {"attention": "sparse", "kv": "gpu", "batch": 1, "context": 4096, "prefill_only": true,
             "prefill_tokens_per_s": 15000.0, "ttft_ms_median": 270.0},
            {"attention": "sparse", "kv": "gpu", "batch": 1, "context": 32768, "prefill_only": true,
             "prefill_tokens_per_s": 9000.0, "ttft_ms_median": 3600.0}]})
        .to_string(),
    )
    .unwrap();
    let l = load_inputs(&[bench]).unwrap();
    let prefix = d.join("out/prefill_report");
    let md = write_report(&l, &prefix).unwrap();
    assert!(
        md.contains(
            "| 4K | sparse prefill, KV on GPU, tensor-core attention | 1 | 15000 | 270.0 |"
        ),
        "{md}"
    );
    let svg = std::fs::read_to_string(d.join("out/prefill_report.prefill.svg")).unwrap();
    assert!(
        svg.contains("prefill tokens/s against prompt length"),
        "chart caption"
    );
    assert!(
        svg.contains("sparse prefill, KV on GPU, tensor-core attention, B = 1"),
        "legend names mode and batch"
    );
    assert!(
        !d.join("out/prefill_report.svg").exists(),
        "no decode chart without decode rows"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn rows_above_the_roofline_say_where_their_time_goes() {
    // the parts by hand: sync = step − GEMMs − fetch, prefetch = step − fetch
    let sync = StepParts {
        step_ms: 33.0,
        gemm_ms: 4.0,
        gemm_batch: 32,
        fetch_ms: Some(19.0),
        fetch_gb_s: Some(50.0),
        overlapped: false,
        dense: false,
    };
    assert!((sync.rest_ms() - 10.0).abs() < 1e-9);
    let prefetch = StepParts {
        step_ms: 20.0,
        overlapped: true,
        ..sync
    };
    assert!((prefetch.rest_ms() - 1.0).abs() < 1e-9);
    let resident = StepParts {
        step_ms: 6.5,
        fetch_ms: None,
        fetch_gb_s: None,
        ..sync
    };
    assert!((resident.rest_ms() - 2.5).abs() < 1e-9);
    // parts past the step (timing noise) leave nothing, never a negative rest
    let noisy = StepParts {
        step_ms: 18.9,
        ..prefetch
    };
    assert_eq!(noisy.rest_ms(), 0.0);

    // a report: one GPU-resident cell above 1.2× and one offloaded sync cell below it
    let d = tmp_dir("above");
    let cells = d.join("cells");
    let mut gpu = cell(
        "nosa-gpu",
        "NOSA, KV on GPU",
        "gpu",
        "query-aware (sync NOSA)",
        2,
        65_536,
        65_536,
        6.4,
        None,
    );
    gpu["gemm_ceiling"] = json!([
        {"batch": 2, "layers_gb_per_s": 3700.0, "layers_graph_ms": 3.9, "lm_head_ms": 0.1},
        {"batch": 64, "layers_gb_per_s": 3700.0, "layers_graph_ms": 4.2, "lm_head_ms": 0.1}
    ]);
    let mut off = cell(
        "nosa-offload-sync",
        "NOSA offloaded (sync)",
        "offload-auto",
        "query-aware (sync NOSA)",
        64,
        65_536,
        65_536,
        58.0,
        Some(2.53e9),
    );
    off["gemm_ceiling"] = gpu["gemm_ceiling"].clone();
    off["case"]["offload"]["fetch_timing"] =
        json!({"fetch_ms_per_step": 50.5, "achieved_gb_s": 50.1});
    write_atomic(&cells.join("a.json"), &gpu).unwrap();
    write_atomic(&cells.join("b.json"), &off).unwrap();
    let l = load_inputs(&[cells]).unwrap();
    let p = l.rows[0].parts.unwrap();
    // GEMMs at the nearest measured batch (B = 2): 3.9 + 0.1 ms
    assert_eq!((p.gemm_batch, p.fetch_ms), (2, None));
    assert!((p.gemm_ms - 4.0).abs() < 1e-9 && (p.rest_ms() - 2.4).abs() < 1e-9);
    let q = l.rows[1].parts.unwrap();
    assert_eq!((q.gemm_batch, q.fetch_ms), (64, Some(50.5)));
    let md = markdown(&l);
    // B 2 at 64K: HBM (15,770,952,448 + 128·(2,097,152 + 4,096·256)) / 3.7e12 = 4.37 ms; 6.4 / 4.37 = 1.46
    assert!(md.contains("Above 1.2× the roofline"), "{md}");
    assert!(
        md.contains("- 64K EB 64 NOSA, KV on GPU, B = 2: 1.46× (6.40 vs 4.37 ms): the layer GEMMs and lm_head alone take 4.00 ms at B = 2, against the roofline's 4.37 ms for every HBM byte; the other 2.40 ms are attention, selection"),
        "{md}"
    );
    // the offloaded cell is 58 / 57.74 = 1.00×: not listed
    assert!(!md.contains("NOSA offloaded (sync), B = 64:"), "{md}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_launch_bound_gemm_rate_is_not_taken_as_the_hbm_ceiling() {
    // NOSA-8B's layer GEMMs stream HBM: their rate is the roofline's
    let big = json!({"gemm_ceiling": [{"batch": 16, "layers_gb_per_s": 3787.0}]});
    let (r, why) = hbm_rate(&big, 16);
    assert_eq!(r, 3787.0);
    assert!(why.contains("measured") && why.contains("B = 16"), "{why}");
    // SmolLM2-135M's (212 MB of layer weights at B = 96) are launch-bound: the constant
    let small = json!({"gemm_ceiling": [{"batch": 96, "layers_gb_per_s": 452.2}]});
    let (r, why) = hbm_rate(&small, 96);
    assert_eq!(r, HBM_WEIGHT_READ_GB_S);
    assert!(
        why.contains("452 GB/s") && why.contains("too small"),
        "{why}"
    );
    // just at the share the measured rate counts
    let edge = json!({"gemm_ceiling": [{"batch": 1, "layers_gb_per_s": MIN_MEASURED_HBM_SHARE * HBM_WEIGHT_READ_GB_S}]});
    assert_eq!(
        hbm_rate(&edge, 1).0,
        MIN_MEASURED_HBM_SHARE * HBM_WEIGHT_READ_GB_S
    );
    assert_eq!(hbm_rate(&json!({}), 1).0, HBM_WEIGHT_READ_GB_S);
}

#[test]
fn a_baseline_takes_the_capped_label_only_when_one_asked_context_ran_there() {
    let d = tmp_dir("labels");
    let cells = d.join("cells");
    let base = json!({"baseline": "transformers-sdpa", "what": "w", "torch": "t", "transformers": "t", "gpu": "g",
        "rows": [{"mode": "transformers SDPA, KV on GPU", "batch": 1, "context": 130048, "equivalent_batch": 64,
                  "tokens_per_s": 11.6, "step_ms_median": 84.7, "step_ms_p99": 95.7}]});
    std::fs::write(d.join("b.json"), base.to_string()).unwrap();
    let c = |slug: &str, asked: u64| {
        cell(
            slug,
            "dense, KV on GPU",
            "gpu",
            "dense",
            1,
            130_048,
            asked,
            7.0,
            None,
        )
    };
    write_atomic(&cells.join("a.json"), &c("dense-gpu", 131_072)).unwrap();
    let l = load_inputs(&[cells.clone(), d.join("b.json")]).unwrap();
    let b = l.rows.iter().find(|r| r.baseline).unwrap();
    assert_eq!((b.context_asked, b.label_asked), (None, Some(131_072)));
    assert!(
        table_row(b).starts_with("| 127K (128K asked) |"),
        "{}",
        table_row(b)
    );
    // a second ask capped to the same context: which label is the baseline's? neither
    write_atomic(&cells.join("c.json"), &c("dense-gpu-200k", 204_800)).unwrap();
    let l = load_inputs(&[cells, d.join("b.json")]).unwrap();
    let b = l.rows.iter().find(|r| r.baseline).unwrap();
    assert_eq!(b.label_asked, None);
    assert!(table_row(b).starts_with("| 127K |"), "{}", table_row(b));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_case_rate_below_the_share_gives_the_roofline_the_constant() {
    let d = tmp_dir("caserate");
    let mut v = dense_b4_64k();
    v["case"]["hbm_gb_s"] = json!(452.0);
    v["gemm_ceiling"] = json!([{"batch": 4, "layers_gb_per_s": 452.0}]);
    write_atomic(&d.join("a.json"), &v).unwrap();
    let l = load_inputs(std::slice::from_ref(&d)).unwrap();
    // dense_b4_64k's 24,360,887,040 HBM bytes at the constant (6.64 ms), not at the
    // measured 452 GB/s (53.9 ms)
    let roof = l.rows[0].roofline.unwrap();
    let want = 24_360_887_040.0 / (HBM_WEIGHT_READ_GB_S * 1e9) * 1e3;
    assert!(
        (roof.hbm_ms - want).abs() < 1e-9,
        "{} vs {want}",
        roof.hbm_ms
    );
    let _ = std::fs::remove_dir_all(&d);
}
