//! Kernel guards that report to the device error record
//! ([`crate::cuda::device_error`]), provoked on purpose, called from
//! [`gpu_check`](super::kernels::gpu_check) (group `guards`; its cases go
//! into the same report). Each case feeds a kernel one bad row among good
//! ones and asserts that the record holds exactly the expected error
//! (kernel, row, layer, KV head, value, limit), that the good rows were
//! processed and the bad one skipped as documented, that
//! [`DeviceErrors::take`] turns it into the expected [`Error::Limit`] and
//! clears it:
//!
//! - `qkv_rope_append (guard)`: a position equal to the RoPE table's rows
//!   (and, second part, two bad rows: the first error wins, one is kept);
//! - `select_blocks (guard)`: a row with more blocks than the launch's cap;
//! - `slot_diff (guard)`: a (row, KV head) with 6 misses and 4 free slots;
//! - `GpuModel (guard)`: the engine end to end — a device-fed decode step
//!   replayed from its CUDA graph with a position past the RoPE table
//!   written into its device-resident inputs: [`GpuModel::argmax`] must
//!   fail with layer 0's `qkv_rope_append` error, and the next check must
//!   find the record cleared.
//! - `sample_rows (non-finite)`, `GpuModel (non-finite)`: logits rows no
//!   token can be chosen from ([`sample::check_logits`]: a NaN, a +inf, all
//!   −inf) through the sampling kernel and through the engine (injected
//!   into the logits buffer, and produced inside a graph-replayed decode
//!   step by a NaN final-norm weight): [`check_nonfinite_logits`].
//!
//! `rel_l2` is the fraction of failed assertions, tolerance 0.

use super::kernels::CaseResult;
use crate::config::{RopeScaling, SparseConfig};
use crate::cpu::EngineOptions;
use crate::cuda::context::dptr;
use crate::cuda::device_error::{DeviceError, DeviceErrorKind, DeviceErrors};
use crate::cuda::ops::offload::{self, SlotDiffArgs};
use crate::cuda::ops::select::{launch_select_blocks, SelectBlocksArgs};
use crate::cuda::ops::{self, EvictionWeights, RopeTables};
use crate::cuda::{Bf16, Gpu};
use crate::model::select::Budget;
use crate::pipeline::{DecodeMode, GpuModel};
use crate::sample::{self, SamplingParams};
use crate::synth::{self, Preset};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;
use rand::rngs::SmallRng;
use rand::Rng;
use serde_json::{json, Value};
use std::sync::Arc;

/// Assertions of one case: how many, how many failed, the first failure.
struct Asserts {
    n: usize,
    bad: usize,
    first: Option<String>,
}

impl Asserts {
    fn new() -> Self {
        Asserts {
            n: 0,
            bad: 0,
            first: None,
        }
    }
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.n += 1;
        if !ok {
            self.bad += 1;
            if self.first.is_none() {
                self.first = Some(what());
            }
        }
    }
    /// The record holds `want` (peeked, not cleared).
    fn record_is(&mut self, errs: &DeviceErrors, want: &DeviceError) {
        let got = errs.peek();
        self.check(matches!(&got, Ok(Some(g)) if g == want), || {
            format!("device error record {got:?}, want {want:?}")
        });
    }
    /// `take` returns `want`'s error, then the record is clear.
    fn take_is(&mut self, errs: &DeviceErrors, want: &DeviceError) {
        let msg = want.to_error().to_string();
        match errs.take() {
            Err(e @ Error::Limit(_)) => {
                self.check(e.to_string() == msg, || format!("take(): {e}, want {msg}"))
            }
            other => self.check(false, || format!("take(): {other:?}, want Err({msg})")),
        }
        let after = errs.peek();
        self.check(matches!(after, Ok(None)), || {
            format!("record after take(): {after:?}, want cleared")
        });
    }
}

