//! L2 prefetch of the O projection's weights during attention
//! (runtime.md §4, "L2 prefetch of the O projection").
//!
//! At small batch a decode layer's attention, split-K combine and RoPE
//! read little from device memory (4.2 MB of KV per layer at B = 1, 4K
//! tokens, NOSA-8B) and are bound by latency, while the O projection that
//! follows streams its whole weight (33.6 MB for NOSA-8B) at the GEMM's
//! small-shape rate. So the layer forks a side stream after its QKV GEMM,
//! asks the L2 to load W_o there (`l2_prefetch`, kernels/l2_prefetch.cu)
//! while attention runs, and joins it before the O projection, which then
//! reads its weight from L2. The values computed are the same with or
//! without it (the prefetch writes nothing); only the time changes.
//!
//! It applies to decode steps of at most [`L2_PREFETCH_MAX_ROWS`] rows with
//! GPU-resident KV (offloaded steps keep the device's bandwidth for the
//! PCIe fetch path), when W_o takes at most 3/4 of the L2.
//! `SPARDA_L2_PREFETCH=0` turns it off, `=1` (the default) leaves it to
//! that rule; `SPARDA_L2_PREFETCH_MB=N` prefetches only the first N MB of
//! W_o (the sweep of `scripts/device/offload.sh l2`).

use super::*;
use cudarc::driver::{CudaEvent, CudaStream};

/// Decode steps of at most this many rows prefetch W_o into L2.
pub const L2_PREFETCH_MAX_ROWS: usize = 16;
/// Bytes per bulk prefetch request (a multiple of 16).
const CHUNK_BYTES: u32 = 16 * 1024;
/// Thread blocks of the prefetch kernel (each thread issues a request or
/// two; the kernel ends when they are issued, not when they land).
const PREFETCH_CTAS: u32 = 16;

/// The side stream and the per-layer fork / join events of the prefetch.
pub(crate) struct L2Prefetch {
    stream: Arc<CudaStream>,
    fork: Vec<CudaEvent>,
    join: Vec<CudaEvent>,
}

