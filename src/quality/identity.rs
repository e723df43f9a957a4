//! What identifies a quality run for comparison: the model (a fingerprint
//! of its weights and shapes), the text (a hash of its token ids), the
//! tokenizer (a hash of its file) and the chunking. A saved base run is
//! compared only with a run that agrees on all of them; the mode settings
//! (attention, budget, backend, KV placement, RoPE overrides, …) are what
//! may differ.
//!
//! Hashes are 64-bit FNV-1a written as 16 lowercase hex digits: they tell
//! runs apart, they do not authenticate anything.

use super::ChunkPlan;
use crate::weights::Checkpoint;
use crate::{Error, Result};
use std::path::Path;

/// 64-bit FNV-1a of `bytes` continued from `h` (start with [`FNV_OFFSET`]).
pub fn fnv1a64(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The FNV-1a 64 offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A hash as 16 lowercase hex digits.
pub fn hex(h: u64) -> String {
    format!("{h:016x}")
}

/// The hash of token ids (FNV-1a 64 over their little-endian u32 bytes).
pub fn hash_tokens(ids: &[u32]) -> String {
    hex(ids
        .iter()
        .fold(FNV_OFFSET, |h, id| fnv1a64(h, &id.to_le_bytes())))
}

/// Bytes sampled per tensor by [`model_fingerprint`]: tensors up to this
/// size are hashed whole, larger ones through 64 evenly spaced windows of
/// 64 bytes (first and last bytes included).
const FULL_HASH_BYTES: usize = 4096;

/// A fingerprint of a checkpoint's weights and shapes, 16 hex digits: FNV-1a
/// 64 over the shapes (L, d, H, Hkv, D, I, V), whether it has eviction heads
/// and a tied lm_head, then every tensor in name order: its name, dtype,
/// shape and bytes (whole up to 4 KiB, else 64 evenly spaced 64-byte
/// windows, so that a 16 GB checkpoint is fingerprinted in milliseconds).
/// Two random-weight presets with different seeds, or two checkpoints of
/// one architecture, get different fingerprints. The config's RoPE and
/// sparse settings are not part of it (they are mode settings here).
pub fn model_fingerprint(ckpt: &Checkpoint) -> String {
    let c = &ckpt.config;
    let mut h = FNV_OFFSET;
    for v in [
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        usize::from(ckpt.eviction_heads),
        usize::from(ckpt.lm_head_tied),
    ] {
        h = fnv1a64(h, &(v as u64).to_le_bytes());
    }
    let mut names = ckpt.store.names();
    names.sort_unstable();
    for name in names {
        let Some(t) = ckpt.store.get(name) else {
            continue;
        };
        h = fnv1a64(h, name.as_bytes());
        h = fnv1a64(h, t.dtype.name().as_bytes());
        for &d in &t.shape {
            h = fnv1a64(h, &(d as u64).to_le_bytes());
        }
        let data = t.data;
        if data.len() <= FULL_HASH_BYTES {
            h = fnv1a64(h, data);
        } else {
            const WINDOWS: usize = 64;
            const W: usize = 64;
            let span = data.len() - W;
            for i in 0..WINDOWS {
                let at = span * i / (WINDOWS - 1);
                h = fnv1a64(h, &data[at..at + W]);
            }
        }
    }
    hex(h)
}

/// The model of a run: compared by fingerprint; the name and shapes are
/// for the reader.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelIdentity {
    /// `--model` as given (a checkpoint directory or `synth:PRESET[:SEED]`).
    pub name: String,
    /// [`model_fingerprint`] of the checkpoint.
    pub fingerprint: String,
    /// L.
    pub layers: usize,
    /// d.
    pub hidden: usize,
    /// H.
    pub heads: usize,
    /// Hkv.
    pub kv_heads: usize,
    /// D.
    pub head_dim: usize,
    /// V: the length of every logits row.
    pub vocab: usize,
}

impl ModelIdentity {
    /// The identity of checkpoint `ckpt` opened as `name`.
    pub fn of(name: &str, ckpt: &Checkpoint) -> ModelIdentity {
        let c = &ckpt.config;
        ModelIdentity {
            name: name.to_string(),
            fingerprint: model_fingerprint(ckpt),
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
        }
    }
}

