//! `sparda tune-ctas`: measures the fetch configurations of offloaded
//! decode on this GPU and chooses one per batch size, separately for the
//! synchronous fetch and for forecast prefetch (runtime.md §4), into a
//! [`FetchTable`].
//!
//! Protocol: synthetic NOSA-8B weights (or any sparse checkpoint), random
//! forecast projections for the prefetch mode; for each context and batch
//! size B, B sequences filled with synthetic KV (runtime.md §5) and
//! offloaded once per mode; then, in `repeats` rounds (each round in a
//! rotated order), each configuration — the SM copy kernel at each CTA
//! count, the copy engines and, in prefetch mode, the SM kernel on whole
//! SMs (`sm-whole:N`; the GEMMs keep every SM) — is set, warmed up (the
//! step is rebuilt) and timed over `steps` real decode steps (CUDA events
//! per step). A configuration's figure is the median over rounds of each
//! round's mean step time ([`round_figure`]); its spread is max − min of
//! the round figures. (Tables swept before this rule, the H200 table's
//! cells among them, hold round medians: [`SweepCell::round_stat`].)
//!
//! Split configurations (`split:N:P`, [`crate::kv::split`]): after those
//! rounds, at each (mode, B) the SM kernel's CTA count N is the one that
//! measured fastest in that cell (ties: fewer CTAs) at the first context
//! where the (mode, B) fitted, and kept for its other contexts (so every
//! context of a batch size measures the same split configurations and the
//! choice below can compare them); then one split per copy-engine share P
//! of [`TuneSpec::split_pcts`] (fixed ratios, 25/50/75 % by default, not
//! derived from the measured rates) is measured the same way, in rounds of
//! their own.
//!
//! Choice per (mode, B): over the contexts measured, each configuration's
//! geometric-mean ratio to the fastest configuration of that context; the
//! lowest wins, and any configuration within the winner's relative spread
//! counts as tied, where the one that takes the fewest SMs is chosen: SM
//! time is counted as CTAs × the share of the misses they fetch (N for
//! `sm:N` and `sm-whole:N`, N·(100 − P)/100 for `split:N:P`, none for the
//! copy engines).
//!
//! More CTAs: when the largest swept CTA count is the fastest SM
//! configuration of a (mode, B) at its first context, twice as many are
//! measured too, while that still improves ([`next_ctas`], at most
//! [`MAX_EXTRA_CTAS`] more); the batch size's other contexts measure the
//! same counts.
//!
//! Resume (`--append`): [`TuneSpec::done`] holds the cells of the table
//! appended to; a (mode, context, B) with every configuration asked for is
//! skipped, one missing some is measured again (its new cells replace the
//! old in the merge).

use crate::bench::{median, open_model, time_step_ms};
use crate::cpu::EngineOptions;
use crate::cuda::Gpu;
use crate::kv::fetch_table::{FetchChoice, FetchEntry, FetchMode, FetchTable, FORMAT};
use crate::kv::offload::OffloadOptions;
use crate::model::forecast::ForecastWeights;
use crate::model::{AttentionOverrides, PrefillMode, SelectionRule};
use crate::pipeline::GpuModel;
use crate::{Error, Result};
use serde::Serialize;
use serde_json::json;
use std::sync::Arc;

/// What to measure.
#[derive(Debug, Clone)]
pub struct TuneSpec {
    /// Checkpoint directory or `synth:PRESET[:SEED]` (default synth:nosa-8b).
    pub model: String,
    /// Batch sizes B, ascending.
    pub batches: Vec<usize>,
    /// Context lengths, tokens.
    pub contexts: Vec<usize>,
    /// Configurations swept.
    pub configs: Vec<FetchChoice>,
    /// Modes measured.
    pub modes: Vec<FetchMode>,
    /// Rounds over every configuration.
    pub repeats: usize,
    /// Timed decode steps per configuration and round.
    pub steps: usize,
    /// Untimed steps after each switch (≥ 2: build, capture).
    pub warmup: usize,
    /// Seed of the synthetic KV and forecast weights.
    pub seed: u64,
    /// Copy-engine shares P (%, 1 … 99) of the split configurations
    /// measured at each (mode, B) beside `configs` (see the module doc);
    /// empty: no split configuration.
    pub split_pcts: Vec<usize>,
    /// Cells an earlier run measured (a table being appended to): their
    /// (mode, context, B) are skipped, and the CTA count of their splits is
    /// kept for the batch size's other contexts.
    pub done: Vec<SweepCell>,
}

/// The default copy-engine shares of the split configurations swept, %.
pub const DEFAULT_SPLIT_PCTS: [usize; 3] = [25, 50, 75];

/// The default CTA counts of the whole-SM configurations (`sm-whole:N`),
/// measured in prefetch mode: on the H200 at B = 16 they beat shared SMs by
/// 6–11 % at 8 and 16 CTAs, 32K and 64K (benches/results/,
/// `whole_sm_fetch_vs_shared_prefetch_32k_64k_b16_h200_2026-12-01_e2f09b4`);
/// with 4 task groups per copy CTA the H200 re-sweep of 2026-12-03 chose 2
/// whole SMs at B 1 and 4 and 12 at B 8 and 32, hence 2 and 12 too.
pub const DEFAULT_WHOLE_CTAS: [usize; 5] = [2, 4, 8, 12, 16];

/// The default CTA counts swept: 2 … 32.
pub const DEFAULT_CTAS: [usize; 8] = [2, 4, 6, 8, 12, 16, 24, 32];

/// One measured cell: (mode, context, B, configuration).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SweepCell {
    /// Synchronous fetch or forecast prefetch.
    pub mode: FetchMode,
    /// Context length, tokens.
    pub context: usize,
    /// Batch size.
    pub batch: usize,
    /// `sm:N`, `sm-whole:N`, `dma` or `split:N:P` ([`FetchChoice::label`]).
    pub config: String,
    /// Median over rounds of the round's figure ([`SweepCell::round_stat`]), ms.
    pub step_ms: f64,
    /// max − min of the round figures, ms.
    pub spread_ms: f64,
    /// Each round's figure, ms.
    pub rounds_ms: Vec<f64>,
    /// What a round's figure is: `"mean"` of its timed steps (sweeps by this
    /// version: a configuration whose steps alternate between fast and slow
    /// is charged its slow steps, as a user's tokens/s is) or `"median"`
    /// (earlier sweeps, every cell of the committed H200 table among them;
    /// the default when the field is absent).
    #[serde(default = "median_stat")]
    pub round_stat: String,
}

/// [`SweepCell::round_stat`] of cells written before the field existed.
fn median_stat() -> String {
    "median".into()
}

/// A round's figure: the mean of its timed step times, ms (0 for none).
pub fn round_figure(step_ms: &[f64]) -> f64 {
    if step_ms.is_empty() {
        0.0
    } else {
        step_ms.iter().sum::<f64>() / step_ms.len() as f64
    }
}

/// SM time a configuration takes from compute, in CTA·% of the misses:
/// CTAs × the share of the misses they fetch (the copy engines take none).
fn sms(c: FetchChoice) -> usize {
    match c {
        FetchChoice::Sm { ctas } | FetchChoice::SmWhole { ctas } => ctas * 100,
        FetchChoice::Dma => 0,
        FetchChoice::Split { ctas, ce_pct } => ctas * 100usize.saturating_sub(ce_pct),
    }
}

