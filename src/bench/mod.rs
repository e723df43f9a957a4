//! `sparda bench`: decode throughput of the GPU engine, with the KV resident
//! on the GPU or offloaded to host memory (protocol of runtime.md §5). A
//! benchmark, not a test (testing.md "Benchmarks are not tests"): it
//! measures and writes JSON under the caller's path; nothing asserts on time.
//!
//! One process loads the weights once and runs a grid of cases (attention
//! × batch × context). Per case:
//! 1. memory check ([`crate::memory`], the estimator `generate` and
//!    `offload-check` refuse with): the KV caches of B sequences (K, V, c,
//!    and Kc/p for sparse attention; offloaded: the slot pools and the
//!    pinned host store) plus the step's buffers and a margin must fit in
//!    the device's free memory and the host's available memory, else the
//!    case is skipped with the reason;
//! 2. B sequences of L tokens: `--prefill synthetic` fills each with random
//!    bf16 K/V and computes c, Kc and p from them on the GPU
//!    ([`GpuModel::fill_synthetic`]), without running the model (labelled
//!    as synthetic prefill in the output); `dense` / `sparse` prefill for
//!    real from prompt tokens (book text through `--tokenizer`, each
//!    sequence a different offset; else random ids);
//! 3. warm-up decode steps (default 2, excluded: the first builds the
//!    device-resident step and runs it eagerly, the second captures the
//!    CUDA graph), then `--steps` timed greedy steps fed on the device
//!    ([`GpuModel::decode_greedy`]), a CUDA event after each;
//! 4. figures: tokens/s = B·steps / (time of the timed steps), mean and
//!    median step time, device memory in use.
//!
//! Also measured in the same run: the layer-GEMM ceiling at each batch size
//! (every layer's four GEMMs as one CUDA graph, [`GpuModel::gemm_ceiling`])
//! and, for B = 1 at the smallest dense context, the same step without the
//! graph ([`DecodeMode::Eager`]) for comparison; and, per case, the time of
//! each piece of the step alone ([`GpuModel::profile_step`]).

use crate::cpu::EngineOptions;
use crate::cuda::Gpu;
use crate::model::{AttentionOverrides, PrefillMode, SelectionRule};
use crate::pipeline::{DecodeMode, GpuModel, GpuSequence, OffloadOptions};
use crate::tokenizer::Tokenizer;
use crate::weights::Checkpoint;
use crate::{Error, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod eb;
mod prompts;
mod summary;
pub use eb::{cell_key, eb_grid, equivalent_batch, kv_name, EbMode, EB_INFLLM_GPU};
pub use prompts::default_texts_dir;
use prompts::{book_tokens, Source};
pub use summary::{forecast_comparison, table};

/// How a benchmark fills the sequences before decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchPrefill {
    /// Random K/V with c, Kc and p computed from them (runtime.md §5).
    Synthetic,
    /// A real prefill of the prompt, with this prefill mode.
    Real(PrefillMode),
}

/// What to run (the `sparda bench` arguments).
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// A checkpoint directory, or `synth:PRESET[:SEED]` (weights built in memory).
    pub model: String,
    /// Attention modes to run, in order: `false` dense, `true` sparse.
    pub sparse: Vec<bool>,
    /// Selection rule override for sparse runs.
    pub selection: Option<SelectionRule>,
    /// `--budget-blocks` / `--select-blocks` overrides.
    pub budget_blocks: Option<usize>,
    /// Query-aware shortlist override.
    pub select_blocks: Option<usize>,
    /// Batch sizes B.
    pub batches: Vec<usize>,
    /// Context lengths L (tokens in each sequence before decoding).
    pub contexts: Vec<usize>,
    /// Timed decode steps per case (≥ 64 per runtime.md §5).
    pub steps: usize,
    /// Untimed decode steps before them (≥ 1; the first builds the step,
    /// the second captures the graph).
    pub warmup: usize,
    /// How sequences are filled.
    pub prefill: BenchPrefill,
    /// The kernel of the prefill rows (dense and sparse) of a real prefill
    /// ([`GpuModel::set_prefill_attention`]; None: the engine's default,
    /// [`crate::pipeline::PrefillAttention::for_head_dim`]).
    pub prefill_attention: Option<crate::pipeline::PrefillAttention>,
    /// tokenizer.json for book-text prompts (else random ids).
    pub tokenizer: Option<PathBuf>,
    /// Directory of `.txt` books (data/texts).
    pub texts: PathBuf,
    /// Seed of random ids and synthetic state.
    pub seed: u64,
    /// Replays per GEMM-ceiling measurement (0: skip it).
    pub ceiling_reps: usize,
    /// Replays per step-piece measurement ([`GpuModel::profile_step`]; 0: skip it).
    pub profile_reps: usize,
    /// Where the KV lives, each run in turn for sparse attention: GPU-resident
    /// (`None`) or offloaded with these settings.
    pub kv: Vec<Option<OffloadOptions>>,
    /// Decode steps with every fetch timed by events after the timed steps
    /// of an offloaded case (fetch GB/s); 0 skips them.
    pub fetch_timing_steps: usize,
    /// SparDA forecast weights (`FILE` or `synth[:SEED]`): offloaded cases
    /// then also run in forecast mode, with each of `prefetch`.
    pub forecast: Option<String>,
    /// Prefetch settings of the forecast runs (true = on).
    pub prefetch: Vec<bool>,
    /// With `forecast`: also run the synchronous NOSA selection.
    pub sync: bool,
    /// Prefetch through the SM copy kernel sizes cuBLAS's GEMMs for the SMs
    /// its CTAs leave ([`GpuModel::set_reserve_fetch_sms`]).
    pub reserve_fetch_sms: bool,
    /// The SM copy kernel's CTAs hold whole SMs
    /// ([`GpuModel::set_fetch_whole_sms`]).
    pub fetch_whole_sms: bool,
    /// Offloaded cases: one more eager step after the timed ones with the
    /// per-CTA timeline on ([`GpuModel::set_cta_log`]), analysed by
    /// [`crate::trace::cta::analyze`] into the case's `cta_timeline`.
    pub cta_timeline: bool,
    /// Equivalent batch sizes (runtime.md §5): when given, each context
    /// runs every [`EbMode`] at the real batch [`equivalent_batch`] gives
    /// it, instead of the `batches` × attention × kv grid.
    pub equivalent_batches: Vec<usize>,
    /// Traced steps per case (0: no tracing; needs a trace session, see
    /// [`crate::trace::init_subscriber`]); as many untraced eager steps run
    /// first, for the overhead figure.
    pub trace_steps: usize,
    /// With `equivalent_batches`: write each cell as its own JSON file in
    /// this directory as it completes ([`crate::report::write_atomic`]) and
    /// skip cells whose file exists with the same configuration
    /// ([`crate::report::plan_cells`]).
    pub resume: Option<PathBuf>,
}

/// Parses a context length: digits with an optional `K` (×1024) or `M`
/// (×1024²) suffix, e.g. `4K`, `32768`.
///
/// Errors: [`Error::Input`] for anything else.
pub fn parse_tokens(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1024),
        Some('m' | 'M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|x| x.checked_mul(mul))
        .ok_or_else(|| Error::Input(format!("bad token count `{s}` (e.g. 4096, 4K, 32K)")))
}

/// Checks that `--model` names a `synth:` preset or a checkpoint directory
/// holding config.json (not a file, not a missing path).
///
/// Errors: [`Error::Input`] naming the path and what to give instead.
pub fn check_model_arg(model: &str) -> Result<()> {
    if model.starts_with("synth:") {
        return Ok(());
    }
    let p = Path::new(model);
    if p.is_file() {
        return Err(Error::Input(format!(
            "--model {model} is a file; give the checkpoint directory holding config.json, *.safetensors and tokenizer.json"
        )));
    }
    if !p.exists() {
        return Err(Error::Input(format!(
            "--model {model}: no such directory; give a checkpoint directory (config.json, *.safetensors, tokenizer.json) or synth:PRESET (tiny, nosa-1b, nosa-3b, nosa-8b)"
        )));
    }
    if !p.join("config.json").is_file() {
        return Err(Error::Input(format!(
            "--model {model} holds no config.json: give the checkpoint directory holding config.json, *.safetensors and tokenizer.json"
        )));
    }
    Ok(())
}

/// Opens `model`: `synth:PRESET[:SEED]` builds a random-weight checkpoint
/// in memory ([`crate::synth::build`]), anything else is a checkpoint
/// directory.
///
/// Errors: `model` is a file ([`check_model_arg`]); an unknown preset or
/// bad seed ([`Error::Input`]); checkpoint errors.
pub fn open_model(model: &str) -> Result<Checkpoint> {
    check_model_arg(model)?;
    match model.strip_prefix("synth:") {
        Some(spec) => {
            let (preset, seed) = crate::synth::parse_spec(spec)?;
            crate::synth::build(preset, seed)
        }
        None => Checkpoint::open(Path::new(model)),
    }
}

