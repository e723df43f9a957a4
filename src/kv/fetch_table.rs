//! The per-GPU fetch table: which fetch configuration (SM copy kernel and
//! its CTA count, or the copy engines) an offloaded decode step uses, per
//! batch size, separately for the synchronous fetch and for forecast
//! prefetch (runtime.md §4). `sparda tune-ctas` measures it on a GPU and
//! writes it as JSON; the tables under `tuning/` in the repository are
//! built into the binary, and `SPARDA_FETCH_TABLE=FILE` names another.
//!
//! Lookup ([`FetchTable::choose`]): the table's entries for the mode, keyed
//! by the measured batch sizes; a batch between two measured sizes b₁ < b₂
//! takes b₁'s entry up to the geometric midpoint √(b₁·b₂) and b₂'s above
//! it; below the smallest or above the largest measured size, the nearest
//! entry. A GPU without a table gets [`super::fetch::fetch_rule`] (SparDA's
//! rule) and a one-line notice that `sparda tune-ctas` would help.

use super::fetch::{fetch_rule, FetchEngine};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The format version [`FetchTable::parse`] reads.
pub const FORMAT: u32 = 1;

/// Tables built into the binary: (GPU name as `cuDeviceGetName` gives it,
/// the table's JSON text, the file it came from). A table `sparda
/// tune-ctas` wrote joins this list when it is committed under `tuning/`.
const BUILT_IN: &[(&str, &str, &str)] = &[(
    "NVIDIA H200",
    include_str!("../../tuning/fetch_nvidia_h200.json"),
    "tuning/fetch_nvidia_h200.json",
)];

/// The GPUs with a table built into the binary (names as `cuDeviceGetName`
/// gives them).
pub fn built_in_gpus() -> Vec<&'static str> {
    BUILT_IN.iter().map(|&(name, _, _)| name).collect()
}

/// The environment variable naming a table file to use instead of the
/// built-in one.
pub const ENV_TABLE: &str = "SPARDA_FETCH_TABLE";

/// Which schedule a step runs: the fetch inside the layer (synchronous
/// NOSA/InfLLM-V2 selection, and forecast without prefetch), or forecast
/// prefetch on the copy stream beside the previous layer's compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FetchMode {
    /// The fetch of layer l waits for layer l's selection and blocks it.
    Sync,
    /// Layer l+1's fetch runs while layer l computes.
    Prefetch,
}

/// One fetch configuration as a table stores it (JSON: `{"engine": "sm",
/// "ctas": N}`, `{"engine": "sm_whole", "ctas": N}`, `{"engine": "dma"}` or
/// `{"engine": "split", "ctas": N, "ce_pct": P}`); its label
/// ([`FetchChoice::label`]) is `sm:N`, `sm-whole:N`, `dma` or `split:N:P`,
/// the spelling of a sweep's cells and (but for `sm-whole:N`) of `--fetch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "engine", rename_all = "lowercase")]
pub enum FetchChoice {
    /// The persistent SM copy kernel on `ctas` CTAs.
    Sm {
        /// CTAs (1 … 1024).
        ctas: usize,
    },
    /// The SM copy kernel on `ctas` CTAs that each hold a whole SM (the
    /// GEMMs keep every SM, so that decode stays bitwise equal to
    /// GPU-resident KV): what `--fetch sm:N --fetch-whole-sms` runs
    /// ([`crate::pipeline::GpuModel::set_fetch_whole_sms`], runtime.md §4).
    /// Tables swept before 2026-12-02 measured it with the GEMMs sized for
    /// the SMs left (`--reserve-fetch-sms`), 1.4 % faster at 32K B 8.
    /// Applies while `ctas` is at most half the SMs; above that it runs as
    /// [`FetchChoice::Sm`].
    #[serde(rename = "sm_whole")]
    SmWhole {
        /// CTAs (1 … 1024), one SM each.
        ctas: usize,
    },
    /// The copy engines.
    Dma,
    /// Each layer's misses split ([`crate::kv::split`]): `ce_pct` % through
    /// the copy engines, the rest through the SM kernel on `ctas` CTAs, at
    /// once.
    Split {
        /// CTAs of the SM kernel's share (1 … 1024).
        ctas: usize,
        /// The copy engines' share of each layer's misses, % (1 … 99).
        ce_pct: usize,
    },
}

