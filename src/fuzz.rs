//! Entry points for fuzzing the parsers of untrusted input: one function per
//! fuzz target, taking the raw bytes of one input file.
//!
//! The fuzz binaries in `fuzz/` (cargo-afl) call these functions, and
//! `tests/fuzz_corpus.rs` replays the saved corpus through the same
//! functions, so CI runs exactly the code that was fuzzed. Each entry runs the
//! parser as the runtime does on a file of that kind, then uses what it
//! accepted the way the runtime would next (reading every tensor, validating
//! a checkpoint, encoding text). Each returns `Ok` when the parser accepted
//! the input; bad input must come back as an [`Error`]: a panic, an abort or
//! a hang is a bug. A few invariants of accepted input are asserted, so that
//! breaking them is a crash the fuzzer reports.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::model::forecast::ForecastWeights;
use crate::tokenizer::{TextStream, Tokenizer};
use crate::weights::{Checkpoint, TensorStore};
use crate::{Error, Result};

/// One fuzz target: its name (the binary in `fuzz/src/bin/` and the folders
/// `fuzz/corpus/<name>/`, `fuzz/regressions/<name>/`) and its entry.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// Name of the binary and of its corpus folder.
    pub name: &'static str,
    /// Feeds one input to the parser.
    pub entry: fn(&[u8]) -> Result<()>,
}

/// Every fuzz target, by name.
pub const TARGETS: [Target; 7] = [
    Target {
        name: "config_json",
        entry: config_json,
    },
    Target {
        name: "safetensors",
        entry: safetensors,
    },
    Target {
        name: "shard_index",
        entry: shard_index,
    },
    Target {
        name: "tokenizer_json",
        entry: tokenizer_json,
    },
    Target {
        name: "torch_pickle",
        entry: torch_pickle,
    },
    Target {
        name: "torch_pt",
        entry: torch_pt,
    },
    Target {
        name: "trace_summarize",
        entry: trace_summarize,
    },
];

fn utf8<'a>(data: &'a [u8], file: &str) -> Result<&'a str> {
    std::str::from_utf8(data).map_err(|e| Error::Input(format!("{file}: not UTF-8: {e}")))
}

/// The small model the weight targets check their input against: d = 8,
/// H = 2, Hkv = 1, D = 4, L = 2, V = 16 (forecast projections [4, 8]).
fn small_config() -> ModelConfig {
    const SMALL: &str = r#"{"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 2, "intermediate_size": 16, "vocab_size": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}"#;
    ModelConfig::from_json_str(SMALL, "<fuzz small config>").expect("the small config is valid")
}

/// `config.json` ([`ModelConfig::from_json_str`]); an accepted config must
/// survive its own JSON round trip ([`ModelConfig::validate`]), and is then
/// checked as offload mode checks its sparse settings and as
/// [`Checkpoint::open`] checks it against weights (here: none, which must
/// be an error).
///
/// # Errors
/// The parser's [`Error::Config`].
///
/// # Panics
/// When an accepted config does not round-trip, or a checkpoint without
/// weights passes validation (parser bugs).
pub fn config_json(data: &[u8]) -> Result<()> {
    let path = Path::new("config.json");
    let cfg = ModelConfig::from_json_str(utf8(data, "config.json")?, path)?;
    if let Err(e) = cfg.validate(path) {
        panic!("config.json accepted, but it does not survive a round trip: {e}");
    }
    let sparse = cfg.sparse_or_default();
    let _ = sparse.validate_offload(path);
    let _ = (sparse.shortlist_blocks(), sparse.windows_per_block());
    let none = Checkpoint::from_parts(cfg, TensorStore::from_tensors(Vec::new()));
    assert!(
        none.is_err(),
        "a checkpoint without weights passed validation"
    );
    Ok(())
}

/// A whole safetensors file ([`TensorStore`] on its bytes, as
/// [`TensorStore::open`] maps it); every tensor it accepted is read as f32,
/// then the store is validated against a small model ([`Checkpoint::from_parts`];
/// its verdict is not the entry's).
///
/// # Errors
/// [`Error::Checkpoint`] for a malformed file.
pub fn safetensors(data: &[u8]) -> Result<()> {
    let store = TensorStore::from_safetensors_bytes(Path::new("model.safetensors"), data.to_vec())?;
    for name in store.names() {
        let t = store.require(name)?;
        let values = t.to_f32();
        assert_eq!(values.len(), t.numel(), "tensor {name}");
    }
    let _ = store.total_bytes();
    let _ = Checkpoint::from_parts(small_config(), store);
    Ok(())
}

