//! config.json parsing, validation and RoPE tables (spec/nosa-model.md §1).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sparda::config::{AttentionMode, ModelConfig, RopeScaling, SparseConfig};
use sparda::Error;

const P: &str = "test/config.json";

/// A Llama-3.2-1B style config.
fn llama() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": 128256,
        "num_hidden_layers": 16,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"
        },
        "tie_word_embeddings": true,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16"
    })
}

/// A small MiniCPM4 style config (muP, LongRoPE), head dim 8.
fn minicpm() -> Value {
    json!({
        "model_type": "minicpm",
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": 1000,
        "num_hidden_layers": 32,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0],
            "original_max_position_embeddings": 32768
        },
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 256,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2
    })
}

fn parse(v: &Value) -> sparda::Result<ModelConfig> {
    ModelConfig::from_json_str(&v.to_string(), P)
}

fn with(mut v: Value, key: &str, val: Value) -> Value {
    v.as_object_mut().unwrap().insert(key.to_string(), val);
    v
}

fn without(mut v: Value, key: &str) -> Value {
    v.as_object_mut().unwrap().remove(key);
    v
}

/// The config error's field and message; panics if `r` is not a config error.
fn config_err(r: sparda::Result<ModelConfig>) -> (String, String) {
    match r {
        Err(e @ Error::Config { .. }) => {
            let text = e.to_string();
            let Error::Config { field, path, .. } = e else {
                unreachable!()
            };
            assert!(
                text.contains(&path.display().to_string()),
                "message names the file: {text}"
            );
            (field, text)
        }
        other => panic!("expected a config error, got {other:?}"),
    }
}

fn rel(a: f32, b: f64) -> f64 {
    ((a as f64 - b) / b).abs()
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "sparda-config-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn llama_style_config() {
    let c = parse(&llama()).unwrap();
    assert_eq!(c.hidden_size, 2048);
    assert_eq!(c.num_attention_heads, 32);
    assert_eq!(c.num_key_value_heads, 8);
    assert_eq!(c.group_size(), 4);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.intermediate_size, 8192);
    assert_eq!(c.rms_norm_eps, 1e-5f32);
    assert_eq!(c.vocab_size, 128256);
    assert_eq!(c.num_hidden_layers, 16);
    assert_eq!(c.max_position_embeddings, 131072);
    assert_eq!(c.rope_theta, 500000.0);
    assert!(c.tie_word_embeddings);
    assert!(!c.attention_bias && !c.mlp_bias);
    assert_eq!(c.bos_token_id, Some(128000));
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(c.mup, None);
    assert_eq!(c.sparse, None);
    assert_eq!(c.attention_mode(false), AttentionMode::Dense);
    assert_eq!(c.attention_mode(true), AttentionMode::Nosa);
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    assert_eq!(
        (c.embed_scale(), c.residual_scale(), c.logit_divisor()),
        (1.0, 1.0, 1.0)
    );
}

#[test]
fn defaults_for_optional_fields() {
    let v = without(
        without(
            without(without(llama(), "num_key_value_heads"), "rope_theta"),
            "tie_word_embeddings",
        ),
        "rope_scaling",
    );
    let v = without(
        without(without(v, "bos_token_id"), "eos_token_id"),
        "hidden_act",
    );
    let c = parse(&v).unwrap();
    assert_eq!(c.num_key_value_heads, 32);
    assert_eq!(c.rope_theta, 10000.0);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.rope_scaling, RopeScaling::Default);
    assert_eq!(c.bos_token_id, None);
    assert!(c.eos_token_ids.is_empty());
    // MiniCPM's config class ties by default.
    let m = parse(&without(minicpm(), "tie_word_embeddings")).unwrap();
    assert!(m.tie_word_embeddings);
}