/// The git commit: `$SPARDA_COMMIT`, else `git rev-parse HEAD` (with
/// `+dirty` when the tree has changes), else null.
pub fn git_commit() -> Option<String> {
    if let Ok(c) = std::env::var("SPARDA_COMMIT") {
        if !c.is_empty() {
            return Some(c);
        }
    }
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let mut c = String::from_utf8_lossy(&head.stdout).trim().to_string();
    let dirty = std::process::Command::new("git")
        .args(["status", "--porcelain"])
        .output()
        .ok()
        .is_some_and(|o| !o.stdout.is_empty());
    if dirty {
        c.push_str("+dirty");
    }
    Some(c)
}

/// The positions a case decodes past its context: warm-up and timed steps,
/// the extra steps of the mode comparison, the host-issue step, fetch
/// timing and tracing, and a margin of 3 (the sequences' capacity is
/// context + this + 1); 1 in a prefill-only run (`steps` 0).
pub fn positions_after_context(spec: &BenchSpec, compare_modes: bool) -> usize {
    if spec.steps == 0 {
        return 1; // prefill only: the first token's position
    }
    spec.warmup
        + spec.steps
        + if compare_modes { 2 * spec.steps + 8 } else { 0 }
        + 2
        + spec.fetch_timing_steps
        + 2 * spec.trace_steps
        + if spec.cta_timeline { 2 } else { 0 }
        + 3
}

/// The context a case runs at: `asked` when `asked + after + 1` positions
/// fit in `max_position` (max_position_embeddings), else the largest
/// multiple of 1,024 that does (e.g. 128K with 89 positions after it on a
/// 131,072-position model runs as 127K), else `max_position − after − 1`.
/// Returns `None` when not even one context token fits.
pub fn cap_context(asked: usize, after: usize, max_position: usize) -> Option<usize> {
    let room = max_position.checked_sub(after + 1).filter(|&r| r > 0)?;
    if asked <= room {
        Some(asked)
    } else if room >= 1024 {
        Some(room / 1024 * 1024)
    } else {
        Some(room)
    }
}

/// Spans of the host-cost measurement before a case's traced steps.
const TRACE_HOST_COST_SPANS: usize = 2000;

/// Tokens of the untimed prefill that opens each prefill-only case.
const PREFILL_WARMUP_TOKENS: usize = 2048;

/// The B = 1, 4K dense decode step's target: at most this many times the
/// layer-GEMM ceiling measured in the same run (README, status table).
pub const B1_TARGET_OVER_CEILING: f64 = 1.15;

/// Resident set size of this process, bytes (`VmRSS` of /proc/self/status;
/// None where that file does not exist).
pub fn host_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Median of a non-empty list (the upper one of an even count).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Percentile p (0–100, nearest rank) of a non-empty list.
fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i.min(s.len() - 1)]
}

/// Timed greedy decode: `steps` device-fed steps with an event after each;
/// returns the per-step milliseconds.
fn time_steps(model: &mut GpuModel, seqs: &mut [GpuSequence], steps: usize) -> Result<StepTimes> {
    let gpu = model.gpu().clone();
    let events = (0..=steps)
        .map(|_| gpu.timing_event())
        .collect::<Result<Vec<_>>>()?;
    use crate::cuda::context::CudaResultExt;
    events[0].record(gpu.stream()).cuda("cuEventRecord")?;
    let t_host = std::time::Instant::now();
    for ev in &events[1..] {
        model.decode_greedy(seqs)?;
        ev.record(gpu.stream()).cuda("cuEventRecord")?;
    }
    let host_ms = t_host.elapsed().as_secs_f64() * 1e3;
    events[steps].synchronize().cuda("cuEventSynchronize")?;
    // Device-fed steps never hand results to the host: check the device
    // error record of the timed steps here (it synchronises; idle by now).
    model.check_device_errors()?;
    let gpu_ms = events
        .windows(2)
        .map(|w| Ok(w[0].elapsed_ms(&w[1]).cuda("cuEventElapsedTime")? as f64))
        .collect::<Result<Vec<f64>>>()?;
    Ok(StepTimes {
        host_ms_per_step: host_ms / steps.max(1) as f64,
        gpu_ms,
    })
}

/// [`time_steps`]' per-step GPU milliseconds (`sparda tune-ctas`).
pub(crate) fn time_step_ms(
    model: &mut GpuModel,
    seqs: &mut [GpuSequence],
    steps: usize,
) -> Result<Vec<f64>> {
    Ok(time_steps(model, seqs, steps)?.gpu_ms)
}

/// Times of [`time_steps`]: GPU step times from CUDA events (ms each) and
/// the host's wall time per step spent issuing them (ms). Host time close to
/// the GPU step time means the host, not the GPU, sets the pace (or a step
/// waits for the GPU inside).
struct StepTimes {
    host_ms_per_step: f64,
    gpu_ms: Vec<f64>,
}

/// The report's `what`: which comparison `spec` runs (runtime.md §5).
fn bench_what(spec: &BenchSpec) -> String {
    let mut w = if spec.steps == 0 {
        "sparda bench --steps 0: prefill only — tokens/s and time to first token of a real prefill, one sequence at a time (offloaded KV: its spill to host memory included)".to_string()
    } else if !spec.equivalent_batches.is_empty() {
        "sparda bench: every mode side by side under the equivalent-batch protocol (runtime.md §5)"
            .to_string()
    } else if spec.forecast.is_some() {
        "sparda bench: synchronous NOSA fetch vs forecast selection with and without prefetch, offloaded KV (runtime.md §5)".to_string()
    } else if spec.kv.iter().any(|k| k.is_some()) {
        "sparda bench: offloaded KV (synchronous fetch) vs GPU-resident decode (runtime.md §5)"
            .to_string()
    } else {
        "sparda bench: GPU-resident decode throughput over the attention × batch × context grid (runtime.md §5)".to_string()
    };
    if spec.trace_steps > 0 && crate::trace::is_recording() {
        w.push_str("; with the step-time overhead of --trace (untraced vs traced steps)");
    }
    w
}

