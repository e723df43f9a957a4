//! `sparda`: the command-line interface (runtime.md §6 vocabulary): the
//! flags of every subcommand; their bodies are in `commands/`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use sparda::{Error, Result};
use std::path::PathBuf;

mod commands;
use commands::{
    bench::cmd_bench, check_outcome, fixture_tokenizer, generate::cmd_generate,
    offload_check::cmd_offload_check, perplexity::cmd_perplexity, synth::cmd_synth,
};

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
    /// Ctrl-C stops before the next decode step: the trace is finished, no
    /// --json report is written, exit code 130 (a second Ctrl-C exits at once).
    #[command(mut_arg("fetch", |a| a.help(GENERATE_FETCH_HELP).num_args(1)))]
    Generate(GenerateArgs),
    /// Perplexity of a text under teacher forcing, scored the way the mode
    /// decodes: chunks of --context tokens, the last --score tokens of each
    /// scored one decode step at a time; with --kl-base, KL divergence, top-1
    /// agreement and Δ perplexity against a base run saved by --save-logits.
    /// Ctrl-C stops before the next decode step: no --json or --save-logits
    /// file is written, exit code 130 (a second Ctrl-C exits at once).
    #[command(mut_arg("fetch", |a| a.help(GENERATE_FETCH_HELP).num_args(1)))]
    Perplexity(PerplexityArgs),
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
    /// loaded once) and writes a JSON report; prints a table. Ctrl-C stops
    /// before the next cell: the trace is finished, no report is written
    /// (each finished cell is printed on stderr), exit code 130.
    Bench(BenchArgs),
    /// The benchmark report (runtime.md §5): merges `sparda bench --resume`
    /// cell directories, single-file `sparda bench --json` reports and
    /// baseline JSONs (benches/baselines/) into PREFIX.json (every figure,
    /// GPU, driver, commits, dates), PREFIX.md (the table: tokens/s, step
    /// p50/p99, γ, PCIe GB/s, GPU and host memory, roofline; for each row
    /// above 1.2× its roofline, where its time goes: GEMMs, fetch, rest) and
    /// PREFIX.svg (tokens/s against context per mode). CPU only.
    Report(ReportArgs),
    /// Measure this GPU's fetch table for offloaded KV: the real decode loop
    /// on synthetic NOSA-8B with the SM copy kernel at each CTA count and
    /// the copy engines, synchronous fetch and forecast prefetch, per batch
    /// size; writes tuning/fetch_<gpu>.json, which `--fetch auto` then uses
    /// (runtime.md §4). `--show` prints the table in use.
    TuneCtas(TuneCtasArgs),
    /// Check the GPU engine end to end against the CPU reference under teacher
    /// forcing, judged by KL divergence and top-1 agreement against what bf16
    /// arithmetic itself costs (the CPU reference with bf16 rounding), with
    /// block selections compared: the tiny synthetic model (dense, NOSA,
    /// InfLLM-V2), plus real text through a checkpoint (e.g. the SmolLM2
    /// fixture) when --model is given. Exit 1 if a case fails.
    GpuCheckE2e {
        /// A dense checkpoint with a tokenizer.json to check too (e.g.
        /// .fixtures/smollm2-135m-instruct).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The real text the --model cases read (≥ 13,760 tokens).
        #[arg(long, default_value = "data/texts/hamlet.txt")]
        text: PathBuf,
        /// Report path.
        #[arg(long, default_value = "gpu_check_e2e.json")]
        json: PathBuf,
        /// Teacher-forced decode steps per case.
        #[arg(long, default_value_t = sparda::checks::e2e::DEFAULT_STEPS)]
        steps: usize,
    },
    /// Chrome/Perfetto trace tools.
    #[command(subcommand)]
    Trace(TraceCmd),
    /// Offloaded decode against GPU-resident sparse decode, bit for bit
    /// (greedy tokens and logits bits at every step): one resident
    /// run, then one offloaded run per --fetch engine. Exit 1 if any differs.
    OffloadCheck(OffloadCheckArgs),
    /// Forecast weights from the model's own activations (spec §4 "Forecast
    /// mode"): collect activations (CPU reference or GPU engine), fit the projections
    /// by ridge regression, evaluate their block recall, or import a SparDA
    /// checkpoint (forecast/README.md).
    #[command(subcommand)]
    Forecast(ForecastCmd),
}

