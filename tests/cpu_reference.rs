//! The CPU reference against itself and against independent formulas:
//! incremental decode = full prefill, NOSA with every
//! block selected = attention over all tokens with the bias, state growth,
//! determinism per seed.

mod common;
use common::{max_abs_err, rel_l2};
use rand::{Rng, SeedableRng};
use sparda::config::{AttentionMode, SparseConfig};
use sparda::cpu::{self, CpuModel, EngineOptions, Logits, Phase};
use sparda::generate::{self, Request};
use sparda::model::select::Budget;
use sparda::model::state::LayerKv;
use sparda::model::{AttentionOverrides, AttentionPlan};
use sparda::sample::SamplingParams;

fn tiny(opts: EngineOptions) -> CpuModel {
    let ckpt = sparda::synth::build(sparda::synth::Preset::Tiny, 1).expect("tiny preset builds");
    CpuModel::new(&ckpt, opts).expect("tiny model loads")
}

fn random_tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Prefill of the first `split` tokens then one-token decode steps must give
/// the logits that one prefill over all tokens gives at every position.
fn incremental_equals_prefill(model: &CpuModel, n: usize, split: usize) {
    let v = model.config.vocab_size;
    let toks = random_tokens(n, 3, v);
    let mut full = model.new_sequence();
    let all = model
        .forward(
            &mut full,
            &toks,
            Phase::Prefill { prompt_len: n },
            Logits::All,
        )
        .unwrap();
    let mut inc = model.new_sequence();
    let mut logits = model.prefill(&mut inc, &toks[..split], |_, _| {}).unwrap();
    for t in split..=n {
        let want = &all[(t - 1) * v..t * v];
        let err = rel_l2(&logits, want);
        assert!(err < 1e-4, "position {}: rel L2 {err:e}", t - 1);
        if t < n {
            logits = model.decode(&mut inc, toks[t]).unwrap();
        }
    }
    // the §3 state is the same too
    for (a, b) in full.layers.iter().zip(&inc.layers) {
        assert_eq!(a.len(), n);
        assert_eq!(a.windows(), b.windows());
        assert!(rel_l2(&b.kc, &a.kc) < 1e-5);
        assert!(rel_l2(&b.p, &a.p) < 1e-5);
    }
}

