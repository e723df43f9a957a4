//! The activation record file of `sparda forecast collect` (read by `fit`).
//!
//! Layout, little-endian throughout:
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `SPFCREC1` |
//! | 8 | u64 record count (written when the file is finished; a file left by an interrupted run says 0 and is refused) |
//! | 8 | u64 header length h |
//! | h | the [`Header`] as UTF-8 JSON |
//! | … | records, each [`Header::record_bytes`] long |
//!
//! A record is one sampled token position of one text: u32 position, u32
//! text index (into [`Header::texts`]), u32 phase (0 prefill, 1 decode), u32
//! zero; then for every layer l = 0 … L−1, f32: x̂_l (the RMSNorm'd attention
//! input of layer l, \[d\]) followed by each target of layer l in
//! [`Header::targets`] order (\[Hkv·D\] each; spec §4 "Forecast mode": the
//! forecast of layer l+1 is regressed from x̂_l onto layer l+1's targets).
//! Records are appended as they are made, so memory stays bounded by one
//! forward call's captured rows.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// File magic.
pub const MAGIC: &[u8; 8] = b"SPFCREC1";

/// Phase of a record's position.
pub const PHASE_PREFILL: u32 = 0;
/// Phase of a record's position.
pub const PHASE_DECODE: u32 = 1;

/// What a record file holds: the model's shapes, the target names, the
/// texts and the mode it was collected in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Model name or path, as given.
    pub model: String,
    /// Weights fingerprint of the model (as the quality reports give it).
    pub fingerprint: String,
    /// L: decoder layers.
    pub layers: usize,
    /// d: hidden size (length of x̂).
    pub hidden: usize,
    /// Hkv: KV heads.
    pub kv_heads: usize,
    /// D: head dimension (each target is Hkv·D long).
    pub head_dim: usize,
    /// Target names, in record order (see `targets`).
    pub targets: Vec<String>,
    /// The texts, by the index records carry.
    pub texts: Vec<String>,
    /// Mode settings (selection, budget, context, sampling), free-form.
    pub settings: serde_json::Value,
}

impl Header {
    /// f32 values per layer in a record: d + targets · Hkv·D.
    pub fn layer_floats(&self) -> usize {
        self.hidden + self.targets.len() * self.kv_heads * self.head_dim
    }
    /// Bytes per record: 16 + 4 · L · [`Self::layer_floats`].
    pub fn record_bytes(&self) -> usize {
        16 + 4 * self.layers * self.layer_floats()
    }
    /// Index of target `name` in [`Self::targets`].
    ///
    /// Errors: [`Error::Format`] naming the target and the ones present.
    pub fn target_index(&self, name: &str) -> Result<usize> {
        self.targets.iter().position(|t| t == name).ok_or_else(|| {
            Error::Format(format!(
                "target `{name}` is not in the record file (it holds {:?})",
                self.targets
            ))
        })
    }
}

/// One record: a position's x̂ and targets for every layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Token position in its chunk (0-based).
    pub position: u32,
    /// Index into [`Header::texts`].
    pub text: u32,
    /// [`PHASE_PREFILL`] or [`PHASE_DECODE`].
    pub phase: u32,
    /// L · [`Header::layer_floats`] values, layer-major.
    pub data: Vec<f32>,
}

impl Record {
    /// x̂ of layer `l`, \[d\].
    pub fn x<'a>(&'a self, h: &Header, l: usize) -> &'a [f32] {
        let o = l * h.layer_floats();
        &self.data[o..o + h.hidden]
    }
    /// Target `t` (index into [`Header::targets`]) of layer `l`, [Hkv·D].
    pub fn target<'a>(&'a self, h: &Header, l: usize, t: usize) -> &'a [f32] {
        let k = h.kv_heads * h.head_dim;
        let o = l * h.layer_floats() + h.hidden + t * k;
        &self.data[o..o + k]
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Streams records to a file.
pub struct Writer {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
    header: Header,
    count: u64,
}