#[test]
fn minicpm_mup_config() {
    let c = parse(&minicpm()).unwrap();
    let mup = c.mup.unwrap();
    assert_eq!(mup.scale_emb, 12.0);
    assert_eq!(mup.scale_depth, Some(1.4));
    assert_eq!(mup.dim_model_base, 256.0);
    assert_eq!(c.embed_scale(), 12.0);
    assert!((c.residual_scale() - 1.4 / 32f32.sqrt()).abs() < 1e-6);
    assert!((c.logit_divisor() - 64.0 / 256.0).abs() < 1e-7);
    assert_eq!(c.rms_norm_eps, 1e-6f32);
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.head_dim, 8);
}

#[test]
fn partial_mup_uses_no_op_defaults() {
    let v = without(without(minicpm(), "scale_depth"), "dim_model_base");
    let c = parse(&v).unwrap();
    let mup = c.mup.unwrap();
    assert_eq!(mup.scale_emb, 12.0);
    assert_eq!(mup.scale_depth, None);
    assert_eq!(mup.dim_model_base, 64.0);
    assert_eq!(c.residual_scale(), 1.0);
    assert_eq!(c.logit_divisor(), 1.0);
    let v = without(without(minicpm(), "scale_emb"), "dim_model_base");
    let c = parse(&v).unwrap();
    assert_eq!(c.embed_scale(), 1.0);
    assert!(c.mup.unwrap().scale_depth.is_some());
    let none = without(
        without(without(minicpm(), "scale_emb"), "dim_model_base"),
        "scale_depth",
    );
    assert_eq!(parse(&none).unwrap().mup, None);
}

#[test]
fn head_dim_override_wins() {
    let base = json!({
        "hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2,
        "intermediate_size": 512, "rms_norm_eps": 1e-5, "vocab_size": 100,
        "num_hidden_layers": 2, "max_position_embeddings": 4096
    });
    assert_eq!(parse(&base).unwrap().head_dim, 32);
    let c = parse(&with(base.clone(), "head_dim", json!(64))).unwrap();
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.rope().inv_freq(1).len(), 32);
    assert!((c.attn_scale() - 0.125).abs() < 1e-7);
    // d not divisible by H and no head_dim: error naming head_dim.
    let (field, msg) = config_err(parse(&with(base, "hidden_size", json!(190))));
    assert_eq!(field, "head_dim");
    assert!(msg.contains("190") && msg.contains('6'), "{msg}");
}

#[test]
fn default_rope_cos_sin_values() {
    let c = parse(&without(llama(), "rope_scaling")).unwrap();
    let rope = c.rope();
    let inv = rope.inv_freq(10);
    assert_eq!(inv.len(), 32);
    for i in [0usize, 1, 17, 31] {
        let want = 1.0 / 500000f64.powf(2.0 * i as f64 / 64.0);
        assert!(
            rel(inv[i], want) < 1e-6,
            "inv_freq[{i}] = {} want {want}",
            inv[i]
        );
    }
    let (mut cos, mut sin) = (vec![0.0f32; 32], vec![0.0f32; 32]);
    rope.cos_sin(1234, 1235, &mut cos, &mut sin);
    for i in [0usize, 5, 31] {
        let a = 1234.0 * inv[i] as f64;
        assert!((cos[i] as f64 - a.cos()).abs() < 1e-4, "cos[{i}]");
        assert!((sin[i] as f64 - a.sin()).abs() < 1e-4, "sin[{i}]");
    }
    assert_eq!(rope.attention_factor(), 1.0);
    // Position 0: cos 1, sin 0.
    rope.cos_sin(0, 1, &mut cos, &mut sin);
    assert!(cos.iter().all(|&x| x == 1.0) && sin.iter().all(|&x| x == 0.0));
}

