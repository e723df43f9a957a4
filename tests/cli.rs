//! Command-line behaviour that needs no GPU: flags that only make sense with
//! offloaded KV or forecast prefetch are refused with a message naming the
//! flag, and GPU-only commands say what they need (never a panic).

use std::process::Command;

fn sparda(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sparda"))
        .args(args)
        .output()
        .expect("runs the binary");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const TINY: [&str; 6] = [
    "generate",
    "--model",
    "synth:tiny",
    "--prompt",
    "hi",
    "--backend",
];

#[test]
fn offload_flags_without_offloaded_kv_are_refused() {
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--fetch", "dma"]);
    let (ok, err) = sparda(&a);
    assert!(!ok);
    assert!(
        err.contains("--fetch, --prefetch-ctas and --offload-layer0 apply to offloaded KV"),
        "{err}"
    );
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--prefetch-ctas", "0"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--prefetch-ctas 0: give 1 … 1024 CTAs"),
        "{err}"
    );
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--prefetch", "off"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--prefetch off applies to forecast mode with offloaded KV"),
        "{err}"
    );
}

#[test]
fn offloaded_kv_on_the_cpu_backend_is_refused() {
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--kv", "offload"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--kv offload needs the CUDA backend"),
        "{err}"
    );
}

#[test]
fn output_paths_in_missing_directories_fail_before_the_run() {
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--json", "/nonexistent-dir-sparda/out.json"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("directory /nonexistent-dir-sparda does not exist"),
        "{err}"
    );
    let mut a = TINY.to_vec();
    a.extend(["cpu", "--trace", "/nonexistent-dir-sparda/t.json"]);
    let (ok, err) = sparda(&a);
    assert!(
        !ok && err.contains("--trace /nonexistent-dir-sparda/t.json: cannot write there"),
        "{err}"
    );
}

#[test]
fn gpu_commands_without_cuda_name_what_they_need() {
    if sparda::cuda::is_available() {
        return; // this machine has a GPU: nothing to check here
    }
    let (ok, err) = sparda(&[
        "offload-check",
        "--model",
        "synth:tiny",
        "--prompt-file",
        "data/texts/hamlet.txt",
        "--json",
        "/tmp/sparda-cli-offload.json",
    ]);
    assert!(
        !ok && err.contains("the CUDA backend") && err.contains("offload-check"),
        "{err}"
    );
    let (ok, err) = sparda(&[
        "bench",
        "--model",
        "synth:tiny",
        "--json",
        "/tmp/sparda-cli-bench.json",
    ]);
    assert!(!ok && err.contains("needs an NVIDIA GPU"), "{err}");
}
