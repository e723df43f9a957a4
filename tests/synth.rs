//! Synthetic checkpoints (presets of spec/nosa-model.md §1): validation,
//! determinism, weight scales, write → open round trip, sharding; and the
//! tokenizer a synthetic checkpoint carries (encode, decode, streaming).

mod common;
use common::TmpDir;
use std::path::{Path, PathBuf};

use serde_json::json;
use sparda::config::AttentionMode;
use sparda::synth::{self, Preset};
use sparda::tokenizer::Tokenizer;
use sparda::weights::{expected_tensors, names, names::LayerTensor, parameter_count, Checkpoint};
use sparda::Error;

/// GPT-2's byte → printable character map used by byte-level BPE.
fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        out[b as usize] = char::from_u32(c).unwrap();
    }
    out
}

/// A byte-level BPE tokenizer.json: ids 0–2 special (`<|endoftext|>`,
/// `<|im_start|>`, `<|im_end|>`), 3–258 the bytes, 259 "he", 260 "ll"; the
/// post-processor prepends `<|im_start|>`.
fn tokenizer_json(dir: &Path) -> PathBuf {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (i, s) in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
    {
        vocab.insert(s.to_string(), json!(i));
    }
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(3 + b));
    }
    vocab.insert("he".into(), json!(259));
    vocab.insert("ll".into(), json!(260));
    let added: Vec<_> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": ["h e", "l l"]
        }
    });
    let p = dir.join("tokenizer-src.json");
    std::fs::write(&p, tok.to_string()).unwrap();
    p
}

#[test]
fn presets_validate_and_match_the_spec_table() {
    for p in Preset::ALL {
        let c = p.config();
        c.validate(Path::new("<test>")).unwrap();
        assert_eq!(Preset::from_name(p.name()).unwrap(), p);
        assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        assert_eq!(c.bos_token_id, Some(synth::BOS_ID));
        assert_eq!(c.eos_token_ids, vec![synth::EOS_ID]);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.hidden_size % c.num_attention_heads, 0, "{p}");
    }
    let e = Preset::from_name("nosa-2b").unwrap_err().to_string();
    assert!(
        e.contains("nosa-2b") && e.contains("tiny") && e.contains("nosa-8b"),
        "{e}"
    );

    let t = Preset::Tiny.config();
    assert_eq!(
        (
            t.num_hidden_layers,
            t.hidden_size,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            t.intermediate_size,
            t.vocab_size
        ),
        (2, 192, 6, 2, 64, 512, 49_152)
    );
    assert_eq!(t.group_size(), 3);
    assert_eq!(t.max_position_embeddings, 32_768);
    let s = t.sparse.unwrap();
    assert_eq!(
        (s.window_blocks(), s.budget_blocks(), s.shortlist_blocks()),
        (2, 6, 5)
    );
    assert_eq!(s.budget_blocks() * s.block_size, 384);

    let c1 = Preset::Nosa1b.config();
    assert_eq!(
        (
            c1.num_hidden_layers,
            c1.hidden_size,
            c1.num_attention_heads,
            c1.num_key_value_heads,
            c1.head_dim
        ),
        (28, 2048, 16, 2, 128)
    );
    assert_eq!(
        (
            c1.intermediate_size,
            c1.vocab_size,
            c1.rope_theta,
            c1.max_position_embeddings
        ),
        (6144, 73_448, 10_000.0, 131_072)
    );
    assert_eq!(c1.rms_norm_eps, 1e-5);
    let c3 = Preset::Nosa3b.config();
    assert_eq!(
        (
            c3.num_hidden_layers,
            c3.hidden_size,
            c3.num_attention_heads,
            c3.head_dim,
            c3.intermediate_size
        ),
        (32, 2560, 32, 80, 6912)
    );
    assert_eq!(c3.group_size(), 16);
    let c8 = Preset::Nosa8b.config();
    assert_eq!(
        (
            c8.num_hidden_layers,
            c8.hidden_size,
            c8.head_dim,
            c8.intermediate_size
        ),
        (32, 4096, 128, 16_384)
    );
    assert_eq!(c8.rms_norm_eps, 1e-6);
    let mup = c8.mup.unwrap();
    assert_eq!(
        (mup.scale_emb, mup.scale_depth, mup.dim_model_base),
        (12.0, Some(1.4), 256.0)
    );
}

#[test]
fn nosa_8b_has_8_19_billion_parameters() {
    let c = Preset::Nosa8b.config();
    let n = parameter_count(&c, true);
    // 2·V·d + L·(2·d·H·D + 2·d·Hkv·D + 3·d·I + 2·d + Hkv + Hkv·Hkv·D) + d.
    assert_eq!(n, 8_185_270_336);
    assert!((n as f64 / 1e9 - 8.19).abs() < 0.005, "{n}");
    // Sanity on the others: ≈ 1.4 B and ≈ 3.3 B with untied 73,448-token embeddings.
    let n1 = parameter_count(&Preset::Nosa1b.config(), true) as f64 / 1e9;
    let n3 = parameter_count(&Preset::Nosa3b.config(), true) as f64 / 1e9;
    assert!((1.0..2.0).contains(&n1), "{n1}");
    assert!((2.5..4.0).contains(&n3), "{n3}");
}