/// One case's result (or skip reason) as JSON.
#[allow(clippy::too_many_arguments)]
fn run_case(
    model: &mut GpuModel,
    spec: &BenchSpec,
    source: &Source,
    sparse: bool,
    batch: usize,
    context: usize,
    compare_modes: bool,
) -> Result<Value> {
    let cell = || {
        format!(
            "the {} cell B = {batch}, L = {context}, before it ran (earlier cells are on stderr)",
            if sparse { "sparse" } else { "dense" }
        )
    };
    crate::interrupt::check(cell)?;
    let gpu = model.gpu().clone();
    let offload = model.offload_options();
    let cap = context + positions_after_context(spec, compare_modes) + 1;
    let footprint = model.offload_footprint(batch, cap);
    // the estimator generate and offload-check refuse with (crate::memory)
    let need = model.memory_need(
        batch,
        cap,
        offload,
        matches!(spec.prefill, BenchPrefill::Real(_)),
    );
    let kv_bytes = need.kv;
    gpu.synchronize()?;
    let total = gpu.mem_info()?.1;
    let mut base = json!({
        "attention": if sparse { "sparse" } else { "dense" },
        "kv": kv_name(&offload),
        "fetch_engine": offload.map(|_| format!("{:?}", model.fetch_engine(batch))),
        // slot pool per (sequence, offloaded layer, KV head): the budget + cache slots
        "cache_slots": offload.map(|o| o.cache_slots),
        "pool_slots": offload.map(|_| model.pool_slots()),
        "selection": if model.forecast_on() {
            if offload.is_none() { "forecast" }
            else if model.prefetch_on() { "forecast+prefetch" } else { "forecast, no prefetch" }
        } else {
            match model.plan.mode {
                crate::config::AttentionMode::Nosa => "query-aware (sync NOSA)",
                crate::config::AttentionMode::InfLlmV2 => "query-aware (InfLLM-V2)",
                _ => "dense",
            }
        },
        "mode": format!("{:?}", model.plan.mode),
        "batch": batch, "context": context,
        "kv_bytes": kv_bytes,
        "gemm_sm_target": model.gemm_sm_target(batch),
        "fetch_whole_sms": spec.fetch_whole_sms,
        // whole SMs in force this run: the flag, or the fetch table's choice
        "fetch_on_whole_sms": model.fetch_on_whole_sms(batch),
        // task groups per SM copy CTA (kernels/kv_offload.cu kv_fetch_sm)
        "fetch_task_groups": crate::cuda::ops::offload::fetch_groups(model.fetch_on_whole_sms(batch)).ok(),
        "cta_timeline": spec.cta_timeline,
        "prompt_origin": source.origins_json(batch),
    });
    if spec.steps == 0 {
        base["prefill_only"] = json!(true);
        base["prefill_mode"] = json!(match spec.prefill {
            BenchPrefill::Real(PrefillMode::Dense) => "dense",
            _ => "as the attention mode says",
        });
    }
    if offload.is_some() {
        base["offload_layer0"] = json!(offload.is_some_and(|o| o.offload_layer0));
        base["host_pinned_bytes"] = json!(footprint.host_pinned_bytes);
        base["host_bytes_per_sequence"] = json!(footprint.host_pinned_bytes / batch.max(1));
        base["gpu_kv_bytes_per_sequence"] = json!(footprint.gpu_kv_bytes / batch.max(1));
    }
    let avail = crate::memory::available(&gpu, need.host_pinned > 0)?;
    if let Err(e) = crate::memory::check(&need, &avail, "cell skipped") {
        let reason = match e {
            Error::Limit(m) => m,
            other => return Err(other),
        };
        eprintln!("  skip: {reason}");
        let mut v = base;
        v["skipped"] = json!(reason);
        return Ok(v);
    }
    let prefill_only = spec.steps == 0;
    if prefill_only {
        // untimed: the first prefill of a case pays for workspace growth
        // and first launches
        let mut seq = model.new_sequence(cap)?;
        let toks = source.tokens(batch, batch + 1, context.min(PREFILL_WARMUP_TOKENS));
        if offload.is_some() {
            model.begin_offload(&mut seq, cap)?;
        }
        model.prefill(&mut seq, &toks, |_, _| {})?;
        if offload.is_some() {
            model.offload_sequence(&mut seq, cap)?;
        }
        drop(seq); // the workspace stays: the timed prefills reuse it
    }
    let t_fill = std::time::Instant::now();
    // One sequence at a time: with offload only one full cache exists at once.
    let mut seqs = Vec::with_capacity(batch);
    let mut first = Vec::with_capacity(batch);
    // per sequence: (prefill ms incl. the offload spill, time to first token ms)
    let mut per_seq: Vec<(f64, f64)> = Vec::with_capacity(batch);
    for b in 0..batch {
        crate::interrupt::check(cell)?;
        let mut seq = model.new_sequence(cap)?;
        let sq = &mut seq;
        let toks = source.tokens(b, batch, context + 1);
        let real = matches!(spec.prefill, BenchPrefill::Real(_));
        if real && offload.is_some() {
            // the pinned host store is allocated before the clock starts, as
            // a resident sequence's KV is (new_sequence)
            model.begin_offload(sq, cap)?;
        }
        let t_seq = std::time::Instant::now();
        match spec.prefill {
            BenchPrefill::Synthetic => {
                model.fill_synthetic(sq, context, spec.seed.wrapping_add(b as u64))?
            }
            BenchPrefill::Real(_) => model.prefill(sq, &toks[..context], |_, _| {})?,
        }
        if offload.is_some() {
            model.offload_sequence(sq, cap)?;
        }
        if prefill_only {
            gpu.synchronize()?;
            let prefill_ms = t_seq.elapsed().as_secs_f64() * 1e3;
            model.argmax()?; // the first token reaches the host
            per_seq.push((prefill_ms, t_seq.elapsed().as_secs_f64() * 1e3));
        }
        first.push(toks[context]);
        seqs.push(seq);
    }
    gpu.synchronize()?;
    let fill_s = t_fill.elapsed().as_secs_f64();
    if prefill_only {
        let (free_after, _) = gpu.mem_info()?;
        let prefill_ms: Vec<f64> = per_seq.iter().map(|p| p.0).collect();
        let ttft_ms: Vec<f64> = per_seq.iter().map(|p| p.1).collect();
        let total_ms: f64 = prefill_ms.iter().sum();
        let tokens_per_s = (batch * context) as f64 / (total_ms / 1e3);
        eprintln!(
            "  {:>6} {} B={batch:<3} L={context:<6} prefill {:.1} ms/sequence (median), {:.0} tokens/s; time to first token median {:.1} ms, max {:.1}",
            if sparse { "sparse" } else { "dense" },
            kv_name(&offload),
            median(&prefill_ms),
            tokens_per_s,
            median(&ttft_ms),
            ttft_ms.iter().copied().fold(0.0, f64::max)
        );
        let mut v = base;
        v["prefill_s"] = json!(fill_s);
        v["prefill_ms_per_sequence"] = json!(prefill_ms);
        v["prefill_tokens_per_s"] = json!(tokens_per_s);
        v["ttft_ms_per_sequence"] = json!(ttft_ms);
        v["ttft_ms_median"] = json!(median(&ttft_ms));
        v["gpu_mem_used_bytes"] = json!(total - free_after);
        v["host_rss_bytes"] = json!(host_rss_bytes());
        drop(seqs);
        model.release_buffers();
        gpu.synchronize()?;
        return Ok(v);
    }
    // Warm-up: build (eager), capture, … (excluded).
    model.decode(&mut seqs, &first)?;
    for _ in 1..spec.warmup {
        model.decode_greedy(&mut seqs)?;
    }
    if offload.is_some() {
        model.reset_offload_stats()?;
    }
    let timed = time_steps(model, &mut seqs, spec.steps)?;
    let host_ms_per_step = timed.host_ms_per_step;
    let per_step = timed.gpu_ms;
    let graph = model.last_step_was_graph();
    // The timed steps' offload statistics, read before any further step.
    let mut offload_json = if offload.is_some() {
        let st = model.offload_stats()?;
        let steps = spec.steps.max(1) as f64;
        Some(json!({
            "locality_gamma": st.locality_all(),
            "locality_gamma_per_layer": st.locality(),
            "bytes_fetched_per_step": st.bytes_fetched() as f64 / steps,
            "blocks_fetched_per_step": st.fetched.iter().sum::<u64>() as f64 / steps,
            "chunk_bytes": st.chunk_bytes,
        }))
    } else {
        None
    };
    // The host's own cost of issuing one step: from an idle GPU and an
    // empty launch queue, so nothing holds the host back (the timed loop's
    // figure is capped by the queue once the host runs ahead). It continues
    // the timed steps' device-resident decode, before anything rebuilds it.
    gpu.synchronize()?;
    let t_issue = std::time::Instant::now();
    model.decode_greedy(&mut seqs)?;
    let host_issue_one_ms = t_issue.elapsed().as_secs_f64() * 1e3;
    gpu.synchronize()?;
    if let (Some(j), true) = (offload_json.as_mut(), spec.fetch_timing_steps > 0) {
        model.set_fetch_timing(true)?;
        model.reset_offload_stats()?;
        model.decode(&mut seqs, &first)?;
        for _ in 1..spec.fetch_timing_steps {
            model.decode_greedy(&mut seqs)?;
        }
        let t = model.offload_stats()?;
        model.set_fetch_timing(false)?;
        j["fetch_timing"] = json!({
            "steps": spec.fetch_timing_steps,
            "fetch_ms_per_step": t.fetch_ms / spec.fetch_timing_steps as f64,
            "bytes_per_step": t.timed_bytes as f64 / spec.fetch_timing_steps as f64,
            "achieved_gb_s": t.fetch_gb_s(),
            "note": "CUDA events around each layer's fetch (diff excluded); extra steps after the timed ones",
        });
    }
    let (free_after, _) = gpu.mem_info()?;
    let total_ms: f64 = per_step.iter().sum();
    let tokens_per_s = (batch * spec.steps) as f64 / (total_ms / 1e3);
    let mut v = base;
    v["prefill_s"] = json!(fill_s);
    v["decode_mode"] = json!(format!("{:?}", model.decode_mode()));
    v["cuda_graph"] = json!(graph);
    v["timed_steps"] = json!(spec.steps);
    v["warmup_steps"] = json!(spec.warmup);
    v["step_ms_mean"] = json!(total_ms / spec.steps as f64);
    v["step_ms_median"] = json!(median(&per_step));
    v["step_ms_p10"] = json!(percentile(&per_step, 10.0));
    v["step_ms_p90"] = json!(percentile(&per_step, 90.0));
    v["step_ms_p99"] = json!(percentile(&per_step, 99.0));
    v["step_ms_all"] = json!(per_step);
    v["host_rss_bytes"] = json!(host_rss_bytes());
    v["step_ms_min"] = json!(per_step.iter().copied().fold(f64::INFINITY, f64::min));
    v["host_issue_ms_per_step"] = json!(host_ms_per_step);
    v["host_issue_one_step_ms"] = json!(host_issue_one_ms);
    v["tokens_per_s"] = json!(tokens_per_s);
    v["gpu_mem_used_bytes"] = json!(total - free_after);
    v["final_len"] = json!(seqs[0].len());
    if let Some(j) = offload_json {
        eprintln!(
            "    γ {:.3}, {:.2} MB fetched per step, fetch {:.1} GB/s",
            j["locality_gamma"].as_f64().unwrap_or(0.0),
            j["bytes_fetched_per_step"].as_f64().unwrap_or(0.0) / 1e6,
            j["fetch_timing"]["achieved_gb_s"].as_f64().unwrap_or(0.0)
        );
        v["offload"] = j;
    }
    // the configuration `--fetch auto` resolved to, so a log shows which table entry ran
    let resolved = if offload.is_some() {
        let on_whole = model.fetch_on_whole_sms(batch);
        let engine = model.fetch_engine(batch);
        let whole = if on_whole { " on whole SMs" } else { "" };
        let groups = match engine {
            crate::pipeline::FetchEngine::Sm { .. }
            | crate::pipeline::FetchEngine::Split { .. } => {
                format!(
                    ", {} task groups per CTA",
                    crate::cuda::ops::offload::fetch_groups(on_whole)?
                )
            }
            _ => String::new(),
        };
        format!(" ({}{whole}{groups})", engine.label())
    } else {
        String::new()
    };
    eprintln!(
        "  {:>6} {}{resolved} B={batch:<3} L={context:<6} step {:.3} ms (median {:.3}; host issues one step in {:.3} from idle), {:.1} tokens/s, graph {graph}, {:.1} GiB in use",
        if sparse { "sparse" } else { "dense" },
        kv_name(&offload),
        total_ms / spec.steps as f64,
        median(&per_step),
        host_issue_one_ms,
        tokens_per_s,
        (total - free_after) as f64 / (1u64 << 30) as f64
    );
    if compare_modes {
        let mut modes = serde_json::Map::new();
        {
            let mode = DecodeMode::Eager;
            model.set_decode_mode(mode);
            model.decode(&mut seqs, &first)?; // rebuild / warm up
            let n = spec.steps.min(32);
            let ms = time_steps(model, &mut seqs, n)?.gpu_ms;
            let mean = ms.iter().sum::<f64>() / n as f64;
            eprintln!(
                "    {mode:?}: step {mean:.3} ms (median {:.3})",
                median(&ms)
            );
            modes.insert(
                format!("{mode:?}").to_lowercase(),
                json!({"step_ms_mean": mean, "step_ms_median": median(&ms), "timed_steps": n,
                       "token_feed": "device (argmax of the previous step)"}),
            );
        }
        model.set_decode_mode(DecodeMode::Graph);
        v["other_decode_modes"] = Value::Object(modes);
    }
    if spec.trace_steps > 0 && crate::trace::is_recording() {
        // Overhead of tracing: the same eager steps without, then with spans.
        let mode = model.decode_mode();
        model.set_decode_mode(DecodeMode::Eager);
        model.decode(&mut seqs, &first)?;
        let plain = time_steps(model, &mut seqs, spec.trace_steps)?;
        model.set_trace(true)?;
        // what one span costs the host, alone on an idle stream: an offloaded
        // step issues eagerly, so per-span host time adds to a step the host
        // already issues close to the GPU's pace
        let host_cost = model.trace_host_cost(TRACE_HOST_COST_SPANS)?;
        // events for the warm-up and timed traced steps, made before timing
        model.reserve_trace(spec.trace_steps + 1)?;
        let _span = tracing::info_span!(target: "sparda::bench", "traced steps",
            batch, context, kv = kv_name(&offload).as_str(), selection = v["selection"].as_str().unwrap_or(""))
        .entered();
        model.decode(&mut seqs, &first)?;
        let traced = time_steps(model, &mut seqs, spec.trace_steps)?;
        drop(_span);
        let spans = model.flush_trace()?;
        model.set_trace(false)?;
        model.set_decode_mode(mode);
        let mean = |t: &StepTimes| t.gpu_ms.iter().sum::<f64>() / t.gpu_ms.len().max(1) as f64;
        let (pm, tm) = (mean(&plain), mean(&traced));
        eprintln!(
            "    trace: {} steps, {:.3} ms/step untraced vs {:.3} traced (+{:.1}%), {spans} GPU spans",
            spec.trace_steps,
            pm,
            tm,
            100.0 * (tm / pm - 1.0)
        );
        if let Some(c) = host_cost {
            eprintln!(
                "    trace host cost: {:.2} µs per span (cuEventRecord {:.2} µs host, {:.2} µs GPU; capture query {:.2} µs); host issues a step in {:.3} ms untraced, {:.3} traced",
                c.span_us, c.record_us, c.record_gpu_us, c.capture_query_us, plain.host_ms_per_step, traced.host_ms_per_step
            );
        }
        v["trace"] = json!({"steps": spec.trace_steps, "untraced_step_ms": pm, "traced_step_ms": tm,
            "untraced_host_ms_per_step": plain.host_ms_per_step, "traced_host_ms_per_step": traced.host_ms_per_step,
            "overhead_pct": 100.0 * (tm / pm - 1.0), "gpu_spans": spans,
            "host_cost_per_span": host_cost,
            "note": "both eager (no CUDA graph), same batch, consecutive steps; a traced step also copies its fetch counts on the device (read after the timed steps)"});
    }
    if spec.cta_timeline && offload.is_some() {
        v["cta_timeline"] = cta_timeline(model, &mut seqs, &first)?;
    }
    if spec.profile_reps > 0 && offload.is_none() {
        // Per-piece times of the step (leaves the batch's state garbage: last).
        model.set_decode_mode(DecodeMode::Graph);
        model.decode(&mut seqs, &first)?;
        let parts = model.profile_step(spec.profile_reps)?;
        let sum: f64 = parts.iter().map(|p| p.1).sum();
        let mut m = serde_json::Map::new();
        for (p, ms) in &parts {
            m.insert(format!("{p:?}"), json!(ms));
        }
        let list: Vec<String> = parts
            .iter()
            .map(|(p, ms)| format!("{p:?} {ms:.3}"))
            .collect();
        eprintln!(
            "    pieces (ms/step, each alone as a graph): {}; sum {sum:.3}",
            list.join(", ")
        );
        v["step_pieces_ms"] = Value::Object(m);
        v["step_pieces_sum_ms"] = json!(sum);
    }
    drop(seqs);
    model.release_buffers();
    gpu.synchronize()?;
    Ok(v)
}