/// `SPARDA_L2_PREFETCH` (on unless "0") and `SPARDA_L2_PREFETCH_MB`
/// (bytes cap; none by default), read once.
fn env_setting() -> (bool, Option<usize>) {
    static SETTING: std::sync::OnceLock<(bool, Option<usize>)> = std::sync::OnceLock::new();
    *SETTING.get_or_init(|| {
        let on = std::env::var("SPARDA_L2_PREFETCH").map_or(true, |v| v != "0");
        let cap = std::env::var("SPARDA_L2_PREFETCH_MB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|mb| mb << 20);
        (on, cap)
    })
}

/// Whether a step of `rows` rows prefetches a weight of `weight_bytes` into
/// an L2 of `l2_bytes`: on, at most [`L2_PREFETCH_MAX_ROWS`] rows,
/// GPU-resident KV, and the weight within 3/4 of the L2.
pub fn l2_prefetch_applies(
    on: bool,
    rows: usize,
    offloaded: bool,
    weight_bytes: usize,
    l2_bytes: usize,
) -> bool {
    on && rows > 0
        && rows <= L2_PREFETCH_MAX_ROWS
        && !offloaded
        && weight_bytes > 0
        && weight_bytes <= l2_bytes / 4 * 3
}

impl L2Prefetch {
    /// A side stream and 2·`layers` events.
    ///
    /// Errors: [`Error::Cuda`] when a stream or an event cannot be made.
    pub(crate) fn new(gpu: &Gpu, layers: usize) -> Result<L2Prefetch> {
        Ok(L2Prefetch {
            stream: gpu
                .context()
                .new_stream()
                .cuda("cuStreamCreate (L2 prefetch)")?,
            fork: crate::kv::offload::sync_events(gpu, layers, "cuEventCreate (L2 prefetch fork)")?,
            join: crate::kv::offload::sync_events(gpu, layers, "cuEventCreate (L2 prefetch join)")?,
        })
    }
}

impl GpuModel {
    /// Whether this step (of `rows` rows, offloaded or not) prefetches W_o
    /// ([`l2_prefetch_applies`] on this GPU's L2 and this model's W_o).
    pub(crate) fn o_prefetch_applies(&self, rows: usize, offloaded: bool) -> bool {
        let (on, _) = env_setting();
        let c = &self.config;
        let wo_bytes = c.num_attention_heads * c.head_dim * c.hidden_size * 2;
        self.l2_prefetch.is_some()
            && l2_prefetch_applies(on, rows, offloaded, wo_bytes, self.gpu.info().l2_bytes)
    }

    /// Forks the side stream off the compute stream and enqueues the
    /// prefetch of layer `l`'s W_o there (when this step prefetches).
    pub(crate) fn o_prefetch_fork(&self, l: usize) -> Result<()> {
        let Some(p) = self.l2_prefetch.as_ref().filter(|_| self.o_prefetch.get()) else {
            return Ok(());
        };
        let gpu = &*self.gpu;
        p.fork[l]
            .record(gpu.stream())
            .cuda("cuEventRecord (L2 prefetch fork)")?;
        p.stream
            .wait(&p.fork[l])
            .cuda("cuStreamWaitEvent (L2 prefetch fork)")?;
        let wo = &self.layers[l].wo;
        let bytes = env_setting()
            .1
            .map_or(wo.len() * 2, |cap| cap.min(wo.len() * 2));
        ops::launch_l2_prefetch(
            gpu,
            &p.stream,
            dptr(gpu, wo),
            bytes,
            CHUNK_BYTES,
            PREFETCH_CTAS,
        )?;
        p.join[l]
            .record(&p.stream)
            .cuda("cuEventRecord (L2 prefetch join)")?;
        Ok(())
    }

    /// The compute stream waits for layer `l`'s prefetch requests to be
    /// issued (before the O projection).
    pub(crate) fn o_prefetch_join(&self, l: usize) -> Result<()> {
        let Some(p) = self.l2_prefetch.as_ref().filter(|_| self.o_prefetch.get()) else {
            return Ok(());
        };
        self.gpu
            .stream()
            .wait(&p.join[l])
            .cuda("cuStreamWaitEvent (L2 prefetch join)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L2: usize = 50 << 20;
    const WO_8B: usize = 4096 * 4096 * 2;

    #[test]
    fn prefetch_applies_to_small_gpu_resident_steps_whose_weight_fits() {
        assert!(l2_prefetch_applies(true, 1, false, WO_8B, L2));
        assert!(l2_prefetch_applies(
            true,
            L2_PREFETCH_MAX_ROWS,
            false,
            WO_8B,
            L2
        ));
        // off, too many rows, no rows, offloaded KV
        assert!(!l2_prefetch_applies(false, 1, false, WO_8B, L2));
        assert!(!l2_prefetch_applies(
            true,
            L2_PREFETCH_MAX_ROWS + 1,
            false,
            WO_8B,
            L2
        ));
        assert!(!l2_prefetch_applies(true, 0, false, WO_8B, L2));
        assert!(!l2_prefetch_applies(true, 1, true, WO_8B, L2));
    }

    #[test]
    fn prefetch_needs_the_weight_within_three_quarters_of_the_l2() {
        // 37.5 MiB of a 50 MiB L2 fits; one byte more does not; an unknown L2 (0) never
        assert!(l2_prefetch_applies(true, 1, false, L2 / 4 * 3, L2));
        assert!(!l2_prefetch_applies(true, 1, false, L2 / 4 * 3 + 1, L2));
        assert!(!l2_prefetch_applies(true, 1, false, WO_8B, 0));
        assert!(!l2_prefetch_applies(true, 1, false, 0, L2));
    }
}
