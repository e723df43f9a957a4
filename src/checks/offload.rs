//! The offloaded-KV kernels against their CPU oracles, called from
//! [`gpu_check`](super::kernels::gpu_check) (its cases go into the same
//! report). Every case is exact: `rel_l2` is the fraction of units that
//! differ (a (row, head) plan, a (block, head) chunk, a tile), tolerance 0.
//!
//! - `slot_diff`: random (slot map, selection, len) triples against
//!   [`kv::plan_slots`] — contexts shorter than a block, one block, exactly
//!   two, ring roll-over, selections that fill the pool, tiny and large
//!   pools, negative entries inside nsel and garbage past it, stale blocks in
//!   the map — plus a multi-step decode whose slot maps stay on the GPU;
//! - `kv_fetch_sm` at 8 / 16 / 32 CTAs, `fetch_dma` (copy engines) and
//!   `fetch_split` (both at once, 16 CTAs, 1 / 25 / 50 / 75 / 99 % through
//!   the copy engines): the whole slot pool after the fetch against a host
//!   copy of the expected chunks, D ∈ {64, 80, 128}, hkv ∈ {1, 2, 8};
//! - `kv_store_blocks`: write-back (ring wrap, rows with nothing to write)
//!   and spill ranges, the whole host store bitwise;
//! - `fetch bandwidth`: GB/s of `kv_fetch_sm` at 8 / 16 / 32 CTAs and of
//!   `fetch_dma` on 256 MiB of random 32 KiB chunks from a 4 GiB pinned
//!   store (numbers in `shape`; pass/fail only on the copied bytes).

use super::kernels::CaseResult;
use crate::cuda::context::dptr;
use crate::cuda::device_error::DeviceErrors;
use crate::cuda::ops::offload::{self, DmaRow, FetchArgs, SlotDiffArgs, StoreArgs, StoreBlocks};
use crate::cuda::Gpu;
use crate::kv::host_store::PinnedKv;
use crate::kv::{self, HostLayout, Kv, EMPTY};
use crate::{Error, Result};
use cudarc::driver::CudaSlice;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore};
use serde_json::{json, Value};

const B: usize = 64;

/// Outcome of an exact case: differing units out of all, the first
/// difference, extra numbers for the report.
struct Exact {
    bad: usize,
    units: usize,
    first: Option<String>,
    extra: Value,
}

impl Exact {
    fn new() -> Exact {
        Exact {
            bad: 0,
            units: 0,
            first: None,
            extra: Value::Null,
        }
    }
    /// Counts one unit; a difference records its description once.
    fn unit(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.units += 1;
        if !ok {
            self.bad += 1;
            if self.first.is_none() {
                self.first = Some(what());
            }
        }
    }
}

fn push(out: &mut Vec<CaseResult>, gpu: &Gpu, kernel: &str, mut shape: Value, r: Result<Exact>) {
    let r = r.and_then(|x| gpu.synchronize().map(|()| x));
    let res = match r {
        Ok(x) => {
            if !x.extra.is_null() {
                if let (Some(s), Some(e)) = (shape.as_object_mut(), x.extra.as_object()) {
                    for (k, v) in e {
                        s.insert(k.clone(), v.clone());
                    }
                }
            }
            let frac = if x.units == 0 {
                0.0
            } else {
                x.bad as f64 / x.units as f64
            };
            let pass = x.bad == 0 && x.units > 0;
            CaseResult {
                kernel: kernel.into(),
                shape,
                rel_l2: frac,
                max_abs_err: x.bad as f64,
                tolerance: 0.0,
                pass,
                error: if x.units == 0 {
                    Some("no units compared".into())
                } else {
                    x.first
                        .map(|f| format!("{} of {} units differ; first: {f}", x.bad, x.units))
                },
            }
        }
        Err(e) => CaseResult::failed(kernel, shape, 0.0, e.to_string()),
    };
    let s = res.shape.to_string();
    let s: String = if s.chars().count() > 70 {
        s.chars().take(67).collect::<String>() + "..."
    } else {
        s
    };
    println!(
        "{:<26} {:<70} rel_l2 {:>10.3e}  {}",
        res.kernel,
        s,
        res.rel_l2,
        if res.pass { "ok" } else { "FAIL" }
    );
    if let Some(e) = &res.error {
        println!("    error: {e}");
    }
    out.push(res);
}

/// Runs every offload case; failures are recorded, never returned.
pub fn check_offload(gpu: &Gpu, rng: &mut SmallRng) -> Vec<CaseResult> {
    let mut out = Vec::new();
    check_slot_diff(gpu, rng, &mut out);
    check_fetch(gpu, rng, &mut out);
    check_store(gpu, rng, &mut out);
    check_bandwidth(gpu, rng, &mut out);
    out
}

// ---------------------------------------------------------------------------
// slot_diff
// ---------------------------------------------------------------------------

/// k distinct values from [0, n), ascending.
fn distinct_sorted(rng: &mut SmallRng, n: usize, k: usize) -> Vec<usize> {
    let mut v = rand::seq::index::sample(rng, n, k.min(n)).into_vec();
    v.sort_unstable();
    v
}

/// One (row, head)'s inputs: slot map (i32, −1 empty), slot ages (empty:
/// ascending reuse, kv::plan_slots; else kv::plan_slots_lru), selection row
/// (s_max entries: nsel valid-or-negative, then garbage), nsel.
struct Unit {
    map: Vec<i32>,
    ages: Vec<i32>,
    sel: Vec<i32>,
    nsel: usize,
}