#[derive(Subcommand)]
enum ForecastCmd {
    /// Run the model over real text (the CPU reference, or the GPU engine
    /// with --backend cuda: prefill, then teacher-forced decode steps) and stream, at sampled positions, each
    /// layer's normalized attention input x̂ and its targets (group-mean
    /// pre-RoPE query; window-score fit) to a record file (format in
    /// forecast/src/records.rs). Ctrl-C stops between positions and removes the unfinished file (exit code 130).
    Collect(ForecastCollectArgs),
    /// Ridge regression per layer from record files (f64 Gram matrices, λ
    /// chosen on held-out records): q_future_proj of every layer l (x̂_l →
    /// layer l+1's target) and layer 0's q_curr_proj, written as
    /// .safetensors that --forecast loads.
    Fit(ForecastFitArgs),
    /// Recall, per layer, of each forecast's chosen blocks against the blocks
    /// the real query-aware selection chooses at the same budget (free blocks
    /// only: sink and window blocks excluded), beside reusing the previous
    /// step's selection and random choice; teacher-forced decode on the CPU.
    Eval(ForecastEvalArgs),
    /// Convert a SparDA trainer checkpoint (.pt/.pth) to .safetensors with
    /// canonical tensor names.
    Import(ForecastImportArgs),
}

/// The model flags of `sparda forecast collect|eval`.
/// The selection flags every command that runs sparse attention takes
/// (spec §1 sparse_config overrides).
#[derive(Args, Clone, Copy)]
struct SelectionArgs {
    /// Selection rule for sparse attention (a dense checkpoint gets a default sparse_config).
    #[arg(long, value_enum)]
    selection: Option<SelectionArg>,
    /// Attended blocks S per (sequence, KV head) (sets topk = S − window blocks).
    #[arg(long, allow_negative_numbers = true)]
    budget_blocks: Option<usize>,
    /// Query-aware shortlist parameter select_blocks.
    #[arg(long, allow_negative_numbers = true)]
    select_blocks: Option<usize>,
}

impl SelectionArgs {
    /// The engine's attention overrides with these flags; `sparse` forces
    /// sparse (true) or dense (false) attention, None keeps the checkpoint's.
    fn overrides(&self, sparse: Option<bool>) -> sparda::model::AttentionOverrides {
        sparda::model::AttentionOverrides {
            sparse,
            selection: self.selection.map(Into::into),
            budget_blocks: self.budget_blocks,
            select_blocks: self.select_blocks,
        }
    }
}

#[derive(Args)]
struct ForecastModelArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json) or `synth:PRESET[:SEED]`.
    #[arg(long)]
    model: PathBuf,
    /// tokenizer.json (default: the model directory's; the fixture's for synth:).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    sel: SelectionArgs,
}

#[derive(Args)]
struct ForecastCollectArgs {
    #[command(flatten)]
    model: ForecastModelArgs,
    /// Text files (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', num_args = 1.., required = true)]
    text: Vec<PathBuf>,
    /// Tokens per chunk (each chunk a fresh sequence).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Chunks per text.
    #[arg(long, default_value_t = 1)]
    max_chunks: usize,
    /// Record every STRIDE-th prefill position from --min-position.
    #[arg(long, default_value_t = 8)]
    stride: usize,
    /// First prefill position recorded (default: budget blocks × block size,
    /// where selection starts to drop blocks).
    #[arg(long)]
    min_position: Option<usize>,
    /// Teacher-forced decode steps at the end of each chunk, every one recorded.
    #[arg(long, default_value_t = 16)]
    decode: usize,
    /// Record file to write.
    #[arg(long)]
    out: PathBuf,
    /// Engine: cpu (the CPU reference, f32 activations; the default), cuda
    /// (the GPU engine, bf16 activations read back at the sampled positions)
    /// or auto (cuda when available).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
}

