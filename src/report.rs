//! The benchmark report (runtime.md §5): every mode side by side under the
//! equivalent-batch protocol, as serving engines publish theirs — one JSON
//! of every figure, a markdown table and an SVG chart of tokens/s against
//! context length per mode.
//!
//! Everything here is pure host code, testable without a GPU:
//! - [`roofline`] and [`hbm_bytes_per_step`]: the step time the step's bytes
//!   would take at the measured ceilings (runtime.md §4, device.md);
//! - [`CellKey`], [`plan_cells`], [`write_atomic`]: the per-cell result files
//!   of `sparda bench --resume DIR` and which cells a re-run skips;
//! - [`load_inputs`], [`markdown`], [`merged_json`], [`write_chart`],
//!   [`replace_between_markers`]: `sparda report`, which merges cell files,
//!   old single-file `sparda bench --json` reports and baseline JSONs
//!   (benches/baselines/) into rows.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// PCIe ceiling of the fetch, GB/s (10⁹ bytes/s): the UVA gather kernel,
/// 32 CTAs × 256 threads, 16-byte loads, random 16 KiB blocks from pinned
/// memory on the H200 machine (runtime.md §4).
pub const PCIE_CEILING_GB_S: f64 = 50.6;

/// HBM weight-read rate used when a report has no GEMM ceiling of its own,
/// GB/s: every layer's four GEMMs as one CUDA graph at B = 1 on the H200,
/// 15.2 GB in 4.13 ms = 3.67 TB/s (device.md, "layer-GEMM ceiling").
pub const HBM_WEIGHT_READ_GB_S: f64 = 3670.0;

/// Compression stride in tokens when a report's config does not give it
/// (nosa-model.md: `kernel_stride` 16).
pub const DEFAULT_KERNEL_STRIDE: usize = 16;

/// Bytes one decode step moves, and the rates they move at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RooflineInput {
    /// Bytes fetched over PCIe per step (the fetch counters; 0 for
    /// GPU-resident modes).
    pub pcie_bytes: f64,
    /// Bytes read from HBM per step ([`hbm_bytes_per_step`]).
    pub hbm_bytes: f64,
    /// PCIe ceiling, GB/s ([`PCIE_CEILING_GB_S`]).
    pub pcie_gb_s: f64,
    /// HBM read rate, GB/s (the measured GEMM ceiling when it reaches
    /// [`MIN_MEASURED_HBM_SHARE`] of [`HBM_WEIGHT_READ_GB_S`], else that
    /// constant: [`hbm_rate`]).
    pub hbm_gb_s: f64,
    /// Whether the fetch overlaps compute (forecast + prefetch): then the
    /// step takes the larger of the two times, else their sum.
    pub overlapped: bool,
}

/// The roofline of one step, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Roofline {
    /// pcie_bytes / pcie rate.
    pub pcie_ms: f64,
    /// hbm_bytes / HBM rate.
    pub hbm_ms: f64,
    /// max(pcie_ms, hbm_ms) when overlapped, else pcie_ms + hbm_ms.
    pub step_ms: f64,
}

/// The step time a step's bytes would take at the ceilings:
///
/// - `pcie_ms = pcie_bytes / (pcie_gb_s · 10⁹) · 10³`
/// - `hbm_ms  = hbm_bytes  / (hbm_gb_s  · 10⁹) · 10³`
/// - `step_ms = max(pcie_ms, hbm_ms)` for overlapped (prefetch) modes,
///   `pcie_ms + hbm_ms` for synchronous ones (a GPU-resident mode has
///   `pcie_bytes = 0`, so both give `hbm_ms`).
///
/// A rate ≤ 0 or non-finite gives NaN times (never a panic). Source:
/// runtime.md §4 (ceilings), §5 (modes).
pub fn roofline(i: &RooflineInput) -> Roofline {
    let ms = |bytes: f64, gb_s: f64| {
        if gb_s.is_finite() && gb_s > 0.0 {
            bytes / (gb_s * 1e9) * 1e3
        } else {
            f64::NAN
        }
    };
    let pcie_ms = if i.pcie_bytes == 0.0 {
        0.0
    } else {
        ms(i.pcie_bytes, i.pcie_gb_s)
    };
    let hbm_ms = ms(i.hbm_bytes, i.hbm_gb_s);
    let step_ms = if i.overlapped {
        pcie_ms.max(hbm_ms)
    } else {
        pcie_ms + hbm_ms
    };
    Roofline {
        pcie_ms,
        hbm_ms,
        step_ms,
    }
}

/// The model shape the HBM bytes of a step follow from (a report's
/// `config` and `weight_bytes`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// Bytes of all weights on the GPU (bf16).
    pub weight_bytes: f64,
    /// Decoder layers.
    pub layers: usize,
    /// KV heads Hkv.
    pub kv_heads: usize,
    /// Head dimension D.
    pub head_dim: usize,
    /// Vocabulary size V.
    pub vocab: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Whether lm_head shares the input embedding.
    pub tie_word_embeddings: bool,
    /// Attended blocks S per (sequence, KV head).
    pub budget_blocks: usize,
    /// Tokens per block (64).
    pub block_size: usize,
    /// Compression stride of Kc in tokens (16).
    pub kernel_stride: usize,
}

/// HBM bytes one decode step reads, for `batch` sequences of `context`
/// tokens (bf16 = 2 bytes):
///
/// - weights: `weight_bytes − V·hidden·2` (the input embedding is a gather of
///   B rows, not read whole; nothing is subtracted when lm_head is tied to it);
/// - dense attention: the whole KV, `B · layers · Hkv · L · D · 2 (K, V) · 2`;
/// - sparse attention (NOSA, InfLLM-V2, forecast; resident or offloaded —
///   offloaded modes read their slot pools): the attended blocks,
///   `B · layers · Hkv · min(S·block, L) · D · 2 · 2`, plus the compressed keys
///   the selection scores, `B · layers · Hkv · ⌈L/stride⌉ · D · 2`.
///
/// Left out (small): c, pooled c, activations, logits. Source: runtime.md §4
/// ("Weight reads bound small batches"), nosa-model.md §1 (budget, stride).
pub fn hbm_bytes_per_step(shape: &ModelShape, batch: usize, context: usize, sparse: bool) -> f64 {
    let embed = if shape.tie_word_embeddings {
        0.0
    } else {
        (shape.vocab * shape.hidden * 2) as f64
    };
    let weights = (shape.weight_bytes - embed).max(0.0);
    let per_token_head = (shape.head_dim * 2 * 2) as f64; // K and V, bf16
    let heads = (batch * shape.layers * shape.kv_heads) as f64;
    let kv = if sparse {
        let attended = (shape.budget_blocks * shape.block_size).min(context) as f64;
        let kc = context.div_ceil(shape.kernel_stride.max(1)) as f64 * (shape.head_dim * 2) as f64;
        heads * (attended * per_token_head + kc)
    } else {
        heads * context as f64 * per_token_head
    };
    weights + kv
}

