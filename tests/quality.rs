//! Perplexity and the comparison with a saved base run (`sparda::quality`),
//! checked on the CPU reference of the tiny preset against the same
//! figures computed directly in the test from `CpuModel` logits.

mod common;
use common::TmpDir;
use sparda::cpu::{CpuModel, EngineOptions};
use sparda::model::AttentionOverrides;
use sparda::quality::identity::{check_model, check_text, ModelIdentity, TextIdentity};
use sparda::quality::logits_file::{LogitsHeader, LogitsReader, LogitsWriter};
use sparda::quality::{evaluate, ChunkPlan, CpuLogits, Evaluation, NextTokenLogits};
use sparda::synth::{self, Preset};
use sparda::weights::Checkpoint;
use sparda::Result;
use std::path::Path;

/// Text-like token ids of the tiny model's vocabulary.
fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919) + 13 + salt * 101) % 49_000)
        .collect()
}

fn tiny(seed: u64) -> Checkpoint {
    synth::build(Preset::Tiny, seed).unwrap()
}

fn model(ckpt: &Checkpoint, dense: bool) -> CpuModel {
    let opts = EngineOptions {
        attention: AttentionOverrides {
            sparse: dense.then_some(false),
            ..Default::default()
        },
        ..Default::default()
    };
    CpuModel::new(ckpt, opts).unwrap()
}

/// log-softmax of a logits row, computed here in f64 from scratch.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x
        .iter()
        .fold(f64::NEG_INFINITY, |a, &v| a.max(f64::from(v)));
    let lse = m + x
        .iter()
        .map(|&v| (f64::from(v) - m).exp())
        .sum::<f64>()
        .ln();
    x.iter().map(|&v| f64::from(v) - lse).collect()
}

/// Every scored position's full log-probability row and scored token, by
/// running the chunks directly on `m` (prefill, then decode the scored
/// tokens one at a time).
fn direct_rows(m: &CpuModel, toks: &[u32], plan: &ChunkPlan) -> Vec<(Vec<f64>, u32)> {
    let p = plan.prefill_len();
    let mut rows = Vec::new();
    for chunk in toks.chunks_exact(plan.context).take(plan.chunks) {
        let mut seq = m.new_sequence();
        let mut logits = m.prefill(&mut seq, &chunk[..p], |_, _| {}).unwrap();
        for (i, &t) in chunk.iter().enumerate().skip(p) {
            rows.push((log_softmax(&logits), t));
            if i + 1 < plan.context {
                logits = m.decode(&mut seq, t).unwrap();
            }
        }
    }
    rows
}

fn header(model: &ModelIdentity, text: &TextIdentity, plan: ChunkPlan, k: usize) -> LogitsHeader {
    LogitsHeader {
        model: model.clone(),
        text: text.clone(),
        chunking: plan,
        top_k: k,
        positions: plan.positions(),
        mode: serde_json::json!({"test": true}),
        date_utc: "2026-01-01T00:00:00Z".into(),
        commit: None,
    }
}

