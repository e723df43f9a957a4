//! Forecast weights for SparDA forecast selection from a model's own
//! activations (spec/nosa-model.md §4 "Forecast mode"), without a training
//! run: the pieces that do not need the model, kept apart from the runtime.
//!
//! - [`records`]: the streamed activation file `sparda forecast collect`
//!   writes (per sampled position and layer: the normalized attention input
//!   x̂_l and that layer's regression targets);
//! - [`targets`]: the target definitions (group-mean pre-RoPE query, and the
//!   query-aware window-score fit);
//! - [`ridge`]: closed-form ridge regression from f64 Gram matrices, λ
//!   chosen on held-out positions;
//! - [`recall`]: recall of predicted block sets against the real selection,
//!   over the freely chosen blocks only.
//!
//! The `sparda` binary (`sparda forecast collect|fit|eval|import`) drives
//! the model and calls into this crate.

#![warn(missing_docs)]

pub mod recall;
pub mod records;
pub mod ridge;
pub mod targets;

/// Errors of this crate: each names the file, field or layer and the numbers.
#[derive(Debug)]
pub enum Error {
    /// An I/O error on the named file.
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A malformed or inconsistent record file, or bad input data.
    Format(String),
    /// A linear-algebra failure (e.g. a decomposition that did not converge).
    Solve(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Format(m) => write!(f, "{m}"),
            Error::Solve(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for Error {}

/// This crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