/// Random inputs of one (row, head): pool S, list width s_max (≥ S + 2 +
/// the negatives), len tokens. `fill`: select as many pooled blocks as fit.
fn gen_unit(rng: &mut SmallRng, s: usize, s_max: usize, len: usize, fill: bool) -> Unit {
    let nb = if len == 0 { 0 } else { (len - 1) / B + 1 };
    let rf = kv::ring_first(len, B) as usize;
    // Slot map: mostly blocks below the ring; sometimes also stale ids past
    // the sequence's blocks. Never a ring block: the engine cannot hold one
    // in a slot (ring_first only grows), and plan_slots assumes so (with a
    // selected ring block in a slot of a full pool it runs out of slots).
    let stale = rng.random_bool(0.2);
    let universe = if stale { rf + s + 4 } else { rf };
    let k0 = rng.random_range(0..=s.min(universe));
    let mut held: Vec<i32> = rand::seq::index::sample(rng, universe.max(1), k0.min(universe))
        .into_iter()
        .map(|b| {
            if b < rf {
                b as i32
            } else {
                (b + nb - rf) as i32
            }
        })
        .collect();
    held.resize(s, -1);
    held.shuffle(rng);
    // Selection: pooled blocks (< rf), overlapping the map, plus ring blocks.
    let cap = s.min(rf);
    let p = if fill || rng.random_bool(0.25) {
        cap
    } else {
        rng.random_range(0..=cap)
    };
    let mut chosen = std::collections::BTreeSet::new();
    let mut from_map: Vec<usize> = held
        .iter()
        .filter(|&&b| b >= 0 && (b as usize) < rf)
        .map(|&b| b as usize)
        .collect();
    from_map.shuffle(rng);
    let keep = rng.random_range(0..=from_map.len().min(p));
    chosen.extend(from_map.into_iter().take(keep));
    while chosen.len() < p {
        chosen.insert(rng.random_range(0..rf));
    }
    for b in rf..nb {
        if rng.random_bool(0.8) {
            chosen.insert(b);
        }
    }
    let mut list: Vec<i32> = chosen.into_iter().map(|b| b as i32).collect();
    // Negative entries inside nsel, where the row has room.
    let room = s_max - list.len();
    let neg = if room > 0 && rng.random_bool(0.3) {
        rng.random_range(1..=room.min(3))
    } else {
        0
    };
    for _ in 0..neg {
        let at = rng.random_range(0..=list.len());
        list.insert(at, -1);
    }
    let nsel = list.len();
    // Garbage past nsel (must be ignored).
    while list.len() < s_max {
        list.push(rng.random_range(-2..(nb as i32 + 5)));
    }
    Unit {
        map: held,
        ages: Vec::new(),
        sel: list,
        nsel,
    }
}

/// What slot_diff must produce for one unit (from kv::plan_slots, or
/// kv::plan_slots_lru with the ages after the step).
struct Want {
    map: Vec<i32>,
    ages: Vec<i32>,
    slot_list: Vec<i32>,
    fetch: Vec<(i32, i32)>,
    selected: usize,
}

fn oracle(u: &Unit, len: usize, s_max: usize) -> Result<Want> {
    let slots: Vec<u32> = u
        .map
        .iter()
        .map(|&b| if b < 0 { EMPTY } else { b as u32 })
        .collect();
    let valid: Vec<(usize, u32)> = u.sel[..u.nsel]
        .iter()
        .enumerate()
        .filter(|(_, &b)| b >= 0)
        .map(|(i, &b)| (i, b as u32))
        .collect();
    let selected: Vec<u32> = valid.iter().map(|&(_, b)| b).collect();
    let rf = kv::ring_first(len, B);
    let plan = if u.ages.is_empty() {
        kv::plan_slots(&slots, &selected, rf)?
    } else {
        let ages: Vec<u32> = u.ages.iter().map(|&a| a as u32).collect();
        kv::plan_slots_lru(&slots, &ages, &selected, rf)?
    };
    let mut slot_list = vec![-1i32; s_max];
    for (k, &(i, _)) in valid.iter().enumerate() {
        slot_list[i] = plan.slot_list[k];
    }
    Ok(Want {
        map: plan
            .slots
            .iter()
            .map(|&b| if b == EMPTY { -1 } else { b as i32 })
            .collect(),
        ages: plan.ages.iter().map(|&a| a as i32).collect(),
        slot_list,
        fetch: plan
            .fetches
            .iter()
            .map(|&(s, b)| (s as i32, b as i32))
            .collect(),
        selected: selected.len(),
    })
}

/// Device state of one slot_diff batch: slot maps (one buffer, rows in
/// reverse order so the row table matters; with ages, each row's map
/// followed by its ages, as the engine lays them out) and outputs.
struct DiffDev {
    maps: CudaSlice<i32>,
    aged: bool,
    tab: CudaSlice<u64>,
    slot_list: CudaSlice<i32>,
    fetch: CudaSlice<i32>,
    nfetch: CudaSlice<i32>,
    stats: CudaSlice<u64>,
    /// Valid inputs raise no device error: a false positive fails the case.
    errs: DeviceErrors,
}

const POISON: i32 = 0x7fff_fff0;

impl DiffDev {
    fn new(
        gpu: &Gpu,
        rows: usize,
        hkv: usize,
        s: usize,
        s_max: usize,
        maps: &[i32],
        ages: &[i32],
    ) -> Result<Self> {
        let aged = !ages.is_empty();
        let per = hkv * s * if aged { 2 } else { 1 };
        let rows_buf: Vec<i32> = (0..rows)
            .flat_map(|r| {
                let m = &maps[r * hkv * s..(r + 1) * hkv * s];
                let a = if aged {
                    &ages[r * hkv * s..(r + 1) * hkv * s]
                } else {
                    &[][..]
                };
                m.iter().chain(a).copied().collect::<Vec<_>>()
            })
            .collect();
        let maps = gpu.upload(&Self::reorder(&rows_buf, rows, per))?;
        let base = dptr(gpu, &maps);
        let tab: Vec<u64> = (0..rows)
            .map(|r| base + ((rows - 1 - r) * per * 4) as u64)
            .collect();
        Ok(DiffDev {
            maps,
            aged,
            tab: gpu.upload(&tab)?,
            slot_list: gpu.upload(&vec![POISON; rows * hkv * s_max])?,
            fetch: gpu.upload(&vec![POISON; rows * hkv * s * 2])?,
            nfetch: gpu.upload(&vec![POISON; rows * hkv])?,
            stats: gpu.zeros(2)?,
            errs: DeviceErrors::new(gpu)?,
        })
    }
    /// Row-major [rows][per] ↔ reversed row order (an involution).
    fn reorder(x: &[i32], rows: usize, per: usize) -> Vec<i32> {
        (0..rows)
            .rev()
            .flat_map(|r| x[r * per..(r + 1) * per].iter().copied())
            .collect()
    }
    /// Launches slot_diff over host selections.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        gpu: &Gpu,
        sel: &[i32],
        nsel: &[i32],
        lens: &[i32],
        rows: usize,
        hkv: usize,
        s: usize,
        s_max: usize,
        stats: bool,
    ) -> Result<()> {
        let (seld, nseld, lensd) = (gpu.upload(sel)?, gpu.upload(nsel)?, gpu.upload(lens)?);
        let a = SlotDiffArgs {
            sel: dptr(gpu, &seld),
            nsel: dptr(gpu, &nseld),
            s_max,
            lens: dptr(gpu, &lensd),
            slot_tab: dptr(gpu, &self.tab),
            slots: s,
            block_size: B,
            kv_heads: hkv,
            rows,
            slot_list: dptr(gpu, &self.slot_list),
            fetch: dptr(gpu, &self.fetch),
            nfetch: dptr(gpu, &self.nfetch),
            stats: if stats { dptr(gpu, &self.stats) } else { 0 },
            err: self.errs.sink(0),
            aged: self.aged,
        };
        offload::slot_diff(gpu, gpu.stream(), &a)?;
        gpu.synchronize()?;
        self.errs.take()
    }
}