#[derive(Args)]
struct ForecastFitArgs {
    /// Record files from `forecast collect` (one model).
    #[arg(long, value_delimiter = ',', num_args = 1.., required = true)]
    data: Vec<PathBuf>,
    /// Target: `qmean` (group-mean pre-RoPE query; the better recall on
    /// SmolLM2) or `score` (least-squares fit of the real window scores);
    /// forecast/README.md compares them.
    #[arg(long, default_value = "qmean")]
    target: String,
    /// Every N-th record of each file is held out to choose λ (0: none, λ = 1e-3 · mean eigenvalue).
    #[arg(long, default_value_t = 5)]
    held_out_every: usize,
    /// Forecast weights to write (.safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Per-layer fit report (λ, held-out error).
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct ForecastEvalArgs {
    #[command(flatten)]
    model: ForecastModelArgs,
    /// Held-out text files (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', num_args = 1.., required = true)]
    text: Vec<PathBuf>,
    /// Tokens per chunk; the last --positions of each are decoded and scored.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Decode steps scored per chunk.
    #[arg(long, default_value_t = 64)]
    positions: usize,
    /// Chunks per text.
    #[arg(long, default_value_t = 1)]
    max_chunks: usize,
    /// Forecast weights to evaluate, `[LABEL=]FILE` or `synth[:SEED]` (repeatable).
    #[arg(long)]
    forecast: Vec<String>,
    /// A SparDA trainer checkpoint (.pt) to evaluate as the `sparda` column.
    #[arg(long)]
    sparda: Option<PathBuf>,
    /// Report path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct ForecastImportArgs {
    /// SparDA trainer checkpoint (.pt / .pth).
    file: PathBuf,
    /// .safetensors to write.
    #[arg(long)]
    out: PathBuf,
    /// Model directory (or `synth:PRESET`) whose config the written weights are checked against.
    #[arg(long)]
    model: Option<PathBuf>,
}

#[derive(Args)]
struct ReportArgs {
    /// Inputs: cell directories of `sparda bench --resume`, bench reports,
    /// baseline JSONs (files or directories of them).
    #[arg(required = true, num_args = 1..)]
    inputs: Vec<PathBuf>,
    /// Output prefix: writes PREFIX.json, PREFIX.md and PREFIX.svg.
    #[arg(long)]
    out: PathBuf,
    /// Also put the markdown between the `<!-- BEGIN sparda report -->` and
    /// `<!-- END sparda report -->` lines of this file (e.g. README.md).
    #[arg(long, value_name = "FILE")]
    readme: Option<PathBuf>,
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
    #[command(flatten)]
    sel: SelectionArgs,
    /// Override the model's sparse_config.dense_len (tokens; spec §1: a
    /// sequence shorter than this attends densely). With --batch, sequences
    /// on both sides of it make steps that mix dense and sparse rows.
    #[arg(long)]
    dense_len: Option<usize>,
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
    /// CPU reference's over this many teacher-forced steps of the whole
    /// batch, GPU-resident and offloaded (0: skip; CPU time grows with the
    /// model).
    #[arg(long, default_value_t = 0)]
    cpu_check_steps: usize,
    /// Stress: also run prefetch with this many µs of injected delay before
    /// every fetch on the copy stream (0: no stress run).
    #[arg(long, default_value_t = 0)]
    copy_delay_us: u32,
    /// Sample GPU memory in use and the process's resident memory every N
    /// decode steps of each run (long runs: GPU memory must stay flat); the
    /// report also spells out every sequence's token at steps 2,000, 8,000
    /// and 20,000 where the run reaches them, and at its last step.
    #[arg(long, default_value_t = 1000)]
    sample_memory_every: usize,
    /// Run only the GPU-resident reference and record it (tokens, logit
    /// hashes, memory samples) in this JSON file, for a later
    /// `--resident FILE` run (a long check split in two processes).
    #[arg(long, conflicts_with = "resident")]
    save_resident: Option<PathBuf>,
    /// Compare the offloaded runs with a resident run recorded by
    /// `--save-resident` instead of running it again (refused when its
    /// binary, GPU, model, prompts or settings differ).
    #[arg(long)]
    resident: Option<PathBuf>,
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

impl From<SelectionArg> for sparda::model::SelectionRule {
    fn from(s: SelectionArg) -> Self {
        match s {
            SelectionArg::Nosa => sparda::model::SelectionRule::Nosa,
            SelectionArg::Infllmv2 => sparda::model::SelectionRule::InfLlmV2,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PrefillArg {
    /// Dense prefill, sparse decode (NOSA_F).
    Dense,
    /// As the attention mode says.
    Sparse,
}

/// `--prefill-attention`: the kernel of prefill rows, dense and sparse (CUDA
/// backend; default: tensor-core where the head dim has a kernel, else rowwise).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PrefillAttentionArg {
    /// The decode attention kernel per query row, split-K (any head dim).
    Rowwise,
    /// Tiles of rows against tiles of keys on the tensor cores (head dim 64, 80 or 128);
    /// sparse prefill over each tile's union of selected blocks.
    TensorCore,
}

impl From<PrefillAttentionArg> for sparda::pipeline::PrefillAttention {
    fn from(a: PrefillAttentionArg) -> Self {
        match a {
            PrefillAttentionArg::Rowwise => sparda::pipeline::PrefillAttention::Rowwise,
            PrefillAttentionArg::TensorCore => sparda::pipeline::PrefillAttention::TensorCore,
        }
    }
}

/// The model and the mode it runs in: the flags `generate` and
/// `perplexity` share (runtime.md §6).
#[derive(Args)]
struct ModeArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or
    /// `synth:PRESET[:SEED]` for a random-weight model built in memory
    /// (tiny, nosa-1b, nosa-3b, nosa-8b; nosa-8b needs ~17 GB of RAM).
    #[arg(long)]
    model: PathBuf,
    /// tokenizer.json (default: the model directory's; for `synth:` models the
    /// SmolLM2 fixture's, as `sparda synth` uses).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Force dense or sparse attention (default: as the checkpoint says).
    #[arg(long, value_enum)]
    attention: Option<AttentionArg>,
    #[command(flatten)]
    sel: SelectionArgs,
    /// Prefill mode: dense (dense prefill, sparse decode: NOSA_F) or sparse
    /// (as the attention mode says; the default). The kernel is
    /// --prefill-attention.
    #[arg(long, value_enum)]
    prefill: Option<PrefillArg>,
    /// Kernel of prefill rows, dense and sparse (CUDA backend): tensor-core
    /// (tiled; head dim 64, 80 or 128, the default there) or rowwise (split-K,
    /// any head dim; the default for other head dims).
    #[arg(long, value_enum)]
    prefill_attention: Option<PrefillAttentionArg>,
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
    /// Where the KV lives (CUDA backend): all on the GPU, or offloaded to
    /// pinned host memory with the selected blocks fetched each step.
    #[arg(long, value_enum, default_value_t = KvArg::Gpu)]
    kv: KvArg,
    #[command(flatten)]
    offload: OffloadArgs,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    mode: ModeArgs,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// File whose text is the prompt (`-`: standard input).
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
    /// Do not stop at EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Write a Chrome/Perfetto trace of the run here: host spans plus GPU
    /// spans per layer and step on one track per stream (decode then runs
    /// without CUDA graphs).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write the run's tokens, text, sampling settings and timings as JSON here
    /// (not written when Ctrl-C interrupts the run).
    #[arg(long)]
    json: Option<PathBuf>,
    /// More token ids that end generation, besides the model's EOS ids
    /// (comma-separated; as vLLM's stop_token_ids). Stop tokens are not
    /// printed; the JSON keeps their ids.
    #[arg(long, value_delimiter = ',')]
    stop_id: Vec<u32>,
    /// With --json: each generated token's log-probability (`logprob`) and
    /// its K most likely alternatives (`top_logprobs`), under the model's
    /// own distribution (log-softmax of the logits, before temperature and
    /// top-k/top-p), as the OpenAI and vLLM APIs report them.
    #[arg(long, value_name = "K")]
    logprobs: Option<usize>,
}

#[derive(Args)]
struct PerplexityArgs {
    #[command(flatten)]
    mode: ModeArgs,
    /// Text file to score.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per chunk: the text is cut into consecutive chunks, each a
    /// fresh sequence.
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true)]
    context: usize,
    /// Tokens scored at the end of each chunk by teacher-forced decode
    /// steps (default: context/2); the ones before them are prefilled.
    #[arg(long, allow_negative_numbers = true)]
    score: Option<usize>,
    /// Score at most K chunks (default: every whole chunk of the text).
    #[arg(long, allow_negative_numbers = true)]
    max_chunks: Option<usize>,
    /// Save every scored position's top-K log-probabilities, the mass
    /// outside them and the token that followed here (binary; the format
    /// is documented in src/quality/logits_file.rs), as a base for --kl-base
    /// (not written when Ctrl-C interrupts the run).
    #[arg(long)]
    save_logits: Option<PathBuf>,
    /// K of --save-logits.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    top_k_save: usize,
    /// Compare with a base run saved by --save-logits (same model, text,
    /// tokenizer, context and score): KL(base ‖ this) over the base's top-K
    /// plus the rest, top-1 agreement, Δ perplexity.
    #[arg(long)]
    kl_base: Option<PathBuf>,
    /// Write the report as JSON here (not written when Ctrl-C interrupts the run).
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
    /// Full KV in pinned host memory, selected blocks fetched.
    Offload,
}

/// One `--fetch` value (runtime.md §4): `auto`, `sm`, `sm:N`, `dma` or
/// `split:N:P` ([`sparda::pipeline::FetchEngine::parse`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum FetchArg {
    /// Per batch size and schedule from the GPU's fetch table (`sparda
    /// tune-ctas`; built in for the H200), else SparDA's rule (SM kernel, 16 or 32 CTAs).
    Auto,
    /// Persistent UVA copy kernel on N CTAs (`sm:N`), or on --prefetch-ctas
    /// (default 16) CTAs (`sm`).
    Sm(Option<usize>),
    /// The copy engines (cuMemcpyBatchAsync).
    Dma,
    /// Each layer's misses split: P % through the copy engines, the rest
    /// through the SM kernel on N CTAs, at once (`split:N:P`).
    Split {
        /// N.
        ctas: usize,
        /// P.
        ce_pct: usize,
    },
}

