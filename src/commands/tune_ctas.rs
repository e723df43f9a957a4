//! `sparda tune-ctas`: measures this GPU's fetch table (sparda::tune), or
//! shows the table in use (`--show`).

use crate::*;
use sparda::kv::fetch_table::{
    table_file_name, FetchChoice, FetchMode, FetchTable, TableSource, ENV_TABLE,
};
use sparda::{Error, Result};
use std::path::PathBuf;

pub(crate) fn cmd_tune_ctas(a: TuneCtasArgs) -> Result<()> {
    if a.show {
        return show(a.gpu.as_deref());
    }
    if let Some(second) = &a.compare {
        return compare(second, a.table.as_deref());
    }
    let quick = a.quick;
    let contexts = match (&a.context, quick) {
        (Some(c), _) => c
            .iter()
            .map(|c| sparda::bench::parse_tokens(c))
            .collect::<Result<Vec<_>>>()?,
        (None, true) => vec![32_768],
        (None, false) => vec![32_768, 65_536],
    };
    let mut batches = match (&a.batch, quick) {
        (Some(b), _) => b.clone(),
        (None, true) => vec![8, 16, 32],
        (None, false) => vec![1, 4, 8, 16, 32, 64, 128],
    };
    batches.sort_unstable();
    batches.dedup();
    if batches.contains(&0) || contexts.contains(&0) {
        return Err(Error::Input(
            "tune-ctas: batch sizes and contexts must be ≥ 1".into(),
        ));
    }
    let ctas = match (&a.ctas, quick) {
        (Some(c), _) => c.clone(),
        (None, true) => vec![4, 8, 16, 32],
        (None, false) => sparda::tune::DEFAULT_CTAS.to_vec(),
    };
    if let Some(&n) = ctas.iter().find(|&&n| n == 0 || n > 1024) {
        return Err(Error::Input(format!("--ctas {n}: give 1 … 1024 CTAs")));
    }
    let mut configs: Vec<FetchChoice> = ctas.iter().map(|&c| FetchChoice::Sm { ctas: c }).collect();
    if !a.no_dma {
        configs.push(FetchChoice::Dma);
    }
    let whole = match (&a.whole_ctas, quick) {
        _ if a.no_whole => Vec::new(),
        (Some(c), _) => c.clone(),
        (None, true) => vec![8],
        (None, false) => sparda::tune::DEFAULT_WHOLE_CTAS.to_vec(),
    };
    for &n in &whole {
        // whole SMs apply while the copy takes at most half of them: the
        // sweep checks N against this GPU's SMs before it measures
        if n == 0 || n > 1024 {
            return Err(Error::Input(format!(
                "--whole-ctas {n}: give 1 … 1024 CTAs"
            )));
        }
        configs.push(FetchChoice::SmWhole { ctas: n });
    }
    let split_pcts = match (&a.split_pct, quick) {
        _ if a.no_split || a.no_dma => Vec::new(),
        (Some(p), _) => p.clone(),
        (None, true) => vec![50],
        (None, false) => sparda::tune::DEFAULT_SPLIT_PCTS.to_vec(),
    };
    for &p in &split_pcts {
        sparda::kv::split::check_ce_pct(p, &format!("--split-pct {p}"))?;
    }
    let modes: Vec<FetchMode> = a
        .mode
        .iter()
        .map(|m| match m {
            TuneModeArg::Sync => FetchMode::Sync,
            TuneModeArg::Prefetch => FetchMode::Prefetch,
        })
        .collect();
    let spec = sparda::tune::TuneSpec {
        model: a.model,
        batches,
        contexts,
        configs,
        modes,
        repeats: a.repeats.unwrap_or(if quick { 2 } else { 3 }),
        steps: a.steps.unwrap_or(if quick { 12 } else { 16 }),
        warmup: a.warmup,
        seed: 1,
        split_pcts,
        done: Vec::new(),
    };
    if let Some(p) = &a.out {
        super::mode::check_output_dirs([p])?;
    }
    // --append: a grid spread over several device calls, one table; the
    // table at --out before this run, merged into every write
    let mut old: Option<FetchTable> = None;
    let mut out = a.out.clone();
    let mut spec = spec;
    if a.append {
        sparda::cuda::require()?;
        let name = sparda::cuda::Gpu::new(0)?.info().name.clone();
        let p = out
            .get_or_insert_with(|| PathBuf::from("tuning").join(table_file_name(&name)))
            .clone();
        // appending: the cells the table has are not measured again
        if p.exists() {
            let t = FetchTable::load(&p)?;
            if t.gpu != name {
                return Err(Error::Input(format!(
                    "tune-ctas --append {}: a fetch table of the {} (this GPU is the {name}); give another --out",
                    p.display(),
                    t.gpu
                )));
            }
            spec.done = sparda::tune::cells_of(&t, &p.display().to_string())?;
            if a.remeasure_medians {
                let mut done = std::mem::take(&mut spec.done);
                let n = sparda::tune::drop_median_cells(&mut done, &spec);
                spec.done = done;
                eprintln!(
                    "tune-ctas: --remeasure-medians: {n} cells on round medians will be measured again"
                );
            }
            let mut keys: Vec<String> = spec
                .done
                .iter()
                .map(|c| format!("{:?} {} {}", c.mode, c.context, c.batch))
                .collect();
            keys.sort();
            keys.dedup();
            eprintln!(
                "tune-ctas: appending to {} ({} (mode, context, B) cells measured before are kept; those with every configuration asked for are skipped)",
                p.display(),
                keys.len()
            );
            old = Some(t);
        }
    }
    let write = |table: &FetchTable, out: &mut Option<PathBuf>| {
        let path = out
            .get_or_insert_with(|| PathBuf::from("tuning").join(table_file_name(&table.gpu)))
            .clone();
        let table = match &old {
            Some(o) => sparda::tune::merge(o, table.clone(), &path.display().to_string())?,
            None => table.clone(),
        };
        let v = serde_json::to_value(&table)
            .map_err(|e| Error::Input(format!("serialising the table: {e}")))?;
        // atomic (and the directory made): a run killed mid-write keeps the
        // table it appends to
        sparda::report::write_atomic(&path, &v)?;
        Ok::<_, Error>((table, path))
    };
    // each finished cell is written at once: a sweep cut short keeps them
    let table = sparda::tune::run(&spec, |partial| write(partial, &mut out).map(|_| ()))?;
    let (table, out) = write(&table, &mut out)?;
    print!("{}", sparda::tune::sweep_table(&table));
    println!("{}", choices(&table));
    eprintln!(
        "tune-ctas: table written to {} (use it with {ENV_TABLE}={}, or commit it under tuning/ to build it in)",
        out.display(),
        out.display()
    );
    Ok(())
}

