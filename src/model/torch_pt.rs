//! Reads tensors from PyTorch checkpoints (`torch.save` zip archives, pickle
//! protocol ≤ 3) — enough to import SparDA's trainer checkpoints (`ckpt-N.pt`,
//! spec/nosa-model.md §2): a dict whose `model_state_dict` holds the
//! forecast projections beside optimizer state.
//!
//! Only data is read: the pickle is interpreted by a small stack machine that
//! knows the opcodes `torch.save` emits and recognises two callables —
//! `torch._utils._rebuild_tensor_v2` (a tensor view of a storage) and
//! `collections.OrderedDict`; any other callable becomes an opaque value, and
//! no Python code is ever run.

use crate::weights::{DType, OwnedTensor};
use crate::{Error, Result};
use std::collections::HashMap;
use std::io::{Read, Seek};
use std::path::Path;

/// A pickled value (the subset torch.save produces).
#[derive(Debug, Clone, PartialEq)]
enum Val {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Val>),
    List(Vec<Val>),
    Dict(Vec<(Val, Val)>),
    Global(String, String),
    /// `BINPERSID` payload: ('storage', storage class, key, location, numel).
    Persistent(Box<Val>),
    /// A view of a storage.
    Tensor(TensorRef),
    /// A call we do not interpret.
    Opaque,
    Mark,
}

/// A tensor as the pickle describes it: which storage, dtype, offset, size, stride (elements).
#[derive(Debug, Clone, PartialEq)]
struct TensorRef {
    key: String,
    dtype: DType,
    offset: usize,
    size: Vec<usize>,
    stride: Vec<usize>,
}

fn bad(path: &Path, msg: impl Into<String>) -> Error {
    Error::checkpoint(path, format!("PyTorch checkpoint: {}", msg.into()))
}

fn storage_dtype(class: &str) -> Option<DType> {
    match class {
        "BFloat16Storage" => Some(DType::BF16),
        "HalfStorage" => Some(DType::F16),
        "FloatStorage" => Some(DType::F32),
        _ => None,
    }
}

