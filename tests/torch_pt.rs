//! The reader of SparDA's torch.save checkpoints on archives written here,
//! whose pickle programs are built byte by byte: a one-tensor state dict
//! whose view (offset, size, stride) each test sets, and pickles that would
//! make the reader build far more than the file holds. Views the reader
//! cannot honour and such pickles are errors naming the file, never an
//! abort. (The view sizes were found by fuzzing, the rest by reading the
//! reader; the inputs are in fuzz/regressions/torch_pickle/.)

use std::io::{Cursor, Write};
use std::path::Path;

use sparda::model::torch_pt::read_tensors_from;
use sparda::weights::DType;

/// `X`: a short string.
fn string(s: &str) -> Vec<u8> {
    let mut v = vec![b'X'];
    v.extend((s.len() as u32).to_le_bytes());
    v.extend(s.as_bytes());
    v
}

/// `LONG1` of 8 bytes: any i64.
fn int(n: i64) -> Vec<u8> {
    let mut v = vec![0x8a, 8];
    v.extend(n.to_le_bytes());
    v
}

fn tuple(xs: &[i64]) -> Vec<u8> {
    let mut v = vec![b'('];
    for &x in xs {
        v.extend(int(x));
    }
    v.push(b't');
    v
}

/// The pickle of `{"w": bf16 view of storage "0" (offset, size, stride)}`,
/// as torch.save writes it (protocol 2, `_rebuild_tensor_v2`).
fn state_dict_pickle(offset: i64, size: &[i64], stride: &[i64]) -> Vec<u8> {
    let mut p = vec![0x80, 2, b'}', b'('];
    p.extend(string("w"));
    p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(");
    p.push(b'(');
    p.extend(string("storage"));
    p.extend(b"ctorch\nBFloat16Storage\n");
    p.extend(string("0"));
    p.extend(string("cpu"));
    p.extend(int(16));
    p.extend(b"tQ");
    p.extend(int(offset));
    p.extend(tuple(size));
    p.extend(tuple(stride));
    p.extend([0x89, b'}', b't', b'R', b'u', b'.']);
    p
}

/// `LONG_BINPUT` / `LONG_BINGET` of memo slot 0.
const PUT0: &[u8] = b"r\x00\x00\x00\x00";
const GET0: &[u8] = b"j\x00\x00\x00\x00";

/// Every tensor of the archive holding pickle `p`.
fn read_pickle(p: &[u8]) -> sparda::Result<Vec<sparda::weights::OwnedTensor>> {
    read_tensors_from(Cursor::new(archive(p)), Path::new("ckpt.pt"), |_| true)
}

/// A stored zip holding `archive/data.pkl` and storage `archive/data/0`:
/// 16 bf16 values with bit patterns 0x3f80 + k (k = 0 … 15).
fn archive(pickle: &[u8]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.start_file("archive/data.pkl", opts).unwrap();
    w.write_all(pickle).unwrap();
    w.start_file("archive/data/0", opts).unwrap();
    for k in 0..16u16 {
        w.write_all(&(0x3f80 + k).to_le_bytes()).unwrap();
    }
    w.finish().unwrap().into_inner()
}

fn read(offset: i64, size: &[i64], stride: &[i64]) -> sparda::Result<Vec<u16>> {
    let a = archive(&state_dict_pickle(offset, size, stride));
    let t = read_tensors_from(Cursor::new(a), Path::new("ckpt.pt"), |_| true)?;
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].name.as_str(), t[0].dtype), ("w", DType::BF16));
    Ok(t[0]
        .data
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) - 0x3f80)
        .collect())
}

fn read_err(offset: i64, size: &[i64], stride: &[i64]) -> String {
    read(offset, size, stride).unwrap_err().to_string()
}

#[test]
fn strided_views_are_gathered_row_major() {
    // a [2, 3] transposed view of a [3, 2] block starting at element 4
    assert_eq!(read(4, &[2, 3], &[1, 2]).unwrap(), vec![4, 6, 8, 5, 7, 9]);
    // the whole storage, and an empty view
    assert_eq!(read(0, &[16], &[1]).unwrap(), (0..16).collect::<Vec<u16>>());
    assert_eq!(read(0, &[0, 5], &[5, 1]).unwrap(), Vec::<u16>::new());
}

/// A view of 2^43 × 4 elements used to be allocated before it was checked
/// against the storage: 64 TiB, an abort.
#[test]
fn a_view_larger_than_its_storage_is_refused() {
    assert_eq!(
        read_err(0, &[1 << 43, 4], &[0, 0]),
        "ckpt.pt: PyTorch checkpoint: tensor `w`: a view of size [8796093022208, 4] has more elements than \
         storage 0 (16 elements of 2 bytes); expanded or overlapping views are not supported"
    );
    // more elements than usize holds
    assert!(read_err(0, &[1 << 40, 1 << 40], &[1, 1]).contains("has more elements than storage 0"));
}