fn finish(out: &mut Vec<CaseResult>, kernel: &str, shape: Value, r: Result<Asserts>) {
    let res = match r {
        Ok(a) => {
            let frac = if a.n == 0 {
                1.0
            } else {
                a.bad as f64 / a.n as f64
            };
            CaseResult {
                kernel: kernel.into(),
                shape,
                rel_l2: frac,
                max_abs_err: a.bad as f64,
                tolerance: 0.0,
                pass: a.bad == 0 && a.n > 0,
                error: a
                    .first
                    .map(|f| format!("{} of {} assertions failed; first: {f}", a.bad, a.n)),
            }
        }
        Err(e) => CaseResult::failed(kernel, shape, 0.0, e.to_string()),
    };
    println!(
        "{:<26} {:<70} rel_l2 {:>10.3e}  {}",
        res.kernel,
        {
            let s = res.shape.to_string();
            if s.chars().count() > 70 {
                s.chars().take(67).collect::<String>() + "..."
            } else {
                s
            }
        },
        res.rel_l2,
        if res.pass { "ok" } else { "FAIL" }
    );
    if let Some(e) = &res.error {
        println!("    error: {e}");
    }
    out.push(res);
}

/// Runs every guard case; failures are recorded, never returned.
pub fn check_guards(gpu: &Arc<Gpu>, rng: &mut SmallRng) -> Vec<CaseResult> {
    let mut out = Vec::new();
    let r = rope_guard(gpu, rng);
    finish(
        &mut out,
        "qkv_rope_append (guard)",
        json!({"G": 8, "Hkv": 2, "D": 128, "table_rows": 64, "positions": [5, 64, 7], "then": [5, 70, 80], "layer": 11}),
        r,
    );
    let r = select_guard(gpu, rng);
    finish(
        &mut out,
        "select_blocks (guard)",
        json!({"Hkv": 2, "lens": [100, 2000, 300], "blocks_cap": 16, "layer": 5, "rule": "InfLlmV2"}),
        r,
    );
    let r = slot_diff_guard(gpu);
    finish(
        &mut out,
        "slot_diff (guard)",
        json!({"rows": 2, "Hkv": 2, "S": 4, "len": 1280, "selected": [[3, 2], [2, 6]], "layer": 9}),
        r,
    );
    let r = engine_guard(gpu);
    finish(
        &mut out,
        "GpuModel (guard)",
        json!({"model": "tiny", "step": "graph replay, device-fed", "position": "RoPE table rows"}),
        r,
    );
    out.extend(check_nonfinite_logits(gpu, rng));
    out
}

/// bf16 N(0, 1) values.
fn bf16_randn(rng: &mut SmallRng, n: usize) -> Vec<Bf16> {
    super::kernels::bf16_normal(rng, n, 1.0).0
}

fn rope_guard(gpu: &Gpu, rng: &mut SmallRng) -> Result<Asserts> {
    let (g, hk, d) = (8usize, 2usize, 128usize);
    let (hq, kvd) = (g * hk, hk * d);
    let row = (hq + 2 * hk) * d;
    let table_rows = 64usize;
    let rope = crate::config::Rope::new(d, 10_000.0, 8192, RopeScaling::Default);
    let tables = RopeTables::from_rope(gpu, &rope, d, table_rows, table_rows)?;
    let a: Vec<f32> = (0..hk).map(|_| rng.random_range(0.2..2.0)).collect();
    let delta: Vec<f32> = (0..hk * kvd).map(|_| rng.random_range(-0.1..0.1)).collect();
    let head = EvictionWeights::new(gpu, &a, &delta, None, hk, d)?;
    let errs = DeviceErrors::new(gpu)?;
    let layer = 11usize;
    let mut t = Asserts::new();
    for (part, positions) in [[5usize, 64, 7], [5, 70, 80]].into_iter().enumerate() {
        // Caches with room for every position (the guard is the table, not
        // the capacity), NaN-poisoned.
        let cap = 81usize;
        let caches: Vec<(CudaSlice<Bf16>, CudaSlice<Bf16>, CudaSlice<f32>)> = (0..3)
            .map(|_| {
                Ok((
                    gpu.upload(&vec![Bf16(0x7fc0); cap * kvd])?,
                    gpu.upload(&vec![Bf16(0x7fc0); cap * kvd])?,
                    gpu.upload(&vec![f32::NAN; cap * hk])?,
                ))
            })
            .collect::<Result<_>>()?;
        let rows: Vec<ops::AppendRow<'_>> = positions
            .iter()
            .zip(&caches)
            .map(|(&pos, (k, v, c))| ops::AppendRow {
                pos,
                k,
                v,
                c: Some(c),
            })
            .collect();
        let mut x = gpu.upload(&bf16_randn(rng, 3 * row))?;
        ops::qkv_rope_append(
            gpu,
            &mut x,
            row,
            hq,
            hk,
            d,
            &rows,
            &tables,
            Some(&head),
            0,
            errs.sink(layer),
        )?;
        gpu.synchronize()?;
        // Rows inside the table are appended and scored; rows outside are not.
        for (i, (&pos, (k, _, c))) in positions.iter().zip(&caches).enumerate() {
            let (kh, ch) = (gpu.download(k)?, gpu.download(c)?);
            let p = pos.min(cap - 1);
            let written = kh[p * kvd..(p + 1) * kvd]
                .iter()
                .all(|x| x.to_f32().is_finite())
                && ch[p * hk..(p + 1) * hk].iter().all(|x| x.is_finite());
            let untouched = kh.iter().all(|x| x.to_f32().is_nan());
            let inside = pos < table_rows;
            t.check(if inside { written } else { untouched }, || {
                format!(
                    "part {part}, row {i} at position {pos}: {}",
                    if inside {
                        "not appended"
                    } else {
                        "written past the table"
                    }
                )
            });
        }
        let want = |row: i32, value: i32| DeviceError {
            kind: DeviceErrorKind::RopePosition,
            row,
            layer: layer as i32,
            head: None,
            value,
            limit: table_rows as i32,
            count: 0,
        };
        if part == 0 {
            let w = want(1, 64);
            t.record_is(&errs, &w);
            t.take_is(&errs, &w);
        } else {
            // Two bad rows: the first to claim the record wins, the other is dropped.
            let got = errs.peek()?;
            let ok = got == Some(want(1, 70)) || got == Some(want(2, 80));
            t.check(ok, || {
                format!("record {got:?}, want row 1 at 70 or row 2 at 80")
            });
            if let Some(g) = got {
                t.take_is(&errs, &g);
            }
        }
    }
    Ok(t)
}

