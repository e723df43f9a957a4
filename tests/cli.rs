//! Command-line behaviour that needs no GPU: flags that only make sense with
//! offloaded KV or forecast prefetch are refused with a message naming the
//! flag, and GPU-only commands say what they need (never a panic).

mod common;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn sparda(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(args)
        .output()
        .expect("runs the binary");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the binary like [`sparda`], but kills it if it is still running
/// after `limit` (a check that regressed to after the model build would
/// otherwise build synth:nosa-8b, ~17 GB, for minutes). Returns success,
/// stderr and the elapsed time.
fn sparda_within(args: &[&str], limit: Duration) -> (bool, String, Duration) {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs the binary");
    let mut stderr = child.stderr.take().expect("piped stderr");
    // Read stderr on a thread so a chatty child never blocks on a full pipe.
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        stderr.read_to_string(&mut s).ok();
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().expect("waits on the binary") {
            break st;
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!(
                "sparda {} still running after {limit:?}: the check runs too late",
                args.join(" ")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    (
        status.success(),
        reader.join().expect("stderr reader"),
        elapsed,
    )
}

/// `generate` on the 8B synthetic preset: building it takes minutes, so
/// anything that fails through this must fail before the build.
const NOSA_8B: [&str; 5] = ["generate", "--model", "synth:nosa-8b", "--prompt", "hi"];

/// Generous sanity bound: the checks themselves take milliseconds.
const FAST: Duration = Duration::from_secs(20);

const TINY: [&str; 6] = [
    "generate",
    "--model",
    "synth:tiny",
    "--prompt",
    "hi",
    "--backend",
];

#[test]
fn offload_flags_without_offloaded_kv_are_refused() {
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--fetch", "dma"]);
    let (ok, err) = sparda(&a);
    assert!(!ok);
    assert!(
        err.contains(
            "--fetch, --prefetch-ctas, --offload-layer0, --fetch-whole-sms, --reserve-fetch-sms and --cache-slots apply to offloaded KV"
        ),
        "{err}"
    );
    // the SM residency flags and cache slots too, for generate and perplexity alike
    for flag in [
        &["--fetch-whole-sms"][..],
        &["--reserve-fetch-sms"],
        &["--cache-slots", "16"],
    ] {
        let mut a = TINY.to_vec();
        a.push("cpu");
        a.extend(flag);
        let (ok, err) = sparda(&a);
        assert!(
            !ok && err.contains("apply to offloaded KV"),
            "{flag:?}: {err}"
        );
    }
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--prefetch-ctas", "0"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--prefetch-ctas 0: give 1 … 1024 CTAs"),
        "{err}"
    );
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--prefetch", "off"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--prefetch off applies to forecast mode with offloaded KV"),
        "{err}"
    );
}

#[test]
fn offloaded_kv_on_the_cpu_backend_is_refused() {
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--kv", "offload"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--kv offload needs the CUDA backend"),
        "{err}"
    );
}

#[test]
fn prefill_attention_flag_takes_two_kernels_and_needs_cuda_for_tensor_cores() {
    // generate and perplexity (the mode flags) and bench list both values.
    for cmd in ["generate", "perplexity", "bench"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sparda"))
            .args([cmd, "--help"])
            .output()
            .expect("runs the binary");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("--prefill-attention") && help.contains("tensor-core"),
            "{cmd}: {help}"
        );
    }
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--prefill-attention", "tensor-core"]);
    let (ok, err, took) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--prefill-attention tensor-core needs the CUDA backend"),
        "{err}"
    );
    assert!(took < FAST, "took {took:?}");
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--prefill-attention", "tiled"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("rowwise") && err.contains("tensor-core"),
        "{err}"
    );
    // rowwise is accepted on the CPU backend (and so is no flag: the default
    // is the engine's, tensor-core only on CUDA): only the check of the flag
    // runs here, the run itself is another test's business.
    let mut a = NOSA_8B.to_vec();
    a.extend([
        "--backend",
        "cpu",
        "--prefill-attention",
        "rowwise",
        "--kv",
        "offload",
    ]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--kv offload needs the CUDA backend"),
        "{err}"
    );
}

#[test]
fn output_paths_in_missing_directories_fail_before_the_run() {
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--json", "/nonexistent-dir-sparda/out.json"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("directory /nonexistent-dir-sparda does not exist"),
        "{err}"
    );
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--trace", "/nonexistent-dir-sparda/t.json"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--trace /nonexistent-dir-sparda/t.json: cannot write there"),
        "{err}"
    );
}

