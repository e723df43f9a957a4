//! `sparda`: the command-line interface (runtime.md §6 vocabulary).

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use sparda::cpu::{CpuModel, EngineOptions};
use sparda::cuda::engine::GpuModel;
use sparda::generate::{self, Request};
use sparda::model::{AttentionOverrides, PrefillMode, SelectionRule};
use sparda::sample::SamplingParams;
use sparda::tokenizer::{TextStream, Tokenizer};
use sparda::{Error, Result};
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "sparda",
    version,
    about = "Decode runtime for NOSA sparse-attention language models"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt (streams tokens; prints tokens/s at the end).
    #[command(mut_arg("fetch", |a| a.help(GENERATE_FETCH_HELP).num_args(1)))]
    Generate(GenerateArgs),
    /// Write a random-weight checkpoint (config.json, safetensors, tokenizer.json).
    Synth(SynthArgs),
    /// Check every CUDA kernel against the CPU reference on random inputs
    /// (spec/testing.md shapes); writes a JSON report; exit 1 if a case fails.
    GpuCheck {
        /// Report path.
        #[arg(long, default_value = "gpu_check.json")]
        json: PathBuf,
    },
    /// Decode-throughput benchmark of the GPU-resident engine (runtime.md §5):
    /// runs every attention × batch × context case in one process (weights
    /// loaded once) and writes a JSON report; prints a table.
    Bench(BenchArgs),
    /// Check the GPU engine end to end against the CPU reference under teacher
    /// forcing (logits rel. L2 ≤ 2e-2 at every step; block selections compared):
    /// the tiny synthetic model (dense, NOSA, InfLLM-V2), plus a checkpoint
    /// (e.g. the SmolLM2 fixture) when --model is given. Exit 1 if a case fails.
    GpuCheckE2e {
        /// A dense checkpoint to check too (e.g. .fixtures/smollm2-135m-instruct).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Report path.
        #[arg(long, default_value = "gpu_check_e2e.json")]
        json: PathBuf,
        /// Teacher-forced decode steps per case.
        #[arg(long, default_value_t = sparda::cuda::check_e2e::DEFAULT_STEPS)]
        steps: usize,
    },
    /// Chrome/Perfetto trace tools.
    #[command(subcommand)]
    Trace(TraceCmd),
    /// Offloaded decode against GPU-resident sparse decode, bit for bit
    /// (greedy tokens and logits bits at every step; issue 4): one resident
    /// run, then one offloaded run per --fetch engine. Exit 1 if any differs.
    OffloadCheck(OffloadCheckArgs),
}

#[derive(Args)]
struct OffloadCheckArgs {
    /// Checkpoint directory or `synth:PRESET[:SEED]`.
    #[arg(long)]
    model: String,
    /// tokenizer.json (default: the model's, or the fixture's for synth:).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Prompt text file.
    #[arg(long)]
    prompt_file: PathBuf,
    /// Prompt tokens kept.
    #[arg(long, default_value_t = 6000)]
    prompt_tokens: usize,
    /// Greedy tokens generated per run.
    #[arg(long, default_value_t = 2048)]
    new_tokens: usize,
    /// Sequences decoded together: sequence b takes the book from offset
    /// 997·b, with 61·b fewer prompt tokens (different lengths, different
    /// roll-over steps).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Selection rule (a dense checkpoint gets a default sparse_config).
    #[arg(long, value_enum)]
    selection: Option<SelectionArg>,
    /// Attended blocks S per (sequence, KV head).
    #[arg(long)]
    budget_blocks: Option<usize>,
    #[command(flatten)]
    offload: OffloadArgs,
    /// Forecast weights (FILE or synth[:SEED]): every run selects with the
    /// forecast; the offloaded runs then go through each --prefetch setting.
    #[arg(long)]
    forecast: Option<String>,
    /// Prefetch settings to run with --forecast.
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "on,off")]
    prefetch: Vec<OnOff>,
    /// With --forecast: also compare the GPU's forecast selections with the
    /// CPU reference's over this many teacher-forced steps (0: skip; CPU
    /// time grows with the model).
    #[arg(long, default_value_t = 0)]
    cpu_check_steps: usize,
    /// Stress: also run prefetch with this many µs of injected delay before
    /// every fetch on the copy stream (0: no stress run).
    #[arg(long, default_value_t = 0)]
    copy_delay_us: u32,
    /// Report path.
    #[arg(long)]
    json: PathBuf,
}