/// What a fetch configuration label may be, for error messages.
pub const LABEL_FORMS: &str =
    "`dma`, `sm:N` (N = 1 … 1024 CTAs), `sm-whole:N` (N = 1 … 1024 CTAs on whole SMs, at most half the GPU's SMs) or `split:N:P` (N = 1 … 1024 CTAs, P = 1 … 99 % through the copy engines)";

impl FetchChoice {
    /// The engine this choice runs (where its CTAs run:
    /// [`FetchChoice::whole_sms`]).
    pub fn engine(self) -> FetchEngine {
        match self {
            FetchChoice::Sm { ctas } | FetchChoice::SmWhole { ctas } => FetchEngine::Sm { ctas },
            FetchChoice::Dma => FetchEngine::Dma,
            FetchChoice::Split { ctas, ce_pct } => FetchEngine::Split { ctas, ce_pct },
        }
    }

    /// Whether the copy kernel's CTAs hold whole SMs:
    /// [`FetchChoice::SmWhole`].
    pub fn whole_sms(self) -> bool {
        matches!(self, FetchChoice::SmWhole { .. })
    }

    /// Reads a [`FetchChoice::label`] back: `dma`, `sm:N`, `sm-whole:N` or
    /// `split:N:P`.
    ///
    /// Errors: [`Error::Input`] naming the label and the allowed forms and
    /// ranges ([`LABEL_FORMS`]: 1 ≤ N ≤ 1024, 1 ≤ P ≤ 99).
    pub fn parse_label(label: &str) -> Result<FetchChoice> {
        let bad = |why: String| {
            Error::Input(format!(
                "fetch configuration `{label}`: {why}give {LABEL_FORMS}"
            ))
        };
        let ctas = |t: &str| match t.parse::<usize>() {
            Ok(n) if (1..=1024).contains(&n) => Ok(n),
            _ => Err(bad(format!("CTA count `{t}` is not 1 … 1024; "))),
        };
        if label == "dma" {
            return Ok(FetchChoice::Dma);
        }
        if let Some(n) = label.strip_prefix("sm:") {
            return Ok(FetchChoice::Sm { ctas: ctas(n)? });
        }
        if let Some(n) = label.strip_prefix("sm-whole:") {
            return Ok(FetchChoice::SmWhole { ctas: ctas(n)? });
        }
        if let Some(rest) = label.strip_prefix("split:") {
            let Some((n, p)) = rest.split_once(':') else {
                return Err(bad("a split needs both N and P; ".into()));
            };
            let ctas = ctas(n)?;
            let ce_pct = match p.parse::<usize>() {
                Ok(p) if crate::kv::split::check_ce_pct(p, "").is_ok() => p,
                _ => return Err(bad(format!("copy-engine share `{p}` is not 1 … 99; "))),
            };
            return Ok(FetchChoice::Split { ctas, ce_pct });
        }
        Err(bad(String::new()))
    }

    /// `sm:N`, `sm-whole:N`, `dma` or `split:N:P`.
    pub fn label(self) -> String {
        match self {
            FetchChoice::Sm { ctas } => format!("sm:{ctas}"),
            FetchChoice::SmWhole { ctas } => format!("sm-whole:{ctas}"),
            FetchChoice::Dma => "dma".into(),
            FetchChoice::Split { ctas, ce_pct } => format!("split:{ctas}:{ce_pct}"),
        }
    }

