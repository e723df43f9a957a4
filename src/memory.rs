//! The GPU and pinned host memory a GPU run needs, against what the machine
//! has, decided before anything is allocated (runtime.md §4 for the KV
//! footprint). One estimator for every command: `generate` and
//! `perplexity` refuse a run that does not fit, `offload-check` refuses its
//! resident and offloaded runs, and `bench` skips such a cell and records
//! why — all with the same numbers and the same messages.
//!
//! What a run needs ([`estimate`], bytes):
//! - GPU weights: bf16 parameters ([`weights_bytes`]), checked before the
//!   upload ([`check_weights`]); zero in later checks (already resident);
//! - GPU KV: B sequences' K, V (bf16), eviction scores c and, with GPU
//!   selection, Kc/p (f32) at the run's capacity ([`KvLayout`]); with
//!   offloaded KV instead the slot pools and tail rings of the offloaded
//!   layers ([`crate::kv::Footprint`]), every layer's small state, and one
//!   full sequence while it is filled;
//! - GPU workspace: the decode step's buffers (per-layer QKV rows, logits,
//!   activations, split-K partials) plus 256 MiB, and with a real prefill
//!   the prefill chunk's buffers plus its split-K partials budget;
//! - pinned host memory: the offloaded layers' full K/V
//!   ([`crate::kv::Footprint::host_pinned_bytes`]).
//!
//! What the machine has ([`Available`]): the GPU's free memory
//! (`cuMemGetInfo`) and `MemAvailable` of /proc/meminfo. A run fits when
//! GPU need + [`GPU_MARGIN_BYTES`] ≤ free and pinned need +
//! [`HOST_MARGIN_BYTES`] ≤ available ([`check`]).

use crate::config::ModelConfig;
use crate::kv::Footprint;
use crate::model::select::Budget;
use crate::{Error, Result};

/// Device memory kept free beyond the estimate (the CUDA context, cuBLAS
/// workspaces, allocator slack), bytes.
pub const GPU_MARGIN_BYTES: usize = 2 << 30;

/// Host memory kept free beyond the pinned KV (pinned pages cannot be
/// swapped; the process and the OS need the rest), bytes.
pub const HOST_MARGIN_BYTES: usize = 8 << 30;

/// Decode-step buffers beyond the per-row estimate (cuBLAS, pointer
/// tables, selection scratch), bytes.
const STEP_EXTRA_BYTES: usize = 256 << 20;

/// Bytes in a GiB, for messages.
const GIB: f64 = (1u64 << 30) as f64;

/// `bytes` in GiB with two decimals.
pub fn gib(bytes: usize) -> String {
    format!("{:.2}", bytes as f64 / GIB)
}

/// How an engine keeps one sequence's KV on the GPU: the inputs of
/// [`KvLayout::sequence_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Decoder layers L.
    pub layers: usize,
    /// KV heads Hkv.
    pub kv_heads: usize,
    /// Head dimension D.
    pub head_dim: usize,
    /// The attention budget (block size, compression windows).
    pub budget: Budget,
    /// NOSA eviction heads: an f32 score c per (token, KV head), and p per
    /// (window, KV head) with GPU selection.
    pub eviction: bool,
    /// Sparse attention selected on the GPU: Kc (f32, per window) kept.
    pub gpu_selection: bool,
}

impl KvLayout {
    /// Device bytes of one sequence with room for `capacity_tokens` tokens
    /// (rounded up to whole blocks), every layer: K and V in bf16
    /// (2·Hkv·D·2 per token), c in f32 (Hkv·4 per token) with eviction
    /// heads, and with GPU selection Kc (Hkv·D·4) and p (Hkv·4) per
    /// compressed window (spec §3).
    pub fn sequence_bytes(&self, capacity_tokens: usize) -> usize {
        let bs = self.budget.block_size.max(1);
        let cap = capacity_tokens.max(1).div_ceil(bs) * bs;
        let (hk, kvd) = (self.kv_heads, self.kv_heads * self.head_dim);
        let mut per = cap * kvd * 2 * 2;
        if self.eviction {
            per += cap * hk * 4;
        }
        if self.gpu_selection {
            let capw = self.budget.windows(cap).max(1);
            per += capw * kvd * 4;
            if self.eviction {
                per += capw * hk * 4;
            }
        }
        per * self.layers
    }
}