impl Writer {
    /// Creates `path` (replacing it) and writes the header.
    ///
    /// Errors: [`Error::Io`] naming the file.
    pub fn create(path: &Path, header: Header) -> Result<Self> {
        let f = std::fs::File::create(path).map_err(io(path))?;
        let mut out = BufWriter::with_capacity(1 << 20, f);
        let json = serde_json::to_vec(&header).expect("header serializes");
        out.write_all(MAGIC).map_err(io(path))?;
        out.write_all(&0u64.to_le_bytes()).map_err(io(path))?;
        out.write_all(&(json.len() as u64).to_le_bytes())
            .map_err(io(path))?;
        out.write_all(&json).map_err(io(path))?;
        Ok(Writer {
            path: path.to_path_buf(),
            out,
            header,
            count: 0,
        })
    }

    /// The header written.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Records written so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Appends one record.
    ///
    /// Errors: [`Error::Format`] when `r.data` does not have L · layer_floats
    /// values; [`Error::Io`].
    pub fn push(&mut self, r: &Record) -> Result<()> {
        let want = self.header.layers * self.header.layer_floats();
        if r.data.len() != want {
            return Err(Error::Format(format!(
                "{}: record at position {} has {} values, the header's shapes need {want}",
                self.path.display(),
                r.position,
                r.data.len()
            )));
        }
        let p = &self.path;
        for v in [r.position, r.text, r.phase, 0] {
            self.out.write_all(&v.to_le_bytes()).map_err(io(p))?;
        }
        self.out.write_all(bytemuck_f32(&r.data)).map_err(io(p))?;
        self.count += 1;
        Ok(())
    }

    /// Writes the record count and closes the file; returns the count.
    ///
    /// Errors: [`Error::Io`].
    pub fn finish(mut self) -> Result<u64> {
        let p = self.path.clone();
        self.out.flush().map_err(io(&p))?;
        let mut f = self.out.into_inner().map_err(|e| io(&p)(e.into_error()))?;
        f.seek(SeekFrom::Start(8)).map_err(io(&p))?;
        f.write_all(&self.count.to_le_bytes()).map_err(io(&p))?;
        f.sync_all().map_err(io(&p))?;
        Ok(self.count)
    }
}

/// f32 slice as little-endian bytes (all supported targets are little-endian).
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 has alignment 1; the length is 4·len.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Reads a record file in order.
pub struct Reader {
    path: PathBuf,
    input: BufReader<std::fs::File>,
    /// The file's header.
    pub header: Header,
    /// Records in the file.
    pub count: u64,
    read: u64,
}