    /// Checks the ranges a deserialised choice may hold (what
    /// [`FetchChoice::parse_label`] checks for a label).
    ///
    /// Errors: [`Error::Input`] naming the configuration, the value and its
    /// range.
    pub fn validate(self) -> Result<()> {
        match self.range_problem() {
            Some(why) => Err(Error::Input(format!(
                "fetch configuration `{}`: {why}",
                self.label()
            ))),
            None => Ok(()),
        }
    }

    /// What is out of range in this choice, if anything.
    fn range_problem(self) -> Option<String> {
        match self {
            FetchChoice::Sm { ctas }
            | FetchChoice::SmWhole { ctas }
            | FetchChoice::Split { ctas, .. }
                if ctas == 0 || ctas > 1024 =>
            {
                Some(format!("{ctas} CTAs (give 1 … 1024)"))
            }
            FetchChoice::Split { ce_pct, .. }
                if !(crate::kv::split::MIN_CE_PCT..=crate::kv::split::MAX_CE_PCT)
                    .contains(&ce_pct) =>
            {
                Some(format!("copy-engine share {ce_pct} % (give 1 … 99)"))
            }
            _ => None,
        }
    }
}

/// One row of a table: the configuration chosen for a measured batch size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FetchEntry {
    /// The measured batch size B (sequences).
    pub batch: usize,
    /// The chosen configuration.
    pub choice: FetchChoice,
    /// Its median step time, ms (information).
    pub step_ms: f64,
}

/// A GPU's fetch table (the JSON `sparda tune-ctas` writes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FetchTable {
    /// [`FORMAT`].
    pub format: u32,
    /// The GPU it was measured on (`cuDeviceGetName`).
    pub gpu: String,
    /// Its SM count.
    pub sm_count: i32,
    /// PCIe link, e.g. "Gen5 x16" (or "unknown").
    pub pcie: String,
    /// Driver version (nvidia-smi's, or the CUDA driver API version).
    pub driver: String,
    /// When it was measured (UTC, ISO 8601).
    pub date_utc: String,
    /// The commit of the binary that measured it.
    pub commit: Option<String>,
    /// How it was measured (model, contexts, steps, repeats).
    pub protocol: String,
    /// Entries of the synchronous fetch, by ascending batch.
    pub sync: Vec<FetchEntry>,
    /// Entries of forecast prefetch, by ascending batch.
    pub prefetch: Vec<FetchEntry>,
    /// The sweep behind the choices (every configuration measured), as
    /// `sparda tune-ctas` recorded it.
    #[serde(default)]
    pub sweep: serde_json::Value,
}

/// Where the table in use came from, for `tune-ctas --show` and notices.
#[derive(Debug, Clone, PartialEq)]
pub enum TableSource {
    /// Built into the binary from this repository file.
    BuiltIn(&'static str),
    /// The file [`ENV_TABLE`] names.
    File(String),
    /// No table for this GPU: SparDA's rule ([`fetch_rule`]).
    Rule,
}

impl FetchTable {
    /// Parses a table's JSON text; `origin` names it in errors.
    ///
    /// Errors: [`Error::Input`] for malformed JSON, another format
    /// version, an empty mode, batches not strictly ascending, a CTA
    /// count outside 1 … 1024 or a split's copy-engine share outside 1 … 99.
    pub fn parse(text: &str, origin: &str) -> Result<FetchTable> {
        let t: FetchTable = serde_json::from_str(text)
            .map_err(|e| Error::Input(format!("fetch table {origin}: {e}")))?;
        if t.format != FORMAT {
            return Err(Error::Input(format!(
                "fetch table {origin}: format {} (this build reads format {FORMAT})",
                t.format
            )));
        }
        for (name, entries) in [("sync", &t.sync), ("prefetch", &t.prefetch)] {
            if entries.is_empty() {
                return Err(Error::Input(format!(
                    "fetch table {origin}: no \"{name}\" entries"
                )));
            }
            for w in entries.windows(2) {
                if w[0].batch >= w[1].batch {
                    return Err(Error::Input(format!(
                        "fetch table {origin}: \"{name}\" batches must ascend strictly (… {}, {} …)",
                        w[0].batch, w[1].batch
                    )));
                }
            }
            for e in entries.iter() {
                if let Some(why) = e.choice.range_problem() {
                    return Err(Error::Input(format!(
                        "fetch table {origin}: \"{name}\" batch {}: {why}",
                        e.batch
                    )));
                }
            }
        }
        Ok(t)
    }