#[test]
fn tiny_build_is_deterministic_per_seed() {
    let a = synth::build(Preset::Tiny, 7).unwrap();
    let b = synth::build(Preset::Tiny, 7).unwrap();
    let c = synth::build(Preset::Tiny, 8).unwrap();
    assert!(a.eviction_heads && !a.lm_head_tied);
    assert_eq!(a.attention_mode(), AttentionMode::Nosa);
    assert_eq!(a.store.names(), b.store.names());
    assert_eq!(a.store.len(), expected_tensors(&a.config, true).len());
    for name in a.store.names() {
        let (x, y, z) = (
            a.store.get(name).unwrap(),
            b.store.get(name).unwrap(),
            c.store.get(name).unwrap(),
        );
        assert_eq!(x.data, y.data, "{name}: same seed differs");
        assert_ne!(x.data, z.data, "{name}: different seeds agree");
    }
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / n;
    (m, var.sqrt())
}

#[test]
fn tiny_weight_scales() {
    let ck = synth::build(Preset::Tiny, 1).unwrap();
    let st = |n: &str| mean_std(&ck.store.to_f32(n).unwrap());
    let near = |got: f64, want: f64, tol: f64, what: &str| {
        assert!(
            (got - want).abs() <= tol * want.abs().max(1e-3),
            "{what}: {got} vs {want}"
        )
    };
    let (m, s) = st(&names::embed());
    near(s, 1.0, 0.02, "embed std");
    assert!(m.abs() < 0.01);
    let (_, s) = st(&names::layer(0, LayerTensor::QProj));
    near(s, 1.0 / 192f64.sqrt(), 0.03, "q std");
    let (_, s) = st(&names::layer(1, LayerTensor::OProj));
    near(s, 1.0 / 384f64.sqrt() / 2.0, 0.03, "o std");
    let (_, s) = st(&names::layer(1, LayerTensor::DownProj));
    near(s, 1.0 / 512f64.sqrt() / 2.0, 0.03, "down std");
    let (m, s) = st(&names::layer(0, LayerTensor::InputNorm));
    near(m, 1.0, 0.05, "norm mean");
    near(s, 0.1, 0.3, "norm std");
    let (_, s) = st(&names::lm_head());
    near(s, 1.0 / 192f64.sqrt(), 0.02, "lm_head std");
    let a = ck
        .store
        .to_f32(&names::layer(0, LayerTensor::EvictA))
        .unwrap();
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|&x| (-1.5..-0.5).contains(&x)), "{a:?}");
    let (_, s) = st(&names::layer(0, LayerTensor::EvictDelta));
    near(s, 1.0 / 128f64.sqrt(), 0.2, "delta std");
    for n in ck.store.names() {
        assert!(
            ck.store.to_f32(n).unwrap().iter().all(|x| x.is_finite()),
            "{n}"
        );
    }
}

#[test]
fn mup_scales_are_compensated() {
    // nosa-8b tensors at reduced shapes (never materialize the full model).
    let c = Preset::Nosa8b.config();
    let emb = synth::generate_tensor(&c, &names::embed(), &[64, 4096], 5);
    let (_, s) = mean_std(&emb.view().to_f32());
    assert!((s - 1.0 / 12.0).abs() < 0.002, "embed std {s}");
    let lm = synth::generate_tensor(&c, &names::lm_head(), &[64, 4096], 5);
    let (_, s) = mean_std(&lm.view().to_f32());
    assert!((s - 16.0 / 64.0).abs() < 0.004, "lm_head std {s}");
    // o_proj: 1/sqrt(H·D) / (sqrt(2L) · 1.4/sqrt(L)) = 1/64 / (1.4·sqrt 2).
    let o = synth::generate_tensor(&c, &names::layer(3, LayerTensor::OProj), &[64, 4096], 5);
    let (_, s) = mean_std(&o.view().to_f32());
    let want = 1.0 / 64.0 / (1.4 * 2f64.sqrt());
    assert!((s - want).abs() < 0.02 * want, "o_proj std {s} vs {want}");
    // Independent of thread count: a chunk's values depend only on seed, name and index.
    let emb2 = synth::generate_tensor(&c, &names::embed(), &[64, 4096], 5);
    assert_eq!(emb.data, emb2.data);
    let big = synth::generate_tensor(&c, &names::embed(), &[128, 4096], 5);
    assert_eq!(
        &big.data[..emb.data.len()],
        &emb.data[..],
        "a prefix of chunks is shape-independent"
    );
}

