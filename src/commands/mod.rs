//! The bodies of the `sparda` subcommands; their flags are defined in
//! `main.rs`.

pub mod bench;
pub mod forecast;
pub mod generate;
pub mod mode;
pub mod offload_check;
pub mod perplexity;
pub mod report;
pub mod synth;
pub mod tune_ctas;

use sparda::{Error, Result};
use std::path::PathBuf;

/// Prints a check's outcome; a failed check is an error naming its report.
pub(crate) fn check_outcome(cmd: &str, what: &str, ok: bool, json: &std::path::Path) -> Result<()> {
    eprintln!(
        "{cmd} {}; report in {}",
        if ok { "passed" } else { "FAILED" },
        json.display()
    );
    if ok {
        Ok(())
    } else {
        Err(Error::Cuda(format!(
            "some {what} cases failed; see {}",
            json.display()
        )))
    }
}

/// The SmolLM2 fixture's tokenizer.json (synthetic models use it): under
/// the working directory if there, else under the checkout this binary was
/// built from.
pub(crate) fn fixture_tokenizer() -> PathBuf {
    let rel = PathBuf::from(".fixtures/smollm2-135m-instruct/tokenizer.json");
    if rel.is_file() {
        rel
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
    }
}
