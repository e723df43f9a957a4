//! `sparda offload-check`: bitwise identity of GPU-resident and offloaded
//! decode (and of prefetch on/off), with selections against the CPU reference.

use super::fixture_tokenizer;
use crate::*;
use sparda::cpu::{CpuModel, EngineOptions};
use sparda::generate::{self};
use sparda::model::PrefillMode;
use sparda::pipeline::GpuModel;
use sparda::tokenizer::Tokenizer;
use sparda::{Error, Result};
use std::path::PathBuf;

/// Opens `model` with `--dense-len` applied to its sparse settings.
///
/// Errors: as [`sparda::bench::open_model`]; [`Error::Input`] for a
/// dense_len on a model without sparse settings.
fn open_checked(a: &OffloadCheckArgs) -> Result<sparda::weights::Checkpoint> {
    let mut ckpt = sparda::bench::open_model(&a.model)?;
    if let Some(dl) = a.dense_len {
        let sc = ckpt.config.sparse.as_mut().ok_or_else(|| {
            Error::Input(format!(
                "--dense-len {dl}: {} has no sparse_config to set it in",
                a.model
            ))
        })?;
        sc.dense_len = dl;
    }
    Ok(ckpt)
}

/// FNV-1a over the prompts' token ids (each prompt's length first).
fn token_hash(prompts: &[Vec<u32>]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in prompts {
        for x in std::iter::once(p.len() as u32).chain(p.iter().copied()) {
            for b in x.to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    h
}

/// Reads a resident run written by `--save-resident`.
///
/// Errors: [`Error::Input`] naming the file when it cannot be parsed or
/// when its key (binary, GPU, model, prompts, settings) differs from this
/// run's, with both values of each differing field.
fn load_resident(
    path: &std::path::Path,
    key: &serde_json::Value,
) -> Result<sparda::checks::identity::Run> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let rec: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        Error::Input(format!(
            "{}: not a resident run record: {e}",
            path.display()
        ))
    })?;
    let got = &rec["key"];
    let differ: Vec<String> = key
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| &got[k.as_str()] != *v)
        .map(|(k, v)| format!("{k}: recorded {} vs now {v}", got[k.as_str()]))
        .collect();
    if !differ.is_empty() {
        return Err(Error::Input(format!(
            "{}: the resident run was recorded with other settings ({})",
            path.display(),
            differ.join("; ")
        )));
    }
    serde_json::from_value(rec["run"].clone())
        .map_err(|e| Error::Input(format!("{}: field run: {e}", path.display())))
}

