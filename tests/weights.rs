//! Safetensors loading (single, sharded, in memory), dtype conversion and
//! checkpoint validation (spec/nosa-model.md §2).

mod common;
use common::TmpDir;
use std::path::Path;

use serde_json::json;
use sparda::config::{AttentionMode, ModelConfig};
use sparda::cpu::{CpuModel, EngineOptions, Logits, Phase};
use sparda::weights::{
    expected_tensors, names, names::LayerTensor, unused_tensors_warning, write_safetensors,
    Checkpoint, DType, OwnedTensor, TensorStore,
};
use sparda::Error;

/// L 2, d 8, H 2 / Hkv 1, D 4, I 16, V 10.
fn small_config(tie: bool, attention_bias: bool, mlp_bias: bool) -> serde_json::Value {
    json!({
        "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "rms_norm_eps": 1e-5, "vocab_size": 10, "num_hidden_layers": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": tie,
        "attention_bias": attention_bias, "mlp_bias": mlp_bias
    })
}

fn cfg_of(v: &serde_json::Value) -> ModelConfig {
    ModelConfig::from_json_str(&v.to_string(), "test/config.json").unwrap()
}

/// Every expected tensor, bf16, values i·0.25 − 1 (cycling).
fn tensors_for(cfg: &ModelConfig, eviction: bool) -> Vec<OwnedTensor> {
    expected_tensors(cfg, eviction)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = (0..n).map(|i| (i % 9) as f32 * 0.25 - 1.0).collect();
            OwnedTensor::from_f32(name, shape, &vals, DType::BF16).unwrap()
        })
        .collect()
}

fn write_config(dir: &Path, v: &serde_json::Value) {
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
}

fn checkpoint_msg(r: sparda::Result<Checkpoint>) -> String {
    match r {
        Err(e @ Error::Checkpoint { .. }) => e.to_string(),
        Err(other) => panic!("expected a checkpoint error, got {other:?}"),
        Ok(_) => panic!("expected a checkpoint error, got Ok"),
    }
}

#[test]
fn single_file_dtype_conversion() {
    let dir = TmpDir::new("weights-dtypes");
    let vals = [1.5f32, -2.25, 0.0078125, 29952.0, -0.0, 65280.0];
    let f32v = [0.1f32, -1.0e-20, 3.4e38, 7.0, 1.0 / 3.0, -123.456];
    let ts = vec![
        OwnedTensor::from_f32("a.bf16", vec![2, 3], &vals, DType::BF16).unwrap(),
        OwnedTensor::from_f32("b.f16", vec![3, 2], &vals, DType::F16).unwrap(),
        OwnedTensor::from_f32("c.f32", vec![6], &f32v, DType::F32).unwrap(),
        // A value bf16 must round: 1 + 2^-9 → 1 (nearest even), 1 + 3·2^-9 → 1 + 2^-7.
        OwnedTensor::from_f32(
            "d.round",
            vec![2],
            &[1.0 + 1.0 / 512.0, 1.0 + 3.0 / 512.0],
            DType::BF16,
        )
        .unwrap(),
    ];
    let file = dir.path().join("model.safetensors");
    write_safetensors(&file, &ts).unwrap();
    let store = TensorStore::open(dir.path()).unwrap();
    assert_eq!(store.names(), vec!["a.bf16", "b.f16", "c.f32", "d.round"]);
    assert_eq!(store.len(), 4);
    assert_eq!(store.files(), vec![file.as_path()]);
    assert_eq!(store.total_bytes(), 12 + 12 + 24 + 4);
    let a = store.get("a.bf16").unwrap();
    assert_eq!(
        (a.dtype, a.shape.clone(), a.numel()),
        (DType::BF16, vec![2, 3], 6)
    );
    assert_eq!(a.to_f32(), vals.to_vec());
    assert_eq!(store.to_f32("b.f16").unwrap(), vals.to_vec());
    assert_eq!(store.info("b.f16").unwrap(), (DType::F16, &[3usize, 2][..]));
    assert_eq!(store.to_f32("c.f32").unwrap(), f32v.to_vec());
    assert_eq!(
        store.to_f32("d.round").unwrap(),
        vec![1.0, 1.0 + 1.0 / 128.0]
    );
    // bf16 view of f32 data rounds; of bf16 data is exact.
    let b = store.to_bf16("c.f32").unwrap();
    assert_eq!(b[3].to_f32(), 7.0);
    assert_eq!(store.to_bf16("a.bf16").unwrap()[1].to_f32(), -2.25);
    let mut out = vec![0.0f32; 6];
    store.get("c.f32").unwrap().to_f32_into(&mut out).unwrap();
    assert_eq!(out, f32v.to_vec());
    assert!(store
        .get("c.f32")
        .unwrap()
        .to_f32_into(&mut [0.0; 5])
        .is_err());
    // Missing tensor: error names it.
    let e = store.to_f32("nope").unwrap_err().to_string();
    assert!(e.contains("nope"), "{e}");
    // Opening the file path directly works too.
    assert_eq!(TensorStore::open(&file).unwrap().names().len(), 4);
}