/// What identifies a benchmark cell across runs (`sparda bench --resume`):
/// a re-run skips a cell whose file exists with an equal key. The commit is
/// recorded in the file, not compared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellKey {
    /// `--model` as given (`synth:nosa-8b`, a directory).
    pub model: String,
    /// The mode's slug ([`crate::bench::EbMode::slug`]).
    pub mode: String,
    /// The context asked for, tokens (before any cap at the model's maximum).
    pub context: usize,
    /// Equivalent batch size EB (runtime.md §5).
    pub equivalent_batch: usize,
    /// Timed decode steps.
    pub steps: usize,
    /// Warm-up decode steps.
    pub warmup: usize,
    /// How sequences were filled (`synthetic`, `real (Dense)`, …).
    pub prefill: String,
    /// `--forecast` as given (null without).
    pub forecast: Option<String>,
    /// The fetch engine of offloaded modes (`offload-auto`, `offload-sm16`, …).
    pub fetch: String,
    /// Seed of synthetic state and random ids.
    pub seed: u64,
    /// `--budget-blocks` override.
    pub budget_blocks: Option<usize>,
    /// `--select-blocks` override.
    pub select_blocks: Option<usize>,
}

impl CellKey {
    /// The cell's file name in the results directory:
    /// `{mode}_L{context}_eb{EB}.json`.
    pub fn file_name(&self) -> String {
        format!(
            "{}_L{}_eb{}.json",
            self.mode, self.context, self.equivalent_batch
        )
    }
}

/// What a re-run does with one planned cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellPlan {
    /// Its file exists with the same key: skipped.
    Done(PathBuf),
    /// No file yet: run it and write the file here.
    Run(PathBuf),
}

/// Plans a grid against the results directory `dir`: per key, [`CellPlan::Done`]
/// when `dir/key.file_name()` exists and its `cell_key` equals the key, else
/// [`CellPlan::Run`]. A missing `dir` plans every cell to run.
///
/// Errors: a cell file that is not JSON or has no `cell_key`
/// ([`Error::Input`], naming the file: move it away to re-run the cell);
/// one whose `cell_key` differs in a field ([`Error::Input`] naming the file,
/// the field and both values — results of another configuration are never
/// overwritten: use another directory).
pub fn plan_cells(dir: &Path, keys: &[CellKey]) -> Result<Vec<CellPlan>> {
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        let path = dir.join(k.file_name());
        if !path.exists() {
            out.push(CellPlan::Run(path));
            continue;
        }
        let v = read_json(&path)?;
        let stored = v.get("cell_key").ok_or_else(|| {
            Error::Input(format!(
                "{}: no `cell_key`: not a cell file of `sparda bench --resume` (move it away to re-run the cell)",
                path.display()
            ))
        })?;
        let want = serde_json::to_value(k).expect("CellKey serializes");
        if let Some((field, a, b)) = first_difference(stored, &want) {
            return Err(Error::Input(format!(
                "{}: field `cell_key.{field}` is {a} in the file but {b} in this run: the directory holds another configuration (use another --resume directory)",
                path.display()
            )));
        }
        out.push(CellPlan::Done(path));
    }
    Ok(out)
}

/// The first key of `want` whose value differs in `stored` (missing = null).
fn first_difference(stored: &Value, want: &Value) -> Option<(String, Value, Value)> {
    let w = want.as_object()?;
    for (k, v) in w {
        let s = stored.get(k).cloned().unwrap_or(Value::Null);
        if &s != v {
            return Some((k.clone(), s, v.clone()));
        }
    }
    None
}

/// Writes `v` (pretty JSON) to `path` atomically: to `path.tmp` in the same
/// directory first, then renamed over `path`, so a reader (or a re-run after
/// an interruption) sees either no file or a complete one. Creates the
/// parent directory.
///
/// Errors: [`Error::Io`] naming the file.
pub fn write_atomic(path: &Path, v: &Value) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let text = serde_json::to_string_pretty(v).expect("JSON values serialize");
    std::fs::write(&tmp, text).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Reads a JSON file. Errors: [`Error::Io`]; [`Error::Input`] naming the
/// file, line and column of a syntax error.
fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| {
        Error::Input(format!(
            "{}: not JSON (line {}, column {}): {e}",
            path.display(),
            e.line(),
            e.column()
        ))
    })
}

/// One row of the report: one mode in one (context, EB) cell, or one
/// baseline measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// The file it came from.
    pub source: String,
    /// Mode name ([`crate::bench::EbMode::name`], or the baseline's).
    pub mode: String,
    /// Whether the row is a baseline (another engine).
    pub baseline: bool,
    /// Equivalent batch size, when run under that protocol.
    pub equivalent_batch: Option<u64>,
    /// Real batch size B.
    pub batch: u64,
    /// Context L that ran, tokens.
    pub context: u64,
    /// Context asked for, when it was capped at the model's maximum.
    pub context_asked: Option<u64>,
    /// For a baseline row: the asked context of the bench rows that ran
    /// capped to this row's context (one asked context only), so the
    /// baseline prints under their label (`127K (128K asked)`); None
    /// otherwise.
    pub label_asked: Option<u64>,
    /// Decode tokens/s (B · steps / timed time).
    pub tokens_per_s: Option<f64>,
    /// Median step time, ms.
    pub step_ms_p50: Option<f64>,
    /// 99th-percentile step time, ms (absent in reports before it was recorded).
    pub step_ms_p99: Option<f64>,
    /// Locality γ over the timed steps (offloaded modes).
    pub gamma: Option<f64>,
    /// PCIe bytes per step over the median step time, GB/s (offloaded modes).
    pub pcie_gb_s: Option<f64>,
    /// Device memory in use, bytes.
    pub gpu_mem_bytes: Option<f64>,
    /// Host memory of the KV (pinned store; 0 for GPU-resident modes), bytes.
    pub host_mem_bytes: Option<f64>,
    /// Roofline of the step ([`roofline`]).
    pub roofline: Option<Roofline>,
    /// step_ms_p50 / roofline step_ms.
    pub measured_over_roofline: Option<f64>,
    /// Where the median step's time goes, from the run's own measurements
    /// ([`StepParts`]); None where the run did not measure them.
    pub parts: Option<StepParts>,
    /// Prefill tokens/s (B · L over the sequences' prefill times): set on
    /// the rows of a prefill benchmark (`sparda bench --steps 0`, the
    /// transformers prefill baseline), which have no decode figures.
    pub prefill_tokens_per_s: Option<f64>,
    /// Median time to first token of a prefill row, ms.
    pub ttft_ms_p50: Option<f64>,
    /// Why the cell did not run.
    pub skipped: Option<String>,
    /// Commit of the binary that measured it (a baseline row: its file's
    /// `commit`, the tree of benches/baselines/ it ran from).
    pub commit: Option<String>,
}