/// The choices per batch size and mode, beside SparDA's rule.
fn choices(t: &FetchTable) -> String {
    let mut s = format!(
        "{:>5}  {:<12} {:<12} {:<10}\n",
        "B", "sync", "prefetch", "SparDA rule"
    );
    for e in &t.sync {
        let rule = sparda::pipeline::fetch_rule(&t.gpu, e.batch).label();
        s += &format!(
            "{:>5}  {:<12} {:<12} {:<10}\n",
            e.batch,
            e.choice.label(),
            t.choose(FetchMode::Prefetch, e.batch).label(),
            rule
        );
    }
    s
}

/// `--compare`: `table`'s choices (default: the one in use for the second
/// sweep's GPU) against the second sweep at `second`.
fn compare(second: &std::path::Path, table: Option<&std::path::Path>) -> Result<()> {
    let s = FetchTable::load(second)?;
    let (t, from) = match table {
        Some(p) => (FetchTable::load(p)?, p.display().to_string()),
        None => {
            let env = std::env::var_os(ENV_TABLE).map(PathBuf::from);
            match FetchTable::for_gpu(&s.gpu, env.as_deref())? {
                Some((t, TableSource::BuiltIn(f))) => (t, format!("built in from {f}")),
                Some((t, TableSource::File(f))) => (t, format!("{ENV_TABLE}={f}")),
                Some((_, TableSource::Rule)) | None => {
                    return Err(Error::Input(format!(
                        "tune-ctas --compare {}: no fetch table for the {} to check (give --table FILE)",
                        second.display(),
                        s.gpu
                    )))
                }
            }
        }
    };
    println!(
        "the {} table ({from}; {}, commit {}) against the sweep of {} ({}, commit {}):",
        t.gpu,
        t.date_utc,
        t.commit.as_deref().unwrap_or("?"),
        second.display(),
        s.date_utc,
        s.commit.as_deref().unwrap_or("?")
    );
    print!(
        "{}",
        sparda::tune::compare_table(&sparda::tune::compare(&t, &s)?)
    );
    Ok(())
}

/// `--show`: the table in use for this GPU (or `gpu`) and where it came from.
fn show(gpu: Option<&str>) -> Result<()> {
    let name = match gpu {
        Some(g) => g.to_string(),
        None => {
            sparda::cuda::require().map_err(|e| {
                Error::Input(format!(
                    "{e}; `tune-ctas --show --gpu NAME` shows a GPU's table without one (built in: {})",
                    sparda::kv::fetch_table::built_in_gpus().join(", ")
                ))
            })?;
            sparda::cuda::Gpu::new(0)?.info().name.clone()
        }
    };
    let env = std::env::var_os(ENV_TABLE).map(PathBuf::from);
    match FetchTable::for_gpu(&name, env.as_deref())? {
        Some((t, src)) => {
            let from = match src {
                TableSource::BuiltIn(f) => format!("built in from {f}"),
                TableSource::File(f) => format!("{ENV_TABLE}={f}"),
                TableSource::Rule => "SparDA's rule".into(),
            };
            println!(
                "fetch table of the {} ({from}); measured {} at commit {} ({} SMs, PCIe {}, driver {})",
                t.gpu,
                t.date_utc,
                t.commit.as_deref().unwrap_or("?"),
                t.sm_count,
                t.pcie,
                t.driver
            );
            print!("{}", choices(&t));
            println!(
                "\nthe sweep: step ms (median over rounds of each round's figure, its round_stat) ± half the spread of the round figures; * the table's choice (the fastest over the contexts, ties within the spread going to the one taking fewer SMs)"
            );
            print!("{}", sparda::tune::sweep_table(&t));
        }
        None => {
            println!(
                "no fetch table for the {name}: --fetch auto uses SparDA's rule (H100: 16 CTAs for B ≤ 16 else 32; A100: 16 for B ≤ 32 else 32; other GPUs: 16); `sparda tune-ctas` measures one"
            );
            let near: Vec<&str> = sparda::kv::fetch_table::built_in_gpus()
                .into_iter()
                .filter(|g| g.to_lowercase().contains(&name.to_lowercase()))
                .collect();
            if !near.is_empty() {
                println!(
                    "(tables are keyed by the full name the driver gives: built in for {})",
                    near.join(", ")
                );
            }
        }
    }
    Ok(())
}