/// Compares one batch's device outputs with the oracle's (with ages, the
/// ages too); returns the maps the GPU now holds (row-major), and the ages.
#[allow(clippy::too_many_arguments)]
fn compare_diff(
    gpu: &Gpu,
    dev: &DiffDev,
    wants: &[Want],
    rows: usize,
    hkv: usize,
    s: usize,
    s_max: usize,
    x: &mut Exact,
    tag: &str,
) -> Result<(Vec<i32>, Vec<i32>)> {
    let per = hkv * s * if dev.aged { 2 } else { 1 };
    let both = DiffDev::reorder(&gpu.download(&dev.maps)?, rows, per);
    let mut maps = Vec::with_capacity(rows * hkv * s);
    let mut ages = Vec::new();
    for row in both.chunks(per) {
        maps.extend_from_slice(&row[..hkv * s]);
        ages.extend_from_slice(&row[hkv * s..]);
    }
    let sl = gpu.download(&dev.slot_list)?;
    let fe = gpu.download(&dev.fetch)?;
    let nf = gpu.download(&dev.nfetch)?;
    for (rh, w) in wants.iter().enumerate() {
        let n = nf[rh];
        let got_fetch: Vec<(i32, i32)> = if (0..=s as i32).contains(&n) {
            (0..n as usize)
                .map(|i| (fe[(rh * s + i) * 2], fe[(rh * s + i) * 2 + 1]))
                .collect()
        } else {
            vec![(n, n)]
        };
        let got_sl = &sl[rh * s_max..(rh + 1) * s_max];
        let got_map = &maps[rh * s..(rh + 1) * s];
        let got_ages = if dev.aged {
            &ages[rh * s..(rh + 1) * s]
        } else {
            &[][..]
        };
        let ok = got_fetch == w.fetch
            && got_sl == w.slot_list
            && got_map == w.map
            && got_ages == &w.ages[..];
        x.unit(ok, || {
            format!(
                "{tag} (row {}, head {}): fetch {:?} want {:?}; slot_list {:?} want {:?}; map {:?} want {:?}",
                rh / hkv,
                rh % hkv,
                got_fetch,
                w.fetch,
                &got_sl[..got_sl.len().min(24)],
                &w.slot_list[..w.slot_list.len().min(24)],
                &got_map[..got_map.len().min(24)],
                &w.map[..w.map.len().min(24)]
            ) + &if dev.aged {
                format!(
                    "; ages {:?} want {:?}",
                    &got_ages[..got_ages.len().min(24)],
                    &w.ages[..w.ages.len().min(24)]
                )
            } else {
                String::new()
            }
        });
    }
    Ok((maps, ages))
}

/// Random slot ages: small (many ties), sometimes at the cap.
fn gen_ages(rng: &mut SmallRng, s: usize) -> Vec<i32> {
    (0..s)
        .map(|_| {
            if rng.random_bool(0.05) {
                kv::MAX_AGE as i32
            } else {
                rng.random_range(0..8)
            }
        })
        .collect()
}

/// Random batches at one (S, s_max, hkv) over `lens`; `aged`: with random
/// slot ages (least-recently-selected reuse).
#[allow(clippy::too_many_arguments)]
fn slot_diff_case(
    gpu: &Gpu,
    rng: &mut SmallRng,
    s: usize,
    s_max: usize,
    hkv: usize,
    lens: &[usize],
    trials: usize,
    fill: bool,
    aged: bool,
) -> Result<Exact> {
    let rows = lens.len();
    let mut x = Exact::new();
    for t in 0..trials {
        let mut maps = Vec::new();
        let mut ages = Vec::new();
        let mut sel = Vec::new();
        let mut nsel = Vec::new();
        let mut wants = Vec::new();
        for &len in lens {
            for _ in 0..hkv {
                let mut u = gen_unit(rng, s, s_max, len, fill);
                if aged {
                    u.ages = gen_ages(rng, s);
                }
                wants.push(oracle(&u, len, s_max)?);
                maps.extend_from_slice(&u.map);
                ages.extend_from_slice(&u.ages);
                sel.extend_from_slice(&u.sel);
                nsel.push(u.nsel as i32);
            }
        }
        let lens_i: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let mut dev = DiffDev::new(gpu, rows, hkv, s, s_max, &maps, &ages)?;
        dev.run(gpu, &sel, &nsel, &lens_i, rows, hkv, s, s_max, true)?;
        compare_diff(
            gpu,
            &dev,
            &wants,
            rows,
            hkv,
            s,
            s_max,
            &mut x,
            &format!("trial {t}"),
        )?;
        let st = gpu.download(&dev.stats)?;
        let want_sel: usize = wants.iter().map(|w| w.selected).sum();
        let want_f: usize = wants.iter().map(|w| w.fetch.len()).sum();
        x.unit(
            st[0] as usize == want_sel && st[1] as usize == want_f,
            || format!("trial {t}: stats {st:?}, want [{want_sel}, {want_f}]"),
        );
    }
    Ok(x)
}