#[derive(Subcommand)]
enum TraceCmd {
    /// Per-phase totals and per-step means, H2D total / exposed / hidden,
    /// overlap % and a per-layer table of a Chrome/Perfetto trace JSON
    /// (written by `generate --trace` or `bench --trace`; see traces/README.md).
    Summarize {
        /// Trace JSON file.
        file: PathBuf,
        /// Print the summary as JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Backend {
    /// CUDA when available, else the CPU reference.
    Auto,
    /// The CPU reference (f32 on the checkpoint's weights).
    Cpu,
    /// The GPU.
    Cuda,
}

#[derive(Clone, Copy, ValueEnum)]
enum AttentionArg {
    Dense,
    Sparse,
}

#[derive(Clone, Copy, ValueEnum)]
enum SelectionArg {
    Nosa,
    Infllmv2,
}

#[derive(Clone, Copy, ValueEnum)]
enum PrefillArg {
    /// Dense prefill, sparse decode (NOSA_F).
    Dense,
    /// As the attention mode says.
    Sparse,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or
    /// `synth:PRESET[:SEED]` for a random-weight model built in memory
    /// (tiny, nosa-1b, nosa-3b, nosa-8b; nosa-8b needs ~17 GB of RAM).
    #[arg(long)]
    model: PathBuf,
    /// tokenizer.json (default: the model directory's; for `synth:` models the
    /// SmolLM2 fixture's, as `sparda synth` uses).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// File whose text is the prompt.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Keep only the first N prompt tokens (e.g. a whole book truncated to a context length).
    #[arg(long, allow_negative_numbers = true)]
    prompt_tokens: Option<usize>,
    /// Upper bound on generated tokens.
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    top_p: f32,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Force dense or sparse attention (default: as the checkpoint says).
    #[arg(long, value_enum)]
    attention: Option<AttentionArg>,
    /// Selection rule for sparse attention.
    #[arg(long, value_enum)]
    selection: Option<SelectionArg>,
    /// Prefill attention.
    #[arg(long, value_enum)]
    prefill: Option<PrefillArg>,
    /// Attended blocks S per (sequence, KV head) (sets topk = S − window blocks).
    #[arg(long, allow_negative_numbers = true)]
    budget_blocks: Option<usize>,
    /// Query-aware shortlist parameter select_blocks.
    #[arg(long, allow_negative_numbers = true)]
    select_blocks: Option<usize>,
    /// SparDA forecast weights (.safetensors, or a SparDA trainer .pt, with
    /// `model.layers.{l}.self_attn.q_future_proj.weight`, keys matched by suffix,
    /// and layer 0's `q_curr_proj`), or `synth[:SEED]` for random ones: sparse decode
    /// selects with the forecast (spec §4 "Forecast mode"; CPU and CUDA).
    #[arg(long)]
    forecast: Option<String>,
    /// Forecast mode with --kv offload: prefetch layer l+1's blocks on a copy
    /// stream while layer l computes (on), or fetch them in the layer (off).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    prefetch: OnOff,
    /// Override rope θ (e.g. 40000 past 32K, as the NOSA evaluations do).
    #[arg(long, allow_hyphen_values = true)]
    rope_theta: Option<f64>,
    /// Override max_position_embeddings.
    #[arg(long, allow_negative_numbers = true)]
    max_position: Option<usize>,
    /// Do not stop at EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Where the KV lives (CUDA backend): all on the GPU, or offloaded to
    /// pinned host memory with the selected blocks fetched each step.
    #[arg(long, value_enum, default_value_t = KvArg::Gpu)]
    kv: KvArg,
    #[command(flatten)]
    offload: OffloadArgs,
    /// Write a Chrome/Perfetto trace of the run here: host spans plus GPU
    /// spans per layer and step on one track per stream (decode then runs
    /// without CUDA graphs).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write the run's tokens and timings as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum KvArg {
    /// All KV on the GPU.
    Gpu,
    /// Full KV in pinned host memory, selected blocks fetched (issue 4).
    Offload,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FetchArg {
    /// Per batch size and GPU (SM kernel; CTAs by SparDA's rule, 16 on the H200).
    Auto,
    /// Persistent UVA copy kernel on --prefetch-ctas CTAs.
    Sm,
    /// The copy engines (cuMemcpyBatchAsync).
    Dma,
}

/// `generate --help`'s text for `--fetch` (generate runs one engine; the
/// shared [`OffloadArgs`] text describes bench's and offload-check's list).
const GENERATE_FETCH_HELP: &str =
    "Fetch engine of offloaded KV (with --kv offload; give one engine)";

/// Offload flags shared by generate, bench and offload-check (runtime.md §6).
#[derive(Args, Clone)]
struct OffloadArgs {
    /// Fetch engines of offloaded KV, each run in turn (comma-separated or
    /// repeated; generate takes one).
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "auto")]
    fetch: Vec<FetchArg>,
    /// CTAs of the SM fetch kernel (default: by the per-GPU rule with --fetch auto, 16 with --fetch sm).
    #[arg(long, allow_negative_numbers = true)]
    prefetch_ctas: Option<usize>,
    /// Offload layer 0 too (default: it stays on the GPU, for every mode compared).
    #[arg(long)]
    offload_layer0: bool,
}

