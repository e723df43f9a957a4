//! The CPU reference's bf16 activation emulation (`CpuModel::set_bf16_emulation`),
//! which rounds where the CUDA engine stores bf16, so GPU-vs-CPU differences
//! can be split into "bf16 arithmetic" and "engine bug".
//!
//! The fixture study (`#[ignore]`, needs `.fixtures/smollm2-135m-instruct`
//! from scripts/fixture.sh or `$SPARDA_FIXTURE`) replays gpu-check-e2e's
//! `fixture-dense` case on the CPU: same prompts (SmallRng seed 17, lengths 9
//! and 60), same teacher-forced tokens (the f32 reference's greedy run, 64
//! steps), and prints the per-step rel L2 of the emulated logits against the
//! f32 ones, plus ablations (one rounding point removed / alone):
//!
//! ```text
//! cargo test --release --test bf16_emulation -- --ignored --nocapture
//! ```

mod common;
use common::rel_l2;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sparda::cpu::{Bf16Points, CpuModel, EngineOptions};
use sparda::model::AttentionOverrides;
use sparda::sample::argmax;
use std::path::PathBuf;

/// The f32 reference's greedy run: logits after prefill and each step, tokens fed.
fn greedy(model: &CpuModel, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut seq = model.new_sequence();
    let mut logits = vec![model.prefill(&mut seq, prompt, |_, _| {}).unwrap()];
    let mut toks = Vec::new();
    for _ in 0..steps {
        let t = argmax(logits.last().unwrap());
        toks.push(t);
        logits.push(model.decode(&mut seq, t).unwrap());
    }
    (logits, toks)
}

/// Logits of `model` teacher-forced on `prompt` then `toks`.
fn forced(model: &CpuModel, prompt: &[u32], toks: &[u32]) -> Vec<Vec<f32>> {
    let mut seq = model.new_sequence();
    let mut logits = vec![model.prefill(&mut seq, prompt, |_, _| {}).unwrap()];
    for &t in toks {
        logits.push(model.decode(&mut seq, t).unwrap());
    }
    logits
}

fn tiny(sparse: Option<bool>) -> (sparda::weights::Checkpoint, EngineOptions) {
    let ckpt = sparda::synth::build(sparda::synth::Preset::Tiny, 7).expect("tiny preset builds");
    let opts = EngineOptions {
        attention: AttentionOverrides {
            sparse,
            ..Default::default()
        },
        ..Default::default()
    };
    (ckpt, opts)
}

/// With every point off, the emulation code path is the f32 reference bit
/// for bit; with every point on it differs, but within the GPU tolerance
/// (2e-2) on the tiny model, dense and NOSA (450 tokens: sparse past the
/// 6-block budget, eviction scores from the bf16 v; measured about 3e-3,
/// as the engine on the H200).
#[test]
fn emulation_is_exact_when_off_and_close_when_on() {
    for sparse in [Some(false), None] {
        let (ckpt, opts) = tiny(sparse);
        let f32m = CpuModel::new(&ckpt, opts).unwrap();
        let v = f32m.config.vocab_size;
        let mut rng = SmallRng::seed_from_u64(5);
        let prompt: Vec<u32> = (0..450).map(|_| rng.random_range(3..v as u32)).collect();
        let (want, toks) = greedy(&f32m, &prompt, 6);
        let mut none = CpuModel::new(&ckpt, opts).unwrap();
        none.set_bf16_emulation(Some(Bf16Points::NONE));
        assert_eq!(
            forced(&none, &prompt, &toks),
            want,
            "sparse {sparse:?}: NONE must be exact"
        );
        let mut all = CpuModel::new(&ckpt, opts).unwrap();
        all.set_bf16_emulation(Some(Bf16Points::ALL));
        assert_eq!(all.bf16_emulation(), Some(Bf16Points::ALL));
        let got = forced(&all, &prompt, &toks);
        let errs: Vec<f64> = got.iter().zip(&want).map(|(g, w)| rel_l2(g, w)).collect();
        let max = errs.iter().copied().fold(0.0, f64::max);
        assert!(errs.iter().all(|&e| e > 0.0), "sparse {sparse:?}: {errs:?}");
        assert!(max <= 2e-2, "sparse {sparse:?}: max rel L2 {max:e}");
    }
}

/// Per-step rel L2 of `pts`-emulated logits against the f32 ones, per prompt.
fn study(
    ckpt: &sparda::weights::Checkpoint,
    pts: Bf16Points,
    prompts: &[Vec<u32>],
    runs: &[(Vec<Vec<f32>>, Vec<u32>)],
) -> Vec<Vec<f64>> {
    let mut m = CpuModel::new(ckpt, EngineOptions::default()).unwrap();
    m.set_bf16_emulation(Some(pts));
    prompts
        .iter()
        .zip(runs)
        .map(|(p, (want, toks))| {
            forced(&m, p, toks)
                .iter()
                .zip(want)
                .map(|(g, w)| rel_l2(g, w))
                .collect()
        })
        .collect()
}

