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
