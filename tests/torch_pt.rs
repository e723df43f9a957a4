//! The reader of SparDA's torch.save checkpoints on archives written here:
//! a one-tensor state dict whose pickle program is built byte by byte, so
//! that each test sets the view (offset, size, stride) the file claims.
//! Views the reader cannot honour are errors naming the file and tensor.
//! (Found by fuzzing; the inputs are in fuzz/regressions/torch_pickle/.)

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