/// CTA records per layer and kernel that [`cta_timeline`] makes room for.
const CTA_LOG_CAP: usize = 1 << 16;

/// One eager decode step of `seqs` with the per-CTA timeline on, analysed:
/// the case's `cta_timeline` (summary, per-layer figures and every
/// record). An eager step before it rebuilds the step with the log on; its
/// records are cleared.
fn cta_timeline(model: &mut GpuModel, seqs: &mut [GpuSequence], first: &[u32]) -> Result<Value> {
    let mode = model.decode_mode();
    model.set_decode_mode(DecodeMode::Eager);
    model.set_cta_log(Some(CTA_LOG_CAP))?;
    let r = (|| {
        model.decode(seqs, first)?;
        model.clear_cta_log()?;
        model.decode_greedy(seqs)?;
        model.read_cta_log()
    })();
    model.set_cta_log(None)?;
    model.set_decode_mode(mode);
    let (t, overflow) = r?;
    let s = crate::trace::cta::analyze(&t);
    eprintln!(
        "    CTA timeline: attention CTAs sharing an SM with a copy CTA {:.1} µs, alone {:.1} µs; kernel span {:.1} µs, alone CTAs done at {:.1} µs; layers beside a copy on other SMs only: span {:.1} µs; layers with no copy running: span {:.1} µs{}",
        s.shared_mean_us,
        s.alone_mean_us,
        s.span_us,
        s.alone_span_us,
        s.apart_span_us,
        s.control_span_us,
        if overflow { " (some launches had more CTAs than the log holds: not logged)" } else { "" }
    );
    Ok(json!({
        "summary": s,
        "overflow": overflow,
        "records": t,
        "note": "one eager decode step; per CTA [start ns, end ns, SM] from %globaltimer and %smid by thread 0 (kernels/common.cuh cta_log_start); attention = attn_partial per layer, fetch = kv_fetch_sm per layer fetched (its CTAs run beside the previous layer's compute under prefetch); 'shared' = an attention CTA with a copy CTA of any layer on its SM during an overlapping interval (src/trace/cta.rs)",
    }))
}

