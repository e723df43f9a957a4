//! `sparda generate`: text generation on the CPU reference or the GPU.

use super::mode::{
    build_engine, check_mode_flags, check_output_dirs, load_forecast, load_tokenizer, mode_config,
    open_checkpoint, plan_json, resolve_backend, Engine,
};
use crate::*;
use indicatif::{ProgressBar, ProgressStyle};
use sparda::generate::{self, Request};
use sparda::sample::SamplingParams;
use sparda::tokenizer::TextStream;
use sparda::{Error, Result};
use std::io::Write;

/// Checks everything `generate` can check from its flags alone (flag
/// combinations, value ranges, output directories) for the resolved
/// `backend`; runs before any model is built or loaded.
pub(crate) fn check_generate_flags(a: &GenerateArgs, backend: Backend) -> Result<()> {
    check_mode_flags(&a.mode, backend, "generate")?;
    if a.prompt_tokens == Some(0) {
        return Err(Error::Input("--prompt-tokens must be ≥ 1".into()));
    }
    if a.logprobs.is_some() && a.json.is_none() {
        return Err(Error::Input(
            "--logprobs writes to the JSON report: add --json FILE".into(),
        ));
    }
    check_output_dirs([&a.json, &a.trace].into_iter().flatten())
}

pub(crate) fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let backend = resolve_backend(a.mode.backend);
    // Everything below up to the model build reads only flags and small
    // files, so a bad invocation fails in well under a second, before
    // e.g. synth:nosa-8b spends minutes and ~17 GB on its weights; flag
    // errors come before a missing CUDA library is reported.
    check_generate_flags(&a, backend)?;
    if backend == Backend::Cuda {
        sparda::cuda::require()?;
    }
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(t), None) => t.clone(),
        (None, Some(p)) if p.as_os_str() == "-" => {
            let mut t = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut t)
                .map_err(|e| Error::Input(format!("--prompt-file - (standard input): {e}")))?;
            t
        }
        (None, Some(p)) => std::fs::read_to_string(p)
            .map_err(|e| Error::Input(format!("--prompt-file {}: {e}", p.display())))?,
        _ => {
            return Err(Error::Input(
                "give --prompt TEXT or --prompt-file FILE".into(),
            ))
        }
    };
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling.validate()?;
    let config = mode_config(&a.mode)?;
    let tokenizer = load_tokenizer(&a.mode)?;
    let mut prompt = tokenizer.encode(&text)?;
    if let Some(n) = a.prompt_tokens {
        if n > prompt.len() {
            eprintln!(
                "note: --prompt-tokens {n}, but the prompt has {} tokens; using all of them",
                prompt.len()
            );
        }
        prompt.truncate(n);
    }
    generate::check_length(
        prompt.len(),
        a.max_new_tokens,
        config.max_position_embeddings,
    )?;
    let forecast = load_forecast(&a.mode, &config)?;
    let ckpt = open_checkpoint(&a.mode)?;
    let engine = build_engine(
        &a.mode,
        backend,
        &ckpt,
        forecast.as_ref(),
        a.trace.is_some(),
    )?;
    let plan_json = plan_json(&a.mode, backend, &engine, forecast.is_some());
    eprintln!(
        "model {} ({} layers, d {}), attention {:?}, backend {}, prompt {} tokens",
        a.mode.model.display(),
        ckpt.config.num_hidden_layers,
        ckpt.config.hidden_size,
        engine.plan().mode,
        engine.backend_name(),
        prompt.len()
    );
    let req = Request {
        prompt,
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_ids: if a.ignore_eos {
            a.stop_id.clone()
        } else {
            let mut ids = ckpt.config.eos_token_ids.clone();
            ids.extend(&a.stop_id);
            ids
        },
        logprobs: a.logprobs,
    };
    let bar = ProgressBar::new(req.prompt.len() as u64).with_style(
        ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens {per_sec} eta {eta}")
            .expect("static template"),
    );
    let mut stream = TextStream::with_prompt(&tokenizer, &req.prompt);
    let mut stdout = std::io::stdout().lock();
    // A closed pipe (`| head`) ends the printing quietly; generation goes on.
    let mut pipe_open = true;
    let progress = |done: usize, _| bar.set_position(done as u64);
    let stop_ids = req.stop_ids.clone();
    let on_token = |tok| {
        if !bar.is_finished() {
            bar.finish_and_clear();
        }
        if stop_ids.contains(&tok) || !pipe_open {
            // a stop token ends the text without being printed (as vLLM, llama.cpp)
            return Ok(());
        }
        let piece = stream.push(tok)?;
        match stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
        {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                pipe_open = false;
                Ok(())
            }
            r => r.map_err(|e| Error::io("<stdout>", e)),
        }
    };
    let out = match engine {
        Engine::Cpu(model) => generate::generate_cpu(&model, &req, progress, on_token).map(|r| r.0),
        Engine::Cuda(mut model) => {
            let out = generate::generate_gpu(&mut model, &req, progress, on_token);
            // the GPU spans recorded so far go into the trace, also when the run
            // failed or was interrupted (a failure to flush them then is secondary)
            match (model.flush_trace(), out) {
                (Ok(_), out) | (Err(_), out @ Err(_)) => out,
                (Err(e), Ok(_)) => Err(e),
            }
        }
    };
    bar.finish_and_clear();
    let out = out?;
    writeln!(stdout).ok();
    eprintln!("{}", run_summary(req.prompt.len(), &out));
    if out.stop == generate::StopReason::Interrupted {
        // No --json report: an interrupted run's figures are not the run's
        // (as vLLM's and llama.cpp's tools leave no result file).
        if let Some(p) = &a.json {
            eprintln!("interrupted: {} not written", p.display());
        }
        return Err(Error::Interrupted(format!(
            "decode step {} ({} tokens generated)",
            out.tokens.len(),
            out.tokens.len()
        )));
    }
    if let Some(p) = a.json {
        // the generated text, without the stop token that ended it
        let text_ids = match out.stop {
            generate::StopReason::Eos => &out.tokens[..out.tokens.len() - 1],
            generate::StopReason::MaxTokens | generate::StopReason::Interrupted => &out.tokens[..],
        };
        let mut v = serde_json::json!({
            "model": a.mode.model, "attention": plan_json, "prompt_tokens": req.prompt, "tokens": out.tokens,
            "text": tokenizer.decode(text_ids)?, "stop": out.stop, "stop_ids": req.stop_ids,
            "sampling": {"temperature": req.sampling.temperature, "top_k": req.sampling.top_k,
                         "top_p": req.sampling.top_p, "seed": req.sampling.seed},
            "prefill_ms": out.prefill_ms, "decode_ms": out.decode_ms, "decode_tokens_per_s": out.decode_tokens_per_s(),
        });
        if req.logprobs.is_some() {
            let text = |id: u32| tokenizer.decode(&[id]).unwrap_or_default();
            v["logprobs"] = serde_json::json!(out
                .logprobs
                .iter()
                .map(|t| serde_json::json!({
                    "token": t.token, "text": text(t.token), "logprob": t.logprob,
                    "top_logprobs": t.top_logprobs.iter()
                        .map(|&(id, lp)| serde_json::json!({"token": id, "text": text(id), "logprob": lp}))
                        .collect::<Vec<_>>(),
                }))
                .collect::<Vec<_>>());
        }
        std::fs::write(&p, serde_json::to_string_pretty(&v).expect("json"))
            .map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}

