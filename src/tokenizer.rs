//! `tokenizer.json` (Hugging Face `tokenizers`) and streaming detokenization.
//!
//! [`Tokenizer`] wraps the `tokenizers` crate and names the file in every
//! error. [`TextStream`] turns generated ids into text one id at a time,
//! holding back bytes of a UTF-8 character that a byte-level token split.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `path` (a `tokenizer.json`, or a directory holding one).
    ///
    /// # Errors
    /// [`Error::Io`] naming the path when the file is missing or unreadable;
    /// [`Error::Tokenizer`] naming it when the tokenizers crate rejects it:
    /// "not valid JSON", or "not a Hugging Face tokenizer.json" for JSON of
    /// another schema (e.g. a bare `{"vocab": …}`), with the crate's reason.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let path = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_bytes(&bytes, path)
    }

    /// Loads a `tokenizer.json` from its contents `bytes`; `path` names the
    /// file in this tokenizer's errors.
    ///
    /// The JSON is checked before the tokenizers crate reads it, and the
    /// post-processor and decoder after: tokenizers 0.22 panics, instead of
    /// returning an error, on malformed JSON inside the `decoder` value,
    /// while encoding with a post-processor its own builder would have
    /// refused (a template naming a special token it does not define, or
    /// `$B`), and while decoding with a `Strip` decoder whose `stop` is not 0.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming `path`, as in [`Tokenizer::from_file`];
    /// for a post-processor or decoder the crate would panic on, naming its
    /// key.
    pub fn from_bytes(bytes: &[u8], path: PathBuf) -> Result<Tokenizer> {
        let err = |msg: String| Error::Tokenizer {
            path: path.clone(),
            msg,
        };
        let json: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| err(why_not_a_tokenizer(&json, &e.to_string())))?;
        if let Some(pp) = json.get("post_processor") {
            check_post_processor(pp, "post_processor").map_err(err)?;
        }
        if let Some(d) = json.get("decoder") {
            check_decoder(d, "decoder").map_err(err)?;
        }
        Ok(Tokenizer { inner, path })
    }

    /// The file this tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            msg: msg.to_string(),
        }
    }

    /// Token ids of `text`, with the special tokens the tokenizer's
    /// post-processor adds (e.g. BOS), i.e. `add_special_tokens = true`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, true).map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included (`skip_special_tokens = false`).
    /// Bytes of an incomplete UTF-8 character decode to U+FFFD.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file (e.g. an id outside the vocabulary).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| self.err(e))
    }

    /// The id of token string `token` (added tokens included), if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of `id`, if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream::new(self)
    }
}

/// The reason the tokenizers crate rejected `json`, a `tokenizer.json`
/// (`crate_msg` is the crate's): JSON that is not a Hugging Face tokenizer
/// (no `model` object), naming the top-level keys it has, or the crate's
/// reason.
fn why_not_a_tokenizer(json: &serde_json::Value, crate_msg: &str) -> String {
    match json {
        serde_json::Value::Object(m) if !m.get("model").is_some_and(|v| v.is_object()) => {
            let keys: Vec<&str> = m.keys().map(String::as_str).take(10).collect();
            format!(
                "not a Hugging Face tokenizer.json: it has no `model` object (top-level keys: {}){}",
                if keys.is_empty() { "none".to_string() } else { keys.join(", ") },
                if m.len() > 10 { format!(", … and {} more", m.len() - 10) } else { String::new() }
            )
        }
        serde_json::Value::Object(_) => {
            format!("not a Hugging Face tokenizer.json: {crate_msg}")
        }
        _ => "not a Hugging Face tokenizer.json: the top level is not a JSON object".to_string(),
    }
}