/// Runs the pickle program `data` and returns the top value.
fn unpickle(data: &[u8], path: &Path) -> Result<Val> {
    let mut stack: Vec<Val> = Vec::new();
    let mut memo: HashMap<u64, Val> = HashMap::new();
    let mut i = 0usize;
    let take = |i: &mut usize, n: usize| -> Result<&[u8]> {
        let s = data
            .get(*i..*i + n)
            .ok_or_else(|| bad(path, format!("pickle truncated at byte {}", *i)))?;
        *i += n;
        Ok(s)
    };
    let u32le = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let pop_mark = |stack: &mut Vec<Val>| -> Result<Vec<Val>> {
        let m = stack
            .iter()
            .rposition(|v| *v == Val::Mark)
            .ok_or_else(|| bad(path, "pickle: MARK missing"))?;
        let items = stack.split_off(m + 1);
        stack.pop();
        Ok(items)
    };
    let pop = |stack: &mut Vec<Val>| {
        stack
            .pop()
            .ok_or_else(|| bad(path, "pickle: stack underflow"))
    };
    loop {
        let op = *take(&mut i, 1)?.first().expect("one byte");
        match op {
            0x80 => {
                take(&mut i, 1)?; // PROTO
            }
            0x95 => {
                take(&mut i, 8)?; // FRAME
            }
            b'.' => return pop(&mut stack), // STOP
            b'(' => stack.push(Val::Mark),
            b'}' => stack.push(Val::Dict(Vec::new())),
            b']' => stack.push(Val::List(Vec::new())),
            b')' => stack.push(Val::Tuple(Vec::new())),
            b'N' => stack.push(Val::None),
            0x88 => stack.push(Val::Bool(true)),
            0x89 => stack.push(Val::Bool(false)),
            b'K' => stack.push(Val::Int(take(&mut i, 1)?[0] as i64)),
            b'M' => {
                let b = take(&mut i, 2)?;
                stack.push(Val::Int(u16::from_le_bytes([b[0], b[1]]) as i64))
            }
            b'J' => {
                let b = take(&mut i, 4)?;
                stack.push(Val::Int(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64))
            }
            0x8a => {
                let n = take(&mut i, 1)?[0] as usize;
                let b = take(&mut i, n)?;
                if n > 8 {
                    return Err(bad(path, format!("pickle: {n}-byte integer")));
                }
                let mut v: i64 = 0;
                for (k, &x) in b.iter().enumerate() {
                    v |= (x as i64) << (8 * k);
                }
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                stack.push(Val::Int(v))
            }
            b'G' => {
                let b = take(&mut i, 8)?;
                stack.push(Val::Float(f64::from_be_bytes(
                    b.try_into().expect("8 bytes"),
                )))
            }
            b'X' | 0x8c | 0x8d => {
                let n = match op {
                    b'X' => u32le(take(&mut i, 4)?),
                    0x8c => take(&mut i, 1)?[0] as usize,
                    _ => {
                        let b = take(&mut i, 8)?;
                        u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize
                    }
                };
                let s = std::str::from_utf8(take(&mut i, n)?)
                    .map_err(|_| bad(path, "pickle: bad UTF-8"))?;
                stack.push(Val::Str(s.to_string()))
            }
            b'B' | b'C' => {
                let n = if op == b'B' {
                    u32le(take(&mut i, 4)?)
                } else {
                    take(&mut i, 1)?[0] as usize
                };
                stack.push(Val::Bytes(take(&mut i, n)?.to_vec()))
            }
            b'q' => {
                let k = take(&mut i, 1)?[0] as u64;
                memo.insert(
                    k,
                    stack
                        .last()
                        .cloned()
                        .ok_or_else(|| bad(path, "pickle: BINPUT on empty stack"))?,
                );
            }
            b'r' => {
                let k = u32le(take(&mut i, 4)?) as u64;
                memo.insert(
                    k,
                    stack
                        .last()
                        .cloned()
                        .ok_or_else(|| bad(path, "pickle: PUT on empty stack"))?,
                );
            }
            0x94 => {
                let k = memo.len() as u64;
                memo.insert(
                    k,
                    stack
                        .last()
                        .cloned()
                        .ok_or_else(|| bad(path, "pickle: MEMOIZE on empty stack"))?,
                );
            }
            b'h' | b'j' => {
                let k = if op == b'h' {
                    take(&mut i, 1)?[0] as u64
                } else {
                    u32le(take(&mut i, 4)?) as u64
                };
                stack.push(
                    memo.get(&k)
                        .cloned()
                        .ok_or_else(|| bad(path, format!("pickle: memo {k} unset")))?,
                )
            }
            b'c' => {
                let line = |i: &mut usize| -> Result<String> {
                    let end = data[*i..]
                        .iter()
                        .position(|&b| b == b'\n')
                        .ok_or_else(|| bad(path, "pickle: GLOBAL"))?;
                    let s = String::from_utf8_lossy(&data[*i..*i + end]).into_owned();
                    *i += end + 1;
                    Ok(s)
                };
                let module = line(&mut i)?;
                let name = line(&mut i)?;
                stack.push(Val::Global(module, name))
            }
            0x93 => {
                let name = pop(&mut stack)?;
                let module = pop(&mut stack)?;
                match (module, name) {
                    (Val::Str(m), Val::Str(n)) => stack.push(Val::Global(m, n)),
                    _ => return Err(bad(path, "pickle: STACK_GLOBAL without strings")),
                }
            }
            b'Q' => {
                let pid = pop(&mut stack)?;
                stack.push(Val::Persistent(Box::new(pid)))
            }
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Val::Tuple(items))
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if stack.len() < n {
                    return Err(bad(path, "pickle: stack underflow"));
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Val::Tuple(items))
            }
            b'l' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Val::List(items))
            }
            b'd' => {
                let items = pop_mark(&mut stack)?;
                let pairs = items
                    .chunks(2)
                    .filter(|c| c.len() == 2)
                    .map(|c| (c[0].clone(), c[1].clone()))
                    .collect();
                stack.push(Val::Dict(pairs))
            }
            b'a' => {
                let v = pop(&mut stack)?;
                if let Some(Val::List(l)) = stack.last_mut() {
                    l.push(v)
                }
            }
            b'e' => {
                let items = pop_mark(&mut stack)?;
                if let Some(Val::List(l)) = stack.last_mut() {
                    l.extend(items)
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                if let Some(Val::Dict(d)) = stack.last_mut() {
                    d.push((k, v))
                }
            }
            b'u' => {
                let items = pop_mark(&mut stack)?;
                if let Some(Val::Dict(d)) = stack.last_mut() {
                    d.extend(
                        items
                            .chunks(2)
                            .filter(|c| c.len() == 2)
                            .map(|c| (c[0].clone(), c[1].clone())),
                    );
                }
            }
            b'R' | 0x81 => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                stack.push(call(callable, args, path)?)
            }
            b'b' => {
                // BUILD: set state on the object; the state of tensors and dicts we read is irrelevant
                pop(&mut stack)?;
            }
            other => {
                return Err(bad(
                    path,
                    format!("pickle: unsupported opcode 0x{other:02x} at byte {}", i - 1),
                ))
            }
        }
    }
}

