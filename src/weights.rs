//! Safetensors checkpoints (single file or shards, memory-mapped), in-memory
//! tensor sets for synthetic models, the tensor-name table, and validation of
//! a checkpoint against its config (spec/nosa-model.md §2).
//!
//! - [`TensorStore`]: name → (dtype, shape, bytes), from `model.safetensors`,
//!   from shards listed by `model.safetensors.index.json`, or from memory.
//! - [`names`]: every Hugging Face tensor name, in one place.
//! - [`expected_tensors`]: the names and shapes a config implies.
//! - [`Checkpoint`]: config + store, validated (every problem in one error;
//!   tensors the model does not read are ignored with one warning).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;

use crate::config::{AttentionMode, ModelConfig};
use crate::error::{Error, Result};

/// Element type of a stored tensor. Only floating types are supported; any
/// other safetensors dtype is an error naming the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16 (2 bytes, little endian).
    BF16,
    /// IEEE half (2 bytes, little endian).
    F16,
    /// IEEE single (4 bytes, little endian).
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
    /// The safetensors name (`BF16`, `F16`, `F32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
        }
    }
    fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            DType::BF16 => safetensors::Dtype::BF16,
            DType::F16 => safetensors::Dtype::F16,
            DType::F32 => safetensors::Dtype::F32,
        }
    }
}

/// Converts little-endian elements of `dtype` in `bytes` to f32, into `out`
/// (`out.len()` elements; `bytes.len() = out.len()·dtype.size()`). Works on
/// unaligned data (memory-mapped tensors need not be aligned).
fn convert_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// A borrowed tensor: row-major (C order), little endian.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorView<'a> {
    /// Tensor name (Hugging Face naming, see [`names`]).
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// `numel · dtype.size()` bytes; may be unaligned.
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// All elements as f32 (exact for bf16/f16/f32), row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.numel()];
        convert_into(self.dtype, self.data, &mut out);
        out
    }
    /// Converts the elements into `out` (which must hold [`TensorView::numel`] values).
    ///
    /// # Errors
    /// [`Error::Input`] naming the tensor when `out` has the wrong length.
    pub fn to_f32_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.numel() {
            return Err(Error::Input(format!(
                "tensor {}: output buffer holds {} values, tensor has {}",
                self.name,
                out.len(),
                self.numel()
            )));
        }
        convert_into(self.dtype, self.data, out);
        Ok(())
    }
    /// All elements as bf16 (bf16 data is copied bit for bit; f16/f32 are
    /// rounded to nearest even).
    pub fn to_bf16(&self) -> Vec<bf16> {
        match self.dtype {
            DType::BF16 => self
                .data
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            _ => self.to_f32().into_iter().map(bf16::from_f32).collect(),
        }
    }
}

/// A tensor owning its bytes (synthetic models, tests).
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Row-major little-endian bytes, `numel · dtype.size()` long.
    pub data: Vec<u8>,
}

impl OwnedTensor {
    /// A tensor of `dtype` holding `values` (rounded to nearest even for bf16/f16).
    ///
    /// # Errors
    /// [`Error::Input`] naming the tensor when `values.len()` ≠ product of `shape`.
    pub fn from_f32(
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &[f32],
        dtype: DType,
    ) -> Result<Self> {
        let name = name.into();
        let numel: usize = shape.iter().product();
        if values.len() != numel {
            return Err(Error::Input(format!(
                "tensor {name}: {} values for shape {shape:?} ({numel} elements)",
                values.len()
            )));
        }
        let mut data = Vec::with_capacity(numel * dtype.size());
        match dtype {
            DType::BF16 => values
                .iter()
                .for_each(|v| data.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes())),
            DType::F16 => values
                .iter()
                .for_each(|v| data.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
            DType::F32 => values
                .iter()
                .for_each(|v| data.extend_from_slice(&v.to_le_bytes())),
        }
        Ok(OwnedTensor {
            name,
            dtype,
            shape,
            data,
        })
    }
    /// A borrowed view of this tensor.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            name: &self.name,
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: &self.data,
        }
    }
}