/// One run's shape, as far as memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Sequences decoded together, B.
    pub batch: usize,
    /// Tokens each sequence has room for (prompt + new tokens, or context
    /// + decode steps).
    pub capacity_tokens: usize,
    /// With offloaded KV: the layers kept resident on the GPU (layer 0
    /// unless `--offload-layer0`); `None`: all KV on the GPU.
    pub offload_resident_layers: Option<usize>,
    /// With offloaded KV: GPU cache slots per (sequence, offloaded layer,
    /// KV head) beside the attended budget (`--cache-slots`).
    pub cache_slots: usize,
    /// The run prefills for real (its chunk buffers exist beside the
    /// decode step's); false for synthetic fills.
    pub prefill: bool,
    /// Prompt tokens per prefill chunk at most (`pipeline::PREFILL_CHUNK`).
    pub prefill_chunk: usize,
    /// The prefill's split-K partials budget (`pipeline::PARTIALS_BUDGET_BYTES`).
    pub partials_budget_bytes: usize,
}

/// What a run needs, bytes (see the module doc for each part).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Need {
    /// Weights still to upload to the GPU (0 once resident).
    pub weights: usize,
    /// KV caches on the GPU.
    pub kv: usize,
    /// Step and prefill buffers on the GPU.
    pub workspace: usize,
    /// Pinned host memory (offloaded KV; 0 without offload).
    pub host_pinned: usize,
}

impl Need {
    /// GPU bytes in all: weights + KV + workspace (no margin).
    pub fn gpu(&self) -> usize {
        self.weights + self.kv + self.workspace
    }
}

/// What the machine has, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Available {
    /// Free device memory (`cuMemGetInfo`).
    pub gpu_free: usize,
    /// Total device memory.
    pub gpu_total: usize,
    /// `MemAvailable` of /proc/meminfo; `None` when not read (no pinned
    /// memory needed).
    pub host: Option<usize>,
}

/// Device bytes of the bf16 weights of a checkpoint of `cfg` (2 bytes per
/// parameter, [`crate::weights::parameter_count`]; the few f32 biases and
/// eviction heads are in the margin).
pub fn weights_bytes(cfg: &ModelConfig, eviction_heads: bool) -> usize {
    crate::weights::parameter_count(cfg, eviction_heads) as usize * 2
}

/// The GPU and pinned host bytes of `w` on a model of `cfg` whose
/// sequences are laid out as `kv` (see the module doc; weights 0: the
/// caller adds them while they are not resident).
pub fn estimate(cfg: &ModelConfig, kv: &KvLayout, w: &Workload) -> Need {
    let seq = kv.sequence_bytes(w.capacity_tokens);
    let (kv_bytes, host_pinned) = match w.offload_resident_layers {
        None => (w.batch * seq, 0),
        Some(resident) => {
            let f = Footprint::new(
                cfg,
                kv.budget.attended + w.cache_slots,
                resident,
                w.batch,
                w.capacity_tokens,
            );
            // every layer's small state (c, Kc, p) stays on the GPU; one full
            // sequence exists while it is filled, before it moves to the host
            let bs = kv.budget.block_size.max(1);
            let full_kv = w.capacity_tokens.max(1).div_ceil(bs)
                * bs
                * kv.kv_heads
                * kv.head_dim
                * 4
                * kv.layers;
            let small = seq.saturating_sub(full_kv);
            (f.gpu_kv_bytes + w.batch * small + seq, f.host_pinned_bytes)
        }
    };
    let (h, hk, dh) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (d, i, v, l) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.num_hidden_layers,
    );
    // the decode step: per-layer QKV rows, logits, activations, partials and scores
    let step = w.batch
        * (l * (h + 3 * hk) * dh * 2 + v * 4 + 8 * i + 4 * h * (w.capacity_tokens / 16 + 64))
        + STEP_EXTRA_BYTES;
    // a prefill chunk: residual (f32), normed and branch rows, QKV, attention,
    // gate|up and SwiGLU (bf16), logits (f32), plus its split-K partials
    let prefill = if w.prefill {
        w.prefill_chunk * (4 * d + 4 * d + 2 * (h + 2 * hk) * dh + 2 * h * dh + 6 * i + 4 * v)
            + w.partials_budget_bytes
    } else {
        0
    };
    Need {
        weights: 0,
        kv: kv_bytes,
        workspace: step + prefill,
        host_pinned,
    }
}