impl FetchArg {
    /// The value as given (`sm` stays `sm`).
    fn label(self) -> String {
        match self {
            FetchArg::Auto => "auto".into(),
            FetchArg::Sm(None) => "sm".into(),
            FetchArg::Sm(Some(n)) => format!("sm:{n}"),
            FetchArg::Dma => "dma".into(),
            FetchArg::Split { ctas, ce_pct } => format!("split:{ctas}:{ce_pct}"),
        }
    }
}

/// clap's parser of a `--fetch` value; the error names the value, the
/// accepted forms and their ranges.
fn parse_fetch_arg(value: &str) -> std::result::Result<FetchArg, String> {
    use sparda::pipeline::FetchEngine;
    if value == "sm" {
        return Ok(FetchArg::Sm(None));
    }
    match FetchEngine::parse(value).map_err(|e| e.to_string())? {
        FetchEngine::Auto => Ok(FetchArg::Auto),
        FetchEngine::Sm { ctas } => Ok(FetchArg::Sm(Some(ctas))),
        FetchEngine::Dma => Ok(FetchArg::Dma),
        FetchEngine::Split { ctas, ce_pct } => Ok(FetchArg::Split { ctas, ce_pct }),
    }
}

/// `generate --help`'s and `perplexity --help`'s text for `--fetch` (they
/// run one engine; the shared [`OffloadArgs`] text describes bench's and
/// offload-check's list).
const GENERATE_FETCH_HELP: &str =
    "Fetch engine of offloaded KV (with --kv offload; give one engine): auto (the GPU's fetch table), sm[:N] (the SM copy kernel on N CTAs), dma (the copy engines) or split:N:P (P % of each layer's misses on the copy engines, the rest on the SM kernel at N CTAs)";