impl safetensors::View for &OwnedTensor {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype.to_safetensors()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` as one safetensors file at `path` (metadata `format: pt`,
/// as PyTorch writers do).
///
/// # Errors
/// [`Error::Io`] / [`Error::Checkpoint`] naming `path`.
pub fn write_safetensors(path: &Path, tensors: &[OwnedTensor]) -> Result<()> {
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(
        tensors.iter().map(|t| (t.name.as_str(), t)),
        Some(meta),
        path,
    )
    .map_err(|e| match e {
        safetensors::SafeTensorError::IoError(io) => Error::io(path, io),
        other => Error::checkpoint(path, format!("cannot write safetensors: {other}")),
    })
}

/// The first line of a Git LFS pointer file.
const LFS_POINTER_START: &[u8] = b"version https://git-lfs.github.com/spec/v1";

/// The most header bytes a safetensors file may declare (the format's limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Every dtype name of the safetensors format (those outside BF16/F16/F32
/// are known but unsupported).
const SAFETENSORS_DTYPES: &[&str] = &[
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "I16", "U16",
    "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "C64",
];

/// One tensor entry of a safetensors header; `dtype` is the problem line
/// when the dtype is unknown or unsupported.
struct HeaderTensor {
    name: String,
    dtype: std::result::Result<DType, String>,
    shape: Vec<usize>,
    begin: usize,
    end: usize,
}

/// A parsed safetensors header: where the data starts, the well-formed
/// tensor entries, and a line per bad entry.
struct Header {
    data_start: usize,
    tensors: Vec<HeaderTensor>,
    problems: Vec<String>,
}

/// Parses and checks the header of safetensors file `path` (contents
/// `bytes`): a Git LFS pointer, a length field past the file or the format's
/// limit, and JSON that is not an object are errors at once; every bad entry
/// (`__metadata__` values not strings, a missing or ill-typed `dtype`,
/// `shape` or `data_offsets`, an unknown dtype, offsets out of the data
/// section or not matching the shape) is one problem line naming the key.
fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let bad = |msg: String| Error::checkpoint(path, format!("malformed safetensors file: {msg}"));
    if bytes.starts_with(LFS_POINTER_START) {
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(1024)]);
        let size = text
            .lines()
            .find_map(|l| l.strip_prefix("size "))
            .map(|s| format!("; the real file is {} bytes", s.trim()))
            .unwrap_or_default();
        return Err(Error::checkpoint(
            path,
            format!(
                "this is a Git LFS pointer file ({} bytes{size}), not the safetensors weights: \
                 run `git lfs pull` in the checkpoint's clone (after `git lfs install`), \
                 or download the file from the Hugging Face hub (e.g. `huggingface-cli download`)",
                bytes.len()
            ),
        ));
    }
    let len = bytes.len() as u64;
    if len < 8 {
        return Err(bad(format!(
            "the file is {len} bytes, shorter than the 8-byte header length field"
        )));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "the header length field says {n} bytes, over the format's limit of {MAX_HEADER_BYTES} (file of {len} bytes)"
        )));
    }
    if n > len - 8 {
        return Err(bad(format!(
            "the header length field says {n} bytes, but only {} bytes follow it",
            len - 8
        )));
    }
    let data_start = 8 + n as usize;
    let data_len = bytes.len() - data_start;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| bad(format!("the {n}-byte header is not valid JSON: {e}")))?;
    let serde_json::Value::Object(map) = json else {
        return Err(bad(format!(
            "the header is JSON but not an object (found {})",
            json_kind(&json)
        )));
    };
    let mut tensors = Vec::new();
    let mut problems = Vec::new();
    for (key, v) in &map {
        if key == "__metadata__" {
            match v {
                serde_json::Value::Object(m) => {
                    for (mk, mv) in m {
                        if !mv.is_string() {
                            problems.push(format!(
                                "header key `__metadata__`.`{mk}`: metadata values must be strings, found {} `{mv}`",
                                json_kind(mv)
                            ));
                        }
                    }
                }
                other => problems.push(format!(
                    "header key `__metadata__`: must be an object of strings, found {} `{other}`",
                    json_kind(other)
                )),
            }
            continue;
        }
        match header_tensor(key, v, data_len) {
            Ok(t) => tensors.push(t),
            Err(p) => problems.push(p),
        }
    }
    if problems.is_empty() {
        problems.extend(layout_problems(&tensors, data_len));
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Header {
        data_start,
        tensors,
        problems,
    })
}

/// The format's layout rule: the tensors' byte ranges tile the data section
/// exactly — no two overlap (one tensor's bytes would alias another's), no
/// bytes between them, none after the last (the safetensors library refuses
/// such files too). One line per break, naming the tensors and offsets.
fn layout_problems(tensors: &[HeaderTensor], data_len: usize) -> Vec<String> {
    let mut by_offset: Vec<&HeaderTensor> = tensors.iter().collect();
    by_offset.sort_by_key(|t| (t.begin, t.end));
    let mut problems = Vec::new();
    let mut covered = 0usize;
    let mut last: Option<&HeaderTensor> = None;
    for t in by_offset {
        if t.begin > covered {
            problems.push(format!(
                "data bytes [{covered}, {}) belong to no tensor (a gap before tensor {})",
                t.begin, t.name
            ));
        } else if t.begin < covered {
            if let Some(p) = last {
                problems.push(format!(
                    "tensors {} [{}, {}] and {} [{}, {}] overlap",
                    p.name, p.begin, p.end, t.name, t.begin, t.end
                ));
            }
        }
        if t.end >= covered {
            covered = t.end;
            last = Some(t);
        }
    }
    if covered < data_len {
        problems.push(format!(
            "the data section has {} bytes after the last tensor's end at {covered} (of {data_len})",
            data_len - covered
        ));
    }
    problems
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// One tensor entry of a header; `Err` is the problem line.
fn header_tensor(
    name: &str,
    v: &serde_json::Value,
    data_len: usize,
) -> std::result::Result<HeaderTensor, String> {
    let p = |msg: String| format!("tensor {name}: {msg}");
    let obj = v.as_object().ok_or_else(|| {
        p(format!(
            "header entry must be an object with dtype, shape and data_offsets, found {}",
            json_kind(v)
        ))
    })?;
    let field = |k: &str| {
        obj.get(k)
            .ok_or_else(|| p(format!("header entry has no `{k}`")))
    };
    let dv = field("dtype")?;
    let dtype_name = dv
        .as_str()
        .ok_or_else(|| p(format!("`dtype` must be a string, found {dv}")))?;
    let uints = |k: &str| -> std::result::Result<Vec<usize>, String> {
        let fv = field(k)?;
        let not_uints = || {
            p(format!(
                "`{k}` must be an array of non-negative integers, found {fv}"
            ))
        };
        let arr = fv.as_array().ok_or_else(not_uints)?;
        arr.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|u| usize::try_from(u).ok())
                    .ok_or_else(not_uints)
            })
            .collect()
    };
    let shape = uints("shape")?;
    let offsets = uints("data_offsets")?;
    let [begin, end] = offsets[..] else {
        return Err(p(format!(
            "`data_offsets` must be [begin, end], found {} values",
            offsets.len()
        )));
    };
    if begin > end || end > data_len {
        return Err(p(format!(
            "data_offsets [{begin}, {end}] out of range: need begin ≤ end ≤ {data_len} (the data section's size){}",
            if end > data_len { "; is the file truncated?" } else { "" }
        )));
    }
    let dtype = match dtype_name {
        "BF16" => Ok(DType::BF16),
        "F16" => Ok(DType::F16),
        "F32" => Ok(DType::F32),
        d if SAFETENSORS_DTYPES.contains(&d) => Err(p(format!(
            "unsupported dtype {d} (supported: BF16, F16, F32)"
        ))),
        d => Err(p(format!(
            "unknown dtype `{d}` (safetensors dtypes: {}; supported: BF16, F16, F32)",
            SAFETENSORS_DTYPES.join(", ")
        ))),
    };
    if let Ok(d) = dtype {
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &x| a.checked_mul(x))
            .and_then(|n| n.checked_mul(d.size()));
        if numel != Some(end - begin) {
            return Err(p(format!(
                "data_offsets [{begin}, {end}] hold {} bytes, but shape {shape:?} of {} needs {}",
                end - begin,
                d.name(),
                numel.map_or("more than usize::MAX".to_string(), |b| b.to_string())
            )));
        }
    }
    Ok(HeaderTensor {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

/// Parses the text of shard index `index` (`model.safetensors.index.json`):
/// its `weight_map` object, tensor name → shard file name, grouped as shard
/// file → the tensor names it must hold.
///
/// # Errors
/// [`Error::Checkpoint`] naming `index`: malformed JSON, no `weight_map`
/// object, a value that is not a string, or a file that is not a plain file
/// name (a path, `..`, `.`, empty), naming the tensor.
pub(crate) fn parse_shard_index(
    index: &Path,
    text: &str,
) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Error::checkpoint(index, format!("malformed shard index: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::checkpoint(index, "shard index has no `weight_map` object"))?;
    let mut by_file: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::checkpoint(
                index,
                format!("weight_map[{name}]: expected a file name, found {file}"),
            )
        })?;
        // A path, `..`, `.` or the empty name would leave the checkpoint
        // directory or name the directory itself.
        let plain = Path::new(file).file_name() == Some(std::ffi::OsStr::new(file));
        if !plain || file.contains('\\') {
            return Err(Error::checkpoint(
                index,
                format!("weight_map[{name}]: file `{file}` must be a plain file name"),
            ));
        }
        by_file
            .entry(file.to_string())
            .or_default()
            .insert(name.clone());
    }
    Ok(by_file)
}

/// Where a tensor's bytes live.
#[derive(Debug, Clone)]
enum Loc {
    /// `files[file][start..end]`.
    File {
        file: usize,
        start: usize,
        end: usize,
    },
    /// `owned[i].data`.
    Owned(usize),
}

#[derive(Debug, Clone)]
struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    loc: Loc,
}

/// The whole contents of one safetensors file: memory-mapped from disk, or
/// held in memory ([`TensorStore::from_safetensors_bytes`]).
#[derive(Debug)]
enum FileBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}

#[derive(Debug)]
struct SafetensorsFile {
    path: PathBuf,
    bytes: FileBytes,
}

/// Named tensors, memory-mapped from safetensors files or held in memory.
///
/// Memory-mapped stores never copy weights into RAM until asked
/// ([`TensorStore::to_f32`], [`TensorView::to_f32`]).
#[derive(Debug)]
pub struct TensorStore {
    origin: PathBuf,
    files: Vec<SafetensorsFile>,
    owned: Vec<OwnedTensor>,
    entries: BTreeMap<String, Entry>,
}

/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

impl TensorStore {
    /// Opens the weights of a checkpoint directory: the shards listed by
    /// `model.safetensors.index.json` (`weight_map`) if that file exists, else
    /// `model.safetensors`. `dir` may also be a `.safetensors` file.
    ///
    /// # Errors
    /// [`Error::Io`] naming the missing or unreadable file (a shard the index
    /// lists included); [`Error::Checkpoint`] naming the file for a malformed
    /// header or index, a tensor the index places in a shard that lacks it, a
    /// tensor in two shards, or an unsupported dtype (naming tensor and dtype).
    pub fn open(dir: impl AsRef<Path>) -> Result<TensorStore> {
        let dir = dir.as_ref();
        if dir.is_file() {
            let mut store = TensorStore::empty(dir);
            store.add_file(dir, None)?;
            return Ok(store);
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(dir, &index);
        }
        let single = dir.join(SINGLE_FILE);
        if !single.is_file() {
            return Err(Error::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("no {SINGLE_FILE} and no {INDEX_FILE} in {}", dir.display()),
                ),
            ));
        }
        let mut store = TensorStore::empty(dir);
        store.add_file(&single, None)?;
        Ok(store)
    }

    fn empty(origin: &Path) -> TensorStore {
        TensorStore {
            origin: origin.to_path_buf(),
            files: Vec::new(),
            owned: Vec::new(),
            entries: BTreeMap::new(),
        }
    }

    fn open_index(dir: &Path, index: &Path) -> Result<TensorStore> {
        let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
        let by_file = parse_shard_index(index, &text)?;
        let mut store = TensorStore::empty(dir);
        for (file, names) in &by_file {
            store.add_file(&dir.join(file), Some(names))?;
        }
        Ok(store)
    }

    /// A store over one safetensors file held in memory: `bytes` is the
    /// whole file, `path` only names it in errors. The same checks as
    /// [`TensorStore::open`] on a file with these contents.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming `path` for a malformed header or an
    /// unsupported dtype.
    pub(crate) fn from_safetensors_bytes(path: &Path, bytes: Vec<u8>) -> Result<TensorStore> {
        let mut store = TensorStore::empty(path);
        store.add_bytes(path, FileBytes::Owned(bytes), None)?;
        Ok(store)
    }

    /// Maps one safetensors file and registers its tensors. With `listed`, every
    /// listed name must be in the file.
    fn add_file(&mut self, path: &Path, listed: Option<&BTreeSet<String>>) -> Result<()> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; the checkpoint files are not expected to
        // change while the runtime runs (as with every mmap-based loader).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        self.add_bytes(path, FileBytes::Mapped(map), listed)
    }

    /// Registers the tensors of safetensors file `path`, whose contents are
    /// `bytes`. With `listed`, every listed name must be in the file.
    fn add_bytes(
        &mut self,
        path: &Path,
        bytes: FileBytes,
        listed: Option<&BTreeSet<String>>,
    ) -> Result<()> {
        let header = parse_header(path, &bytes)?;
        let file_idx = self.files.len();
        let mut problems = header.problems;
        for h in header.tensors {
            let name = h.name;
            let dtype = match h.dtype {
                Ok(d) => d,
                Err(p) => {
                    problems.push(p);
                    continue;
                }
            };
            if self.entries.contains_key(&name) {
                problems.push(format!("tensor {name}: present in more than one file"));
                continue;
            }
            self.entries.insert(
                name,
                Entry {
                    dtype,
                    shape: h.shape,
                    loc: Loc::File {
                        file: file_idx,
                        start: header.data_start + h.begin,
                        end: header.data_start + h.end,
                    },
                },
            );
        }
        if let Some(listed) = listed {
            for name in listed {
                let here = matches!(self.entries.get(name), Some(Entry { loc: Loc::File { file, .. }, .. }) if *file == file_idx);
                if !here
                    && !problems
                        .iter()
                        .any(|p| p.starts_with(&format!("tensor {name}:")))
                {
                    problems.push(format!(
                        "tensor {name}: listed in {INDEX_FILE} for this file but not in it"
                    ));
                }
            }
        }
        if !problems.is_empty() {
            return Err(Error::checkpoint(
                path,
                list_with_more(&problems, MAX_LISTED, "\n"),
            ));
        }
        self.files.push(SafetensorsFile {
            path: path.to_path_buf(),
            bytes,
        });
        Ok(())
    }

    /// A store holding `tensors` in memory (no file); later duplicates of a
    /// name replace earlier ones.
    pub fn from_tensors(tensors: Vec<OwnedTensor>) -> TensorStore {
        let mut store = TensorStore::empty(Path::new("<memory>"));
        for t in tensors {
            store.insert(t);
        }
        store
    }

    /// Adds (or replaces) an in-memory tensor.
    pub fn insert(&mut self, t: OwnedTensor) {
        let idx = self.owned.len();
        self.entries.insert(
            t.name.clone(),
            Entry {
                dtype: t.dtype,
                shape: t.shape.clone(),
                loc: Loc::Owned(idx),
            },
        );
        self.owned.push(t);
    }

    /// The directory or file the store was opened from (`<memory>` for in-memory stores).
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// The tensor `name`, if present.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let (key, e) = self.entries.get_key_value(name)?;
        let data: &[u8] = match &e.loc {
            Loc::File { file, start, end } => &self.files[*file].bytes[*start..*end],
            Loc::Owned(i) => &self.owned[*i].data,
        };
        Some(TensorView {
            name: key.as_str(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            data,
        })
    }

    /// The tensor `name`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the store's origin and the tensor when absent.
    pub fn require(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name)
            .ok_or_else(|| Error::checkpoint(&self.origin, format!("tensor {name} is missing")))
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the store holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Shape and dtype of `name`, without touching its bytes.
    pub fn info(&self, name: &str) -> Option<(DType, &[usize])> {
        self.entries
            .get(name)
            .map(|e| (e.dtype, e.shape.as_slice()))
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.entries
            .values()
            .map(|e| e.shape.iter().product::<usize>() * e.dtype.size())
            .sum()
    }

    /// The safetensors files backing this store (empty for in-memory stores).
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// The tensor `name` as f32 (bf16/f16/f32 → f32, row-major).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the tensor when absent.
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.require(name)?.to_f32())
    }

    /// The tensor `name` as bf16 (see [`TensorView::to_bf16`]).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the tensor when absent.
    pub fn to_bf16(&self, name: &str) -> Result<Vec<bf16>> {
        Ok(self.require(name)?.to_bf16())
    }

    /// Copies every tensor into memory (for comparisons and rewriting).
    pub fn to_owned_tensors(&self) -> Vec<OwnedTensor> {
        self.entries
            .keys()
            .filter_map(|n| self.get(n))
            .map(|v| OwnedTensor {
                name: v.name.to_string(),
                dtype: v.dtype,
                shape: v.shape.clone(),
                data: v.data.to_vec(),
            })
            .collect()
    }
}

/// The tensor-name table: every Hugging Face name the runtime reads, in one
/// place (spec §2).
pub mod names {
    /// `model.embed_tokens.weight` [V, d].
    pub fn embed() -> String {
        "model.embed_tokens.weight".to_string()
    }
    /// `model.norm.weight` \[d\].
    pub fn final_norm() -> String {
        "model.norm.weight".to_string()
    }
    /// `lm_head.weight` [V, d].
    pub fn lm_head() -> String {
        "lm_head.weight".to_string()
    }

    /// The per-layer tensors (prefix `model.layers.{i}.`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum LayerTensor {
        /// `input_layernorm.weight` \[d\].
        InputNorm,
        /// `post_attention_layernorm.weight` \[d\].
        PostAttnNorm,
        /// `self_attn.q_proj.weight` [H·D, d].
        QProj,
        /// `self_attn.k_proj.weight` [Hkv·D, d].
        KProj,
        /// `self_attn.v_proj.weight` [Hkv·D, d].
        VProj,
        /// `self_attn.o_proj.weight` [d, H·D].
        OProj,
        /// `self_attn.q_proj.bias` [H·D] (attention_bias).
        QBias,
        /// `self_attn.k_proj.bias` [Hkv·D] (attention_bias).
        KBias,
        /// `self_attn.v_proj.bias` [Hkv·D] (attention_bias).
        VBias,
        /// `self_attn.o_proj.bias` \[d\] (attention_bias).
        OBias,
        /// `mlp.gate_proj.weight` [I, d].
        GateProj,
        /// `mlp.up_proj.weight` [I, d].
        UpProj,
        /// `mlp.down_proj.weight` [d, I].
        DownProj,
        /// `mlp.gate_proj.bias` \[I\] (mlp_bias).
        GateBias,
        /// `mlp.up_proj.bias` \[I\] (mlp_bias).
        UpBias,
        /// `mlp.down_proj.bias` \[d\] (mlp_bias).
        DownBias,
        /// Eviction head `self_attn.A` \[Hkv\] (NOSA).
        EvictA,
        /// Eviction head `self_attn.delta.weight` [Hkv, Hkv·D] (NOSA).
        EvictDelta,
        /// Eviction head `self_attn.delta.bias` \[Hkv\] (NOSA with attention_bias).
        EvictDeltaBias,
        /// SparDA forecast `self_attn.q_future_proj.weight` [Hkv·D, d] (separate file, §2).
        QFutureProj,
        /// SparDA forecast `self_attn.q_curr_proj.weight` [Hkv·D, d] (layer 0 only, separate file).
        QCurrProj,
    }

    impl LayerTensor {
        /// Every per-layer tensor, in declaration order.
        pub const ALL: [LayerTensor; 21] = [
            LayerTensor::InputNorm,
            LayerTensor::PostAttnNorm,
            LayerTensor::QProj,
            LayerTensor::KProj,
            LayerTensor::VProj,
            LayerTensor::OProj,
            LayerTensor::QBias,
            LayerTensor::KBias,
            LayerTensor::VBias,
            LayerTensor::OBias,
            LayerTensor::GateProj,
            LayerTensor::UpProj,
            LayerTensor::DownProj,
            LayerTensor::GateBias,
            LayerTensor::UpBias,
            LayerTensor::DownBias,
            LayerTensor::EvictA,
            LayerTensor::EvictDelta,
            LayerTensor::EvictDeltaBias,
            LayerTensor::QFutureProj,
            LayerTensor::QCurrProj,
        ];

        /// The name after `model.layers.{i}.`.
        pub fn suffix(self) -> &'static str {
            match self {
                LayerTensor::InputNorm => "input_layernorm.weight",
                LayerTensor::PostAttnNorm => "post_attention_layernorm.weight",
                LayerTensor::QProj => "self_attn.q_proj.weight",
                LayerTensor::KProj => "self_attn.k_proj.weight",
                LayerTensor::VProj => "self_attn.v_proj.weight",
                LayerTensor::OProj => "self_attn.o_proj.weight",
                LayerTensor::QBias => "self_attn.q_proj.bias",
                LayerTensor::KBias => "self_attn.k_proj.bias",
                LayerTensor::VBias => "self_attn.v_proj.bias",
                LayerTensor::OBias => "self_attn.o_proj.bias",
                LayerTensor::GateProj => "mlp.gate_proj.weight",
                LayerTensor::UpProj => "mlp.up_proj.weight",
                LayerTensor::DownProj => "mlp.down_proj.weight",
                LayerTensor::GateBias => "mlp.gate_proj.bias",
                LayerTensor::UpBias => "mlp.up_proj.bias",
                LayerTensor::DownBias => "mlp.down_proj.bias",
                LayerTensor::EvictA => "self_attn.A",
                LayerTensor::EvictDelta => "self_attn.delta.weight",
                LayerTensor::EvictDeltaBias => "self_attn.delta.bias",
                LayerTensor::QFutureProj => "self_attn.q_future_proj.weight",
                LayerTensor::QCurrProj => "self_attn.q_curr_proj.weight",
            }
        }
    }

    /// `model.layers.{i}.<suffix>`.
    pub fn layer(i: usize, t: LayerTensor) -> String {
        format!("model.layers.{i}.{}", t.suffix())
    }
}

use names::LayerTensor;

/// Expected shape of per-layer tensor `t` under `cfg` (spec §2).
pub fn layer_tensor_shape(cfg: &ModelConfig, t: LayerTensor) -> Vec<usize> {
    let d = cfg.hidden_size;
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let hkv = cfg.num_key_value_heads;
    let i = cfg.intermediate_size;
    match t {
        LayerTensor::InputNorm | LayerTensor::PostAttnNorm => vec![d],
        LayerTensor::QProj => vec![q, d],
        LayerTensor::KProj | LayerTensor::VProj => vec![kv, d],
        LayerTensor::OProj => vec![d, q],
        LayerTensor::QBias => vec![q],
        LayerTensor::KBias | LayerTensor::VBias => vec![kv],
        LayerTensor::OBias => vec![d],
        LayerTensor::GateProj | LayerTensor::UpProj => vec![i, d],
        LayerTensor::DownProj => vec![d, i],
        LayerTensor::GateBias | LayerTensor::UpBias => vec![i],
        LayerTensor::DownBias => vec![d],
        LayerTensor::EvictA => vec![hkv],
        LayerTensor::EvictDelta => vec![hkv, kv],
        LayerTensor::EvictDeltaBias => vec![hkv],
        LayerTensor::QFutureProj | LayerTensor::QCurrProj => vec![kv, d],
    }
}

/// The per-layer tensors a config implies, in a fixed order (spec §2).
pub fn layer_tensors(cfg: &ModelConfig, eviction_heads: bool) -> Vec<LayerTensor> {
    use LayerTensor::*;
    let mut v = vec![InputNorm, QProj, KProj, VProj, OProj];
    if cfg.attention_bias {
        v.extend([QBias, KBias, VBias, OBias]);
    }
    if eviction_heads {
        v.extend([EvictA, EvictDelta]);
        if cfg.attention_bias {
            v.push(EvictDeltaBias);
        }
    }
    v.extend([PostAttnNorm, GateProj, UpProj, DownProj]);
    if cfg.mlp_bias {
        v.extend([GateBias, UpBias, DownBias]);
    }
    v
}

/// Every tensor (name, shape) a checkpoint of `cfg` must hold (spec §2):
/// embedding, per-layer norms/projections (biases when `attention_bias` /
/// `mlp_bias`), eviction heads when `eviction_heads`, final norm, and
/// `lm_head.weight` unless `tie_word_embeddings`.
pub fn expected_tensors(cfg: &ModelConfig, eviction_heads: bool) -> Vec<(String, Vec<usize>)> {
    expected_tensors_of_layers(cfg, eviction_heads, cfg.num_hidden_layers)
}

/// [`expected_tensors`] with the per-layer tensors of the first `layers`
/// layers only.
fn expected_tensors_of_layers(
    cfg: &ModelConfig,
    eviction_heads: bool,
    layers: usize,
) -> Vec<(String, Vec<usize>)> {
    let mut out = vec![(names::embed(), vec![cfg.vocab_size, cfg.hidden_size])];
    let per_layer = layer_tensors(cfg, eviction_heads);
    for l in 0..layers {
        for &t in &per_layer {
            out.push((names::layer(l, t), layer_tensor_shape(cfg, t)));
        }
    }
    out.push((names::final_norm(), vec![cfg.hidden_size]));
    if !cfg.tie_word_embeddings {
        out.push((names::lm_head(), vec![cfg.vocab_size, cfg.hidden_size]));
    }
    out
}

/// Number of parameters a checkpoint of `cfg` holds (sum over [`expected_tensors`]).
pub fn parameter_count(cfg: &ModelConfig, eviction_heads: bool) -> u64 {
    expected_tensors(cfg, eviction_heads)
        .iter()
        .map(|(_, s)| s.iter().map(|&x| x as u64).product::<u64>())
        .sum()
}

/// A model: its config and its validated weights.
#[derive(Debug)]
pub struct Checkpoint {
    /// The config (config.json + generation_config.json).
    pub config: ModelConfig,
    /// The weights.
    pub store: TensorStore,
    /// The checkpoint directory (`None` for in-memory models).
    pub dir: Option<PathBuf>,
    /// Whether the model has NOSA eviction heads (`self_attn.A` in every layer).
    pub eviction_heads: bool,
    /// Whether `lm_head` is the embedding matrix (`tie_word_embeddings`); any
    /// `lm_head.weight` present is then ignored.
    pub lm_head_tied: bool,
    /// Tensors in the store that the model does not read (sorted), e.g.
    /// `rotary_emb.inv_freq` buffers of older Llama files or SparDA forecast
    /// projections saved beside the weights. They are ignored, with one
    /// warning listing them.
    pub unused_tensors: Vec<String>,
}

impl Checkpoint {
    /// Opens a Hugging Face checkpoint directory: `config.json` (+
    /// `generation_config.json`), the safetensors weights, then validation as
    /// in [`Checkpoint::from_parts`].
    ///
    /// # Errors
    /// [`Error::Io`] naming a missing `config.json` or weight file;
    /// [`Error::Config`] for a bad config; [`Error::Checkpoint`] for a
    /// malformed weight file or listing every missing and mis-shaped tensor
    /// and every tensor the config leaves unused but the runtime would read
    /// under another config (other extra tensors only warn).
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_file(dir)?;
        let store = TensorStore::open(dir)?;
        let v = validate(&config, &store, dir)?;
        Ok(Checkpoint {
            config,
            store,
            dir: Some(dir.to_path_buf()),
            eviction_heads: v.eviction_heads,
            lm_head_tied: v.lm_head_tied,
            unused_tensors: v.unused,
        })
    }

    /// A checkpoint from a config and a store (e.g. an in-memory synthetic model).
    ///
    /// Validation: eviction heads are present iff layer 0 has `self_attn.A`,
    /// and then every layer needs them; the store must hold every one of
    /// [`expected_tensors`] with those shapes — every missing and mis-shaped
    /// tensor is listed in one error (the first [`MAX_LISTED`] lines, then
    /// "… and N more"); layers of `num_hidden_layers` past the last layer
    /// the store holds a tensor of are one line naming both counts. A tensor
    /// the runtime reads under another config (a
    /// bias when `attention_bias` is false, a layer past
    /// `num_hidden_layers`, …) is an error too, since ignoring it would give
    /// wrong output. Any other extra tensor (`rotary_emb.inv_freq`,
    /// `q_future_proj`, a zero-element leftover) is ignored: it is listed in
    /// [`Checkpoint::unused_tensors`] and named in one warning. `tie_word_embeddings` true:
    /// the embedding is the lm_head; a different `lm_head.weight` present is
    /// ignored with a warning. False and no `lm_head.weight`: error.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the store's origin, one problem per line.
    pub fn from_parts(config: ModelConfig, store: TensorStore) -> Result<Checkpoint> {
        let origin = store.origin().to_path_buf();
        let v = validate(&config, &store, &origin)?;
        Ok(Checkpoint {
            config,
            store,
            dir: None,
            eviction_heads: v.eviction_heads,
            lm_head_tied: v.lm_head_tied,
            unused_tensors: v.unused,
        })
    }

    /// Which attention this model runs (spec §1).
    pub fn attention_mode(&self) -> AttentionMode {
        self.config.attention_mode(self.eviction_heads)
    }

    /// The name of the lm_head matrix to use: `lm_head.weight`, or the
    /// embedding when tied.
    pub fn lm_head_name(&self) -> String {
        if self.lm_head_tied {
            names::embed()
        } else {
            names::lm_head()
        }
    }

    /// `tokenizer.json` of the checkpoint directory.
    ///
    /// # Errors
    /// [`Error::Io`] (not found) naming the path, or naming `<memory>` for an
    /// in-memory checkpoint.
    pub fn tokenizer_path(&self) -> Result<PathBuf> {
        let p = match &self.dir {
            Some(d) => d.join("tokenizer.json"),
            None => PathBuf::from("<memory>/tokenizer.json"),
        };
        if !p.is_file() {
            return Err(Error::io(
                &p,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
            ));
        }
        Ok(p)
    }
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// How many lines (or names) an error or warning lists before "… and N more".
pub const MAX_LISTED: usize = 10;

/// `items` joined by `sep`, the first `max` of them, then "… and N more"
/// when there are more.
pub fn list_with_more(items: &[String], max: usize, sep: &str) -> String {
    let mut out = items
        .iter()
        .take(max)
        .cloned()
        .collect::<Vec<_>>()
        .join(sep);
    if items.len() > max {
        out.push_str(&format!("{sep}… and {} more", items.len() - max));
    }
    out
}

/// The one-line warning naming the tensors a model does not use (the first
/// [`MAX_LISTED`], then "… and N more"), as [`Checkpoint::open`] logs it.
pub fn unused_tensors_warning(origin: &Path, unused: &[String]) -> String {
    format!(
        "{}: ignoring {} tensor{} the model does not use: {}",
        origin.display(),
        unused.len(),
        if unused.len() == 1 { "" } else { "s" },
        list_with_more(unused, MAX_LISTED, ", ")
    )
}

/// Whether `name` is a tensor the runtime reads under some config: the
/// embedding, final norm, lm_head, or a per-layer tensor of [`names`] other
/// than the forecast projections (which live in their own file and are
/// ignored when saved beside the weights).
fn is_runtime_tensor(name: &str) -> bool {
    if name == names::embed() || name == names::final_norm() || name == names::lm_head() {
        return true;
    }
    let Some((_, suffix)) = split_layer_name(name) else {
        return false;
    };
    LayerTensor::ALL
        .iter()
        .filter(|t| !matches!(t, LayerTensor::QFutureProj | LayerTensor::QCurrProj))
        .any(|t| t.suffix() == suffix)
}

/// `model.layers.{i}.<suffix>` → (i, suffix).
fn split_layer_name(name: &str) -> Option<(usize, &str)> {
    let (idx, suffix) = name.strip_prefix("model.layers.")?.split_once('.')?;
    Some((idx.parse().ok()?, suffix))
}

/// What validation found out about a store that matches its config.
struct Validated {
    eviction_heads: bool,
    lm_head_tied: bool,
    unused: Vec<String>,
}

/// Checks `store` against `cfg`.
fn validate(cfg: &ModelConfig, store: &TensorStore, path: &Path) -> Result<Validated> {
    let a0 = names::layer(0, LayerTensor::EvictA);
    let eviction_heads = store.contains(&a0);
    let mut hints = Vec::new();
    // Layers past the last one the store has a tensor of are one problem
    // line, not one per tensor: a config.json with a wrong (even huge)
    // num_hidden_layers must not list, or build the names of, every tensor
    // of every missing layer.
    let held = store
        .names()
        .iter()
        .filter_map(|n| split_layer_name(n))
        .map(|(i, _)| i.saturating_add(1))
        .max()
        .unwrap_or(0);
    let layers = cfg.num_hidden_layers.min(held);
    if cfg.num_hidden_layers > held {
        hints.push(if held == 0 {
            format!(
                "num_hidden_layers = {}, but the weights hold no layer tensor (model.layers.N.…)",
                cfg.num_hidden_layers
            )
        } else {
            format!(
                "num_hidden_layers = {}, but the weights hold tensors of layers 0 … {} only: layers {held} … {} are missing",
                cfg.num_hidden_layers,
                held - 1,
                cfg.num_hidden_layers - 1
            )
        });
    }
    let expected = expected_tensors_of_layers(cfg, eviction_heads, layers);
    let expected_names: BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    for (name, shape) in &expected {
        match store.info(name) {
            None => missing.push(format!(
                "missing: {name} (expected shape {})",
                shape_str(shape)
            )),
            Some((_, found)) if found != shape.as_slice() => misshaped.push(format!(
                "mis-shaped: {name}: expected {}, found {}",
                shape_str(shape),
                shape_str(found)
            )),
            Some(_) => {}
        }
    }
    let lm = names::lm_head();
    let mut unexpected = Vec::new();
    let mut unused = Vec::new();
    for name in store.names() {
        if expected_names.contains(name) {
            continue;
        }
        if cfg.tie_word_embeddings && name == lm {
            continue;
        }
        if !is_runtime_tensor(name) {
            unused.push(name.to_string());
            continue;
        }
        let Some((dtype, shape)) = store.info(name) else {
            continue;
        };
        unexpected.push(format!(
            "unexpected: {name} (shape {}, {}; the config does not use it: check attention_bias, mlp_bias, num_hidden_layers)",
            shape_str(shape),
            dtype.name()
        ));
    }
    if eviction_heads {
        let lacking: Vec<usize> = (1..layers)
            .filter(|&l| !store.contains(&names::layer(l, LayerTensor::EvictA)))
            .collect();
        if !lacking.is_empty() {
            hints.push(format!(
                "eviction heads: layer 0 has self_attn.A, so every layer needs one; layers {lacking:?} lack it"
            ));
        }
    } else {
        let having: Vec<usize> = (1..layers)
            .filter(|&l| store.contains(&names::layer(l, LayerTensor::EvictA)))
            .collect();
        if !having.is_empty() {
            hints.push(format!(
                "eviction heads: layer 0 has no self_attn.A but layers {having:?} do (all layers or none)"
            ));
        }
    }
    if !cfg.tie_word_embeddings && !store.contains(&lm) {
        hints.push("tie_word_embeddings is false and lm_head.weight is absent".to_string());
    }
    let problems: Vec<String> = hints
        .into_iter()
        .chain(missing)
        .chain(misshaped)
        .chain(unexpected)
        .collect();
    if !problems.is_empty() {
        return Err(Error::checkpoint(
            path,
            format!(
                "the weights do not match config.json ({} problem lines):\n{}",
                problems.len(),
                list_with_more(&problems, MAX_LISTED, "\n")
            ),
        ));
    }
    if !unused.is_empty() {
        tracing::warn!("{}", unused_tensors_warning(path, &unused));
    }
    if cfg.tie_word_embeddings {
        if let (Some(lmv), Some(ev)) = (store.get(&lm), store.get(&names::embed())) {
            let same = lmv.shape == ev.shape
                && if lmv.dtype == ev.dtype {
                    lmv.data == ev.data
                } else {
                    lmv.to_f32() == ev.to_f32()
                };
            if !same {
                tracing::warn!(
                    checkpoint = %path.display(),
                    "tie_word_embeddings is true but lm_head.weight differs from the embedding; using the embedding"
                );
            }
        }
    }
    Ok(Validated {
        eviction_heads,
        lm_head_tied: cfg.tie_word_embeddings,
        unused,
    })
}
