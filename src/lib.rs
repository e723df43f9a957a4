//! sparda-rt: a decode runtime for NOSA (Native and Offloadable Sparse
//! Attention) long-context language models.
//!
//! Layout (spec/style.md):
//! - [`config`]: `config.json` → model, RoPE and sparse settings (nosa-model.md §1);
//! - [`weights`]: safetensors checkpoints, the tensor-name table, validation (§2);
//! - [`tokenizer`]: `tokenizer.json` and streaming detokenization;
//! - [`model`]: the NOSA math once, backend-agnostic: compression state,
//!   block pooling and selection (§3–§6);
//! - [`cpu`]: the CPU reference backend, the oracle for everything else;
//! - [`cuda`]: the device: context, NVRTC kernel cache, cuBLAS, one typed
//!   wrapper per kernel ([`cuda::ops`]);
//! - [`kv`]: the KV cache: host layout, slot plans and footprint (host logic),
//!   GPU-resident caches, the pinned host store, slot pools, fetch and write-back;
//! - [`pipeline`]: the GPU engine: weights, prefill, and the decode step with its
//!   per-layer schedule of streams and events (sync and forecast + prefetch);
//! - [`checks`]: GPU checks against the CPU reference (`gpu-check`, end to end, identity);
//! - [`sample`]: token sampling;
//! - [`synth`]: random-weight checkpoints for tests and benchmarks;
//! - [`generate`]: the text-generation loop behind `sparda generate`;
//! - [`interrupt`]: Ctrl-C (SIGINT) handling of the long-running commands;
//! - [`memory`]: the GPU and pinned host memory a run needs, checked against
//!   what the machine has before anything is allocated;
//! - [`quality`]: perplexity and the comparison with a saved base run
//!   (KL divergence, top-1 agreement) behind `sparda perplexity`;
//! - [`mod@bench`]: the decode benchmark behind `sparda bench`;
//! - [`trace`]: Chrome/Perfetto traces of copy/compute overlap and their summary;
//! - [`fuzz`]: one entry per parser of untrusted input, shared by the fuzz
//!   targets (`fuzz/`) and the corpus replay test.
#![warn(missing_docs)]

pub mod bench;
pub mod checks;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod fuzz;
pub mod generate;
pub mod interrupt;
pub mod kv;
pub mod memory;
pub mod model;
pub mod pipeline;
pub mod quality;
pub mod report;
pub mod sample;
pub mod synth;
pub mod tokenizer;
pub mod trace;
pub mod tune;
pub mod weights;

pub use error::{Error, Result};