impl Reader {
    /// Opens `path` and checks the magic, header and size.
    ///
    /// Errors: [`Error::Io`]; [`Error::Format`] naming the file for a wrong
    /// magic, a bad header, an unfinished file (count 0) or a size that does
    /// not match count · record bytes (with the numbers).
    pub fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(io(path))?;
        let size = f.metadata().map_err(io(path))?.len();
        let mut input = BufReader::with_capacity(1 << 20, f);
        let mut head = [0u8; 24];
        input.read_exact(&mut head).map_err(|e| {
            Error::Format(format!(
                "{}: not a forecast record file ({size} bytes, shorter than its 24-byte preamble: {e})",
                path.display()
            ))
        })?;
        if &head[..8] != MAGIC {
            return Err(Error::Format(format!(
                "{}: not a forecast record file (magic {:?}, expected {:?})",
                path.display(),
                String::from_utf8_lossy(&head[..8]),
                std::str::from_utf8(MAGIC).unwrap()
            )));
        }
        let count = u64::from_le_bytes(head[8..16].try_into().unwrap());
        let hlen = u64::from_le_bytes(head[16..24].try_into().unwrap());
        if hlen > size.saturating_sub(24) {
            return Err(Error::Format(format!(
                "{}: header length {hlen} exceeds the file ({size} bytes)",
                path.display()
            )));
        }
        let mut json = vec![0u8; hlen as usize];
        input.read_exact(&mut json).map_err(io(path))?;
        let header: Header = serde_json::from_slice(&json)
            .map_err(|e| Error::Format(format!("{}: bad header JSON: {e}", path.display())))?;
        if header.layers == 0 || header.hidden == 0 || header.kv_heads == 0 || header.head_dim == 0
        {
            return Err(Error::Format(format!(
                "{}: header has a zero shape (layers {}, hidden {}, kv_heads {}, head_dim {})",
                path.display(),
                header.layers,
                header.hidden,
                header.kv_heads,
                header.head_dim
            )));
        }
        if count == 0 {
            return Err(Error::Format(format!(
                "{}: record count 0 (an unfinished or empty collection; run `sparda forecast collect` again)",
                path.display()
            )));
        }
        let want = 24 + hlen + count * header.record_bytes() as u64;
        if size != want {
            return Err(Error::Format(format!(
                "{}: {size} bytes, but {count} records of {} bytes after a {hlen}-byte header need {want}",
                path.display(),
                header.record_bytes()
            )));
        }
        Ok(Reader {
            path: path.to_path_buf(),
            input,
            header,
            count,
            read: 0,
        })
    }

    /// The next record, `None` at the end.
    ///
    /// Errors: [`Error::Io`] naming the file.
    pub fn next_record(&mut self) -> Result<Option<Record>> {
        if self.read == self.count {
            return Ok(None);
        }
        let mut meta = [0u8; 16];
        self.input.read_exact(&mut meta).map_err(io(&self.path))?;
        let u = |i: usize| u32::from_le_bytes(meta[4 * i..4 * i + 4].try_into().unwrap());
        let n = self.header.layers * self.header.layer_floats();
        let mut bytes = vec![0u8; 4 * n];
        self.input.read_exact(&mut bytes).map_err(io(&self.path))?;
        let data = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        self.read += 1;
        Ok(Some(Record {
            position: u(0),
            text: u(1),
            phase: u(2),
            data,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            model: "m".into(),
            fingerprint: "f".into(),
            layers: 2,
            hidden: 3,
            kv_heads: 1,
            head_dim: 2,
            targets: vec!["a".into(), "b".into()],
            texts: vec!["t.txt".into()],
            settings: serde_json::json!({"context": 8}),
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let dir = std::env::temp_dir().join(format!("spfc_rec_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("r.bin");
        let h = header();
        assert_eq!(h.layer_floats(), 7);
        assert_eq!(h.record_bytes(), 16 + 4 * 14);
        let mut w = Writer::create(&p, h.clone()).unwrap();
        let recs: Vec<Record> = (0..3)
            .map(|i| Record {
                position: 10 + i,
                text: 0,
                phase: i % 2,
                data: (0..14).map(|j| (i * 100 + j) as f32).collect(),
            })
            .collect();
        for r in &recs {
            w.push(r).unwrap();
        }
        assert!(w
            .push(&Record {
                position: 1,
                text: 0,
                phase: 0,
                data: vec![0.0; 3]
            })
            .is_err());
        assert_eq!(w.finish().unwrap(), 3);
        let mut r = Reader::open(&p).unwrap();
        assert_eq!(r.header, h);
        assert_eq!(r.count, 3);
        let first = r.next_record().unwrap().unwrap();
        assert_eq!(first, recs[0]);
        assert_eq!(first.x(&h, 1), &[7.0, 8.0, 9.0]);
        assert_eq!(first.target(&h, 1, 1), &[12.0, 13.0]);
        assert_eq!(h.target_index("b").unwrap(), 1);
        assert!(h.target_index("c").unwrap_err().to_string().contains("`c`"));
        assert_eq!(r.next_record().unwrap().unwrap(), recs[1]);
        assert_eq!(r.next_record().unwrap().unwrap(), recs[2]);
        assert!(r.next_record().unwrap().is_none());
        // a truncated file is refused with the sizes
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        let e = Reader::open(&p).err().unwrap().to_string();
        assert!(e.contains("3 records of 72 bytes"), "{e}");
        // an unfinished one (count 0) too
        let mut unfinished = bytes.clone();
        unfinished[8..16].copy_from_slice(&0u64.to_le_bytes());
        std::fs::write(&p, &unfinished).unwrap();
        assert!(Reader::open(&p)
            .err()
            .unwrap()
            .to_string()
            .contains("record count 0"));
        std::fs::write(&p, b"NOTAFILE0000000000000000").unwrap();
        assert!(Reader::open(&p)
            .err()
            .unwrap()
            .to_string()
            .contains("magic"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