    /// Reads and parses a table file.
    ///
    /// Errors: [`Error::Io`] naming the file; [`FetchTable::parse`]'s.
    pub fn load(path: &Path) -> Result<FetchTable> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        FetchTable::parse(&text, &path.display().to_string())
    }

    /// The table for the GPU named `gpu_name`: the file [`ENV_TABLE`] names
    /// (`env_file`, refused when it was measured on another GPU), else the
    /// built-in table of that GPU, else `None` (SparDA's rule applies).
    ///
    /// Errors: the file cannot be read or parsed; it belongs to another GPU
    /// (the message names both).
    pub fn for_gpu(
        gpu_name: &str,
        env_file: Option<&Path>,
    ) -> Result<Option<(FetchTable, TableSource)>> {
        if let Some(p) = env_file {
            let t = FetchTable::load(p)?;
            if t.gpu != gpu_name {
                return Err(Error::Input(format!(
                    "{ENV_TABLE}={}: a fetch table of the {} (this GPU is the {gpu_name}); run `sparda tune-ctas` on this GPU",
                    p.display(),
                    t.gpu
                )));
            }
            return Ok(Some((t, TableSource::File(p.display().to_string()))));
        }
        for &(name, text, file) in BUILT_IN {
            if name == gpu_name {
                return Ok(Some((
                    FetchTable::parse(text, file)?,
                    TableSource::BuiltIn(file),
                )));
            }
        }
        Ok(None)
    }

    /// The entries of `mode`.
    pub fn entries(&self, mode: FetchMode) -> &[FetchEntry] {
        match mode {
            FetchMode::Sync => &self.sync,
            FetchMode::Prefetch => &self.prefetch,
        }
    }

    /// The configuration for `batch` sequences in `mode` (see the module
    /// doc for the thresholds between measured sizes).
    pub fn choose(&self, mode: FetchMode, batch: usize) -> FetchChoice {
        let e = self.entries(mode);
        let mut pick = e[0];
        for w in e.windows(2) {
            let threshold = ((w[0].batch * w[1].batch) as f64).sqrt();
            if batch as f64 > threshold {
                pick = w[1];
            }
        }
        pick.choice
    }
}

/// The fetch engine for `batch` rows in `mode` on the GPU `gpu_name` with
/// `table` (when there is one), else SparDA's rule.
pub fn auto_engine(
    table: Option<&FetchTable>,
    gpu_name: &str,
    mode: FetchMode,
    batch: usize,
) -> FetchEngine {
    match table {
        Some(t) => t.choose(mode, batch).engine(),
        None => fetch_rule(gpu_name, batch),
    }
}

/// Whether the table's choice for `batch` rows in `mode` puts the copy
/// kernel's CTAs on whole SMs ([`FetchChoice::SmWhole`]); SparDA's rule
/// (no table) never does.
pub fn auto_whole_sms(table: Option<&FetchTable>, mode: FetchMode, batch: usize) -> bool {
    table.is_some_and(|t| t.choose(mode, batch).whole_sms())
}