impl OffloadArgs {
    /// Whether any offload flag differs from its default.
    fn given(&self) -> bool {
        self.fetch != [FetchArg::Auto] || self.prefetch_ctas.is_some() || self.offload_layer0
    }

    /// Rejects a CTA count the kernel cannot use.
    fn validate(&self) -> Result<()> {
        match self.prefetch_ctas {
            Some(n) if n == 0 || n > 1024 => Err(Error::Input(format!(
                "--prefetch-ctas {n}: give 1 … 1024 CTAs"
            ))),
            _ => Ok(()),
        }
    }

    fn options(&self) -> Vec<sparda::cuda::engine::OffloadOptions> {
        use sparda::cuda::engine::{FetchEngine, OffloadOptions};
        self.fetch
            .iter()
            .map(|f| OffloadOptions {
                fetch: match (f, self.prefetch_ctas) {
                    (FetchArg::Auto, None) => FetchEngine::Auto,
                    (FetchArg::Auto | FetchArg::Sm, Some(ctas)) => FetchEngine::Sm { ctas },
                    (FetchArg::Sm, None) => FetchEngine::Sm { ctas: 16 },
                    (FetchArg::Dma, _) => FetchEngine::Dma,
                },
                offload_layer0: self.offload_layer0,
            })
            .collect()
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum BenchPrefillArg {
    /// Real dense prefill (NOSA_F), then decode.
    Dense,
    /// Real prefill as the attention mode says.
    #[value(alias = "real")]
    Sparse,
    /// Random K/V with c, Kc and p computed from them; the model is not run.
    Synthetic,
}

#[derive(Args)]
struct BenchArgs {
    /// Checkpoint directory, or `synth:PRESET[:SEED]` (e.g. synth:nosa-8b).
    #[arg(long)]
    model: String,
    /// Attention modes, each run in turn (comma-separated or repeated).
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "dense")]
    attention: Vec<AttentionArg>,
    /// Selection rule for sparse attention.
    #[arg(long, value_enum)]
    selection: Option<SelectionArg>,
    /// Attended blocks S per (sequence, KV head).
    #[arg(long)]
    budget_blocks: Option<usize>,
    /// Query-aware shortlist parameter select_blocks.
    #[arg(long)]
    select_blocks: Option<usize>,
    /// Batch sizes B (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "1")]
    batch: Vec<usize>,
    /// Context lengths L: tokens per sequence before decoding (e.g. 4K,32K).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "4K")]
    context: Vec<String>,
    /// Timed decode steps per case (≥ 64 per runtime.md §5).
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Untimed warm-up decode steps per case (build, graph capture).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// How sequences are filled before decoding.
    #[arg(long, value_enum, default_value_t = BenchPrefillArg::Synthetic)]
    prefill: BenchPrefillArg,
    /// tokenizer.json: prompts from the books in --texts (else random ids).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Directory of .txt books for prompts.
    #[arg(long, default_value = "data/texts")]
    texts: PathBuf,
    /// Seed of random ids and synthetic state.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Replays per layer-GEMM ceiling measurement (0 skips it).
    #[arg(long, default_value_t = 20)]
    ceiling_reps: usize,
    /// Replays per step-piece timing (0 skips it).
    #[arg(long, default_value_t = 10)]
    profile_reps: usize,
    /// Where the KV lives (each run in turn; offload runs for sparse attention only).
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "gpu")]
    kv: Vec<KvArg>,
    #[command(flatten)]
    offload: OffloadArgs,
    /// Extra decode steps with every fetch timed (fetch GB/s) per offloaded case.
    #[arg(long, default_value_t = 16)]
    fetch_timing_steps: usize,
    /// Forecast weights (FILE or synth[:SEED]): offloaded cases also run in
    /// forecast mode with each --prefetch setting (issue 5).
    #[arg(long)]
    forecast: Option<String>,
    /// Prefetch settings of the forecast runs.
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "on,off")]
    prefetch: Vec<OnOff>,
    /// With --forecast: also run the synchronous NOSA selection (the baseline).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    sync: OnOff,
    /// Write a Chrome/Perfetto trace here: after each case's timed steps,
    /// --trace-steps more steps run with GPU spans (and as many without, to
    /// measure the tracing overhead).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Equivalent batch sizes (runtime.md §5): per context, run every mode
    /// (dense and NOSA on the GPU, NOSA and InfLLM-V2 offloaded, and with
    /// --forecast forecast ± prefetch) at the real batch that fills the same
    /// GPU KV memory as EB offloaded sequences; replaces --batch. Offloaded
    /// modes use the first --fetch engine; --prefetch, --sync and --selection
    /// do not apply (each mode has its own).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    equivalent_batch: Vec<usize>,
    /// Traced steps per case with --trace.
    #[arg(long, default_value_t = 4)]
    trace_steps: usize,
    /// Report path.
    #[arg(long)]
    json: PathBuf,
}

