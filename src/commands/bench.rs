//! `sparda bench`: the decode benchmark (runtime.md §5).

use crate::*;
use sparda::model::PrefillMode;
use sparda::{Error, Result};

pub(crate) fn cmd_bench(a: BenchArgs) -> Result<()> {
    let contexts = a
        .context
        .iter()
        .map(|c| sparda::bench::parse_tokens(c))
        .collect::<Result<Vec<_>>>()?;
    if a.json.is_none() && a.resume.is_none() {
        return Err(Error::Input(
            "bench: give --json FILE (the report) or --resume DIR (one file per cell), or both"
                .into(),
        ));
    }
    // Book prompts need a tokenizer: --tokenizer, else the checkpoint's
    // tokenizer.json, else the fixture's (the synth presets' own).
    let tokenizer = a.tokenizer.clone().or_else(|| {
        let own = std::path::Path::new(&a.model).join("tokenizer.json");
        if a.model.starts_with("synth:") {
            Some(fixture_tokenizer()).filter(|p| p.is_file())
        } else {
            Some(own).filter(|p| p.is_file())
        }
    });
    let spec = sparda::bench::BenchSpec {
        model: a.model,
        sparse: a
            .attention
            .iter()
            .map(|x| matches!(x, AttentionArg::Sparse))
            .collect(),
        selection: a.sel.selection.map(Into::into),
        budget_blocks: a.sel.budget_blocks,
        select_blocks: a.sel.select_blocks,
        batches: a.batch,
        contexts,
        steps: a.steps,
        warmup: a.warmup,
        prefill: match a.prefill {
            BenchPrefillArg::Synthetic => sparda::bench::BenchPrefill::Synthetic,
            BenchPrefillArg::Dense => sparda::bench::BenchPrefill::Real(PrefillMode::Dense),
            BenchPrefillArg::Sparse => sparda::bench::BenchPrefill::Real(PrefillMode::Auto),
        },
        prefill_attention: a.prefill_attention.map(Into::into),
        tokenizer,
        texts: a
            .texts
            .unwrap_or_else(|| sparda::bench::default_texts_dir(std::path::Path::new("."))),
        seed: a.seed,
        ceiling_reps: a.ceiling_reps,
        profile_reps: a.profile_reps,
        kv: a
            .kv
            .iter()
            .flat_map(|k| match k {
                KvArg::Gpu => vec![None],
                KvArg::Offload => a.offload.options().into_iter().map(Some).collect(),
            })
            .collect(),
        fetch_timing_steps: a.fetch_timing_steps,
        forecast: a.forecast,
        prefetch: a.prefetch.iter().map(|p| *p == OnOff::On).collect(),
        sync: a.sync == OnOff::On,
        reserve_fetch_sms: a.offload.reserve_fetch_sms,
        fetch_whole_sms: a.offload.fetch_whole_sms,
        cta_timeline: a.cta_timeline,
        equivalent_batches: a.equivalent_batch,
        trace_steps: if a.trace.is_some() { a.trace_steps } else { 0 },
        resume: a.resume.clone(),
    };
    let report = sparda::bench::run(&spec).inspect_err(|e| {
        if let Error::Interrupted(_) = e {
            // no report of an interrupted grid; each finished cell's line is above
            eprintln!(
                "bench: interrupted; {} not written (the finished cells are printed above{})",
                a.json
                    .as_deref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "the report".into()),
                if a.resume.is_some() {
                    "; each finished cell's file is in the --resume directory"
                } else {
                    ""
                }
            );
        }
    })?;
    if let Some(j) = &a.json {
        std::fs::write(j, serde_json::to_string_pretty(&report).expect("json"))
            .map_err(|e| Error::io(j, e))?;
    }
    print!("{}", sparda::bench::table(&report));
    if let Some(j) = &a.json {
        eprintln!("bench: report in {}", j.display());
    }
    if let Some(d) = &a.resume {
        eprintln!(
            "bench: cell files in {} (merge them: sparda report {} --out PREFIX)",
            d.display(),
            d.display()
        );
    }
    Ok(())
}
