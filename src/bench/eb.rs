//! The equivalent-batch protocol (runtime.md §5): the modes compared, the
//! real batch of each at an equivalent batch size, the grid of cells and
//! their keys.

use super::*;

/// The modes compared under the equivalent-batch protocol (runtime.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EbMode {
    /// Full attention, all KV on the GPU.
    DenseGpu,
    /// NOSA sparse attention, all KV on the GPU.
    SparseGpu,
    /// NOSA offloaded, synchronous fetch.
    NosaOffload,
    /// InfLLM-V2-style selection (no eviction head), offloaded.
    InfllmOffload,
    /// SparDA forecast selection with prefetch, offloaded.
    ForecastPrefetch,
    /// Forecast selection, fetch inside the layer, offloaded.
    ForecastNoPrefetch,
}

impl EbMode {
    /// Every mode, in report order.
    pub const ALL: [EbMode; 6] = [
        EbMode::DenseGpu,
        EbMode::SparseGpu,
        EbMode::NosaOffload,
        EbMode::InfllmOffload,
        EbMode::ForecastPrefetch,
        EbMode::ForecastNoPrefetch,
    ];
    /// Name in reports.
    pub fn name(self) -> &'static str {
        match self {
            EbMode::DenseGpu => "dense, KV on GPU",
            EbMode::SparseGpu => "NOSA, KV on GPU",
            EbMode::NosaOffload => "NOSA offloaded (sync)",
            EbMode::InfllmOffload => "InfLLM-V2 offloaded (sync)",
            EbMode::ForecastPrefetch => "forecast + prefetch",
            EbMode::ForecastNoPrefetch => "forecast, no prefetch",
        }
    }
    /// File-name slug of the mode (cell files of `--resume`).
    pub fn slug(self) -> &'static str {
        match self {
            EbMode::DenseGpu => "dense-gpu",
            EbMode::SparseGpu => "nosa-gpu",
            EbMode::NosaOffload => "nosa-offload-sync",
            EbMode::InfllmOffload => "infllmv2-offload-sync",
            EbMode::ForecastPrefetch => "forecast-prefetch",
            EbMode::ForecastNoPrefetch => "forecast-no-prefetch",
        }
    }
    /// Whether the mode keeps only selected blocks on the GPU.
    pub fn offloaded(self) -> bool {
        !matches!(self, EbMode::DenseGpu | EbMode::SparseGpu)
    }
}

/// The report name of [`EbMode::SparseGpu`] on a checkpoint without
/// eviction heads, which selects by InfLLM-V2 there (spec §1).
pub const EB_INFLLM_GPU: &str = "InfLLM-V2, KV on GPU";

/// The real batch of `mode` at equivalent batch `eb` (runtime.md §5): the
/// GPU's KV memory is fixed at what `eb` offloaded sequences keep there,
/// `attended` blocks of `block_size` tokens each; an offloaded mode runs
/// `eb` sequences, a GPU-resident one as many whole `context`-token
/// sequences as that memory holds (at least 1). E.g. S = 64 blocks, L =
/// 16K: EB 128 → 128 offloaded, 32 resident.
pub fn equivalent_batch(
    mode: EbMode,
    eb: usize,
    attended: usize,
    block_size: usize,
    context: usize,
) -> usize {
    if mode.offloaded() {
        eb
    } else {
        (eb * attended * block_size / context.max(1)).max(1)
    }
}

/// The cells of an equivalent-batch grid in run order: per context (as
/// asked), per EB, every [`EbMode`] (the forecast modes only with
/// `--forecast`). Empty without `--equivalent-batch`.
pub fn eb_grid(spec: &BenchSpec) -> Vec<(usize, usize, EbMode)> {
    let mut out = Vec::new();
    for &l in &spec.contexts {
        for &eb in &spec.equivalent_batches {
            for mode in EbMode::ALL {
                let forecast_mode =
                    matches!(mode, EbMode::ForecastPrefetch | EbMode::ForecastNoPrefetch);
                if forecast_mode && spec.forecast.is_none() {
                    continue; // needs --forecast
                }
                out.push((l, eb, mode));
            }
        }
    }
    out
}

/// The [`crate::report::CellKey`] of one EB cell of `spec` (context as
/// asked), offloaded modes fetching with `off`.
pub fn cell_key(
    spec: &BenchSpec,
    off: &OffloadOptions,
    context: usize,
    eb: usize,
    mode: EbMode,
) -> crate::report::CellKey {
    crate::report::CellKey {
        model: spec.model.clone(),
        mode: mode.slug().to_string(),
        context,
        equivalent_batch: eb,
        steps: spec.steps,
        warmup: spec.warmup,
        prefill: match spec.prefill {
            BenchPrefill::Synthetic => "synthetic".to_string(),
            BenchPrefill::Real(m) => format!("real ({m:?})"),
        },
        forecast: spec.forecast.clone(),
        fetch: if mode.offloaded() {
            kv_name(&Some(*off))
        } else {
            "gpu".to_string()
        },
        seed: spec.seed,
        budget_blocks: spec.budget_blocks,
        select_blocks: spec.select_blocks,
    }
}

/// Name of a KV placement in reports: `gpu`, `offload-sm16`, `offload-dma`,
/// `offload-split8-50` (8 CTAs, 50 % through the copy engines), `offload-auto`;
/// with cache slots a `-cacheN` suffix (`offload-auto-cache32`).
pub fn kv_name(kv: &Option<OffloadOptions>) -> String {
    match kv {
        None => "gpu".into(),
        Some(o) => {
            let engine = match o.fetch {
                crate::pipeline::FetchEngine::Sm { ctas } => format!("offload-sm{ctas}"),
                crate::pipeline::FetchEngine::Dma => "offload-dma".into(),
                crate::pipeline::FetchEngine::Split { ctas, ce_pct } => {
                    format!("offload-split{ctas}-{ce_pct}")
                }
                crate::pipeline::FetchEngine::Auto => "offload-auto".into(),
            };
            if o.cache_slots > 0 {
                format!("{engine}-cache{}", o.cache_slots)
            } else {
                engine
            }
        }
    }
}