#[test]
fn gpu_commands_without_cuda_name_what_they_need() {
    if sparda::cuda::is_available() {
        return; // this machine has a GPU: nothing to check here
    }
    let (ok, err) = sparda(&[
        "offload-check",
        "--model",
        "synth:tiny",
        "--prompt-file",
        "data/texts/hamlet.txt",
        "--json",
        "/tmp/sparda-cli-offload.json",
    ]);
    assert!(
        !ok && err.contains("the CUDA backend") && err.contains("offload-check"),
        "{err}"
    );
    let (ok, err) = sparda(&[
        "bench",
        "--model",
        "synth:tiny",
        "--json",
        "/tmp/sparda-cli-bench.json",
    ]);
    assert!(!ok && err.contains("needs an NVIDIA GPU"), "{err}");
}

#[test]
fn offloaded_kv_on_the_cpu_backend_fails_before_the_model_is_built() {
    let mut a = NOSA_8B.to_vec();
    a.extend(["--kv", "offload", "--backend", "cpu"]);
    let (ok, err, took) = sparda_within(&a, FAST);
    assert!(!ok, "{err}");
    assert!(
        err.contains("--kv offload needs the CUDA backend (--backend cuda)"),
        "{err}"
    );
    assert!(!err.contains("building synth:nosa-8b"), "{err}");
    assert!(took < FAST, "took {took:?}");
}

#[test]
fn bad_fetch_values_are_refused_with_the_value_and_the_ranges() {
    for (v, why) in [
        ("split:0:50", "CTA count `0` is not 1 … 1024"),
        ("split:8:100", "copy-engine share `100` is not 1 … 99"),
        ("split:8:0", "copy-engine share `0` is not 1 … 99"),
        ("warp", "split:N:P"),
    ] {
        let mut a = TINY.to_vec();
        a.extend(["cuda", "--kv", "offload", "--fetch", v]);
        let (ok, err) = sparda(&a);
        assert!(
            !ok && err.contains(&format!("`{v}`")) && err.contains(why),
            "{v}: {err}"
        );
    }
    // a valid split is one engine; two are refused naming both
    let mut a = NOSA_8B.to_vec();
    a.extend(["--kv", "offload", "--fetch", "split:8:50,sm:4"]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("give one --fetch engine (got --fetch split:8:50,sm:4)"),
        "{err}"
    );
}

#[test]
fn more_than_one_fetch_engine_for_generate_fails_before_the_model_is_built() {
    let mut a = NOSA_8B.to_vec();
    a.extend(["--kv", "offload", "--backend", "cpu", "--fetch", "sm,dma"]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("generate: give one --fetch engine (got --fetch sm,dma)"),
        "{err}"
    );
    let mut a = NOSA_8B.to_vec();
    a.extend(["--kv", "offload", "--fetch", "sm", "--fetch", "dma"]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("generate: give one --fetch engine (got --fetch sm,dma)"),
        "{err}"
    );
    // with --backend cuda on a machine without CUDA, the flag error still comes first
    let mut a = NOSA_8B.to_vec();
    a.extend(["--kv", "offload", "--backend", "cuda", "--fetch", "sm,dma"]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("generate: give one --fetch engine (got --fetch sm,dma)"),
        "{err}"
    );
    // a list of cache-slot counts is for bench and offload-check
    let mut a = NOSA_8B.to_vec();
    a.extend([
        "--kv",
        "offload",
        "--backend",
        "cpu",
        "--cache-slots",
        "0,32",
    ]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("generate: give one --cache-slots value (got --cache-slots 0,32)"),
        "{err}"
    );
}

#[test]
fn missing_tokenizer_prompt_file_and_forecast_fail_before_the_model_is_built() {
    let mut a = NOSA_8B.to_vec();
    a.extend([
        "--backend",
        "cpu",
        "--tokenizer",
        "/nonexistent-dir-sparda/tokenizer.json",
    ]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--tokenizer /nonexistent-dir-sparda/tokenizer.json"),
        "{err}"
    );
    assert!(!err.contains("building synth:nosa-8b"), "{err}");
    let (ok, err, _) = sparda_within(
        &[
            "generate",
            "--model",
            "synth:nosa-8b",
            "--backend",
            "cpu",
            "--prompt-file",
            "/nonexistent-dir-sparda/prompt.txt",
        ],
        FAST,
    );
    assert!(
        !ok && err.contains("--prompt-file /nonexistent-dir-sparda/prompt.txt"),
        "{err}"
    );
    let mut a = NOSA_8B.to_vec();
    a.extend([
        "--backend",
        "cpu",
        "--forecast",
        "/nonexistent-dir-sparda/forecast.safetensors",
    ]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--forecast /nonexistent-dir-sparda/forecast.safetensors"),
        "{err}"
    );
    let mut a = NOSA_8B.to_vec();
    a.extend([
        "--backend",
        "cpu",
        "--forecast",
        "synth",
        "--attention",
        "dense",
    ]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--forecast synth") && err.contains("--attention dense"),
        "{err}"
    );
}