/// Run-level facts of a report or cell file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunMeta {
    /// The file.
    pub source: String,
    /// GPU name.
    pub gpu: Option<String>,
    /// CUDA driver version.
    pub driver: Option<String>,
    /// Commit.
    pub commit: Option<String>,
    /// Date (UTC).
    pub date_utc: Option<String>,
    /// `--model`.
    pub model: Option<String>,
    /// The protocol text of the run.
    pub protocol: Option<String>,
    /// How sequences were filled.
    pub prefill: Option<String>,
    /// Where prompt tokens came from.
    pub prompt_tokens: Option<String>,
}

fn s(v: &Value) -> Option<String> {
    v.as_str().map(str::to_string)
}

fn run_meta(v: &Value, source: &str) -> RunMeta {
    RunMeta {
        source: source.to_string(),
        gpu: s(&v["gpu"]),
        driver: s(&v["driver_cuda_version"]),
        commit: s(&v["commit"]),
        date_utc: s(&v["date_utc"]),
        model: s(&v["model"]),
        protocol: s(&v["protocol"]),
        prefill: s(&v["prefill"]),
        prompt_tokens: s(&v["prompt_tokens"]),
    }
}

/// The model shape of a report (its `config` and `weight_bytes`); None
/// when a field is missing. Stride and tying default to nosa-model.md's
/// values when the report predates them.
pub fn model_shape(report: &Value) -> Option<ModelShape> {
    let c = &report["config"];
    let u = |k: &str| c[k].as_u64().map(|x| x as usize);
    Some(ModelShape {
        weight_bytes: report["weight_bytes"].as_f64()?,
        layers: u("layers")?,
        kv_heads: u("kv_heads")?,
        head_dim: u("head_dim")?,
        vocab: u("vocab")?,
        hidden: u("hidden")?,
        tie_word_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(false),
        budget_blocks: u("budget_blocks_S")?,
        block_size: u("block_size")?,
        kernel_stride: u("kernel_stride").unwrap_or(DEFAULT_KERNEL_STRIDE),
    })
}

/// The HBM rate for a cell of batch `batch`: the report's measured
/// layer-GEMM ceiling (`gemm_ceiling[].layers_gb_per_s`) at the nearest
/// batch, else [`HBM_WEIGHT_READ_GB_S`]. A measured rate below
/// [`MIN_MEASURED_HBM_SHARE`] of that constant is not taken as the ceiling:
/// a small model's layer GEMMs (SmolLM2-135M: 212 MB of layer weights,
/// 452 GB/s) are bound by launches and latency, not by HBM, and a roofline
/// at their rate would lie above steps that run faster. Returns (GB/s,
/// where it came from).
pub fn hbm_rate(report: &Value, batch: u64) -> (f64, String) {
    match nearest_ceiling(report, batch, |c| c["layers_gb_per_s"].as_f64()) {
        Some((b, r)) if streams_hbm(r) => {
            (r, format!("measured layer-GEMM ceiling at B = {b}"))
        }
        Some((b, r)) => (
            HBM_WEIGHT_READ_GB_S,
            format!(
                "device.md layer-GEMM ceiling ({:.2} TB/s): the measured {r:.0} GB/s at B = {b} is GEMMs too small to stream HBM",
                HBM_WEIGHT_READ_GB_S / 1e3
            ),
        ),
        None => (
            HBM_WEIGHT_READ_GB_S,
            format!(
                "device.md layer-GEMM ceiling ({:.2} TB/s)",
                HBM_WEIGHT_READ_GB_S / 1e3
            ),
        ),
    }
}

/// The share of [`HBM_WEIGHT_READ_GB_S`] (a fraction, no unit) a measured
/// layer-GEMM rate must reach to serve as the roofline's HBM rate
/// ([`hbm_rate`]). On the H200 (2026-12-01) NOSA-8B's layer GEMMs measure
/// 3,396–3,825 GB/s and SmolLM2-135M's 452–467 GB/s; the cut sits between.
pub const MIN_MEASURED_HBM_SHARE: f64 = 0.5;

/// Whether a measured layer-GEMM rate (GB/s) is taken as the roofline's
/// HBM rate: at least [`MIN_MEASURED_HBM_SHARE`] of [`HBM_WEIGHT_READ_GB_S`].
fn streams_hbm(rate_gb_s: f64) -> bool {
    rate_gb_s >= MIN_MEASURED_HBM_SHARE * HBM_WEIGHT_READ_GB_S
}

/// The mode name of a case: its `eb_mode`, else from its attention,
/// KV placement and selection.
fn case_mode(c: &Value) -> String {
    if let Some(m) = c["eb_mode"].as_str() {
        return m.to_string();
    }
    let kv = c["kv"].as_str().unwrap_or("gpu");
    let sel = c["selection"].as_str().unwrap_or("");
    match (c["attention"].as_str(), kv.starts_with("offload"), sel) {
        (Some("dense"), _, _) => "dense, KV on GPU".into(),
        (_, false, "forecast") => "forecast, KV on GPU".into(),
        (_, false, _) => "NOSA, KV on GPU".into(),
        (_, true, "forecast+prefetch") => "forecast + prefetch".into(),
        (_, true, "forecast, no prefetch") => "forecast, no prefetch".into(),
        (_, true, "query-aware (InfLLM-V2)") => "InfLLM-V2 offloaded (sync)".into(),
        _ => "NOSA offloaded (sync)".into(),
    }
}