/// `model.safetensors.index.json`: the shard map (file → tensor names); every
/// file it accepts must be a plain file name inside the checkpoint directory.
///
/// # Errors
/// [`Error::Checkpoint`] for a malformed index.
///
/// # Panics
/// When an accepted shard name is not a plain file name (a parser bug).
pub fn shard_index(data: &[u8]) -> Result<()> {
    let index = Path::new(crate::weights::INDEX_FILE);
    let by_file =
        crate::weights::parse_shard_index(index, utf8(data, crate::weights::INDEX_FILE)?)?;
    for file in by_file.keys() {
        let plain = Path::new(file).file_name() == Some(std::ffi::OsStr::new(file));
        assert!(
            plain && !file.contains('\\'),
            "shard `{file}` accepted, but it is not a plain file name"
        );
    }
    Ok(())
}

/// Text the tokenizer target encodes: ASCII, accents, CJK, an emoji, control
/// characters and ChatML markers.
const SAMPLE_TEXT: &str =
    "Hello, world! ¿Qué tal? 你好 🙂\t\n  <|im_start|>user\nx = 12345;<|im_end|>\r\n\u{0}";

/// `tokenizer.json` ([`Tokenizer::from_bytes`]); an accepted tokenizer
/// encodes a fixed text, decodes it back, streams it id by id
/// ([`TextStream`]) and decodes ids at and past the end of its vocabulary.
///
/// # Errors
/// [`Error::Tokenizer`] naming `tokenizer.json`.
pub fn tokenizer_json(data: &[u8]) -> Result<()> {
    let tok = Tokenizer::from_bytes(data, PathBuf::from("tokenizer.json"))?;
    let ids = tok.encode(SAMPLE_TEXT)?;
    tok.decode(&ids)?;
    let mut stream = TextStream::with_prompt(&tok, &ids[..ids.len() / 2]);
    for &id in &ids[ids.len() / 2..] {
        stream.push(id)?;
    }
    stream.finish()?;
    let v = u32::try_from(tok.vocab_size()).unwrap_or(u32::MAX);
    tok.decode(&[0, v.saturating_sub(1), v, u32::MAX])?;
    Ok(())
}

/// A SparDA trainer checkpoint (`.pt`, a torch.save zip archive): every
/// tensor is read ([`crate::model::torch_pt::read_tensors_from`]), then the
/// forecast projections are imported for a small model
/// ([`ForecastWeights::from_store`], as [`ForecastWeights::open`] does; its
/// verdict is not the entry's).
///
/// # Errors
/// [`Error::Checkpoint`] naming `ckpt.pt`.
pub fn torch_pt(data: &[u8]) -> Result<()> {
    let path = Path::new("ckpt.pt");
    let tensors = crate::model::torch_pt::read_tensors_from(Cursor::new(data), path, |_| true)?;
    for t in &tensors {
        let numel = t.shape.iter().product::<usize>();
        assert_eq!(t.data.len(), numel * t.dtype.size(), "tensor {}", t.name);
    }
    let store = TensorStore::from_tensors(tensors);
    let _ = ForecastWeights::from_store(&small_config(), &store, path);
    Ok(())
}

/// Storage files of the archive [`torch_pickle`] builds: keys `0` … `3`.
const PICKLE_STORAGES: usize = 4;
/// Bytes of each of those storages (128 bf16 values, 64 f32 values).
const PICKLE_STORAGE_BYTES: usize = 256;

/// The pickle program of a SparDA checkpoint (`data.pkl`) alone: `data` is
/// stored as `archive/data.pkl` in a torch.save-style archive built here,
/// beside storages `archive/data/0` … `archive/data/3` of 256 bytes each,
/// which then goes through [`torch_pt`]. (Fuzzing whole archives rarely
/// reaches the pickle: the zip's CRC-32 rejects almost every mutation of it.)
///
/// # Errors
/// As [`torch_pt`].
pub fn torch_pickle(data: &[u8]) -> Result<()> {
    use std::io::Write;
    let zip_err = |e: zip::result::ZipError| Error::Input(format!("building the archive: {e}"));
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(data.len() > u32::MAX as usize / 2);
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        w.start_file(name, opts).map_err(zip_err)?;
        w.write_all(bytes)
            .map_err(|e| Error::Input(format!("building the archive: {e}")))
    };
    put("archive/data.pkl", data)?;
    for k in 0..PICKLE_STORAGES {
        let bytes: Vec<u8> = (0..PICKLE_STORAGE_BYTES)
            .map(|i| (i * 7 + k * 31) as u8)
            .collect();
        put(&format!("archive/data/{k}"), &bytes)?;
    }
    let archive = w.finish().map_err(zip_err)?.into_inner();
    torch_pt(&archive)
}

/// `sparda trace summarize` on a trace file's text
/// ([`crate::trace::summarize_text`]), then its text and JSON reports.
///
/// # Errors
/// [`Error::Input`] naming `trace.json`.
pub fn trace_summarize(data: &[u8]) -> Result<()> {
    let s = crate::trace::summarize_text(utf8(data, "trace.json")?, Path::new("trace.json"))?;
    s.to_text();
    serde_json::to_string(&s).map_err(|e| Error::Input(format!("trace.json: summary: {e}")))?;
    Ok(())
}