/// Checks decoder `d` (JSON at key path `at`): tokenizers 0.22's `Strip`
/// decoder panics (a reversed slice range, or an index below 0) when it
/// decodes a short token made only of its `content` character and `stop`
/// is not 0, so only `stop` = 0 (what Llama-2 and Mistral tokenizers use)
/// is accepted. `Sequence` decoders are checked member by member.
fn check_decoder(d: &serde_json::Value, at: &str) -> std::result::Result<(), String> {
    use serde_json::Value;
    match d.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            let members = d.get("decoders").and_then(Value::as_array);
            for (i, m) in members.into_iter().flatten().enumerate() {
                check_decoder(m, &format!("{at}.decoders[{i}]"))?;
            }
        }
        Some("Strip") => {
            let stop = d.get("stop").and_then(Value::as_u64).unwrap_or(0);
            if stop != 0 {
                return Err(format!(
                    "{at}: a Strip decoder with stop = {stop} is not supported \
                     (tokenizers 0.22 panics decoding a token made only of its `content` character; stop must be 0)"
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Checks post-processor `pp` (JSON at key path `at`) as the tokenizers
/// crate's TemplateProcessing builder does, which its JSON reader skips:
/// the `single` template (the one encoding uses) may name only special
/// tokens of `special_tokens` and only the first sequence (`$A`);
/// otherwise encoding panics. `Sequence` post-processors are checked member
/// by member.
fn check_post_processor(pp: &serde_json::Value, at: &str) -> std::result::Result<(), String> {
    use serde_json::Value;
    fn list<'a>(v: &'a Value, k: &str) -> &'a [Value] {
        v.get(k)
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice)
    }
    match pp.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            for (i, p) in list(pp, "processors").iter().enumerate() {
                check_post_processor(p, &format!("{at}.processors[{i}]"))?;
            }
        }
        Some("TemplateProcessing") => {
            let specials = pp.get("special_tokens").and_then(Value::as_object);
            for (i, piece) in list(pp, "single").iter().enumerate() {
                let id = |kind: &str| piece.get(kind)?.get("id")?.as_str();
                if let Some(tok) = id("SpecialToken") {
                    if !specials.is_some_and(|m| m.contains_key(tok)) {
                        return Err(format!(
                            "{at}.single[{i}]: special token `{tok}` is not in {at}.special_tokens"
                        ));
                    }
                }
                if id("Sequence") == Some("B") {
                    return Err(format!(
                        "{at}.single[{i}]: the single-sequence template uses the second sequence $B"
                    ));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Streaming detokenizer: feed generated ids one at a time with
/// [`TextStream::push`]; each call returns the text completed by that id
/// (possibly empty). The concatenation of all returned pieces (plus
/// [`TextStream::finish`]) equals `decode(all ids)` for tokenizers whose
/// decoding is prefix-stable (byte-level BPE, SentencePiece).
///
/// Method: decode the ids since the last emitted point with and without the
/// newest; emit the difference unless it ends in U+FFFD (a character whose
/// bytes are not all generated yet), in which case hold it back. Started
/// with [`TextStream::with_prompt`], the decode window begins inside the
/// prompt, so that tokenizers whose decoders treat the start of a text
/// specially (SentencePiece's Metaspace and Strip decoders drop the leading
/// space of the first word) stream exactly decode(prompt + generated) minus
/// decode(prompt).
#[derive(Debug)]
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    /// Prompt ids kept as decoding context (never emitted), then every id pushed.
    ids: Vec<u32>,
    /// How many ids at the front of `ids` are prompt context.
    context: usize,
    /// Start of the decode window (a few ids of context before `emitted`).
    prefix: usize,
    /// Ids up to here have had their text emitted.
    emitted: usize,
}

impl<'a> TextStream<'a> {
    /// An empty stream over `tok`.
    pub fn new(tok: &'a Tokenizer) -> TextStream<'a> {
        TextStream {
            tok,
            ids: Vec::new(),
            context: 0,
            prefix: 0,
            emitted: 0,
        }
    }

    /// A stream that continues `prompt`: its last ids (up to
    /// [`PROMPT_CONTEXT_IDS`]) are decoding context, never emitted, so the
    /// first generated word keeps its leading space on every tokenizer family.
    pub fn with_prompt(tok: &'a Tokenizer, prompt: &[u32]) -> TextStream<'a> {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_IDS)..];
        TextStream {
            tok,
            ids: tail.to_vec(),
            context: tail.len(),
            prefix: 0,
            emitted: tail.len(),
        }
    }

    /// Every id pushed so far (the prompt context left out).
    pub fn ids(&self) -> &[u32] {
        &self.ids[self.context..]
    }

    /// Adds `id`; returns the newly completed text (empty while a UTF-8
    /// character is incomplete).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file when decoding fails (e.g. an id
    /// outside the vocabulary).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = self.tok.decode(&self.ids[self.prefix..self.emitted])?;
        let after = self.tok.decode(&self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let piece = suffix_after(&before, &after);
            self.prefix = self.emitted;
            self.emitted = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Flushes held-back text (an incomplete character comes out as U+FFFD).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the file when decoding fails.
    pub fn finish(&mut self) -> Result<String> {
        if self.emitted == self.ids.len() {
            return Ok(String::new());
        }
        let before = self.tok.decode(&self.ids[self.prefix..self.emitted])?;
        let after = self.tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.emitted;
        self.emitted = self.ids.len();
        Ok(suffix_after(&before, &after))
    }
}

/// Prompt ids a [`TextStream::with_prompt`] keeps as decoding context.
pub const PROMPT_CONTEXT_IDS: usize = 8;

/// The part of `after` beyond `before`: the plain suffix when `after` starts
/// with `before`, else everything after their longest common prefix (on a
/// character boundary).
fn suffix_after(before: &str, after: &str) -> String {
    if let Some(s) = after.strip_prefix(before) {
        return s.to_string();
    }
    let common = before
        .char_indices()
        .zip(after.chars())
        .take_while(|((_, a), b)| a == b)
        .last()
        .map_or(0, |((i, a), _)| i + a.len_utf8());
    after[common..].to_string()
}
