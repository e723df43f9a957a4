//! The NOSA math once, backend-agnostic (spec/nosa-model.md §1, §3–§6):
//! which attention a model runs, the block budget, the per-token state and
//! the selection rule. Backends ([`crate::cpu`], [`crate::cuda`]) call into
//! this module; the CPU reference is built directly on it.

pub mod forecast;
pub mod select;
pub mod state;
pub mod torch_pt;

use crate::config::{AttentionMode, ModelConfig, SparseConfig};
use crate::{Error, Result};
pub use select::{Budget, SelectionRule};

/// User overrides of the attention mode (`--attention`, `--selection`,
/// runtime.md §6). `None` means "as the checkpoint says".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionOverrides {
    /// `--attention dense|sparse`: `Some(false)` forces dense, `Some(true)` sparse.
    pub sparse: Option<bool>,
    /// `--selection nosa|infllmv2`.
    pub selection: Option<SelectionRule>,
    /// `--budget-blocks S`: sets topk = S − W.
    pub budget_blocks: Option<usize>,
    /// `--select-blocks N`.
    pub select_blocks: Option<usize>,
}

/// Prefill attention (`--prefill`, spec §6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PrefillMode {
    /// As the attention mode says (sparse for NOSA/InfLLM-V2 unless the prompt is shorter than dense_len).
    #[default]
    Auto,
    /// Dense prefill, sparse decode (the paper's NOSA_F).
    Dense,
}

/// The attention a model runs, resolved from the checkpoint and the overrides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionPlan {
    /// Dense, NOSA or InfLLM-V2.
    pub mode: AttentionMode,
    /// The sparse settings in force (defaults for NOSA checkpoints without a
    /// `sparse_config`; also kept for dense models so `--attention sparse` works).
    pub sparse: SparseConfig,
    /// The block budget derived from `sparse`.
    pub budget: Budget,
}

impl AttentionPlan {
    /// Spec §1 "Which attention a model gets": eviction heads → NOSA; no heads
    /// but a `sparse_config` → InfLLM-V2; neither → dense; then the overrides.
    ///
    /// Errors: NOSA selection asked for a checkpoint without eviction heads;
    /// a budget override that breaks the §1 validation rules.
    pub fn resolve(
        cfg: &ModelConfig,
        eviction_heads: bool,
        ov: AttentionOverrides,
    ) -> Result<Self> {
        let mut sparse = cfg.sparse.unwrap_or_default();
        if let Some(s) = ov.budget_blocks {
            let w = sparse.window_blocks();
            let min = w + sparse.init_blocks + ov.select_blocks.unwrap_or(sparse.select_blocks);
            if s < min {
                return Err(Error::Input(format!(
                    "--budget-blocks {s} is below the minimum {min} = {w} window blocks + init_blocks {} + select_blocks {} (lower --select-blocks for a smaller budget)",
                    sparse.init_blocks,
                    ov.select_blocks.unwrap_or(sparse.select_blocks)
                )));
            }
            sparse.topk = s - w;
        }
        if let Some(n) = ov.select_blocks {
            sparse.select_blocks = n;
        }
        if sparse.select_blocks == 0
            || sparse
                .init_blocks
                .checked_add(sparse.select_blocks)
                .is_none_or(|x| x > sparse.topk)
        {
            return Err(Error::Input(format!(
                "sparse budget: need 1 ≤ select_blocks and init_blocks + select_blocks ≤ topk, got init_blocks {} select_blocks {} topk {}",
                sparse.init_blocks, sparse.select_blocks, sparse.topk
            )));
        }
        let default_mode = if eviction_heads {
            AttentionMode::Nosa
        } else if cfg.sparse.is_some() {
            AttentionMode::InfLlmV2
        } else {
            AttentionMode::Dense
        };
        let mode = match (ov.sparse, ov.selection) {
            (Some(false), _) => AttentionMode::Dense,
            (_, Some(SelectionRule::Nosa)) => {
                if !eviction_heads {
                    return Err(Error::Input(
                        "--selection nosa needs eviction heads (self_attn.A / self_attn.delta.weight), which this checkpoint lacks; use --selection infllmv2".into(),
                    ));
                }
                AttentionMode::Nosa
            }
            (_, Some(SelectionRule::InfLlmV2)) => AttentionMode::InfLlmV2,
            (Some(true), None) if default_mode == AttentionMode::Dense => AttentionMode::InfLlmV2,
            _ => default_mode,
        };
        Ok(AttentionPlan {
            mode,
            sparse,
            budget: Budget::new(&sparse),
        })
    }

    /// The selection rule for a sparse mode (`None` for dense).
    pub fn rule(&self) -> Option<SelectionRule> {
        match self.mode {
            AttentionMode::Dense => None,
            AttentionMode::Nosa => Some(SelectionRule::Nosa),
            AttentionMode::InfLlmV2 => Some(SelectionRule::InfLlmV2),
        }
    }

    /// Whether attention at sequence length `t_len` (the current token
    /// included) runs sparse: a sparse mode and T ≥ dense_len (spec §1).
    /// Decode asks it per token, prefill with the whole prompt's length (§6).
    pub fn sparse_at(&self, t_len: usize) -> bool {
        self.mode != AttentionMode::Dense && t_len >= self.sparse.dense_len
    }
}
