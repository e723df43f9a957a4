//! The CUDA backend (issue 3). Built with cudarc's `dynamic-loading`, so the
//! binary builds and runs on machines without CUDA; there, asking for the GPU
//! is a clear error, never a panic (spec/device.md).

use crate::{Error, Result};

/// Which CUDA libraries can be loaded on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLibraries {
    /// libcuda (the driver).
    pub driver: bool,
    /// libnvrtc (run-time kernel compilation).
    pub nvrtc: bool,
    /// libcublas.
    pub cublas: bool,
}

/// Probes for the CUDA libraries without touching any of their functions
/// (cudarc panics on first use of a missing library, so this must come first).
pub fn libraries() -> CudaLibraries {
    // SAFETY: these only try to dlopen the libraries and report success.
    unsafe {
        CudaLibraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
        }
    }
}

/// Whether a CUDA-capable setup (driver, NVRTC and cuBLAS) is present.
pub fn is_available() -> bool {
    let l = libraries();
    l.driver && l.nvrtc && l.cublas
}

/// Checks that the CUDA backend can run here.
///
/// Errors: [`Error::Cuda`] naming the missing libraries; while the GPU
/// engine is not built yet (issue 3), an error saying so even when CUDA is
/// present.
pub fn require() -> Result<()> {
    let l = libraries();
    let missing: Vec<&str> = [(l.driver, "libcuda (driver)"), (l.nvrtc, "libnvrtc"), (l.cublas, "libcublas")]
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, n)| *n)
        .collect();
    if !missing.is_empty() {
        return Err(Error::Cuda(format!(
            "--backend cuda needs an NVIDIA GPU with CUDA 13 libraries; not found: {} (set LD_LIBRARY_PATH=/usr/local/cuda/lib64, or use --backend cpu)",
            missing.join(", ")
        )));
    }
    Err(Error::Cuda("the CUDA engine is not built yet (issue 3); use --backend cpu".into()))
}