/// One row from a bench case and its report (run-level `config`,
/// `weight_bytes`, `gemm_ceiling`, `commit`).
pub fn row_from_case(report: &Value, c: &Value, source: &str) -> Row {
    let f = |v: &Value| v.as_f64().filter(|x| x.is_finite());
    let batch = c["batch"].as_u64().unwrap_or(0);
    let context = c["context"].as_u64().unwrap_or(0);
    let mut row = Row {
        source: source.to_string(),
        mode: case_mode(c),
        baseline: false,
        equivalent_batch: c["equivalent_batch"].as_u64(),
        batch,
        context,
        context_asked: c["context_asked"].as_u64().filter(|&a| a != context),
        label_asked: None,
        tokens_per_s: None,
        step_ms_p50: None,
        step_ms_p99: None,
        gamma: None,
        pcie_gb_s: None,
        gpu_mem_bytes: None,
        host_mem_bytes: None,
        roofline: None,
        measured_over_roofline: None,
        parts: None,
        prefill_tokens_per_s: None,
        ttft_ms_p50: None,
        skipped: s(&c["skipped"]),
        commit: s(&report["commit"]),
    };
    if c["prefill_only"] == true
        || (c["prefill_tokens_per_s"].is_number() && c["step_ms_median"].is_null())
    {
        // a prefill-only case (bench --steps 0)
        let dense = c["prefill_mode"].as_str() == Some("dense");
        let kv = if c["kv"].as_str().is_some_and(|k| k.starts_with("offload")) {
            "KV offloaded"
        } else {
            "KV on GPU"
        };
        row.mode = match (c["attention"].as_str(), dense) {
            (Some("dense"), _) => format!("dense prefill, {kv}"),
            (_, true) => format!("dense prefill (sparse decode), {kv}"),
            _ => format!("sparse prefill, {kv}"),
        };
        // the kernel is a run-level setting of bench (older cases: per case)
        if let Some(a) = c["prefill_attention"]
            .as_str()
            .or(report["prefill_attention"].as_str())
        {
            row.mode.push_str(&format!(", {a} attention"));
        }
        if row.skipped.is_none() {
            row.prefill_tokens_per_s = f(&c["prefill_tokens_per_s"]);
            row.ttft_ms_p50 = f(&c["ttft_ms_median"]);
            row.gpu_mem_bytes = f(&c["gpu_mem_used_bytes"]);
        }
        return row;
    }
    if row.skipped.is_some() {
        return row;
    }
    row.tokens_per_s = f(&c["tokens_per_s"]);
    row.step_ms_p50 = f(&c["step_ms_median"]);
    row.step_ms_p99 = f(&c["step_ms_p99"]);
    row.gamma = f(&c["offload"]["locality_gamma"]);
    let offloaded = c["kv"].as_str().is_some_and(|k| k.starts_with("offload"));
    let pcie_bytes = if offloaded {
        f(&c["offload"]["bytes_fetched_per_step"])
    } else {
        Some(0.0)
    };
    if let (true, Some(b), Some(ms)) = (offloaded, pcie_bytes, row.step_ms_p50) {
        row.pcie_gb_s = Some(b / (ms * 1e-3) / 1e9);
    }
    row.gpu_mem_bytes = f(&c["gpu_mem_used_bytes"]);
    row.host_mem_bytes = if offloaded {
        f(&c["host_pinned_bytes"])
    } else {
        Some(0.0)
    };
    if let (Some(shape), Some(pcie)) = (model_shape(report), pcie_bytes) {
        let sparse = c["attention"].as_str() != Some("dense");
        let hbm = hbm_bytes_per_step(&shape, batch as usize, context as usize, sparse);
        // the case's own measured rate, under the same rule as `hbm_rate`
        let rate = match c["hbm_gb_s"].as_f64() {
            Some(r) if streams_hbm(r) => r,
            _ => hbm_rate(report, batch).0,
        };
        let r = roofline(&RooflineInput {
            pcie_bytes: pcie,
            hbm_bytes: hbm,
            pcie_gb_s: PCIE_CEILING_GB_S,
            hbm_gb_s: rate,
            overlapped: offloaded && c["selection"] == "forecast+prefetch",
        });
        row.measured_over_roofline = row.step_ms_p50.map(|m| m / r.step_ms);
        row.roofline = Some(r);
    }
    if let (Some(step), Some((gemm_ms, gemm_batch))) = (row.step_ms_p50, gemm_ms(report, batch)) {
        let timing = &c["offload"]["fetch_timing"];
        let fetch = f(&timing["fetch_ms_per_step"]);
        row.parts = match (offloaded, fetch) {
            (true, None) => None,
            _ => Some(StepParts {
                step_ms: step,
                gemm_ms,
                gemm_batch,
                fetch_ms: fetch,
                fetch_gb_s: f(&timing["achieved_gb_s"]),
                overlapped: offloaded && c["selection"] == "forecast+prefetch",
                dense: c["attention"].as_str() == Some("dense"),
            }),
        };
    }
    row
}

/// Where a decode step's time goes, from the run's own measurements, ms:
/// the layer GEMMs and lm_head alone (the bench's GEMM-ceiling graph at
/// the nearest measured batch), the fetch (CUDA events around each
/// layer's fetch, offloaded modes), and the rest ([`StepParts::rest_ms`]).
/// The roofline counts bytes; these count time, so together they say why
/// a step is above its roofline (runtime.md §5: "every mode's step within
/// 1.2× its roofline, or the reason it is not").
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepParts {
    /// The median step, ms.
    pub step_ms: f64,
    /// Layer GEMMs + lm_head as one graph, alone, ms.
    pub gemm_ms: f64,
    /// The batch that GEMM time was measured at.
    pub gemm_batch: u64,
    /// The fetch per step, ms (None: GPU-resident).
    pub fetch_ms: Option<f64>,
    /// The fetch's rate while it runs, GB/s.
    pub fetch_gb_s: Option<f64>,
    /// Whether the fetch runs beside compute (forecast + prefetch).
    pub overlapped: bool,
    /// Whether attention is dense (no selection).
    pub dense: bool,
}

