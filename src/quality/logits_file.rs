//! The saved-logits file of `sparda perplexity --save-logits FILE`, read
//! back by `--kl-base FILE`: per scored position, the run's top-K
//! next-token log-probabilities, the probability mass outside them, and the
//! token that followed.
//!
//! # Format (version 1, little-endian)
//!
//! ```text
//! offset  size       field
//! 0       8          magic "SPDLOGIT"
//! 8       4          u32 version = 1
//! 12      4          u32 H: header length, bytes
//! 16      H          header: one UTF-8 JSON object, a LogitsHeader
//! 16 + H  P · R      P = header.positions records of R = 12 + 8·K bytes,
//!                    K = header.top_k, in scoring order (chunk by chunk,
//!                    position by position)
//! ```
//!
//! One record (one scored position: the distribution the run gave for the
//! next token, before that token was fed):
//!
//! ```text
//! size   field
//! 4      u32 next: id of the token that followed (the scored token)
//! 4      f32 next_logprob: ln p(next), nats (≤ 0)
//! 4      f32 rest_mass: probability outside the top-K, Σ_{j ∉ top-K} p_j,
//!        summed directly (not 1 − Σ top-K), in [0, 1]
//! 4·K    u32 ids: the top-K ids by descending probability, ties to the lower id
//! 4·K    f32 logprobs: ln p of each of those ids, nats
//! ```
//!
//! The header ([`LogitsHeader`]) identifies what was scored — the model
//! (fingerprint of weights and shapes, name, shapes), the text (hash of its
//! token ids, path, token count), the tokenizer (hash of its file, path)
//! and the chunking (context, score, chunks) — plus K, P, the run's mode
//! settings, date and commit. Log-probabilities are those of the run's f32
//! logits computed in f64 and rounded to f32. The file size is exactly
//! 16 + H + P·R bytes; anything else is refused as truncated or extended.
//! A run writes `FILE.partial` and renames it to `FILE` when the last
//! position is written.

use super::dist::{mass_outside, top_k_ids, LogSoftmax};
use super::identity::{ModelIdentity, TextIdentity};
use super::ChunkPlan;
use crate::{Error, Result};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// The first 8 bytes of a saved-logits file.
pub const MAGIC: [u8; 8] = *b"SPDLOGIT";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the header: magic, version, header length.
const PREFIX_BYTES: u64 = 16;
/// Largest header accepted when reading, bytes.
const MAX_HEADER_BYTES: u32 = 16 << 20;

/// The JSON header of a saved-logits file (see the module doc).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LogitsHeader {
    /// The model scored.
    pub model: ModelIdentity,
    /// The text scored and its tokenizer.
    pub text: TextIdentity,
    /// Context, score and chunk count.
    pub chunking: ChunkPlan,
    /// K: top log-probabilities per record (1 ≤ K ≤ V).
    pub top_k: usize,
    /// P: records in the file (chunks · score).
    pub positions: usize,
    /// The run's mode settings (backend, attention, budget, KV, …), for the
    /// reader; not compared.
    pub mode: serde_json::Value,
    /// When the run was made, `YYYY-MM-DDTHH:MM:SSZ`.
    pub date_utc: String,
    /// The build's git commit, if known.
    pub commit: Option<String>,
}

impl LogitsHeader {
    /// R: bytes per record, 12 + 8·K.
    pub fn record_bytes(&self) -> usize {
        12 + 8 * self.top_k
    }
}

/// One scored position (see the module doc for the fields' meaning).
#[derive(Debug, Clone, PartialEq)]
pub struct PositionRecord {
    /// Id of the token that followed.
    pub next: u32,
    /// ln p(next), nats.
    pub next_logprob: f32,
    /// Probability mass outside `ids`.
    pub rest_mass: f32,
    /// Top-K ids, most likely first.
    pub ids: Vec<u32>,
    /// ln p of each id in `ids`, nats.
    pub logprobs: Vec<f32>,
}