/// For a resumed sweep: the labels of `configs` that the earlier cells
/// `done` lack at (mode, context, B) `key` (empty: the cell is complete and
/// skipped), or `None` when that cell was not measured before.
pub fn missing_before(
    done: &[SweepCell],
    key: (FetchMode, usize, usize),
    configs: &[FetchChoice],
) -> Option<Vec<String>> {
    let before: Vec<&str> = done
        .iter()
        .filter(|c| (c.mode, c.context, c.batch) == key)
        .map(|c| c.config.as_str())
        .collect();
    if before.is_empty() {
        return None;
    }
    Some(
        configs
            .iter()
            .map(|c| c.label())
            .filter(|x| !before.contains(&x.as_str()))
            .collect(),
    )
}

/// The most CTA counts a cell measures beyond the swept ones
/// ([`next_ctas`]).
pub const MAX_EXTRA_CTAS: usize = 3;

/// The next CTA count to measure beyond the swept ones: twice the largest
/// SM-kernel count among `measured` (configuration, step ms) when that one
/// was the fastest SM configuration (more CTAs still improved), while ≤
/// 1024; `None` otherwise.
pub fn next_ctas(measured: &[(FetchChoice, f64)]) -> Option<usize> {
    let most = measured
        .iter()
        .filter_map(|&(c, _)| match c {
            FetchChoice::Sm { ctas } => Some(ctas),
            _ => None,
        })
        .max()?;
    // the fastest SM CTA count (ties: fewer CTAs), as the splits take it
    let fastest = split_ctas(measured)?;
    (fastest == most && 2 * most <= 1024).then_some(2 * most)
}

/// The CTA count of the split configurations of one cell: the SM
/// configuration with the lowest step time among `measured` (label, step
/// ms), fewer CTAs on a tie; `None` without an SM configuration.
pub fn split_ctas(measured: &[(FetchChoice, f64)]) -> Option<usize> {
    measured
        .iter()
        .filter_map(|&(c, ms)| match c {
            FetchChoice::Sm { ctas } => Some((ctas, ms)),
            _ => None,
        })
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .map(|(ctas, _)| ctas)
}

/// The choice for one (mode, B) from its cells (every context, every
/// configuration): see the module doc. Returns the chosen configuration
/// and its step time at the largest context. `None` without cells.
pub fn choose(cells: &[&SweepCell], configs: &[FetchChoice]) -> Option<(FetchChoice, f64)> {
    let mut contexts: Vec<usize> = cells.iter().map(|c| c.context).collect();
    contexts.sort_unstable();
    contexts.dedup();
    let cell = |cfg: FetchChoice, l: usize| {
        cells
            .iter()
            .find(|c| c.context == l && c.config == cfg.label())
    };
    // per configuration: geometric mean ratio to each context's fastest, and
    // its largest relative spread
    let mut scored: Vec<(FetchChoice, f64, f64)> = Vec::new();
    for &cfg in configs {
        let mut log_sum = 0.0;
        let mut rel_spread = 0.0f64;
        let mut n = 0;
        for &l in &contexts {
            let best = cells
                .iter()
                .filter(|c| c.context == l)
                .map(|c| c.step_ms)
                .fold(f64::INFINITY, f64::min);
            if let Some(c) = cell(cfg, l) {
                log_sum += (c.step_ms / best).ln();
                rel_spread = rel_spread.max(c.spread_ms / c.step_ms);
                n += 1;
            }
        }
        if n == contexts.len() && n > 0 {
            scored.push((cfg, (log_sum / n as f64).exp(), rel_spread));
        }
    }
    let &(_, best, spread) = scored.iter().min_by(|a, b| a.1.total_cmp(&b.1))?;
    let chosen = scored
        .iter()
        .filter(|s| s.1 <= best * (1.0 + spread))
        .min_by(|a, b| sms(a.0).cmp(&sms(b.0)).then(a.1.total_cmp(&b.1)))?
        .0;
    let l_max = *contexts.last()?;
    Some((chosen, cell(chosen, l_max)?.step_ms))
}