/// A decode of `steps` tokens: each step a new selection of up to `budget`
/// pooled blocks that keeps most of the previous one, the slot maps carried
/// on the GPU (in place) and on the CPU (plan_slots; `cache` > 0: S =
/// budget + cache slots, plan_slots_lru with the ages carried too), every
/// step compared.
fn slot_diff_decode(
    gpu: &Gpu,
    rng: &mut SmallRng,
    budget: usize,
    cache: usize,
    hkv: usize,
    start: &[usize],
    steps: usize,
) -> Result<Exact> {
    let rows = start.len();
    let s = budget + cache;
    let s_max = budget + 2;
    let mut x = Exact::new();
    let mut cpu_maps = vec![-1i32; rows * hkv * s];
    let mut cpu_ages = if cache > 0 {
        vec![0i32; rows * hkv * s]
    } else {
        Vec::new()
    };
    let mut prev: Vec<Vec<usize>> = vec![Vec::new(); rows * hkv];
    let mut dev = DiffDev::new(gpu, rows, hkv, s, s_max, &cpu_maps, &cpu_ages)?;
    let (mut tot_sel, mut tot_fetch) = (0usize, 0usize);
    for step in 0..steps {
        let lens: Vec<usize> = start.iter().map(|&l| l + step).collect();
        let mut sel = Vec::new();
        let mut nsel = Vec::new();
        let mut wants = Vec::new();
        for (rh, p) in prev.iter_mut().enumerate() {
            let len = lens[rh / hkv];
            let nb = (len - 1) / B + 1;
            let rf = kv::ring_first(len, B) as usize;
            let target = budget.min(rf);
            let mut chosen: std::collections::BTreeSet<usize> = p
                .iter()
                .copied()
                .filter(|&b| b < rf && rng.random_bool(0.9))
                .collect();
            while chosen.len() > target {
                let v: Vec<usize> = chosen.iter().copied().collect();
                chosen.remove(&v[rng.random_range(0..v.len())]);
            }
            while chosen.len() < target {
                chosen.insert(rng.random_range(0..rf));
            }
            *p = chosen.iter().copied().collect();
            chosen.extend(rf..nb);
            let mut row: Vec<i32> = chosen.iter().map(|&b| b as i32).collect();
            let n = row.len();
            row.resize(s_max, -1);
            let u = Unit {
                map: cpu_maps[rh * s..(rh + 1) * s].to_vec(),
                ages: if cache > 0 {
                    cpu_ages[rh * s..(rh + 1) * s].to_vec()
                } else {
                    Vec::new()
                },
                sel: row,
                nsel: n,
            };
            let w = oracle(&u, len, s_max)?;
            tot_sel += w.selected;
            tot_fetch += w.fetch.len();
            cpu_maps[rh * s..(rh + 1) * s].copy_from_slice(&w.map);
            if cache > 0 {
                cpu_ages[rh * s..(rh + 1) * s].copy_from_slice(&w.ages);
            }
            sel.extend_from_slice(&u.sel);
            nsel.push(n as i32);
            wants.push(w);
        }
        let lens_i: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        dev.run(gpu, &sel, &nsel, &lens_i, rows, hkv, s, s_max, true)?;
        compare_diff(
            gpu,
            &dev,
            &wants,
            rows,
            hkv,
            s,
            s_max,
            &mut x,
            &format!("step {step}"),
        )?;
    }
    let st = gpu.download(&dev.stats)?;
    x.unit(
        st[0] as usize == tot_sel && st[1] as usize == tot_fetch,
        || format!("stats {st:?}, want [{tot_sel}, {tot_fetch}]"),
    );
    x.extra = json!({"locality": 1.0 - tot_fetch as f64 / tot_sel.max(1) as f64});
    Ok(x)
}

/// (S, s_max, hkv, lens, trials, fill the pool).
type DiffCfg<'a> = (usize, usize, usize, &'a [usize], usize, bool);

fn check_slot_diff(gpu: &Gpu, rng: &mut SmallRng, out: &mut Vec<CaseResult>) {
    let short: &[usize] = &[1, 2, 30, 63, 64, 65, 100, 127, 128, 129, 130, 191, 192, 193];
    let mixed: &[usize] = &[
        1, 64, 128, 129, 192, 193, 256, 257, 700, 1000, 4096, 4097, 5000, 20000,
    ];
    let long: &[usize] = &[3000, 16384, 16385, 50000, 65, 20];
    // (S, s_max, hkv, lens, trials, fill)
    let cfgs: &[DiffCfg<'_>] = &[
        (64, 66, 2, short, 6, false),
        (64, 66, 2, mixed, 6, false),
        (64, 70, 2, mixed, 6, true),
        (1, 5, 2, mixed, 8, false),
        (4, 8, 1, mixed, 8, false),
        (4, 8, 1, mixed, 8, true),
        (24, 512, 2, mixed, 6, false),
        (256, 260, 8, long, 4, false),
        (256, 512, 8, long, 4, true),
        (128, 130, 3, mixed, 4, true),
    ];
    for aged in [false, true] {
        for &(s, s_max, hkv, lens, trials, fill) in cfgs {
            let shape = json!({"S": s, "s_max": s_max, "Hkv": hkv, "B": B, "lens": lens, "trials": trials, "fill_pool": fill, "aged": aged});
            let r = slot_diff_case(gpu, rng, s, s_max, hkv, lens, trials, fill, aged);
            push(out, gpu, "slot_diff", shape, r);
        }
    }
    // (budget, cache slots, Hkv, start lengths, steps)
    for &(budget, cache, hkv, start, steps) in &[
        (
            16usize,
            0usize,
            2usize,
            &[1usize, 60, 120, 250, 1000][..],
            300usize,
        ),
        (64, 0, 2, &[4000, 4090, 130][..], 200),
        (3, 0, 1, &[100, 190][..], 150),
        (16, 16, 2, &[1, 60, 120, 250, 1000][..], 300),
        (64, 32, 2, &[4000, 4090, 130][..], 200),
        (3, 5, 1, &[100, 190][..], 150),
    ] {
        let shape = json!({"budget": budget, "cache_slots": cache, "S": budget + cache, "Hkv": hkv, "B": B, "start_lens": start, "steps": steps, "decode": true});
        let r = slot_diff_decode(gpu, rng, budget, cache, hkv, start, steps);
        push(out, gpu, "slot_diff (decode)", shape, r);
    }
}

// ---------------------------------------------------------------------------
// kv_fetch_sm, fetch_dma
// ---------------------------------------------------------------------------

/// A random host store, slot pool and fetch lists; `expect` is the pool
/// after a correct fetch.
struct FetchSetup {
    host: PinnedKv,
    layout: HostLayout,
    rows: usize,
    hkv: usize,
    d: usize,
    s: usize,
    pool0: Vec<u8>,
    expect: Vec<u8>,
    fetch: Vec<i32>,
    nfetch: Vec<i32>,
    host_rows: Vec<u64>,
    /// Pool byte offset of each row (rows in reverse order).
    pool_off: Vec<usize>,
}

impl FetchSetup {
    fn chunk(&self) -> usize {
        2 * B * self.d * 2
    }
    fn pool_row_bytes(&self) -> usize {
        self.hkv * self.s * self.chunk()
    }
}