/// A tokenizer-file stand-in: identities hash its bytes only.
fn tokenizer_file(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

/// Runs `engine` over `toks` by `plan`, saving a base of K = `k` to `save`.
fn save_run(
    engine: &mut dyn NextTokenLogits,
    toks: &[u32],
    plan: &ChunkPlan,
    h: &LogitsHeader,
    save: &Path,
) -> Evaluation {
    let mut w = LogitsWriter::create(save, h).unwrap();
    let ev = evaluate(engine, toks, plan, Some(&mut w), None, |_| {}).unwrap();
    w.finish().unwrap();
    ev
}

/// A base run's top-K + rest KL and the top-1 agreement at one
/// position, computed directly from both runs' full log-probability rows.
fn direct_kl(base: &[f64], this: &[f64], k: usize) -> (f64, bool) {
    let mut ids: Vec<usize> = (0..base.len()).collect();
    ids.sort_by(|&a, &b| base[b].total_cmp(&base[a]).then(a.cmp(&b)));
    let top = &ids[..k];
    let mut kl = 0.0;
    for &i in top {
        kl += base[i].exp() * (base[i] - this[i]);
    }
    let p_rest: f64 = ids[k..].iter().map(|&i| base[i].exp()).sum();
    let q_rest: f64 = ids[k..].iter().map(|&i| this[i].exp()).sum();
    if p_rest > 0.0 {
        kl += p_rest * (p_rest / q_rest).ln();
    }
    let argmax = (0..this.len())
        .max_by(|&a, &b| this[a].total_cmp(&this[b]).then(b.cmp(&a)))
        .unwrap();
    (kl.max(0.0), argmax == ids[0])
}

#[test]
fn perplexity_equals_a_direct_computation_from_cpu_logits() {
    let ckpt = tiny(0);
    let m = model(&ckpt, false);
    let toks = tokens(130, 0);
    let plan = ChunkPlan::new(toks.len(), 40, Some(16), None, 32_768).unwrap();
    assert_eq!(
        (plan.chunks, plan.prefill_len(), plan.positions()),
        (3, 24, 48)
    );
    let ev = evaluate(&mut CpuLogits::new(&m), &toks, &plan, None, None, |_| {}).unwrap();
    let direct: Vec<f64> = direct_rows(&m, &toks, &plan)
        .iter()
        .map(|(lp, t)| -lp[*t as usize])
        .collect();
    assert_eq!(ev.nlls.len(), direct.len());
    for (i, (a, b)) in ev.nlls.iter().zip(&direct).enumerate() {
        assert!((a - b).abs() < 1e-9, "position {i}: {a} vs {b}");
    }
    let n = direct.len() as f64;
    let mean = direct.iter().sum::<f64>() / n;
    let var = direct.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let se = (var / n).sqrt();
    assert_eq!(ev.nll.tokens, 48);
    assert!((ev.nll.mean_nll - mean).abs() < 1e-9);
    assert!((ev.nll.ppl - mean.exp()).abs() <= 1e-9 * mean.exp());
    let [lo, hi] = ev.nll.ppl_ci95.unwrap();
    assert!((lo.ln() - (mean - 1.96 * se)).abs() < 1e-9);
    assert!((hi.ln() - (mean + 1.96 * se)).abs() < 1e-9);
    assert_eq!(ev.timing.scored_tokens, 48);
    assert_eq!(ev.timing.prefill_tokens, 72);
}

#[test]
fn identical_runs_have_zero_kl_and_full_top1_agreement() {
    let dir = TmpDir::new("quality-identical");
    let ckpt = tiny(0);
    let m = model(&ckpt, false);
    let toks = tokens(100, 1);
    let plan = ChunkPlan::new(toks.len(), 48, None, None, 32_768).unwrap();
    let tok = tokenizer_file(dir.path(), "tok.json", "{}");
    let (mid, tid) = (
        ModelIdentity::of("synth:tiny", &ckpt),
        TextIdentity::new(Path::new("t.txt"), &toks, &tok).unwrap(),
    );
    let base = dir.path().join("base.bin");
    let h = header(&mid, &tid, plan, 16);
    let ev0 = save_run(&mut CpuLogits::new(&m), &toks, &plan, &h, &base);
    let mut r = LogitsReader::open(&base).unwrap();
    assert_eq!(r.header(), &h);
    let ev = evaluate(
        &mut CpuLogits::new(&m),
        &toks,
        &plan,
        None,
        Some(&mut r),
        |_| {},
    )
    .unwrap();
    let kl = ev.kl.unwrap();
    assert_eq!(kl.positions, plan.positions());
    assert_eq!(
        (kl.kl_mean, kl.kl_median, kl.kl_p99, kl.kl_max),
        (0.0, 0.0, 0.0, 0.0)
    );
    assert_eq!(kl.top1_agreement_pct, 100.0);
    assert_eq!((kl.delta_nll_mean, kl.delta_ppl), (0.0, 0.0));
    assert!(kl.lower_bound && kl.note.contains("lower bound"));
    assert!((kl.base_ppl / ev0.nll.ppl - 1.0).abs() < 1e-5);
}

/// Logits of another engine, shifted by a fixed pattern: a perturbed run
/// through the library API.
struct Perturbed<'a>(CpuLogits<'a>);