fn assert_same_tensors(a: &Checkpoint, b: &Checkpoint) {
    assert_eq!(a.store.names(), b.store.names());
    for name in a.store.names() {
        assert_eq!(
            a.store.get(name).unwrap(),
            b.store.get(name).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn tiny_write_then_open_round_trip() {
    let dir = TmpDir::new("synth-roundtrip");
    let tok = tokenizer_json(dir.path());
    let out = dir.path().join("tiny");
    synth::write(Preset::Tiny, 3, &out, &tok).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    assert!(!out.join("model.safetensors.index.json").exists());
    let opened = Checkpoint::open(&out).unwrap();
    let built = synth::build(Preset::Tiny, 3).unwrap();
    assert_eq!(opened.config, built.config);
    assert_eq!(opened.config, Preset::Tiny.config());
    assert!(opened.eviction_heads && !opened.lm_head_tied);
    assert_same_tensors(&opened, &built);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["sparse_config"]["window_size"], json!(128));
    assert_eq!(cfg["head_dim"], json!(64));
    let tp = opened.tokenizer_path().unwrap();
    let t = Tokenizer::from_file(&tp).unwrap();
    assert_eq!(t.token_to_id("<|im_end|>"), Some(synth::EOS_ID));
}

#[test]
fn sharded_write_round_trip() {
    let dir = TmpDir::new("synth-shards");
    let tok = tokenizer_json(dir.path());
    let out = dir.path().join("tiny-sharded");
    // Tiny is ≈ 40 MB: 8 MiB shards give several files; the 18.9 MB embedding gets its own.
    synth::write_config_sharded(&Preset::Tiny.config(), true, 11, &out, &tok, 8 << 20).unwrap();
    assert!(!out.join("model.safetensors").exists());
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let files: std::collections::BTreeSet<&str> = idx["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let first = *files.iter().next().unwrap();
    assert!(first.starts_with("model-00001-of-"), "{first}");
    let opened = Checkpoint::open(&out).unwrap();
    assert_eq!(opened.store.files().len(), files.len());
    assert_same_tensors(&opened, &synth::build(Preset::Tiny, 11).unwrap());
    assert_eq!(
        idx["metadata"]["total_size"].as_u64().unwrap() as usize,
        opened.store.total_bytes()
    );
}

#[test]
fn write_without_tokenizer_is_io_error_naming_it() {
    let dir = TmpDir::new("synth-notok");
    let missing = dir.path().join("no-such-tokenizer.json");
    let out = dir.path().join("out");
    match synth::write(Preset::Tiny, 1, &out, &missing) {
        Err(Error::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("{other:?}"),
    }
    assert!(
        !out.join("config.json").exists(),
        "nothing is written before the check"
    );
}

#[test]
fn tokenizer_encode_decode_and_errors() {
    let dir = TmpDir::new("synth-tok");
    let t = Tokenizer::from_file(tokenizer_json(dir.path())).unwrap();
    assert_eq!(t.vocab_size(), 261);
    assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
    let ids = t.encode("hello").unwrap();
    // BOS from the post-processor, then "he", "ll", "o".
    assert_eq!(ids, vec![1, 259, 260, 3 + b'o' as u32]);
    assert_eq!(t.decode(&ids).unwrap(), "<|im_start|>hello");
    assert_eq!(t.decode(&ids[1..]).unwrap(), "hello");
    // Missing file: Io naming it; invalid file: Tokenizer error naming it.
    let missing = dir.path().join("nope.json");
    match Tokenizer::from_file(&missing) {
        Err(Error::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("{other:?}"),
    }
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    match Tokenizer::from_file(&bad) {
        Err(e @ Error::Tokenizer { .. }) => assert!(e.to_string().contains("bad.json"), "{e}"),
        other => panic!("{other:?}"),
    }
    // An id outside the vocabulary does not panic.
    let _ = t.decode(&[100_000]);
}

#[test]
fn text_stream_holds_back_split_utf8_characters() {
    let dir = TmpDir::new("synth-stream");
    let t = Tokenizer::from_file(tokenizer_json(dir.path())).unwrap();
    let text = "héllo, 世界 🙂!";
    let ids = t.encode(text).unwrap();
    let ids = &ids[1..]; // drop BOS
                         // Every non-ASCII byte is its own token here: é = 2, 世 = 3, 🙂 = 4 tokens.
    assert_eq!(ids.len(), text.len() - 1, "{ids:?}"); // "he" merged
    let mut s = t.stream();
    let mut pieces = Vec::new();
    for &id in ids {
        pieces.push(s.push(id).unwrap());
    }
    pieces.push(s.finish().unwrap());
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    // "h" (no merge before é), then é's first byte holds back, its second completes "é".
    assert_eq!(pieces[0], "h");
    assert_eq!(pieces[1], "");
    assert_eq!(pieces[2], "é");
    // 🙂 (4 bytes): three empty pieces, then the character.
    let emoji_at = pieces.iter().position(|p| p.contains('🙂')).unwrap();
    assert_eq!(pieces[emoji_at], "🙂");
    assert_eq!(&pieces[emoji_at - 3..emoji_at], &["", "", ""]);
    assert_eq!(s.ids(), ids);
    // An unfinished character at the end comes out of finish() as U+FFFD.
    let mut s = t.stream();
    let e_ids = t.encode("é").unwrap();
    assert_eq!(s.push(e_ids[1]).unwrap(), "");
    assert_eq!(s.finish().unwrap(), "\u{FFFD}");
}
