//! GPU checks, kept out of the production modules and run on the device
//! machine as `sparda gpu-check`, `sparda gpu-check-e2e` and
//! `sparda offload-check` (spec/testing.md: the CPU reference is the oracle):
//! - [`kernels`]: every CUDA kernel against the CPU reference on fresh
//!   random inputs at the shapes testing.md lists, with a JSON report;
//! - [`select`], [`offload`], [`sample`]: the selection, offloaded-KV and
//!   sampling kernel groups of that check;
//! - [`guards`]: kernel guards provoked on purpose, reported through the
//!   device error record (kernel level and through the engine);
//! - [`e2e`]: the whole engine against the CPU reference under teacher
//!   forcing, per-step selections included;
//! - [`identity`]: bitwise identity between decode modes (GPU-resident vs
//!   offloaded KV, prefetch on vs off).

pub mod e2e;
pub mod guards;
pub mod identity;
pub mod kernels;
pub mod offload;
pub mod sample;
pub mod select;

pub use kernels::{gpu_check, CaseResult, TOLERANCE_BF16};