/// Runs the sweep and returns the table (with the sweep in it). Progress
/// on stderr, one line per (context, B, mode) cell. After each cell,
/// `on_cell` gets the table of the cells measured so far (so that a sweep
/// cut short, e.g. at a device call's time limit, keeps what it measured);
/// the order is context, then B, then mode, so both modes of a batch size
/// are done before the next.
///
/// Errors: CUDA missing or failing; a model that cannot run sparse
/// attention; no cell fitting in memory; bad arguments; `on_cell`'s.
pub fn run(
    spec: &TuneSpec,
    mut on_cell: impl FnMut(&FetchTable) -> Result<()>,
) -> Result<FetchTable> {
    crate::cuda::require()?;
    if spec.batches.is_empty() || spec.contexts.is_empty() || spec.configs.is_empty() {
        return Err(Error::Input(
            "tune-ctas: need a batch size, a context and a configuration".into(),
        ));
    }
    if spec.repeats == 0 || spec.steps == 0 || spec.warmup < 2 {
        return Err(Error::Input(
            "tune-ctas: need ≥ 1 round, ≥ 1 timed step and ≥ 2 warm-up steps".into(),
        ));
    }
    let gpu = Arc::new(Gpu::new(0)?);
    let info = gpu.info().clone();
    let half = (info.sm_count.max(0) as usize) / 2;
    if let Some(c) = spec
        .configs
        .iter()
        .find(|c| matches!(c, FetchChoice::SmWhole { ctas } if *ctas > half))
    {
        return Err(Error::Input(format!(
            "tune-ctas: {}: whole SMs apply to at most half the SMs ({half} of the {}'s {}); lower --whole-ctas",
            c.label(),
            info.name,
            info.sm_count
        )));
    }
    eprintln!(
        "tune-ctas: {} ({} SMs); loading {} …",
        info.name, info.sm_count, spec.model
    );
    let ckpt = open_model(&spec.model)?;
    let opts = EngineOptions {
        attention: AttentionOverrides {
            sparse: Some(true),
            selection: Some(SelectionRule::Nosa),
            ..Default::default()
        },
        prefill: PrefillMode::Auto,
    };
    let mut model = GpuModel::new(gpu.clone(), &ckpt, opts)?;
    let cfg = ckpt.config.clone();
    drop(ckpt);
    let fw = ForecastWeights::from_arg(&format!("synth:{}", spec.seed), &cfg)?;
    let mut cells: Vec<SweepCell> = Vec::new();
    // every configuration measured (the splits' CTA counts vary by cell)
    let mut configs: Vec<FetchChoice> = spec.configs.clone();
    // per (mode, B): the CTA count of its splits, from its first context
    let mut split_ctas_of: Vec<((FetchMode, usize), usize)> = Vec::new();
    // per (mode, B): the CTA counts measured beyond the swept ones
    let swept_max = spec
        .configs
        .iter()
        .filter_map(|c| match c {
            FetchChoice::Sm { ctas } => Some(*ctas),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let mut extra_ctas_of: Vec<((FetchMode, usize), Vec<usize>)> = Vec::new();
    for c in &spec.done {
        if let Ok(FetchChoice::Sm { ctas }) = FetchChoice::parse_label(&c.config) {
            if ctas > swept_max {
                match extra_ctas_of
                    .iter_mut()
                    .find(|(k, _)| *k == (c.mode, c.batch))
                {
                    Some((_, v)) if !v.contains(&ctas) => v.push(ctas),
                    Some(_) => {}
                    None => extra_ctas_of.push(((c.mode, c.batch), vec![ctas])),
                }
            }
        }
    }
    for (_, v) in extra_ctas_of.iter_mut() {
        v.sort_unstable();
    }
    for c in &spec.done {
        if let Ok(FetchChoice::Split { ctas, .. }) = FetchChoice::parse_label(&c.config) {
            if !split_ctas_of.iter().any(|(k, _)| *k == (c.mode, c.batch)) {
                split_ctas_of.push(((c.mode, c.batch), ctas));
            }
        }
    }
    let mut skipped: Vec<serde_json::Value> = Vec::new();
    let total = spec.modes.len() * spec.contexts.len() * spec.batches.len();
    let mut done = 0;
    let (pcie, driver) = nvidia_smi_link();
    let driver = driver.unwrap_or_else(|| format!("CUDA {}", info.driver_version_string()));
    // (a resumed run that measures nothing new chooses over the cells it kept)
    let table_of = |cells: &[SweepCell], configs: &[FetchChoice], skipped: &[serde_json::Value]| {
        let cells = if cells.is_empty() {
            &spec.done[..]
        } else {
            cells
        };
        let (sync, prefetch) = entries_of(cells, configs)?;
        Ok::<_, Error>(FetchTable {
            format: FORMAT,
            gpu: info.name.clone(),
            sm_count: info.sm_count,
            pcie: pcie.clone(),
            driver: driver.clone(),
            date_utc: crate::checks::kernels::utc_now_iso(),
            commit: std::env::var("SPARDA_COMMIT")
                .ok()
                .or_else(crate::bench::git_commit),
            protocol: protocol(spec),
            sync,
            prefetch,
            sweep: json!({"cells": cells, "skipped": skipped,
                "configs": configs.iter().map(|c| c.label()).collect::<Vec<_>>()}),
        })
    };
    for &l in &spec.contexts {
        for &b in &spec.batches {
            for &mode in &spec.modes {
                done += 1;
                // whole SMs only matter beside compute: prefetch mode alone
                let here: Vec<FetchChoice> = spec
                    .configs
                    .iter()
                    .copied()
                    .filter(|c| mode == FetchMode::Prefetch || !c.whole_sms())
                    .collect();
                // a cell measured before (--append) is skipped when it has
                // every configuration asked for now, else measured again
                match missing_before(&spec.done, (mode, l, b), &here) {
                    Some(missing) if missing.is_empty() => {
                        eprintln!("[{done}/{total}] {mode:?} L={l} B={b}: measured before (--append), skipped");
                        continue;
                    }
                    Some(missing) => eprintln!(
                        "[{done}/{total}] {mode:?} L={l} B={b}: measured before without {}: measuring it again",
                        missing.join(", ")
                    ),
                    None => {}
                }
                let off = OffloadOptions {
                    fetch: spec.configs[0].engine(),
                    ..OffloadOptions::default()
                };
                model.set_forecast(None, false)?;
                model.set_offload(Some(off))?;
                model.set_forecast((mode == FetchMode::Prefetch).then_some(&fw), true)?;
                let runs = spec.configs.len() + spec.split_pcts.len() + MAX_EXTRA_CTAS;
                let cap = l + spec.repeats * runs * (spec.warmup + spec.steps) + 8;
                if let Err(e) =
                    model.check_memory(b, cap, Some(off), false, "lower --batch or --context")
                {
                    eprintln!("[{done}/{total}] {mode:?} L={l} B={b}: skipped: {e}");
                    skipped.push(
                        json!({"mode": mode, "context": l, "batch": b, "reason": e.to_string()}),
                    );
                    if !(cells.is_empty() && spec.done.is_empty()) {
                        on_cell(&table_of(&cells, &configs, &skipped)?)?;
                    }
                    continue;
                }
                eprintln!("[{done}/{total}] {mode:?} L={l} B={b}: filling {b} sequences …");
                crate::interrupt::check(|| format!("tune-ctas ({mode:?}, L {l}, B {b})"))?;
                let mut seqs = Vec::with_capacity(b);
                for i in 0..b {
                    let mut s = model.new_sequence(cap)?;
                    model.fill_synthetic(&mut s, l, spec.seed.wrapping_add(i as u64))?;
                    model.offload_sequence(&mut s, cap)?;
                    seqs.push(s);
                }
                let mut measured = measure(&mut model, &mut seqs, &here, spec, |r| {
                    format!("tune-ctas ({mode:?}, L {l}, B {b}, round {r})")
                })?;
                // beyond the largest CTA count while it still improves: the
                // first context of a (mode, B) decides, the others measure
                // the same counts (so the choice compares them everywhere)
                let extra = match extra_ctas_of.iter().find(|(k, _)| *k == (mode, b)) {
                    Some((_, v)) => {
                        let v = v.clone();
                        let cfgs: Vec<FetchChoice> =
                            v.iter().map(|&ctas| FetchChoice::Sm { ctas }).collect();
                        if !cfgs.is_empty() {
                            measured.extend(measure(&mut model, &mut seqs, &cfgs, spec, |r| {
                                format!("tune-ctas ({mode:?}, L {l}, B {b}, more CTAs, round {r})")
                            })?);
                        }
                        v
                    }
                    None => {
                        let mut v = Vec::new();
                        while v.len() < MAX_EXTRA_CTAS {
                            let at: Vec<(FetchChoice, f64)> =
                                measured.iter().map(|(c, r)| (*c, median(r))).collect();
                            let Some(n) = next_ctas(&at) else { break };
                            eprintln!("    the most CTAs were the fastest: {n} CTAs too");
                            measured.extend(measure(
                                &mut model,
                                &mut seqs,
                                &[FetchChoice::Sm { ctas: n }],
                                spec,
                                |r| {
                                    format!(
                                        "tune-ctas ({mode:?}, L {l}, B {b}, {n} CTAs, round {r})"
                                    )
                                },
                            )?);
                            v.push(n);
                        }
                        extra_ctas_of.push(((mode, b), v.clone()));
                        v
                    }
                };
                for &ctas in &extra {
                    if !configs.contains(&FetchChoice::Sm { ctas }) {
                        configs.push(FetchChoice::Sm { ctas });
                    }
                }
                if !spec.split_pcts.is_empty() {
                    let at: Vec<(FetchChoice, f64)> =
                        measured.iter().map(|(c, r)| (*c, median(r))).collect();
                    let ctas = match split_ctas_of.iter().find(|(k, _)| *k == (mode, b)) {
                        Some(&(_, n)) => Some(n),
                        None => split_ctas(&at),
                    };
                    if let Some(ctas) = ctas {
                        if !split_ctas_of.iter().any(|(k, _)| *k == (mode, b)) {
                            split_ctas_of.push(((mode, b), ctas));
                        }
                        let splits: Vec<FetchChoice> = spec
                            .split_pcts
                            .iter()
                            .map(|&ce_pct| FetchChoice::Split { ctas, ce_pct })
                            .collect();
                        for &c in &splits {
                            if !configs.contains(&c) {
                                configs.push(c);
                            }
                        }
                        measured.extend(measure(&mut model, &mut seqs, &splits, spec, |r| {
                            format!("tune-ctas ({mode:?}, L {l}, B {b}, splits, round {r})")
                        })?);
                    }
                }
                let mut line = Vec::new();
                for (c, r) in &measured {
                    let hi = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
                    let cell = SweepCell {
                        mode,
                        context: l,
                        batch: b,
                        config: c.label(),
                        step_ms: median(r),
                        spread_ms: hi - lo,
                        rounds_ms: r.clone(),
                        round_stat: "mean".into(),
                    };
                    line.push(format!("{} {:.2}", cell.config, cell.step_ms));
                    cells.push(cell);
                }
                eprintln!("    step ms: {}", line.join(", "));
                drop(seqs);
                model.release_buffers();
                on_cell(&table_of(&cells, &configs, &skipped)?)?;
            }
        }
    }
    model.set_forecast(None, false)?;
    model.set_offload(None)?;
    table_of(&cells, &configs, &skipped)
}

/// The table's protocol line: how `spec` measures.
fn protocol(spec: &TuneSpec) -> String {
    format!(
        "sparda tune-ctas on {}: synthetic KV (runtime.md §5), NOSA selection; prefetch mode with random forecast projections (synth:{}); contexts {:?}; per configuration and round {} warm-up + {} timed decode steps (CUDA events), {} rounds in rotated order; figure = median of round means (mean step time per round), spread = max - min{}{}",
        spec.model, spec.seed, spec.contexts, spec.warmup, spec.steps, spec.repeats,
        if spec.split_pcts.is_empty() {
            String::new()
        } else {
            format!("; splits with {:?} % through the copy engines at each (mode, B)'s fastest SM CTA count (first context), in rounds of their own", spec.split_pcts)
        },
        if spec.configs.iter().any(|c| c.whole_sms()) {
            "; sm-whole:N (copy CTAs on whole SMs, GEMMs on every SM) in prefetch mode only"
        } else {
            ""
        }
    )
}

/// Times `configs` on the filled batch `seqs`: `spec.repeats` rounds, each
/// over every configuration in an order rotated by the round (set, warm up,
/// time `spec.steps` steps). Returns per configuration its round figures
/// ([`round_figure`]: the mean step time), ms, in the order of `configs`.
/// `what` names the round for an interrupt.
///
/// Errors: a failing decode step; an interrupt.
fn measure(
    model: &mut GpuModel,
    seqs: &mut [crate::pipeline::GpuSequence],
    configs: &[FetchChoice],
    spec: &TuneSpec,
    what: impl Fn(usize) -> String,
) -> Result<Vec<(FetchChoice, Vec<f64>)>> {
    let first = vec![1u32; seqs.len()];
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for r in 0..spec.repeats {
        for k in 0..configs.len() {
            let i = (k + r) % configs.len();
            crate::interrupt::check(|| what(r))?;
            // where the copy CTAs run, then the engine (which rebuilds the step)
            model.set_fetch_whole_sms(configs[i].whole_sms());
            model.set_offload(Some(OffloadOptions {
                fetch: configs[i].engine(),
                ..OffloadOptions::default()
            }))?;
            model.decode(seqs, &first)?;
            for _ in 2..spec.warmup {
                model.decode_greedy(seqs)?;
            }
            rounds[i].push(round_figure(&time_step_ms(model, seqs, spec.steps)?));
        }
    }
    model.set_fetch_whole_sms(false);
    Ok(configs.iter().copied().zip(rounds).collect())
}

/// The table's entries from sweep cells: per mode and measured batch size,
/// [`choose`]'s configuration; a mode without cells takes the other's
/// entries (the runtime needs both).
///
/// Errors: [`Error::Input`] when no cell was measured.
pub fn entries_of(
    cells: &[SweepCell],
    configs: &[FetchChoice],
) -> Result<(Vec<FetchEntry>, Vec<FetchEntry>)> {
    for (mode, b, label, missing) in incomplete_configs(cells, configs) {
        eprintln!(
            "tune-ctas: {label} at B = {b} ({mode:?}) was not measured at context {} and is left out of that choice (every configuration is compared at every context of its batch size)",
            missing
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let entries = |mode: FetchMode| -> Vec<FetchEntry> {
        let mut batches: Vec<usize> = cells
            .iter()
            .filter(|c| c.mode == mode)
            .map(|c| c.batch)
            .collect();
        batches.sort_unstable();
        batches.dedup();
        batches
            .into_iter()
            .filter_map(|b| {
                let mine: Vec<&SweepCell> = cells
                    .iter()
                    .filter(|c| c.mode == mode && c.batch == b)
                    .collect();
                choose(&mine, configs).map(|(choice, step_ms)| FetchEntry {
                    batch: b,
                    choice,
                    step_ms,
                })
            })
            .collect()
    };
    let (sync, prefetch) = (entries(FetchMode::Sync), entries(FetchMode::Prefetch));
    match (sync.is_empty(), prefetch.is_empty()) {
        (true, true) => Err(Error::Input(
            "tune-ctas: no cell fitted in memory; lower --batch or --context".into(),
        )),
        // sync steps were never measured on whole SMs: the same CTAs, shared
        (true, false) => Ok((
            prefetch
                .iter()
                .map(|e| FetchEntry {
                    choice: match e.choice {
                        FetchChoice::SmWhole { ctas } => FetchChoice::Sm { ctas },
                        c => c,
                    },
                    ..*e
                })
                .collect(),
            prefetch,
        )),
        (false, true) => Ok((sync.clone(), sync)),
        _ => Ok((sync, prefetch)),
    }
}

/// The configurations measured at some but not all contexts of a (mode,
/// batch size) in `cells` — [`choose`] leaves them out — each with the
/// contexts it misses: (mode, B, label, missing contexts). A merged sweep
/// whose runs chose different split CTA counts shows up here.
pub fn incomplete_configs(
    cells: &[SweepCell],
    configs: &[FetchChoice],
) -> Vec<(FetchMode, usize, String, Vec<usize>)> {
    let mut out = Vec::new();
    for mode in [FetchMode::Sync, FetchMode::Prefetch] {
        let mut batches: Vec<usize> = cells
            .iter()
            .filter(|c| c.mode == mode)
            .map(|c| c.batch)
            .collect();
        batches.sort_unstable();
        batches.dedup();
        for b in batches {
            let mine: Vec<&SweepCell> = cells
                .iter()
                .filter(|c| c.mode == mode && c.batch == b)
                .collect();
            let mut contexts: Vec<usize> = mine.iter().map(|c| c.context).collect();
            contexts.sort_unstable();
            contexts.dedup();
            for cfg in configs {
                let label = cfg.label();
                let have: Vec<usize> = contexts
                    .iter()
                    .copied()
                    .filter(|&l| mine.iter().any(|c| c.context == l && c.config == label))
                    .collect();
                if !have.is_empty() && have.len() < contexts.len() {
                    let missing = contexts
                        .iter()
                        .copied()
                        .filter(|l| !have.contains(l))
                        .collect();
                    out.push((mode, b, label, missing));
                }
            }
        }
    }
    out
}

/// The sweep cells a table records (its `sweep.cells`).
///
/// Errors: [`Error::Input`] naming `origin` when they cannot be read.
pub fn cells_of(t: &FetchTable, origin: &str) -> Result<Vec<SweepCell>> {
    serde_json::from_value(t.sweep["cells"].clone())
        .map_err(|e| Error::Input(format!("fetch table {origin}: its sweep cells: {e}")))
}

/// `--remeasure-medians`: drops from `done` (the cells of a table being
/// appended to) every (mode, context, B) among those `spec` asks for whose
/// cells hold round medians ([`SweepCell::round_stat`]), so that they are
/// measured again on round means; a run cut short and called again resumes
/// (the cells it wrote hold means). Returns how many cells were dropped.
pub fn drop_median_cells(done: &mut Vec<SweepCell>, spec: &TuneSpec) -> usize {
    let asked = |c: &SweepCell| {
        spec.modes.contains(&c.mode)
            && spec.contexts.contains(&c.context)
            && spec.batches.contains(&c.batch)
    };
    let stale: Vec<(FetchMode, usize, usize)> = done
        .iter()
        .filter(|c| asked(c) && c.round_stat == "median")
        .map(|c| (c.mode, c.context, c.batch))
        .collect();
    let before = done.len();
    done.retain(|c| !stale.contains(&(c.mode, c.context, c.batch)));
    before - done.len()
}

/// One (mode, context, B) of a second sweep, against a table's choice
/// ([`compare`]): is the choice within the tolerance of the best
/// configuration that sweep measured there?
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareRow {
    /// Synchronous fetch or forecast prefetch.
    pub mode: FetchMode,
    /// Context length, tokens.
    pub context: usize,
    /// Batch size.
    pub batch: usize,
    /// The table's choice for (mode, B) ([`FetchTable::choose`]), as a label.
    pub choice: String,
    /// The choice's step time in the second sweep, ms (`None`: that sweep
    /// did not measure it here).
    pub choice_ms: Option<f64>,
    /// The second sweep's fastest configuration here, and its step time, ms.
    pub best: String,
    /// Step time of [`CompareRow::best`], ms.
    pub best_ms: f64,
    /// choice_ms / best_ms (`None` when the choice was not measured).
    pub ratio: Option<f64>,
    /// The tolerance, relative: the larger of 2 % and the relative spreads
    /// of the two cells (issue target: "within 2 %, or within the measured
    /// spread if larger").
    pub tolerance: f64,
    /// ratio ≤ 1 + tolerance.
    pub within: bool,
}

/// Checks `table`'s choices against a second, separate sweep of the same
/// GPU (`second`, e.g. `tune-ctas --out second.json` of a later run): one
/// row per (mode, context, B) the second sweep measured, in its order
/// (mode, then B, then context). A choice the second sweep did not measure
/// is reported, not within.
///
/// Errors: tables of different GPUs (both named); an unreadable sweep.
pub fn compare(table: &FetchTable, second: &FetchTable) -> Result<Vec<CompareRow>> {
    if table.gpu != second.gpu {
        return Err(Error::Input(format!(
            "tune-ctas --compare: the table is the {}'s, the second sweep ran on the {}",
            table.gpu, second.gpu
        )));
    }
    let cells = cells_of(second, "the second sweep")?;
    let mut groups: Vec<(FetchMode, usize, usize)> =
        cells.iter().map(|c| (c.mode, c.batch, c.context)).collect();
    groups.sort_by_key(|&(m, b, l)| (m == FetchMode::Prefetch, b, l));
    groups.dedup();
    let mut rows = Vec::new();
    for (mode, batch, context) in groups {
        let here: Vec<&SweepCell> = cells
            .iter()
            .filter(|c| (c.mode, c.batch, c.context) == (mode, batch, context))
            .collect();
        let Some(best) = here.iter().min_by(|a, b| a.step_ms.total_cmp(&b.step_ms)) else {
            continue;
        };
        let choice = table.choose(mode, batch).label();
        let mine = here.iter().find(|c| c.config == choice);
        let rel = |c: &SweepCell| {
            if c.step_ms > 0.0 {
                c.spread_ms / c.step_ms
            } else {
                0.0
            }
        };
        let tolerance = mine.map_or(rel(best), |m| rel(m).max(rel(best))).max(0.02);
        let ratio = mine.map(|m| m.step_ms / best.step_ms);
        rows.push(CompareRow {
            mode,
            context,
            batch,
            choice,
            choice_ms: mine.map(|m| m.step_ms),
            best: best.config.clone(),
            best_ms: best.step_ms,
            ratio,
            tolerance,
            within: ratio.is_some_and(|r| r <= 1.0 + tolerance),
        });
    }
    Ok(rows)
}

/// [`compare`]'s rows as a text table, with a last line counting those
/// within their tolerance.
pub fn compare_table(rows: &[CompareRow]) -> String {
    let mut s = format!(
        "{:<9} {:>8} {:>5}  {:<13} {:>9}  {:<13} {:>9}  {:>7} {:>6}  verdict\n",
        "mode", "context", "B", "table", "ms", "best", "ms", "ratio", "tol"
    );
    for r in rows {
        s += &format!(
            "{:<9} {:>8} {:>5}  {:<13} {:>9}  {:<13} {:>9.2}  {:>7} {:>5.1}%  {}\n",
            format!("{:?}", r.mode).to_lowercase(),
            r.context,
            r.batch,
            r.choice,
            r.choice_ms.map_or("–".into(), |v| format!("{v:.2}")),
            r.best,
            r.best_ms,
            r.ratio.map_or("–".into(), |v| format!("{v:.3}")),
            r.tolerance * 100.0,
            if r.within {
                "within"
            } else if r.ratio.is_none() {
                "not measured"
            } else {
                "OUTSIDE"
            }
        );
    }
    s += &format!(
        "{} of {} (mode, context, B) within their tolerance\n",
        rows.iter().filter(|r| r.within).count(),
        rows.len()
    );
    s
}

/// `new` with the sweep of `old` (a table of the same GPU, e.g. an earlier
/// device call's part of the grid) merged in: every (mode, context, batch)
/// `new` measured replaces all of `old`'s cells there (whatever
/// configurations they were), the others are kept, and the choices are made
/// again over all cells (configurations:
/// the union of both sweeps'). `new`'s metadata stays; the protocol notes
/// the merge.
///
/// Errors: tables of different GPUs (both named); unreadable sweeps.
pub fn merge(old: &FetchTable, new: FetchTable, origin: &str) -> Result<FetchTable> {
    if old.gpu != new.gpu {
        return Err(Error::Input(format!(
            "{origin}: a fetch table of the {}, this sweep ran on the {}",
            old.gpu, new.gpu
        )));
    }
    let fresh = cells_of(&new, "this sweep")?;
    // a (mode, context, B) the new sweep measured is replaced whole: the
    // configurations compared at one context always come from one run
    let group = |c: &SweepCell| (c.mode, c.context, c.batch);
    let mut cells: Vec<SweepCell> = cells_of(old, origin)?
        .into_iter()
        .filter(|o| !fresh.iter().any(|f| group(f) == group(o)))
        .collect();
    cells.extend(fresh);
    let mut labels: Vec<String> = Vec::new();
    for t in [old, &new] {
        for l in t.sweep["configs"].as_array().into_iter().flatten() {
            if let Some(l) = l.as_str().filter(|l| !labels.iter().any(|x| x == l)) {
                labels.push(l.to_string());
            }
        }
    }
    let configs = labels
        .iter()
        .map(|l| FetchChoice::parse_label(l))
        .collect::<Result<Vec<_>>>()?;
    let (sync, prefetch) = entries_of(&cells, &configs)?;
    let skipped = new.sweep["skipped"].clone();
    Ok(FetchTable {
        protocol: format!(
            "{} (merged with the sweep of {origin}, measured {} at commit {})",
            new.protocol,
            old.date_utc,
            old.commit.as_deref().unwrap_or("?")
        ),
        sync,
        prefetch,
        sweep: json!({"cells": cells, "skipped": skipped, "configs": labels}),
        ..new
    })
}

/// PCIe link ("GenG xW") and driver version from `nvidia-smi`, when it is
/// there ("unknown" / `None` otherwise).
fn nvidia_smi_link() -> (String, Option<String>) {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=pcie.link.gen.max,pcie.link.width.max,driver_version",
            "--format=csv,noheader,nounits",
            "--id=0",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let s = String::from_utf8_lossy(&o.stdout);
            let f: Vec<&str> = s.trim().split(',').map(str::trim).collect();
            match f.as_slice() {
                [g, w, d] => (format!("Gen{g} x{w}"), Some(d.to_string())),
                _ => ("unknown".into(), None),
            }
        }
        _ => ("unknown".into(), None),
    }
}

/// The sweep as a text table: one row per (mode, context, B), one column
/// per configuration (median step ms ± spread), the choice marked `*`. The
/// split configurations, whose CTA count varies by batch size, share one
/// column per copy-engine share P (`split:N:P`), each cell naming its N
/// (`13.70±0.04 N8`).
pub fn sweep_table(t: &FetchTable) -> String {
    let cells = cells_of(t, "the table").unwrap_or_default();
    let labels: Vec<String> = t.sweep["configs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    // a column: a label, or every split of one share
    #[derive(PartialEq)]
    enum Col {
        One(String),
        Split(usize),
    }
    let mut cols: Vec<Col> = Vec::new();
    for l in &labels {
        let col = match FetchChoice::parse_label(l) {
            Ok(FetchChoice::Split { ce_pct, .. }) => Col::Split(ce_pct),
            _ => Col::One(l.clone()),
        };
        if !cols.contains(&col) {
            cols.push(col);
        }
    }
    let mut out = format!("{:<9} {:>7} {:>4}", "mode", "context", "B");
    for c in &cols {
        out += &match c {
            Col::One(l) => format!(" {l:>14}"),
            Col::Split(p) => format!(" {:>18}", format!("split:N:{p}")),
        };
    }
    out.push('\n');
    let mut keys: Vec<(FetchMode, usize, usize)> =
        cells.iter().map(|c| (c.mode, c.context, c.batch)).collect();
    keys.dedup();
    for (mode, l, b) in keys {
        let chosen = t.choose(mode, b).label();
        out += &format!(
            "{:<9} {:>7} {:>4}",
            format!("{mode:?}").to_lowercase(),
            l,
            b
        );
        let here = |x: &&SweepCell| x.mode == mode && x.context == l && x.batch == b;
        let text = |x: &SweepCell| {
            format!(
                "{}{:.2}±{:.2}",
                if x.config == chosen { "*" } else { "" },
                x.step_ms,
                x.spread_ms / 2.0
            )
        };
        for c in &cols {
            out += &match c {
                Col::One(label) => match cells.iter().filter(here).find(|x| &x.config == label) {
                    Some(x) => format!(" {:>14}", text(x)),
                    None => format!(" {:>14}", "-"),
                },
                Col::Split(p) => {
                    let cell =
                        cells.iter().filter(here).find_map(|x| {
                            match FetchChoice::parse_label(&x.config) {
                                Ok(FetchChoice::Split { ctas, ce_pct }) if ce_pct == *p => {
                                    Some((x, ctas))
                                }
                                _ => None,
                            }
                        });
                    match cell {
                        Some((x, ctas)) => format!(" {:>18}", format!("{} N{ctas}", text(x))),
                        None => format!(" {:>18}", "-"),
                    }
                }
            };
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(l: usize, cfg: &str, ms: f64, spread: f64) -> SweepCell {
        SweepCell {
            mode: FetchMode::Sync,
            context: l,
            batch: 8,
            config: cfg.into(),
            step_ms: ms,
            spread_ms: spread,
            rounds_ms: vec![ms],
            round_stat: "mean".into(),
        }
    }

    /// A table of `gpu` from `cells` over the configurations `labels`, its
    /// entries chosen as a sweep's are.
    fn table_from(cells: Vec<SweepCell>, labels: &[&str], gpu: &str) -> FetchTable {
        let configs: Vec<FetchChoice> = labels
            .iter()
            .map(|l| FetchChoice::parse_label(l).unwrap())
            .collect();
        let (sync, prefetch) = entries_of(&cells, &configs).unwrap();
        FetchTable {
            format: FORMAT,
            gpu: gpu.into(),
            sm_count: 132,
            pcie: "Gen5 x16".into(),
            driver: "580".into(),
            date_utc: "2026-12-01T00:00:00Z".into(),
            commit: Some("abc".into()),
            protocol: "p".into(),
            sync,
            prefetch,
            sweep: json!({"cells": cells, "skipped": [], "configs": labels}),
        }
    }

    #[test]
    fn a_round_is_charged_its_slow_steps() {
        // steps alternating between 10 and 13 ms: the median of 5 says 10,
        // the mean (a user's tokens/s) 11.2
        let steps = [10.0, 13.0, 10.0, 13.0, 10.0];
        assert_eq!(median(&steps), 10.0);
        assert!((round_figure(&steps) - 11.2).abs() < 1e-12);
        assert_eq!(round_figure(&[]), 0.0);
        // cells written before the field say how their rounds were summarised
        let old: SweepCell = serde_json::from_value(json!({
            "mode": "sync", "context": 32768, "batch": 8, "config": "sm:8",
            "step_ms": 13.8, "spread_ms": 0.1, "rounds_ms": [13.8, 13.7]
        }))
        .unwrap();
        assert_eq!(old.round_stat, "median");
    }

    #[test]
    fn the_fastest_wins_and_ties_within_the_spread_go_to_fewer_sms() {
        let configs = [
            FetchChoice::Sm { ctas: 4 },
            FetchChoice::Sm { ctas: 8 },
            FetchChoice::Sm { ctas: 16 },
            FetchChoice::Dma,
        ];
        let cells = [
            cell(32768, "sm:4", 10.5, 0.05),
            cell(32768, "sm:8", 10.0, 0.05),
            cell(32768, "sm:16", 10.02, 0.05),
            cell(32768, "dma", 14.0, 0.1),
        ];
        let refs: Vec<&SweepCell> = cells.iter().collect();
        // sm:16 is within sm:8's 0.5 % spread but takes more SMs: sm:8.
        assert_eq!(
            choose(&refs, &configs),
            Some((FetchChoice::Sm { ctas: 8 }, 10.0))
        );
        // A wide spread makes sm:4 a tie: fewer SMs win.
        let cells = [
            cell(32768, "sm:4", 10.5, 0.05),
            cell(32768, "sm:8", 10.0, 1.0),
            cell(32768, "sm:16", 10.02, 0.05),
            cell(32768, "dma", 14.0, 0.1),
        ];
        let refs: Vec<&SweepCell> = cells.iter().collect();
        assert_eq!(
            choose(&refs, &configs),
            Some((FetchChoice::Sm { ctas: 4 }, 10.5))
        );
    }

    #[test]
    fn whole_sm_configurations_compete_in_prefetch_mode_only() {
        let sm = |ctas| FetchChoice::Sm { ctas };
        let whole = |ctas| FetchChoice::SmWhole { ctas };
        let configs = [sm(8), sm(16), whole(8), whole(16)];
        let at = |mode, cfg: &str, ms| SweepCell {
            mode,
            ..cell(32768, cfg, ms, 0.02)
        };
        let cells = vec![
            at(FetchMode::Sync, "sm:8", 13.7),
            at(FetchMode::Sync, "sm:16", 13.6),
            at(FetchMode::Prefetch, "sm:8", 12.7),
            at(FetchMode::Prefetch, "sm:16", 13.8),
            at(FetchMode::Prefetch, "sm-whole:8", 12.0),
            at(FetchMode::Prefetch, "sm-whole:16", 12.4),
        ];
        // absent from sync mode altogether: not an incomplete configuration
        assert!(incomplete_configs(&cells, &configs).is_empty());
        let (sync, prefetch) = entries_of(&cells, &configs).unwrap();
        assert_eq!(sync[0].choice, sm(16));
        assert_eq!((prefetch[0].choice, prefetch[0].step_ms), (whole(8), 12.0));
        // the same SMs as sm:8: a tie within the spread goes to the faster
        let tied = [
            at(FetchMode::Prefetch, "sm:8", 12.01),
            at(FetchMode::Prefetch, "sm-whole:8", 12.0),
        ];
        let refs: Vec<&SweepCell> = tied.iter().collect();
        assert_eq!(choose(&refs, &configs), Some((whole(8), 12.0)));
        // a prefetch-only sweep fills the sync entries with the same CTAs, shared
        let only: Vec<SweepCell> = cells
            .iter()
            .filter(|c| c.mode == FetchMode::Prefetch)
            .cloned()
            .collect();
        let (sync, prefetch) = entries_of(&only, &configs).unwrap();
        assert_eq!((sync[0].choice, prefetch[0].choice), (sm(8), whole(8)));
    }
    #[test]
    fn a_resumed_sweep_skips_complete_cells_and_names_what_others_lack() {
        let done = vec![
            cell(32768, "sm:8", 10.0, 0.1),
            cell(32768, "dma", 12.0, 0.1),
        ];
        let sm8 = FetchChoice::Sm { ctas: 8 };
        let key = (FetchMode::Sync, 32768, 8);
        assert_eq!(
            missing_before(&done, key, &[sm8, FetchChoice::Dma]),
            Some(vec![])
        );
        assert_eq!(
            missing_before(&done, key, &[sm8, FetchChoice::SmWhole { ctas: 8 }]),
            Some(vec!["sm-whole:8".to_string()])
        );
        // another context, batch or mode: not measured before
        assert_eq!(
            missing_before(&done, (FetchMode::Sync, 65536, 8), &[sm8]),
            None
        );
        assert_eq!(
            missing_before(&done, (FetchMode::Prefetch, 32768, 8), &[sm8]),
            None
        );
    }

    #[test]
    fn more_ctas_are_tried_only_while_the_most_are_the_fastest() {
        let sm = |ctas| FetchChoice::Sm { ctas };
        // 32 CTAs fastest and the most: try 64
        assert_eq!(
            next_ctas(&[(sm(8), 54.0), (sm(32), 53.4), (FetchChoice::Dma, 50.0)]),
            Some(64)
        );
        // 64 measured and slower than 32: stop
        assert_eq!(
            next_ctas(&[(sm(8), 54.0), (sm(32), 53.4), (sm(64), 53.6)]),
            None
        );
        // a tie goes to fewer CTAs: stop
        assert_eq!(next_ctas(&[(sm(16), 53.4), (sm(32), 53.4)]), None);
        // 1024 is the kernel's most
        assert_eq!(next_ctas(&[(sm(1024), 1.0)]), None);
        assert_eq!(next_ctas(&[(FetchChoice::Dma, 1.0)]), None);
    }

    #[test]
    fn merged_sweeps_keep_the_other_batches_and_choose_again() {
        let table = |cells, configs: &[&str]| table_from(cells, configs, "NVIDIA H200");
        let at = |b, cfg: &str, ms| SweepCell {
            batch: b,
            ..cell(32768, cfg, ms, 0.0)
        };
        let old = table(
            vec![
                at(8, "sm:4", 10.0),
                at(8, "sm:8", 11.0),
                at(16, "sm:4", 20.0),
                at(16, "sm:8", 19.0),
            ],
            &["sm:4", "sm:8"],
        );
        // the new call re-measures B 16 and adds the copy engines there
        let new = table(
            vec![
                at(16, "sm:4", 20.0),
                at(16, "sm:8", 21.0),
                at(16, "dma", 18.0),
            ],
            &["sm:4", "sm:8", "dma"],
        );
        let m = merge(&old, new, "old.json").unwrap();
        let c = |b| m.choose(FetchMode::Sync, b);
        assert_eq!(c(8), FetchChoice::Sm { ctas: 4 }); // kept from the old sweep
        assert_eq!(c(16), FetchChoice::Dma); // chosen again over the new cells
        assert_eq!(cells_of(&m, "m").unwrap().len(), 5);
        // a re-measured (mode, context, B) replaces every old cell there, even
        // of configurations the new sweep did not run: sm:8 at B 8 (old, 11.0)
        // is gone once B 8 is measured again with sm:4 only
        let again = table(vec![at(8, "sm:4", 10.5)], &["sm:4"]);
        let m2 = merge(&m, again, "m.json").unwrap();
        let cells = cells_of(&m2, "m2").unwrap();
        let b8: Vec<&SweepCell> = cells.iter().filter(|c| c.batch == 8).collect();
        assert_eq!(b8.len(), 1);
        assert_eq!((b8[0].config.as_str(), b8[0].step_ms), ("sm:4", 10.5));
        assert_eq!(cells.iter().filter(|c| c.batch == 16).count(), 3);
        assert!(m.protocol.contains("merged with the sweep of old.json"));
        let mut other = old.clone();
        other.gpu = "NVIDIA A100-SXM4-80GB".into();
        let e = merge(&other, m, "a100.json").unwrap_err().to_string();
        assert!(e.contains("A100") && e.contains("H200"), "{e}");
    }

    #[test]
    fn median_cells_asked_for_are_dropped_for_remeasurement() {
        let spec = TuneSpec {
            model: "synth:nosa-8b".into(),
            batches: vec![8, 16],
            contexts: vec![32768],
            configs: vec![FetchChoice::Sm { ctas: 8 }],
            modes: vec![FetchMode::Prefetch],
            repeats: 2,
            steps: 12,
            warmup: 3,
            seed: 1,
            split_pcts: Vec::new(),
            done: Vec::new(),
        };
        let c = |mode, l, b, stat: &str| SweepCell {
            mode,
            batch: b,
            round_stat: stat.into(),
            ..cell(l, "sm:8", 10.0, 0.0)
        };
        let mut done = vec![
            c(FetchMode::Prefetch, 32768, 8, "median"), // asked, medians: dropped
            c(FetchMode::Prefetch, 32768, 16, "mean"),  // asked, means: kept
            c(FetchMode::Prefetch, 65536, 8, "median"), // context not asked: kept
            c(FetchMode::Sync, 32768, 8, "median"),     // mode not asked: kept
            c(FetchMode::Prefetch, 32768, 32, "median"), // B not asked: kept
        ];
        assert_eq!(drop_median_cells(&mut done, &spec), 1);
        assert_eq!(done.len(), 4);
        assert!(!done
            .iter()
            .any(|x| (x.mode, x.context, x.batch) == (FetchMode::Prefetch, 32768, 8)));
        // nothing left to drop: a resumed run keeps what it measured
        assert_eq!(drop_median_cells(&mut done, &spec), 0);
    }

    #[test]
    fn a_second_sweep_checks_the_choices_within_2_percent_or_the_spread() {
        let table = |cells, gpu| table_from(cells, &["sm:4", "sm:8", "sm:16"], gpu);
        let at = |b, cfg: &str, ms, spread| SweepCell {
            batch: b,
            ..cell(32768, cfg, ms, spread)
        };
        // the table: sm:4 at B 8, sm:8 at B 16
        let first = table(
            vec![
                at(8, "sm:4", 10.0, 0.0),
                at(8, "sm:8", 11.0, 0.0),
                at(16, "sm:8", 19.0, 0.0),
                at(16, "sm:16", 20.0, 0.0),
            ],
            "NVIDIA H200",
        );
        // second run: at B 8 sm:8 is now 1.5 % faster (within 2 %); at B 16
        // sm:16 is 5 % faster (outside, spreads small); at B 16 of a third
        // context nothing but sm:16 was measured
        let second = table(
            vec![
                at(8, "sm:4", 10.15, 0.01),
                at(8, "sm:8", 10.0, 0.01),
                at(16, "sm:8", 21.0, 0.02),
                at(16, "sm:16", 20.0, 0.02),
                SweepCell {
                    batch: 16,
                    ..cell(65536, "sm:16", 25.0, 0.0)
                },
            ],
            "NVIDIA H200",
        );
        let rows = compare(&first, &second).unwrap();
        assert_eq!(rows.len(), 3);
        let (b8, b16, b16_64k) = (&rows[0], &rows[1], &rows[2]);
        assert_eq!(
            (b8.batch, b8.choice.as_str(), b8.best.as_str()),
            (8, "sm:4", "sm:8")
        );
        assert!((b8.ratio.unwrap() - 1.015).abs() < 1e-9 && b8.within);
        assert_eq!((b16.choice.as_str(), b16.best.as_str()), ("sm:8", "sm:16"));
        assert!((b16.ratio.unwrap() - 1.05).abs() < 1e-9 && !b16.within);
        assert_eq!(
            (b16_64k.context, b16_64k.choice_ms, b16_64k.within),
            (65536, None, false)
        );
        let text = compare_table(&rows);
        assert!(
            text.contains("OUTSIDE") && text.contains("not measured"),
            "{text}"
        );
        assert!(text.contains("1 of 3"), "{text}");
        // a spread larger than 2 % widens the tolerance: 5 % slower, 6 % spread
        let wide = table(
            vec![at(16, "sm:8", 21.0, 1.26), at(16, "sm:16", 20.0, 0.1)],
            "NVIDIA H200",
        );
        let r = &compare(&first, &wide).unwrap()[0];
        assert!((r.tolerance - 0.06).abs() < 1e-9 && r.within);
        // another GPU's sweep is refused with both names
        let other = table(vec![at(8, "sm:4", 10.0, 0.0)], "NVIDIA A100-SXM4-80GB");
        let e = compare(&first, &other).unwrap_err().to_string();
        assert!(e.contains("H200") && e.contains("A100"), "{e}");
    }

    #[test]
    fn over_contexts_the_geometric_mean_ratio_decides() {
        let configs = [FetchChoice::Sm { ctas: 4 }, FetchChoice::Sm { ctas: 8 }];
        // sm:4 best at 32K by 2 %, sm:8 best at 64K by 10 %: sm:8 overall,
        // reported with its 64K time.
        let cells = [
            cell(32768, "sm:4", 10.0, 0.0),
            cell(32768, "sm:8", 10.2, 0.0),
            cell(65536, "sm:4", 22.0, 0.0),
            cell(65536, "sm:8", 20.0, 0.0),
        ];
        let refs: Vec<&SweepCell> = cells.iter().collect();
        assert_eq!(
            choose(&refs, &configs),
            Some((FetchChoice::Sm { ctas: 8 }, 20.0))
        );
        assert_eq!(choose(&[], &configs), None);
    }

    #[test]
    fn a_configuration_missing_a_context_is_named() {
        let split = |ctas| FetchChoice::Split { ctas, ce_pct: 50 };
        let configs = [FetchChoice::Sm { ctas: 8 }, split(8), split(16)];
        // two merged sweeps: splits at 8 CTAs at 32K, at 16 CTAs at 64K
        let cells = [
            cell(32768, "sm:8", 10.0, 0.0),
            cell(65536, "sm:8", 14.0, 0.0),
            cell(32768, "split:8:50", 9.0, 0.0),
            cell(65536, "split:16:50", 13.0, 0.0),
        ];
        let inc = incomplete_configs(&cells, &configs);
        assert_eq!(inc.len(), 2, "{inc:?}");
        assert!(inc.contains(&(
            cells[0].mode,
            cells[0].batch,
            "split:8:50".into(),
            vec![65536]
        )));
        assert!(inc.contains(&(
            cells[0].mode,
            cells[0].batch,
            "split:16:50".into(),
            vec![32768]
        )));
        // and the choice falls back to the configuration measured everywhere
        let refs: Vec<&SweepCell> = cells.iter().collect();
        assert_eq!(
            choose(&refs, &configs),
            Some((FetchChoice::Sm { ctas: 8 }, 14.0))
        );
    }

    #[test]
    fn splits_take_the_fastest_cta_count_and_count_only_their_sm_share() {
        let sm = |ctas| FetchChoice::Sm { ctas };
        assert_eq!(
            split_ctas(&[(sm(4), 12.0), (sm(8), 10.0), (FetchChoice::Dma, 9.0)]),
            Some(8)
        );
        // a tie goes to fewer CTAs; no SM configuration, no split
        assert_eq!(split_ctas(&[(sm(16), 10.0), (sm(8), 10.0)]), Some(8));
        assert_eq!(split_ctas(&[(FetchChoice::Dma, 9.0)]), None);
        let split = |ce_pct| FetchChoice::Split { ctas: 8, ce_pct };
        assert!(sms(split(75)) < sms(split(25)) && sms(split(25)) < sms(sm(8)));
        assert_eq!(sms(FetchChoice::Dma), 0);
        // the fastest split wins; a split tied with sm:8 wins on SM time
        let configs = [sm(4), sm(8), FetchChoice::Dma, split(25), split(50)];
        let cells = [
            cell(32768, "sm:4", 10.5, 0.0),
            cell(32768, "sm:8", 10.0, 0.0),
            cell(32768, "dma", 14.0, 0.0),
            cell(32768, "split:8:25", 9.5, 0.0),
            cell(32768, "split:8:50", 9.8, 0.0),
        ];
        let refs: Vec<&SweepCell> = cells.iter().collect();
        assert_eq!(choose(&refs, &configs), Some((split(25), 9.5)));
        let cells = [
            cell(32768, "sm:8", 10.0, 0.2),
            cell(32768, "split:8:50", 10.1, 0.0),
        ];
        let refs: Vec<&SweepCell> = cells.iter().collect();
        assert_eq!(choose(&refs, &configs), Some((split(50), 10.1)));
    }

    #[test]
    fn the_sweep_table_gives_splits_one_column_per_share() {
        let at = |b, cfg: &str, ms| SweepCell {
            batch: b,
            ..cell(32768, cfg, ms, 0.0)
        };
        let cells = vec![
            at(8, "sm:4", 10.0),
            at(8, "sm:8", 11.0),
            at(8, "split:4:50", 9.0),
            at(16, "sm:4", 21.0),
            at(16, "sm:8", 20.0),
            at(16, "split:8:50", 22.0),
        ];
        let labels = ["sm:4", "sm:8", "split:4:50", "split:8:50"];
        let t = table_from(cells, &labels, "NVIDIA H200");
        // the table reads back through its JSON with the split entry
        let t = FetchTable::parse(&serde_json::to_string(&t).unwrap(), "t").unwrap();
        assert_eq!(
            t.choose(FetchMode::Sync, 8),
            FetchChoice::Split {
                ctas: 4,
                ce_pct: 50
            }
        );
        assert_eq!(t.choose(FetchMode::Sync, 16), FetchChoice::Sm { ctas: 8 });
        let text = sweep_table(&t);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[0].matches("split:N:50").count(), 1, "{text}");
        assert!(lines[1].contains("*9.00±0.00 N4"), "{text}");
        assert!(
            lines[2].contains("22.00±0.00 N8") && lines[2].contains("*20.00"),
            "{text}"
        );
    }
}