#[allow(clippy::too_many_arguments)]
fn fetch_setup(
    gpu: &Gpu,
    rng: &mut SmallRng,
    rows: usize,
    hkv: usize,
    d: usize,
    s: usize,
    nblocks: usize,
    random_host: bool,
) -> Result<FetchSetup> {
    let layout = HostLayout {
        batch: rows,
        layers: 1,
        blocks_per_seq: nblocks,
        kv_heads: hkv,
        block_size: B,
        head_dim: d,
    };
    let mut host = PinnedKv::new(gpu, layout.total_bytes())?;
    if random_host {
        let mut bytes = vec![0u8; layout.total_bytes()];
        rng.fill_bytes(&mut bytes);
        host.write(0, &bytes)?;
    } else {
        fill_fast(&mut host, rng.random());
    }
    let chunk = 2 * B * d * 2;
    let pool_row = hkv * s * chunk;
    let mut pool0 = vec![0u8; rows * pool_row];
    rng.fill_bytes(&mut pool0);
    let mut fetch = Vec::with_capacity(rows * hkv * s * 2);
    let mut nfetch = Vec::with_capacity(rows * hkv);
    for _ in 0..rows * hkv {
        let n = match rng.random_range(0..5) {
            0 => 0,
            1 => s,
            _ => rng.random_range(0..=s),
        }
        .min(nblocks);
        let mut slots: Vec<usize> = rand::seq::index::sample(rng, s, n).into_vec();
        slots.shuffle(rng);
        let blocks = distinct_sorted(rng, nblocks, n);
        for i in 0..s {
            if i < n {
                fetch.push(slots[i] as i32);
                fetch.push(blocks[i] as i32);
            } else {
                fetch.push(-7);
                fetch.push(-7);
            }
        }
        nfetch.push(n as i32);
    }
    let host_rows: Vec<u64> = (0..rows)
        .map(|r| {
            layout
                .tile_offset(r, 0, 0, 0, Kv::K)
                .map(|o| host.device_ptr() + o as u64)
        })
        .collect::<Result<_>>()?;
    let pool_off: Vec<usize> = (0..rows).map(|r| (rows - 1 - r) * pool_row).collect();
    let mut st = FetchSetup {
        host,
        layout,
        rows,
        hkv,
        d,
        s,
        expect: pool0.clone(),
        pool0,
        fetch,
        nfetch,
        host_rows,
        pool_off,
    };
    st.expect = expected_pool(&st)?;
    Ok(st)
}

/// The pool after a correct fetch, from the host store (HostLayout offsets).
fn expected_pool(st: &FetchSetup) -> Result<Vec<u8>> {
    let chunk = st.chunk();
    let mut pool = st.pool0.clone();
    for rh in 0..st.rows * st.hkv {
        let (r, h) = (rh / st.hkv, rh % st.hkv);
        for i in 0..st.nfetch[rh] as usize {
            let slot = st.fetch[(rh * st.s + i) * 2] as usize;
            let block = st.fetch[(rh * st.s + i) * 2 + 1] as usize;
            let src = st.layout.tile_offset(r, 0, block, h, Kv::K)?;
            let dst = st.pool_off[r] + (h * st.s + slot) * chunk;
            st.host.read(src, &mut pool[dst..dst + chunk])?;
        }
    }
    Ok(pool)
}