#[test]
fn dense_incremental_decode_equals_full_prefill() {
    let model = tiny(EngineOptions {
        attention: AttentionOverrides {
            sparse: Some(false),
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(model.plan.mode, AttentionMode::Dense);
    incremental_equals_prefill(&model, 150, 20);
}

#[test]
fn nosa_incremental_decode_equals_sparse_prefill_past_the_budget() {
    // tiny: S = 6 blocks = 384 tokens; 520 tokens make selection drop blocks.
    let model = tiny(EngineOptions::default());
    assert_eq!(model.plan.mode, AttentionMode::Nosa);
    assert_eq!(model.plan.budget.attended, 6);
    incremental_equals_prefill(&model, 520, 450);
}

#[test]
fn sparse_selection_really_drops_blocks_and_keeps_forced_ones() {
    let model = tiny(EngineOptions::default());
    let toks = random_tokens(700, 5, model.config.vocab_size);
    let mut seq = model.new_sequence();
    model.prefill(&mut seq, &toks, |_, _| {}).unwrap();
    let b = model.plan.budget;
    let q = 699 / 64; // current block 10 → 11 blocks exist
    for layer in &seq.selections {
        for sel in layer {
            assert_eq!(sel.len(), b.attended, "{sel:?}");
            assert!(
                sel.contains(&0)
                    && sel.contains(&q)
                    && sel.contains(&(q - 1))
                    && sel.contains(&(q - 2))
            );
        }
    }
}

/// Naive attention over all tokens j ≤ t with (or without) the bias, f64.
fn naive(kv: &LayerKv, q: &[f32], t: usize, hq: usize, dh: usize, bias: bool) -> Vec<f64> {
    let hk = kv.kv_heads;
    let g = hq / hk;
    let mut out = vec![0.0f64; hq * dh];
    for head in 0..hq {
        let h = head / g;
        let logits: Vec<f64> = (0..=t)
            .map(|j| {
                let k = &kv.k[j * kv.kv_dim + h * dh..j * kv.kv_dim + (h + 1) * dh];
                let s: f64 = (0..dh)
                    .map(|x| q[head * dh + x] as f64 * k[x] as f64)
                    .sum::<f64>()
                    / (dh as f64).sqrt();
                s + if bias { kv.c[j * hk + h] as f64 } else { 0.0 }
            })
            .collect();
        let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
        for (j, l) in logits.iter().enumerate() {
            let p = (l - mx).exp() / z;
            for x in 0..dh {
                out[head * dh + x] += p * kv.v[j * kv.kv_dim + h * dh + x] as f64;
            }
        }
    }
    out
}

fn random_kv(rng: &mut impl Rng, budget: &Budget, hk: usize, dh: usize, t: usize) -> LayerKv {
    let mut kv = LayerKv::new(hk, dh);
    let k: Vec<f32> = (0..t * hk * dh)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let v: Vec<f32> = (0..t * hk * dh)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let c: Vec<f32> = (0..t * hk).map(|_| rng.random_range(-2.0..0.5)).collect();
    kv.append(budget, &k, &v, &c);
    kv
}

/// NOSA with a budget covering every block equals attention over all tokens
/// with the eviction bias on the scaled logits; dense has no bias (spec §5).
/// GQA groups 3, 8, 16; head dims 64, 80, 128; T from < 32 to past a block.
#[test]
fn nosa_with_every_block_selected_equals_biased_full_attention() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let cfg = sparda::synth::build(sparda::synth::Preset::Tiny, 1)
        .unwrap()
        .config;
    for (g, dh) in [(3usize, 64usize), (8, 80), (16, 128)] {
        let hk = 2;
        let hq = g * hk;
        for t_len in [7usize, 31, 48, 49, 64, 65, 130] {
            let mut c = cfg.clone();
            c.num_attention_heads = hq;
            c.num_key_value_heads = hk;
            c.head_dim = dh;
            c.sparse = Some(SparseConfig {
                topk: 40,
                ..SparseConfig::default()
            }); // S = 56 blocks ≫ T/64
            let plan = AttentionPlan::resolve(&c, true, AttentionOverrides::default()).unwrap();
            assert_eq!(plan.mode, AttentionMode::Nosa);
            let kv = random_kv(&mut rng, &plan.budget, hk, dh, t_len);
            let q: Vec<f32> = (0..hq * dh).map(|_| rng.random_range(-1.0..1.0)).collect();
            let t = t_len - 1;
            let mut out = vec![0.0f32; hq * dh];
            let sel = cpu::sparse_attention(&plan, &kv, &q, t, 1, hq, &mut out);
            assert!(sel.iter().all(|s| s.len() == t / 64 + 1));
            let want = naive(&kv, &q, t, hq, dh, true);
            let err = max_abs_err(&out, &want);
            assert!(err < 1e-5, "g {g} d {dh} T {t_len}: max err {err:e}");
            let mut dense = vec![0.0f32; hq * dh];
            cpu::dense_attention(&kv, &q, t, 1, hq, dh, &mut dense);
            let want = naive(&kv, &q, t, hq, dh, false);
            let err = max_abs_err(&dense, &want);
            assert!(err < 1e-5, "dense g {g} d {dh} T {t_len}: max err {err:e}");
            // the bias matters: NOSA ≠ dense unless c is constant
            let diff = out
                .iter()
                .zip(&dense)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(diff > 1e-4 || t_len == 1);
        }
    }
}

#[test]
fn state_keeps_growing_over_long_generations() {
    let model = tiny(EngineOptions::default());
    let b = model.plan.budget;
    let mut seq = model.new_sequence();
    let toks = random_tokens(40, 9, model.config.vocab_size);
    let mut logits = model.prefill(&mut seq, &toks, |_, _| {}).unwrap();
    for _ in 0..700 {
        let tok = sparda::sample::argmax(&logits);
        logits = model.decode(&mut seq, tok).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
    }
    let t = seq.len();
    assert_eq!(t, 740);
    for kv in &seq.layers {
        assert_eq!(kv.windows(), b.windows(t));
        // the last window is the mean of its 32 keys
        let i = kv.windows() - 1;
        let mut want = vec![0.0f32; kv.kv_dim];
        for tok in i * 16..i * 16 + 32 {
            for (w, k) in want
                .iter_mut()
                .zip(&kv.k[tok * kv.kv_dim..(tok + 1) * kv.kv_dim])
            {
                *w += k / 32.0;
            }
        }
        assert!(rel_l2(&kv.kc[i * kv.kv_dim..], &want) < 1e-5);
    }
    // the window moved with the generation: the current block and W before it are selected
    let q = (t - 1) / 64;
    for sel in &seq.selections[0] {
        assert!(sel.contains(&q) && sel.contains(&(q - 2)), "{sel:?}");
    }
}

#[test]
fn generate_is_deterministic_per_seed() {
    let model = tiny(EngineOptions::default());
    let prompt = random_tokens(100, 4, model.config.vocab_size);
    let run = |seed| {
        let req = Request {
            prompt: prompt.clone(),
            max_new_tokens: 24,
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 50,
                top_p: 0.95,
                seed,
            },
            stop_ids: vec![],
            logprobs: None,
        };
        generate::generate_cpu(&model, &req, |_, _| {}, |_| Ok(()))
            .unwrap()
            .0
            .tokens
    };
    let a = run(1);
    assert_eq!(a.len(), 24);
    assert_eq!(a, run(1));
    assert_ne!(a, run(2));
}

#[test]
fn prompt_past_max_position_is_an_error_with_numbers() {
    let model = tiny(EngineOptions::default());
    let max = model.config.max_position_embeddings;
    let req = Request {
        prompt: vec![1; 10],
        max_new_tokens: max,
        sampling: Default::default(),
        stop_ids: vec![],
        logprobs: None,
    };
    let err = generate::generate_cpu(&model, &req, |_, _| {}, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{}", max + 10)) && err.contains(&max.to_string()),
        "{err}"
    );
    let mut seq = model.new_sequence();
    let bad = model.config.vocab_size as u32;
    let err = model.decode(&mut seq, bad).unwrap_err().to_string();
    assert!(err.contains(&bad.to_string()), "{err}");
}

/// log-softmax of one row in f64, directly from its definition.
fn log_softmax_f64(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
    x.iter().map(|&v| v as f64 - m - z.ln()).collect()
}

#[test]
fn generate_logprobs_equal_log_softmax_of_the_logits() {
    let model = tiny(EngineOptions::default());
    let prompt = random_tokens(70, 9, model.config.vocab_size);
    let k = 5;
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            seed: 3,
        },
    ] {
        let req = Request {
            prompt: prompt.clone(),
            max_new_tokens: 12,
            sampling,
            stop_ids: vec![],
            logprobs: Some(k),
        };
        let (out, _) = generate::generate_cpu(&model, &req, |_, _| {}, |_| Ok(())).unwrap();
        assert_eq!(out.logprobs.len(), out.tokens.len());
        // The same logits, step by step: the prompt, then each generated token.
        let mut seq = model.new_sequence();
        let mut logits = model.prefill(&mut seq, &prompt, |_, _| {}).unwrap();
        for (i, (&tok, lp)) in out.tokens.iter().zip(&out.logprobs).enumerate() {
            let want = log_softmax_f64(&logits);
            assert_eq!(lp.token, tok);
            assert!(
                (lp.logprob as f64 - want[tok as usize]).abs() < 1e-5,
                "step {i}: logprob {} vs {}",
                lp.logprob,
                want[tok as usize]
            );
            // the K most likely ids, descending, with their log-probabilities
            let mut order: Vec<usize> = (0..want.len()).collect();
            order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
            assert_eq!(lp.top_logprobs.len(), k);
            for (j, &(id, l)) in lp.top_logprobs.iter().enumerate() {
                assert_eq!(id as usize, order[j], "step {i}, rank {j}");
                assert!((l as f64 - want[id as usize]).abs() < 1e-5);
            }
            // a probability distribution: exp sums to 1
            let total: f64 = want.iter().map(|l| l.exp()).sum();
            assert!((total - 1.0).abs() < 1e-9);
            logits = model.decode(&mut seq, tok).unwrap();
        }
        if sampling.temperature == 0.0 {
            // greedy: every chosen token is the most likely one
            assert!(out.logprobs.iter().all(|t| t.top_logprobs[0].0 == t.token));
        }
    }
}