fn select_guard(gpu: &Gpu, rng: &mut SmallRng) -> Result<Asserts> {
    let budget = Budget::new(&SparseConfig::default());
    let hk = 2usize;
    let lens = [100usize, 2000, 300];
    let rows = lens.len();
    let cap = 16usize;
    let nb: Vec<usize> = lens.iter().map(|&l| budget.blocks(l - 1)).collect();
    let w_stride = budget.windows(2000).div_ceil(64) * 64;
    let s_max = budget.attended;
    let scores: Vec<f32> = (0..rows * hk * w_stride)
        .map(|_| rng.random_range(0.0..1.0))
        .collect();
    let scores = gpu.upload(&scores)?;
    let lens_d = gpu.upload(&lens.map(|l| l as i32))?;
    let sel = gpu.upload(&vec![i32::MIN; rows * hk * s_max])?;
    let nsel = gpu.upload(&vec![i32::MIN; rows * hk])?;
    let errs = DeviceErrors::new(gpu)?;
    let layer = 5usize;
    let args = SelectBlocksArgs {
        scores: dptr(gpu, &scores),
        p: 0,
        lens: dptr(gpu, &lens_d),
        sel: dptr(gpu, &sel),
        nsel: dptr(gpu, &nsel),
        pooled_r: 0,
        pooled_e: 0,
        w_stride,
        s_max,
        nb_stride: 0,
        blocks: cap,
        kv_heads: hk,
        rows,
        nosa: false,
        win_lens: 0,
        err: errs.sink(layer),
    };
    // SAFETY: scores hold rows·Hkv·w_stride ≥ Mc windows per row, the lists
    // rows·Hkv·s_max and rows·Hkv entries; a row past `blocks` is the guard
    // under test (the kernel clears it without reading further).
    unsafe { launch_select_blocks(gpu, &budget, &args, "select_blocks (guard)") }?;
    gpu.synchronize()?;
    let (sel_h, nsel_h) = (gpu.download(&sel)?, gpu.download(&nsel)?);
    let mut t = Asserts::new();
    for (b, &n) in nb.iter().enumerate() {
        for h in 0..hk {
            let r = b * hk + h;
            let row = &sel_h[r * s_max..(r + 1) * s_max];
            let (want_n, want): (usize, Vec<i32>) = if n > cap {
                (0, vec![-1; s_max])
            } else {
                // Under the budget: every block.
                let k = n.min(budget.attended);
                (
                    k,
                    (0..s_max as i32)
                        .map(|i| if (i as usize) < k { i } else { -1 })
                        .collect(),
                )
            };
            t.check(nsel_h[r] == want_n as i32 && row == want, || {
                format!(
                    "row {b} ({n} blocks), head {h}: nsel {} list {:?}, want {want_n} {:?}",
                    nsel_h[r],
                    &row[..row.len().min(8)],
                    &want[..want.len().min(8)]
                )
            });
        }
    }
    // Both KV heads of row 1 fail; either may claim the record first.
    let got = errs.peek()?;
    let want = |h: i32| DeviceError {
        kind: DeviceErrorKind::SelectBlocksCap,
        row: 1,
        layer: layer as i32,
        head: Some(h),
        value: nb[1] as i32,
        limit: cap as i32,
        count: 0,
    };
    t.check(got == Some(want(0)) || got == Some(want(1)), || {
        format!("record {got:?}, want {:?} (head 0 or 1)", want(0))
    });
    if let Some(g) = got {
        t.take_is(&errs, &g);
    }
    Ok(t)
}