/// The one-line summary `generate` prints on stderr after a run: prompt tokens,
/// prefill ms and tokens/s, tokens generated, decode steps (the first token
/// comes from the prefill), decode ms and tokens/s, and why it stopped. A run
/// that generated no token, or one token and so no decode step, says so
/// instead of a decode rate of 0.
fn run_summary(prompt_tokens: usize, out: &generate::Output) -> String {
    let prefill = format!(
        "prefill {prompt_tokens} tokens in {:.0} ms ({:.1} tokens/s)",
        out.prefill_ms,
        prompt_tokens as f64 / (out.prefill_ms / 1e3)
    );
    let decode = match out.tokens.len() {
        0 => "no tokens generated".to_string(),
        1 => "1 token generated (from the prefill; no decode step)".to_string(),
        n => format!(
            "{n} tokens generated, {} decode steps in {:.0} ms ({:.2} tokens/s)",
            n - 1,
            out.decode_ms,
            out.decode_tokens_per_s()
        ),
    };
    format!("{prefill}; {decode}; stop: {:?}", out.stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(tokens: usize, decode_ms: f64) -> generate::Output {
        generate::Output {
            tokens: vec![7; tokens],
            prefill_ms: 500.0,
            decode_ms,
            stop: generate::StopReason::MaxTokens,
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn the_summary_gives_a_decode_rate_only_when_decode_steps_ran() {
        let s = run_summary(1000, &output(0, 0.0));
        assert_eq!(
            s,
            "prefill 1000 tokens in 500 ms (2000.0 tokens/s); no tokens generated; stop: MaxTokens"
        );
        assert!(run_summary(1000, &output(1, 0.0))
            .contains("1 token generated (from the prefill; no decode step)"));
        let s = run_summary(1000, &output(5, 100.0));
        assert!(
            s.contains("5 tokens generated, 4 decode steps in 100 ms (40.00 tokens/s)"),
            "{s}"
        );
    }
}