/// The file name `tune-ctas` gives a GPU's table: `fetch_<name>.json`, the
/// name lower-cased with every run of other characters as one `_`
/// ("NVIDIA H200" → `fetch_nvidia_h200.json`).
pub fn table_file_name(gpu_name: &str) -> String {
    let mut s = String::new();
    for c in gpu_name.chars() {
        if c.is_ascii_alphanumeric() {
            s.push(c.to_ascii_lowercase());
        } else if !s.ends_with('_') {
            s.push('_');
        }
    }
    format!("fetch_{}.json", s.trim_matches('_'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(gpu: &str) -> FetchTable {
        let e = |batch, choice| FetchEntry {
            batch,
            choice,
            step_ms: 1.0,
        };
        FetchTable {
            format: FORMAT,
            gpu: gpu.into(),
            sm_count: 132,
            pcie: "Gen5 x16".into(),
            driver: "580".into(),
            date_utc: "2026-12-01T00:00:00Z".into(),
            commit: None,
            protocol: "test".into(),
            sync: vec![
                e(8, FetchChoice::Sm { ctas: 4 }),
                e(32, FetchChoice::Sm { ctas: 12 }),
                e(64, FetchChoice::Dma),
            ],
            prefetch: vec![e(8, FetchChoice::Sm { ctas: 2 })],
            sweep: serde_json::Value::Null,
        }
    }

    #[test]
    fn a_table_round_trips_and_thresholds_sit_at_geometric_midpoints() {
        let t = table("NVIDIA H200");
        let text = serde_json::to_string(&t).unwrap();
        assert!(text.contains(r#""engine":"sm","ctas":4"#), "{text}");
        let t = FetchTable::parse(&text, "test").unwrap();
        let c = |b| t.choose(FetchMode::Sync, b);
        // √(8·32) = 16, √(32·64) ≈ 45.25
        assert_eq!(c(1), FetchChoice::Sm { ctas: 4 });
        assert_eq!(c(16), FetchChoice::Sm { ctas: 4 });
        assert_eq!(c(17), FetchChoice::Sm { ctas: 12 });
        assert_eq!(c(45), FetchChoice::Sm { ctas: 12 });
        assert_eq!(c(46), FetchChoice::Dma);
        assert_eq!(c(1000), FetchChoice::Dma);
        assert_eq!(
            t.choose(FetchMode::Prefetch, 128),
            FetchChoice::Sm { ctas: 2 }
        );
        assert_eq!(
            auto_engine(Some(&t), "NVIDIA H200", FetchMode::Sync, 20),
            FetchEngine::Sm { ctas: 12 }
        );
    }

    #[test]
    fn without_a_table_sparda_rule_applies() {
        assert_eq!(
            auto_engine(None, "NVIDIA H100 80GB HBM3", FetchMode::Prefetch, 17),
            FetchEngine::Sm { ctas: 32 }
        );
        assert_eq!(
            auto_engine(None, "NVIDIA L40S", FetchMode::Sync, 64),
            FetchEngine::Sm { ctas: 16 }
        );
        assert!(FetchTable::for_gpu("NVIDIA L40S", None).unwrap().is_none());
    }

    #[test]
    fn the_built_in_tables_parse_and_name_their_gpu() {
        for &(name, text, file) in BUILT_IN {
            let t = FetchTable::parse(text, file).unwrap();
            assert_eq!(t.gpu, name, "{file}");
            assert_eq!(file, format!("tuning/{}", table_file_name(name)));
            let (_, src) = FetchTable::for_gpu(name, None).unwrap().unwrap();
            assert_eq!(src, TableSource::BuiltIn(file));
            // its sweep reads back, and choosing again over it gives its entries
            let cells = crate::tune::cells_of(&t, file).unwrap();
            assert!(!cells.is_empty(), "{file}");
            let configs: Vec<FetchChoice> = t.sweep["configs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| FetchChoice::parse_label(l.as_str().unwrap()).unwrap())
                .collect();
            assert_eq!(
                crate::tune::entries_of(&cells, &configs).unwrap(),
                (t.sync.clone(), t.prefetch.clone())
            );
        }
    }

    #[test]
    fn a_table_of_another_gpu_is_refused_with_both_names() {
        let dir = std::env::temp_dir().join(format!("sparda-fetch-table-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.json");
        std::fs::write(
            &p,
            serde_json::to_string(&table("NVIDIA A100-SXM4-80GB")).unwrap(),
        )
        .unwrap();
        let e = FetchTable::for_gpu("NVIDIA H200", Some(&p))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NVIDIA A100-SXM4-80GB") && e.contains("NVIDIA H200"),
            "{e}"
        );
        let (t, src) = FetchTable::for_gpu("NVIDIA A100-SXM4-80GB", Some(&p))
            .unwrap()
            .unwrap();
        assert_eq!(t.sync.len(), 3);
        assert_eq!(src, TableSource::File(p.display().to_string()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_tables_name_the_rule_broken() {
        let mut t = table("X");
        t.sync.swap(0, 1);
        let e = FetchTable::parse(&serde_json::to_string(&t).unwrap(), "f.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f.json") && e.contains("ascend strictly (… 32, 8 …)"),
            "{e}"
        );
        let mut t = table("X");
        t.prefetch[0].choice = FetchChoice::Sm { ctas: 0 };
        let e = FetchTable::parse(&serde_json::to_string(&t).unwrap(), "f.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch 8: 0 CTAs"), "{e}");
        let mut t = table("X");
        t.format = 7;
        let e = FetchTable::parse(&serde_json::to_string(&t).unwrap(), "f.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("format 7"), "{e}");
        t.format = FORMAT;
        t.prefetch.clear();
        let e = FetchTable::parse(&serde_json::to_string(&t).unwrap(), "f.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no \"prefetch\" entries"), "{e}");
    }

    #[test]
    fn labels_round_trip_and_bad_ones_name_the_value_and_the_ranges() {
        for c in [
            FetchChoice::Dma,
            FetchChoice::Sm { ctas: 1 },
            FetchChoice::Sm { ctas: 1024 },
            FetchChoice::Split {
                ctas: 8,
                ce_pct: 50,
            },
            FetchChoice::Split { ctas: 1, ce_pct: 1 },
            FetchChoice::Split {
                ctas: 1024,
                ce_pct: 99,
            },
        ] {
            assert_eq!(FetchChoice::parse_label(&c.label()).unwrap(), c);
            assert_eq!(c.engine().label(), c.label());
            assert_eq!(FetchEngine::parse(&c.label()).unwrap(), c.engine());
            c.validate().unwrap();
        }
        assert_eq!(
            FetchChoice::Split {
                ctas: 16,
                ce_pct: 25
            }
            .label(),
            "split:16:25"
        );
        for (label, why) in [
            ("split:0:50", "CTA count `0` is not 1 … 1024"),
            ("split:1025:50", "CTA count `1025`"),
            ("split:8:0", "copy-engine share `0` is not 1 … 99"),
            ("split:8:100", "copy-engine share `100`"),
            ("split:8:-5", "copy-engine share `-5`"),
            ("split:8", "needs both N and P"),
            ("split:x:50", "CTA count `x`"),
            ("sm:0", "CTA count `0`"),
            ("ce", ""),
            ("sm", ""),
        ] {
            let e = FetchChoice::parse_label(label).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{label}`")) && e.contains(why) && e.contains(LABEL_FORMS),
                "{label}: {e}"
            );
        }
        for c in [
            FetchChoice::Split { ctas: 8, ce_pct: 0 },
            FetchChoice::Split {
                ctas: 8,
                ce_pct: 100,
            },
            FetchChoice::Split {
                ctas: 0,
                ce_pct: 50,
            },
        ] {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(&c.label()), "{e}");
        }
    }

    #[test]
    fn a_table_may_choose_whole_sms_and_only_its_entry_takes_them() {
        let mut t = table("NVIDIA H200");
        let whole = FetchChoice::SmWhole { ctas: 8 };
        t.prefetch.push(FetchEntry {
            batch: 32,
            choice: whole,
            step_ms: 2.0,
        });
        let text = serde_json::to_string(&t).unwrap();
        assert!(text.contains(r#""engine":"sm_whole","ctas":8"#), "{text}");
        let t = FetchTable::parse(&text, "test").unwrap();
        assert_eq!(t.choose(FetchMode::Prefetch, 32), whole);
        assert_eq!(whole.label(), "sm-whole:8");
        assert_eq!(FetchChoice::parse_label("sm-whole:8").unwrap(), whole);
        // the same copy kernel, on whole SMs above the threshold √(8·32) = 16
        for b in [17, 64] {
            assert_eq!(
                auto_engine(Some(&t), "NVIDIA H200", FetchMode::Prefetch, b),
                FetchEngine::Sm { ctas: 8 }
            );
            assert!(auto_whole_sms(Some(&t), FetchMode::Prefetch, b));
        }
        assert!(!auto_whole_sms(Some(&t), FetchMode::Prefetch, 16));
        assert!(!auto_whole_sms(Some(&t), FetchMode::Sync, 64));
        assert!(!auto_whole_sms(None, FetchMode::Prefetch, 64));
        let e = FetchTable::parse(
            &text.replace(r#""sm_whole","ctas":8"#, r#""sm_whole","ctas":0"#),
            "f.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("f.json") && e.contains("\"prefetch\" batch 32") && e.contains("0 CTAs"),
            "{e}"
        );
    }

    #[test]
    fn a_table_may_choose_a_split_and_reads_it_back() {
        let mut t = table("NVIDIA H200");
        let split = FetchChoice::Split {
            ctas: 8,
            ce_pct: 50,
        };
        t.prefetch.push(FetchEntry {
            batch: 32,
            choice: split,
            step_ms: 2.0,
        });
        let text = serde_json::to_string(&t).unwrap();
        assert!(
            text.contains(r#""engine":"split","ctas":8,"ce_pct":50"#),
            "{text}"
        );
        let t = FetchTable::parse(&text, "test").unwrap();
        assert_eq!(
            t.choose(FetchMode::Prefetch, 8),
            FetchChoice::Sm { ctas: 2 }
        );
        assert_eq!(t.choose(FetchMode::Prefetch, 32), split);
        assert_eq!(
            auto_engine(Some(&t), "NVIDIA H200", FetchMode::Prefetch, 64),
            FetchEngine::Split {
                ctas: 8,
                ce_pct: 50
            }
        );
        // out-of-range splits in a table are refused with the batch and value
        for (bad, why) in [
            (r#""ce_pct":50"#, r#""ce_pct":100"#),
            (r#""ctas":8,"ce_pct""#, r#""ctas":0,"ce_pct""#),
        ] {
            let e = FetchTable::parse(&text.replace(bad, why), "f.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("f.json") && e.contains("\"prefetch\" batch 32"),
                "{e}"
            );
        }
        let e = FetchTable::parse(&text.replace(r#""ce_pct":50"#, r#""ce_pct":100"#), "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("copy-engine share 100 % (give 1 … 99)"), "{e}");
        // an unknown engine is refused with its name
        let e = FetchTable::parse(
            &text.replace(r#""engine":"dma""#, r#""engine":"warp""#),
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("warp"), "{e}");
    }

    #[test]
    fn table_file_names_are_slugs_of_the_gpu_name() {
        assert_eq!(table_file_name("NVIDIA H200"), "fetch_nvidia_h200.json");
        assert_eq!(
            table_file_name("NVIDIA H100 80GB HBM3"),
            "fetch_nvidia_h100_80gb_hbm3.json"
        );
        assert_eq!(
            table_file_name("NVIDIA A100-SXM4-80GB"),
            "fetch_nvidia_a100_sxm4_80gb.json"
        );
    }
}