#[test]
fn llama3_inv_freq_matches_hand_computed_values() {
    // θ 500000, D 64·2 = 128 through head_dim; factor 8, low 1, high 4, orig 8192.
    let v = with(llama(), "head_dim", json!(128));
    let v = with(
        v,
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}),
    );
    let c = parse(&v).unwrap();
    let inv = c.rope().inv_freq(1);
    assert_eq!(inv.len(), 64);
    // High frequency (wavelength < 2048): unchanged.
    assert!(rel(inv[0], 1.0) < 1e-7);
    assert!(rel(inv[10], 0.12868737343265052) < 1e-6);
    // Low frequency (wavelength > 8192): divided by the factor.
    assert!(rel(inv[63], 3.068925988914511e-07) < 1e-5);
    // Medium band: smoothed (values computed by hand in f64).
    assert!(rel(inv[29], 0.002166570763503359) < 1e-5, "{}", inv[29]);
    assert!(rel(inv[32], 0.0005248461609929547) < 1e-5, "{}", inv[32]);
    assert!(rel(inv[34], 0.00017850781276799638) < 1e-5, "{}", inv[34]);
}

#[test]
fn linear_and_dynamic_rope() {
    let v = with(
        llama(),
        "rope_scaling",
        json!({"type": "linear", "factor": 4.0}),
    );
    let c = parse(&v).unwrap();
    assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    let inv = c.rope().inv_freq(1);
    assert!(rel(inv[3], 1.0 / 500000f64.powf(6.0 / 64.0) / 4.0) < 1e-6);

    // Dynamic NTK, D 64, θ 10000, factor 2, max (= orig) 4096.
    let v = with(
        with(
            with(llama(), "rope_theta", json!(10000.0)),
            "max_position_embeddings",
            json!(4096),
        ),
        "rope_scaling",
        json!({"rope_type": "dynamic", "factor": 2.0}),
    );
    let c = parse(&v).unwrap();
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 4096
        }
    );
    let rope = c.rope();
    let short = rope.inv_freq(4096);
    assert!(rel(short[1], 1.0 / 10000f64.powf(2.0 / 64.0)) < 1e-6);
    // seq_len 10000: base = 10000·((2·10000/4096) − 1)^(64/62) = 40564.968…
    let long = rope.inv_freq(10000);
    assert!(rel(long[1], 0.7177864848979212) < 1e-5, "{}", long[1]);
    assert!(rel(long[5], 0.19053571060051644) < 1e-5, "{}", long[5]);
    let (mut cos, mut sin) = (vec![0.0; 32], vec![0.0; 32]);
    rope.cos_sin(9999, 10000, &mut cos, &mut sin);
    assert!((cos[1] as f64 - (9999.0 * long[1] as f64).cos()).abs() < 1e-3);
}

