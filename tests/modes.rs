//! Which attention runs when (spec/nosa-model.md §1, §5, §6) and the muP
//! scalings, checked through the CPU reference on the tiny preset.

mod common;
use common::rel_l2;
use sparda::config::{AttentionMode, Mup, SparseConfig};
use sparda::cpu::{ops, CpuModel, EngineOptions, Logits, Phase, Sequence};
use sparda::model::forecast::ForecastWeights;
use sparda::model::{AttentionOverrides, AttentionPlan, PrefillMode, SelectionRule};
use sparda::synth::{self, Preset};
use sparda::weights::names::{self, LayerTensor};
use sparda::weights::{Checkpoint, DType, OwnedTensor, TensorStore};

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 13) % 49_000).collect()
}

fn prefill_logits(model: &CpuModel, toks: &[u32]) -> Vec<f32> {
    let mut seq = model.new_sequence();
    model.prefill(&mut seq, toks, |_, _| {}).unwrap()
}

fn dense_opts() -> EngineOptions {
    EngineOptions {
        attention: AttentionOverrides {
            sparse: Some(false),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn attention_mode_follows_heads_and_sparse_config() {
    let cfg = Preset::Tiny.config();
    let ov = AttentionOverrides::default();
    assert_eq!(
        AttentionPlan::resolve(&cfg, true, ov).unwrap().mode,
        AttentionMode::Nosa
    );
    assert_eq!(
        AttentionPlan::resolve(&cfg, false, ov).unwrap().mode,
        AttentionMode::InfLlmV2
    );
    let mut plain = cfg.clone();
    plain.sparse = None;
    assert_eq!(
        AttentionPlan::resolve(&plain, false, ov).unwrap().mode,
        AttentionMode::Dense
    );
    // a NOSA checkpoint without sparse_config gets the §1 defaults
    let p = AttentionPlan::resolve(&plain, true, ov).unwrap();
    assert_eq!(
        (p.mode, p.sparse),
        (AttentionMode::Nosa, SparseConfig::default())
    );
    // overrides
    let sparse = AttentionOverrides {
        sparse: Some(true),
        ..ov
    };
    assert_eq!(
        AttentionPlan::resolve(&plain, false, sparse).unwrap().mode,
        AttentionMode::InfLlmV2
    );
    let dense = AttentionOverrides {
        sparse: Some(false),
        ..ov
    };
    assert_eq!(
        AttentionPlan::resolve(&cfg, true, dense).unwrap().mode,
        AttentionMode::Dense
    );
    let inf = AttentionOverrides {
        selection: Some(SelectionRule::InfLlmV2),
        ..ov
    };
    assert_eq!(
        AttentionPlan::resolve(&cfg, true, inf).unwrap().mode,
        AttentionMode::InfLlmV2
    );
    let nosa = AttentionOverrides {
        selection: Some(SelectionRule::Nosa),
        ..ov
    };
    let err = AttentionPlan::resolve(&cfg, false, nosa)
        .unwrap_err()
        .to_string();
    assert!(err.contains("self_attn.A"), "{err}");
    // budget overrides: S = topk + W
    let b = AttentionOverrides {
        budget_blocks: Some(10),
        select_blocks: Some(3),
        ..ov
    };
    let p = AttentionPlan::resolve(&cfg, true, b).unwrap();
    assert_eq!(
        (p.budget.attended, p.budget.shortlist, p.sparse.topk),
        (10, 6, 8)
    );
    let err = AttentionPlan::resolve(
        &cfg,
        true,
        AttentionOverrides {
            budget_blocks: Some(2),
            ..ov
        },
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("--budget-blocks 2 is below the minimum 5"),
        "{err}"
    );
    // a huge --select-blocks must not wrap around the budget check
    let huge = AttentionOverrides {
        select_blocks: Some(usize::MAX),
        ..ov
    };
    assert!(AttentionPlan::resolve(&cfg, true, huge).is_err());
    // nor a huge --max-new-tokens the length check
    let err = sparda::generate::check_length(10, usize::MAX, 8192)
        .unwrap_err()
        .to_string();
    assert!(err.contains("8192"), "{err}");
}

#[test]
fn below_dense_len_a_sparse_model_computes_dense_attention() {
    let mut ckpt = synth::build(Preset::Tiny, 2).unwrap();
    let toks = tokens(500); // past the 384-token budget
    let dense = CpuModel::new(&ckpt, dense_opts()).unwrap();
    let want = prefill_logits(&dense, &toks);
    let sparse = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    let nosa = prefill_logits(&sparse, &toks);
    assert!(
        rel_l2(&nosa, &want) > 1e-3,
        "sparse must differ from dense here"
    );
    ckpt.config.sparse = Some(SparseConfig {
        dense_len: 501,
        ..ckpt.config.sparse.unwrap()
    });
    let gated = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    assert_eq!(gated.plan.mode, AttentionMode::Nosa);
    let got = prefill_logits(&gated, &toks);
    assert!(rel_l2(&got, &want) < 1e-5, "T < dense_len: dense, no bias");
    // at T = dense_len (the next decode step) it turns sparse
    assert!(!gated.plan.sparse_at(500) && gated.plan.sparse_at(501));
}

#[test]
fn dense_prefill_then_sparse_decode() {
    let ckpt = synth::build(Preset::Tiny, 2).unwrap();
    let toks = tokens(500);
    let dense = CpuModel::new(&ckpt, dense_opts()).unwrap();
    let nosa_f = CpuModel::new(
        &ckpt,
        EngineOptions {
            prefill: PrefillMode::Dense,
            ..Default::default()
        },
    )
    .unwrap();
    let mut a = dense.new_sequence();
    let mut b = nosa_f.new_sequence();
    let la = dense.prefill(&mut a, &toks, |_, _| {}).unwrap();
    let lb = nosa_f.prefill(&mut b, &toks, |_, _| {}).unwrap();
    assert!(
        rel_l2(&lb, &la) < 1e-6,
        "--prefill dense equals dense prefill"
    );
    assert!(b.selections.iter().all(|l| l.iter().all(|s| s.is_empty())));
    let la = dense.decode(&mut a, 5).unwrap();
    let lb = nosa_f.decode(&mut b, 5).unwrap();
    assert!(rel_l2(&lb, &la) > 1e-3, "decode is sparse");
    assert!(b.selections.iter().all(|l| l.iter().all(|s| s.len() == 6)));
}

/// The CPU model of `ckpt` with `dense_len` in its sparse_config, in
/// forecast mode when `forecast` is given.
fn with_dense_len(
    ckpt: &mut Checkpoint,
    dense_len: usize,
    forecast: Option<&ForecastWeights>,
) -> CpuModel {
    ckpt.config.sparse = Some(SparseConfig {
        dense_len,
        ..ckpt.config.sparse.unwrap()
    });
    let mut model = CpuModel::new(ckpt, EngineOptions::default()).unwrap();
    model.set_forecast(forecast.cloned()).unwrap();
    model
}

/// Decodes `toks` one per call on a copy of `seq`: every step's logits,
/// [n, V], and the sequence afterwards.
fn one_per_call(model: &CpuModel, seq: &Sequence, toks: &[u32]) -> (Vec<f32>, Sequence) {
    let mut seq = seq.clone();
    let logits = toks
        .iter()
        .flat_map(|&t| model.decode(&mut seq, t).unwrap())
        .collect();
    (logits, seq)
}

/// dense_len is decided per token (spec §1): a decode call whose tokens cross
/// dense_len runs those with T < dense_len dense and the rest sparse, as
/// decoding them one per call does — bitwise for decode shapes (at most
/// `ops::MATVEC_ROWS` rows: the same f32 arithmetic per row), within rounding
/// for longer calls; with query-aware and with forecast selection.
#[test]
fn decode_call_crossing_dense_len_switches_at_the_crossing_token() {
    let mut ckpt = synth::build(Preset::Tiny, 2).unwrap();
    let v = ckpt.config.vocab_size;
    let fw = {
        let tensors = ForecastWeights::synth_tensors(&ckpt.config, 7);
        ForecastWeights::from_store(
            &ckpt.config,
            &TensorStore::from_tensors(tensors),
            std::path::Path::new("synth"),
        )
        .unwrap()
    };
    // 420 prompt tokens: past the 384-token budget, so selection drops blocks;
    // prefilled dense (420 < every dense_len below), the same for all models.
    let p = 420;
    let prefill_model = with_dense_len(&mut ckpt, p + 2, None);
    let mut prefilled = prefill_model.new_sequence();
    prefill_model
        .prefill(&mut prefilled, &tokens(p), |_, _| {})
        .unwrap();
    let call = [101u32, 202, 303, 404];
    let n = call.len();
    assert!(n <= ops::MATVEC_ROWS, "decode shapes: per-row arithmetic");
    for forecast in [None, Some(&fw)] {
        let mode = if forecast.is_some() {
            "forecast"
        } else {
            "query-aware"
        };
        // token i has T = p + i + 1: all sparse at dense_len p + 1, all dense at p + n + 1
        let (all_sparse, _) = one_per_call(
            &with_dense_len(&mut ckpt, p + 1, forecast),
            &prefilled,
            &call,
        );
        let (all_dense, _) = one_per_call(
            &with_dense_len(&mut ckpt, p + n + 1, forecast),
            &prefilled,
            &call,
        );
        for k in 1..n {
            // dense_len p + 1 + k: tokens 0 … k−1 dense, k … n−1 sparse
            let model = with_dense_len(&mut ckpt, p + 1 + k, forecast);
            let (want, want_seq) = one_per_call(&model, &prefilled, &call);
            let mut seq = prefilled.clone();
            let got = model
                .forward(&mut seq, &call, Phase::Decode, Logits::All)
                .unwrap();
            assert!(
                got == want,
                "{mode}, {k} dense tokens: one call differs from one token per call (rel L2 {:e})",
                rel_l2(&got, &want)
            );
            assert_eq!(seq.len(), p + n);
            assert_eq!(seq.selections, want_seq.selections, "{mode}, k {k}");
            assert_eq!(seq.forecasts, want_seq.forecasts, "{mode}, k {k}");
            // both sides really run: the dense tokens are an all-dense run's,
            // the first token is not an all-sparse run's, the first sparse
            // token not an all-dense run's
            assert!(got[..k * v] == all_dense[..k * v], "{mode}, k {k}");
            let row = |l: &[f32], i: usize| l[i * v..(i + 1) * v].to_vec();
            assert!(
                rel_l2(&row(&got, 0), &row(&all_sparse, 0)) > 1e-3,
                "{mode}, k {k}"
            );
            assert!(
                rel_l2(&row(&got, k), &row(&all_dense, k)) > 1e-3,
                "{mode}, k {k}"
            );
            // Logits::Last is the last token's row
            let last = model
                .forward(&mut prefilled.clone(), &call, Phase::Decode, Logits::Last)
                .unwrap();
            assert!(last == row(&want, n - 1), "{mode}, k {k}: Logits::Last");
        }
    }
    // a longer call (GEMM shapes), crossing after 5 of its 9 tokens
    let long: Vec<u32> = (0..9u32).map(|i| 500 + 37 * i).collect();
    let model = with_dense_len(&mut ckpt, p + 1 + 5, None);
    let (want, _) = one_per_call(&model, &prefilled, &long);
    let got = model
        .forward(&mut prefilled.clone(), &long, Phase::Decode, Logits::All)
        .unwrap();
    for i in 0..long.len() {
        let err = rel_l2(&got[i * v..(i + 1) * v], &want[i * v..(i + 1) * v]);
        assert!(err < 1e-4, "long call, token {i}: rel L2 {err:e}");
    }
}

/// muP: scale_emb s, residual factor scale_depth/√L = r and logit divisor
/// d/dim_model_base = q equal a plain model whose embedding is ×s, o_proj
/// and down_proj ×r, lm_head ÷q. Powers of two keep both sides exact.
#[test]
fn mup_scalings_equal_rescaled_weights() {
    let base = synth::build(Preset::Tiny, 3).unwrap();
    let cfg = &base.config;
    let l = cfg.num_hidden_layers;
    let mut mup_cfg = cfg.clone();
    mup_cfg.mup = Some(Mup {
        scale_emb: 2.0,
        scale_depth: Some(0.5 * (l as f32).sqrt()),
        dim_model_base: cfg.hidden_size as f32 / 4.0,
    });
    let mup = Checkpoint::from_parts(
        mup_cfg,
        TensorStore::from_tensors(base.store.to_owned_tensors()),
    )
    .unwrap();
    let mut store = TensorStore::from_tensors(base.store.to_owned_tensors());
    let mut scaled = |name: String, f: f32| {
        let v = base
            .store
            .to_f32(&name)
            .unwrap()
            .iter()
            .map(|x| x * f)
            .collect::<Vec<f32>>();
        let shape = base.store.info(&name).unwrap().1.to_vec();
        store.insert(OwnedTensor::from_f32(name, shape, &v, DType::BF16).unwrap());
    };
    scaled(names::embed(), 2.0);
    scaled(names::lm_head(), 0.25);
    for i in 0..l {
        scaled(names::layer(i, LayerTensor::OProj), 0.5);
        scaled(names::layer(i, LayerTensor::DownProj), 0.5);
    }
    let plain = Checkpoint::from_parts(cfg.clone(), store).unwrap();
    let toks = tokens(80);
    let run = |c: &Checkpoint| {
        let m = CpuModel::new(c, EngineOptions::default()).unwrap();
        let mut seq = m.new_sequence();
        m.forward(
            &mut seq,
            &toks,
            Phase::Prefill {
                prompt_len: toks.len(),
            },
            Logits::All,
        )
        .unwrap()
    };
    let (a, b) = (run(&mup), run(&plain));
    assert!(rel_l2(&a, &b) < 1e-5, "rel L2 {}", rel_l2(&a, &b));
    // and muP does change the output
    assert!(rel_l2(&a, &run(&base)) > 1e-2);
}
