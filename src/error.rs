//! The crate's error type. Every variant names the file, field, tensor or limit
//! involved and the numbers, so that bad input never turns into a panic or
//! silently wrong output (DEVELOPERS.md, "Bad input").

use std::path::PathBuf;

/// All errors of sparda-rt.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` (or `generation_config.json`) is malformed or inconsistent.
    /// `field` is the JSON key at fault (e.g. `sparse_config.kernel_size`).
    #[error("{path}: field `{field}`: {msg}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The offending key.
        field: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// The weights do not match the config: missing, unexpected or mis-shaped
    /// tensors (all listed in one message), unreadable or malformed
    /// safetensors (a Git LFS pointer included), bad dtype.
    #[error("{path}: {msg}")]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// Every problem found, one per line.
        msg: String,
    },
    /// `tokenizer.json` could not be loaded, or text could not be encoded/decoded.
    #[error("{path}: tokenizer: {msg}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizers crate's message.
        msg: String,
    },
    /// A request exceeds a limit of the model or the machine (context length,
    /// memory), with the numbers.
    #[error("limit exceeded: {0}")]
    Limit(String),
    /// Invalid user input (CLI flags, prompt, sampling parameters).
    #[error("invalid input: {0}")]
    Input(String),
    /// The CUDA backend is unavailable or failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// A logits row that a token is chosen from holds a NaN, a +∞, or no
    /// finite value (every entry −∞): the model or a kernel broke, and no
    /// token can be chosen ([`crate::sample::check_logits`], the rule the
    /// CPU, the GPU argmax and sampling kernels and the perplexity scoring
    /// share). The fields say where, as far as the reporter could tell;
    /// [`Error::locate`] fills in what the generation loop knows.
    #[error("{}", nonfinite_message(*step, *sequence, *layer, what))]
    NonFiniteLogits {
        /// Decode step: tokens chosen before this one in its sequence (0:
        /// the prefill's last logits; s: the logits of the s-th decode
        /// step). `None` where the reporter cannot tell (a device-fed
        /// benchmark loop, a direct [`crate::pipeline::GpuModel::argmax`]).
        step: Option<usize>,
        /// The sequence: its row in the decode batch (or, in perplexity,
        /// its chunk).
        sequence: Option<usize>,
        /// The first decoder layer after which the hidden state held a NaN
        /// or ±∞, where the engine can tell (the CPU reference tracks it;
        /// the GPU does not).
        layer: Option<usize>,
        /// What is wrong with the row, with the id and counts, e.g.
        /// "NaN at id 17 (3 of 49152 entries NaN)".
        what: String,
    },
    /// The run was interrupted (Ctrl-C, SIGINT) between two units of work;
    /// `0` names where (e.g. "prefill", "decode step 12"). The CLI exits
    /// with [`crate::interrupt::EXIT_CODE`].
    #[error("interrupted (Ctrl-C) at {0}")]
    Interrupted(String),
}

/// The text of [`Error::NonFiniteLogits`].
fn nonfinite_message(
    step: Option<usize>,
    sequence: Option<usize>,
    layer: Option<usize>,
    what: &str,
) -> String {
    let mut at = Vec::new();
    if let Some(s) = step {
        at.push(format!("decode step {s}"));
    }
    if let Some(q) = sequence {
        at.push(format!("sequence {q}"));
    }
    let at = if at.is_empty() {
        String::new()
    } else {
        format!(" at {}", at.join(", "))
    };
    let layer = match layer {
        Some(l) => format!("; the hidden state first held a NaN or ±inf after layer {l}"),
        None => String::new(),
    };
    format!(
        "non-finite logits{at}: {what}{layer}; no token can be chosen: the model's weights or a kernel produced them (check the checkpoint, --rope-theta/--max-position, and on the GPU `sparda gpu-check`)"
    )
}

/// Shorthand for `std::result::Result<T, sparda::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    /// An [`Error::Config`] for `path` and `field`.
    pub fn config(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        msg: impl Into<String>,
    ) -> Self {
        Error::Config {
            path: path.into(),
            field: field.into(),
            msg: msg.into(),
        }
    }
    /// An [`Error::NonFiniteLogits`] with its missing `step` and
    /// `sequence` filled in (those already known are kept); any other error
    /// unchanged. Loops that know the decode step and the sequence call it
    /// on their engine's errors.
    pub fn locate(self, step: usize, sequence: usize) -> Self {
        match self {
            Error::NonFiniteLogits {
                step: s,
                sequence: q,
                layer,
                what,
            } => Error::NonFiniteLogits {
                step: s.or(Some(step)),
                sequence: q.or(Some(sequence)),
                layer,
                what,
            },
            other => other,
        }
    }
    /// An [`Error::Checkpoint`] for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