fn slot_diff_guard(gpu: &Gpu) -> Result<Asserts> {
    const BS: usize = 64;
    let (rows, hkv, s, s_max) = (2usize, 2usize, 4usize, 8usize);
    let len = 20 * BS; // ring_first = 18: blocks 0…17 need slots
                       // (row, head) selections, all below the ring; (1, 1) has 6 misses for 4 slots.
    let picks: [&[i32]; 4] = [&[0, 1, 2], &[3, 4], &[5, 6], &[1, 2, 3, 4, 5, 6]];
    let mut sel = vec![-1i32; rows * hkv * s_max];
    let mut nsel = vec![0i32; rows * hkv];
    for (u, p) in picks.iter().enumerate() {
        sel[u * s_max..u * s_max + p.len()].copy_from_slice(p);
        nsel[u] = p.len() as i32;
    }
    let maps = gpu.upload(&vec![-1i32; rows * hkv * s])?;
    let base = dptr(gpu, &maps);
    let tab: Vec<u64> = (0..rows).map(|r| base + (r * hkv * s * 4) as u64).collect();
    let tab = gpu.upload(&tab)?;
    let (sel_d, nsel_d) = (gpu.upload(&sel)?, gpu.upload(&nsel)?);
    let lens = gpu.upload(&vec![len as i32; rows])?;
    let slot_list = gpu.upload(&vec![i32::MIN; rows * hkv * s_max])?;
    let fetch = gpu.upload(&vec![i32::MIN; rows * hkv * s * 2])?;
    let nfetch = gpu.upload(&vec![i32::MIN; rows * hkv])?;
    let errs = DeviceErrors::new(gpu)?;
    let layer = 9usize;
    let a = SlotDiffArgs {
        sel: dptr(gpu, &sel_d),
        nsel: dptr(gpu, &nsel_d),
        s_max,
        lens: dptr(gpu, &lens),
        slot_tab: dptr(gpu, &tab),
        slots: s,
        block_size: BS,
        kv_heads: hkv,
        rows,
        slot_list: dptr(gpu, &slot_list),
        fetch: dptr(gpu, &fetch),
        nfetch: dptr(gpu, &nfetch),
        stats: 0,
        err: errs.sink(layer),
        aged: false,
    };
    offload::slot_diff(gpu, gpu.stream(), &a)?;
    gpu.synchronize()?;
    let (sl, nf) = (gpu.download(&slot_list)?, gpu.download(&nfetch)?);
    let mut t = Asserts::new();
    for (u, p) in picks.iter().enumerate() {
        // Empty pools: misses take slots 0, 1, … in ascending block order;
        // past the free slots, slot −1 (not fetched).
        let fetched = p.len().min(s);
        let want: Vec<i32> = (0..s_max as i32)
            .map(|i| if (i as usize) < fetched { i } else { -1 })
            .collect();
        let got = &sl[u * s_max..(u + 1) * s_max];
        t.check(nf[u] == fetched as i32 && got == want, || {
            format!(
                "row {}, head {}: nfetch {} slot_list {got:?}, want {fetched} {want:?}",
                u / hkv,
                u % hkv,
                nf[u]
            )
        });
    }
    let want = DeviceError {
        kind: DeviceErrorKind::SlotDiffNoSlot,
        row: 1,
        layer: layer as i32,
        head: Some(1),
        value: 6,
        limit: 4,
        count: 0,
    };
    t.record_is(&errs, &want);
    t.take_is(&errs, &want);
    Ok(t)
}