pub(crate) fn cmd_offload_check(a: OffloadCheckArgs) -> Result<()> {
    sparda::cuda::require()?;
    let ckpt = open_checked(&a)?;
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| {
        if a.model.starts_with("synth:") {
            fixture_tokenizer()
        } else {
            PathBuf::from(&a.model).join("tokenizer.json")
        }
    });
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let text = std::fs::read_to_string(&a.prompt_file).map_err(|e| Error::io(&a.prompt_file, e))?;
    let mut prompt = tokenizer.encode(&text)?;
    if prompt.len() < a.prompt_tokens {
        return Err(Error::Input(format!(
            "{}: {} tokens, fewer than --prompt-tokens {}",
            a.prompt_file.display(),
            prompt.len(),
            a.prompt_tokens
        )));
    }
    if a.batch == 0 || prompt.len() < a.prompt_tokens + 997 * a.batch.saturating_sub(1) {
        return Err(Error::Input(format!(
            "--batch {}: {} has {} tokens; {} sequences of up to {} tokens at offsets of 997 need {}",
            a.batch,
            a.prompt_file.display(),
            prompt.len(),
            a.batch,
            a.prompt_tokens,
            a.prompt_tokens + 997 * a.batch.saturating_sub(1)
        )));
    }
    if a.prompt_tokens <= 61 * a.batch.saturating_sub(1) {
        return Err(Error::Input(format!(
            "--prompt-tokens {} is too short for --batch {} (sequence b gets 61·b fewer tokens)",
            a.prompt_tokens, a.batch
        )));
    }
    let prompts: Vec<Vec<u32>> = (0..a.batch)
        .map(|b| prompt[997 * b..997 * b + a.prompt_tokens - 61 * b].to_vec())
        .collect();
    prompt.truncate(a.prompt_tokens);
    generate::check_length(
        prompt.len(),
        a.new_tokens,
        ckpt.config.max_position_embeddings,
    )?;
    let opts = EngineOptions {
        attention: a.sel.overrides(Some(true)),
        prefill: PrefillMode::Auto,
    };
    let gpu = std::sync::Arc::new(sparda::cuda::Gpu::new(0)?);
    // refused with the numbers before anything is allocated: the weights,
    // then the resident run's and the offloaded runs' KV (every sequence
    // has room for its prompt and the new tokens, as checks::identity sizes it)
    sparda::memory::check_weights(&gpu, &ckpt.config, ckpt.eviction_heads)?;
    let mut model = GpuModel::new(gpu.clone(), &ckpt, opts)?;
    a.offload.apply_sm_residency(&mut model);
    drop(ckpt);
    let cap = prompts.iter().map(Vec::len).max().unwrap_or(0) + a.new_tokens + 1;
    let change = "lower --batch, --prompt-tokens or --new-tokens";
    model.check_memory(a.batch, cap, None, true, change)?;
    for o in a.offload.options() {
        model.check_memory(a.batch, cap, Some(o), true, change)?;
    }
    eprintln!(
        "offload-check: {} ({:?}, S = {} blocks) on {}, prompt {} tokens, {} new tokens",
        a.model,
        model.plan.mode,
        model.plan.budget.attended,
        gpu.info().name,
        prompt.len(),
        a.new_tokens
    );
    let forecast = a
        .forecast
        .as_deref()
        .map(|spec| sparda::model::forecast::ForecastWeights::from_arg(spec, &model.config))
        .transpose()?;
    let mut modes = Vec::new();
    for o in a.offload.options() {
        if forecast.is_some() {
            for p in &a.prefetch {
                modes.push(sparda::checks::identity::Mode {
                    offload: o,
                    prefetch: *p == OnOff::On,
                    copy_delay_us: 0,
                });
            }
            if a.copy_delay_us > 0 {
                modes.push(sparda::checks::identity::Mode {
                    offload: o,
                    prefetch: true,
                    copy_delay_us: a.copy_delay_us,
                });
            }
        } else {
            modes.push(sparda::checks::identity::Mode {
                offload: o,
                prefetch: false,
                copy_delay_us: 0,
            });
        }
    }
    if let Some(f) = &forecast {
        model.set_forecast(Some(f), false)?;
    }
    // what a recorded resident run must share with this one to stand in
    // for it: the same binary, GPU, model, prompts and settings
    let key = serde_json::json!({
        "commit": sparda::bench::git_commit(),
        "gpu": gpu.info().name,
        "model": a.model,
        "prompt_file": a.prompt_file,
        "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
        "prompt_hash": format!("{:016x}", token_hash(&prompts)),
        "new_tokens": a.new_tokens,
        "forecast": a.forecast,
        "mode": format!("{:?}", model.plan.mode),
        "budget_blocks": model.plan.budget.attended,
        "select_blocks": model.plan.sparse.select_blocks,
        "selection": format!("{:?}", model.plan.rule()),
        "dense_len": a.dense_len,
        "sample_memory_every": a.sample_memory_every,
    });
    if let Some(path) = &a.save_resident {
        let r = sparda::checks::identity::run(
            &mut model,
            &prompts,
            a.new_tokens,
            None,
            a.sample_memory_every,
        )?;
        eprintln!(
            "offload-check: GPU-resident sparse, {} tokens in {:.0} ms; recorded in {}",
            r.tokens.len(),
            r.decode_ms,
            path.display()
        );
        let rec = serde_json::json!({
            "what": "offload-check resident run (read back with --resident)",
            "key": key,
            "date_utc": sparda::checks::kernels::utc_now_iso(),
            "run": r,
        });
        return sparda::report::write_atomic(path, &rec);
    }
    let base = a
        .resident
        .as_deref()
        .map(|path| load_resident(path, &key))
        .transpose()?;
    let (mut ok, mut v) = sparda::checks::identity::offload_identity(
        &mut model,
        &prompts,
        a.new_tokens,
        &modes,
        a.sample_memory_every,
        base,
    )?;
    v["resident_from"] = serde_json::json!(a.resident);
    v["forecast"] = serde_json::json!(a.forecast);
    if let (Some(f), true) = (&forecast, a.cpu_check_steps > 0) {
        // the CPU reference opens the model again (the GPU run dropped its copy)
        let mut cpu = CpuModel::new(&open_checked(&a)?, opts)?;
        cpu.set_forecast(Some(f.clone()))?;
        let mut per_kv = serde_json::Map::new();
        for kv in [None, a.offload.options().first().copied()] {
            model.set_offload(kv)?;
            let (pass, j) = sparda::checks::identity::forecast_selection(
                &mut model,
                &cpu,
                &prompts,
                a.cpu_check_steps,
            )?;
            ok &= pass;
            per_kv.insert(if kv.is_some() { "offload" } else { "gpu" }.into(), j);
        }
        model.set_offload(None)?;
        v["forecast_selection_vs_cpu"] = serde_json::Value::Object(per_kv);
    }
    let info = gpu.info();
    v["gpu"] = serde_json::json!(info.name);
    v["date_utc"] = serde_json::json!(sparda::checks::kernels::utc_now_iso());
    v["commit"] = serde_json::json!(sparda::bench::git_commit());
    v["model"] = serde_json::json!(a.model);
    v["attention"] = serde_json::json!({
        "mode": format!("{:?}", model.plan.mode),
        "budget_blocks": model.plan.budget.attended,
        "block_size": model.plan.budget.block_size,
    });
    v["prompt_file"] = serde_json::json!(a.prompt_file);
    std::fs::write(&a.json, serde_json::to_string_pretty(&v).expect("json"))
        .map_err(|e| Error::io(&a.json, e))?;
    check_outcome("offload-check", "identity", ok, &a.json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(dir: &std::path::Path, key: serde_json::Value) -> PathBuf {
        let run = sparda::checks::identity::Run {
            tokens: vec![5, 7, 9],
            logit_hashes: vec![1, 2, 3],
            decode_ms: 12.5,
            stats: None,
            memory: vec![],
            fetch_resolved: None,
            graph_steps: 0,
        };
        let p = dir.join("resident.json");
        let rec = serde_json::json!({"key": key, "run": run});
        std::fs::write(&p, rec.to_string()).unwrap();
        p
    }

    #[test]
    fn resident_record_round_trips_and_refuses_other_settings() {
        let dir = std::env::temp_dir().join(format!("sparda-resident-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = serde_json::json!({"model": "synth:nosa-8b", "new_tokens": 20000});
        let p = record(&dir, key.clone());
        let run = load_resident(&p, &key).unwrap();
        assert_eq!(run.tokens, vec![5, 7, 9]);
        assert_eq!(run.logit_hashes, vec![1, 2, 3]);
        let other = serde_json::json!({"model": "synth:nosa-8b", "new_tokens": 2000});
        let e = load_resident(&p, &other).unwrap_err().to_string();
        assert!(e.contains("new_tokens: recorded 20000 vs now 2000"), "{e}");
        std::fs::write(&p, "{").unwrap();
        let e = load_resident(&p, &key).unwrap_err().to_string();
        assert!(e.contains("not a resident run record"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn token_hash_separates_prompt_boundaries() {
        let a = token_hash(&[vec![1, 2], vec![3]]);
        let b = token_hash(&[vec![1], vec![2, 3]]);
        assert_ne!(a, b);
        assert_eq!(a, token_hash(&[vec![1, 2], vec![3]]));
    }
}