impl Perturbed<'_> {
    fn shift(mut l: Vec<f32>) -> Vec<f32> {
        for (j, x) in l.iter_mut().enumerate() {
            *x += 0.8 * ((j as f32) * 0.37).sin();
        }
        l
    }
}

impl NextTokenLogits for Perturbed<'_> {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn prefill(&mut self, prefix: &[u32]) -> Result<Vec<f32>> {
        self.0.prefill(prefix).map(Self::shift)
    }
    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        self.0.decode(token).map(Self::shift)
    }
}

/// Checks a comparison against the direct computation from both runs' rows.
fn check_against_direct(
    ev: &Evaluation,
    base_rows: &[(Vec<f64>, u32)],
    this_rows: &[(Vec<f64>, u32)],
    k: usize,
) {
    let kl = ev.kl.as_ref().unwrap();
    let mut kls = Vec::new();
    let mut agree = 0;
    let mut d = Vec::new();
    for ((b, t), (q, t2)) in base_rows.iter().zip(this_rows) {
        assert_eq!(t, t2);
        let (x, a) = direct_kl(b, q, k);
        kls.push(x);
        agree += usize::from(a);
        d.push(-q[*t as usize] + b[*t as usize]);
    }
    let n = kls.len() as f64;
    let mean = kls.iter().sum::<f64>() / n;
    let max = kls.iter().cloned().fold(0.0, f64::max);
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    let p99 = sorted[((0.99 * n).ceil() as usize) - 1];
    assert!(mean > 1e-6, "the runs differ: mean KL {mean}");
    // the library rounds log-probabilities to f32 as it stores them
    // (measured: a few 1e-8 apart)
    let tol = |x: f64| 1e-7 + 1e-3 * x;
    assert!(
        (kl.kl_mean - mean).abs() < tol(mean),
        "{} vs {mean}",
        kl.kl_mean
    );
    assert!((kl.kl_max - max).abs() < tol(max), "{} vs {max}", kl.kl_max);
    assert!((kl.kl_p99 - p99).abs() < tol(p99), "{} vs {p99}", kl.kl_p99);
    assert!((kl.top1_agreement_pct - 100.0 * agree as f64 / n).abs() < 1e-9);
    let dm = d.iter().sum::<f64>() / n;
    assert!(
        (kl.delta_nll_mean - dm).abs() < 1e-5,
        "{} vs {dm}",
        kl.delta_nll_mean
    );
    let base_mean = base_rows.iter().map(|(b, t)| -b[*t as usize]).sum::<f64>() / n;
    let dppl = base_mean.exp() * (dm.exp() - 1.0);
    assert!(
        (kl.delta_ppl - dppl).abs() < 1e-4 * base_mean.exp(),
        "{} vs {dppl}",
        kl.delta_ppl
    );
}

#[test]
fn perturbed_logits_kl_equals_the_direct_top_k_plus_rest_computation() {
    let dir = TmpDir::new("quality-perturbed");
    let ckpt = tiny(0);
    let m = model(&ckpt, false);
    let toks = tokens(80, 2);
    let plan = ChunkPlan::new(toks.len(), 40, Some(12), None, 32_768).unwrap();
    let tok = tokenizer_file(dir.path(), "tok.json", "{}");
    let tid = TextIdentity::new(Path::new("t.txt"), &toks, &tok).unwrap();
    let mid = ModelIdentity::of("synth:tiny", &ckpt);
    let k = 8;
    let base = dir.path().join("base.bin");
    save_run(
        &mut CpuLogits::new(&m),
        &toks,
        &plan,
        &header(&mid, &tid, plan, k),
        &base,
    );
    let mut r = LogitsReader::open(&base).unwrap();
    let ev = evaluate(
        &mut Perturbed(CpuLogits::new(&m)),
        &toks,
        &plan,
        None,
        Some(&mut r),
        |_| {},
    )
    .unwrap();
    let base_rows = direct_rows(&m, &toks, &plan);
    let this_rows: Vec<(Vec<f64>, u32)> = {
        // the same shift, applied to the direct logits before log-softmax
        let p = plan.prefill_len();
        let mut rows = Vec::new();
        for chunk in toks.chunks_exact(plan.context) {
            let mut seq = m.new_sequence();
            let mut l = m.prefill(&mut seq, &chunk[..p], |_, _| {}).unwrap();
            for (i, &t) in chunk.iter().enumerate().skip(p) {
                rows.push((log_softmax(&Perturbed::shift(l.clone())), t));
                if i + 1 < plan.context {
                    l = m.decode(&mut seq, t).unwrap();
                }
            }
        }
        rows
    };
    check_against_direct(&ev, &base_rows, &this_rows, k);
}