#[derive(Args)]
struct SynthArgs {
    /// tiny | nosa-1b | nosa-3b | nosa-8b.
    #[arg(long)]
    preset: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Weight seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// tokenizer.json to copy (the SmolLM2 fixture's).
    #[arg(long, default_value_os_t = fixture_tokenizer())]
    tokenizer: PathBuf,
    /// Also write random SparDA forecast weights to OUT/forecast.safetensors.
    #[arg(long)]
    forecast: bool,
}

fn main() {
    let cli = Cli::parse();
    let trace_path = match &cli.cmd {
        Cmd::Generate(a) => a.trace.clone(),
        Cmd::Bench(a) => a.trace.clone(),
        _ => None,
    };
    let session = match sparda::trace::init_subscriber(trace_path.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let r = match cli.cmd {
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Synth(a) => cmd_synth(a),
        Cmd::GpuCheckE2e { model, json, steps } => {
            sparda::cuda::check_e2e::gpu_check_e2e(model.as_deref(), &json, steps)
                .and_then(|ok| check_outcome("gpu-check-e2e", "end-to-end", ok, &json))
        }
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::OffloadCheck(a) => cmd_offload_check(a),
        Cmd::Trace(TraceCmd::Summarize { file, json }) => {
            sparda::trace::summarize_file(&file).map(|s| {
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&s).expect("summary serializes")
                    );
                } else {
                    print!("{}", s.to_text());
                }
            })
        }
        Cmd::GpuCheck { json } => sparda::cuda::check::gpu_check(&json)
            .and_then(|ok| check_outcome("gpu-check", "kernel", ok, &json)),
    };
    let r = r.and_then(|()| match session {
        Some(s) => {
            let path = s.path().to_path_buf();
            s.finish().map(|_| {
                eprintln!(
                    "trace written to {} (open in ui.perfetto.dev; `sparda trace summarize` for the numbers)",
                    path.display()
                )
            })
        }
        None => Ok(()),
    });
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let contexts = a
        .context
        .iter()
        .map(|c| sparda::bench::parse_tokens(c))
        .collect::<Result<Vec<_>>>()?;
    let spec = sparda::bench::BenchSpec {
        model: a.model,
        sparse: a
            .attention
            .iter()
            .map(|x| matches!(x, AttentionArg::Sparse))
            .collect(),
        selection: a.selection.map(|s| match s {
            SelectionArg::Nosa => SelectionRule::Nosa,
            SelectionArg::Infllmv2 => SelectionRule::InfLlmV2,
        }),
        budget_blocks: a.budget_blocks,
        select_blocks: a.select_blocks,
        batches: a.batch,
        contexts,
        steps: a.steps,
        warmup: a.warmup,
        prefill: match a.prefill {
            BenchPrefillArg::Synthetic => sparda::bench::BenchPrefill::Synthetic,
            BenchPrefillArg::Dense => sparda::bench::BenchPrefill::Real(PrefillMode::Dense),
            BenchPrefillArg::Sparse => sparda::bench::BenchPrefill::Real(PrefillMode::Auto),
        },
        tokenizer: a.tokenizer,
        texts: a.texts,
        seed: a.seed,
        ceiling_reps: a.ceiling_reps,
        profile_reps: a.profile_reps,
        kv: a
            .kv
            .iter()
            .flat_map(|k| match k {
                KvArg::Gpu => vec![None],
                KvArg::Offload => a.offload.options().into_iter().map(Some).collect(),
            })
            .collect(),
        fetch_timing_steps: a.fetch_timing_steps,
        forecast: a.forecast,
        prefetch: a.prefetch.iter().map(|p| *p == OnOff::On).collect(),
        sync: a.sync == OnOff::On,
        equivalent_batches: a.equivalent_batch,
        trace_steps: if a.trace.is_some() { a.trace_steps } else { 0 },
    };
    let report = sparda::bench::run(&spec)?;
    std::fs::write(
        &a.json,
        serde_json::to_string_pretty(&report).expect("json"),
    )
    .map_err(|e| Error::io(&a.json, e))?;
    print!("{}", sparda::bench::table(&report));
    eprintln!("bench: report in {}", a.json.display());
    Ok(())
}

