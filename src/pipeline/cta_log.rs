//! The per-CTA timeline of a decode step (`bench --cta-timeline`): device
//! buffers that the attention kernel and the SM fetch kernel fill with one
//! `[start ns, end ns, SM id]` record per CTA (kernels/common.cuh
//! `cta_log_start`), read back as a [`CtaTimeline`] for
//! [`crate::trace::cta::analyze`]. Off by default; on, a step runs
//! eagerly (a CUDA graph would keep the addresses it was captured with).

use super::*;
use crate::trace::cta::{CtaRecord, CtaTimeline};
use std::sync::atomic::{AtomicBool, Ordering};

/// Record words per CTA.
const WORDS: usize = 3;

/// The kernel a record buffer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CtaKernel {
    /// `attn_partial` (decode attention).
    Attention,
    /// `kv_fetch_sm` (the SM fetch of a layer's missed blocks).
    Fetch,
}

/// Device buffers of one step's CTA records.
pub(crate) struct CtaLogBuffers {
    /// u64 \[layers\]\[cap\]\[3\]: attention CTAs.
    attn: CudaSlice<u64>,
    /// u64 \[layers\]\[cap\]\[3\]: SM fetch CTAs.
    fetch: CudaSlice<u64>,
    /// Records per layer and kernel.
    cap: usize,
    /// A launch had more CTAs than `cap` and was not logged.
    overflow: AtomicBool,
}

impl GpuModel {
    /// Turns the per-CTA timeline on (`Some(cap)`: room for `cap` CTAs per
    /// layer of each kernel, zeroed) or off (`None`). Drops the cached
    /// decode step, and while on no step is captured into a CUDA graph.
    /// Synchronises the context before the old buffers go.
    ///
    /// Errors: [`Error::Input`] for a capacity of 0; [`Error::Cuda`] when
    /// the context cannot synchronise or the buffers cannot be allocated
    /// (2 × layers × cap × 24 bytes).
    pub fn set_cta_log(&mut self, cap: Option<usize>) -> Result<()> {
        if self.cta_log.is_some() {
            // kernels on any stream (the fetch's too) may still write the records
            self.gpu
                .context()
                .synchronize()
                .cuda("synchronising before freeing the CTA log")?;
        }
        self.step = None;
        self.cta_log = match cap {
            None => None,
            Some(0) => {
                return Err(Error::Input(
                    "CTA timeline: room for 0 CTAs per layer".into(),
                ))
            }
            Some(cap) => {
                let n = self.layers.len() * cap * WORDS;
                Some(CtaLogBuffers {
                    attn: self.gpu.zeros::<u64>(n)?,
                    fetch: self.gpu.zeros::<u64>(n)?,
                    cap,
                    overflow: AtomicBool::new(false),
                })
            }
        };
        Ok(())
    }

    /// Zeroes the CTA records (before the step to be logged); no-op when
    /// the timeline is off.
    ///
    /// Errors: [`Error::Cuda`] when the zeroing fails.
    pub fn clear_cta_log(&mut self) -> Result<()> {
        if let Some(b) = self.cta_log.as_mut() {
            let s = self.gpu.stream();
            s.memset_zeros(&mut b.attn).cuda("zeroing the CTA log")?;
            s.memset_zeros(&mut b.fetch).cuda("zeroing the CTA log")?;
            b.overflow.store(false, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The CTA records written since the last [`GpuModel::clear_cta_log`]
    /// (per layer; CTAs that wrote nothing are left out), and whether some
    /// launch had more CTAs than the buffers hold (it was not logged).
    /// Synchronises. An empty timeline when the log is off.
    ///
    /// Errors: [`Error::Cuda`] on a copy failure.
    pub fn read_cta_log(&self) -> Result<(CtaTimeline, bool)> {
        let Some(b) = self.cta_log.as_ref() else {
            return Ok((CtaTimeline::default(), false));
        };
        self.gpu.synchronize()?;
        let per_layer = |v: Vec<u64>| -> Vec<Vec<CtaRecord>> {
            v.chunks_exact(b.cap * WORDS)
                .map(|l| {
                    l.chunks_exact(WORDS)
                        .filter_map(|r| CtaRecord::from_raw([r[0], r[1], r[2]]))
                        .collect()
                })
                .collect()
        };
        let t = CtaTimeline {
            attention: per_layer(self.gpu.download(&b.attn)?),
            fetch: per_layer(self.gpu.download(&b.fetch)?),
        };
        Ok((t, b.overflow.load(Ordering::Relaxed)))
    }

    /// Whether the per-CTA timeline is on.
    pub(crate) fn cta_log_on(&self) -> bool {
        self.cta_log.is_some()
    }

    /// The record address for a launch of `kernel` with `ctas` CTAs in
    /// layer `layer`, or 0 (nothing recorded) when the timeline is off or
    /// the launch has more CTAs than the buffers hold (noted as overflow).
    pub(crate) fn cta_log_ptr(&self, kernel: CtaKernel, layer: usize, ctas: usize) -> u64 {
        let Some(b) = self.cta_log.as_ref() else {
            return 0;
        };
        if ctas > b.cap || layer >= self.layers.len() {
            b.overflow.store(true, Ordering::Relaxed);
            return 0;
        }
        let buf = match kernel {
            CtaKernel::Attention => &b.attn,
            CtaKernel::Fetch => &b.fetch,
        };
        dptr(&self.gpu, buf) + (layer * b.cap * WORDS * 8) as u64
    }
}