/// Runs the benchmark grid of `spec` and returns the JSON report (the
/// caller writes it). Prints progress to stderr.
///
/// Errors: CUDA missing or failing ([`Error::Cuda`]); bad arguments
/// ([`Error::Input`]); checkpoint errors. A case that does not fit in
/// device memory is skipped and recorded, not an error.
pub fn run(spec: &BenchSpec) -> Result<Value> {
    if spec.warmup == 0 || spec.batches.is_empty() || spec.contexts.is_empty() {
        return Err(Error::Input(
            "bench: need ≥ 1 warm-up step, a batch and a context".into(),
        ));
    }
    if spec.batches.contains(&0) || spec.contexts.contains(&0) {
        return Err(Error::Input(
            "bench: --batch and --context take sizes ≥ 1".into(),
        ));
    }
    if spec.steps == 0 {
        // prefill only (as llama-bench -n 0): what it would not measure is refused
        let refuse = |what: &str| {
            Err(Error::Input(format!(
                "bench --steps 0 (prefill only): {what} measures decode steps; drop it or give --steps ≥ 1"
            )))
        };
        if spec.prefill == BenchPrefill::Synthetic {
            return Err(Error::Input(
                "bench --steps 0 (prefill only) needs a real prefill: give --prefill dense or --prefill sparse".into(),
            ));
        }
        if !spec.equivalent_batches.is_empty() {
            return refuse("--equivalent-batch");
        }
        if spec.forecast.is_some() {
            return refuse("--forecast");
        }
        if spec.trace_steps > 0 {
            return refuse("--trace");
        }
    }
    if spec.equivalent_batches.contains(&0) {
        return Err(Error::Input("--equivalent-batch: give sizes ≥ 1".into()));
    }
    if spec.resume.is_some() && spec.equivalent_batches.is_empty() {
        return Err(Error::Input(
            "--resume writes the cells of an --equivalent-batch grid: give --equivalent-batch"
                .into(),
        ));
    }
    let kv_modes = if spec.kv.is_empty() {
        vec![None]
    } else {
        spec.kv.clone()
    };
    // The offload settings of every offloaded mode of an EB grid: the first
    // offloaded --kv entry (or the defaults).
    let off = kv_modes
        .iter()
        .flatten()
        .next()
        .copied()
        .unwrap_or_default();
    // The EB grid and, with --resume, what is already done: planned before
    // anything is loaded, so a finished grid costs no GPU time.
    let eb_cells = eb_grid(spec);
    let keys: Vec<crate::report::CellKey> = eb_cells
        .iter()
        .map(|&(l, eb, mode)| cell_key(spec, &off, l, eb, mode))
        .collect();
    let plan = match &spec.resume {
        Some(dir) => Some(crate::report::plan_cells(dir, &keys)?),
        None => None,
    };
    let mut done_cases = Vec::new();
    if let Some(p) = &plan {
        for c in p {
            if let crate::report::CellPlan::Done(f) = c {
                let text = std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?;
                let v: Value = serde_json::from_str(&text)
                    .map_err(|e| Error::Input(format!("{}: not JSON: {e}", f.display())))?;
                done_cases.push(v["case"].clone());
            }
        }
        eprintln!(
            "bench: --resume {}: {} of {} cells done, {} to run",
            spec.resume.as_deref().unwrap_or(Path::new("")).display(),
            done_cases.len(),
            p.len(),
            p.len() - done_cases.len()
        );
        if done_cases.len() == p.len() {
            return Ok(json!({
                "what": bench_what(spec),
                "resume_dir": spec.resume,
                "note": "every cell of the grid was already in the --resume directory: nothing ran (`sparda report DIR` merges them)",
                "cases": done_cases,
            }));
        }
    }
    crate::cuda::require()?;
    let gpu = Arc::new(Gpu::new(0)?);
    let t = std::time::Instant::now();
    eprintln!("bench: loading {} …", spec.model);
    let ckpt = open_model(&spec.model)?;
    let opts = |sparse: bool| EngineOptions {
        attention: AttentionOverrides {
            sparse: Some(sparse),
            selection: if sparse { spec.selection } else { None },
            budget_blocks: spec.budget_blocks,
            select_blocks: spec.select_blocks,
        },
        prefill: match spec.prefill {
            BenchPrefill::Real(m) => m,
            BenchPrefill::Synthetic => PrefillMode::Auto,
        },
    };
    crate::memory::check_weights(&gpu, &ckpt.config, ckpt.eviction_heads)?;
    let mut model = GpuModel::new(gpu.clone(), &ckpt, opts(spec.sparse[0]))?;
    model.set_reserve_fetch_sms(spec.reserve_fetch_sms);
    model.set_fetch_whole_sms(spec.fetch_whole_sms);
    if let Some(pa) = spec.prefill_attention {
        model.set_prefill_attention(pa)?;
    }
    let cfg = ckpt.config.clone();
    drop(ckpt);
    let load_s = t.elapsed().as_secs_f64();
    eprintln!(
        "bench: weights on {} in {load_s:.1} s ({:.2} GB)",
        gpu.info().name,
        model.weight_bytes() as f64 / 1e9
    );
    let source = match &spec.tokenizer {
        Some(p) => Source::Books(book_tokens(&Tokenizer::from_file(p)?, &spec.texts)?),
        None => Source::Random(spec.seed, cfg.vocab_size),
    };
    // Contexts capped at the model's maximum position (runtime.md §5 asks
    // for 128K; 128K plus the decoded steps exceeds 131,072 positions).
    let max_pos = cfg.max_position_embeddings;
    let capped = |l: usize, compare: bool| {
        let after = positions_after_context(spec, compare);
        cap_context(l, after, max_pos).ok_or_else(|| {
            Error::Input(format!(
                "--context {l}: the model's max_position_embeddings {max_pos} leaves no context token once {after} decoded positions are added"
            ))
        })
    };
    for &l in &spec.contexts {
        let c = capped(l, false)?;
        if c != l {
            eprintln!(
                "bench: context {l} runs as {c}: {l} + {} decoded positions exceed max_position_embeddings {max_pos}",
                positions_after_context(spec, false) + 1
            );
        }
    }
    // The GEMM ceiling at each batch that runs: the --batch list, or the
    // real batches of the EB cells still to run.
    let budget = model.plan.budget;
    let mut ceiling_batches: Vec<usize> = if spec.equivalent_batches.is_empty() {
        spec.batches.clone()
    } else {
        let mut v = Vec::new();
        for (i, &(l, eb, mode)) in eb_cells.iter().enumerate() {
            let to_run = plan
                .as_ref()
                .is_none_or(|p| matches!(p[i], crate::report::CellPlan::Run(_)));
            if to_run {
                v.push(equivalent_batch(
                    mode,
                    eb,
                    budget.attended,
                    budget.block_size,
                    capped(l, false)?,
                ));
            }
        }
        v
    };
    ceiling_batches.sort_unstable();
    ceiling_batches.dedup();
    let mut ceilings = Vec::new();
    if spec.ceiling_reps > 0 && spec.steps > 0 {
        for &b in &ceiling_batches {
            let c = model.gemm_ceiling(b, spec.ceiling_reps)?;
            eprintln!(
                "bench: layer GEMMs alone (one graph) at B={b}: cuBLAS {:.3} ms ({:.0} GB/s), engine routing {:.3} ms; lm_head {:.3} ms",
                c.layers_graph_ms, c.layers_gb_per_s, c.layers_graph_ms_engine, c.lm_head_ms
            );
            ceilings.push(c);
        }
    }
    let info = gpu.info();
    // Run-level facts, in the report and in every cell file.
    let meta = json!({
        "what": bench_what(spec),
        "gpu": info.name, "arch": info.arch, "sm_count": info.sm_count,
        "total_mem_bytes": info.total_mem_bytes,
        "driver_cuda_version": info.driver_version_string(),
        "nvrtc_version": format!("{}.{}", info.nvrtc_version.0, info.nvrtc_version.1),
        "date_utc": crate::checks::kernels::utc_now_iso(),
        "commit": git_commit(),
        "model": spec.model,
        "config": {
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "max_position_embeddings": max_pos,
            "budget_blocks_S": budget.attended, "block_size": budget.block_size,
            "kernel_stride": budget.kernel_stride,
        },
        "weight_bytes": model.weight_bytes(),
        "small_batch_gemv_rows": gpu.small_gemv_rows(),
        "pdl": gpu.pdl_allowed(),
        "gemv_block_warps": crate::cuda::ops::gemv::block_warps(),
        "gemv_down_cublas": crate::cuda::ops::gemv::down_on_cublas(),
        "prefill_union_stats": crate::pipeline::union_stats::enabled(),
        "nvrtc_options": crate::cuda::context::env_nvrtc_options(),
        "host_pages": crate::kv::host_store::HostPages::from_env()?.name(),
        "weights_load_s": load_s,
        "prefill": match spec.prefill {
            BenchPrefill::Synthetic => "synthetic: random bf16 K/V N(0,1) per layer; c, Kc, p computed from them on the GPU; the model is not run (runtime.md §5)".to_string(),
            BenchPrefill::Real(m) => format!("real ({m:?})"),
        },
        "prefill_attention": model.prefill_attention().name(),
        "prefill_scores": crate::cuda::ops::prefill_scores::prefill_scores().name(),
        // the window-scoring kernel that runs for this model on this GPU (null: cuBLAS or
        // a shape the tensor-core kernels do not take)
        "prefill_scores_entry": crate::cuda::ops::prefill_scores::scores_kernel(
            crate::cuda::ops::prefill_scores::prefill_scores(),
            &info.arch,
            cfg.head_dim,
            cfg.num_attention_heads / cfg.num_key_value_heads.max(1),
        )
        .ok()
        .map(|k| k.entry),
        "select_threads_forced": crate::cuda::ops::select::select_threads_forced(),
        "swiglu_v8": crate::cuda::ops::swiglu_vec8(),
        "rmsnorm_v4": crate::cuda::ops::rmsnorm_vec4(),
        // prompt tokens per prefill forward call at most ($SPARDA_PREFILL_CHUNK or the default)
        "prefill_chunk": crate::pipeline::prefill_chunk(),
        "prompt_tokens": match &source {
            Source::Books(b) => format!(
                "book text ({}: {}), sequence b on text b mod {}, sequences sharing a text at different offsets (`prompt_origin` per case)",
                spec.texts.display(),
                b.iter().map(|x| x.name.as_str()).collect::<Vec<_>>().join(", "),
                b.len()
            ),
            Source::Random(..) => "random ids".to_string(),
        },
        "protocol": if spec.steps == 0 {
            format!("per case: one untimed prefill of {PREFILL_WARMUP_TOKENS} tokens (workspaces, first launches), then each of the B sequences prefilled in turn, timed on the host around the prefill and its synchronisation (the sequence's KV, and with offloaded KV its pinned host store, allocated before the clock starts; the spill to pinned host memory included); time to first token adds the argmax and its copy to the host; prefill tokens/s = B·L / the sum of the sequences' prefill times")
        } else {
            format!(
                "per case: {} warm-up decode steps excluded (the first builds the device-resident step and runs it eagerly, the second captures the CUDA graph), then {} timed greedy steps fed on the device; CUDA events around each step; tokens/s = B·steps / timed wall time; decode only (prefill excluded)",
                spec.warmup, spec.steps
            )
        },
    });
    let ceiling_at = |b: usize| ceilings.iter().find(|c| c.batch == b);
    let min_ctx = *spec.contexts.iter().min().expect("non-empty");
    let mut cases = done_cases;
    let forecast = spec
        .forecast
        .as_deref()
        .map(|f| crate::model::forecast::ForecastWeights::from_arg(f, &cfg))
        .transpose()?;
    // selection modes of an offloaded case: sync NOSA, then forecast × prefetch
    let mut sel_modes: Vec<Option<bool>> = if forecast.is_none() || spec.sync {
        vec![None]
    } else {
        Vec::new()
    };
    if forecast.is_some() {
        sel_modes.extend(spec.prefetch.iter().map(|&p| Some(p)));
    }
    for (i, &(asked, eb, mode)) in eb_cells.iter().enumerate() {
        let file = match plan.as_ref().map(|p| &p[i]) {
            Some(crate::report::CellPlan::Done(_)) => continue,
            Some(crate::report::CellPlan::Run(f)) => Some(f),
            None => None,
        };
        let l = capped(asked, false)?;
        let forecast_mode = matches!(mode, EbMode::ForecastPrefetch | EbMode::ForecastNoPrefetch);
        // a checkpoint without eviction heads (e.g. a Llama with a
        // sparse_config) selects by InfLLM-V2 where NOSA would: its
        // GPU-resident sparse and forecast modes; its offloaded NOSA mode is
        // the InfLLM-V2 one, so that cell is recorded as skipped
        let nosa = model.eviction;
        let skipped = mode == EbMode::NosaOffload && !nosa;
        let (mut c, b) = if skipped {
            let why = "NOSA selection needs eviction heads, which this checkpoint lacks (its offloaded sparse mode is InfLLM-V2 offloaded)";
            eprintln!("bench: EB {eb}, L {l}: {}: skipped: {why}", mode.name());
            let c = json!({"attention": "sparse", "kv": kv_name(&Some(off)), "batch": eb,
                "context": l, "skipped": why});
            (c, eb)
        } else {
            let mut o = opts(mode != EbMode::DenseGpu);
            if mode != EbMode::DenseGpu {
                // each mode's own rule, whatever --selection says
                o.attention.selection = Some(if mode == EbMode::InfllmOffload || !nosa {
                    SelectionRule::InfLlmV2
                } else {
                    SelectionRule::Nosa
                });
            }
            model.set_offload(None)?; // the new options must not meet the last mode's offload
            model.set_options(o)?;
            model.set_offload(mode.offloaded().then_some(off))?;
            model.set_forecast(
                if forecast_mode {
                    forecast.as_ref()
                } else {
                    None
                },
                mode == EbMode::ForecastPrefetch,
            )?;
            let b = equivalent_batch(
                mode,
                eb,
                model.plan.budget.attended,
                model.plan.budget.block_size,
                l,
            );
            eprintln!("bench: EB {eb}, L {l}: {} at B = {b}", mode.name());
            let c = run_case(
                &mut model,
                spec,
                &source,
                mode != EbMode::DenseGpu,
                b,
                l,
                false,
            )?;
            (c, b)
        };
        c["equivalent_batch"] = json!(eb);
        c["eb_mode"] = json!(if mode == EbMode::SparseGpu && !nosa {
            EB_INFLLM_GPU
        } else {
            mode.name()
        });
        c["context_asked"] = json!(asked);
        let ceiling = ceiling_at(b).filter(|_| !skipped);
        if let Some(ce) = ceiling {
            c["hbm_gb_s"] = json!(ce.layers_gb_per_s);
        }
        if let Some(f) = file {
            let mut cell = meta.clone();
            cell["date_utc"] = json!(crate::checks::kernels::utc_now_iso());
            cell["cell_key"] = serde_json::to_value(&keys[i]).expect("CellKey serializes");
            if !skipped {
                cell["gemm_ceiling"] = json!(ceiling.into_iter().collect::<Vec<_>>());
            }
            cell["case"] = c.clone();
            crate::report::write_atomic(f, &cell)?;
            if !skipped {
                eprintln!("  cell written: {}", f.display());
            }
        }
        cases.push(c);
    }
    if !eb_cells.is_empty() {
        model.set_forecast(None, false)?;
        model.set_offload(None)?;
    }
    let grid_sparse: &[bool] = if spec.equivalent_batches.is_empty() {
        &spec.sparse
    } else {
        &[]
    };
    for &sparse in grid_sparse {
        model.set_options(opts(sparse))?;
        for kv in &kv_modes {
            if kv.is_some() && !sparse {
                continue; // offload keeps selected blocks: sparse only
            }
            model.set_offload(*kv)?;
            for &b in &spec.batches {
                for &l in &spec.contexts {
                    // GPU-resident with --forecast: also the forecast selection, the
                    // step prefetch is compared against
                    let modes: &[Option<bool>] = match (kv.is_some(), sparse && forecast.is_some())
                    {
                        (true, _) => &sel_modes,
                        (false, true) => &[None, Some(false)],
                        (false, false) => &[None],
                    };
                    for &m in modes {
                        match m {
                            None => model.set_forecast(None, false)?,
                            Some(p) => model.set_forecast(forecast.as_ref(), p)?,
                        }
                        let compare = !sparse && b == 1 && l == min_ctx && kv.is_none();
                        let lc = capped(l, compare)?;
                        let mut c = run_case(&mut model, spec, &source, sparse, b, lc, compare)?;
                        if lc != l {
                            c["context_asked"] = json!(l);
                        }
                        cases.push(c);
                    }
                    model.set_forecast(None, false)?;
                }
            }
            model.set_offload(None)?;
        }
    }
    // The step-time target: B = 1, L = 4K dense against the layer-GEMM ceiling
    // measured in the same run (B1_TARGET_OVER_CEILING × it).
    let target = cases
        .iter()
        .find(|c| c["attention"] == "dense" && c["batch"] == 1 && c["context"] == 4096)
        .and_then(|c| {
            c["step_ms_mean"]
                .as_f64()
                .map(|ms| (ms, c["step_ms_median"].as_f64()))
        });
    let ceiling1 = ceilings.iter().find(|c| c.batch == 1);
    let comparison = match (target, ceiling1) {
        (Some((ms, med)), Some(c)) => {
            // the ceiling: the faster of the two graphs of layer GEMMs (when the
            // engine's own GEMV beats cuBLAS, cuBLAS is no ceiling)
            let (ceil, source) = if c.layers_graph_ms_engine < c.layers_graph_ms {
                (c.layers_graph_ms_engine, "engine routing")
            } else {
                (c.layers_graph_ms, "cuBLAS")
            };
            json!({
                "case": "dense, B=1, L=4096",
                "step_ms_mean": ms, "step_ms_median": med,
                "layer_gemm_ceiling_ms_measured": ceil,
                "layer_gemm_ceiling_source": source,
                "layer_gemms_cublas_ms": c.layers_graph_ms,
                "layer_gemms_engine_routing_ms": c.layers_graph_ms_engine,
                "layer_gemm_ceiling_ms_device_md": 4.13,
                "lm_head_ms": c.lm_head_ms,
                "rest_ms": ms - ceil,
                "step_over_ceiling": ms / ceil,
                // the target: 1.15 × the layer-GEMM ceiling measured in the same run
                "target_ms": B1_TARGET_OVER_CEILING * ceil,
                "meets_target": ms <= B1_TARGET_OVER_CEILING * ceil,
            })
        }
        _ => Value::Null,
    };
    let forecast_comparison = forecast_comparison(&cases);
    let mut report = meta;
    report["gemm_ceiling"] = json!(ceilings);
    report["target_comparison"] = comparison;
    report["forecast_comparison"] = forecast_comparison;
    report["cases"] = Value::Array(cases);
    if let Some(d) = &spec.resume {
        report["resume_dir"] = json!(d);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::prompts::Book;
    use super::*;

    fn case(sel: &str, b: u64, l: u64, step: f64, fetch_ms: Option<f64>) -> Value {
        let mut c = json!({"kv": "offload-sm16", "selection": sel, "batch": b, "context": l,
            "step_ms_mean": step, "tokens_per_s": b as f64 * 1e3 / step,
            "offload": {"locality_gamma": 0.8}});
        if let Some(p) = fetch_ms {
            c["offload"]["fetch_timing"] = json!({"fetch_ms_per_step": p});
        }
        c
    }

    #[test]
    fn forecast_comparison_takes_p_and_c_from_the_sync_run() {
        // sync 30 ms of which 10 fetch → C = 20, bound 1.5; prefetch 21, no prefetch 28
        let cases = vec![
            case("query-aware (sync NOSA)", 32, 65_536, 30.0, Some(10.0)),
            case("forecast+prefetch", 32, 65_536, 21.0, Some(10.0)),
            case("forecast, no prefetch", 32, 65_536, 28.0, Some(10.0)),
            // another cell without forecast runs: no entry
            case("query-aware (sync NOSA)", 8, 32_768, 12.0, Some(4.0)),
        ];
        let v = forecast_comparison(&cases);
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 1);
        let f = &a[0];
        assert_eq!(f["P_fetch_ms"], 10.0);
        assert_eq!(f["C_rest_ms"], 20.0);
        assert!((f["bound"].as_f64().unwrap() - 1.5).abs() < 1e-12);
        assert!((f["speedup"]["vs_sync"].as_f64().unwrap() - 30.0 / 21.0).abs() < 1e-12);
        assert!((f["speedup"]["vs_no_prefetch"].as_f64().unwrap() - 28.0 / 21.0).abs() < 1e-12);
        // 1.333 / 1.5 = 0.889 < 0.9
        assert_eq!(f["target_vs_no_prefetch_0_9_bound_met"], false);
        // L = 64K, B·L = 2.1 M, but bound 1.5 ≤ 1.55: the 1.4× target does not apply
        assert_eq!(f["target_vs_sync_1_4_applies"], false);
        assert_eq!(f["target_vs_sync_1_4_met"], true);
        // no GPU-resident forecast run: no resident ratio
        assert!(f["prefetch_over_resident"].is_null());
        // with one (kv "gpu", selection "forecast"): 21 / 17.5 = 1.2 > 1.15
        let mut with_resident = cases.clone();
        let mut r = case("forecast", 32, 65_536, 17.5, None);
        r["kv"] = json!("gpu");
        with_resident.push(r);
        let v = forecast_comparison(&with_resident);
        let f = &v.as_array().unwrap()[0];
        assert_eq!(f["resident_forecast_step_ms"], 17.5);
        assert!((f["prefetch_over_resident"].as_f64().unwrap() - 1.2).abs() < 1e-12);
        assert_eq!(f["target_prefetch_1_15_resident_met"], false);
        // P 10 ≤ C 20: the 1.15× target applies here
        assert_eq!(f["target_prefetch_1_15_resident_applies"], true);
        // the forecast run's own P 10 and C 28 - 10 = 18: 18 / 17.5 of the resident step;
        // the prefetched 21 over max(10, 18)
        assert_eq!(f["forecast_P_fetch_ms"], 10.0);
        assert_eq!(f["forecast_C_rest_ms"], 18.0);
        assert!((f["forecast_rest_over_resident"].as_f64().unwrap() - 18.0 / 17.5).abs() < 1e-12);
        assert!((f["prefetch_over_forecast_ideal"].as_f64().unwrap() - 21.0 / 18.0).abs() < 1e-12);
        // no resident run of the sync selection yet; with one (16 ms): C 20 / 16
        assert!(f["resident_sync_step_ms"].is_null());
        let mut r = case("query-aware (sync NOSA)", 32, 65_536, 16.0, None);
        r["kv"] = json!("gpu");
        with_resident.push(r);
        let v = forecast_comparison(&with_resident);
        assert_eq!(v[0]["resident_sync_step_ms"], 16.0);
        assert!((v[0]["sync_rest_over_resident"].as_f64().unwrap() - 1.25).abs() < 1e-12);
        let text = table(&json!({"cases": [], "forecast_comparison": v}));
        assert!(
            text.contains("forecast, no prefetch: P 10.00 ms C 18.00 ms (1.03× the GPU-resident forecast step); prefetch 1.17× max(P, C); sync C 1.25× the GPU-resident sync step"),
            "{text}"
        );
        // a fetch longer than the rest of the step (P 25 > C 5): it does not
        let mut fetch_bound = with_resident.clone();
        fetch_bound[0]["offload"]["fetch_timing"]["fetch_ms_per_step"] = json!(25.0);
        let v = forecast_comparison(&fetch_bound);
        assert_eq!(v[0]["target_prefetch_1_15_resident_applies"], false);
    }

    #[test]
    fn forecast_runs_pair_with_the_sync_run_of_their_own_selection_rule() {
        let with_mode = |mut c: Value, m: &str| {
            c["mode"] = json!(m);
            c
        };
        let cases = vec![
            with_mode(
                case("query-aware (sync NOSA)", 16, 65_536, 30.0, Some(10.0)),
                "Nosa",
            ),
            with_mode(
                case("query-aware (InfLLM-V2)", 16, 65_536, 25.0, Some(9.0)),
                "InfLlmV2",
            ),
            with_mode(case("forecast+prefetch", 16, 65_536, 21.0, None), "Nosa"),
            with_mode(
                case("forecast, no prefetch", 16, 65_536, 28.0, None),
                "Nosa",
            ),
        ];
        let v = forecast_comparison(&cases);
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 1);
        assert_eq!(a[0]["P_fetch_ms"], 10.0);
    }

    #[test]
    fn forecast_comparison_skips_cells_that_did_not_run() {
        let mut pre = case("forecast+prefetch", 32, 131_072, 0.0, None);
        pre["skipped"] = json!("needs more pinned memory");
        let cases = vec![
            case("query-aware (sync NOSA)", 32, 131_072, 30.0, Some(10.0)),
            pre,
            case("forecast, no prefetch", 32, 131_072, 28.0, Some(10.0)),
        ];
        assert_eq!(forecast_comparison(&cases).as_array().unwrap().len(), 0);
    }

    #[test]
    fn equivalent_batch_follows_runtime_md_example() {
        // S = 64 blocks of 64 tokens, L = 16K: EB 128 → 128 offloaded, 32 on the GPU
        for m in EbMode::ALL {
            let b = equivalent_batch(m, 128, 64, 64, 16_384);
            assert_eq!(b, if m.offloaded() { 128 } else { 32 }, "{}", m.name());
        }
        // a context longer than the whole budget still runs one sequence
        assert_eq!(equivalent_batch(EbMode::DenseGpu, 1, 64, 64, 131_072), 1);
        assert_eq!(equivalent_batch(EbMode::SparseGpu, 64, 64, 64, 65_536), 4);
    }

    #[test]
    fn kv_names_say_where_the_kv_lives_and_how_it_is_fetched() {
        use crate::pipeline::FetchEngine;
        assert_eq!(kv_name(&None), "gpu");
        let o = OffloadOptions {
            fetch: FetchEngine::Sm { ctas: 16 },
            offload_layer0: false,
            cache_slots: 0,
        };
        assert_eq!(kv_name(&Some(o)), "offload-sm16");
        let c = OffloadOptions {
            cache_slots: 32,
            ..o
        };
        assert_eq!(kv_name(&Some(c)), "offload-sm16-cache32");
        let o = OffloadOptions {
            fetch: FetchEngine::Dma,
            ..o
        };
        assert_eq!(kv_name(&Some(o)), "offload-dma");
        let o = OffloadOptions {
            fetch: FetchEngine::Split {
                ctas: 8,
                ce_pct: 50,
            },
            ..o
        };
        assert_eq!(kv_name(&Some(o)), "offload-split8-50");
    }

    #[test]
    fn token_counts_accept_k_and_m_suffixes() {
        assert_eq!(parse_tokens("4K").unwrap(), 4096);
        assert_eq!(parse_tokens("32k").unwrap(), 32_768);
        assert_eq!(parse_tokens("100").unwrap(), 100);
        assert_eq!(parse_tokens("1M").unwrap(), 1 << 20);
        assert!(parse_tokens("x").is_err());
        assert!(parse_tokens("").is_err());
    }

    fn book(name: &str, len: u32) -> Book {
        Book {
            name: name.into(),
            tokens: (0..len).collect(),
        }
    }

    #[test]
    fn contexts_are_capped_at_the_model_maximum() {
        // 128K + 89 decoded positions on a 131,072-position model: 127K
        assert_eq!(cap_context(131_072, 88, 131_072), Some(130_048));
        // with 2,048 positions after it, 126K (129,024 tokens)
        assert_eq!(cap_context(131_072, 2_047, 131_072), Some(129_024));
        assert_eq!(cap_context(65_536, 88, 131_072), Some(65_536));
        assert_eq!(cap_context(1_000, 100, 600), Some(499));
        assert_eq!(cap_context(10, 200, 100), None);
        let s = tiny_spec(); // 1 warm-up, 1 step
        assert_eq!(positions_after_context(&s, false), 1 + 1 + 2 + 3);
        assert_eq!(positions_after_context(&s, true), 7 + 2 + 8);
    }

    #[test]
    fn sequences_take_different_texts_then_different_offsets() {
        let src = Source::Books(vec![book("a.txt", 100), book("b.txt", 50)]);
        // batch 4 on 2 texts: 2 sequences per text, at 0 and half its length
        assert_eq!(src.origin(0, 4), (0, 0));
        assert_eq!(src.origin(1, 4), (1, 0));
        assert_eq!(src.origin(2, 4), (0, 50));
        assert_eq!(src.origin(3, 4), (1, 25));
        assert_eq!(src.tokens(3, 4, 30)[..3], [25, 26, 27]);
        assert_eq!(
            src.tokens(3, 4, 30)[29],
            (25 + 29) % 50,
            "wraps at the text's end"
        );
        let o = src.origins_json(2);
        assert_eq!(o[1]["text"], "b.txt");
        assert_eq!(o[1]["offset"], 0);
        assert_eq!(o[1]["text_tokens"], 50);
        assert_eq!(Source::Random(0, 10).origins_json(2), Value::Null);
    }

    #[test]
    fn the_eb_grid_and_its_cell_keys() {
        let mut s = tiny_spec();
        s.contexts = vec![16_384, 131_072];
        s.equivalent_batches = vec![64, 128];
        assert_eq!(
            eb_grid(&s).len(),
            2 * 2 * 4,
            "no forecast modes without --forecast"
        );
        s.forecast = Some("synth:1".into());
        let g = eb_grid(&s);
        assert_eq!(g.len(), 2 * 2 * 6);
        assert_eq!(g[0], (16_384, 64, EbMode::DenseGpu));
        assert_eq!(g[23], (131_072, 128, EbMode::ForecastNoPrefetch));
        let off = OffloadOptions::default();
        let k = cell_key(&s, &off, 131_072, 128, EbMode::ForecastPrefetch);
        assert_eq!(k.file_name(), "forecast-prefetch_L131072_eb128.json");
        assert_eq!(k.fetch, "offload-sm16");
        assert_eq!(k.prefill, "synthetic");
        assert_eq!(
            cell_key(&s, &off, 16_384, 64, EbMode::DenseGpu).fetch,
            "gpu"
        );
    }

    #[test]
    fn resume_without_an_equivalent_batch_grid_is_refused() {
        let mut s = tiny_spec();
        s.resume = Some(PathBuf::from("cells"));
        let e = run(&s).unwrap_err().to_string();
        assert!(
            e.contains("--resume") && e.contains("--equivalent-batch"),
            "{e}"
        );
    }

    #[test]
    fn prompts_differ_per_sequence_and_wrap_around_the_book() {
        let book = Source::Books(vec![book("x.txt", 100)]);
        let a = book.tokens(0, 4, 10);
        let b = book.tokens(1, 4, 10);
        assert_eq!(a[0], 0);
        assert_eq!(b[0], 25);
        assert_eq!(book.tokens(3, 4, 40)[39], (75 + 39) % 100);
        let r = Source::Random(1, 50);
        let x = r.tokens(0, 2, 100);
        assert!(x.iter().all(|&t| (3..50).contains(&t)));
        assert_ne!(x, r.tokens(1, 2, 100));
    }

    #[test]
    fn percentiles() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median(&v), 3.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 5.0);
    }

    fn tiny_spec() -> BenchSpec {
        BenchSpec {
            model: "synth:tiny".into(),
            sparse: vec![false],
            selection: None,
            budget_blocks: None,
            select_blocks: None,
            batches: vec![1],
            contexts: vec![64],
            steps: 1,
            warmup: 1,
            prefill: BenchPrefill::Synthetic,
            prefill_attention: None,
            tokenizer: None,
            texts: PathBuf::from("data/texts"),
            seed: 0,
            ceiling_reps: 0,
            profile_reps: 0,
            kv: vec![None],
            fetch_timing_steps: 0,
            forecast: None,
            prefetch: vec![],
            sync: true,
            reserve_fetch_sms: false,
            fetch_whole_sms: false,
            cta_timeline: false,
            equivalent_batches: vec![],
            trace_steps: 0,
            resume: None,
        }
    }

    #[test]
    fn bench_without_cuda_is_an_error_not_a_panic() {
        if crate::cuda::is_available() {
            return;
        }
        assert!(matches!(run(&tiny_spec()), Err(Error::Cuda(_))));
    }

    #[test]
    fn report_names_the_comparison_it_runs() {
        let mut s = tiny_spec();
        assert!(bench_what(&s)
            .contains("GPU-resident decode throughput over the attention × batch × context grid"));
        s.kv = vec![None, Some(OffloadOptions::default())];
        assert!(bench_what(&s).contains("offloaded KV (synchronous fetch) vs GPU-resident"));
        s.forecast = Some("synth:1".into());
        assert!(bench_what(&s).contains("forecast selection with and without prefetch"));
        s.equivalent_batches = vec![128];
        assert!(bench_what(&s).contains("equivalent-batch protocol"));
    }

    #[test]
    fn prefill_only_needs_a_real_prefill_and_refuses_decode_options() {
        let mut s = tiny_spec();
        s.steps = 0;
        let e = run(&s).unwrap_err().to_string();
        assert!(e.contains("needs a real prefill"), "{e}");
        s.prefill = BenchPrefill::Real(PrefillMode::Dense);
        s.equivalent_batches = vec![32];
        let e = run(&s).unwrap_err().to_string();
        assert!(
            e.contains("--equivalent-batch measures decode steps"),
            "{e}"
        );
        s.equivalent_batches.clear();
        s.forecast = Some("synth:1".into());
        let e = run(&s).unwrap_err().to_string();
        assert!(e.contains("--forecast measures decode steps"), "{e}");
        s.forecast = None;
        // a prefill-only case reserves the first token's position only
        assert_eq!(positions_after_context(&s, true), 1);
        assert!(bench_what(&s).contains("prefill only"));
        s.steps = 64;
        assert_eq!(positions_after_context(&s, false), 1 + 64 + 2 + 3);
    }

    #[test]
    fn table_prints_prefill_only_rows() {
        let r = json!({"cases": [{"attention": "sparse", "kv": "gpu", "batch": 1, "context": 32768,
            "prefill_tokens_per_s": 20480.4, "ttft_ms_median": 1600.04}]});
        let t = table(&r);
        assert!(
            t.contains("prefill only: 20480 tokens/s, time to first token 1600.0 ms"),
            "{t}"
        );
    }
}
