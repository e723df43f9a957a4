//! Prompt tokens for benchmark sequences: book text through a tokenizer,
//! each sequence at its own offset, else random ids.

use super::*;

/// The default directory of prompt texts: `../shared/data/texts` (the
/// team's books beside the checkout, several whole texts) when it holds a
/// `.txt`, else `data/texts` (the bundled one). Relative to `root`.
pub fn default_texts_dir(root: &Path) -> PathBuf {
    let shared = root.join("../shared/data/texts");
    let has_txt = std::fs::read_dir(&shared).is_ok_and(|d| {
        d.filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "txt"))
    });
    if has_txt {
        shared
    } else {
        root.join("data/texts")
    }
}

/// One text's tokens, for prompts.
pub(super) struct Book {
    /// File name (e.g. `hamlet.txt`).
    pub(super) name: String,
    /// Its tokens.
    pub(super) tokens: Vec<u32>,
}

/// Book tokens for prompts: every `.txt` under `dir`, encoded, one
/// [`Book`] each, sorted by name.
pub(super) fn book_tokens(tok: &Tokenizer, dir: &Path) -> Result<Vec<Book>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| Error::io(&f, e))?;
        let tokens = tok.encode(&text)?;
        if !tokens.is_empty() {
            out.push(Book {
                name: f
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                tokens,
            });
        }
    }
    if out.is_empty() {
        return Err(Error::Input(format!(
            "no .txt text under {} to take prompts from",
            dir.display()
        )));
    }
    Ok(out)
}

/// Where prompt tokens come from.
pub(super) enum Source {
    /// Real text: one or more books (runtime.md §5: each sequence a
    /// different text or offset).
    Books(Vec<Book>),
    /// Random ids (seed, vocabulary size).
    Random(u64, usize),
}

impl Source {
    /// Where sequence `b` of `batch` starts: book `b mod n` of the n books,
    /// and on it the k-th (k = b div n) of the ⌈batch/n⌉ sequences that
    /// share that book, at offset k·(book length / ⌈batch/n⌉). Returns the
    /// book index and the offset (random ids: (0, 0)).
    pub(super) fn origin(&self, b: usize, batch: usize) -> (usize, usize) {
        match self {
            Source::Books(books) if !books.is_empty() => {
                let n = books.len();
                let per_book = batch.max(1).div_ceil(n);
                let i = b % n;
                (i, (b / n) * (books[i].tokens.len() / per_book))
            }
            _ => (0, 0),
        }
    }
    /// `len` tokens for sequence `b` of `batch`: the book and offset of
    /// [`Source::origin`], wrapping around at the book's end; or random ids
    /// in 3 … V−1.
    pub(super) fn tokens(&self, b: usize, batch: usize, len: usize) -> Vec<u32> {
        match self {
            Source::Books(books) if !books.is_empty() => {
                let (i, off) = self.origin(b, batch);
                let t = &books[i].tokens;
                (0..len).map(|j| t[(off + j) % t.len()]).collect()
            }
            Source::Books(_) => vec![3; len],
            Source::Random(seed, vocab) => {
                let mut rng = SmallRng::seed_from_u64(seed.wrapping_add(b as u64 * 7919));
                (0..len)
                    .map(|_| rng.random_range(3..(*vocab).max(4) as u32))
                    .collect()
            }
        }
    }
    /// The text and offset of every sequence of a batch (for the report),
    /// or null for random ids.
    pub(super) fn origins_json(&self, batch: usize) -> Value {
        match self {
            Source::Books(books) if !books.is_empty() => Value::Array(
                (0..batch)
                    .map(|b| {
                        let (i, off) = self.origin(b, batch);
                        json!({"text": books[i].name, "offset": off, "text_tokens": books[i].tokens.len()})
                    })
                    .collect(),
            ),
            _ => Value::Null,
        }
    }
}