impl StepParts {
    /// The time not in the parts, ms (≥ 0): step − GEMMs − fetch for a fetch
    /// inside the layer (and GPU-resident steps: step − GEMMs), step −
    /// fetch under prefetch (what the fetch beside it does not hide). The
    /// rest is attention, selection, the small per-layer kernels and the
    /// gaps between launches.
    pub fn rest_ms(&self) -> f64 {
        let fetch = self.fetch_ms.unwrap_or(0.0);
        let rest = if self.overlapped {
            self.step_ms - fetch
        } else {
            self.step_ms - self.gemm_ms - fetch
        };
        // timing noise can put the parts past the step: nothing is left
        rest.max(0.0)
    }

    /// One sentence: where the step's time goes, against `roofline`.
    pub fn reason(&self, roofline: &Roofline) -> String {
        let rest = self.rest_ms();
        let gemm = format!(
            "the layer GEMMs and lm_head alone take {:.2} ms at B = {}",
            self.gemm_ms, self.gemm_batch
        );
        let others = if self.dense {
            "attention over the whole context (its KV bytes are in the roofline at the weight-read rate), the small per-layer kernels and launch gaps"
        } else {
            "attention, selection, the small per-layer kernels and launch gaps"
        };
        let rate = self
            .fetch_gb_s
            .map(|r| format!(" at {r:.1} GB/s"))
            .unwrap_or_default();
        match self.fetch_ms {
            None => format!(
                "{gemm}, against the roofline's {:.2} ms for every HBM byte; the other {rest:.2} ms are {others}, which do not run at the weight-read rate",
                roofline.hbm_ms
            ),
            Some(f) if self.overlapped => format!(
                "the fetch takes {f:.2} ms{rate} beside compute (roofline {:.2} ms); the step runs {rest:.2} ms past it, compute the fetch does not hide; {gemm}, and the roofline's HBM time is {:.2} ms",
                roofline.pcie_ms, roofline.hbm_ms
            ),
            Some(f) => format!(
                "the fetch takes {f:.2} ms{rate} (roofline {:.2} ms) and each layer waits for it; {gemm}; the other {rest:.2} ms are {others} (the roofline gives all compute {:.2} ms of HBM time)",
                roofline.pcie_ms, roofline.hbm_ms
            ),
        }
    }
}

/// The bench's layer-GEMM + lm_head time (`gemm_ceiling[]`:
/// `layers_graph_ms` + `lm_head_ms`) at the measured batch nearest
/// `batch`, with that batch; None when the report has none.
pub fn gemm_ms(report: &Value, batch: u64) -> Option<(f64, u64)> {
    nearest_ceiling(report, batch, |c| {
        Some(c["layers_graph_ms"].as_f64()? + c["lm_head_ms"].as_f64().unwrap_or(0.0))
    })
    .map(|(b, ms)| (ms, b))
}

/// `figure` of the report's `gemm_ceiling[]` entry at the measured batch
/// nearest `batch`, among the entries where it is finite and > 0: (that
/// batch, the figure); None without one.
fn nearest_ceiling(
    report: &Value,
    batch: u64,
    figure: impl Fn(&Value) -> Option<f64>,
) -> Option<(u64, f64)> {
    report["gemm_ceiling"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| Some((c["batch"].as_u64()?, figure(c)?)))
        .filter(|(_, x)| x.is_finite() && *x > 0.0)
        .min_by_key(|(b, _)| b.abs_diff(batch))
}

/// Rows above this multiple of their roofline get their reason in the
/// report (runtime.md §5).
pub const ROOFLINE_TOLERANCE: f64 = 1.2;

/// Rows of a baseline JSON (benches/baselines/*.py): `{"baseline": NAME,
/// "rows": [{"mode", "batch", "context", "tokens_per_s", "step_ms_median",
/// "step_ms_p99", "gpu_mem_used_bytes", "host_mem_bytes",
/// "equivalent_batch"?, "skipped"?}]}`; a prefill baseline's rows carry
/// `prefill_tokens_per_s` and `ttft_ms_median` instead of the decode figures.
///
/// Errors: [`Error::Input`] naming the file and the row index of a row
/// without `mode`, `batch` or `context`.
pub fn rows_from_baseline(v: &Value, source: &str) -> Result<Vec<Row>> {
    let f = |v: &Value| v.as_f64().filter(|x| x.is_finite());
    let mut out = Vec::new();
    for (i, r) in v["rows"].as_array().into_iter().flatten().enumerate() {
        let need = |k: &str| {
            Error::Input(format!(
                "{source}: rows[{i}]: field `{k}` missing or of the wrong type"
            ))
        };
        out.push(Row {
            source: source.to_string(),
            mode: s(&r["mode"]).ok_or_else(|| need("mode"))?,
            baseline: true,
            equivalent_batch: r["equivalent_batch"].as_u64(),
            batch: r["batch"].as_u64().ok_or_else(|| need("batch"))?,
            context: r["context"].as_u64().ok_or_else(|| need("context"))?,
            context_asked: None,
            label_asked: None,
            tokens_per_s: f(&r["tokens_per_s"]),
            step_ms_p50: f(&r["step_ms_median"]),
            step_ms_p99: f(&r["step_ms_p99"]),
            gamma: None,
            pcie_gb_s: None,
            gpu_mem_bytes: f(&r["gpu_mem_used_bytes"]),
            host_mem_bytes: f(&r["host_mem_bytes"]),
            roofline: None,
            measured_over_roofline: None,
            parts: None,
            prefill_tokens_per_s: f(&r["prefill_tokens_per_s"]),
            ttft_ms_p50: f(&r["ttft_ms_median"]),
            skipped: s(&r["skipped"]),
            commit: s(&v["commit"]),
        });
    }
    Ok(out)
}

/// Everything the report read.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    /// Every row, sorted ([`sort_rows`]).
    pub rows: Vec<Row>,
    /// Run-level facts per file (cell files of one directory: one per file).
    pub runs: Vec<RunMeta>,
    /// Baseline files with their run-level facts (`what`, versions, …).
    pub baselines: Vec<Value>,
}

