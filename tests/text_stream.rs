//! Streamed text equals decode(prompt + generated) minus decode(prompt) for
//! every tokenizer family the runtime meets: byte-level BPE (SmolLM2, GPT-2,
//! Llama-3), SentencePiece with a Metaspace decoder, and SentencePiece with
//! byte fallback and a Strip decoder (Llama-2, Mistral, MiniCPM). The two
//! SentencePiece tokenizers are written here as small tokenizer.json files;
//! the byte-level one is the SmolLM2 fixture's.

use sparda::tokenizer::{TextStream, Tokenizer};

/// Single-character vocabulary (no merges: one token per character) plus
/// the SentencePiece word marker and, for byte fallback, `<0xNN>` tokens.
fn vocab(byte_fallback: bool) -> serde_json::Value {
    let mut v = serde_json::Map::new();
    let mut add = |t: String| {
        let n = v.len();
        v.entry(t).or_insert(serde_json::json!(n));
    };
    add("<unk>".into());
    add("▁".into());
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,.'!?".chars() {
        add(c.to_string());
    }
    if byte_fallback {
        for b in 0..=255u8 {
            add(format!("<0x{b:02X}>"));
        }
    }
    serde_json::Value::Object(v)
}

fn bpe(byte_fallback: bool) -> serde_json::Value {
    serde_json::json!({"type": "BPE", "dropout": null, "unk_token": "<unk>",
        "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
        "byte_fallback": byte_fallback, "ignore_merges": false,
        "vocab": vocab(byte_fallback), "merges": []})
}

/// Metaspace pre-tokenizer and decoder (the first word's marker is dropped
/// at the start of a text).
fn metaspace() -> serde_json::Value {
    serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
        "post_processor": null,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
        "model": bpe(false)})
}

/// Llama-2 style: prepend ▁ and replace spaces in the normalizer; decode by
/// ▁ → space, byte fallback, fuse, and strip one leading space.
fn byte_fallback() -> serde_json::Value {
    serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": bpe(true)})
}

fn write(dir: &std::path::Path, name: &str, v: &serde_json::Value) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(v).unwrap()).unwrap();
    p
}

/// Streams `generated` after `prompt`; returns (streamed, expected).
fn stream(tok: &Tokenizer, prompt: &[u32], generated: &[u32]) -> (String, String) {
    let mut s = TextStream::with_prompt(tok, prompt);
    let mut out = String::new();
    for &id in generated {
        out.push_str(&s.push(id).unwrap());
    }
    out.push_str(&s.finish().unwrap());
    assert_eq!(s.ids(), generated, "ids() leaves the prompt context out");
    let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let full = tok.decode(&all).unwrap();
    let head = tok.decode(prompt).unwrap();
    let want = full
        .strip_prefix(&head)
        .expect("prefix-stable decoding")
        .to_string();
    (out, want)
}

#[test]
fn streamed_text_equals_the_decoded_continuation_for_every_tokenizer_family() {
    let dir = std::env::temp_dir().join(format!("sparda-text-stream-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/.fixtures/smollm2-135m-instruct/tokenizer.json"
    );
    let families = [
        ("byte-level BPE", std::path::PathBuf::from(fixture)),
        ("Metaspace", write(&dir, "metaspace.json", &metaspace())),
        (
            "byte fallback",
            write(&dir, "byte_fallback.json", &byte_fallback()),
        ),
    ];
    for (family, path) in &families {
        let tok = Tokenizer::from_file(path).unwrap();
        for (prompt, cont) in [
            ("Hello", " world, it's me."),
            ("The answer is", " forty two!"),
            ("naïve", " café, déjà vu"),
        ] {
            let p = tok.encode(prompt).unwrap();
            let all = tok.encode(&format!("{prompt}{cont}")).unwrap();
            assert!(
                all.starts_with(&p),
                "{family}: {prompt:?} tokenizes as a prefix"
            );
            let (got, want) = stream(&tok, &p, &all[p.len()..]);
            assert_eq!(got, want, "{family}: {prompt:?} + {cont:?}");
            assert!(
                got.starts_with(' '),
                "{family}: the first word keeps its space: {got:?}"
            );
        }
    }
    // Without the prompt as context, the SentencePiece decoders drop the space.
    let tok = Tokenizer::from_file(&families[1].1).unwrap();
    let p = tok.encode("Hello").unwrap();
    let all = tok.encode("Hello world").unwrap();
    let mut bare = TextStream::new(&tok);
    let text: String = all[p.len()..]
        .iter()
        .map(|&id| bare.push(id).unwrap())
        .collect();
    assert_eq!(text, "world", "the old behaviour this guards against");
    std::fs::remove_dir_all(&dir).ok();
}
