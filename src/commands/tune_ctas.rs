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
    };
    if let Some(p) = &a.out {
        super::mode::check_output_dirs([p])?;
    }
    let table = sparda::tune::run(&spec)?;
    let out = a
        .out
        .unwrap_or_else(|| PathBuf::from("tuning").join(table_file_name(&table.gpu)));
    // --append: a grid spread over several device calls, one table
    let table = if a.append && out.exists() {
        let old = FetchTable::load(&out)?;
        sparda::tune::merge(&old, table, &out.display().to_string())?
    } else {
        table
    };
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let text = serde_json::to_string_pretty(&table)
        .map_err(|e| Error::Input(format!("serialising the table: {e}")))?;
    std::fs::write(&out, text + "\n").map_err(|e| Error::io(&out, e))?;
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

/// `--show`: the table in use for this GPU (or `gpu`) and where it came from.
fn show(gpu: Option<&str>) -> Result<()> {
    let name = match gpu {
        Some(g) => g.to_string(),
        None => {
            sparda::cuda::require()?;
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
            print!("{}", sparda::tune::sweep_table(&t));
        }
        None => println!(
            "no fetch table for the {name}: --fetch auto uses SparDA's rule (H100: 16 CTAs for B ≤ 16 else 32; A100: 16 for B ≤ 32 else 32; other GPUs: 16); `sparda tune-ctas` measures one"
        ),
    }
    Ok(())
}
