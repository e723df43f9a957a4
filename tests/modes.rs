//! Which attention runs when (spec/nosa-model.md §1, §5, §6) and the muP
//! scalings, checked through the CPU reference on the tiny preset.

mod common;
use common::rel_l2;
use sparda::config::{AttentionMode, Mup, SparseConfig};
use sparda::cpu::{CpuModel, EngineOptions, Logits, Phase};
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