/// (max, mean, (seq, step) of the max) over every sequence and step.
fn summary(errs: &[Vec<f64>]) -> (f64, f64, (usize, usize)) {
    let (mut max, mut at, mut sum, mut n) = (0.0f64, (0, 0), 0.0, 0usize);
    for (b, e) in errs.iter().enumerate() {
        for (s, &x) in e.iter().enumerate() {
            if x > max {
                max = x;
                at = (b, s);
            }
            sum += x;
            n += 1;
        }
    }
    (max, sum / n.max(1) as f64, at)
}

#[test]
#[ignore = "a study (about 4 minutes on 2 cores): prints per-step numbers, run with --ignored"]
fn fixture_bf16_emulation_study() {
    let dir = std::env::var_os("SPARDA_FIXTURE").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".fixtures/smollm2-135m-instruct"),
        PathBuf::from,
    );
    let ckpt = sparda::weights::Checkpoint::open(&dir).expect("fixture opens");
    let steps: usize = std::env::var("SPARDA_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let f32m = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    let v = f32m.config.vocab_size;
    // As src/checks/e2e.rs `fixture-dense`: one SmallRng(17), prompts of 9 then 60 tokens.
    let mut rng = SmallRng::seed_from_u64(17);
    let prompts: Vec<Vec<u32>> = [9usize, 60]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(3..v as u32)).collect())
        .collect();
    let runs: Vec<_> = prompts.iter().map(|p| greedy(&f32m, p, steps)).collect();

    let all = study(&ckpt, Bf16Points::ALL, &prompts, &runs);
    let (max, mean, at) = summary(&all);
    println!(
        "ALL points: max {max:.3e} at (seq {}, step {}), mean {mean:.3e}",
        at.0, at.1
    );
    for (b, e) in all.iter().enumerate() {
        let (mx, mn, a) = summary(std::slice::from_ref(e));
        println!(
            "  seq {b} (prompt {}): max {mx:.3e} at step {}, mean {mn:.3e}",
            prompts[b].len(),
            a.1
        );
        // The reference's top-1/top-2 margin and logit norm per step, next to the error.
        for (s, x) in e.iter().enumerate() {
            let l = &runs[b].0[s];
            let mut top = l.clone();
            top.sort_by(|a, b| b.total_cmp(a));
            let norm = l.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            println!(
                "    step {s:>2} rel_l2 {x:.3e} |ref| {norm:9.1} top1-top2 {:.3}",
                top[0] - top[1]
            );
        }
    }
    // Custom point sets: SPARDA_BF16_SETS="norm_out,act;qkv,rope" (points on, others off).
    if let Ok(sets) = std::env::var("SPARDA_BF16_SETS") {
        for set in sets.split(';').filter(|s| !s.is_empty()) {
            let mut pts = Bf16Points::NONE;
            for name in set.split(',').filter(|s| !s.is_empty()) {
                pts = pts
                    .with(name.trim(), true)
                    .expect("a Bf16Points field name");
            }
            let e = study(&ckpt, pts, &prompts, &runs);
            let (mx, mn, a) = summary(&e);
            let per: Vec<String> = e
                .iter()
                .map(|s| {
                    let (m, n, at) = summary(std::slice::from_ref(s));
                    format!("max {m:.3e} (step {}) mean {n:.3e}", at.1)
                })
                .collect();
            println!(
                "set [{set}]: max {mx:.3e} at {a:?}, mean {mn:.3e}; per seq: {}",
                per.join(" | ")
            );
        }
    }
    if std::env::var_os("SPARDA_NO_ABLATION").is_some() {
        return;
    }
    println!("ablation: ALL minus one point / that point alone (max, mean, where)");
    for name in Bf16Points::NAMES {
        let minus = summary(&study(
            &ckpt,
            Bf16Points::ALL.with(name, false).unwrap(),
            &prompts,
            &runs,
        ));
        let alone = summary(&study(
            &ckpt,
            Bf16Points::NONE.with(name, true).unwrap(),
            &prompts,
            &runs,
        ));
        println!(
            "  {name:<13} without: max {:.3e} mean {:.3e} at {:?} | alone: max {:.3e} mean {:.3e} at {:?}",
            minus.0, minus.1, minus.2, alone.0, alone.1, alone.2
        );
    }
}