/// Applies the two callables we understand; anything else is opaque.
fn call(callable: Val, args: Val, path: &Path) -> Result<Val> {
    let Val::Global(module, name) = callable else {
        return Ok(Val::Opaque);
    };
    let args = match args {
        Val::Tuple(a) => a,
        _ => return Ok(Val::Opaque),
    };
    match (module.as_str(), name.as_str()) {
        ("collections", "OrderedDict") => Ok(Val::Dict(Vec::new())),
        ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
            let ints = |v: &Val| -> Option<Vec<usize>> {
                match v {
                    Val::Tuple(x) => x
                        .iter()
                        .map(|e| {
                            if let Val::Int(i) = e {
                                usize::try_from(*i).ok()
                            } else {
                                None
                            }
                        })
                        .collect(),
                    _ => None,
                }
            };
            let (Some(Val::Persistent(pid)), Some(Val::Int(offset)), Some(size), Some(stride)) = (
                args.first(),
                args.get(1),
                args.get(2).and_then(ints),
                args.get(3).and_then(ints),
            ) else {
                return Err(bad(path, "pickle: malformed _rebuild_tensor_v2 arguments"));
            };
            let Val::Tuple(p) = pid.as_ref() else {
                return Err(bad(path, "pickle: storage id is not a tuple"));
            };
            let (Some(Val::Global(_, class)), Some(Val::Str(key))) = (p.get(1), p.get(2)) else {
                return Err(bad(path, "pickle: malformed storage id"));
            };
            let dtype = storage_dtype(class)
                .ok_or_else(|| bad(path, format!("unsupported storage type {class}")))?;
            Ok(Val::Tensor(TensorRef {
                key: key.clone(),
                dtype,
                offset: usize::try_from(*offset).map_err(|_| {
                    bad(
                        path,
                        format!("pickle: tensor storage offset {offset} is negative"),
                    )
                })?,
                size,
                stride,
            }))
        }
        _ => Ok(Val::Opaque),
    }
}

/// Walks nested dicts, collecting (dotted key path, tensor).
fn collect(v: &Val, prefix: &str, out: &mut Vec<(String, TensorRef)>) {
    match v {
        Val::Dict(items) => {
            for (k, v) in items {
                let key = match k {
                    Val::Str(s) => s.clone(),
                    Val::Int(i) => i.to_string(),
                    _ => continue,
                };
                let full = if prefix.is_empty() {
                    key
                } else {
                    format!("{prefix}.{key}")
                };
                collect(v, &full, out);
            }
        }
        Val::Tensor(t) => out.push((prefix.to_string(), t.clone())),
        _ => {}
    }
}