#[test]
fn in_memory_store() {
    let t = OwnedTensor::from_f32("x", vec![2], &[1.0, 2.0], DType::F32).unwrap();
    let store = TensorStore::from_tensors(vec![t.clone()]);
    assert_eq!(store.get("x").unwrap(), t.view());
    assert!(store.files().is_empty());
    assert!(OwnedTensor::from_f32("y", vec![3], &[1.0], DType::BF16).is_err());
}

#[test]
fn single_file_checkpoint_opens() {
    let dir = TmpDir::new("weights-single");
    let v = small_config(false, false, false);
    write_config(dir.path(), &v);
    let cfg = cfg_of(&v);
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &tensors_for(&cfg, false),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(!ck.eviction_heads);
    assert!(!ck.lm_head_tied);
    assert_eq!(ck.lm_head_name(), "lm_head.weight");
    assert_eq!(ck.attention_mode(), AttentionMode::Dense);
    assert_eq!(ck.dir.as_deref(), Some(dir.path()));
    assert_eq!(ck.store.len(), expected_tensors(&cfg, false).len());
    // 1 embed + 2·9 per layer + norm + lm_head.
    assert_eq!(ck.store.len(), 1 + 2 * 9 + 1 + 1);
    let q = ck.store.get(&names::layer(1, LayerTensor::QProj)).unwrap();
    assert_eq!(q.shape, vec![8, 8]);
    assert_eq!(&q.to_f32()[..3], &[-1.0, -0.75, -0.5]);
    // No tokenizer.json: Io error naming the path.
    match ck.tokenizer_path() {
        Err(Error::Io { path, .. }) => assert_eq!(path, dir.path().join("tokenizer.json")),
        other => panic!("{other:?}"),
    }
}

fn write_sharded(
    dir: &Path,
    tensors: &[OwnedTensor],
    split: usize,
) -> serde_json::Map<String, serde_json::Value> {
    let (a, b) = tensors.split_at(split);
    write_safetensors(&dir.join("model-00001-of-00002.safetensors"), a).unwrap();
    write_safetensors(&dir.join("model-00002-of-00002.safetensors"), b).unwrap();
    let mut map = serde_json::Map::new();
    for t in a {
        map.insert(t.name.clone(), json!("model-00001-of-00002.safetensors"));
    }
    for t in b {
        map.insert(t.name.clone(), json!("model-00002-of-00002.safetensors"));
    }
    map
}

fn write_index(dir: &Path, map: &serde_json::Map<String, serde_json::Value>) {
    let idx = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), idx.to_string()).unwrap();
}

#[test]
fn sharded_checkpoint_opens() {
    let dir = TmpDir::new("weights-sharded");
    let v = small_config(true, false, false);
    write_config(dir.path(), &v);
    let cfg = cfg_of(&v);
    let ts = tensors_for(&cfg, true);
    let map = write_sharded(dir.path(), &ts, 7);
    write_index(dir.path(), &map);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(ck.eviction_heads);
    assert!(ck.lm_head_tied);
    assert_eq!(ck.lm_head_name(), "model.embed_tokens.weight");
    assert_eq!(ck.attention_mode(), AttentionMode::Nosa);
    assert_eq!(ck.store.files().len(), 2);
    for t in &ts {
        assert_eq!(ck.store.get(&t.name).unwrap(), t.view(), "{}", t.name);
    }
}