/// Opens a model again for the CPU reference (the GPU run dropped its copy).
fn ckpt_cpu(model: &str) -> Result<sparda::weights::Checkpoint> {
    sparda::bench::open_model(model)
}

fn cmd_offload_check(a: OffloadCheckArgs) -> Result<()> {
    sparda::cuda::require()?;
    let ckpt = sparda::bench::open_model(&a.model)?;
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| {
        if a.model.starts_with("synth:") {
            fixture_tokenizer()
        } else {
            PathBuf::from(&a.model).join("tokenizer.json")
        }
    });
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let text = std::fs::read_to_string(&a.prompt_file).map_err(|e| Error::io(&a.prompt_file, e))?;
    let mut prompt = tokenizer.encode(&text)?;
    if prompt.len() < a.prompt_tokens {
        return Err(Error::Input(format!(
            "{}: {} tokens, fewer than --prompt-tokens {}",
            a.prompt_file.display(),
            prompt.len(),
            a.prompt_tokens
        )));
    }
    if a.batch == 0 || prompt.len() < a.prompt_tokens + 997 * a.batch.saturating_sub(1) {
        return Err(Error::Input(format!(
            "--batch {}: {} has {} tokens; {} sequences of up to {} tokens at offsets of 997 need {}",
            a.batch,
            a.prompt_file.display(),
            prompt.len(),
            a.batch,
            a.prompt_tokens,
            a.prompt_tokens + 997 * a.batch.saturating_sub(1)
        )));
    }
    if a.prompt_tokens <= 61 * a.batch.saturating_sub(1) {
        return Err(Error::Input(format!(
            "--prompt-tokens {} is too short for --batch {} (sequence b gets 61·b fewer tokens)",
            a.prompt_tokens, a.batch
        )));
    }
    let prompts: Vec<Vec<u32>> = (0..a.batch)
        .map(|b| prompt[997 * b..997 * b + a.prompt_tokens - 61 * b].to_vec())
        .collect();
    prompt.truncate(a.prompt_tokens);
    generate::check_length(
        prompt.len(),
        a.new_tokens,
        ckpt.config.max_position_embeddings,
    )?;
    let opts = EngineOptions {
        attention: AttentionOverrides {
            sparse: Some(true),
            selection: a.selection.map(|s| match s {
                SelectionArg::Nosa => SelectionRule::Nosa,
                SelectionArg::Infllmv2 => SelectionRule::InfLlmV2,
            }),
            budget_blocks: a.budget_blocks,
            select_blocks: None,
        },
        prefill: PrefillMode::Auto,
    };
    let gpu = std::sync::Arc::new(sparda::cuda::Gpu::new(0)?);
    let mut model = GpuModel::new(gpu.clone(), &ckpt, opts)?;
    drop(ckpt);
    eprintln!(
        "offload-check: {} ({:?}, S = {} blocks) on {}, prompt {} tokens, {} new tokens",
        a.model,
        model.plan.mode,
        model.plan.budget.attended,
        gpu.info().name,
        prompt.len(),
        a.new_tokens
    );
    let forecast = a
        .forecast
        .as_deref()
        .map(|spec| sparda::model::forecast::ForecastWeights::from_arg(spec, &model.config))
        .transpose()?;
    let mut modes = Vec::new();
    for o in a.offload.options() {
        if forecast.is_some() {
            for p in &a.prefetch {
                modes.push(sparda::cuda::check_identity::Mode {
                    offload: o,
                    prefetch: *p == OnOff::On,
                    copy_delay_us: 0,
                });
            }
            if a.copy_delay_us > 0 {
                modes.push(sparda::cuda::check_identity::Mode {
                    offload: o,
                    prefetch: true,
                    copy_delay_us: a.copy_delay_us,
                });
            }
        } else {
            modes.push(sparda::cuda::check_identity::Mode {
                offload: o,
                prefetch: false,
                copy_delay_us: 0,
            });
        }
    }
    if let Some(f) = &forecast {
        model.set_forecast(Some(f), false)?;
    }
    let (mut ok, mut v) =
        sparda::cuda::check_identity::offload_identity(&mut model, &prompts, a.new_tokens, &modes)?;
    v["forecast"] = serde_json::json!(a.forecast);
    if let (Some(f), true) = (&forecast, a.cpu_check_steps > 0) {
        let mut cpu = CpuModel::new(&ckpt_cpu(&a.model)?, opts)?;
        cpu.set_forecast(Some(f.clone()))?;
        let mut per_kv = serde_json::Map::new();
        for kv in [None, a.offload.options().first().copied()] {
            model.set_offload(kv)?;
            let (pass, j) = sparda::cuda::check_identity::forecast_selection(
                &mut model,
                &cpu,
                &prompt,
                a.cpu_check_steps,
            )?;
            ok &= pass;
            per_kv.insert(if kv.is_some() { "offload" } else { "gpu" }.into(), j);
        }
        model.set_offload(None)?;
        v["forecast_selection_vs_cpu"] = serde_json::Value::Object(per_kv);
    }
    let info = gpu.info();
    v["gpu"] = serde_json::json!(info.name);
    v["date_utc"] = serde_json::json!(sparda::cuda::check::utc_now_iso());
    v["commit"] = serde_json::json!(sparda::bench::git_commit());
    v["model"] = serde_json::json!(a.model);
    v["attention"] = serde_json::json!({
        "mode": format!("{:?}", model.plan.mode),
        "budget_blocks": model.plan.budget.attended,
        "block_size": model.plan.budget.block_size,
    });
    v["prompt_file"] = serde_json::json!(a.prompt_file);
    std::fs::write(&a.json, serde_json::to_string_pretty(&v).expect("json"))
        .map_err(|e| Error::io(&a.json, e))?;
    check_outcome("offload-check", "identity", ok, &a.json)
}