/// Offload flags shared by generate, perplexity, bench and offload-check (runtime.md §6).
#[derive(Args, Clone)]
struct OffloadArgs {
    /// Fetch engines of offloaded KV, each run in turn (comma-separated or
    /// repeated; generate and perplexity take one): auto (the GPU's fetch
    /// table, else SparDA's rule), sm (SM copy kernel, --prefetch-ctas or 16
    /// CTAs), sm:N (N CTAs), dma (copy engines), split:N:P (P = 1…99 % of
    /// each layer's misses through the copy engines, the rest through the SM
    /// kernel on N = 1…1024 CTAs, at once).
    #[arg(long, value_parser = parse_fetch_arg, value_delimiter = ',', num_args = 1.., default_value = "auto")]
    fetch: Vec<FetchArg>,
    /// CTAs of the SM fetch kernel (default: from the fetch table with --fetch auto, 16 with --fetch sm; sm:N and split:N:P give their own).
    #[arg(long, allow_negative_numbers = true)]
    prefetch_ctas: Option<usize>,
    /// Offload layer 0 too (default: it stays on the GPU, for every mode compared).
    #[arg(long)]
    offload_layer0: bool,
    /// SM copy kernel: each copy CTA holds a whole SM (it asks for all of a
    /// block's shared memory), so that compute blocks run only on the other
    /// SMs; applies while the copy takes at most half the SMs. Same copies;
    /// under forecast prefetch it keeps the attention CTAs off the copy SMs
    /// (traces/README.md).
    #[arg(long)]
    fetch_whole_sms: bool,
    /// Forecast prefetch through the SM copy kernel: size cuBLAS's GEMMs for
    /// the SMs its CTAs leave (cublasSetSmCountTarget), instead of all of them.
    /// Other GEMM kernels: the logits then differ from GPU-resident decode in
    /// their last bits (the default keeps them bitwise equal).
    #[arg(long)]
    reserve_fetch_sms: bool,
    /// GPU cache slots per (sequence, offloaded layer, KV head) beyond the
    /// attended budget: blocks that leave the selection stay on the GPU, the
    /// least recently selected replaced first, so a block selected again is
    /// a hit instead of a PCIe fetch. Each slot costs 2·block·head_dim·2 bytes
    /// per (sequence, layer, KV head), 32 KiB on NOSA-8B (0: the pool holds the budget only).
    /// bench and offload-check take a list (every fetch engine runs with each).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "0")]
    cache_slots: Vec<usize>,
}