impl PositionRecord {
    /// The record of one logits row (\[V\], normalized by `lsm`, see
    /// [`LogSoftmax::of`]) followed by `next`, with the top `k` ids (k is
    /// capped at V).
    ///
    /// Errors: [`Error::Input`] when `next` ≥ V.
    pub fn from_logits(logits: &[f32], lsm: &LogSoftmax, next: u32, k: usize) -> Result<Self> {
        let x_next = *logits.get(next as usize).ok_or_else(|| {
            Error::Input(format!(
                "token id {next} is outside the vocabulary of {} ids",
                logits.len()
            ))
        })?;
        let ids = top_k_ids(logits, k);
        let logprobs = ids
            .iter()
            .map(|&i| lsm.logprob(logits[i as usize]) as f32)
            .collect();
        Ok(PositionRecord {
            next,
            next_logprob: lsm.logprob(x_next) as f32,
            rest_mass: mass_outside(logits, lsm, &ids) as f32,
            ids,
            logprobs,
        })
    }
}

/// Writes a saved-logits file: the header at [`LogitsWriter::create`], one
/// record per [`LogitsWriter::write`], complete at [`LogitsWriter::finish`].
pub struct LogitsWriter {
    out: BufWriter<std::fs::File>,
    partial: PathBuf,
    path: PathBuf,
    top_k: usize,
    positions: usize,
    written: usize,
}

impl LogitsWriter {
    /// Creates `path.partial` and writes the prefix and `header` to it.
    ///
    /// Errors: [`Error::Input`] for K = 0; [`Error::Io`] when the file
    /// cannot be created or written.
    pub fn create(path: &Path, header: &LogitsHeader) -> Result<LogitsWriter> {
        if header.top_k == 0 {
            return Err(Error::Input(
                "saved logits need K ≥ 1 log-probabilities per position".into(),
            ));
        }
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let file = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
        let mut out = BufWriter::new(file);
        let json = serde_json::to_vec(header).expect("the header serializes");
        let len = u32::try_from(json.len()).expect("a header under 4 GiB");
        let io = |e| Error::io(&partial, e);
        out.write_all(&MAGIC).map_err(io)?;
        out.write_all(&VERSION.to_le_bytes()).map_err(io)?;
        out.write_all(&len.to_le_bytes()).map_err(io)?;
        out.write_all(&json).map_err(io)?;
        Ok(LogitsWriter {
            out,
            partial,
            path: path.to_path_buf(),
            top_k: header.top_k,
            positions: header.positions,
            written: 0,
        })
    }

    /// K: log-probabilities per record.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Appends one record.
    ///
    /// Errors: [`Error::Input`] for a record without exactly K ids and
    /// log-probabilities, or one past the header's position count;
    /// [`Error::Io`] on a write failure.
    pub fn write(&mut self, r: &PositionRecord) -> Result<()> {
        if r.ids.len() != self.top_k || r.logprobs.len() != self.top_k {
            return Err(Error::Input(format!(
                "saved logits: a record of {} ids and {} log-probabilities in a file of K = {}",
                r.ids.len(),
                r.logprobs.len(),
                self.top_k
            )));
        }
        if self.written == self.positions {
            return Err(Error::Input(format!(
                "saved logits: more than the header's {} positions",
                self.positions
            )));
        }
        let mut buf = Vec::with_capacity(12 + 8 * self.top_k);
        buf.extend(r.next.to_le_bytes());
        buf.extend(r.next_logprob.to_le_bytes());
        buf.extend(r.rest_mass.to_le_bytes());
        buf.extend(r.ids.iter().flat_map(|i| i.to_le_bytes()));
        buf.extend(r.logprobs.iter().flat_map(|l| l.to_le_bytes()));
        self.out
            .write_all(&buf)
            .map_err(|e| Error::io(&self.partial, e))?;
        self.written += 1;
        Ok(())
    }

    /// Flushes the file and renames it from `FILE.partial` to `FILE`.
    ///
    /// Errors: [`Error::Input`] when fewer records than the header's
    /// position count were written; [`Error::Io`] on a flush or rename
    /// failure.
    pub fn finish(mut self) -> Result<()> {
        if self.written != self.positions {
            return Err(Error::Input(format!(
                "saved logits: {} positions written of the header's {}",
                self.written, self.positions
            )));
        }
        self.out.flush().map_err(|e| Error::io(&self.partial, e))?;
        std::fs::rename(&self.partial, &self.path).map_err(|e| Error::io(&self.path, e))
    }
}