/// Decides whether `need` fits in `avail` (see the module doc for the
/// margins). `change` says what to change (e.g. "lower --batch or
/// --context") and ends each message.
///
/// Errors: [`Error::Limit`] naming the memory, the need split into its
/// parts, the margin and what is available, in GiB — the pinned host
/// memory first, then the GPU's.
pub fn check(need: &Need, avail: &Available, change: &str) -> Result<()> {
    if need.host_pinned > 0 {
        let host = avail.host.unwrap_or(0);
        if need.host_pinned.saturating_add(HOST_MARGIN_BYTES) > host {
            return Err(Error::Limit(format!(
                "offloaded KV needs {} GiB of pinned host memory + {} GiB margin; {} GiB available (MemAvailable in /proc/meminfo): {change}",
                gib(need.host_pinned),
                gib(HOST_MARGIN_BYTES),
                gib(host)
            )));
        }
    }
    if need.gpu().saturating_add(GPU_MARGIN_BYTES) > avail.gpu_free {
        let weights = if need.weights > 0 {
            format!("weights {} GiB + ", gib(need.weights))
        } else {
            String::new()
        };
        return Err(Error::Limit(format!(
            "needs {} GiB of GPU memory ({weights}KV {} GiB + workspace {} GiB) + {} GiB margin; {} GiB free of {} GiB: {change}",
            gib(need.gpu()),
            gib(need.kv),
            gib(need.workspace),
            gib(GPU_MARGIN_BYTES),
            gib(avail.gpu_free),
            gib(avail.gpu_total)
        )));
    }
    Ok(())
}

/// What `gpu` has now: its free and total memory, and `MemAvailable` when
/// `host` (a run that pins host memory).
///
/// Errors: [`Error::Cuda`] when `cuMemGetInfo` fails; [`Error::Io`] /
/// [`Error::Limit`] when /proc/meminfo cannot be read
/// ([`crate::kv::host_store::host_available_bytes`]).
pub fn available(gpu: &crate::cuda::Gpu, host: bool) -> Result<Available> {
    let (gpu_free, gpu_total) = gpu.mem_info()?;
    let host = if host {
        Some(crate::kv::host_store::host_available_bytes()?)
    } else {
        None
    };
    Ok(Available {
        gpu_free,
        gpu_total,
        host,
    })
}