impl OffloadArgs {
    /// Whether any offload flag differs from its default.
    fn given(&self) -> bool {
        self.fetch != [FetchArg::Auto]
            || self.prefetch_ctas.is_some()
            || self.offload_layer0
            || self.fetch_whole_sms
            || self.reserve_fetch_sms
            || self.cache_slots != [0]
    }

    /// Where the SM copy kernel's CTAs run ([`sparda::pipeline::GpuModel::set_fetch_whole_sms`],
    /// [`sparda::pipeline::GpuModel::set_reserve_fetch_sms`]).
    fn apply_sm_residency(&self, m: &mut sparda::pipeline::GpuModel) {
        m.set_fetch_whole_sms(self.fetch_whole_sms);
        m.set_reserve_fetch_sms(self.reserve_fetch_sms);
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

    fn options(&self) -> Vec<sparda::pipeline::OffloadOptions> {
        use sparda::pipeline::{FetchEngine, OffloadOptions};
        self.cache_slots
            .iter()
            .flat_map(|&cache_slots| self.fetch.iter().map(move |f| (f, cache_slots)))
            .map(|(f, cache_slots)| OffloadOptions {
                fetch: match (*f, self.prefetch_ctas) {
                    (FetchArg::Auto, None) => FetchEngine::Auto,
                    (FetchArg::Auto | FetchArg::Sm(None), Some(ctas)) => FetchEngine::Sm { ctas },
                    (FetchArg::Sm(None), None) => FetchEngine::Sm {
                        ctas: sparda::cuda::ops::offload::DEFAULT_FETCH_CTAS,
                    },
                    (FetchArg::Sm(Some(ctas)), _) => FetchEngine::Sm { ctas },
                    (FetchArg::Dma, _) => FetchEngine::Dma,
                    (FetchArg::Split { ctas, ce_pct }, _) => FetchEngine::Split { ctas, ce_pct },
                },
                offload_layer0: self.offload_layer0,
                cache_slots,
            })
            .collect()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TuneModeArg {
    /// The fetch inside the layer (NOSA/InfLLM-V2 selection).
    Sync,
    /// Forecast prefetch beside the previous layer's compute.
    Prefetch,
}

#[derive(Args)]
struct TuneCtasArgs {
    /// Print the table in use for this GPU (or --gpu) and where it came from; measure nothing.
    #[arg(long)]
    show: bool,
    /// With --show: the GPU name (as nvidia-smi prints it) instead of GPU 0's.
    #[arg(long, requires = "show")]
    gpu: Option<String>,
    /// Check a table's choices against a second, separate sweep (this file,
    /// written by `tune-ctas --out`): per (mode, context, B) the choice's
    /// step time there against that sweep's fastest, within 2 % or the
    /// measured spread; measures nothing, needs no GPU.
    #[arg(long, value_name = "SECOND_SWEEP", conflicts_with = "show")]
    compare: Option<PathBuf>,
    /// With --compare: the table whose choices are checked (default: the
    /// table `--fetch auto` uses for the second sweep's GPU: $SPARDA_FETCH_TABLE
    /// or the built-in one).
    #[arg(long, requires = "compare")]
    table: Option<PathBuf>,
    /// Model: a sparse checkpoint directory or `synth:PRESET[:SEED]`.
    #[arg(long, default_value = "synth:nosa-8b")]
    model: String,
    /// Batch sizes (default 1,4,8,16,32,64,128; --quick: 8,16,32).
    #[arg(long, value_delimiter = ',', num_args = 1.., allow_negative_numbers = true)]
    batch: Option<Vec<usize>>,
    /// Context lengths, tokens (K = 1024; default 32K,64K; --quick: 32K).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    context: Option<Vec<String>>,
    /// CTA counts of the SM kernel (default 2,4,6,8,12,16,24,32; --quick: 4,8,16,32).
    #[arg(long, value_delimiter = ',', num_args = 1.., allow_negative_numbers = true)]
    ctas: Option<Vec<usize>>,
    /// Leave the copy engines out of the sweep (the splits too: they use them).
    #[arg(long)]
    no_dma: bool,
    /// Copy-engine shares, %, of the split configurations measured at each
    /// (mode, B) at its fastest SM CTA count (default 25,50,75; --quick: 50).
    #[arg(long, value_delimiter = ',', num_args = 1.., allow_negative_numbers = true)]
    split_pct: Option<Vec<usize>>,
    /// Leave the split configurations out of the sweep.
    #[arg(long)]
    no_split: bool,
    /// CTA counts of the whole-SM configurations `sm-whole:N` (copy CTAs on
    /// whole SMs, GEMMs on every SM), measured in prefetch mode
    /// (default 2,4,8,12,16; --quick: 8).
    #[arg(long, value_delimiter = ',', num_args = 1.., allow_negative_numbers = true)]
    whole_ctas: Option<Vec<usize>>,
    /// Leave the whole-SM configurations out of the sweep.
    #[arg(long)]
    no_whole: bool,
    /// Schedules to measure.
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "sync,prefetch")]
    mode: Vec<TuneModeArg>,
    /// Rounds over every configuration (default 3; --quick: 2).
    #[arg(long)]
    repeats: Option<usize>,
    /// Timed decode steps per configuration and round (default 16; --quick: 12).
    #[arg(long)]
    steps: Option<usize>,
    /// Untimed steps after each switch (≥ 2: build, capture).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// A smaller sweep (about two minutes on an H200).
    #[arg(long)]
    quick: bool,
    /// Where to write the table (default tuning/fetch_<gpu>.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Merge this sweep into the table already at --out (same GPU): the
    /// (mode, context, B) cells it has with every configuration asked for are
    /// skipped, the others measured and added after each cell, and the choices made over all of them (a grid spread over
    /// several runs; a run cut short resumes where it stopped).
    #[arg(long)]
    append: bool,
    /// With --append: measure again the (mode, context, B) cells asked for
    /// whose figures are round medians (tables swept before round means),
    /// replacing them; called again after a cut, it resumes.
    #[arg(long, requires = "append")]
    remeasure_medians: bool,
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
    #[command(flatten)]
    sel: SelectionArgs,
    /// Batch sizes B (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "1")]
    batch: Vec<usize>,
    /// Context lengths L: tokens per sequence before decoding (e.g. 4K,32K).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "4K")]
    context: Vec<String>,
    /// Timed decode steps per case (≥ 64 per runtime.md §5); 0 benchmarks
    /// the prefill alone (tokens/s and time to first token of each
    /// sequence; needs --prefill dense or sparse), as `llama-bench -n 0`.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Untimed warm-up decode steps per case (build, graph capture).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// How sequences are filled before decoding.
    #[arg(long, value_enum, default_value_t = BenchPrefillArg::Synthetic)]
    prefill: BenchPrefillArg,
    /// Kernel of the prefill rows of a real prefill (--prefill dense|sparse):
    /// tensor-core (the default for head dims 64, 80, 128) or rowwise.
    #[arg(long, value_enum)]
    prefill_attention: Option<PrefillAttentionArg>,
    /// tokenizer.json for prompts from the books in --texts (default: the
    /// checkpoint's, or the fixture's for synth: models; without one, random ids).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Directory of .txt books for prompts, one text per file; sequence b of a
    /// batch reads text b mod n at its own offset (default: ../shared/data/texts
    /// when it holds texts, else data/texts).
    #[arg(long)]
    texts: Option<PathBuf>,
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
    /// forecast mode with each --prefetch setting.
    #[arg(long)]
    forecast: Option<String>,
    /// Prefetch settings of the forecast runs.
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1.., default_value = "on,off")]
    prefetch: Vec<OnOff>,
    /// Offloaded KV: after each case's timed steps, one more eager step
    /// records every CTA of the attention and SM fetch kernels (start, end,
    /// SM) and the report says whether attention CTAs that share an SM with
    /// a copy CTA take longer (`cta_timeline`).
    #[arg(long)]
    cta_timeline: bool,
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
    /// Report path (not written when Ctrl-C interrupts the grid).
    #[arg(long)]
    json: Option<PathBuf>,
    /// With --equivalent-batch: write each cell to DIR/{mode}_L{context}_eb{EB}.json
    /// as it completes (atomically), and skip cells whose file exists with the
    /// same configuration (model, mode, context, EB, steps, warm-up, fill,
    /// forecast, fetch, seed, budget); merge them with `sparda report DIR`.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
}

