//! `offload-check`: offloaded decode against GPU-resident sparse decode,
//! bit for bit (issue 4 item 8; testing.md "Bitwise identity").
//!
//! Both runs use the same prefill (the GPU-resident one), the same
//! selection kernels and the same attention kernel reducing in ascending
//! block order; only where each block is read from differs (GPU cache vs
//! slot pool / tail ring filled from pinned host memory). So greedy decode
//! must give the same token at every step and the same logits bits: each
//! step's f32 logits are hashed (FNV-1a over their bits) and the hashes
//! compared. Long runs cover what NOSI gets wrong (runtime.md §3): the
//! window moving, compressed state growing, many tail roll-overs and
//! write-backs, contexts shorter than the budget at the start.

use super::engine::{GpuModel, OffloadOptions};
use crate::{Error, Result};
use serde_json::{json, Value};

/// One decode run's record.
#[derive(Debug, Clone)]
pub struct Run {
    /// Greedy tokens, one per step (the first from the prefill's logits).
    pub tokens: Vec<u32>,
    /// FNV-1a hash of each step's logits bits (same order).
    pub logit_hashes: Vec<u64>,
    /// Decode wall time, ms.
    pub decode_ms: f64,
    /// Offload counters of the run (None when GPU-resident).
    pub stats: Option<super::engine::OffloadStats>,
}

fn fnv1a(x: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in x {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Greedy decode of `new_tokens` tokens after `prompt`, GPU-resident
/// (`offload` None) or offloaded.
///
/// Errors: as [`GpuModel::prefill`], [`GpuModel::offload_sequence`],
/// [`GpuModel::decode`].
pub fn run(
    model: &mut GpuModel,
    prompt: &[u32],
    new_tokens: usize,
    offload: Option<OffloadOptions>,
) -> Result<Run> {
    model.set_offload(offload)?;
    let cap = prompt.len() + new_tokens + 1;
    let mut seq = model.new_sequence(cap)?;
    model.prefill(&mut seq, prompt, |_, _| {})?;
    if offload.is_some() {
        model.offload_sequence(&mut seq, cap)?;
        model.reset_offload_stats()?;
    }
    let mut tokens = Vec::with_capacity(new_tokens);
    let mut logit_hashes = Vec::with_capacity(new_tokens);
    let t = std::time::Instant::now();
    let mut tok = *model
        .argmax()?
        .first()
        .ok_or_else(|| Error::Cuda("argmax returned no token".into()))?;
    logit_hashes.push(fnv1a(&model.download_logits()?));
    tokens.push(tok);
    for _ in 1..new_tokens {
        model.decode(std::slice::from_mut(&mut seq), &[tok])?;
        logit_hashes.push(fnv1a(&model.download_logits()?));
        tok = *model
            .argmax()?
            .first()
            .ok_or_else(|| Error::Cuda("argmax returned no token".into()))?;
        tokens.push(tok);
    }
    let decode_ms = t.elapsed().as_secs_f64() * 1e3;
    let stats = if offload.is_some() {
        Some(model.offload_stats()?)
    } else {
        None
    };
    drop(seq);
    model.set_offload(None)?;
    model.release_buffers();
    Ok(Run {
        tokens,
        logit_hashes,
        decode_ms,
        stats,
    })
}

/// The resident run, then one offloaded run per entry of `engines`, each
/// compared with the resident one. Returns (all identical, JSON record).
///
/// Errors: as [`run`].
pub fn offload_identity(
    model: &mut GpuModel,
    prompt: &[u32],
    new_tokens: usize,
    engines: &[OffloadOptions],
) -> Result<(bool, Value)> {
    let base = run(model, prompt, new_tokens, None)?;
    eprintln!(
        "offload-check: GPU-resident sparse, {} tokens in {:.0} ms",
        base.tokens.len(),
        base.decode_ms
    );
    let mut all = true;
    let mut runs = Vec::new();
    for o in engines {
        let r = run(model, prompt, new_tokens, Some(*o))?;
        let tok_mismatch = base.tokens.iter().zip(&r.tokens).position(|(a, b)| a != b);
        let logit_mismatch = base
            .logit_hashes
            .iter()
            .zip(&r.logit_hashes)
            .position(|(a, b)| a != b);
        let same = tok_mismatch.is_none()
            && logit_mismatch.is_none()
            && base.tokens.len() == r.tokens.len();
        all &= same;
        let st = r.stats.clone().unwrap_or_default();
        eprintln!(
            "offload-check: {:?}: {} in {:.0} ms; tokens {}, logits {}; γ {:.3}, {} blocks fetched",
            o.fetch,
            if same { "IDENTICAL" } else { "DIFFERENT" },
            r.decode_ms,
            tok_mismatch.map_or("all equal".to_string(), |i| format!(
                "first differ at step {i}"
            )),
            logit_mismatch.map_or("bitwise equal".to_string(), |i| format!(
                "first differ at step {i}"
            )),
            st.locality_all(),
            st.fetched.iter().sum::<u64>()
        );
        runs.push(json!({
            "fetch": o.fetch.name(),
            "fetch_detail": format!("{:?}", o.fetch),
            "offload_layer0": o.offload_layer0,
            "identical": same,
            "first_token_mismatch": tok_mismatch,
            "first_logits_mismatch": logit_mismatch,
            "steps": r.tokens.len(),
            "decode_ms": r.decode_ms,
            "locality_gamma": st.locality_all(),
            "locality_gamma_per_layer": st.locality(),
            "blocks_fetched": st.fetched.iter().sum::<u64>(),
            "bytes_fetched": st.bytes_fetched(),
        }));
    }
    let v = json!({
        "prompt_tokens": prompt.len(),
        "new_tokens": new_tokens,
        "final_context": prompt.len() + new_tokens,
        "resident": {"decode_ms": base.decode_ms, "tokens_head": &base.tokens[..base.tokens.len().min(32)]},
        "offloaded": runs,
        "identical": all,
        "compared": "greedy token and FNV-1a hash of the f32 logits bits at every step",
    });
    Ok((all, v))
}