#[test]
fn missing_index_shard_is_io_error_naming_it() {
    let dir = TmpDir::new("weights-missing-shard");
    let v = small_config(false, false, false);
    write_config(dir.path(), &v);
    let ts = tensors_for(&cfg_of(&v), false);
    let map = write_sharded(dir.path(), &ts, 5);
    write_index(dir.path(), &map);
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    match Checkpoint::open(dir.path()) {
        Err(Error::Io { path, .. }) => {
            assert_eq!(path, dir.path().join("model-00002-of-00002.safetensors"))
        }
        other => panic!("{other:?}"),
    }
}

/// A shard the index names must be a plain file name in the checkpoint
/// directory: a path, `..`, `.` and the empty name are refused naming the
/// index, the tensor and the name. (Found by fuzzing: the empty name was
/// accepted and opened the directory itself.)
#[test]
fn index_shard_names_must_be_plain_file_names() {
    let dir = TmpDir::new("weights-shard-names");
    let v = small_config(false, false, false);
    write_config(dir.path(), &v);
    let ts = tensors_for(&cfg_of(&v), false);
    for bad in [
        "",
        ".",
        "..",
        "../model.safetensors",
        "sub/model.safetensors",
        "a\\b",
        "shard/",
    ] {
        let mut map = write_sharded(dir.path(), &ts, 5);
        map.insert(names::final_norm(), json!(bad));
        write_index(dir.path(), &map);
        let msg = checkpoint_msg(Checkpoint::open(dir.path()));
        assert!(
            msg.ends_with(&format!(
                "model.safetensors.index.json: weight_map[model.norm.weight]: file `{bad}` must be a plain file name"
            )),
            "{msg}"
        );
    }
}

#[test]
fn index_pointing_at_wrong_shard_is_error() {
    let dir = TmpDir::new("weights-wrong-shard");
    let v = small_config(false, false, false);
    write_config(dir.path(), &v);
    let ts = tensors_for(&cfg_of(&v), false);
    let mut map = write_sharded(dir.path(), &ts, 5);
    map.insert(
        names::final_norm(),
        json!("model-00001-of-00002.safetensors"),
    );
    write_index(dir.path(), &map);
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert!(
        msg.contains("model.norm.weight") && msg.contains("model-00001-of-00002.safetensors"),
        "{msg}"
    );
    // Malformed index JSON names the index.
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"weight_map\": ",
    )
    .unwrap();
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert!(msg.contains("model.safetensors.index.json"), "{msg}");
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{}").unwrap();
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert!(msg.contains("weight_map"), "{msg}");
}

#[test]
fn corrupted_safetensors_header_is_error_naming_file() {
    let dir = TmpDir::new("weights-corrupt");
    let v = small_config(false, false, false);
    write_config(dir.path(), &v);
    let file = dir.path().join("model.safetensors");
    // Header length claims more bytes than the file has.
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"a\":");
    std::fs::write(&file, &bytes).unwrap();
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert!(
        msg.contains(&file.display().to_string()) && msg.contains("malformed"),
        "{msg}"
    );
    // Valid length, invalid JSON.
    let header = b"{\"a\": {\"dtype\": \"BF16\", ";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(&file, &bytes).unwrap();
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert!(msg.contains(&file.display().to_string()), "{msg}");
    // Truncated data: a valid file minus its last bytes.
    let good = TmpDir::new("weights-corrupt-good");
    let t = OwnedTensor::from_f32("x", vec![4], &[1.0, 2.0, 3.0, 4.0], DType::F32).unwrap();
    write_safetensors(&good.path().join("model.safetensors"), &[t]).unwrap();
    let full = std::fs::read(good.path().join("model.safetensors")).unwrap();
    std::fs::write(&file, &full[..full.len() - 3]).unwrap();
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert!(
        msg.ends_with(
            "tensor x: data_offsets [0, 16] out of range: need begin ≤ end ≤ 13 \
             (the data section's size); is the file truncated?"
        ),
        "{msg}"
    );
    // Empty file.
    std::fs::write(&file, b"").unwrap();
    let _ = checkpoint_msg(Checkpoint::open(dir.path()));
}