/// Refuses, before the upload, a checkpoint of `cfg` whose bf16 weights do
/// not fit in `gpu`'s free memory (with [`GPU_MARGIN_BYTES`]).
///
/// Errors: [`Error::Limit`] with the weights' GiB and the GPU's free and
/// total GiB; [`Error::Cuda`] when `cuMemGetInfo` fails.
pub fn check_weights(
    gpu: &crate::cuda::Gpu,
    cfg: &ModelConfig,
    eviction_heads: bool,
) -> Result<()> {
    let need = Need {
        weights: weights_bytes(cfg, eviction_heads),
        ..Need::default()
    };
    check(
        &need,
        &available(gpu, false)?,
        "the weights alone do not fit: use a smaller model or a GPU with more free memory",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Preset;

    fn nosa8b_layout(gpu_selection: bool) -> (ModelConfig, KvLayout) {
        let cfg = Preset::Nosa8b.config();
        let budget = Budget::new(&cfg.sparse.expect("NOSA-8B has sparse settings"));
        let kv = KvLayout {
            layers: cfg.num_hidden_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            budget,
            eviction: true,
            gpu_selection,
        };
        (cfg, kv)
    }

    fn workload(batch: usize, cap: usize, offload: Option<usize>, prefill: bool) -> Workload {
        Workload {
            batch,
            capacity_tokens: cap,
            offload_resident_layers: offload,
            cache_slots: 0,
            prefill,
            prefill_chunk: 512,
            partials_budget_bytes: 512 << 20,
        }
    }

    #[test]
    fn sequence_bytes_counts_kv_scores_and_windows() {
        let (_, kv) = nosa8b_layout(false);
        // NOSA-8B: Hkv 2, D 128, 32 layers: 32 KiB of K/V + 8 B of c per token
        let per_token = 2 * 128 * 2 * 2 + 2 * 4;
        assert_eq!(kv.sequence_bytes(4096), 4096 * per_token * 32);
        // rounded up to whole 64-token blocks
        assert_eq!(kv.sequence_bytes(4033), kv.sequence_bytes(4096));
        assert_eq!(kv.sequence_bytes(4032), 4032 * per_token * 32);
        let (_, sel) = nosa8b_layout(true);
        let w = sel.budget.windows(4096);
        assert_eq!(
            sel.sequence_bytes(4096),
            (4096 * per_token + w * (2 * 128 * 4 + 2 * 4)) * 32
        );
    }

    #[test]
    fn estimate_adds_kv_workspace_and_pinned_memory() {
        let (cfg, kv) = nosa8b_layout(true);
        let resident = estimate(&cfg, &kv, &workload(16, 32_768, None, false));
        assert_eq!(resident.kv, 16 * kv.sequence_bytes(32_768));
        assert_eq!(resident.host_pinned, 0);
        assert_eq!(resident.weights, 0);
        // a real prefill adds the chunk's buffers and its partials budget
        let with_prefill = estimate(&cfg, &kv, &workload(16, 32_768, None, true));
        assert!(with_prefill.workspace >= resident.workspace + (512 << 20));
        assert_eq!(with_prefill.kv, resident.kv);
        // offloaded (layer 0 resident): 31 layers' full K/V pinned on the host
        let off = estimate(&cfg, &kv, &workload(16, 65_536, Some(1), false));
        assert_eq!(off.host_pinned, 16 * 31 * 1024 * (64 << 10));
        let f = Footprint::new(&cfg, kv.budget.attended, 1, 16, 65_536);
        assert_eq!(off.host_pinned, f.host_pinned_bytes);
        assert!(off.kv > f.gpu_kv_bytes && off.kv < 16 * kv.sequence_bytes(65_536));
        // 32 cache slots: 32 more (block, head) K+V chunks of 32 KiB per
        // (sequence, offloaded layer, KV head: 2 on NOSA-8B) on the GPU,
        // nothing more pinned
        let cached = estimate(
            &cfg,
            &kv,
            &Workload {
                cache_slots: 32,
                ..workload(16, 65_536, Some(1), false)
            },
        );
        assert_eq!(cached.kv - off.kv, 16 * 31 * 2 * 32 * (32 << 10));
        assert_eq!(cached.host_pinned, off.host_pinned);
        // NOSA-8B in bf16: ≈ 8.19 B parameters → ≈ 16.4 GB
        let w = weights_bytes(&cfg, true);
        assert!((16_000_000_000..17_000_000_000).contains(&w), "{w}");
    }

    const G: usize = 1 << 30;

    #[test]
    fn check_refuses_with_the_numbers_and_what_to_change() {
        let need = Need {
            weights: 0,
            kv: 60 * G,
            workspace: G,
            host_pinned: 0,
        };
        let fits = Available {
            gpu_free: 63 * G,
            gpu_total: 140 * G,
            host: None,
        };
        assert!(check(&need, &fits, "x").is_ok());
        let tight = Available {
            gpu_free: 62 * G,
            ..fits
        };
        let e = check(&need, &tight, "lower --batch").unwrap_err();
        assert!(matches!(e, Error::Limit(_)));
        assert_eq!(
            e.to_string(),
            "limit exceeded: needs 61.00 GiB of GPU memory (KV 60.00 GiB + workspace 1.00 GiB) + 2.00 GiB margin; 62.00 GiB free of 140.00 GiB: lower --batch"
        );
        let weights = Need {
            weights: 16 * G,
            ..Need::default()
        };
        let small = Available {
            gpu_free: 17 * G,
            ..fits
        };
        let e = check(&weights, &small, "use a smaller model")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("needs 16.00 GiB of GPU memory (weights 16.00 GiB + KV 0.00 GiB"),
            "{e}"
        );
        assert!(check(
            &weights,
            &Available {
                gpu_free: 18 * G,
                ..fits
            },
            ""
        )
        .is_ok());
        assert!(check(
            &weights,
            &Available {
                gpu_free: 18 * G - 1,
                ..fits
            },
            ""
        )
        .is_err());
    }

    #[test]
    fn check_refuses_pinned_memory_first_with_its_margin() {
        let need = Need {
            weights: 0,
            kv: G,
            workspace: G,
            host_pinned: 100 * G,
        };
        let avail = Available {
            gpu_free: 0,
            gpu_total: 140 * G,
            host: Some(107 * G),
        };
        let e = check(&need, &avail, "lower --batch or --new-tokens")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "limit exceeded: offloaded KV needs 100.00 GiB of pinned host memory + 8.00 GiB margin; 107.00 GiB available (MemAvailable in /proc/meminfo): lower --batch or --new-tokens"
        );
        // enough host memory: the GPU is checked next (0 free here)
        let e = check(
            &need,
            &Available {
                host: Some(108 * G),
                ..avail
            },
            "y",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("of GPU memory") && e.contains("0.00 GiB free of 140.00 GiB: y"),
            "{e}"
        );
        // no pinned memory needed: MemAvailable is not consulted
        let gpu_only = Need {
            host_pinned: 0,
            ..need
        };
        assert!(check(
            &gpu_only,
            &Available {
                gpu_free: 5 * G,
                gpu_total: 140 * G,
                host: None
            },
            ""
        )
        .is_ok());
    }
}
