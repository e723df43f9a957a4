//! Kernel launches that may begin before the previous kernel on the stream
//! has ended: programmatic dependent launch (PDL, sm_90+; CUDA programming
//! guide, "Programmatic Dependent Launch and Synchronization").
//!
//! A kernel launched with PDL on has its blocks scheduled once every block
//! of the kernel before it has run `griddepcontrol.launch_dependents` (or
//! exited), so its launch and prologue overlap that kernel's tail instead
//! of following it. Every kernel launched through [`KernelLaunch`] calls
//! `pdl_wait()` (kernels/common.cuh) before it touches memory, which waits
//! for the kernel before it to have completed and its writes to be
//! visible: the results are those of a plain launch, bit for bit. Kernels
//! that do not wait (cuBLAS, the copy kernels) are never launched with PDL
//! on. On a stream capture the launch becomes a programmatic edge of the
//! CUDA graph.
//!
//! With PDL off ([`super::Gpu::pdl`]) the launch is a plain one; the kernel's
//! wait then returns at once.

use super::Gpu;
use cudarc::driver::{sys, CudaFunction, DeviceRepr, DriverError, LaunchConfig};
use std::ffi::c_void;
use std::marker::PhantomData;

/// A launch builder like cudarc's `LaunchArgs` ([`KernelLaunch::arg`] per
/// kernel parameter, in order), launched through `cuLaunchKernelEx` with
/// programmatic stream serialization allowed when [`Gpu::pdl`] is on.
/// Only for kernels that call `pdl_wait()` before their first memory
/// access (see the module docs).
pub struct KernelLaunch<'a> {
    gpu: &'a Gpu,
    func: &'a CudaFunction,
    args: Vec<*mut c_void>,
    _args: PhantomData<&'a ()>,
}

impl Gpu {
    /// A [`KernelLaunch`] of `func` on [`Gpu::stream`].
    pub fn launch_builder<'a>(&'a self, func: &'a CudaFunction) -> KernelLaunch<'a> {
        KernelLaunch {
            gpu: self,
            func,
            args: Vec::with_capacity(24),
            _args: PhantomData,
        }
    }
}

impl<'a> KernelLaunch<'a> {
    /// Appends the next kernel parameter (a scalar or a device address; it
    /// must outlive the launch, which the borrow ensures).
    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(v as *const T as *mut c_void);
        self
    }

    /// Enqueues the kernel on [`Gpu::stream`] with `cfg`, with PDL when
    /// [`Gpu::pdl`] is on.
    ///
    /// # Safety
    /// The parameters must match the kernel's signature in number, order
    /// and type, and every address must point to memory of the sizes the
    /// kernel reads and writes; the kernel must call `pdl_wait()` before
    /// any memory access.
    ///
    /// Errors: the driver's error (binding the context, or the launch).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let stream = self.gpu.stream();
        stream.context().bind_to_thread()?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: an all-zero union is a valid value of every member.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let pdl = self.gpu.pdl();
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        // SAFETY: the caller promises the parameters match the kernel; the
        // configuration and its attribute outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

/// PDL on for the launches of one scope: [`Gpu::set_pdl`]`(on)` when made,
/// off again when dropped (also when the scope unwinds).
pub struct PdlScope<'a> {
    gpu: &'a Gpu,
}

impl<'a> PdlScope<'a> {
    /// Turns PDL on (where allowed) when `on`, off otherwise, until dropped.
    pub fn new(gpu: &'a Gpu, on: bool) -> Self {
        gpu.set_pdl(on);
        PdlScope { gpu }
    }
}

impl Drop for PdlScope<'_> {
    fn drop(&mut self) {
        self.gpu.set_pdl(false);
    }
}