#[test]
fn another_attention_mode_kl_equals_the_direct_computation() {
    // NOSA (the tiny preset's 6-block budget drops blocks past 384 tokens)
    // against a dense base, one chunk of 1024 tokens, the last 12 scored.
    let dir = TmpDir::new("quality-mode");
    let ckpt = tiny(0);
    let (dense, nosa) = (model(&ckpt, true), model(&ckpt, false));
    let toks = tokens(1024, 3);
    let plan = ChunkPlan::new(toks.len(), 1024, Some(12), None, 32_768).unwrap();
    let tok = tokenizer_file(dir.path(), "tok.json", "{}");
    let tid = TextIdentity::new(Path::new("t.txt"), &toks, &tok).unwrap();
    let mid = ModelIdentity::of("synth:tiny", &ckpt);
    let k = 32;
    let base = dir.path().join("dense.bin");
    save_run(
        &mut CpuLogits::new(&dense),
        &toks,
        &plan,
        &header(&mid, &tid, plan, k),
        &base,
    );
    let mut r = LogitsReader::open(&base).unwrap();
    let ev = evaluate(
        &mut CpuLogits::new(&nosa),
        &toks,
        &plan,
        None,
        Some(&mut r),
        |_| {},
    )
    .unwrap();
    check_against_direct(
        &ev,
        &direct_rows(&dense, &toks, &plan),
        &direct_rows(&nosa, &toks, &plan),
        k,
    );
}

#[test]
fn a_base_of_another_model_text_tokenizer_or_chunking_is_refused_naming_the_field() {
    let dir = TmpDir::new("quality-refuse");
    let (c0, c1) = (tiny(0), tiny(1));
    let m0 = ModelIdentity::of("synth:tiny", &c0);
    let m1 = ModelIdentity::of("synth:tiny:1", &c1);
    assert_eq!(
        m0,
        ModelIdentity::of("synth:tiny", &tiny(0)),
        "deterministic"
    );
    let base = Path::new("base.bin");
    let err = check_model(base, &m0, &m1).unwrap_err().to_string();
    assert!(
        err.contains("model.fingerprint")
            && err.contains(&m0.fingerprint)
            && err.contains(&m1.fingerprint)
            && err.contains("synth:tiny:1"),
        "{err}"
    );
    check_model(base, &m0, &m0).unwrap();

    let (ta, tb) = (tokens(200, 4), tokens(200, 5));
    let tok = tokenizer_file(dir.path(), "tok.json", "{\"a\": 1}");
    let tok2 = tokenizer_file(dir.path(), "tok2.json", "{\"a\": 2}");
    let text_a = TextIdentity::new(Path::new("a.txt"), &ta, &tok).unwrap();
    let text_b = TextIdentity::new(Path::new("b.txt"), &tb, &tok).unwrap();
    let text_a2 = TextIdentity::new(Path::new("a.txt"), &ta, &tok2).unwrap();
    let plan = ChunkPlan::new(200, 64, None, None, 32_768).unwrap();
    check_text(base, (&text_a, &plan), (&text_a, &plan)).unwrap();
    let err = check_text(base, (&text_a, &plan), (&text_b, &plan))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`text.hash`") && err.contains("a.txt") && err.contains("b.txt"),
        "{err}"
    );
    let err = check_text(base, (&text_a, &plan), (&text_a2, &plan))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`text.tokenizer_hash`"), "{err}");
    let other = ChunkPlan::new(200, 64, Some(16), None, 32_768).unwrap();
    let err = check_text(base, (&text_a, &plan), (&text_a, &other))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`chunking.score`") && err.contains("32") && err.contains("16"),
        "{err}"
    );
    let fewer = ChunkPlan::new(200, 64, None, Some(1), 32_768).unwrap();
    let err = check_text(base, (&text_a, &plan), (&text_a, &fewer))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`chunking.chunks`"), "{err}");
}