/// Reads a saved-logits file: the header at [`LogitsReader::open`], then
/// the records in order ([`LogitsReader::next_record`]).
pub struct LogitsReader {
    input: BufReader<std::fs::File>,
    path: PathBuf,
    header: LogitsHeader,
    read: usize,
}

impl LogitsReader {
    /// Opens `path` and reads and checks its prefix and header.
    ///
    /// Errors: [`Error::Io`] when it cannot be read; [`Error::Input`] naming
    /// the file for a wrong magic (not a saved-logits file), another
    /// version, a malformed header, K = 0, or a size other than
    /// 16 + H + P·(12 + 8·K) bytes (truncated or extended; the numbers are
    /// in the message).
    pub fn open(path: &Path) -> Result<LogitsReader> {
        let io = |e| Error::io(path, e);
        let bad = |msg: String| Error::Input(format!("{}: {msg}", path.display()));
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut input = BufReader::new(file);
        let mut prefix = [0u8; PREFIX_BYTES as usize];
        input.read_exact(&mut prefix).map_err(|_| {
            bad(format!(
                "{size} bytes: too short for a saved-logits file (written by sparda perplexity --save-logits)"
            ))
        })?;
        if prefix[..8] != MAGIC {
            return Err(bad(
                "not a saved-logits file (written by sparda perplexity --save-logits): wrong magic"
                    .into(),
            ));
        }
        let version = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!(
                "saved-logits format version {version}; this build reads version {VERSION}"
            )));
        }
        let hlen = u32::from_le_bytes(prefix[12..16].try_into().expect("4 bytes"));
        if hlen > MAX_HEADER_BYTES || u64::from(hlen) > size.saturating_sub(PREFIX_BYTES) {
            return Err(bad(format!(
                "header of {hlen} bytes in a file of {size} bytes"
            )));
        }
        let mut json = vec![0u8; hlen as usize];
        input.read_exact(&mut json).map_err(io)?;
        let header: LogitsHeader =
            serde_json::from_slice(&json).map_err(|e| bad(format!("malformed header: {e}")))?;
        if header.top_k == 0 {
            return Err(bad("header: top_k is 0".into()));
        }
        let expected = (header.record_bytes() as u64)
            .checked_mul(header.positions as u64)
            .and_then(|b| b.checked_add(PREFIX_BYTES + u64::from(hlen)));
        if expected != Some(size) {
            return Err(bad(format!(
                "{size} bytes, but its header describes {} positions of {} bytes ({} bytes in all): truncated or extended",
                header.positions,
                header.record_bytes(),
                expected.map_or_else(|| "too many".to_string(), |e| e.to_string())
            )));
        }
        Ok(LogitsReader {
            input,
            path: path.to_path_buf(),
            header,
            read: 0,
        })
    }

    /// The file's header.
    pub fn header(&self) -> &LogitsHeader {
        &self.header
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next record.
    ///
    /// Errors: [`Error::Input`] past the last record; [`Error::Io`] on a
    /// read failure.
    pub fn next_record(&mut self) -> Result<PositionRecord> {
        if self.read == self.header.positions {
            return Err(Error::Input(format!(
                "{}: all {} positions read already",
                self.path.display(),
                self.header.positions
            )));
        }
        let k = self.header.top_k;
        let mut buf = vec![0u8; self.header.record_bytes()];
        self.input
            .read_exact(&mut buf)
            .map_err(|e| Error::io(&self.path, e))?;
        self.read += 1;
        let u = |i: usize| u32::from_le_bytes(buf[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let f = |i: usize| f32::from_bits(u(i));
        Ok(PositionRecord {
            next: u(0),
            next_logprob: f(1),
            rest_mass: f(2),
            ids: (3..3 + k).map(u).collect(),
            logprobs: (3 + k..3 + 2 * k).map(f).collect(),
        })
    }
}
