//! Replays the fuzz corpus through the entries the fuzz targets call
//! ([`sparda::fuzz`]): every file of `fuzz/corpus/<target>/` (afl's minimized
//! queue) and of `fuzz/regressions/<target>/` (inputs that once crashed or hung
//! a target) must come back as `Ok` or `Err`, never as a panic. So CI checks
//! each input the fuzzer found interesting without afl.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sparda::fuzz::{Target, TARGETS};

/// Longest a single replayed input may take (a hang is a bug too). The
/// slowest inputs take a few milliseconds in release builds.
const MAX_PER_INPUT: Duration = Duration::from_secs(5);

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files of `dir`, sorted; none when the folder does not exist.
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

/// What replaying one folder found.
#[derive(Debug, Default)]
struct Replay {
    accepted: usize,
    rejected: usize,
    /// `file: panic message` or `file: took N ms`.
    failures: Vec<String>,
}

fn replay_files(target: &Target, files: &[PathBuf]) -> Replay {
    let mut r = Replay::default();
    for f in files {
        let data = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let t0 = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| (target.entry)(&data))) {
            Ok(Ok(())) => r.accepted += 1,
            Ok(Err(_)) => r.rejected += 1,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                r.failures.push(format!("{}: panicked: {msg}", f.display()));
            }
        }
        let took = t0.elapsed();
        if took > MAX_PER_INPUT {
            r.failures
                .push(format!("{}: took {} ms", f.display(), took.as_millis()));
        }
    }
    r
}

/// Replays target `name`'s corpus and regressions; the corpus must not be
/// empty and must hold at least one input the parser accepts (the real
/// files it was seeded with), so that the replay cannot pass vacuously.
fn replay(name: &str) {
    let target = TARGETS
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no fuzz target {name}"));
    let corpus = files_in(&fuzz_dir().join("corpus").join(name));
    let regressions = files_in(&fuzz_dir().join("regressions").join(name));
    assert!(
        !corpus.is_empty(),
        "fuzz/corpus/{name}/ is empty or missing"
    );
    let c = replay_files(target, &corpus);
    let r = replay_files(target, &regressions);
    let failures: Vec<&String> = c.failures.iter().chain(&r.failures).collect();
    assert!(
        failures.is_empty(),
        "{name}: {} of {} inputs failed:\n{}",
        failures.len(),
        corpus.len() + regressions.len(),
        failures
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(c.accepted + c.rejected, corpus.len());
    assert_eq!(r.accepted + r.rejected, regressions.len());
    assert!(
        c.accepted >= 1,
        "{name}: none of the {} corpus files is accepted",
        corpus.len()
    );
    eprintln!(
        "{name}: corpus {} files ({} accepted, {} rejected), regressions {} files",
        corpus.len(),
        c.accepted,
        c.rejected,
        regressions.len()
    );
}

#[test]
fn config_json_corpus() {
    replay("config_json");
}

#[test]
fn safetensors_corpus() {
    replay("safetensors");
}

#[test]
fn shard_index_corpus() {
    replay("shard_index");
}

#[test]
fn tokenizer_json_corpus() {
    replay("tokenizer_json");
}

#[test]
fn torch_pt_corpus() {
    replay("torch_pt");
}

#[test]
fn torch_pickle_corpus() {
    replay("torch_pickle");
}

#[test]
fn trace_summarize_corpus() {
    replay("trace_summarize");
}

/// Every target has a test above and a corpus folder, and every corpus or
/// regressions folder belongs to a target (a renamed target cannot leave its
/// corpus unreplayed).
#[test]
fn every_target_has_a_corpus_and_every_corpus_a_target() {
    let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
    assert_eq!(
        names,
        [
            "config_json",
            "safetensors",
            "shard_index",
            "tokenizer_json",
            "torch_pickle",
            "torch_pt",
            "trace_summarize"
        ]
    );
    for kind in ["corpus", "regressions"] {
        let Ok(rd) = std::fs::read_dir(fuzz_dir().join(kind)) else {
            assert_eq!(kind, "regressions", "fuzz/corpus/ is missing");
            continue;
        };
        for e in rd {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(
                names.contains(&name.as_str()),
                "fuzz/{kind}/{name}/ belongs to no fuzz target"
            );
        }
    }
    for n in &names {
        assert!(
            fuzz_dir().join("corpus").join(n).is_dir(),
            "fuzz/corpus/{n}/ missing"
        );
    }
    let bins = files_in(&fuzz_dir().join("src/bin"));
    let bin_names: Vec<String> = bins
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        bin_names, names,
        "fuzz/src/bin/ holds one binary per target"
    );
}