fn engine_guard(gpu: &Arc<Gpu>) -> Result<Asserts> {
    let ckpt = synth::build(Preset::Tiny, 21)?;
    let mut model = GpuModel::new(gpu.clone(), &ckpt, EngineOptions::default())?;
    model.set_decode_mode(DecodeMode::Graph);
    let vocab = ckpt.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..100u32).map(|i| (i * 7919) % (vocab - 3) + 3).collect();
    let mut seqs = vec![model.new_sequence(prompt.len() + 16)?];
    let mut t = Asserts::new();
    model.prefill(&mut seqs[0], &prompt, |_, _| {})?;
    let first = model.argmax()?;
    // Build (eager), capture, replay: clean steps raise nothing.
    model.decode(&mut seqs, &first)?;
    model.decode_greedy(&mut seqs)?;
    model.decode_greedy(&mut seqs)?;
    let clean = model.argmax();
    t.check(clean.is_ok(), || format!("clean steps: {clean:?}"));
    // The next step's position (row 0), written into the device-resident step
    // inputs [ids n | pos n | lens n | seq_lens n] (n = 1): the RoPE table's rows.
    let rows = model.rope_tables.as_ref().map_or(0, |r| r.rows);
    {
        let st = model.step.as_mut().expect("a decode step was built");
        gpu.stream()
            .memcpy_htod(&[rows as u32], &mut st.io.slice_mut(1..2))
            .map_err(|e| Error::Cuda(format!("writing the step position: {e}")))?;
    }
    model.decode_greedy(&mut seqs)?;
    t.check(model.last_step_was_graph(), || {
        "the provoked step did not replay the CUDA graph".into()
    });
    // Every layer's append fails; layer 0 runs first and keeps the record.
    let want = DeviceError {
        kind: DeviceErrorKind::RopePosition,
        row: 0,
        layer: 0,
        head: None,
        value: rows as i32,
        limit: rows as i32,
        count: 0,
    }
    .to_error()
    .to_string();
    match model.argmax() {
        Err(e @ Error::Limit(_)) => t.check(e.to_string() == want, || {
            format!("argmax: {e}, want {want}")
        }),
        other => t.check(false, || format!("argmax: {other:?}, want Err({want})")),
    }
    let again = model.check_device_errors();
    t.check(again.is_ok(), || {
        format!("check_device_errors after the report: {again:?}, want Ok (cleared)")
    });
    Ok(t)
}

/// Sampling parameters of the non-finite cases: greedy and sampled.
const NONFINITE_PARAMS: [SamplingParams; 2] = [
    SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    },
    SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 0,
    },
];

/// A finite row of `vocab` logits.
fn finite_row(rng: &mut SmallRng, vocab: usize) -> Vec<f32> {
    (0..vocab).map(|_| rng.random_range(-4.0f32..4.0)).collect()
}

/// Rows no token can be chosen from ([`sample::check_logits`]), by name.
fn nonfinite_rows(rng: &mut SmallRng, vocab: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut one_nan = finite_row(rng, vocab);
    one_nan[vocab / 3] = f32::NAN;
    let mut pos_inf = finite_row(rng, vocab);
    pos_inf[vocab / 2] = f32::INFINITY;
    pos_inf[vocab - 1] = f32::INFINITY;
    let mut nan_inf = finite_row(rng, vocab);
    nan_inf[7] = f32::INFINITY;
    nan_inf[vocab - 2] = f32::NAN;
    nan_inf[vocab - 5] = f32::NAN;
    vec![
        ("all NaN", vec![f32::NAN; vocab]),
        ("one NaN", one_nan),
        ("+inf", pos_inf),
        ("NaN and +inf", nan_inf),
        ("all -inf", vec![f32::NEG_INFINITY; vocab]),
    ]
}

/// The record a kernel must write for row `row` holding `fault`.
fn logits_record(fault: sample::LogitsFault, row: usize) -> DeviceError {
    use sample::LogitsFault as F;
    let (kind, value, count, vocab) = match fault {
        F::Nan { id, count, vocab } => (DeviceErrorKind::LogitsNan, id as i32, count, vocab),
        F::PosInf { id, count, vocab } => (DeviceErrorKind::LogitsPosInf, id as i32, count, vocab),
        F::NoFinite { vocab } => (DeviceErrorKind::LogitsNoFinite, -1, vocab, vocab),
    };
    DeviceError {
        kind,
        row: row as i32,
        layer: -1,
        head: None,
        value,
        limit: vocab as i32,
        count: count as i32,
    }
}