/// The text of a run and how it was tokenized: compared by the tokenizer
/// file's hash and the token ids' hash; the paths and token count are for
/// the reader.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TextIdentity {
    /// The text file as given.
    pub path: String,
    /// Tokens of the whole text.
    pub tokens: usize,
    /// [`hash_tokens`] of the whole text's token ids.
    pub hash: String,
    /// The tokenizer.json as given.
    pub tokenizer: String,
    /// FNV-1a 64 of the tokenizer file's bytes.
    pub tokenizer_hash: String,
}

impl TextIdentity {
    /// The identity of text `path` tokenized to `ids` by the tokenizer file
    /// `tokenizer` (read here to hash it).
    ///
    /// Errors: [`Error::Io`] when the tokenizer file cannot be read.
    pub fn new(path: &Path, ids: &[u32], tokenizer: &Path) -> Result<TextIdentity> {
        let bytes = std::fs::read(tokenizer).map_err(|e| Error::io(tokenizer, e))?;
        Ok(TextIdentity {
            path: path.display().to_string(),
            tokens: ids.len(),
            hash: hash_tokens(ids),
            tokenizer: tokenizer.display().to_string(),
            tokenizer_hash: hex(fnv1a64(FNV_OFFSET, &bytes)),
        })
    }
}

/// A base run that cannot be compared with this one.
fn mismatch(base: &Path, what: &str, field: &str, b: String, t: String) -> Error {
    Error::Input(format!(
        "{}: the base run is of another {what}: `{field}` is {b} in the base and {t} in this run",
        base.display()
    ))
}

/// Checks that the base run saved in `base` (its `model`) is of the same
/// model as this run.
///
/// Errors: [`Error::Input`] naming the field (`model.fingerprint` or
/// `model.vocab`) with both values and both model names.
pub fn check_model(base: &Path, b: &ModelIdentity, t: &ModelIdentity) -> Result<()> {
    if b.vocab != t.vocab {
        return Err(mismatch(
            base,
            "model",
            "model.vocab",
            format!("{} ({})", b.vocab, b.name),
            format!("{} ({})", t.vocab, t.name),
        ));
    }
    if b.fingerprint != t.fingerprint {
        return Err(mismatch(
            base,
            "model",
            "model.fingerprint",
            format!("{} ({})", b.fingerprint, b.name),
            format!("{} ({})", t.fingerprint, t.name),
        ));
    }
    Ok(())
}

/// Checks that the base run saved in `base` scored the same tokens as this
/// run: the same tokenizer file, the same text token ids, and the same
/// context, score and chunk count.
///
/// Errors: [`Error::Input`] naming the first field that differs
/// (`text.tokenizer_hash`, `text.hash`, `chunking.context`,
/// `chunking.score`, `chunking.chunks`) with both values.
pub fn check_text(
    base: &Path,
    b: (&TextIdentity, &ChunkPlan),
    t: (&TextIdentity, &ChunkPlan),
) -> Result<()> {
    let ((bt, bp), (tt, tp)) = (b, t);
    if bt.tokenizer_hash != tt.tokenizer_hash {
        return Err(mismatch(
            base,
            "tokenization",
            "text.tokenizer_hash",
            format!("{} ({})", bt.tokenizer_hash, bt.tokenizer),
            format!("{} ({})", tt.tokenizer_hash, tt.tokenizer),
        ));
    }
    if bt.hash != tt.hash {
        return Err(mismatch(
            base,
            "text",
            "text.hash",
            format!("{} ({}, {} tokens)", bt.hash, bt.path, bt.tokens),
            format!("{} ({}, {} tokens)", tt.hash, tt.path, tt.tokens),
        ));
    }
    for (field, bv, tv) in [
        ("chunking.context", bp.context, tp.context),
        ("chunking.score", bp.score, tp.score),
        ("chunking.chunks", bp.chunks, tp.chunks),
    ] {
        if bv != tv {
            return Err(mismatch(
                base,
                "chunking",
                field,
                bv.to_string(),
                tv.to_string(),
            ));
        }
    }
    Ok(())
}