#[derive(Args)]
struct SynthArgs {
    /// tiny | nosa-1b | nosa-3b | nosa-8b.
    #[arg(long)]
    preset: String,
    /// Output directory (refused when it exists and is not empty, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Write into a non-empty --out directory (files of the same names are replaced).
    #[arg(long)]
    force: bool,
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
    // Ctrl-C stops the long loops between units of work (sparda::interrupt);
    // the other commands keep the default (the process ends at once).
    if matches!(
        cli.cmd,
        Cmd::Generate(_)
            | Cmd::Perplexity(_)
            | Cmd::Bench(_)
            | Cmd::OffloadCheck(_)
            | Cmd::TuneCtas(_)
            | Cmd::Forecast(_)
    ) {
        if let Err(e) = sparda::interrupt::install() {
            eprintln!("warning: {e}; Ctrl-C will end the run without finishing its trace");
        }
    }
    let r = match cli.cmd {
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Perplexity(a) => cmd_perplexity(a),
        Cmd::Synth(a) => cmd_synth(a),
        Cmd::GpuCheckE2e {
            model,
            text,
            json,
            steps,
        } => sparda::checks::e2e::gpu_check_e2e(model.as_deref(), &text, &json, steps)
            .and_then(|ok| check_outcome("gpu-check-e2e", "end-to-end", ok, &json)),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::Report(a) => commands::report::cmd_report(a),
        Cmd::TuneCtas(a) => commands::tune_ctas::cmd_tune_ctas(a),
        Cmd::OffloadCheck(a) => cmd_offload_check(a),
        Cmd::Forecast(ForecastCmd::Collect(a)) => commands::forecast::cmd_collect(a),
        Cmd::Forecast(ForecastCmd::Fit(a)) => commands::forecast::cmd_fit(a),
        Cmd::Forecast(ForecastCmd::Eval(a)) => commands::forecast::cmd_eval(a),
        Cmd::Forecast(ForecastCmd::Import(a)) => commands::forecast::cmd_import(a),
        Cmd::Trace(TraceCmd::Summarize { file, json }) => {
            sparda::trace::summarize_file(&file).and_then(|s| {
                let text = if json {
                    serde_json::to_string_pretty(&s).expect("summary serializes") + "\n"
                } else {
                    s.to_text()
                };
                // a reader that closed the pipe (`| head`) ends the output quietly
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                    r => r.map_err(|e| Error::io("<stdout>", e)),
                }
            })
        }
        Cmd::GpuCheck { json } => sparda::checks::gpu_check(&json)
            .and_then(|ok| check_outcome("gpu-check", "kernel", ok, &json)),
    };
    // The trace records what ran, also when the run failed or was
    // interrupted: it is finished (merged, written, its temporary file
    // removed) either way.
    let traced = match session {
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
    };
    match (r, traced) {
        (Ok(()), Ok(())) => {}
        (Err(e @ Error::Interrupted(_)), t) => {
            if let Err(te) = t {
                eprintln!("error: {te}");
            }
            eprintln!("{e}");
            std::process::exit(sparda::interrupt::EXIT_CODE);
        }
        (Err(e), t) => {
            if let Err(te) = t {
                eprintln!("error: {te}");
            }
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        (Ok(()), Err(e)) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
