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

/// Deepest nesting of containers a pickle may build. torch.save's state
/// dicts and optimizer states nest fewer than 10 deep; the limit keeps
/// dropping, copying and walking values (recursive) far from a thread's
/// stack size.
const MAX_DEPTH: usize = 100;

/// Most bytes the memo copies (PUT, GET) of one pickle, and the key paths
/// [`collect`] builds, may take. torch.save's pickles copy small values
/// (a storage id, a tensor); without a limit a file of a few hundred bytes
/// can double a value with every copy.
const MAX_COPIED_BYTES: usize = 64 << 20;

/// Bytes `v` takes (its nodes and their strings), counted without
/// recursion; `None` once the count passes `limit`.
fn footprint(v: &Val, limit: usize) -> Option<usize> {
    let mut total = 0usize;
    let mut todo = vec![v];
    while let Some(v) = todo.pop() {
        total += std::mem::size_of::<Val>()
            + match v {
                Val::Str(s) => s.len(),
                Val::Bytes(b) => b.len(),
                Val::Global(m, n) => m.len() + n.len(),
                Val::Tensor(t) => t.key.len() + 8 * (t.size.len() + t.stride.len()),
                Val::Tuple(x) | Val::List(x) => {
                    todo.extend(x);
                    0
                }
                Val::Dict(x) => {
                    todo.extend(x.iter().flat_map(|(k, v)| [k, v]));
                    0
                }
                Val::Persistent(x) => {
                    todo.push(x);
                    0
                }
                Val::None
                | Val::Bool(_)
                | Val::Int(_)
                | Val::Float(_)
                | Val::Opaque
                | Val::Mark => 0,
            };
        if total > limit {
            return None;
        }
    }
    Some(total)
}

/// Consecutive items as (key, value) pairs; an odd last item is dropped.
fn pairs(items: Vec<Val>) -> Vec<(Val, Val)> {
    let mut it = items.into_iter();
    std::iter::from_fn(|| Some((it.next()?, it.next()?))).collect()
}

/// A value on the pickle machine's stack, with its nesting depth: 0 for a
/// scalar, 1 + the deepest item for a container.
type Slot = (Val, usize);

/// The values of `items` and the depth of a container holding them.
fn contain(items: Vec<Slot>, path: &Path) -> Result<(Vec<Val>, usize)> {
    let depth = 1 + items.iter().map(|s| s.1).max().unwrap_or(0);
    if depth > MAX_DEPTH {
        return Err(bad(
            path,
            format!("pickle: values nested more than {MAX_DEPTH} deep"),
        ));
    }
    Ok((items.into_iter().map(|s| s.0).collect(), depth))
}