/// Fills the pinned buffer with a cheap pseudo-random pattern, in parallel.
fn fill_fast(host: &mut PinnedKv, seed: u64) {
    // SAFETY: no GPU work touches the fresh buffer.
    let bytes = unsafe { host.as_mut_slice() };
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .min(16);
    let per = bytes.len().div_ceil(threads).div_ceil(8) * 8;
    std::thread::scope(|sc| {
        for (t, part) in bytes.chunks_mut(per).enumerate() {
            sc.spawn(move || {
                let mut z = seed ^ (t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                for w in part.chunks_mut(8) {
                    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut v = z;
                    v = (v ^ (v >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    v = (v ^ (v >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    v ^= v >> 31;
                    w.copy_from_slice(&v.to_le_bytes()[..w.len()]);
                }
            });
        }
    });
}

/// Compares a downloaded pool with the expected one, per (row, head, slot) chunk.
fn compare_pool(st: &FetchSetup, got: &[u8], x: &mut Exact) {
    let chunk = st.chunk();
    for r in 0..st.rows {
        for h in 0..st.hkv {
            for slot in 0..st.s {
                let o = st.pool_off[r] + (h * st.s + slot) * chunk;
                let ok = got.get(o..o + chunk) == Some(&st.expect[o..o + chunk]);
                x.unit(ok, || format!("row {r}, head {h}, slot {slot}"));
            }
        }
    }
}

/// Device copies of a setup's lists and a pool holding `pool0`.
struct FetchDev {
    pool: CudaSlice<u8>,
    fetch: CudaSlice<i32>,
    nfetch: CudaSlice<i32>,
    host_tab: CudaSlice<u64>,
    pool_tab: CudaSlice<u64>,
}

impl FetchDev {
    fn new(gpu: &Gpu, st: &FetchSetup) -> Result<Self> {
        let pool = gpu.upload(&st.pool0)?;
        let base = dptr(gpu, &pool);
        let pool_rows: Vec<u64> = st.pool_off.iter().map(|&o| base + o as u64).collect();
        Ok(FetchDev {
            fetch: gpu.upload(&st.fetch)?,
            nfetch: gpu.upload(&st.nfetch)?,
            host_tab: gpu.upload(&st.host_rows)?,
            pool_tab: gpu.upload(&pool_rows)?,
            pool,
        })
    }
    fn args(&self, gpu: &Gpu, st: &FetchSetup) -> FetchArgs {
        FetchArgs {
            fetch: dptr(gpu, &self.fetch),
            nfetch: dptr(gpu, &self.nfetch),
            slots: st.s,
            rows: st.rows,
            kv_heads: st.hkv,
            host_tab: dptr(gpu, &self.host_tab),
            pool_tab: dptr(gpu, &self.pool_tab),
            block_size: B,
            head_dim: st.d,
            cta_log: 0,
        }
    }
    fn dma_rows(&self, gpu: &Gpu, st: &FetchSetup) -> Vec<DmaRow> {
        let base = dptr(gpu, &self.pool);
        (0..st.rows)
            .map(|r| DmaRow {
                host: st.host_rows[r],
                pool: base + st.pool_off[r] as u64,
            })
            .collect()
    }
}

/// `kv_fetch_sm` on `st` at each (CTAs, whole SMs) of `configs`, its pool
/// against the expected copies, bit for bit.
fn check_fetch_sm(
    gpu: &Gpu,
    st: &FetchSetup,
    nblocks: usize,
    configs: &[(usize, bool)],
    out: &mut Vec<CaseResult>,
) {
    let chunks: i32 = st.nfetch.iter().sum();
    for &(ctas, whole) in configs {
        let shape = json!({"D": st.d, "Hkv": st.hkv, "B": B, "S": st.s, "rows": st.rows, "pairs": st.rows * st.hkv, "host_blocks": nblocks, "chunks": chunks, "ctas": ctas, "whole_sms": whole});
        let r = (|| {
            let dev = FetchDev::new(gpu, st)?;
            offload::kv_fetch_sm(gpu, gpu.stream(), &dev.args(gpu, st), ctas, whole)?;
            let got = gpu.download(&dev.pool)?;
            let mut x = Exact::new();
            compare_pool(st, &got, &mut x);
            Ok(x)
        })();
        push(out, gpu, "kv_fetch_sm", shape, r);
    }
}

fn check_fetch(gpu: &Gpu, rng: &mut SmallRng, out: &mut Vec<CaseResult>) {
    // more (row, head) pairs than the kernel scans at once (512): 367 rows × 3 KV heads =
    // 1,101 pairs in three chunks, the boundaries inside rows (row 170 head 2, row 341 head 1);
    // random counts (0 and S about a third of the time each). A lost task, or one copied
    // from or into another pair, changes the pool; a task done twice writes the same bytes
    // and is not seen here (nor which CTA did it).
    let (d, hkv, rows, s, nblocks) = (64usize, 3usize, 367usize, 4usize, 6usize);
    match fetch_setup(gpu, rng, rows, hkv, d, s, nblocks, true) {
        Ok(st) => check_fetch_sm(gpu, &st, nblocks, &[(8, false), (16, true)], out),
        Err(e) => push(
            out,
            gpu,
            "kv_fetch_sm",
            json!({"D": d, "Hkv": hkv, "rows": rows}),
            Err(e),
        ),
    }
    for &d in &[64usize, 80, 128] {
        for &hkv in &[1usize, 2, 8] {
            let (rows, s, nblocks) = (3usize, 24usize, 40usize);
            let st = match fetch_setup(gpu, rng, rows, hkv, d, s, nblocks, true) {
                Ok(st) => st,
                Err(e) => {
                    let shape = json!({"D": d, "Hkv": hkv});
                    push(out, gpu, "kv_fetch_sm", shape, Err(e));
                    continue;
                }
            };
            let chunks: i32 = st.nfetch.iter().sum();
            // (16 CTAs also holding whole SMs: the same copies)
            check_fetch_sm(
                gpu,
                &st,
                nblocks,
                &[(8, false), (16, false), (32, false), (16, true)],
                out,
            );
            let shape = json!({"D": d, "Hkv": hkv, "B": B, "S": s, "rows": rows, "host_blocks": nblocks, "chunks": chunks});
            let r = (|| {
                let dev = FetchDev::new(gpu, &st)?;
                gpu.synchronize()?;
                let dl = gpu.download(&dev.nfetch)?;
                let fl = gpu.download(&dev.fetch)?;
                let bytes = offload::fetch_dma(
                    gpu,
                    gpu.stream(),
                    &fl,
                    &dl,
                    s,
                    hkv,
                    &dev.dma_rows(gpu, &st),
                    B,
                    d,
                )?;
                let got = gpu.download(&dev.pool)?;
                let mut x = Exact::new();
                compare_pool(&st, &got, &mut x);
                x.unit(bytes == chunks as usize * st.chunk(), || {
                    format!(
                        "returned {bytes} bytes, want {}",
                        chunks as usize * st.chunk()
                    )
                });
                Ok(x)
            })();
            push(out, gpu, "fetch_dma", shape, r);
            for &ce_pct in &[1usize, 25, 50, 75, 99] {
                // the SM share on whole SMs at 50 %
                let whole = ce_pct == 50;
                let shape = json!({"D": d, "Hkv": hkv, "B": B, "S": s, "rows": rows, "host_blocks": nblocks, "chunks": chunks, "ctas": 16, "ce_pct": ce_pct, "whole_sms": whole});
                let r = split_case(gpu, &st, 16, ce_pct, whole);
                push(out, gpu, "fetch_split", shape, r);
            }
        }
    }
    // No chunk at all: both paths are no-ops.
    let shape = json!({"D": 128, "Hkv": 2, "S": 8, "rows": 2, "chunks": 0});
    let r = (|| {
        let mut st = fetch_setup(gpu, rng, 2, 2, 128, 8, 4, true)?;
        st.nfetch.iter_mut().for_each(|n| *n = 0);
        st.expect = st.pool0.clone();
        let dev = FetchDev::new(gpu, &st)?;
        offload::kv_fetch_sm(gpu, gpu.stream(), &dev.args(gpu, &st), 16, false)?;
        let bytes = offload::fetch_dma(
            gpu,
            gpu.stream(),
            &st.fetch,
            &st.nfetch,
            8,
            2,
            &dev.dma_rows(gpu, &st),
            B,
            128,
        )?;
        let got = gpu.download(&dev.pool)?;
        let mut x = Exact::new();
        compare_pool(&st, &got, &mut x);
        x.unit(bytes == 0, || format!("fetch_dma returned {bytes} bytes"));
        Ok(x)
    })();
    push(out, gpu, "kv_fetch_sm + fetch_dma (empty)", shape, r);
}

/// The split fetch of one setup ([`offload::fetch_split`]): the copy
/// engines' share on a side stream, the SM kernel's on the GPU's stream,
/// joined; the whole pool against the expected one, and the plan's counts
/// against [`kv::split::split_misses`].
fn split_case(
    gpu: &Gpu,
    st: &FetchSetup,
    ctas: usize,
    ce_pct: usize,
    whole_sms: bool,
) -> Result<Exact> {
    use crate::cuda::context::CudaResultExt;
    let dev = FetchDev::new(gpu, st)?;
    gpu.synchronize()?;
    let side = gpu.context().new_stream().cuda("cuStreamCreate (split)")?;
    let ev = || gpu.context().new_event(None).cuda("cuEventCreate (split)");
    let (fork, join) = (ev()?, ev()?);
    let mut counts = gpu.zeros::<i32>(st.rows * st.hkv)?;
    let streams = offload::SplitStreams {
        fetch: gpu.stream(),
        ce: &side,
        fork: &fork,
        join: &join,
        // the copy engines' share starts 50 µs late: without the join, the
        // download on the fetch stream below would read the pool too early
        ce_delay_ns: 50_000,
        whole_sms,
    };
    let rows = dev.dma_rows(gpu, st);
    let args = dev.args(gpu, st);
    let plan = offload::fetch_split(
        gpu,
        &streams,
        &args,
        &st.fetch,
        &st.nfetch,
        &rows,
        &mut counts,
        ctas,
        ce_pct,
    )?;
    // the GPU's stream waited for the side stream: one download sees both
    let got = gpu.download(&dev.pool)?;
    let mut x = Exact::new();
    compare_pool(st, &got, &mut x);
    let want = kv::split::split_misses(&st.nfetch, st.s, ce_pct)?;
    x.unit(plan == want, || format!("plan {plan:?}, want {want:?}"));
    Ok(x)
}

// ---------------------------------------------------------------------------
// kv_store_blocks
// ---------------------------------------------------------------------------

/// Which blocks of each row a store case writes.
enum StoreMode<'a> {
    /// lens per row (write-back of the block that just completed).
    Completed(&'a [usize]),
    /// [lo, hi) per row.
    Range(&'a [(usize, usize)]),
}

#[allow(clippy::too_many_arguments)]
fn store_case(
    gpu: &Gpu,
    rng: &mut SmallRng,
    hkv: usize,
    d: usize,
    nblocks: usize,
    ring: usize,
    mode: &StoreMode<'_>,
    grid_x: usize,
) -> Result<Exact> {
    let rows = match mode {
        StoreMode::Completed(l) => l.len(),
        StoreMode::Range(r) => r.len(),
    };
    let layout = HostLayout {
        batch: rows,
        layers: 1,
        blocks_per_seq: nblocks,
        kv_heads: hkv,
        block_size: B,
        head_dim: d,
    };
    let mut host = PinnedKv::new(gpu, layout.total_bytes())?;
    let mut host0 = vec![0u8; layout.total_bytes()];
    rng.fill_bytes(&mut host0);
    host.write(0, &host0)?;
    let cache_tokens = if ring > 0 { ring } else { nblocks * B };
    let row_bytes = hkv * d * 2;
    let mut kc = Vec::new();
    let mut vc = Vec::new();
    for _ in 0..rows {
        let mut k = vec![0u8; cache_tokens * row_bytes];
        let mut v = vec![0u8; cache_tokens * row_bytes];
        rng.fill_bytes(&mut k);
        rng.fill_bytes(&mut v);
        kc.push(k);
        vc.push(v);
    }
    let kd: Vec<CudaSlice<u8>> = kc.iter().map(|k| gpu.upload(k)).collect::<Result<_>>()?;
    let vd: Vec<CudaSlice<u8>> = vc.iter().map(|v| gpu.upload(v)).collect::<Result<_>>()?;
    let ktab = gpu.upload(&kd.iter().map(|k| dptr(gpu, k)).collect::<Vec<u64>>())?;
    let vtab = gpu.upload(&vd.iter().map(|v| dptr(gpu, v)).collect::<Vec<u64>>())?;
    let host_rows: Vec<u64> = (0..rows)
        .map(|r| {
            layout
                .tile_offset(r, 0, 0, 0, Kv::K)
                .map(|o| host.device_ptr() + o as u64)
        })
        .collect::<Result<_>>()?;
    let htab = gpu.upload(&host_rows)?;
    // Blocks each row writes.
    let ranges: Vec<(usize, usize)> = match mode {
        StoreMode::Completed(lens) => lens
            .iter()
            .map(|&l| {
                if l > 0 && l % B == 0 {
                    (l / B - 1, l / B)
                } else {
                    (0, 0)
                }
            })
            .collect(),
        StoreMode::Range(r) => r.to_vec(),
    };
    // Keep the device side's index buffers alive until the sync below.
    let (_a, _b, blocks) = match mode {
        StoreMode::Completed(lens) => {
            let l: Vec<i32> = lens.iter().map(|&x| x as i32).collect();
            let ld = gpu.upload(&l)?;
            let p = dptr(gpu, &ld);
            (Some(ld), None, StoreBlocks::Completed { lens: p })
        }
        StoreMode::Range(r) => {
            let lo: Vec<i32> = r.iter().map(|x| x.0 as i32).collect();
            let hi: Vec<i32> = r.iter().map(|x| x.1 as i32).collect();
            let (lod, hid) = (gpu.upload(&lo)?, gpu.upload(&hi)?);
            let (lp, hp) = (dptr(gpu, &lod), dptr(gpu, &hid));
            (Some(lod), Some(hid), StoreBlocks::Range { lo: lp, hi: hp })
        }
    };
    let a = StoreArgs {
        kptr: dptr(gpu, &ktab),
        vptr: dptr(gpu, &vtab),
        host_tab: dptr(gpu, &htab),
        ring,
        rows,
        kv_heads: hkv,
        block_size: B,
        head_dim: d,
        blocks,
    };
    offload::kv_store_blocks(gpu, gpu.stream(), &a, grid_x)?;
    gpu.synchronize()?;
    // Expected host bytes.
    let mut want = host0;
    let tile = B * d * 2;
    for (r, &(lo, hi)) in ranges.iter().enumerate() {
        for blk in lo..hi {
            for h in 0..hkv {
                for (kvi, src) in [(Kv::K, &kc[r]), (Kv::V, &vc[r])] {
                    let base = layout.tile_offset(r, 0, blk, h, kvi)?;
                    for t in 0..B {
                        let tok = blk * B + t;
                        let row = if ring > 0 { tok % ring } else { tok };
                        let so = (row * hkv + h) * d * 2;
                        want[base + t * d * 2..base + (t + 1) * d * 2]
                            .copy_from_slice(&src[so..so + d * 2]);
                    }
                }
            }
        }
    }
    let mut got = vec![0u8; layout.total_bytes()];
    host.read(0, &mut got)?;
    let mut x = Exact::new();
    for r in 0..rows {
        for blk in 0..nblocks {
            for h in 0..hkv {
                for kvi in [Kv::K, Kv::V] {
                    let o = layout.tile_offset(r, 0, blk, h, kvi)?;
                    x.unit(got[o..o + tile] == want[o..o + tile], || {
                        format!("row {r}, block {blk}, head {h}, {kvi:?}")
                    });
                }
            }
        }
    }
    Ok(x)
}

fn check_store(gpu: &Gpu, rng: &mut SmallRng, out: &mut Vec<CaseResult>) {
    let wb_lens: &[usize] = &[64, 128, 192, 320, 383, 0, 448, 65, 512];
    let spill: &[(usize, usize)] = &[(0, 8), (3, 5), (2, 2), (7, 8), (0, 1)];
    let ring_spill: &[(usize, usize)] = &[(2, 4), (5, 7), (0, 2), (6, 6)];
    for &(d, hkv, grid_x) in &[
        (64usize, 1usize, 0usize),
        (80, 2, 1),
        (128, 8, 64),
        (128, 2, 3),
    ] {
        let shape = json!({"mode": "write-back", "D": d, "Hkv": hkv, "B": B, "ring": 2 * B, "lens": wb_lens, "grid_x": grid_x});
        let r = store_case(
            gpu,
            rng,
            hkv,
            d,
            8,
            2 * B,
            &StoreMode::Completed(wb_lens),
            grid_x,
        );
        push(out, gpu, "kv_store_blocks", shape, r);
        let shape = json!({"mode": "spill", "D": d, "Hkv": hkv, "B": B, "ring": 0, "ranges": spill, "grid_x": grid_x});
        let r = store_case(gpu, rng, hkv, d, 8, 0, &StoreMode::Range(spill), grid_x);
        push(out, gpu, "kv_store_blocks", shape, r);
        let shape = json!({"mode": "spill", "D": d, "Hkv": hkv, "B": B, "ring": 2 * B, "ranges": ring_spill, "grid_x": grid_x});
        let r = store_case(
            gpu,
            rng,
            hkv,
            d,
            8,
            2 * B,
            &StoreMode::Range(ring_spill),
            grid_x,
        );
        push(out, gpu, "kv_store_blocks", shape, r);
    }
}

// ---------------------------------------------------------------------------
// bandwidth
// ---------------------------------------------------------------------------

/// Median of the elapsed times (ms) of `reps` runs of `f` between events.
fn time_ms(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    gpu.synchronize()?;
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let (e0, e1) = (gpu.timing_event()?, gpu.timing_event()?);
        e0.record(gpu.stream())
            .map_err(|e| Error::Cuda(format!("cuEventRecord: {e}")))?;
        f()?;
        e1.record(gpu.stream())
            .map_err(|e| Error::Cuda(format!("cuEventRecord: {e}")))?;
        let ms = e0
            .elapsed_ms(&e1)
            .map_err(|e| Error::Cuda(format!("cuEventElapsedTime: {e}")))?;
        ts.push(ms as f64);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

fn check_bandwidth(gpu: &Gpu, rng: &mut SmallRng, out: &mut Vec<CaseResult>) {
    // 4 GiB host store (16 rows × 4096 blocks × 64 KiB at hkv 2, D 128), 256
    // slots per (row, head) all fetched: 8192 random 32 KiB chunks = 256 MiB.
    let avail = crate::kv::host_store::host_available_bytes().unwrap_or(0);
    let want_host = 4usize << 30;
    let nblocks = if avail >= want_host + (8usize << 30) {
        4096
    } else {
        1024
    };
    let (rows, hkv, d, s) = (16usize, 2usize, 128usize, 256usize);
    let mut shape = json!({
        "what": "fetch bandwidth, random 32 KiB (block, head) chunks, median of 5 after a warm-up",
        "host_store_bytes": rows * nblocks * hkv * 2 * B * d * 2,
        "rows": rows, "Hkv": hkv, "D": d, "B": B, "S": s,
        "host_available_bytes": avail,
    });
    let r = (|| {
        let mut st = fetch_setup(gpu, rng, rows, hkv, d, s, nblocks, false)?;
        // Every (row, head) fetches all S slots.
        st.fetch.clear();
        for _ in 0..rows * hkv {
            let mut slots: Vec<usize> = (0..s).collect();
            slots.shuffle(rng);
            let blocks = distinct_sorted(rng, nblocks, s);
            for i in 0..s {
                st.fetch.push(slots[i] as i32);
                st.fetch.push(blocks[i] as i32);
            }
        }
        st.nfetch = vec![s as i32; rows * hkv];
        st.pool0 = vec![0u8; rows * st.pool_row_bytes()];
        st.expect = expected_pool(&st)?;
        let bytes = rows * hkv * s * st.chunk();
        let mut x = Exact::new();
        let mut res = serde_json::Map::new();
        res.insert("bytes_per_fetch".into(), json!(bytes));
        for &ctas in &[8usize, 16, 32] {
            let dev = FetchDev::new(gpu, &st)?;
            let a = dev.args(gpu, &st);
            let ms = time_ms(gpu, 5, || {
                offload::kv_fetch_sm(gpu, gpu.stream(), &a, ctas, false)
            })?;
            let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
            println!("    kv_fetch_sm {ctas} CTAs: {ms:.3} ms, {gbs:.1} GB/s");
            res.insert(format!("sm_{ctas}cta_gbps"), json!(gbs));
            res.insert(format!("sm_{ctas}cta_ms"), json!(ms));
            if ctas == 16 {
                compare_pool(&st, &gpu.download(&dev.pool)?, &mut x);
            }
        }
        let dev = FetchDev::new(gpu, &st)?;
        let rows_dma = dev.dma_rows(gpu, &st);
        let ms = time_ms(gpu, 5, || {
            offload::fetch_dma(
                gpu,
                gpu.stream(),
                &st.fetch,
                &st.nfetch,
                s,
                hkv,
                &rows_dma,
                B,
                d,
            )
            .map(drop)
        })?;
        let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
        println!("    fetch_dma (cuMemcpyBatchAsync): {ms:.3} ms, {gbs:.1} GB/s");
        res.insert("dma_gbps".into(), json!(gbs));
        res.insert("dma_ms".into(), json!(ms));
        compare_pool(&st, &gpu.download(&dev.pool)?, &mut x);
        x.extra = Value::Object(res);
        Ok(x)
    })();
    if let Some(o) = shape.as_object_mut() {
        o.insert("nblocks_per_row".into(), json!(nblocks));
    }
    push(out, gpu, "fetch bandwidth", shape, r);
}