#[test]
fn saved_logits_round_trip_and_damaged_files_are_refused() {
    let dir = TmpDir::new("quality-file");
    let ckpt = tiny(0);
    let m = model(&ckpt, false);
    let toks = tokens(40, 6);
    let plan = ChunkPlan::new(toks.len(), 40, Some(5), None, 32_768).unwrap();
    let tok = tokenizer_file(dir.path(), "tok.json", "{}");
    let tid = TextIdentity::new(Path::new("t.txt"), &toks, &tok).unwrap();
    let h = header(&ModelIdentity::of("synth:tiny", &ckpt), &tid, plan, 4);
    let path = dir.path().join("base.bin");
    let ev = save_run(&mut CpuLogits::new(&m), &toks, &plan, &h, &path);
    assert!(!dir.path().join("base.bin.partial").exists());
    let rows = direct_rows(&m, &toks, &plan);
    let mut r = LogitsReader::open(&path).unwrap();
    for (i, (lp, t)) in rows.iter().enumerate() {
        let rec = r.next_record().unwrap();
        assert_eq!(rec.next, *t);
        assert!((f64::from(rec.next_logprob) + ev.nlls[i]).abs() < 1e-5);
        assert_eq!(rec.ids.len(), 4);
        let mut order: Vec<usize> = (0..lp.len()).collect();
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
        let want: Vec<u32> = order[..4].iter().map(|&i| i as u32).collect();
        assert_eq!(rec.ids, want, "position {i}");
        for (id, l) in rec.ids.iter().zip(&rec.logprobs) {
            assert!((f64::from(*l) - lp[*id as usize]).abs() < 1e-5);
        }
        let rest: f64 = order[4..].iter().map(|&i| lp[i].exp()).sum();
        assert!((f64::from(rec.rest_mass) - rest).abs() < 1e-6);
    }
    assert!(r.next_record().is_err(), "no record past the last");

    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.bin");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    let err = LogitsReader::open(&cut).err().unwrap().to_string();
    assert!(err.contains("truncated"), "{err}");
    let bad = dir.path().join("bad.bin");
    std::fs::write(&bad, b"not a logits file at all").unwrap();
    let err = LogitsReader::open(&bad).err().unwrap().to_string();
    assert!(err.contains("not a saved-logits file"), "{err}");
}

#[test]
fn chunk_plans_name_the_numbers_when_refused() {
    let p = ChunkPlan::new(1000, 256, None, None, 4096).unwrap();
    assert_eq!((p.context, p.score, p.chunks), (256, 128, 3));
    assert_eq!(
        ChunkPlan::new(1000, 256, None, Some(2), 4096)
            .unwrap()
            .chunks,
        2
    );
    assert_eq!(
        ChunkPlan::new(1000, 256, None, Some(9), 4096)
            .unwrap()
            .chunks,
        3
    );
    let err = |r: sparda::Result<ChunkPlan>| r.unwrap_err().to_string();
    let e = err(ChunkPlan::new(100, 256, None, None, 4096));
    assert!(
        e.contains("100 tokens") && e.contains("--context 256"),
        "{e}"
    );
    let e = err(ChunkPlan::new(1000, 256, Some(256), None, 4096));
    assert!(e.contains("--score 256") && e.contains("1 … 255"), "{e}");
    assert!(err(ChunkPlan::new(1000, 256, Some(0), None, 4096)).contains("--score 0"));
    assert!(err(ChunkPlan::new(1000, 1, None, None, 4096)).contains("--context 1"));
    assert!(err(ChunkPlan::new(1000, 256, None, Some(0), 4096)).contains("--max-chunks 0"));
    let e = err(ChunkPlan::new(10_000, 8192, None, None, 4096));
    assert!(e.contains("8192") && e.contains("4096"), "{e}");
}