#[test]
fn negative_sampling_values_get_range_errors_naming_the_flag() {
    let mut a = NOSA_8B.to_vec();
    a.extend(["--backend", "cpu", "--top-p", "-0.1"]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--top-p must lie in (0, 1], got -0.1"),
        "{err}"
    );
    assert!(!err.contains("unexpected argument"), "{err}");
    let mut a = NOSA_8B.to_vec();
    a.extend(["--backend", "cpu", "--temperature", "-1"]);
    let (ok, err, _) = sparda_within(&a, FAST);
    assert!(
        !ok && err.contains("--temperature must be a finite value ≥ 0, got -1"),
        "{err}"
    );
    // Unsigned flags: clap's invalid-value error names the flag and value.
    for flag in ["--top-k", "--seed", "--max-new-tokens", "--prompt-tokens"] {
        let mut a = NOSA_8B.to_vec();
        a.extend(["--backend", "cpu", flag, "-1"]);
        let (ok, err, _) = sparda_within(&a, FAST);
        assert!(
            !ok && err.contains("invalid value '-1'") && err.contains(flag),
            "{flag}: {err}"
        );
        assert!(!err.contains("unexpected argument"), "{flag}: {err}");
    }
}

#[test]
fn generate_help_describes_fetch_as_one_engine() {
    for cmd in ["generate", "perplexity"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sparda"))
            .args([cmd, "--help"])
            .output()
            .expect("runs the binary");
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(!help.contains("each run in turn"), "{cmd}: {help}");
        assert!(help.contains("give one engine"), "{cmd}: {help}");
    }
    // bench and offload-check still run each engine in turn.
    for cmd in ["bench", "offload-check"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sparda"))
            .args([cmd, "--help"])
            .output()
            .expect("runs the binary");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("Fetch engines of offloaded KV, each run in turn"),
            "{cmd}: {help}"
        );
    }
}