#[test]
fn longrope_short_vs_long_factors_and_attention_factor() {
    // max = orig: short factors, attention factor 1.
    let c = parse(&minicpm()).unwrap();
    let rope = c.rope();
    assert_eq!(rope.attention_factor(), 1.0);
    let inv = rope.inv_freq(1);
    let short = [1.0, 1.5, 2.0, 3.0];
    let long = [2.0, 4.0, 8.0, 16.0];
    for i in 0..4 {
        let plain = 1.0 / 10000f64.powf(2.0 * i as f64 / 8.0);
        assert!(rel(inv[i], plain / short[i]) < 1e-6, "short {i}");
    }
    // max > orig: long factors and √(1 + ln(4)/ln(32768)) = 1.0645812948447542.
    let c = parse(&with(minicpm(), "max_position_embeddings", json!(131072))).unwrap();
    let rope = c.rope();
    assert!(rel(rope.attention_factor(), 1.0645812948447542) < 1e-6);
    let inv = rope.inv_freq(10);
    for i in 0..4 {
        let plain = 1.0 / 10000f64.powf(2.0 * i as f64 / 8.0);
        assert!(rel(inv[i], plain / long[i]) < 1e-6, "long {i}");
    }
    // Chosen once per model: a short sequence still uses the long factors.
    let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
    rope.cos_sin(0, 1, &mut cos, &mut sin);
    assert!(rel(cos[0], 1.0645812948447542) < 1e-6);
    rope.cos_sin(100, 101, &mut cos, &mut sin);
    let a = 100.0 * inv[2] as f64;
    assert!((sin[2] as f64 - a.sin() * 1.0645812948447542).abs() < 1e-4);
    // `with_max_position` follows the same rule.
    let c2 = parse(&minicpm())
        .unwrap()
        .with_max_position(131072)
        .unwrap();
    assert_eq!(c2.rope().inv_freq(1), inv);
    assert_eq!(c2.max_position_embeddings, 131072);
    // `su` alias and the old `type` key.
    let mut v = minicpm();
    v["rope_scaling"]["type"] = json!("su");
    v["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("rope_type");
    assert!(matches!(
        parse(&v).unwrap().rope_scaling,
        RopeScaling::LongRope { .. }
    ));
    // A top-level original_max_position_embeddings (Phi-3 style) wins.
    let v = with(
        with(minicpm(), "original_max_position_embeddings", json!(4096)),
        "max_position_embeddings",
        json!(16384),
    );
    match parse(&v).unwrap().rope_scaling {
        RopeScaling::LongRope {
            original_max_position_embeddings,
            ..
        } => assert_eq!(original_max_position_embeddings, 4096),
        other => panic!("{other:?}"),
    }
}

#[test]
fn longrope_factor_length_must_be_half_head_dim() {
    let mut v = minicpm();
    v["rope_scaling"]["long_factor"] = json!([1.0, 2.0, 3.0]);
    let (field, msg) = config_err(parse(&v));
    assert_eq!(field, "rope_scaling.long_factor");
    assert!(
        msg.contains('3') && msg.contains('4') && msg.contains('8'),
        "{msg}"
    );
    let mut v = minicpm();
    v["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("short_factor");
    assert_eq!(config_err(parse(&v)).0, "rope_scaling.short_factor");
}

#[test]
fn rope_parameters_form_of_transformers_5() {
    let v = without(without(llama(), "rope_theta"), "rope_scaling");
    let v = with(
        v,
        "rope_parameters",
        json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    );
    let c = parse(&v).unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c, parse(&llama()).unwrap());
    let v = with(
        without(llama(), "rope_scaling"),
        "rope_parameters",
        json!({"rope_type": "default", "rope_theta": 1e6}),
    );
    let c = parse(&v).unwrap();
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.rope_scaling, RopeScaling::Default);
    let v = with(
        llama(),
        "rope_parameters",
        json!({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
    );
    let (field, msg) = config_err(parse(&v));
    assert_eq!(field, "rope_parameters.rope_type");
    assert!(msg.contains("yarn"), "{msg}");
}

#[test]
fn unknown_rope_type_is_named() {
    let v = with(
        llama(),
        "rope_scaling",
        json!({"rope_type": "ntk-by-parts", "factor": 2.0}),
    );
    let (field, msg) = config_err(parse(&v));
    assert_eq!(field, "rope_scaling.rope_type");
    assert!(msg.contains("ntk-by-parts"), "{msg}");
    let v = with(
        llama(),
        "rope_scaling",
        json!({"type": "yarn", "factor": 2.0}),
    );
    let (field, msg) = config_err(parse(&v));
    assert_eq!(field, "rope_scaling.type");
    assert!(msg.contains("yarn"), "{msg}");
}

#[test]
fn overrides_change_theta_and_limit() {
    let c = parse(&without(llama(), "rope_scaling"))
        .unwrap()
        .with_rope_theta(40000.0)
        .with_max_position(200_000)
        .unwrap();
    assert_eq!(c.rope_theta, 40000.0);
    assert_eq!(c.max_position_embeddings, 200_000);
    let inv = c.rope().inv_freq(1);
    assert!(rel(inv[1], 1.0 / 40000f64.powf(2.0 / 64.0)) < 1e-6);
}

#[test]
fn eos_list_and_generation_config() {
    let dir = tmpdir("gen");
    let v = with(
        with(llama(), "eos_token_id", json!(128001)),
        "bos_token_id",
        json!(128000),
    );
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
    let c = ModelConfig::from_file(&dir).unwrap();
    assert_eq!(c.eos_token_ids, vec![128001]);
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"bos_token_id": 128002, "eos_token_id": [128001, 128009]}"#,
    )
    .unwrap();
    let c = ModelConfig::from_file(dir.join("config.json")).unwrap();
    assert_eq!(c.eos_token_ids, vec![128001, 128009]);
    assert_eq!(c.bos_token_id, Some(128002));
    // An id outside the vocabulary in generation_config.json names that file.
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": 999999}"#,
    )
    .unwrap();
    let e = ModelConfig::from_file(&dir).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("generation_config.json") && msg.contains("999999") && msg.contains("128256"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_config_file_is_io_error_naming_path() {
    let dir = tmpdir("missing");
    let e = ModelConfig::from_file(&dir).unwrap_err();
    match &e {
        Error::Io { path, .. } => assert_eq!(path, &dir.join("config.json")),
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sparse_config_defaults_fill_missing_keys() {
    let c = parse(&with(llama(), "sparse_config", json!({}))).unwrap();
    assert_eq!(c.sparse, Some(SparseConfig::default()));
    assert_eq!(c.attention_mode(false), AttentionMode::InfLlmV2);
    let s = parse(&with(
        llama(),
        "sparse_config",
        json!({"topk": 80, "select_blocks": 24}),
    ))
    .unwrap()
    .sparse
    .unwrap();
    assert_eq!(
        s,
        SparseConfig {
            topk: 80,
            select_blocks: 24,
            ..SparseConfig::default()
        }
    );
    // SparDA NOSA-8B budget (spec §1 table): S 96, n 41.
    assert_eq!(s.budget_blocks(), 96);
    assert_eq!(s.shortlist_blocks(), 41);
    let d = SparseConfig::default();
    assert_eq!(
        (
            d.window_blocks(),
            d.budget_blocks(),
            d.shortlist_blocks(),
            d.windows_per_block()
        ),
        (16, 64, 33, 4)
    );
    assert_eq!(parse(&llama()).unwrap().sparse_or_default(), d);
    // null counts as absent.
    assert_eq!(
        parse(&with(llama(), "sparse_config", Value::Null))
            .unwrap()
            .sparse,
        None
    );
}

fn sparse_err(s: Value) -> (String, String) {
    config_err(parse(&with(llama(), "sparse_config", s)))
}

#[test]
fn sparse_config_validation_errors_name_field_and_numbers() {
    let (f, m) = sparse_err(json!({"kernel_size": 30}));
    assert_eq!(f, "sparse_config.kernel_size");
    assert!(
        m.contains("30") && m.contains("16") && m.contains("32"),
        "{m}"
    );

    let (f, m) = sparse_err(json!({"kernel_size": 48, "kernel_stride": 24}));
    assert_eq!(f, "sparse_config.block_size");
    assert!(m.contains("24") && m.contains("64"), "{m}");

    let (f, m) = sparse_err(json!({"window_size": 1000}));
    assert_eq!(f, "sparse_config.window_size");
    assert!(m.contains("1000") && m.contains("64"), "{m}");

    let (f, m) = sparse_err(json!({"select_blocks": 0}));
    assert_eq!(f, "sparse_config.select_blocks");
    assert!(m.contains('0'), "{m}");

    let (f, m) = sparse_err(json!({"topk": 10}));
    assert_eq!(f, "sparse_config.topk");
    assert!(
        m.contains("17") && m.contains("10") && m.contains("16"),
        "{m}"
    );

    let (f, _) = sparse_err(json!({"kernel_stride": 0, "kernel_size": 0}));
    assert_eq!(f, "sparse_config.kernel_stride");

    let (f, m) = sparse_err(json!({"init_blocks": -1}));
    assert_eq!(f, "sparse_config.init_blocks");
    assert!(m.contains("-1"), "{m}");

    // Offload rule: dense_len ≤ S·block_size = 64·64 = 4096.
    let s = SparseConfig {
        dense_len: 5000,
        ..SparseConfig::default()
    };
    assert!(s.validate(Path::new(P)).is_ok());
    let e = s.validate_offload(Path::new(P)).unwrap_err();
    let m = e.to_string();
    assert!(matches!(&e, Error::Config { field, .. } if field == "sparse_config.dense_len"));
    assert!(m.contains("5000") && m.contains("4096"), "{m}");
    assert!(SparseConfig {
        dense_len: 4096,
        ..s
    }
    .validate_offload(Path::new(P))
    .is_ok());
}

#[test]
fn malformed_json_reports_serde_message_and_line() {
    let text = "{\n  \"hidden_size\": 64,\n  \"num_attention_heads\": 8,,\n}";
    let (field, msg) = config_err(ModelConfig::from_json_str(text, P));
    assert_eq!(field, "<json>");
    assert!(msg.contains("line 3"), "{msg}");
    let (_, msg) = config_err(ModelConfig::from_json_str("[1, 2]", P));
    assert!(msg.contains("object"), "{msg}");
}

#[test]
fn missing_required_field_is_named() {
    for key in [
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
    ] {
        let (field, msg) = config_err(parse(&without(llama(), key)));
        assert_eq!(field, key);
        assert!(msg.contains("missing"), "{msg}");
    }
    // Wrong type.
    let (field, msg) = config_err(parse(&with(llama(), "hidden_size", json!("2048"))));
    assert_eq!(field, "hidden_size");
    assert!(msg.contains("2048"), "{msg}");
}

#[test]
fn basic_consistency_checks() {
    let (f, m) = config_err(parse(&with(llama(), "num_key_value_heads", json!(5))));
    assert_eq!(f, "num_key_value_heads");
    assert!(m.contains("32") && m.contains('5'), "{m}");
    let (f, m) = config_err(parse(&with(llama(), "hidden_act", json!("gelu"))));
    assert_eq!(f, "hidden_act");
    assert!(m.contains("gelu"), "{m}");
    assert!(parse(&with(llama(), "hidden_act", json!("swish"))).is_ok());
    let (f, _) = config_err(parse(&with(llama(), "num_hidden_layers", json!(0))));
    assert_eq!(f, "num_hidden_layers");
    let (f, _) = config_err(parse(&with(llama(), "head_dim", json!(63))));
    assert_eq!(f, "head_dim");
    let (f, m) = config_err(parse(&with(
        llama(),
        "eos_token_id",
        json!([128001, 200000]),
    )));
    assert_eq!(f, "eos_token_id");
    assert!(m.contains("200000") && m.contains("128256"), "{m}");
    let (f, _) = config_err(parse(&with(
        llama(),
        "rope_scaling",
        json!({"rope_type": "linear", "factor": -2.0}),
    )));
    assert_eq!(f, "rope_scaling.factor");
    let (f, _) = config_err(parse(&with(llama(), "rms_norm_eps", json!(0.0))));
    assert_eq!(f, "rms_norm_eps");
}

#[test]
fn json_round_trip() {
    for v in [
        llama(),
        minicpm(),
        with(
            llama(),
            "sparse_config",
            json!({"topk": 80, "select_blocks": 24, "dense_len": 512}),
        ),
    ] {
        let c = parse(&v).unwrap();
        let back = ModelConfig::from_json_str(&c.to_json_value().to_string(), P).unwrap();
        assert_eq!(back, c);
        c.validate(Path::new(P)).unwrap();
    }
    let v = parse(&llama()).unwrap().to_json_value();
    assert_eq!(v["rms_norm_eps"], json!(1e-5));
    assert_eq!(v["rope_scaling"]["rope_type"], json!("llama3"));
}

#[test]
fn active_sliding_window_is_refused_by_name() {
    // Mistral style: a window smaller than the context.
    let v = with(llama(), "sliding_window", json!(64));
    let (field, msg) = config_err(parse(&v));
    assert_eq!(field, "sliding_window");
    assert_eq!(
        msg,
        "test/config.json: field `sliding_window`: sliding-window attention is not implemented: \
         sliding_window = 64 < max_position_embeddings = 131072 (null, or a value ≥ \
         max_position_embeddings, or use_sliding_window = false means full attention)"
    );
    // Not a number: a type error naming the field.
    let (field, _) = config_err(parse(&with(llama(), "sliding_window", json!("64"))));
    assert_eq!(field, "sliding_window");
    // No effect: null, a window covering the whole context, or switched off
    // (Qwen2 style).
    for v in [
        with(llama(), "sliding_window", Value::Null),
        with(llama(), "sliding_window", json!(131072)),
        with(llama(), "sliding_window", json!(200000)),
        with(
            with(llama(), "sliding_window", json!(4096)),
            "use_sliding_window",
            json!(false),
        ),
    ] {
        let c = parse(&v).unwrap();
        assert_eq!(c.max_position_embeddings, 131072);
        assert_eq!(c.hidden_size, 2048);
    }
    // use_sliding_window true keeps the refusal.
    let v = with(
        with(llama(), "sliding_window", json!(4096)),
        "use_sliding_window",
        json!(true),
    );
    assert_eq!(config_err(parse(&v)).0, "sliding_window");
    // A window that covers the context stays covering it: --max-position
    // past it is refused with both numbers, up to it is fine; a window
    // switched off never limits it.
    let c = parse(&with(llama(), "sliding_window", json!(131072))).unwrap();
    assert_eq!(c.sliding_window, Some(131072));
    let e = c.clone().with_max_position(262144).unwrap_err().to_string();
    assert!(
        e.contains("--max-position 262144") && e.contains("sliding_window = 131072"),
        "{e}"
    );
    assert_eq!(
        c.with_max_position(65536).unwrap().max_position_embeddings,
        65536
    );
    let off = with(
        with(llama(), "sliding_window", json!(4096)),
        "use_sliding_window",
        json!(false),
    );
    let c = parse(&off).unwrap();
    assert_eq!(c.sliding_window, None);
    assert_eq!(
        c.with_max_position(262144).unwrap().max_position_embeddings,
        262144
    );
}

#[test]
fn unseen_model_type_and_architecture_load_with_a_warning() {
    use sparda::config::architecture_warning;
    let p = Path::new(P);
    // Known names (and none at all) give no warning.
    assert_eq!(
        architecture_warning(p, Some("llama"), &["LlamaForCausalLM".into()]),
        None
    );
    assert_eq!(
        architecture_warning(p, Some("minicpm"), &["MiniCPMForCausalLM".into()]),
        None
    );
    assert_eq!(
        architecture_warning(p, Some("mistral"), &["MistralForCausalLM".into()]),
        None
    );
    assert_eq!(architecture_warning(p, None, &[]), None);
    // Unseen names are listed in one line.
    assert_eq!(
        architecture_warning(p, Some("nosa"), &["NOSAForCausalLM".into()]).as_deref(),
        Some(
            "test/config.json: model_type `nosa` and architectures [NOSAForCausalLM] not seen by \
             this runtime (it knows model_type llama, mistral, minicpm and architectures \
             LlamaForCausalLM, MistralForCausalLM, MiniCPMForCausalLM); loading it as a \
             Llama-layout model"
        )
    );
    assert_eq!(
        architecture_warning(p, Some("llama"), &["LlamaForCausalLM".into(), "Foo".into()])
            .as_deref(),
        Some(
            "test/config.json: architectures [Foo] not seen by this runtime (it knows model_type \
             llama, mistral, minicpm and architectures LlamaForCausalLM, MistralForCausalLM, \
             MiniCPMForCausalLM); loading it as a Llama-layout model"
        )
    );
    // Such a config is not refused: it parses to the same config as a llama one.
    let v = with(
        with(llama(), "model_type", json!("nosa")),
        "architectures",
        json!(["NOSAForCausalLM"]),
    );
    assert_eq!(parse(&v).unwrap(), parse(&llama()).unwrap());
}

/// A positive value that is 0 or infinite once rounded to f32 (the
/// precision the runtime computes in) is refused, naming the key and both
/// values; the smallest positive f32 is still accepted. (Found by fuzzing:
/// `rms_norm_eps` 1e-75 was accepted and ran as 0.)
#[test]
fn positive_values_must_survive_rounding_to_f32() {
    let (f, m) = config_err(parse(&with(llama(), "rms_norm_eps", json!(1e-75))));
    assert_eq!(f, "rms_norm_eps");
    assert_eq!(
        m,
        "test/config.json: field `rms_norm_eps`: 1e-75 is 0 in f32, the precision the runtime computes in (positive finite f32 values: 1e-45 to 3.4028235e38)"
    );
    for (key, v, in_f32) in [
        ("scale_emb", 1e50, "inf"),
        ("scale_depth", 1e-60, "0"),
        ("dim_model_base", 1e300, "inf"),
    ] {
        let (f, m) = config_err(parse(&with(minicpm(), key, json!(v))));
        assert_eq!(f, key);
        assert!(m.contains(&format!(" is {in_f32} in f32")), "{m}");
    }
    let c = parse(&with(llama(), "rms_norm_eps", json!(1e-45))).unwrap();
    assert_eq!(c.rms_norm_eps, f32::from_bits(1));
    c.validate(Path::new(P)).unwrap();
}

/// JSON numbers are read correctly rounded, so a config written and read
/// back equals the one read. (Found by fuzzing: a llama3
/// `high_freq_factor` of 4.4444444444444444e23 came back one ulp larger.)
#[test]
fn float_fields_read_back_exactly() {
    let v = with(
        llama(),
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.4444444444444444e23, "original_max_position_embeddings": 8192}),
    );
    let c = parse(&v).unwrap();
    let RopeScaling::Llama3 {
        high_freq_factor, ..
    } = c.rope_scaling
    else {
        panic!("{:?}", c.rope_scaling)
    };
    assert_eq!(
        high_freq_factor.to_bits(),
        4.4444444444444444e23f64.to_bits()
    );
    c.validate(Path::new(P)).unwrap();
    let text = c.to_json_value().to_string();
    assert!(text.contains("4.4444444444444444e+23"), "{text}");
}

/// Sparse settings whose arithmetic would overflow are refused with the
/// numbers instead of overflowing. (Found by fuzzing: kernel_stride
/// 11111111111111111116 overflowed 2·kernel_stride.)
#[test]
fn sparse_settings_that_overflow_are_refused() {
    let (f, m) = sparse_err(json!({"kernel_stride": 11111111111111111116u64}));
    assert_eq!(f, "sparse_config.kernel_size");
    assert!(
        m.ends_with("kernel_size = 32 must equal 2·kernel_stride = 2·11111111111111111116 = 22222222222222222232"),
        "{m}"
    );
    let (f, m) = sparse_err(json!({"init_blocks": u64::MAX, "select_blocks": 2, "topk": 10}));
    assert_eq!(f, "sparse_config.topk");
    assert!(
        m.contains("= 18446744073709551615 + 2 = 18446744073709551617 exceeds topk = 10"),
        "{m}"
    );
    let (f, m) = sparse_err(json!({"topk": u64::MAX / 64}));
    assert_eq!(f, "sparse_config.topk");
    assert!(
        m.ends_with(
            "(288230376151711743 + 16) · 64 = 18446744073709552576 tokens does not fit in usize"
        ),
        "{m}"
    );
}