/// Reads the report's inputs: each path a directory of cell files (every
/// `*.json` in it, `*.tmp` left out), a cell file, an old single-file
/// `sparda bench --json` report (`cases`), or a baseline JSON (`baseline`).
///
/// Errors: unreadable files or bad JSON ([`Error::Io`], [`Error::Input`]
/// naming the file); a JSON that is none of the three ([`Error::Input`]);
/// no input at all.
pub fn load_inputs(paths: &[PathBuf]) -> Result<Loaded> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut in_dir: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| Error::io(p, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.extension().is_some_and(|x| x == "json"))
                .collect();
            in_dir.sort();
            files.extend(in_dir);
        } else {
            files.push(p.clone());
        }
    }
    if files.is_empty() {
        return Err(Error::Input(
            "report: no input JSON (give cell directories, bench reports or baseline files)".into(),
        ));
    }
    let mut out = Loaded::default();
    for f in files {
        let v = read_json(&f)?;
        let src = f.display().to_string();
        if v.get("cell_key").is_some() {
            out.rows.push(row_from_case(&v, &v["case"], &src));
            out.runs.push(run_meta(&v, &src));
        } else if let Some(cases) = v["cases"].as_array() {
            out.rows
                .extend(cases.iter().map(|c| row_from_case(&v, c, &src)));
            out.runs.push(run_meta(&v, &src));
        } else if v.get("baseline").is_some() {
            out.rows.extend(rows_from_baseline(&v, &src)?);
            let mut b = v.clone();
            if let Some(o) = b.as_object_mut() {
                o.remove("rows");
                o.insert("source".into(), json!(src));
            }
            out.baselines.push(b);
        } else {
            return Err(Error::Input(format!(
                "{src}: neither a cell file (`cell_key`), a bench report (`cases`) nor a baseline (`baseline`)"
            )));
        }
    }
    label_capped_baselines(&mut out.rows);
    sort_rows(&mut out.rows);
    Ok(out)
}

/// Sets [`Row::label_asked`] of each baseline row run at a context that
/// bench rows ran capped to (a baseline run at the bench's capped length,
/// e.g. 127K for 128K asked), so that both print under one label; only
/// where a single asked context was capped to it.
fn label_capped_baselines(rows: &mut [Row]) {
    let mut capped: std::collections::BTreeMap<u64, std::collections::BTreeSet<u64>> =
        Default::default();
    for r in rows.iter().filter(|r| !r.baseline) {
        if let Some(a) = r.context_asked {
            capped.entry(r.context).or_default().insert(a);
        }
    }
    for r in rows
        .iter_mut()
        .filter(|r| r.baseline && r.context_asked.is_none())
    {
        r.label_asked = capped
            .get(&r.context)
            .filter(|asked| asked.len() == 1)
            .and_then(|asked| asked.first().copied());
    }
}

/// Report order of a mode name: [`crate::bench::EbMode::ALL`]'s order, then
/// baselines and others by name.
fn mode_rank(r: &Row) -> usize {
    // a checkpoint without eviction heads runs its resident sparse mode as InfLLM-V2
    let name = if r.mode == crate::bench::EB_INFLLM_GPU {
        crate::bench::EbMode::SparseGpu.name()
    } else {
        r.mode.as_str()
    };
    crate::bench::EbMode::ALL
        .iter()
        .position(|m| m.name() == name)
        .unwrap_or(100)
        + if r.baseline { 100 } else { 0 }
}

/// Sorts rows by context, equivalent batch, mode order (the order of
/// [`crate::bench::EbMode::ALL`], baselines after),
/// then batch.
pub fn sort_rows(rows: &mut [Row]) {
    rows.sort_by(|a, b| {
        (
            a.context,
            a.equivalent_batch.unwrap_or(0),
            mode_rank(a),
            &a.mode,
            a.batch,
        )
            .cmp(&(
                b.context,
                b.equivalent_batch.unwrap_or(0),
                mode_rank(b),
                &b.mode,
                b.batch,
            ))
    });
}

/// A context in tokens as the report prints it: `16K` when a multiple of
/// 1,024, else the number.
pub fn context_label(l: u64) -> String {
    if l > 0 && l.is_multiple_of(1024) {
        format!("{}K", l / 1024)
    } else {
        l.to_string()
    }
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "–".into())
}

fn gib(x: Option<f64>) -> String {
    x.map(|v| format!("{:.1}", v / (1u64 << 30) as f64))
        .unwrap_or_else(|| "–".into())
}

/// The header of the markdown table.
pub const TABLE_HEADER: &str = "| L | EB | mode | B | tokens/s | step p50 ms | step p99 ms | γ | PCIe GB/s | GPU GiB | host GiB | roofline ms | measured / roofline |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";

/// One markdown table row (`TABLE_HEADER`'s columns; `–` where a figure
/// does not apply or was not recorded).
pub fn table_row(r: &Row) -> String {
    let l = match r.context_asked.or(r.label_asked) {
        Some(a) => format!("{} ({} asked)", context_label(r.context), context_label(a)),
        None => context_label(r.context),
    };
    let eb = r
        .equivalent_batch
        .map(|e| e.to_string())
        .unwrap_or_else(|| "–".into());
    if let Some(why) = &r.skipped {
        return format!(
            "| {l} | {eb} | {} | {} | skipped: {} | | | | | | | | |\n",
            r.mode,
            r.batch,
            why.replace('|', "/").replace('\n', " ")
        );
    }
    format!(
        "| {l} | {eb} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
        r.mode,
        r.batch,
        opt(r.tokens_per_s, 0),
        opt(r.step_ms_p50, 2),
        opt(r.step_ms_p99, 2),
        opt(r.gamma, 3),
        opt(r.pcie_gb_s, 1),
        gib(r.gpu_mem_bytes),
        gib(r.host_mem_bytes),
        opt(r.roofline.map(|x| x.step_ms), 2),
        opt(r.measured_over_roofline, 2),
    )
}

fn uniq(v: impl Iterator<Item = Option<String>>) -> Vec<String> {
    let mut out: Vec<String> = v.flatten().collect();
    out.sort();
    out.dedup();
    out
}