/// `r` is [`Error::NonFiniteLogits`] with `step`, sequence `seq` and `what`.
fn is_nonfinite(
    r: &Result<impl std::fmt::Debug>,
    step: Option<usize>,
    seq: usize,
    what: &str,
) -> bool {
    matches!(r, Err(Error::NonFiniteLogits { step: s, sequence: Some(q), layer: None, what: w })
        if *s == step && *q == seq && w == what)
}

/// `sample_rows` (both its greedy and its sampling path) on three rows, the
/// middle one non-finite: the record names row 1 with the fault
/// `check_logits` gives for it (id, count, V), `take` turns it into
/// [`Error::NonFiniteLogits`] for sequence 1, the good rows get their
/// tokens and the bad one its argmax; a row with −inf entries among finite
/// ones raises nothing.
fn sample_rows_nonfinite(gpu: &Gpu, rng: &mut SmallRng) -> Result<Asserts> {
    let vocab = 1000;
    let errs = DeviceErrors::new(gpu)?;
    let mut t = Asserts::new();
    let u = [0.25f64, 0.5, 0.75];
    for p in NONFINITE_PARAMS {
        for (name, bad) in nonfinite_rows(rng, vocab) {
            let good = [finite_row(rng, vocab), finite_row(rng, vocab)];
            let x: Vec<f32> = [&good[0][..], &bad[..], &good[1][..]].concat();
            let dev = gpu.upload(&x)?;
            let got = ops::sample_rows(gpu, &dev, 3, vocab, &p, &u, errs.sink(0))?;
            let want = [
                sample::sample_with_u(&p, &good[0], u[0]),
                sample::argmax(&bad),
                sample::sample_with_u(&p, &good[1], u[2]),
            ];
            t.check(got == want, || {
                format!("{name}, T {}: ids {got:?}, want {want:?}", p.temperature)
            });
            let fault = sample::check_logits(&bad).err();
            t.check(fault.is_some(), || {
                format!("{name}: check_logits passes it")
            });
            let Some(fault) = fault else { continue };
            t.record_is(&errs, &logits_record(fault, 1));
            let r = errs.take();
            t.check(is_nonfinite(&r, None, 1, &fault.to_string()), || {
                format!(
                    "{name}, T {}: take() {r:?}, want NonFiniteLogits for sequence 1: {fault}",
                    p.temperature
                )
            });
        }
        let mut masked = finite_row(rng, vocab);
        masked[3] = f32::NEG_INFINITY;
        let dev = gpu.upload(&masked)?;
        ops::sample_rows(gpu, &dev, 1, vocab, &p, &u[..1], errs.sink(0))?;
        let r = errs.peek();
        t.check(matches!(r, Ok(None)), || {
            format!(
                "−inf among finite logits, T {}: record {r:?}, want none",
                p.temperature
            )
        });
        errs.clear();
    }
    Ok(t)
}

