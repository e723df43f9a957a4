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
    /// An [`Error::Checkpoint`] for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