/// The markdown report: where and what was measured (GPUs, drivers,
/// commits, dates, models, fill), how the roofline is computed, then the
/// table ([`TABLE_HEADER`], one [`table_row`] per row).
pub fn markdown(l: &Loaded) -> String {
    let list = |v: Vec<String>| {
        if v.is_empty() {
            "–".to_string()
        } else {
            v.join(", ")
        }
    };
    let mut out = String::new();
    out.push_str(&format!(
        "- GPU {}; CUDA driver {}; commit {}; date {}; model {}.\n",
        list(uniq(l.runs.iter().map(|r| r.gpu.clone()))),
        list(uniq(l.runs.iter().map(|r| r.driver.clone()))),
        list(uniq(l.runs.iter().map(|r| r.commit.clone()))),
        list(uniq(l.runs.iter().map(|r| {
            r.date_utc.as_ref().map(|d| d.chars().take(10).collect())
        }))),
        list(uniq(l.runs.iter().map(|r| r.model.clone()))),
    ));
    for p in uniq(l.runs.iter().map(|r| r.prefill.clone())) {
        out.push_str(&format!("- Fill: {p}.\n"));
    }
    for p in uniq(l.runs.iter().map(|r| r.prompt_tokens.clone())) {
        out.push_str(&format!("- Prompt tokens: {p}.\n"));
    }
    for p in uniq(l.runs.iter().map(|r| r.protocol.clone())) {
        out.push_str(&format!("- Protocol: {p}.\n"));
    }
    out.push_str(&format!(
        "- Roofline: PCIe bytes of the step (fetch counters) at {PCIE_CEILING_GB_S} GB/s, HBM bytes (weights less the input embedding, plus the KV read: all of it for dense attention, the attended blocks and the compressed keys for sparse) at the run's measured layer-GEMM ceiling when that is at least {MIN_MEASURED_HBM_SHARE} × {:.2} TB/s (device.md), else that constant (a small model's GEMMs do not stream HBM); the larger of the two for forecast + prefetch, the sum otherwise. measured / roofline = step p50 / roofline.\n",
        HBM_WEIGHT_READ_GB_S / 1e3
    ));
    let capped: Vec<String> = l
        .rows
        .iter()
        .filter_map(|r| r.context_asked.map(|a| (a, r.context)))
        .map(|(a, c)| {
            format!(
                "{} ran as {} ({c} tokens)",
                context_label(a),
                context_label(c)
            )
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !capped.is_empty() {
        out.push_str(&format!(
            "- Contexts capped so that the context plus the decoded steps stay within the model's max_position_embeddings: {}.\n",
            capped.join("; ")
        ));
    }
    // one line per baseline (its cells are often one file each): dates and
    // commits of its files listed together
    let mut lines: std::collections::BTreeMap<String, (Vec<String>, Vec<String>)> =
        Default::default();
    for b in &l.baselines {
        let line = format!(
            "- Baseline `{}`: {} (torch {}, transformers {}, {}",
            b["baseline"].as_str().unwrap_or("?"),
            b["what"].as_str().unwrap_or(""),
            b["torch"].as_str().unwrap_or("?"),
            b["transformers"].as_str().unwrap_or("?"),
            b["gpu"].as_str().unwrap_or("?"),
        );
        let e = lines.entry(line).or_default();
        e.0.extend(b["date_utc"].as_str().map(|d| d.chars().take(10).collect()));
        e.1.extend(b["commit"].as_str().map(String::from));
    }
    for (line, (mut dates, mut commits)) in lines {
        for v in [&mut dates, &mut commits] {
            v.sort();
            v.dedup();
        }
        out.push_str(&format!(
            "{line}; date {}; commit {}).\n",
            list(dates),
            list(commits)
        ));
    }
    out.push('\n');
    let (prefill, decode): (Vec<&Row>, Vec<&Row>) = l.rows.iter().partition(|r| is_prefill_row(r));
    if !decode.is_empty() {
        out.push_str(TABLE_HEADER);
        for r in &decode {
            out.push_str(&table_row(r));
        }
        let above: Vec<String> = decode
            .iter()
            .filter_map(|r| {
                let (ratio, roof) = (r.measured_over_roofline?, r.roofline?);
                (ratio > ROOFLINE_TOLERANCE).then(|| {
                    let why = r.parts.map_or_else(
                        || "the run did not measure its GEMM or fetch time".to_string(),
                        |p| p.reason(&roof),
                    );
                    format!(
                        "- {} EB {} {}, B = {}: {ratio:.2}× ({:.2} vs {:.2} ms): {why}.\n",
                        context_label(r.context),
                        r.equivalent_batch.map_or("–".into(), |e| e.to_string()),
                        r.mode,
                        r.batch,
                        r.step_ms_p50.unwrap_or(f64::NAN),
                        roof.step_ms
                    )
                })
            })
            .collect();
        if !above.is_empty() {
            out.push_str(&format!(
                "\nAbove {ROOFLINE_TOLERANCE}× the roofline, and why (from the run's own GEMM and fetch times):\n\n"
            ));
            for a in above {
                out.push_str(&a);
            }
        }
    }
    if !prefill.is_empty() {
        if !out.ends_with("\n\n") {
            out.push('\n');
        }
        out.push_str("Prefill (one sequence at a time; time to first token = the prefill and the first token's argmax):\n\n");
        out.push_str(PREFILL_TABLE_HEADER);
        for r in prefill {
            out.push_str(&prefill_table_row(r));
        }
    }
    out
}

/// Whether a row measures prefill (no decode figures): a `bench --steps 0`
/// case or a prefill baseline's row (skipped ones by their mode name).
pub fn is_prefill_row(r: &Row) -> bool {
    r.prefill_tokens_per_s.is_some()
        || r.ttft_ms_p50.is_some()
        || (r.tokens_per_s.is_none() && r.mode.contains("prefill"))
}

/// The header of the prefill table.
pub const PREFILL_TABLE_HEADER: &str = "| L | mode | B | prefill tokens/s | time to first token p50 ms | GPU GiB |\n| --- | --- | --- | --- | --- | --- |\n";

/// One prefill table row ([`PREFILL_TABLE_HEADER`]'s columns).
pub fn prefill_table_row(r: &Row) -> String {
    let l = context_label(r.context);
    if let Some(why) = &r.skipped {
        return format!(
            "| {l} | {} | {} | skipped: {} | | |\n",
            r.mode,
            r.batch,
            why.replace('|', "/").replace('\n', " ")
        );
    }
    format!(
        "| {l} | {} | {} | {} | {} | {} |\n",
        r.mode,
        r.batch,
        opt(r.prefill_tokens_per_s, 0),
        opt(r.ttft_ms_p50, 1),
        gib(r.gpu_mem_bytes),
    )
}

/// The merged JSON of a report: what it is, the runs (GPU, driver, commit,
/// date, model, protocol per input file), the baselines' run facts, the
/// ceilings of the roofline, and every row.
pub fn merged_json(l: &Loaded) -> Value {
    json!({
        "what": "sparda report: every mode side by side under the equivalent-batch protocol (runtime.md §5), with the roofline of each step",
        "date_utc": crate::checks::kernels::utc_now_iso(),
        "commit_of_report": crate::bench::git_commit(),
        "runs": l.runs,
        "baselines": l.baselines,
        "roofline": {
            "pcie_gb_s": PCIE_CEILING_GB_S,
            "hbm_gb_s_default": HBM_WEIGHT_READ_GB_S,
            "min_measured_hbm_share": MIN_MEASURED_HBM_SHARE,
            "rule": "overlapped (forecast + prefetch): max(PCIe ms, HBM ms); synchronous: PCIe ms + HBM ms",
        },
        "rows": l.rows,
    })
}

/// Writes the chart of tokens/s against context length (K tokens), one
/// line per mode (per mode and EB when a context ran a mode at several EBs), as an SVG file
/// (plotters, SVG backend). Skipped rows and rows without tokens/s are
/// left out.
///
/// Errors: no row to plot ([`Error::Input`]); drawing or writing fails
/// ([`Error::Input`] naming the file).
pub fn write_chart(rows: &[Row], path: &Path) -> Result<()> {
    chart(
        rows,
        path,
        |r| r.tokens_per_s,
        "decode tokens/s against context",
    )
}

/// As [`write_chart`] for the prefill rows ([`is_prefill_row`]): prefill
/// tokens/s against prompt length, one line per mode and batch size.
///
/// Errors: as [`write_chart`].
pub fn write_prefill_chart(rows: &[Row], path: &Path) -> Result<()> {
    let named: Vec<Row> = rows
        .iter()
        .filter(|r| is_prefill_row(r))
        .map(|r| Row {
            mode: format!("{}, B = {}", r.mode, r.batch),
            ..r.clone()
        })
        .collect();
    chart(
        &named,
        path,
        |r| r.prefill_tokens_per_s,
        "prefill tokens/s against prompt length",
    )
}

/// One line per mode of `value` against context (K tokens), as an SVG file.
fn chart(rows: &[Row], path: &Path, value: fn(&Row) -> Option<f64>, caption: &str) -> Result<()> {
    use plotters::prelude::*;
    let pts: Vec<(&Row, f64)> = rows
        .iter()
        .filter(|r| r.skipped.is_none())
        .filter_map(|r| value(r).map(|t| (r, t)))
        .collect();
    if pts.is_empty() {
        return Err(Error::Input(format!(
            "{}: no measured row to chart",
            path.display()
        )));
    }
    // EB in the legend only when one context ran a mode at several EBs (a
    // grid with one EB per context draws one line per mode across contexts)
    let several_ebs = pts.iter().any(|(a, _)| {
        pts.iter().any(|(b, _)| {
            a.context == b.context && a.mode == b.mode && a.equivalent_batch != b.equivalent_batch
        })
    });
    let name = |r: &Row| match (several_ebs, r.equivalent_batch) {
        (true, Some(e)) => format!("{} (EB {e})", r.mode),
        _ => r.mode.clone(),
    };
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (r, t) in &pts {
        let n = name(r);
        let x = r.context as f64 / 1024.0;
        match series.iter_mut().find(|(k, _)| *k == n) {
            Some((_, v)) => v.push((x, *t)),
            None => series.push((n, vec![(x, *t)])),
        }
    }
    for (_, v) in &mut series {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let xmax = pts
        .iter()
        .map(|(r, _)| r.context as f64 / 1024.0)
        .fold(0.0, f64::max);
    let ymax = pts.iter().map(|(_, t)| *t).fold(0.0, f64::max);
    let err = |e: &dyn std::fmt::Display| Error::Input(format!("{}: chart: {e}", path.display()));
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..xmax * 1.05 + 1.0, 0.0..ymax * 1.1 + 1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("context (K tokens)")
        .y_desc("tokens/s")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (n, v)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(v.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(n.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(v.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The marker line opening the generated section of README.md.
pub const README_BEGIN: &str = "<!-- BEGIN sparda report -->";
/// The marker line closing it.
pub const README_END: &str = "<!-- END sparda report -->";

/// `text` with the lines between [`README_BEGIN`] and [`README_END`]
/// replaced by `section` (markers kept).
///
/// Errors: a marker missing, or END before BEGIN ([`Error::Input`] naming
/// `what`, the file, and the marker).
pub fn replace_between_markers(text: &str, section: &str, what: &str) -> Result<String> {
    let b = text
        .find(README_BEGIN)
        .ok_or_else(|| Error::Input(format!("{what}: no `{README_BEGIN}` marker line")))?;
    let after_b = b + README_BEGIN.len();
    let e = text[after_b..]
        .find(README_END)
        .map(|i| after_b + i)
        .ok_or_else(|| {
            Error::Input(format!(
                "{what}: no `{README_END}` marker line after `{README_BEGIN}`"
            ))
        })?;
    let mut out = String::with_capacity(text.len() + section.len());
    out.push_str(&text[..after_b]);
    out.push('\n');
    out.push_str(section.trim_end());
    out.push('\n');
    out.push_str(&text[e..]);
    Ok(out)
}

/// Writes `PREFIX.json` ([`merged_json`]), `PREFIX.md` ([`markdown`]),
/// `PREFIX.svg` ([`write_chart`]; when decode rows were measured, or when
/// nothing was) and `PREFIX.prefill.svg` ([`write_prefill_chart`]; when
/// prefill rows were measured); returns the markdown.
///
/// Errors: as [`write_chart`]; [`Error::Io`] naming a file.
pub fn write_report(l: &Loaded, prefix: &Path) -> Result<String> {
    let with = |ext: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    if let Some(parent) = prefix.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    write_atomic(&with(".json"), &merged_json(l))?;
    let md = markdown(l);
    let mdp = with(".md");
    std::fs::write(&mdp, &md).map_err(|e| Error::io(&mdp, e))?;
    let decode = l
        .rows
        .iter()
        .any(|r| r.skipped.is_none() && r.tokens_per_s.is_some());
    let prefill = l
        .rows
        .iter()
        .any(|r| r.skipped.is_none() && r.prefill_tokens_per_s.is_some());
    if decode || !prefill {
        write_chart(&l.rows, &with(".svg"))?;
    }
    if prefill {
        write_prefill_chart(&l.rows, &with(".prefill.svg"))?;
    }
    Ok(md)
}