/// Prints a check's outcome; a failed check is an error naming its report.
fn check_outcome(cmd: &str, what: &str, ok: bool, json: &std::path::Path) -> Result<()> {
    eprintln!(
        "{cmd} {}; report in {}",
        if ok { "passed" } else { "FAILED" },
        json.display()
    );
    if ok {
        Ok(())
    } else {
        Err(Error::Cuda(format!(
            "some {what} cases failed; see {}",
            json.display()
        )))
    }
}

/// The SmolLM2 fixture's tokenizer.json (synthetic models use it): under
/// the working directory if there, else under the checkout this binary was
/// built from.
fn fixture_tokenizer() -> PathBuf {
    let rel = PathBuf::from(".fixtures/smollm2-135m-instruct/tokenizer.json");
    if rel.is_file() {
        rel
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
    }
}

fn cmd_synth(a: SynthArgs) -> Result<()> {
    let preset = sparda::synth::Preset::from_name(&a.preset)?;
    sparda::synth::write(preset, a.seed, &a.out, &a.tokenizer)?;
    eprintln!(
        "wrote {} ({} preset, seed {})",
        a.out.display(),
        a.preset,
        a.seed
    );
    if a.forecast {
        let path = a.out.join("forecast.safetensors");
        let tensors =
            sparda::model::forecast::ForecastWeights::synth_tensors(&preset.config(), a.seed);
        sparda::weights::write_safetensors(&path, &tensors)?;
        eprintln!("wrote {} (random forecast weights)", path.display());
    }
    Ok(())
}

/// Checks everything `generate` can check from its flags alone (flag
/// combinations, value ranges, output directories) for the resolved
/// `backend`; runs before any model is built or loaded.
fn check_generate_flags(a: &GenerateArgs, backend: Backend) -> Result<()> {
    a.offload.validate()?;
    if a.kv != KvArg::Offload && a.offload.given() {
        return Err(Error::Input(
            "--fetch, --prefetch-ctas and --offload-layer0 apply to offloaded KV: add --kv offload (CUDA backend)".into(),
        ));
    }
    if a.kv == KvArg::Offload && a.offload.fetch.len() != 1 {
        let given: Vec<String> = a
            .offload
            .fetch
            .iter()
            .filter_map(|f| f.to_possible_value().map(|v| v.get_name().to_string()))
            .collect();
        return Err(Error::Input(format!(
            "generate: give one --fetch engine (got --fetch {})",
            given.join(",")
        )));
    }
    if a.kv == KvArg::Offload && backend != Backend::Cuda {
        return Err(Error::Input(
            "--kv offload needs the CUDA backend (--backend cuda)".into(),
        ));
    }
    if a.prefetch == OnOff::Off && (a.kv != KvArg::Offload || a.forecast.is_none()) {
        return Err(Error::Input(
            "--prefetch off applies to forecast mode with offloaded KV (--forecast … --kv offload)"
                .into(),
        ));
    }
    if let (Some(spec), Some(AttentionArg::Dense)) = (&a.forecast, a.attention) {
        return Err(Error::Input(format!(
            "--forecast {spec} selects blocks for sparse attention, but --attention dense was given: drop one"
        )));
    }
    if let Some(spec) = a.forecast.as_deref() {
        let synth = spec == "synth" || spec.starts_with("synth:");
        if !synth && !std::path::Path::new(spec).exists() {
            return Err(Error::Input(format!(
                "--forecast {spec}: no such file or directory (give a .safetensors or .pt file, or synth[:SEED])"
            )));
        }
    }
    if a.prompt_tokens == Some(0) {
        return Err(Error::Input("--prompt-tokens must be ≥ 1".into()));
    }
    if let Some(t) = a.rope_theta {
        if !(t.is_finite() && t > 0.0) {
            return Err(Error::Input(format!(
                "--rope-theta must be a finite value > 0, got {t}"
            )));
        }
    }
    for p in [&a.json, &a.trace].into_iter().flatten() {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(d) = dir.filter(|d| !d.is_dir()) {
            return Err(Error::Input(format!(
                "{}: directory {} does not exist",
                p.display(),
                d.display()
            )));
        }
    }
    Ok(())
}

