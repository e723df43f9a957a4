//! tokenizer.json files on which the tokenizers crate panics (while loading
//! or while encoding) are refused at load with an error naming the file and
//! the key. (Found by fuzzing; the inputs are in
//! fuzz/regressions/tokenizer_json/.)

use serde_json::{json, Value};
use sparda::tokenizer::Tokenizer;
use sparda::Error;

/// A word-level tokenizer (vocabulary `<unk>`, `<s>`, `a`) with post-processor `pp`.
fn with_post_processor(pp: Value) -> Value {
    json!({
        "version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
        "post_processor": pp, "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "<unk>", "vocab": {"<unk>": 0, "<s>": 1, "a": 2}}
    })
}

fn template(single: Value, special_tokens: Value) -> Value {
    with_post_processor(json!({
        "type": "TemplateProcessing", "single": single,
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": special_tokens
    }))
}

fn load_err(text: &str) -> String {
    match Tokenizer::from_bytes(text.as_bytes(), "dir/tokenizer.json".into()) {
        Err(e @ Error::Tokenizer { .. }) => e.to_string(),
        other => panic!("expected a tokenizer error, got {other:?}"),
    }
}

#[test]
fn a_valid_template_encodes() {
    let t = template(
        json!([{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]),
        json!({"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}),
    );
    let tok = Tokenizer::from_bytes(t.to_string().as_bytes(), "tokenizer.json".into()).unwrap();
    assert_eq!(tok.encode("a").unwrap(), vec![1, 2]);
}

#[test]
fn template_naming_an_undefined_special_token_is_refused() {
    let t = template(
        json!([{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]),
        json!({}),
    );
    assert_eq!(
        load_err(&t.to_string()),
        "dir/tokenizer.json: tokenizer: post_processor.single[0]: special token `<s>` is not in post_processor.special_tokens"
    );
    // inside a Sequence post-processor too
    let seq = with_post_processor(json!({"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        t["post_processor"].clone()
    ]}));
    assert_eq!(
        load_err(&seq.to_string()),
        "dir/tokenizer.json: tokenizer: post_processor.processors[1].single[0]: special token `<s>` is not in \
         post_processor.processors[1].special_tokens"
    );
}

#[test]
fn single_template_with_the_second_sequence_is_refused() {
    let t = template(
        json!([{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}]),
        json!({}),
    );
    assert_eq!(
        load_err(&t.to_string()),
        "dir/tokenizer.json: tokenizer: post_processor.single[1]: the single-sequence template uses the second sequence $B"
    );
}

/// Malformed JSON inside `decoder` made tokenizers 0.22 panic
/// (`expect("Helper")`); the JSON is now checked first.
#[test]
fn malformed_json_inside_the_decoder_is_a_json_error() {
    let good = with_post_processor(Value::Null).to_string();
    let bad = good.replace(r#""decoder":null"#, r#""decoder":{"type":"Fuse","x":1.}"#);
    assert_ne!(bad, good);
    let msg = load_err(&bad);
    assert!(
        msg.starts_with(
            "dir/tokenizer.json: tokenizer: not valid JSON: invalid number at line 1 column"
        ),
        "{msg}"
    );
}

/// tokenizers 0.22's Strip decoder panics decoding a token made only of its
/// `content` character when `stop` ≥ 1 (a reversed slice range); such a
/// decoder is refused at load, also inside a Sequence. `stop` = 0, the
/// Llama-2 / Mistral setting, loads and decodes.
#[test]
fn strip_decoder_with_a_stop_is_refused() {
    let with_decoder = |d: Value| {
        let mut t = with_post_processor(Value::Null);
        t["decoder"] = d;
        t.to_string()
    };
    let strip = |stop: u64| json!({"type": "Strip", "content": " ", "start": 1, "stop": stop});
    assert_eq!(
        load_err(&with_decoder(strip(1))),
        "dir/tokenizer.json: tokenizer: decoder: a Strip decoder with stop = 1 is not supported \
         (tokenizers 0.22 panics decoding a token made only of its `content` character; stop must be 0)"
    );
    let seq = json!({"type": "Sequence", "decoders": [{"type": "Fuse"}, strip(2)]});
    assert!(load_err(&with_decoder(seq)).starts_with(
        "dir/tokenizer.json: tokenizer: decoder.decoders[1]: a Strip decoder with stop = 2"
    ));
    let tok = Tokenizer::from_bytes(with_decoder(strip(0)).as_bytes(), "t.json".into()).unwrap();
    assert_eq!(tok.decode(&[2, 1]).unwrap(), "a<s>");
}