#[test]
fn a_view_past_the_end_of_its_storage_is_refused() {
    assert_eq!(
        read_err(10, &[2, 4], &[4, 1]),
        "ckpt.pt: PyTorch checkpoint: tensor `w`: view (offset 10, size [2, 4], stride [4, 1]) past the end \
         of storage 0 (16 elements)"
    );
    // a stride whose product with the size overflows usize
    assert!(read_err(0, &[2], &[i64::MAX]).contains("past the end of storage 0"));
    assert_eq!(
        read_err(-1, &[2], &[1]),
        "ckpt.pt: PyTorch checkpoint: pickle: tensor storage offset -1 is negative"
    );
    assert_eq!(
        read_err(0, &[2, 2], &[1]),
        "ckpt.pt: PyTorch checkpoint: tensor `w`: size [2, 2] and stride [1] differ in length"
    );
}

/// Each memo copy of a list of two copies doubles it: 40 copies of a
/// 100-byte pickle would take 2^40 values. The copies are counted.
#[test]
fn a_pickle_doubling_its_values_is_refused() {
    let mut p = vec![0x80, 2, b']'];
    p.extend(PUT0);
    for _ in 0..40 {
        p.extend(GET0);
        p.extend(GET0);
        p.push(0x86); // TUPLE2
        p.extend(PUT0);
    }
    p.push(b'.');
    let t0 = std::time::Instant::now();
    let err = read_pickle(&p).unwrap_err().to_string();
    assert_eq!(
        err,
        "ckpt.pt: PyTorch checkpoint: pickle: its memo copies take more than 64 MiB (it copies values over and over)"
    );
    assert!(t0.elapsed().as_secs() < 5, "{:?}", t0.elapsed());
    // a long string copied 100,000 times: 100 MB from a 200 kB pickle
    let mut p = vec![0x80, 2, b']'];
    p.extend(string(&"x".repeat(1000)));
    p.extend(PUT0);
    p.push(b'a'); // APPEND
    for _ in 0..100_000 {
        p.extend(GET0);
        p.push(b'a');
    }
    p.push(b'.');
    assert!(read_pickle(&p)
        .unwrap_err()
        .to_string()
        .contains("memo copies take more than 64 MiB"));
}

/// Lists nested 300,000 deep overflowed the stack when dropped; values may
/// nest 100 deep (torch.save's nest fewer than 10), also through memo
/// copies.
#[test]
fn nesting_is_bounded() {
    let nested = |n: usize| {
        let mut p = vec![0x80, 2];
        p.extend(std::iter::repeat_n(b']', n));
        p.extend(std::iter::repeat_n(b'a', n - 1));
        p
    };
    let deep = "ckpt.pt: PyTorch checkpoint: pickle: values nested more than 100 deep";
    let mut p = nested(300_000);
    p.push(b'.');
    assert_eq!(read_pickle(&p).unwrap_err().to_string(), deep);
    // 100 deep loads; a copy of it inside a tuple is one too many
    let mut p = nested(100);
    p.extend(PUT0);
    p.push(b'.');
    assert!(read_pickle(&p).unwrap().is_empty());
    p.pop();
    p.extend(GET0);
    p.extend([0x85, b'.']); // TUPLE1
    assert_eq!(read_pickle(&p).unwrap_err().to_string(), deep);
    // a copy wrapped in a tuple, put back, over and over
    let mut p = vec![0x80, 2, b']'];
    p.extend(PUT0);
    for _ in 0..200 {
        p.extend(GET0);
        p.push(0x85);
        p.extend(PUT0);
    }
    p.push(b'.');
    assert_eq!(read_pickle(&p).unwrap_err().to_string(), deep);
}

/// Dicts nested 99 deep under 512 kB keys, each copied from the memo: key
/// paths of 2.5 GB.
#[test]
fn key_paths_are_bounded() {
    let mut p = vec![0x80, 2];
    p.extend(string(&"k".repeat(1 << 19)));
    p.extend(PUT0);
    p.push(b'}');
    for _ in 0..98 {
        p.push(b'(');
        p.extend(GET0);
        p.push(b'}');
    }
    p.extend(std::iter::repeat_n(b'u', 98));
    p.push(b'.');
    assert_eq!(
        read_pickle(&p).unwrap_err().to_string(),
        "ckpt.pt: PyTorch checkpoint: the key paths of its nested dicts take more than 64 MiB"
    );
}

/// A string length of 2^64 − 1 bytes overflowed the reader's position.
#[test]
fn a_huge_string_length_is_a_truncated_pickle() {
    let mut p = vec![0x80, 2, 0x8d];
    p.extend(u64::MAX.to_le_bytes());
    assert_eq!(
        read_pickle(&p).unwrap_err().to_string(),
        "ckpt.pt: PyTorch checkpoint: pickle truncated at byte 11"
    );
}