/// The config of `generate --model` (a checkpoint's config.json, or a
/// `synth:` preset's) with the --rope-theta and --max-position overrides,
/// read without loading or building any weights.
fn generate_config(a: &GenerateArgs) -> Result<sparda::config::ModelConfig> {
    let name = a.model.to_string_lossy();
    let mut config = match name.strip_prefix("synth:") {
        Some(spec) => sparda::synth::parse_spec(spec)?.0.config(),
        None => sparda::config::ModelConfig::from_file(&a.model)?,
    };
    if let Some(t) = a.rope_theta {
        config = config.with_rope_theta(t);
    }
    if let Some(m) = a.max_position {
        config = config.with_max_position(m);
    }
    Ok(config)
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let backend = match a.backend {
        Backend::Auto if sparda::cuda::is_available() => Backend::Cuda,
        Backend::Auto => Backend::Cpu,
        b => b,
    };
    // Everything below up to the model build reads only flags and small
    // files, so a bad invocation fails in well under a second, before
    // e.g. synth:nosa-8b spends minutes and ~17 GB on its weights; flag
    // errors come before a missing CUDA library is reported.
    check_generate_flags(&a, backend)?;
    if backend == Backend::Cuda {
        sparda::cuda::require()?;
    }
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(t), None) => t.clone(),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map_err(|e| Error::Input(format!("--prompt-file {}: {e}", p.display())))?,
        _ => {
            return Err(Error::Input(
                "give --prompt TEXT or --prompt-file FILE".into(),
            ))
        }
    };
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling.validate()?;
    let config = generate_config(&a)?;
    let model_name = a.model.to_string_lossy().into_owned();
    let synth = model_name.starts_with("synth:");
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| {
        if synth {
            fixture_tokenizer()
        } else {
            a.model.join("tokenizer.json")
        }
    });
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| match e {
        Error::Io { path, source } if a.tokenizer.is_some() => {
            Error::Input(format!("--tokenizer {}: {source}", path.display()))
        }
        Error::Io { path, source } => Error::Input(format!(
            "{}: {source} (give the tokenizer with --tokenizer FILE; scripts/fixture.sh builds the default one)",
            path.display()
        )),
        other => other,
    })?;
    let mut prompt = tokenizer.encode(&text)?;
    if let Some(n) = a.prompt_tokens {
        prompt.truncate(n);
    }
    generate::check_length(
        prompt.len(),
        a.max_new_tokens,
        config.max_position_embeddings,
    )?;
    let forecast = a
        .forecast
        .as_deref()
        .map(|spec| sparda::model::forecast::ForecastWeights::from_arg(spec, &config))
        .transpose()?;
    if synth {
        eprintln!("building {model_name} in memory…");
    }
    let mut ckpt = sparda::bench::open_model(&model_name)?;
    if let Some(t) = a.rope_theta {
        ckpt.config = ckpt.config.with_rope_theta(t);
    }
    if let Some(m) = a.max_position {
        ckpt.config = ckpt.config.with_max_position(m);
    }
    let opts = EngineOptions {
        attention: AttentionOverrides {
            sparse: a.attention.map(|x| matches!(x, AttentionArg::Sparse)),
            selection: a.selection.map(|s| match s {
                SelectionArg::Nosa => SelectionRule::Nosa,
                SelectionArg::Infllmv2 => SelectionRule::InfLlmV2,
            }),
            budget_blocks: a.budget_blocks,
            select_blocks: a.select_blocks,
        },
        prefill: match a.prefill {
            Some(PrefillArg::Dense) => PrefillMode::Dense,
            _ => PrefillMode::Auto,
        },
    };
    enum Engine {
        Cpu(Box<CpuModel>),
        Cuda(Box<GpuModel>),
    }
    let engine = if backend == Backend::Cuda {
        let gpu = std::sync::Arc::new(sparda::cuda::Gpu::new(0)?);
        let t = std::time::Instant::now();
        let mut m = GpuModel::new(gpu, &ckpt, opts)?;
        if a.kv == KvArg::Offload {
            // check_generate_flags made sure there is exactly one engine.
            m.set_offload(a.offload.options().first().copied())?;
        }
        if let Some(f) = &forecast {
            m.set_forecast(Some(f), a.prefetch == OnOff::On)?;
        }
        m.set_trace(a.trace.is_some())?;
        eprintln!(
            "weights on {} in {:.1} s",
            m.gpu().info().name,
            t.elapsed().as_secs_f64()
        );
        Engine::Cuda(Box::new(m))
    } else {
        let mut m = CpuModel::new(&ckpt, opts)?;
        if let Some(f) = &forecast {
            if m.plan.rule().is_none() {
                return Err(Error::Input(
                    "--forecast selects blocks for sparse attention, but this model runs dense: add --attention sparse (or --selection)".into(),
                ));
            }
            m.set_forecast(Some(f.clone()))?;
        }
        Engine::Cpu(Box::new(m))
    };
    let (plan, backend_name) = match &engine {
        Engine::Cpu(m) => (m.plan, "cpu".to_string()),
        Engine::Cuda(m) => (m.plan, format!("cuda (selection {:?})", m.selection_path())),
    };
    let mode = plan.mode;
    let plan_json = serde_json::json!({
        "mode": format!("{:?}", plan.mode),
        "budget_blocks": plan.budget.attended,
        "shortlist_blocks": plan.budget.shortlist,
        "dense_len": plan.sparse.dense_len,
        "forecast": forecast.is_some(),
        "backend": backend_name,
        "kv": match (backend, a.kv) {
            (Backend::Cpu, _) => "host (CPU reference)".to_string(),
            (_, KvArg::Gpu) => "gpu".to_string(),
            (_, KvArg::Offload) => format!("offload ({:?})", a.offload.options()),
        },
    });
    eprintln!(
        "model {} ({} layers, d {}), attention {:?}, backend {backend_name}, prompt {} tokens",
        a.model.display(),
        ckpt.config.num_hidden_layers,
        ckpt.config.hidden_size,
        mode,
        prompt.len()
    );
    let req = Request {
        prompt,
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_ids: if a.ignore_eos {
            Vec::new()
        } else {
            ckpt.config.eos_token_ids.clone()
        },
    };
    let bar = ProgressBar::new(req.prompt.len() as u64).with_style(
        ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens {per_sec} eta {eta}")
            .expect("static template"),
    );
    let mut stream = TextStream::new(&tokenizer);
    let mut stdout = std::io::stdout().lock();
    let progress = |done: usize, _| bar.set_position(done as u64);
    let on_token = |tok| {
        if !bar.is_finished() {
            bar.finish_and_clear();
        }
        let piece = stream.push(tok)?;
        stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
            .map_err(|e| Error::io("<stdout>", e))
    };
    let out = match engine {
        Engine::Cpu(model) => generate::generate_cpu(&model, &req, progress, on_token)?.0,
        Engine::Cuda(mut model) => {
            let out = generate::generate_gpu(&mut model, &req, progress, on_token)?;
            model.flush_trace()?;
            out
        }
    };
    writeln!(stdout).ok();
    eprintln!(
        "prefill {} tokens in {:.0} ms ({:.1} tokens/s); {} tokens generated, {} decode steps in {:.0} ms ({:.2} tokens/s); stop: {:?}",
        req.prompt.len(),
        out.prefill_ms,
        req.prompt.len() as f64 / (out.prefill_ms / 1e3),
        out.tokens.len(),
        out.tokens.len().saturating_sub(1),
        out.decode_ms,
        out.decode_tokens_per_s(),
        out.stop
    );
    if let Some(p) = a.json {
        let v = serde_json::json!({
            "model": a.model, "attention": plan_json, "prompt_tokens": req.prompt, "tokens": out.tokens, "stop": out.stop,
            "prefill_ms": out.prefill_ms, "decode_ms": out.decode_ms, "decode_tokens_per_s": out.decode_tokens_per_s(),
        });
        std::fs::write(&p, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}
