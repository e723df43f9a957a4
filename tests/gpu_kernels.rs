//! GPU kernels against the CPU reference (spec/testing.md), through
//! `sparda::checks::gpu_check`. The GPU test is ignored by default so that
//! it never counts as passed on a machine without a GPU; run it on the GPU
//! machine with `cargo test --release --test gpu_kernels -- --ignored`
//! (or `sparda gpu-check`, the same check as a command). Without CUDA (CI,
//! the developer machines) the check must return a clear `Error::Cuda`,
//! never panic.

use sparda::checks::gpu_check;
use sparda::Error;

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn gpu_kernels_match_the_cpu_reference() {
    let out = std::env::temp_dir().join(format!("sparda-gpu-check-{}.json", std::process::id()));
    match gpu_check(&out) {
        Ok(pass) => assert!(
            pass,
            "GPU kernels disagree with the CPU reference; report: {}",
            out.display()
        ),
        Err(e) => panic!("gpu_check: {e}"),
    }
}

#[test]
fn gpu_check_without_cuda_is_an_error_not_a_panic() {
    if sparda::cuda::is_available() {
        return; // the ignored test above covers a machine with a GPU
    }
    let out = std::env::temp_dir().join(format!("sparda-gpu-check-{}.json", std::process::id()));
    match gpu_check(&out) {
        Err(Error::Cuda(msg)) => assert!(msg.contains("not found"), "{msg}"),
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
}

#[test]
fn gpu_context_without_cuda_is_an_error_not_a_panic() {
    if sparda::cuda::is_available() {
        return;
    }
    match sparda::cuda::Gpu::new(0) {
        Err(Error::Cuda(msg)) => assert!(msg.contains("not found"), "{msg}"),
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
}

/// Non-finite logits on the GPU: NaN / +inf / all −inf rows through the
/// sampling kernel (greedy and sampled paths), NaN and −inf written into
/// the engine's logits buffer after a prefill, and NaN logits computed
/// inside a graph-replayed decode step of a generation must come back as
/// `Error::NonFiniteLogits` naming the sequence (and, from the generation
/// loop, decode step 3), with the record cleared afterwards
/// (`sparda::checks::guards::check_nonfinite_logits`). Needs a GPU:
/// `cargo test --release --test gpu_kernels -- --ignored`.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn gpu_nonfinite_logits_are_errors() {
    use rand::SeedableRng;
    let gpu =
        std::sync::Arc::new(sparda::cuda::Gpu::new(0).unwrap_or_else(|e| panic!("Gpu::new: {e}")));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(9);
    let cases = sparda::checks::guards::check_nonfinite_logits(&gpu, &mut rng);
    assert_eq!(cases.len(), 2);
    for c in &cases {
        assert!(c.pass, "{}: {:?}", c.kernel, c.error);
    }
}