/// The engine end to end on the tiny model: NaN / all −inf written into the
/// prefill's logits buffer make [`GpuModel::argmax`] and
/// [`GpuModel::sample`] fail with [`Error::NonFiniteLogits`] for sequence 0
/// (and clear the record); a generation whose final-norm weight turns NaN
/// after its third token (every later logit NaN, computed inside the decode
/// step, replayed from its CUDA graph) fails at decode step 3, sequence 0,
/// greedy and sampled.
fn engine_nonfinite(gpu: &Arc<Gpu>) -> Result<Asserts> {
    let ckpt = synth::build(Preset::Tiny, 21)?;
    let vocab = ckpt.config.vocab_size;
    let prompt: Vec<u32> = (0..100u32)
        .map(|i| (i * 7919) % (vocab as u32 - 3) + 3)
        .collect();
    let mut t = Asserts::new();
    for (name, value) in [("all NaN", f32::NAN), ("all -inf", f32::NEG_INFINITY)] {
        let mut model = GpuModel::new(gpu.clone(), &ckpt, EngineOptions::default())?;
        let mut seq = model.new_sequence(prompt.len() + 8)?;
        model.prefill(&mut seq, &prompt, |_, _| {})?;
        let fault = sample::check_logits(&vec![value; vocab])
            .err()
            .map(|f| f.to_string())
            .unwrap_or_default();
        for p in NONFINITE_PARAMS {
            {
                let ws = model.ws.as_mut().expect("a prefill workspace");
                gpu.stream()
                    .memcpy_htod(&vec![value; vocab], &mut ws.logits.slice_mut(0..vocab))
                    .map_err(|e| Error::Cuda(format!("writing the logits: {e}")))?;
            }
            let r = if p.temperature == 0.0 {
                model.argmax()
            } else {
                model.sample(&p, &[0.5])
            };
            t.check(is_nonfinite(&r, None, 0, &fault), || {
                format!(
                    "{name}, T {}: {r:?}, want NonFiniteLogits for sequence 0: {fault}",
                    p.temperature
                )
            });
            let again = model.check_device_errors();
            t.check(again.is_ok(), || {
                format!("{name}: record not cleared: {again:?}")
            });
        }
    }
    for p in NONFINITE_PARAMS {
        let mut model = GpuModel::new(gpu.clone(), &ckpt, EngineOptions::default())?;
        model.set_decode_mode(DecodeMode::Graph);
        let norm = dptr(gpu, &model.final_norm);
        let norm_bytes = model.final_norm.len() * 2;
        let g = gpu.clone();
        let req = crate::generate::Request {
            prompt: prompt.clone(),
            max_new_tokens: 8,
            sampling: p,
            stop_ids: vec![],
            logprobs: None,
        };
        let mut n = 0;
        let r = crate::generate::generate_gpu(
            &mut model,
            &req,
            |_, _| {},
            |_| {
                n += 1;
                if n == 3 {
                    // bf16 0xFFFF is a NaN: every later logit is NaN
                    // SAFETY: `norm` is the live final-norm weight of `model`
                    // (norm_bytes long), on this stream.
                    unsafe {
                        cudarc::driver::result::memset_d8_async(
                            norm,
                            0xFF,
                            norm_bytes,
                            g.stream().cu_stream(),
                        )
                    }
                    .map_err(|e| Error::Cuda(format!("poisoning the final norm: {e}")))?;
                }
                Ok(())
            },
        );
        let want = format!("NaN at id 0 ({vocab} of {vocab} entries NaN)");
        let r = r.map(|o| o.tokens);
        t.check(is_nonfinite(&r, Some(3), 0, &want), || {
            format!(
                "generate, T {}: {r:?}, want NonFiniteLogits at decode step 3, sequence 0: {want}",
                p.temperature
            )
        });
        t.check(model.last_step_was_graph(), || {
            "the poisoned step did not replay the CUDA graph".into()
        });
    }
    Ok(t)
}

/// The non-finite logits cases (part of [`check_guards`]; also run alone by
/// the ignored test `gpu_nonfinite_logits_are_errors` in
/// tests/gpu_kernels.rs), one [`CaseResult`] each: `sample_rows
/// (non-finite)` — NaN, +inf and all −inf rows (greedy and sampled) must be
/// reported with the row, lowest id, count and V that
/// [`sample::check_logits`] gives, and −inf among finite logits must not;
/// `GpuModel (non-finite)` — NaN / −inf written into the engine's logits
/// buffer after a prefill, and NaN logits computed inside a graph-replayed
/// decode step mid-generation, must come back as
/// [`Error::NonFiniteLogits`] naming the sequence (and decode step 3).
pub fn check_nonfinite_logits(gpu: &Arc<Gpu>, rng: &mut SmallRng) -> Vec<CaseResult> {
    let mut out = Vec::new();
    let r = sample_rows_nonfinite(gpu, rng);
    finish(
        &mut out,
        "sample_rows (non-finite)",
        json!({"vocab": 1000, "rows": 3, "bad_row": 1, "logits": ["all NaN", "one NaN", "+inf", "NaN and +inf", "all -inf"], "temperature": [0.0, 0.8]}),
        r,
    );
    let r = engine_nonfinite(gpu);
    finish(
        &mut out,
        "GpuModel (non-finite)",
        json!({"model": "tiny", "injected": ["NaN / -inf logits after prefill", "NaN final norm after 3 tokens"], "temperature": [0.0, 0.8]}),
        r,
    );
    out
}