#[test]
fn generate_logprobs_go_to_the_json_report() {
    let tok = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.fixtures/smollm2-135m-instruct/tokenizer.json"
    );
    let dir = std::env::temp_dir().join(format!("sparda-logprobs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("gen.json");
    let base = [
        "generate",
        "--model",
        "synth:tiny",
        "--backend",
        "cpu",
        "--tokenizer",
        tok,
        "--prompt",
        "The quality of mercy is not strained",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    ];
    // without --json there is nowhere to put them: a clear error, before the model is built
    let (ok, err) = sparda(&[&base[..], &["--logprobs", "3"]].concat());
    assert!(
        !ok && err.contains("--logprobs") && err.contains("--json"),
        "{err}"
    );
    let (ok, err) = sparda(
        &[
            &base[..],
            &["--logprobs", "3", "--json", json.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let tokens = v["tokens"].as_array().unwrap();
    let lps = v["logprobs"].as_array().unwrap();
    assert_eq!(tokens.len(), 6);
    assert_eq!(lps.len(), tokens.len());
    for (t, lp) in tokens.iter().zip(lps) {
        assert_eq!(&lp["token"], t);
        let l = lp["logprob"].as_f64().unwrap();
        assert!(l <= 0.0 && l.is_finite());
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // greedy (the default): the chosen token is the most likely one, with the same logprob
        assert_eq!(&top[0]["token"], t);
        assert!((top[0]["logprob"].as_f64().unwrap() - l).abs() < 1e-9);
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        assert!(lp["text"].is_string());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The SmolLM2 fixture's tokenizer (scripts/fixture.sh builds it).
fn fixture_tokenizer() -> String {
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".fixtures/smollm2-135m-instruct/tokenizer.json");
    assert!(
        tok.exists(),
        "run scripts/fixture.sh first: {} is missing",
        tok.display()
    );
    tok.display().to_string()
}

/// `sparda perplexity` on the tiny preset over the bundled book, with the
/// fixture tokenizer: 2 chunks of 128 tokens, the last 64 of each scored.
fn tiny_perplexity(model: &str, text: &str, extra: &[&str]) -> (bool, String) {
    let tok = fixture_tokenizer();
    let mut a = vec![
        "perplexity",
        "--model",
        model,
        "--backend",
        "cpu",
        "--tokenizer",
        &tok,
        "--text",
        text,
        "--context",
        "128",
        "--max-chunks",
        "2",
    ];
    a.extend(extra);
    sparda(&a)
}

fn read_json(p: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).expect("report written")).expect("JSON")
}

#[test]
fn perplexity_on_hamlet_writes_a_consistent_report_and_compares_with_its_base() {
    let dir = common::TmpDir::new("cli-perplexity");
    let (base, json) = (dir.path().join("base.bin"), dir.path().join("base.json"));
    let hamlet = "data/texts/hamlet.txt";
    let (ok, err) = tiny_perplexity(
        "synth:tiny",
        hamlet,
        &[
            "--save-logits",
            base.to_str().unwrap(),
            "--top-k-save",
            "16",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(ok, "{err}");
    let v = read_json(&json);
    let f = |k: &str| {
        v[k].as_f64()
            .filter(|x| x.is_finite())
            .unwrap_or_else(|| panic!("{k} is not a finite number: {v}"))
    };
    assert_eq!(v["command"], "perplexity");
    assert_eq!(f("tokens_scored"), 128.0);
    assert_eq!(
        v["chunking"],
        serde_json::json!({"context": 128, "score": 64, "chunks": 2})
    );
    assert_eq!(f("prefill_tokens_per_chunk"), 64.0);
    let (nll, ppl, se) = (f("mean_nll"), f("ppl"), f("nll_se"));
    assert!(nll > 0.0 && se > 0.0, "{v}");
    assert!(
        (ppl - nll.exp()).abs() <= 1e-9 * ppl,
        "ppl {ppl} vs exp(mean NLL) {}",
        nll.exp()
    );
    let ci: Vec<f64> = v["ppl_ci95"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert!(
        (ci[0] - (nll - 1.96 * se).exp()).abs() <= 1e-9 * ci[0],
        "{v}"
    );
    assert!(
        (ci[1] - (nll + 1.96 * se).exp()).abs() <= 1e-9 * ci[1],
        "{v}"
    );
    assert!(ci[0] < ppl && ppl < ci[1], "{v}");
    let t = &v["timing"];
    for k in [
        "prefill_s",
        "score_s",
        "prefill_tokens_per_s",
        "score_tokens_per_s",
    ] {
        assert!(
            t[k].as_f64().is_some_and(|x| x.is_finite() && x > 0.0),
            "{k}: {t}"
        );
    }
    assert_eq!(
        (t["scored_tokens"].as_u64(), t["prefill_tokens"].as_u64()),
        (Some(128), Some(128))
    );
    assert_eq!(v["model"]["name"], "synth:tiny");
    assert_eq!(v["model"]["vocab"], 49_152);
    assert_eq!(v["model"]["fingerprint"].as_str().map(str::len), Some(16));
    assert_eq!(v["text"]["path"], hamlet);
    assert!(v["text"]["tokens"].as_u64().unwrap() > 256);
    assert!(v["tokenizer"].as_str().unwrap().ends_with("tokenizer.json"));
    assert_eq!(v["mode"]["backend"], "cpu");
    assert_eq!(v["mode"]["mode"], "Nosa");
    assert!(v["gpu"].is_null());
    assert!(v["date_utc"].as_str().unwrap().ends_with('Z'));
    assert!(v.get("commit").is_some());
    assert_eq!(v["save_logits"]["top_k"], 16);
    assert!(v["kl"].is_null());

    // the same mode against its own base: KL 0, full agreement
    let json2 = dir.path().join("same.json");
    let (ok, err) = tiny_perplexity(
        "synth:tiny",
        hamlet,
        &[
            "--kl-base",
            base.to_str().unwrap(),
            "--json",
            json2.to_str().unwrap(),
        ],
    );
    assert!(ok, "{err}");
    let w = read_json(&json2);
    let kl = &w["kl"];
    assert_eq!(
        (kl["kl_mean"].as_f64(), kl["kl_max"].as_f64()),
        (Some(0.0), Some(0.0)),
        "{kl}"
    );
    assert_eq!(kl["top1_agreement_pct"].as_f64(), Some(100.0), "{kl}");
    assert_eq!(kl["positions"], 128);
    assert_eq!(kl["top_k"], 16);
    assert_eq!(kl["lower_bound"], true);
    assert_eq!(kl["delta_ppl"].as_f64(), Some(0.0), "{kl}");
    assert!((w["ppl"].as_f64().unwrap() / ppl - 1.0).abs() < 1e-12);

    // another model (seed), another text: refused, naming the field
    let (ok, err) = tiny_perplexity(
        "synth:tiny:1",
        hamlet,
        &["--kl-base", base.to_str().unwrap()],
    );
    assert!(
        !ok && err.contains("`model.fingerprint`") && err.contains("synth:tiny:1"),
        "{err}"
    );
    let other = dir.path().join("other.txt");
    let book = std::fs::read_to_string(hamlet).unwrap();
    std::fs::write(&other, &book[book.len() / 2..]).unwrap();
    let (ok, err) = tiny_perplexity(
        "synth:tiny",
        other.to_str().unwrap(),
        &["--kl-base", base.to_str().unwrap()],
    );
    assert!(!ok && err.contains("`text.hash`"), "{err}");
    let (ok, err) = tiny_perplexity(
        "synth:tiny",
        hamlet,
        &["--kl-base", base.to_str().unwrap(), "--score", "32"],
    );
    assert!(
        !ok && err.contains("`chunking.score`") && err.contains("64"),
        "{err}"
    );
}

#[test]
fn perplexity_flag_errors_fail_before_the_model_is_built() {
    let dir = common::TmpDir::new("cli-perplexity-flags");
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "To be, or not to be.").unwrap();
    let junk = dir.path().join("junk.bin");
    std::fs::write(&junk, "not logits").unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["perplexity", "--model", "synth:nosa-8b", "--backend", "cpu"];
        if !extra.contains(&"--text") {
            a.extend(["--text", "data/texts/hamlet.txt"]);
        }
        a.extend(extra);
        let (ok, err, took) = sparda_within(&a, FAST);
        assert!(!ok, "{err}");
        assert!(!err.contains("building synth:nosa-8b"), "{err}");
        assert!(took < FAST, "took {took:?}");
        err
    };
    let e = run(&["--context", "1"]);
    assert!(e.contains("--context 1"), "{e}");
    let e = run(&["--context", "256", "--score", "300"]);
    assert!(e.contains("--score 300") && e.contains("1 … 255"), "{e}");
    let e = run(&["--context", "64", "--text", short.to_str().unwrap()]);
    assert!(e.contains("shorter than one chunk of --context 64"), "{e}");
    let e = run(&["--context", "999999"]);
    assert!(
        e.contains("--context 999999") && e.contains("max_position_embeddings"),
        "{e}"
    );
    let e = run(&["--top-k-save", "0"]);
    assert!(e.contains("--top-k-save must be ≥ 1"), "{e}");
    let e = run(&["--kl-base", "/nonexistent-dir-sparda/base.bin"]);
    assert!(e.contains("/nonexistent-dir-sparda/base.bin"), "{e}");
    let e = run(&["--kl-base", junk.to_str().unwrap()]);
    assert!(e.contains("saved-logits file"), "{e}");
    let e = run(&["--kv", "offload"]);
    assert!(e.contains("--kv offload needs the CUDA backend"), "{e}");
    let e = run(&["--save-logits", "/nonexistent-dir-sparda/base.bin"]);
    assert!(
        e.contains("directory /nonexistent-dir-sparda does not exist"),
        "{e}"
    );
    let e = run(&["--text", "/nonexistent-dir-sparda/book.txt"]);
    assert!(e.contains("--text /nonexistent-dir-sparda/book.txt"), "{e}");
}

/// Runs the binary and returns (success, stdout, stderr).
fn sparda_out(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(args)
        .output()
        .expect("runs the binary");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_stop_token_ends_the_text_without_being_printed() {
    let tok = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.fixtures/smollm2-135m-instruct/tokenizer.json"
    );
    let dir = std::env::temp_dir().join(format!("sparda-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (j1, j2) = (dir.join("free.json"), dir.join("stopped.json"));
    let base = [
        "generate",
        "--model",
        "synth:tiny",
        "--backend",
        "cpu",
        "--tokenizer",
        tok,
        "--prompt",
        "Now is the winter of our discontent",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    ];
    let (ok, _, err) = sparda_out(&[&base[..], &["--json", j1.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    let free: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&j1).unwrap()).unwrap();
    let ids: Vec<u64> = free["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 6);
    // stop at the third greedy token: it ends the run and is neither printed nor in "text"
    let stop = ids[2].to_string();
    let first = ids.iter().position(|&t| t == ids[2]).unwrap();
    let (ok, stdout, err) = sparda_out(
        &[
            &base[..],
            &["--stop-id", &stop, "--json", j2.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    let stopped: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&j2).unwrap()).unwrap();
    let got: Vec<u64> = stopped["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(
        got,
        ids[..=first].to_vec(),
        "the stop id ends generation and stays in the ids"
    );
    assert_eq!(stopped["stop"], "Eos");
    let text = stopped["text"].as_str().unwrap();
    // stdout is the streamed text plus a final newline
    assert_eq!(stdout, format!("{text}\n"));
    // the free run's text starts with it and goes on (the stop token's text is not in it)
    let free_text = free["text"].as_str().unwrap();
    assert!(free_text.starts_with(text) && free_text.len() > text.len());
    assert_eq!(stopped["sampling"]["temperature"], 0.0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn outputs_that_would_clobber_or_cannot_be_written_are_refused_before_the_run() {
    let dir = std::env::temp_dir().join(format!("sparda-outdir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    // --json naming a directory: refused at once, nothing left beside it
    let (ok, err) = sparda(&[
        "generate",
        "--model",
        "synth:tiny",
        "--backend",
        "cpu",
        "--prompt",
        "x",
        "--json",
        d,
    ]);
    assert!(!ok && err.contains("is a directory"), "{err}");
    // synth into a non-empty directory: refused unless --force
    std::fs::write(dir.join("keep.txt"), "mine").unwrap();
    let (ok, err) = sparda(&["synth", "--preset", "tiny", "--out", d]);
    assert!(
        !ok && err.contains("not empty") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "nothing written"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn prompt_file_dash_reads_standard_input() {
    use std::io::Write;
    let tok = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.fixtures/smollm2-135m-instruct/tokenizer.json"
    );
    let dir = std::env::temp_dir().join(format!("sparda-stdin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompt = "To be, or not to be, that is the question";
    let args = |json: &std::path::Path| {
        vec![
            "generate".to_string(),
            "--model".into(),
            "synth:tiny".into(),
            "--backend".into(),
            "cpu".into(),
            "--tokenizer".into(),
            tok.into(),
            "--max-new-tokens".into(),
            "3".into(),
            "--ignore-eos".into(),
            "--json".into(),
            json.to_str().unwrap().into(),
        ]
    };
    let (j1, j2) = (dir.join("arg.json"), dir.join("stdin.json"));
    let mut a1 = args(&j1);
    a1.extend(["--prompt".into(), prompt.into()]);
    let (ok, _, err) = sparda_out(&a1.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{err}");
    let mut a2 = args(&j2);
    a2.extend(["--prompt-file".into(), "-".into()]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(&a2)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(prompt.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (v1, v2) = (read(&j1), read(&j2));
    assert_eq!(v1["prompt_tokens"], v2["prompt_tokens"]);
    assert_eq!(v1["tokens"], v2["tokens"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// A directory holding the tiny preset's config.json (with `edit` applied).
fn tiny_config_dir(tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> common::TmpDir {
    let dir = common::TmpDir::new(tag);
    let mut v = sparda::synth::Preset::Tiny.config().to_json_value();
    edit(&mut v);
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    dir
}

#[test]
fn model_that_is_a_file_says_so() {
    let dir = tiny_config_dir("cli-model-file", |_| {});
    let file = dir.path().join("config.json");
    let f = file.to_str().unwrap();
    for cmd in ["generate", "perplexity"] {
        let mut a = vec![cmd, "--model", f, "--backend", "cpu"];
        a.extend(if cmd == "generate" {
            ["--prompt", "hi"]
        } else {
            ["--text", f]
        });
        let (ok, err) = sparda(&a);
        assert!(!ok, "{err}");
        assert!(
            err.contains(&format!(
                "--model {f} is a file; give the checkpoint directory holding config.json, *.safetensors and tokenizer.json"
            )),
            "{err}"
        );
        assert!(
            !err.contains("panicked") && !err.contains("tokenizer.json/"),
            "{err}"
        );
    }
}

/// A missing path and a directory without config.json are named as
/// --model, with what to give instead (not a bare OS error).
#[test]
fn model_that_is_missing_or_not_a_checkpoint_says_so() {
    for cmd in ["generate", "perplexity"] {
        for (model, want) in [
            (
                "data/no_such_model_dir",
                "--model data/no_such_model_dir: no such directory",
            ),
            ("data/texts", "--model data/texts holds no config.json"),
        ] {
            let mut a = vec![cmd, "--model", model, "--backend", "cpu"];
            a.extend(if cmd == "generate" {
                ["--prompt", "hi"]
            } else {
                ["--text", "data/texts/hamlet.txt"]
            });
            let (ok, err) = sparda(&a);
            assert!(!ok && err.contains(want), "{cmd} {model}: {err}");
        }
    }
}

/// --prompt-tokens past the prompt's length says so and uses the prompt.
#[test]
fn prompt_tokens_past_the_prompt_is_noted() {
    let (ok, err) = sparda(&[
        "generate",
        "--model",
        "synth:tiny",
        "--prompt",
        "Hello there",
        "--prompt-tokens",
        "5000",
        "--max-new-tokens",
        "2",
        "--backend",
        "cpu",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("note: --prompt-tokens 5000, but the prompt has"),
        "{err}"
    );
}

#[test]
fn tokenizer_json_of_another_schema_is_named() {
    let dir = tiny_config_dir("cli-bad-tokenizer", |_| {});
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, r#"{"vocab": {}}"#).unwrap();
    let d = dir.path().to_str().unwrap();
    let run = || {
        sparda(&[
            "generate",
            "--model",
            d,
            "--backend",
            "cpu",
            "--prompt",
            "hi",
        ])
    };
    let (ok, err) = run();
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!(
            "{}: tokenizer: not a Hugging Face tokenizer.json: it has no `model` object (top-level keys: vocab)",
            tok.display()
        )),
        "{err}"
    );
    // Not JSON at all.
    std::fs::write(&tok, "vocab = {}").unwrap();
    let (ok, err) = run();
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!("{}: tokenizer: not valid JSON: ", tok.display())),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Weights of another model size: every tensor is mis-shaped, and the error
/// shows the first 10 lines and a count of the rest.
#[test]
fn checkpoint_of_another_size_lists_ten_mismatches_and_a_count() {
    use sparda::weights::{expected_tensors, write_safetensors};
    let dir = tiny_config_dir("cli-other-size", |v| v["hidden_size"] = 256.into());
    let tiny = sparda::synth::build(sparda::synth::Preset::Tiny, 1).unwrap();
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &tiny.store.to_owned_tensors(),
    )
    .unwrap();
    let cfg = sparda::config::ModelConfig::from_file(dir.path()).unwrap();
    let n_expected = expected_tensors(&cfg, tiny.eviction_heads).len();
    let d = dir.path().to_str().unwrap();
    let tok = fixture_tokenizer();
    let (ok, err) = sparda(&[
        "generate",
        "--model",
        d,
        "--backend",
        "cpu",
        "--tokenizer",
        &tok,
        "--prompt",
        "hi",
    ]);
    assert!(!ok, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains(
            "mis-shaped: model.embed_tokens.weight: expected [49152, 256], found [49152, 192]"
        ),
        "{err}"
    );
    let listed = err
        .lines()
        .filter(|l| l.starts_with("mis-shaped: ") || l.starts_with("missing: "))
        .count();
    assert_eq!(listed, 10, "{err}");
    // Every tensor touching the hidden size is mis-shaped: all but the
    // eviction heads (A [Hkv], delta [Hkv, Hkv·D]).
    let evict = if tiny.eviction_heads { 2 * 2 } else { 0 };
    let problems = n_expected - evict;
    assert!(
        err.contains(&format!("({problems} problem lines)")),
        "{err}"
    );
    assert!(
        err.contains(&format!("\n… and {} more", problems - 10)),
        "{err}"
    );
}

/// What tells an interrupt test that the run got going.
/// Bytes of generated text [`Ready::Stdout`] waits for: several tokens.
const STDOUT_READY_BYTES: usize = 64;

enum Ready {
    /// [`STDOUT_READY_BYTES`] bytes of generated text on stdout. The first
    /// token comes from the prefill's logits, so its bytes alone do not mean
    /// a decode step has finished (a Ctrl-C then can land before the first
    /// one); several tokens' worth do.
    Stdout,
    /// A line of stderr containing this text, then the delay.
    Stderr(&'static str, Duration),
}

/// Starts `sparda args`, waits until `ready`, sends it `signals` SIGINTs
/// (with `kill -INT`, 50 ms apart) and waits for it to end (at most 120 s).
/// Returns the exit code and stderr.
fn interrupted_run(args: &[&str], ready: Ready, signals: usize) -> (Option<i32>, String) {
    use std::io::BufRead;
    use std::sync::mpsc;
    let mut child = Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs the binary");
    let (tx, rx) = mpsc::channel::<()>();
    let mut stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let want = match ready {
        Ready::Stderr(s, _) => Some(s),
        Ready::Stdout => None,
    };
    let tx2 = tx.clone();
    let out_reader = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        let mut told = false;
        let mut seen = 0usize;
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen += n;
            if want.is_none() && !told && seen >= STDOUT_READY_BYTES {
                tx2.send(()).ok();
                told = true;
            }
        }
    });
    let err_reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(|l| l.ok())
        {
            if want.is_some_and(|w| line.contains(w)) {
                tx.send(()).ok();
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    if rx.recv_timeout(Duration::from_secs(120)).is_err() {
        child.kill().ok();
        child.wait().ok();
        panic!(
            "sparda {}: never got going; stderr: {}",
            args.join(" "),
            err_reader.join().unwrap_or_default()
        );
    }
    if let Ready::Stderr(_, d) = ready {
        std::thread::sleep(d);
    }
    for i in 0..signals {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        let ok = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .expect("runs kill");
        assert!(ok.success(), "kill -INT failed");
    }
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("waits on the binary") {
            break st;
        }
        if start.elapsed() > Duration::from_secs(120) {
            child.kill().ok();
            child.wait().ok();
            panic!("sparda {} did not stop after SIGINT", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    out_reader.join().ok();
    (status.code(), err_reader.join().expect("stderr reader"))
}

/// Files in `dir` whose names end with `suffix`.
fn files_ending(dir: &std::path::Path, suffix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(suffix))
        .collect()
}

/// Ctrl-C during `generate`: exit code 130, the trace finished (it parses and
/// holds the decode steps that ran), no temporary file left, and no --json
/// report (an interrupted run writes none; stderr says so).
#[test]
fn ctrl_c_during_generate_finishes_the_trace_and_writes_no_report() {
    let dir = common::TmpDir::new("ctrlc-generate");
    let trace = dir.path().join("run.json");
    let json = dir.path().join("out.json");
    let (t, j) = (trace.display().to_string(), json.display().to_string());
    let (code, err) = interrupted_run(
        &[
            "generate",
            "--model",
            "synth:tiny",
            "--backend",
            "cpu",
            "--prompt",
            "Once upon a time",
            "--max-new-tokens",
            "30000",
            "--ignore-eos",
            "--trace",
            &t,
            "--json",
            &j,
        ],
        Ready::Stdout,
        1,
    );
    assert_eq!(code, Some(130), "stderr: {err}");
    assert!(err.contains("stop: Interrupted"), "{err}");
    assert!(err.contains("interrupted (Ctrl-C) at decode step"), "{err}");
    assert!(err.contains(&format!("{j} not written")), "{err}");
    assert!(err.contains("trace written to"), "{err}");
    assert!(!json.exists(), "an interrupted run wrote {j}");
    assert_eq!(files_ending(dir.path(), ".tmp"), Vec::<String>::new());
    let s = sparda::trace::summarize_file(&trace).expect("the trace parses");
    assert!(s.steps >= 1, "no decode step in the trace: {s:?}");
    assert!(
        s.steps < 30_000,
        "the run was not stopped early: {} steps",
        s.steps
    );
}

/// Ctrl-C during `perplexity`: exit code 130, neither the --json report nor
/// the --save-logits file (nor its `.partial`) left behind, and stderr says
/// how far the scoring got.
#[test]
fn ctrl_c_during_perplexity_leaves_no_partial_files() {
    let dir = common::TmpDir::new("ctrlc-perplexity");
    let json = dir.path().join("ppl.json");
    let logits = dir.path().join("base.logits");
    let (j, l) = (json.display().to_string(), logits.display().to_string());
    let tok = fixture_tokenizer();
    let text = format!("{}/data/texts/hamlet.txt", env!("CARGO_MANIFEST_DIR"));
    let (code, err) = interrupted_run(
        &[
            "perplexity",
            "--model",
            "synth:tiny",
            "--backend",
            "cpu",
            "--tokenizer",
            &tok,
            "--text",
            &text,
            "--context",
            "1024",
            "--json",
            &j,
            "--save-logits",
            &l,
        ],
        Ready::Stderr("prefilled and", Duration::from_millis(700)),
        1,
    );
    assert_eq!(code, Some(130), "stderr: {err}");
    assert!(err.contains("interrupted after"), "{err}");
    assert!(err.contains(&format!("{j} and {l} not written")), "{err}");
    assert!(!json.exists() && !logits.exists());
    assert_eq!(files_ending(dir.path(), ".partial"), Vec::<String>::new());
    assert_eq!(files_ending(dir.path(), ".tmp"), Vec::<String>::new());
}

/// A second Ctrl-C ends the run at once, with the same exit code.
#[test]
fn a_second_ctrl_c_exits_at_once_with_130() {
    let (code, err) = interrupted_run(
        &[
            "generate",
            "--model",
            "synth:tiny",
            "--backend",
            "cpu",
            "--prompt",
            "Once upon a time",
            "--max-new-tokens",
            "30000",
            "--ignore-eos",
        ],
        Ready::Stdout,
        2,
    );
    assert_eq!(code, Some(130), "stderr: {err}");
}
