//! SparDA forecast mode in the CPU reference (spec/nosa-model.md §2, §4
//! "Forecast mode"): weight loading by key suffix with
//! errors naming layers, and the selection rule — layer 0 scores its own
//! current-step windows, layer l ≥ 1 those of the previous step.

use sparda::config::SparseConfig;
use sparda::cpu::{forecast_window_scores, CpuModel, EngineOptions};
use sparda::model::forecast::ForecastWeights;
use sparda::model::select::{self, SelectionRule};
use sparda::model::state::LayerKv;
use sparda::synth::{self, Preset};
use sparda::weights::{DType, OwnedTensor, TensorStore};
use std::path::Path;

fn zero_forecast(cfg: &sparda::config::ModelConfig) -> ForecastWeights {
    let size = cfg.num_key_value_heads * cfg.head_dim * cfg.hidden_size;
    ForecastWeights {
        future: vec![vec![0.0; size]; cfg.num_hidden_layers - 1],
        curr0: vec![0.0; size],
    }
}

#[test]
fn weights_load_by_suffix_and_errors_name_layers() {
    let cfg = Preset::Tiny.config();
    let tensors = ForecastWeights::synth_tensors(&cfg, 3);
    assert_eq!(tensors.len(), cfg.num_hidden_layers); // L−1 future + 1 curr
                                                      // SparDA's trainer writes other prefixes: match by suffix
    let renamed: Vec<OwnedTensor> = tensors
        .iter()
        .map(|t| OwnedTensor {
            name: format!("module.{}", t.name),
            ..t.clone()
        })
        .collect();
    let fw =
        ForecastWeights::from_store(&cfg, &TensorStore::from_tensors(renamed), Path::new("f.pt"))
            .unwrap();
    assert_eq!(fw.future.len(), 1);
    assert_eq!(fw.curr0.len(), 2 * 64 * 192);
    // missing layer 0 q_curr_proj and a mis-shaped q_future_proj
    let mut bad: Vec<OwnedTensor> = tensors
        .iter()
        .filter(|t| !t.name.contains("q_curr_proj"))
        .cloned()
        .collect();
    bad[0] = OwnedTensor::from_f32(
        bad[0].name.clone(),
        vec![64, 192],
        &vec![0.5; 64 * 192],
        DType::BF16,
    )
    .unwrap();
    let err = ForecastWeights::from_store(
        &cfg,
        &TensorStore::from_tensors(bad),
        Path::new("f.safetensors"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("f.safetensors"), "{err}");
    assert!(
        err.contains("layer 0: missing `layers.0.self_attn.q_curr_proj.weight`"),
        "{err}"
    );
    assert!(
        err.contains("[64, 192]") && err.contains("[128, 192]"),
        "{err}"
    );
}

#[test]
fn forecast_scores_are_plain_dot_products() {
    let mut kv = LayerKv::new(2, 4);
    let budget = select::Budget::new(&SparseConfig::default());
    // 48 tokens → 2 windows; K rows chosen so the window means are simple
    let k: Vec<f32> = (0..48)
        .flat_map(|t| [1.0, 0.0, 0.0, (t / 16) as f32, 2.0, 0.0, 0.0, 0.0])
        .collect();
    kv.append(&budget, &k, &k, &vec![0.0; 48 * 2]);
    assert_eq!(kv.windows(), 2);
    // head 0: Kc[0] = [1,0,0,0.5], Kc[1] = [1,0,0,1.5]; f = [2,0,0,4] → 4, 8 (no scale, no softmax)
    assert_eq!(
        forecast_window_scores(&[2.0, 0.0, 0.0, 4.0], &kv, 0, 2),
        vec![4.0, 8.0]
    );
    // head 1: Kc = [2,0,0,0] in both windows
    assert_eq!(
        forecast_window_scores(&[0.5, 0.0, 0.0, 0.0], &kv, 1, 1),
        vec![1.0]
    );
}

/// With zero forecast weights every forecast score is 0, so the selection is
/// fixed by the rule alone: shortlist = forced + lowest ids (ties), then the
/// highest pooled eviction scores — from the current step's windows in layer
/// 0 and the previous step's in layer 1, checked over 80 steps. (The window
/// the current token completes lies in a forced block, so the two counts
/// never change a selection — spec §4 — which this also confirms.)
#[test]
fn layer0_uses_current_windows_and_later_layers_the_previous_steps() {
    let ckpt = synth::build(Preset::Tiny, 4).unwrap();
    let mut model = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    model
        .set_forecast(Some(zero_forecast(&model.config)))
        .unwrap();
    let b = model.plan.budget;
    let prompt: Vec<u32> = (0..700u32).map(|i| (i * 17 + 3) % 40_000).collect();
    let mut seq = model.new_sequence();
    let mut logits = model.prefill(&mut seq, &prompt, |_, _| {}).unwrap();
    for _ in 0..80 {
        let tok = sparda::sample::argmax(&logits);
        logits = model.decode(&mut seq, tok).unwrap();
        let t_len = seq.len();
        let nb = b.blocks(t_len - 1);
        for (li, windows) in [(0usize, b.windows(t_len)), (1, b.windows(t_len - 1))] {
            let kv = &seq.layers[li];
            for h in 0..kv.kv_heads {
                let pick = |mc: usize| {
                    let p: Vec<f32> = (0..mc).map(|w| kv.p[w * kv.kv_heads + h]).collect();
                    let e = select::pool_blocks(&b, &p, nb);
                    select::select(&b, SelectionRule::Nosa, &vec![0.0; nb], &e)
                };
                let want = pick(windows);
                assert_eq!(seq.selections[li][h], want, "layer {li} head {h} T {t_len}");
                let other = if li == 0 {
                    b.windows(t_len - 1)
                } else {
                    b.windows(t_len)
                };
                assert_eq!(
                    pick(other),
                    want,
                    "a completed window outside the forced blocks"
                );
            }
        }
    }
}

#[test]
fn forecast_selection_differs_from_query_aware_and_stays_valid() {
    let ckpt = synth::build(Preset::Tiny, 4).unwrap();
    let plain = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    let mut fc = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
    let tensors = ForecastWeights::synth_tensors(&fc.config, 9);
    let fw = ForecastWeights::from_store(
        &fc.config,
        &TensorStore::from_tensors(tensors),
        Path::new("synth"),
    )
    .unwrap();
    fc.set_forecast(Some(fw)).unwrap();
    let prompt: Vec<u32> = (0..600u32).map(|i| (i * 29 + 1) % 40_000).collect();
    let (mut a, mut f) = (plain.new_sequence(), fc.new_sequence());
    let la = plain.prefill(&mut a, &prompt, |_, _| {}).unwrap();
    let lf = fc.prefill(&mut f, &prompt, |_, _| {}).unwrap();
    assert_eq!(la, lf, "prefill does not use the forecast");
    let mut differ = 0;
    let b = fc.plan.budget;
    for step in 0..40u32 {
        let tok = 100 + step;
        plain.decode(&mut a, tok).unwrap();
        let logits = fc.decode(&mut f, tok).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
        let q = (f.len() - 1) / 64;
        for (sa, sf) in a
            .selections
            .iter()
            .flatten()
            .zip(f.selections.iter().flatten())
        {
            assert_eq!(sf.len(), b.attended);
            assert!(
                sf.contains(&0)
                    && sf.contains(&q)
                    && sf.contains(&(q - 1))
                    && sf.contains(&(q - 2))
            );
            differ += usize::from(sa != sf);
        }
    }
    assert!(
        differ > 0,
        "forecast selection never differed from the query-aware one"
    );
    let bad = ForecastWeights {
        future: vec![],
        curr0: vec![],
    };
    assert!(fc.set_forecast(Some(bad)).is_err());
}

/// Wiring: q_curr_proj drives layer 0 only, q_future_proj of layer 0 drives
/// layer 1 only. Zeroing one leaves its layer on the zero-score rule while
/// the other layer departs from it.
#[test]
fn curr_proj_drives_layer0_and_future_proj_the_next_layer() {
    let ckpt = synth::build(Preset::Tiny, 4).unwrap();
    let random = {
        let cfg = Preset::Tiny.config();
        ForecastWeights::from_store(
            &cfg,
            &TensorStore::from_tensors(ForecastWeights::synth_tensors(&cfg, 5)),
            Path::new("s"),
        )
        .unwrap()
    };
    let prompt: Vec<u32> = (0..650u32).map(|i| (i * 13 + 5) % 40_000).collect();
    for zero_layer in [0usize, 1] {
        let mut fw = random.clone();
        if zero_layer == 0 {
            fw.curr0.fill(0.0);
        } else {
            fw.future[0].fill(0.0);
        }
        let mut model = CpuModel::new(&ckpt, EngineOptions::default()).unwrap();
        model.set_forecast(Some(fw)).unwrap();
        let b = model.plan.budget;
        let mut seq = model.new_sequence();
        model.prefill(&mut seq, &prompt, |_, _| {}).unwrap();
        let mut other_departs = 0;
        for step in 0..30u32 {
            model.decode(&mut seq, 200 + step).unwrap();
            let t_len = seq.len();
            let nb = b.blocks(t_len - 1);
            for li in 0..2 {
                let windows = if li == 0 {
                    b.windows(t_len)
                } else {
                    b.windows(t_len - 1)
                };
                let kv = &seq.layers[li];
                for h in 0..kv.kv_heads {
                    let p: Vec<f32> = (0..windows).map(|w| kv.p[w * kv.kv_heads + h]).collect();
                    let zero_rule = select::select(
                        &b,
                        SelectionRule::Nosa,
                        &vec![0.0; nb],
                        &select::pool_blocks(&b, &p, nb),
                    );
                    if li == zero_layer {
                        assert_eq!(
                            seq.selections[li][h], zero_rule,
                            "layer {li} must follow its zeroed projection"
                        );
                    } else if seq.selections[li][h] != zero_rule {
                        other_departs += 1;
                    }
                }
            }
        }
        assert!(
            other_departs > 0,
            "the non-zeroed projection never changed its layer's selection"
        );
    }
}

/// A SparDA-style trainer checkpoint written by torch.save
/// (scripts/make_sparda_pt.py: model_state_dict beside optimizer state, one
/// tensor saved as a transposed view) imports to exactly the tensors of the
/// safetensors copy the same script wrote.
#[test]
fn sparda_pt_checkpoint_imports_like_its_safetensors_copy() {
    let cfg = Preset::Tiny.config();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let pt = ForecastWeights::open(&dir.join("sparda_tiny_forecast.pt"), &cfg).unwrap();
    let st = ForecastWeights::open(&dir.join("sparda_tiny_forecast.safetensors"), &cfg).unwrap();
    assert_eq!(pt.future, st.future);
    assert_eq!(pt.curr0, st.curr0);
    assert!(pt.curr0.iter().any(|&x| x != 0.0));
    // the raw reader keeps every matching tensor with its key path
    let all = sparda::model::torch_pt::read_tensors(&dir.join("sparda_tiny_forecast.pt"), |_| true)
        .unwrap();
    let names: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
    assert!(
        names.contains(&"model_state_dict.model.layers.1.self_attn.q_future_proj.weight"),
        "{names:?}"
    );
    assert!(
        names.contains(&"optimizer_state_dict.state.0.exp_avg"),
        "{names:?}"
    );
    // not a checkpoint: a clear error naming the file
    let err = sparda::model::torch_pt::read_tensors(
        &dir.join("sparda_tiny_forecast.safetensors"),
        |_| true,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("sparda_tiny_forecast.safetensors") && err.contains("zip"),
        "{err}"
    );
}