#[test]
fn unsupported_dtype_names_tensor_and_dtype() {
    let dir = TmpDir::new("weights-dtype");
    let header = br#"{"pos_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 16]);
    std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
    let e = TensorStore::open(dir.path()).unwrap_err();
    assert!(matches!(e, Error::Checkpoint { .. }));
    let msg = e.to_string();
    assert!(msg.contains("pos_ids") && msg.contains("I64"), "{msg}");
}

#[test]
fn missing_files_are_io_errors_naming_path() {
    let dir = TmpDir::new("weights-nofiles");
    match Checkpoint::open(dir.path()) {
        Err(Error::Io { path, .. }) => assert_eq!(path, dir.path().join("config.json")),
        other => panic!("{other:?}"),
    }
    write_config(dir.path(), &small_config(false, false, false));
    match Checkpoint::open(dir.path()) {
        Err(Error::Io { path, .. }) => assert_eq!(path, dir.path().join("model.safetensors")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn tied_and_untied_lm_head_rules() {
    // Tied, no lm_head: the embedding is used.
    let cfg = cfg_of(&small_config(true, false, false));
    let ts = tensors_for(&cfg, false);
    assert!(!ts.iter().any(|t| t.name == "lm_head.weight"));
    let ck = Checkpoint::from_parts(cfg.clone(), TensorStore::from_tensors(ts.clone())).unwrap();
    assert!(ck.lm_head_tied);
    // Tied with a different lm_head present: accepted (warning), embedding used.
    let mut with_lm = ts.clone();
    with_lm.push(
        OwnedTensor::from_f32("lm_head.weight", vec![10, 8], &[0.5; 80], DType::BF16).unwrap(),
    );
    let ck = Checkpoint::from_parts(cfg.clone(), TensorStore::from_tensors(with_lm)).unwrap();
    assert!(ck.lm_head_tied);
    assert_eq!(ck.lm_head_name(), names::embed());
    // Untied without lm_head: error naming it.
    let untied = cfg_of(&small_config(false, false, false));
    let msg = checkpoint_msg(Checkpoint::from_parts(
        untied.clone(),
        TensorStore::from_tensors(ts),
    ));
    assert!(
        msg.contains("lm_head.weight") && msg.contains("tie_word_embeddings"),
        "{msg}"
    );
    assert!(msg.contains("[10, 8]"), "{msg}");
    // Untied with lm_head: fine.
    let ck = Checkpoint::from_parts(
        untied.clone(),
        TensorStore::from_tensors(tensors_for(&untied, false)),
    )
    .unwrap();
    assert!(!ck.lm_head_tied);
}

#[test]
fn one_error_lists_missing_unexpected_and_misshaped() {
    let cfg = cfg_of(&small_config(false, false, false));
    let mut ts = tensors_for(&cfg, false);
    let q1 = names::layer(1, LayerTensor::QProj);
    let k0 = names::layer(0, LayerTensor::KProj);
    let up0 = names::layer(0, LayerTensor::UpProj);
    ts.retain(|t| t.name != q1 && t.name != k0);
    for t in ts.iter_mut() {
        if t.name == up0 {
            *t = OwnedTensor::from_f32(up0.clone(), vec![8, 16], &[0.0; 128], DType::BF16).unwrap();
        }
    }
    // A bias the config does not enable and a layer past num_hidden_layers
    // would change the output: fatal, not ignored.
    ts.push(
        OwnedTensor::from_f32(
            names::layer(0, LayerTensor::QBias),
            vec![8],
            &[0.0; 8],
            DType::BF16,
        )
        .unwrap(),
    );
    ts.push(
        OwnedTensor::from_f32(
            names::layer(2, LayerTensor::InputNorm),
            vec![8],
            &[1.0; 8],
            DType::F16,
        )
        .unwrap(),
    );
    // Unknown extras are only ignored (with a warning).
    ts.push(
        OwnedTensor::from_f32(
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            vec![2],
            &[1.0, 0.5],
            DType::F32,
        )
        .unwrap(),
    );
    let msg = checkpoint_msg(Checkpoint::from_parts(cfg, TensorStore::from_tensors(ts)));
    for needle in [
        "(5 problem lines)",
        "missing: model.layers.1.self_attn.q_proj.weight (expected shape [8, 8])",
        "missing: model.layers.0.self_attn.k_proj.weight (expected shape [4, 8])",
        "mis-shaped: model.layers.0.mlp.up_proj.weight: expected [16, 8], found [8, 16]",
        "unexpected: model.layers.0.self_attn.q_proj.bias (shape [8], BF16; the config does not use it",
        "unexpected: model.layers.2.input_layernorm.weight (shape [8], F16;",
    ] {
        assert!(msg.contains(needle), "missing line `{needle}` in:\n{msg}");
    }
    assert!(!msg.contains("inv_freq"), "{msg}");
    assert!(msg.contains("<memory>"), "{msg}");
}

/// Checkpoint of a larger model than config.json says: every tensor is
/// mis-shaped, and the error lists the first 10 lines then "… and N more".
#[test]
fn many_mismatches_list_ten_lines_and_a_count() {
    let cfg = cfg_of(&small_config(false, false, false));
    let mut bigger = small_config(false, false, false);
    bigger["hidden_size"] = json!(16);
    bigger["num_attention_heads"] = json!(4);
    let big = cfg_of(&bigger);
    let msg = checkpoint_msg(Checkpoint::from_parts(
        cfg.clone(),
        TensorStore::from_tensors(tensors_for(&big, false)),
    ));
    // 2 layers × 9 tensors + embed + norm + lm_head, all mis-shaped.
    let n = expected_tensors(&cfg, false).len();
    assert_eq!(n, 21);
    assert!(msg.contains(&format!("({n} problem lines)")), "{msg}");
    assert!(
        msg.contains("mis-shaped: model.embed_tokens.weight: expected [10, 8], found [10, 16]"),
        "{msg}"
    );
    assert_eq!(msg.matches("mis-shaped: ").count(), 10, "{msg}");
    assert!(msg.ends_with(&format!("\n… and {} more", n - 10)), "{msg}");
}

/// A config.json naming more layers than the weights hold gets one line with
/// both counts, not a line per tensor of every missing layer. (Found by
/// fuzzing: num_hidden_layers = 278238685388 built names for every missing
/// tensor, without end.)
#[test]
fn layers_past_the_weights_are_one_line() {
    let cfg = cfg_of(&small_config(false, false, false));
    let mut huge = small_config(false, false, false);
    huge["num_hidden_layers"] = json!(278238685388u64);
    let msg = checkpoint_msg(Checkpoint::from_parts(
        cfg_of(&huge),
        TensorStore::from_tensors(tensors_for(&cfg, false)),
    ));
    assert!(msg.contains("(1 problem lines)"), "{msg}");
    assert!(
        msg.ends_with(
            "num_hidden_layers = 278238685388, but the weights hold tensors of layers 0 … 1 only: \
             layers 2 … 278238685387 are missing"
        ),
        "{msg}"
    );
    let msg = checkpoint_msg(Checkpoint::from_parts(
        cfg_of(&huge),
        TensorStore::from_tensors(Vec::new()),
    ));
    assert!(
        msg.contains(
            "num_hidden_layers = 278238685388, but the weights hold no layer tensor (model.layers.N.…)"
        ),
        "{msg}"
    );
    // and the lm_head hint, then embedding, final norm and lm_head missing
    assert!(msg.contains("(5 problem lines)"), "{msg}");
    assert!(
        msg.contains("missing: model.norm.weight (expected shape [8])"),
        "{msg}"
    );
}

fn logits_of(ck: &Checkpoint) -> Vec<f32> {
    let m = CpuModel::new(ck, EngineOptions::default()).unwrap();
    let mut seq = m.new_sequence();
    m.forward(
        &mut seq,
        &[1, 7, 3, 9, 0],
        Phase::Prefill { prompt_len: 5 },
        Logits::All,
    )
    .unwrap()
}

#[test]
fn extra_tensors_are_ignored_listed_and_leave_logits_unchanged() {
    let cfg = cfg_of(&small_config(false, false, false));
    let plain = TmpDir::new("weights-extra-plain");
    let extra = TmpDir::new("weights-extra");
    for d in [&plain, &extra] {
        write_config(d.path(), &small_config(false, false, false));
    }
    let ts = tensors_for(&cfg, false);
    write_safetensors(&plain.path().join("model.safetensors"), &ts).unwrap();
    let mut with_extra = ts.clone();
    with_extra
        .push(OwnedTensor::from_f32("model.extra_empty", vec![0, 8], &[], DType::BF16).unwrap());
    for l in 0..2 {
        with_extra.push(
            OwnedTensor::from_f32(
                format!("model.layers.{l}.self_attn.rotary_emb.inv_freq"),
                vec![2],
                &[1.0, 0.01],
                DType::F32,
            )
            .unwrap(),
        );
    }
    // Forecast projections saved beside the weights.
    with_extra.push(
        OwnedTensor::from_f32(
            names::layer(0, LayerTensor::QFutureProj),
            vec![4, 8],
            &[0.5; 32],
            DType::BF16,
        )
        .unwrap(),
    );
    write_safetensors(&extra.path().join("model.safetensors"), &with_extra).unwrap();

    let a = Checkpoint::open(plain.path()).unwrap();
    let b = Checkpoint::open(extra.path()).unwrap();
    assert!(a.unused_tensors.is_empty());
    assert_eq!(
        b.unused_tensors,
        vec![
            "model.extra_empty",
            "model.layers.0.self_attn.q_future_proj.weight",
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            "model.layers.1.self_attn.rotary_emb.inv_freq",
        ]
    );
    assert_eq!(b.store.info("model.extra_empty").unwrap().1, &[0, 8]);
    let (la, lb) = (logits_of(&a), logits_of(&b));
    assert_eq!(la.len(), 5 * 10);
    assert!(la.iter().all(|x| x.is_finite()));
    assert_eq!(la, lb);

    let w = unused_tensors_warning(extra.path(), &b.unused_tensors);
    assert_eq!(
        w,
        format!(
            "{}: ignoring 4 tensors the model does not use: model.extra_empty, \
             model.layers.0.self_attn.q_future_proj.weight, \
             model.layers.0.self_attn.rotary_emb.inv_freq, \
             model.layers.1.self_attn.rotary_emb.inv_freq",
            extra.path().display()
        )
    );
    // Past 10 names the warning counts the rest.
    let many: Vec<String> = (0..13).map(|i| format!("t{i}")).collect();
    assert_eq!(
        unused_tensors_warning(Path::new("m"), &many),
        "m: ignoring 13 tensors the model does not use: t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, … and 3 more"
    );
}

#[test]
fn eviction_heads_in_some_layers_only() {
    let cfg = cfg_of(&small_config(false, false, false));
    // Layer 0 has them, layer 1 does not: missing in layer 1.
    let mut ts = tensors_for(&cfg, true);
    ts.retain(|t| {
        !t.name.starts_with("model.layers.1.self_attn.A")
            && !t.name.starts_with("model.layers.1.self_attn.delta")
    });
    let msg = checkpoint_msg(Checkpoint::from_parts(
        cfg.clone(),
        TensorStore::from_tensors(ts),
    ));
    assert!(msg.contains("layers [1] lack it"), "{msg}");
    assert!(
        msg.contains("missing: model.layers.1.self_attn.A (expected shape [1])"),
        "{msg}"
    );
    assert!(
        msg.contains("missing: model.layers.1.self_attn.delta.weight (expected shape [1, 4])"),
        "{msg}"
    );
    // Layer 1 has them, layer 0 does not: unexpected in layer 1.
    let mut ts = tensors_for(&cfg, true);
    ts.retain(|t| {
        !t.name.starts_with("model.layers.0.self_attn.A")
            && !t.name.starts_with("model.layers.0.self_attn.delta")
    });
    let msg = checkpoint_msg(Checkpoint::from_parts(
        cfg.clone(),
        TensorStore::from_tensors(ts),
    ));
    assert!(
        msg.contains("layer 0 has no self_attn.A but layers [1] do"),
        "{msg}"
    );
    assert!(
        msg.contains("unexpected: model.layers.1.self_attn.A"),
        "{msg}"
    );
    // Mis-shaped A.
    let mut ts = tensors_for(&cfg, true);
    let a1 = names::layer(1, LayerTensor::EvictA);
    for t in ts.iter_mut() {
        if t.name == a1 {
            *t = OwnedTensor::from_f32(a1.clone(), vec![2], &[-1.0, -1.0], DType::F32).unwrap();
        }
    }
    let msg = checkpoint_msg(Checkpoint::from_parts(cfg, TensorStore::from_tensors(ts)));
    assert!(
        msg.contains("mis-shaped: model.layers.1.self_attn.A: expected [1], found [2]"),
        "{msg}"
    );
}

#[test]
fn expected_tensors_with_biases_and_eviction_heads() {
    let cfg = cfg_of(&small_config(false, true, true));
    let exp = expected_tensors(&cfg, true);
    let get = |n: &str| {
        exp.iter()
            .find(|(name, _)| name == n)
            .map(|(_, s)| s.clone())
    };
    assert_eq!(get("model.embed_tokens.weight"), Some(vec![10, 8]));
    assert_eq!(get("lm_head.weight"), Some(vec![10, 8]));
    assert_eq!(get("model.norm.weight"), Some(vec![8]));
    assert_eq!(
        get("model.layers.1.self_attn.q_proj.weight"),
        Some(vec![8, 8])
    );
    assert_eq!(get("model.layers.1.self_attn.q_proj.bias"), Some(vec![8]));
    assert_eq!(get("model.layers.1.self_attn.k_proj.bias"), Some(vec![4]));
    assert_eq!(
        get("model.layers.1.self_attn.o_proj.weight"),
        Some(vec![8, 8])
    );
    assert_eq!(get("model.layers.1.self_attn.o_proj.bias"), Some(vec![8]));
    assert_eq!(get("model.layers.0.self_attn.A"), Some(vec![1]));
    assert_eq!(
        get("model.layers.0.self_attn.delta.weight"),
        Some(vec![1, 4])
    );
    assert_eq!(get("model.layers.0.self_attn.delta.bias"), Some(vec![1]));
    assert_eq!(get("model.layers.0.mlp.gate_proj.bias"), Some(vec![16]));
    assert_eq!(
        get("model.layers.0.mlp.down_proj.weight"),
        Some(vec![8, 16])
    );
    assert_eq!(get("model.layers.0.mlp.down_proj.bias"), Some(vec![8]));
    // 1 + 2·(5 + 4 + 3 + 4 + 3) + 1 + 1.
    assert_eq!(exp.len(), 1 + 2 * 19 + 2);
    let plain = expected_tensors(&cfg_of(&small_config(true, false, false)), false);
    assert_eq!(plain.len(), 1 + 2 * 9 + 1);
    assert!(!plain
        .iter()
        .any(|(n, _)| n.contains("bias") || n.contains("self_attn.A") || n == "lm_head.weight"));
    // The full set validates, with the eviction bias required.
    let ck = Checkpoint::from_parts(
        cfg.clone(),
        TensorStore::from_tensors(tensors_for(&cfg, true)),
    )
    .unwrap();
    assert!(ck.eviction_heads);
    let mut ts = tensors_for(&cfg, true);
    ts.retain(|t| t.name != "model.layers.1.self_attn.delta.bias");
    let msg = checkpoint_msg(Checkpoint::from_parts(cfg, TensorStore::from_tensors(ts)));
    assert!(
        msg.contains("missing: model.layers.1.self_attn.delta.bias"),
        "{msg}"
    );
    // Forecast names (separate file) come from the same table.
    assert_eq!(
        names::layer(3, LayerTensor::QFutureProj),
        "model.layers.3.self_attn.q_future_proj.weight"
    );
    assert_eq!(
        names::layer(0, LayerTensor::QCurrProj),
        "model.layers.0.self_attn.q_curr_proj.weight"
    );
}

fn raw_safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn store_msg(dir: &Path) -> String {
    match TensorStore::open(dir) {
        Err(e @ Error::Checkpoint { .. }) => e.to_string(),
        Err(other) => panic!("expected a checkpoint error, got {other:?}"),
        Ok(_) => panic!("expected a checkpoint error, got Ok"),
    }
}

#[test]
fn git_lfs_pointer_is_named_with_how_to_fetch_the_file() {
    let dir = TmpDir::new("weights-lfs");
    write_config(dir.path(), &small_config(false, false, false));
    let file = dir.path().join("model.safetensors");
    let pointer = "version https://git-lfs.github.com/spec/v1\n\
                   oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n\
                   size 269060552\n";
    std::fs::write(&file, pointer).unwrap();
    let msg = checkpoint_msg(Checkpoint::open(dir.path()));
    assert_eq!(
        msg,
        format!(
            "{}: this is a Git LFS pointer file ({} bytes; the real file is 269060552 bytes), \
             not the safetensors weights: run `git lfs pull` in the checkpoint's clone \
             (after `git lfs install`), or download the file from the Hugging Face hub \
             (e.g. `huggingface-cli download`)",
            file.display(),
            pointer.len()
        )
    );
    assert!(!msg.contains("too large"), "{msg}");
}

#[test]
fn malformed_headers_name_the_file_key_and_rule() {
    let dir = TmpDir::new("weights-bad-header");
    let file = dir.path().join("model.safetensors");
    let f = file.display().to_string();

    // __metadata__ values must be strings.
    let h = r#"{"__metadata__":{"format":"pt","step":1000},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    std::fs::write(&file, raw_safetensors(h, &[0u8; 8])).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!(
            "{f}: header key `__metadata__`.`step`: metadata values must be strings, found a number `1000`"
        )
    );

    // An unknown dtype.
    let h = r#"{"x":{"dtype":"BF32","shape":[2],"data_offsets":[0,8]}}"#;
    std::fs::write(&file, raw_safetensors(h, &[0u8; 8])).unwrap();
    let msg = store_msg(dir.path());
    assert!(
        msg.starts_with(&format!(
            "{f}: tensor x: unknown dtype `BF32` (safetensors dtypes: BOOL, U8,"
        )),
        "{msg}"
    );
    assert!(msg.ends_with("supported: BF16, F16, F32)"), "{msg}");

    // Offsets past the data section (8 bytes here).
    let h = r#"{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    std::fs::write(&file, raw_safetensors(h, &[0u8; 8])).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!(
            "{f}: tensor x: data_offsets [0, 16] out of range: need begin ≤ end ≤ 8 \
             (the data section's size); is the file truncated?"
        )
    );

    // Offsets that do not match the shape, and a non-integer shape: both listed.
    let h = r#"{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]},"b":{"dtype":"F16","shape":[-1],"data_offsets":[4,8]}}"#;
    std::fs::write(&file, raw_safetensors(h, &[0u8; 8])).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!(
            "{f}: tensor a: data_offsets [0, 4] hold 4 bytes, but shape [3] of BF16 needs 6\n\
             tensor b: `shape` must be an array of non-negative integers, found [-1]"
        )
    );

    // The tensors must tile the data section: a gap, an overlap and
    // trailing bytes are each named with their offsets.
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    std::fs::write(&file, raw_safetensors(h, &[0u8; 16])).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!(
            "{f}: data bytes [4, 8) belong to no tensor (a gap before tensor b)\n\
             the data section has 4 bytes after the last tensor's end at 12 (of 16)"
        )
    );
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    std::fs::write(&file, raw_safetensors(h, &[0u8; 8])).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!("{f}: tensors a [0, 8] and b [4, 8] overlap")
    );

    // A header length past the end of the file (what an LFS pointer used to
    // be reported as) gives both numbers.
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"a\":");
    std::fs::write(&file, &bytes).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!(
            "{f}: malformed safetensors file: the header length field says 1000 bytes, but only 5 bytes follow it"
        )
    );

    // A header that is JSON but not an object.
    std::fs::write(&file, raw_safetensors("[1, 2]", &[])).unwrap();
    assert_eq!(
        store_msg(dir.path()),
        format!(
            "{f}: malformed safetensors file: the header is JSON but not an object (found an array)"
        )
    );
}

#[test]
fn the_layer_tensor_list_names_each_tensor_once() {
    use sparda::weights::names::LayerTensor;
    let suffixes: std::collections::HashSet<&str> =
        LayerTensor::ALL.iter().map(|t| t.suffix()).collect();
    assert_eq!(suffixes.len(), LayerTensor::ALL.len());
    assert!(suffixes.contains("self_attn.delta.bias") && suffixes.contains("mlp.down_proj.bias"));
}
