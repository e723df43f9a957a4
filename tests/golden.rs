//! The SmolLM2-135M fixture against transformers (spec/testing.md
//! "Oracles"). Goldens in tests/golden/*.json come from
//! scripts/golden.py: transformers loads the GGUF itself, so they also check
//! our converter (scripts/fixture.py) and tokenizer.json.
//!
//! Needs the fixture: `scripts/fixture.sh` (scripts/test.sh runs it).

use serde::Deserialize;
use sparda::cpu::{CpuModel, EngineOptions};
use sparda::tokenizer::Tokenizer;
use sparda::weights::Checkpoint;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Step {
    argmax: u32,
    margin: f32,
    l2: f64,
    logsumexp: f64,
    top_ids: Vec<u32>,
    top_logits: Vec<f32>,
}

#[derive(Deserialize)]
struct Golden {
    name: String,
    prompt_text: String,
    prompt_ids: Vec<u32>,
    generated: Vec<u32>,
    steps: Vec<Step>,
}

/// Top-1/top-2 margin below which free-run token equality is not asked (spec/testing.md).
const NEAR_TIE: f32 = 1e-2;

fn fixture_dir() -> PathBuf {
    let dir = std::env::var_os("SPARDA_FIXTURE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".fixtures/smollm2-135m-instruct")
        });
    assert!(
        dir.join("model.safetensors").exists(),
        "SmolLM2 fixture missing at {}: run scripts/fixture.sh (scripts/test.sh does)",
        dir.display()
    );
    dir
}

fn goldens() -> Vec<Golden> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/golden")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 4,
        "expected ≥ 4 golden files in {}",
        dir.display()
    );
    files
        .iter()
        .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

/// Relative L2 error of our logits at the golden's top-64 ids, and our
/// full-vector L2 norm and logsumexp against the golden's.
fn compare(ours: &[f32], step: &Step) -> (f64, f64, f64) {
    let num: f64 = step
        .top_ids
        .iter()
        .zip(&step.top_logits)
        .map(|(&i, &g)| (ours[i as usize] as f64 - g as f64).powi(2))
        .sum();
    let den: f64 = step.top_logits.iter().map(|&g| (g as f64).powi(2)).sum();
    let l2 = ours.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let mx = ours.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let lse = mx
        + ours
            .iter()
            .map(|&x| (x as f64 - mx).exp())
            .sum::<f64>()
            .ln();
    (
        (num / den).sqrt(),
        (l2 - step.l2).abs() / step.l2,
        (lse - step.logsumexp).abs(),
    )
}

/// Under teacher forcing (the golden's greedy tokens fed to our model), our
/// logits match transformers' at every one of the 33 steps (relative L2 ≤
/// 1e-3) and our argmax equals its greedy token at each of the 32 steps
/// (the same as our free-run greedy continuation being equal), except at
/// near-ties (margin ≤ 1e-2), where it must be one of the top two.
#[test]
fn smollm2_matches_transformers_under_teacher_forcing() {
    let dir = fixture_dir();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let model = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    let gs = goldens();
    assert!(
        gs.iter().any(|g| g.prompt_ids.len() >= 2000),
        "one golden prompt must have ≥ 2,000 tokens"
    );
    for g in &gs {
        assert_eq!(
            tok.encode(&g.prompt_text).unwrap(),
            g.prompt_ids,
            "{}: tokenizer differs from transformers'",
            g.name
        );
        assert_eq!(g.steps.len(), g.generated.len() + 1);
        let mut seq = model.new_sequence();
        let mut logits = model.prefill(&mut seq, &g.prompt_ids, |_, _| {}).unwrap();
        let mut worst = (0.0f64, 0.0f64, 0.0f64);
        for (k, step) in g.steps.iter().enumerate() {
            let (rel, l2, lse) = compare(&logits, step);
            assert!(
                rel <= 1e-3,
                "{} step {k}: top-64 logits rel L2 {rel:e} > 1e-3",
                g.name
            );
            assert!(
                l2 <= 1e-3,
                "{} step {k}: logits L2 norm off by {l2:e} (relative)",
                g.name
            );
            assert!(lse <= 1e-2, "{} step {k}: logsumexp off by {lse:e}", g.name);
            worst = (worst.0.max(rel), worst.1.max(l2), worst.2.max(lse));
            let ours = sparda::sample::argmax(&logits);
            if k < g.generated.len() {
                if step.margin > NEAR_TIE {
                    assert_eq!(
                        ours, g.generated[k],
                        "{} step {k}: greedy token (golden margin {})",
                        g.name, step.margin
                    );
                } else {
                    // spec/testing.md: token equality is asked only where the
                    // reference's top-1/top-2 margin exceeds 1e-2.
                    assert!(
                        step.top_ids[..2].contains(&ours),
                        "{} step {k}: near-tie token {ours}",
                        g.name
                    );
                }
                assert_eq!(step.argmax, g.generated[k]);
                logits = model.decode(&mut seq, g.generated[k]).unwrap();
            }
        }
        eprintln!(
            "{}: {} prompt tokens, worst rel L2 {:.2e}, norm {:.2e}, logsumexp {:.2e}",
            g.name,
            g.prompt_ids.len(),
            worst.0,
            worst.1,
            worst.2
        );
    }
}

/// `sparda generate` itself (the CLI a user runs) on the ≥ 2,000-token book
/// prompt prints transformers' greedy continuation.
#[test]
fn cli_generate_on_book_prompt_equals_transformers_greedy() {
    let dir = fixture_dir();
    let g = goldens()
        .into_iter()
        .max_by_key(|g| g.prompt_ids.len())
        .unwrap();
    assert!(g
        .steps
        .iter()
        .take(g.generated.len())
        .all(|s| s.margin > NEAR_TIE));
    let prompt =
        std::env::temp_dir().join(format!("sparda-golden-prompt-{}.txt", std::process::id()));
    let json = prompt.with_extension("json");
    std::fs::write(&prompt, &g.prompt_text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args([
            "generate",
            "--backend",
            "cpu",
            "--ignore-eos",
            "--max-new-tokens",
        ])
        .arg(g.generated.len().to_string())
        .arg("--model")
        .arg(&dir)
        .arg("--prompt-file")
        .arg(&prompt)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sparda generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let prompt_ids: Vec<u32> = serde_json::from_value(v["prompt_tokens"].clone()).unwrap();
    let tokens: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(prompt_ids, g.prompt_ids);
    assert_eq!(tokens, g.generated);
    let _ = std::fs::remove_file(&prompt);
    let _ = std::fs::remove_file(&json);
}