/// Runs the pickle program `data` and returns the top value.
fn unpickle(data: &[u8], path: &Path) -> Result<Val> {
    let mut stack: Vec<Slot> = Vec::new();
    let mut memo: HashMap<u64, Slot> = HashMap::new();
    let mut i = 0usize;
    let take = |i: &mut usize, n: usize| -> Result<&[u8]> {
        let s = i
            .checked_add(n)
            .and_then(|end| data.get(*i..end))
            .ok_or_else(|| bad(path, format!("pickle truncated at byte {}", *i)))?;
        *i += n;
        Ok(s)
    };
    let mut copied = 0usize;
    let mut copy = |(v, depth): &Slot| -> Result<Slot> {
        copied += footprint(v, MAX_COPIED_BYTES - copied).ok_or_else(|| {
            bad(
                path,
                format!(
                    "pickle: its memo copies take more than {} MiB (it copies values over and over)",
                    MAX_COPIED_BYTES >> 20
                ),
            )
        })?;
        Ok((v.clone(), *depth))
    };
    let u32le = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let pop_mark = |stack: &mut Vec<Slot>| -> Result<Vec<Slot>> {
        let m = stack
            .iter()
            .rposition(|s| s.0 == Val::Mark)
            .ok_or_else(|| bad(path, "pickle: MARK missing"))?;
        let items = stack.split_off(m + 1);
        stack.pop();
        Ok(items)
    };
    let pop = |stack: &mut Vec<Slot>| {
        stack
            .pop()
            .ok_or_else(|| bad(path, "pickle: stack underflow"))
    };
    loop {
        let op = *take(&mut i, 1)?.first().expect("one byte");
        let scalar = match op {
            0x80 => {
                take(&mut i, 1)?; // PROTO
                None
            }
            0x95 => {
                take(&mut i, 8)?; // FRAME
                None
            }
            b'.' => return pop(&mut stack).map(|s| s.0), // STOP
            b'(' => Some(Val::Mark),
            b'N' => Some(Val::None),
            0x88 => Some(Val::Bool(true)),
            0x89 => Some(Val::Bool(false)),
            b'K' => Some(Val::Int(take(&mut i, 1)?[0] as i64)),
            b'M' => {
                let b = take(&mut i, 2)?;
                Some(Val::Int(u16::from_le_bytes([b[0], b[1]]) as i64))
            }
            b'J' => {
                let b = take(&mut i, 4)?;
                Some(Val::Int(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64))
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
                Some(Val::Int(v))
            }
            b'G' => {
                let b = take(&mut i, 8)?;
                Some(Val::Float(f64::from_be_bytes(
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
                Some(Val::Str(s.to_string()))
            }
            b'B' | b'C' => {
                let n = if op == b'B' {
                    u32le(take(&mut i, 4)?)
                } else {
                    take(&mut i, 1)?[0] as usize
                };
                Some(Val::Bytes(take(&mut i, n)?.to_vec()))
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
                Some(Val::Global(module, name))
            }
            0x93 => {
                let name = pop(&mut stack)?.0;
                let module = pop(&mut stack)?.0;
                match (module, name) {
                    (Val::Str(m), Val::Str(n)) => Some(Val::Global(m, n)),
                    _ => return Err(bad(path, "pickle: STACK_GLOBAL without strings")),
                }
            }
            _ => None,
        };
        if let Some(v) = scalar {
            stack.push((v, 0));
            continue;
        }
        match op {
            0x80 | 0x95 => {}
            b'}' => stack.push((Val::Dict(Vec::new()), 1)),
            b']' => stack.push((Val::List(Vec::new()), 1)),
            b')' => stack.push((Val::Tuple(Vec::new()), 1)),
            b'q' | b'r' | 0x94 => {
                let k = match op {
                    b'q' => take(&mut i, 1)?[0] as u64,
                    b'r' => u32le(take(&mut i, 4)?) as u64,
                    _ => memo.len() as u64,
                };
                let top = stack.last().ok_or_else(|| {
                    bad(
                        path,
                        format!("pickle: memo put (0x{op:02x}) on empty stack"),
                    )
                })?;
                memo.insert(k, copy(top)?);
            }
            b'h' | b'j' => {
                let k = if op == b'h' {
                    take(&mut i, 1)?[0] as u64
                } else {
                    u32le(take(&mut i, 4)?) as u64
                };
                let v = memo
                    .get(&k)
                    .ok_or_else(|| bad(path, format!("pickle: memo {k} unset")))?;
                stack.push(copy(v)?)
            }
            b'Q' => {
                let pid = pop(&mut stack)?;
                let (mut v, depth) = contain(vec![pid], path)?;
                stack.push((Val::Persistent(Box::new(v.remove(0))), depth))
            }
            b't' | b'l' | 0x85..=0x87 => {
                let items = if op == b't' || op == b'l' {
                    pop_mark(&mut stack)?
                } else {
                    let n = (op - 0x84) as usize;
                    if stack.len() < n {
                        return Err(bad(path, "pickle: stack underflow"));
                    }
                    stack.split_off(stack.len() - n)
                };
                let (items, depth) = contain(items, path)?;
                let v = if op == b'l' {
                    Val::List(items)
                } else {
                    Val::Tuple(items)
                };
                stack.push((v, depth))
            }
            b'd' => {
                let (items, depth) = contain(pop_mark(&mut stack)?, path)?;
                stack.push((Val::Dict(pairs(items)), depth))
            }
            b'a' | b'e' | b's' | b'u' => {
                let items = match op {
                    b'a' => vec![pop(&mut stack)?],
                    b's' => {
                        let v = pop(&mut stack)?;
                        let k = pop(&mut stack)?;
                        vec![k, v]
                    }
                    _ => pop_mark(&mut stack)?,
                };
                let (items, depth) = contain(items, path)?;
                match stack.last_mut() {
                    Some((Val::List(l), d)) if op == b'a' || op == b'e' => {
                        l.extend(items);
                        *d = (*d).max(depth);
                    }
                    Some((Val::Dict(m), d)) if op == b's' || op == b'u' => {
                        m.extend(pairs(items));
                        *d = (*d).max(depth);
                    }
                    _ => {}
                }
            }
            b'R' | 0x81 => {
                let args = pop(&mut stack)?.0;
                let callable = pop(&mut stack)?.0;
                // an empty dict, a tensor or an opaque value
                stack.push((call(callable, args, path)?, 1))
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
/// Key paths take at most `*budget` bytes in all; `Err` once they would
/// take more.
fn collect(
    v: &Val,
    prefix: &str,
    out: &mut Vec<(String, TensorRef)>,
    budget: &mut usize,
) -> std::result::Result<(), ()> {
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
                *budget = budget.checked_sub(full.len()).ok_or(())?;
                collect(v, &full, out, budget)?;
            }
        }
        Val::Tensor(t) => out.push((prefix.to_string(), t.clone())),
        _ => {}
    }
    Ok(())
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
    let mut budget = MAX_COPIED_BYTES;
    collect(&top, "", &mut refs, &mut budget).map_err(|()| {
        bad(
            path,
            format!(
                "the key paths of its nested dicts take more than {} MiB",
                MAX_COPIED_BYTES >> 20
            ),
        )
    })?;
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