/// The elements of view `t` of `storage`, row-major. The view must lie
/// inside the storage and hold at most as many elements as it (an expanded
/// or overlapping view, never saved for parameters or optimizer state, is
/// refused), so the result is never larger than the file. `Err` says why.
fn gather(t: &TensorRef, storage: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let es = t.dtype.size();
    let elems = storage.len() / es;
    if t.stride.len() != t.size.len() {
        return Err(format!(
            "size {:?} and stride {:?} differ in length",
            t.size, t.stride
        ));
    }
    let numel = t.size.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let numel = match numel {
        Some(n) if n <= elems => n,
        _ => {
            return Err(format!(
                "a view of size {:?} has more elements than storage {} ({elems} elements of {} bytes); \
                 expanded or overlapping views are not supported",
                t.size,
                t.key,
                es
            ))
        }
    };
    if numel == 0 {
        return Ok(Vec::new());
    }
    // The view's last element: offset + Σ (size − 1)·stride.
    let last = t
        .size
        .iter()
        .zip(&t.stride)
        .try_fold(t.offset, |a, (&n, &s)| {
            a.checked_add((n - 1).checked_mul(s)?)
        });
    if last.is_none_or(|l| l >= elems) {
        return Err(format!(
            "view (offset {}, size {:?}, stride {:?}) past the end of storage {} ({elems} elements)",
            t.offset, t.size, t.stride, t.key
        ));
    }
    let mut data = Vec::with_capacity(numel * es);
    let mut idx = vec![0usize; t.size.len()];
    for _ in 0..numel {
        let e = t.offset + idx.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
        data.extend_from_slice(&storage[e * es..(e + 1) * es]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < t.size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(data)
}

/// Reads every tensor of a `torch.save` checkpoint whose key path (nested
/// dict keys joined by '.', e.g. `model_state_dict.model.layers.0.…`) is
/// accepted by `want`, as row-major [`OwnedTensor`]s (strided views are
/// gathered).
///
/// Errors: not a zip archive, no `data.pkl`, an unsupported pickle opcode or
/// storage type, a view past the end of its storage or with more elements
/// than it (an expanded view) — each naming the file (and the tensor).
pub fn read_tensors(path: &Path, want: impl Fn(&str) -> bool) -> Result<Vec<OwnedTensor>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    read_tensors_from(file, path, want)
}

/// [`read_tensors`] on the contents of a checkpoint read from `archive`
/// (a file, or bytes in memory); `path` only names it in errors.
///
/// Errors: as [`read_tensors`].
pub fn read_tensors_from(
    archive: impl Read + Seek,
    path: &Path,
    want: impl Fn(&str) -> bool,
) -> Result<Vec<OwnedTensor>> {
    let mut zip =
        zip::ZipArchive::new(archive).map_err(|e| bad(path, format!("not a zip archive ({e})")))?;
    let pkl_name = (0..zip.len())
        .filter_map(|k| zip.name_for_index(k).map(str::to_string))
        .find(|n| n.ends_with("data.pkl"))
        .ok_or_else(|| bad(path, "no data.pkl inside (not written by torch.save?)"))?;
    let root = pkl_name.trim_end_matches("data.pkl").to_string();
    let mut read = |name: &str| -> Result<Vec<u8>> {
        let mut f = zip
            .by_name(name)
            .map_err(|e| bad(path, format!("{name}: {e}")))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).map_err(|e| Error::io(path, e))?;
        Ok(buf)
    };
    let top = unpickle(&read(&pkl_name)?, path)?;
    let mut refs = Vec::new();
    collect(&top, "", &mut refs);
    let mut out = Vec::new();
    for (name, t) in refs.into_iter().filter(|(n, _)| want(n)) {
        let storage = read(&format!("{root}data/{}", t.key))?;
        let data = gather(&t, &storage).map_err(|m| bad(path, format!("tensor `{name}`: {m}")))?;
        out.push(OwnedTensor {
            name,
            dtype: t.dtype,
            shape: t.size,
            data,
        });
    }
    Ok(out)
}
