//! The device: everything that knows CUDA but not the model. Built with
//! cudarc's `dynamic-loading`, so the binary builds and runs on machines
//! without CUDA; there, asking for the GPU is a clear error, never a panic
//! (spec/device.md).
//!
//! - [`context`]: the device context, its compute stream, NVRTC compilation
//!   of `kernels/*.cu` with an on-disk cubin cache, the cuBLAS handle, the
//!   bf16 GEMM and CUDA-graph capture;
//! - [`ops`]: one typed wrapper per kernel, shapes checked before launch
//!   ([`ops::select`]: selection kernels; [`ops::offload`]: offloaded-KV kernels).
//! - [`launch`]: kernel launches with programmatic dependent launch (the
//!   next kernel's launch overlaps the previous one's tail);
//! - [`device_error`]: the device error record through which kernels report
//!   a failed guard (pinned, device-mapped; decoded into an [`Error`]).
//!
//! The model on the GPU is [`crate::pipeline`], its KV cache [`crate::kv`],
//! the GPU checks [`crate::checks`].
//!
//! Device tensors are `CudaSlice<T>` from cudarc. bf16 values travel as
//! [`Bf16`] (their 16 raw bits), since cudarc's own `half` support is a
//! feature this crate does not enable.

pub mod context;
pub mod device_error;
pub mod gemm_lt;
pub mod launch;
pub mod ops;

pub use context::{DeviceInfo, GemmOut, Gpu};
pub use launch::{KernelLaunch, PdlScope};

use crate::{Error, Result};

/// One bf16 value on the device, as its raw bits (the layout of
/// `half::bf16` and of CUDA's `__nv_bfloat16`). Convert with
/// [`Bf16::from_f32`] / [`Bf16::to_f32`] or from/into `half::bf16`;
/// [`bf16_bits`] reinterprets a whole `&[half::bf16]` without copying.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bf16(pub u16);

// SAFETY: a plain 2-byte value with no padding and no invalid bit patterns.
unsafe impl cudarc::driver::DeviceRepr for Bf16 {}
// SAFETY: all-zero bits are +0.0.
unsafe impl cudarc::driver::ValidAsZeroBits for Bf16 {}
// SAFETY: repr(transparent) over u16: every bit pattern is valid, no padding.
unsafe impl bytemuck::Zeroable for Bf16 {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for Bf16 {}

impl Bf16 {
    /// Rounds an f32 to bf16 (round to nearest even, as `half::bf16::from_f32`).
    pub fn from_f32(x: f32) -> Self {
        Bf16(half::bf16::from_f32(x).to_bits())
    }
    /// The exact f32 value of this bf16.
    pub fn to_f32(self) -> f32 {
        half::bf16::from_bits(self.0).to_f32()
    }
}

impl From<half::bf16> for Bf16 {
    fn from(x: half::bf16) -> Self {
        Bf16(x.to_bits())
    }
}

impl From<Bf16> for half::bf16 {
    fn from(x: Bf16) -> Self {
        half::bf16::from_bits(x.0)
    }
}

/// Reinterprets host bf16 values (e.g. a safetensors tensor) as [`Bf16`]
/// without copying, ready for `CudaStream::clone_htod`.
pub fn bf16_bits(x: &[half::bf16]) -> &[Bf16] {
    bytemuck::cast_slice(x)
}

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

/// The libraries this machine lacks, by name (empty when all are present).
pub fn missing_libraries() -> Vec<&'static str> {
    let l = libraries();
    [
        (l.driver, "libcuda (driver)"),
        (l.nvrtc, "libnvrtc"),
        (l.cublas, "libcublas"),
    ]
    .iter()
    .filter(|(ok, _)| !ok)
    .map(|(_, n)| *n)
    .collect()
}

/// Checks that the CUDA backend can run here (driver, NVRTC and cuBLAS
/// loadable), before any CUDA call: cudarc panics on first use of a missing
/// library, so callers check this first.
///
/// Errors: [`Error::Cuda`] naming the missing libraries.
pub fn require() -> Result<()> {
    let missing = missing_libraries();
    if !missing.is_empty() {
        return Err(Error::Cuda(format!(
            "the CUDA backend (generate --backend cuda, bench, offload-check, gpu-check) needs an NVIDIA GPU with CUDA 13 libraries; not found: {} (set LD_LIBRARY_PATH=/usr/local/cuda/lib64; `generate --backend cpu` runs without a GPU)",
            missing.join(", ")
        )));
    }
    Ok(())
}
