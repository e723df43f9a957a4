//! Fetching a layer's misses from pinned host memory into their slots
//! (runtime.md §1 step 5, §4): the persistent UVA copy kernel `kv_fetch_sm`,
//! the copy engines (`cuMemcpyBatchAsync`), or both at once on a split of
//! the misses ([`crate::kv::split`]), synchronously in the layer or as a
//! prefetch on the copy stream (forecast mode), with optional event timing
//! and the offload counters.

use super::offload::*;
use crate::cuda::context::{dptr, CudaResultExt};
use crate::pipeline::cta_log::CtaKernel;
use crate::pipeline::*;
use crate::{Error, Result};
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// How misses are fetched from host memory (runtime.md §4; `--fetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchEngine {
    /// The persistent UVA copy kernel on a fixed grid of `ctas` CTAs
    /// (`--fetch sm --prefetch-ctas N`).
    Sm {
        /// CTAs of the copy kernel (SparDA's default for the H200: 16).
        ctas: usize,
    },
    /// The copy engines: one `cuMemcpyBatchAsync` per layer per step over
    /// the misses (32 KiB chunks at D = 128). The host reads each layer's
    /// fetch lists first, so this engine synchronises once per layer.
    Dma,
    /// Both at once on a split of each layer's misses
    /// ([`crate::kv::split`]): `ce_pct` % of the layer's (block, head)
    /// chunks (rounded, per layer and step) through one `cuMemcpyBatchAsync`
    /// on a side stream, the rest through the SM kernel on `ctas` CTAs on
    /// the fetch stream, which then waits for the copy engines
    /// (`--fetch split:CTAS:PCT`). Reads the fetch lists on the host like
    /// [`FetchEngine::Dma`]: one synchronisation per layer.
    Split {
        /// CTAs of the SM kernel's share (1 … 1024).
        ctas: usize,
        /// The copy engines' share of each layer's misses, % (1 … 99).
        ce_pct: usize,
    },
    /// Chosen per batch size and schedule from the GPU's fetch table
    /// ([`crate::kv::fetch_table`]), else by [`fetch_rule`] (the default).
    Auto,
}

/// The default fetch engine for `batch` sequences on the GPU named
/// `gpu_name` (runtime.md §2, §4), used by [`FetchEngine::Auto`] on a GPU
/// without a fetch table ([`crate::kv::fetch_table`]):
/// - the SM copy kernel everywhere: on the H200 (2026-11-30,
///   benches/results/offload_sync_vs_gpu_resident_grid_h200_2026-11-30_a8338ae.json) it moved 49.5–50.8 GB/s on 16
///   CTAs at B = 16–64 against 19.5–24.3 GB/s for the copy engines (32 KiB
///   chunks, one host sync per layer for the fetch list);
/// - its CTA count as SparDA's authors set it: H100 16 for B ≤ 16 else 32,
///   A100 16 for B ≤ 32 else 32, every other GPU (the H200 included) 16 —
///   on the H200 8–32 CTAs all reach 51 GB/s alone (gpu-check), so more
///   CTAs would only take SMs from the compute stream.
pub fn fetch_rule(gpu_name: &str, batch: usize) -> FetchEngine {
    let name = gpu_name.to_ascii_uppercase();
    let ctas = if name.contains("H100") {
        if batch <= 16 {
            16
        } else {
            32
        }
    } else if name.contains("A100") {
        if batch <= 32 {
            16
        } else {
            32
        }
    } else {
        16
    };
    FetchEngine::Sm { ctas }
}

/// The `--fetch` values [`FetchEngine::parse`] accepts, for help and errors.
pub const FETCH_FORMS: &str = "`auto`, `sm` (16 CTAs, or --prefetch-ctas), `sm:N`, `dma` or `split:N:P` (N = 1 … 1024 SM-kernel CTAs, P = 1 … 99 % of each layer's misses through the copy engines)";

impl FetchEngine {
    /// Name used in reports: `sm`, `dma`, `split` or `auto`
    /// ([`FetchEngine::label`] adds the numbers).
    pub fn name(&self) -> &'static str {
        match self {
            FetchEngine::Sm { .. } => "sm",
            FetchEngine::Dma => "dma",
            FetchEngine::Split { .. } => "split",
            FetchEngine::Auto => "auto",
        }
    }

    /// The `--fetch` spelling of this engine: `sm:N`, `dma`, `split:N:P`
    /// or `auto` ([`FetchEngine::parse`] reads it back; the fetch table's
    /// labels are the same).
    pub fn label(&self) -> String {
        match *self {
            FetchEngine::Sm { ctas } => format!("sm:{ctas}"),
            FetchEngine::Dma => "dma".into(),
            FetchEngine::Split { ctas, ce_pct } => format!("split:{ctas}:{ce_pct}"),
            FetchEngine::Auto => "auto".into(),
        }
    }

    /// Reads a `--fetch` value: `auto`, `sm` (the SM kernel on
    /// [`DEFAULT_FETCH_CTAS`](crate::cuda::ops::offload::DEFAULT_FETCH_CTAS)
    /// CTAs), or a fetch table label — `sm:N`, `dma`, `split:N:P`
    /// ([`FetchChoice::parse_label`](crate::kv::fetch_table::FetchChoice::parse_label)).
    ///
    /// Errors: [`Error::Input`] naming the value and the accepted forms
    /// and ranges ([`FETCH_FORMS`]).
    pub fn parse(value: &str) -> Result<FetchEngine> {
        match value {
            "auto" => Ok(FetchEngine::Auto),
            "sm" => Ok(FetchEngine::Sm {
                ctas: crate::cuda::ops::offload::DEFAULT_FETCH_CTAS,
            }),
            // a table's whole-SM configuration is not an engine: the flags that run it
            _ if value.starts_with("sm-whole:") => Err(Error::Input(format!(
                "--fetch `{value}`: a fetch-table configuration; give `--fetch sm:{} --fetch-whole-sms` (the same copies on whole SMs)",
                value.trim_start_matches("sm-whole:")
            ))),
            _ => crate::kv::fetch_table::FetchChoice::parse_label(value)
                .map(|c| c.engine())
                .map_err(|e| match e {
                    Error::Input(m) if m.ends_with(crate::kv::fetch_table::LABEL_FORMS) => {
                        Error::Input(format!(
                            "{}{FETCH_FORMS}",
                            m.trim_end_matches(crate::kv::fetch_table::LABEL_FORMS)
                        ))
                    }
                    e => e,
                }),
        }
    }

    /// Checks the ranges of an engine built in code (what
    /// [`FetchEngine::parse`] checks for a value): CTAs 1 … 1024, a split's
    /// copy-engine share 1 … 99 %.
    ///
    /// Errors: [`Error::Input`] naming the engine and the value.
    pub fn validate(&self) -> Result<()> {
        match *self {
            FetchEngine::Sm { ctas } => crate::kv::fetch_table::FetchChoice::Sm { ctas }.validate(),
            FetchEngine::Split { ctas, ce_pct } => {
                crate::kv::fetch_table::FetchChoice::Split { ctas, ce_pct }.validate()
            }
            FetchEngine::Dma | FetchEngine::Auto => Ok(()),
        }
    }
}

impl GpuModel {
    /// Enqueues the fetch of layer `l`'s misses (as its last `slot_diff`
    /// listed them) on `stream` with the configured engine, timed by events
    /// when fetch timing is on; with an injected copy delay
    /// ([`GpuModel::set_copy_delay_us`]) a spin kernel runs first.
    pub(crate) fn offload_fetch(
        &self,
        st: &mut DecodeStep,
        l: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let (hk, dh) = (c.num_key_value_heads, c.head_dim);
        let n = st.n;
        let bs = self.plan.budget.block_size;
        let Some(off) = st.off.as_mut() else {
            return Ok(());
        };
        let sl_slots = off.slots;
        let tab = dptr(gpu, &off.tabs) + (l * 3 * n * 8) as u64;
        let (pool_tab, host_tab) = (tab, tab + (2 * n * 8) as u64);
        let fetch = dptr(gpu, &off.fetch) + ((l * n * hk * sl_slots * 2) * 4) as u64;
        let nfetch = dptr(gpu, &off.nfetch) + ((l * n * hk) * 4) as u64;
        if self.copy_delay_us > 0 {
            let f = gpu.function("spin_wait")?;
            let ns = self.copy_delay_us as u64 * 1000;
            let mut b = stream.launch_builder(f);
            b.arg(&ns);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches spin_wait (kernels/forecast.cu).
            unsafe { b.launch(cfg) }.cuda("spin_wait")?;
        }
        let timed = self.fetch_timing && !off.timing.is_empty();
        if timed {
            off.timing[l]
                .0
                .record(stream)
                .cuda("cuEventRecord (fetch)")?;
        }
        let span = self.tspan(stream, crate::trace::Track::Copy, "fetch", l)?;
        self.note_fetch_span(l, span);
        match self.fetch_engine(n) {
            FetchEngine::Sm { ctas } => {
                let args = crate::cuda::ops::offload::FetchArgs {
                    fetch,
                    nfetch,
                    slots: sl_slots,
                    rows: n,
                    kv_heads: hk,
                    host_tab,
                    pool_tab,
                    block_size: bs,
                    head_dim: dh,
                    cta_log: self.cta_log_ptr(CtaKernel::Fetch, l, ctas),
                };
                crate::cuda::ops::offload::kv_fetch_sm(
                    gpu,
                    stream,
                    &args,
                    ctas,
                    self.fetch_whole_sms_for(n, ctas),
                )?;
            }
            FetchEngine::Dma => self.fetch_dma_layer(off, l, n, stream)?,
            FetchEngine::Split { ctas, ce_pct } => {
                self.fetch_split_layer(off, l, n, stream, ctas, ce_pct)?
            }
            FetchEngine::Auto => {
                return Err(Error::Input(
                    "fetch engine left unresolved (fetch_rule never returns Auto)".into(),
                ))
            }
        }
        self.tspan_end(stream, span)?;
        if timed {
            off.timing[l]
                .1
                .record(stream)
                .cuda("cuEventRecord (fetch)")?;
        }
        Ok(())
    }

    /// The copy-engine fetch of layer `l`: waits for the layer's fetch
    /// lists (one host synchronisation of the compute stream), then one
    /// `cuMemcpyBatchAsync` on `stream`.
    pub(crate) fn fetch_dma_layer(
        &self,
        off: &StepOffload,
        l: usize,
        n: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let hk = self.config.num_key_value_heads;
        let s_slots = off.slots;
        let nf = gpu.download(&off.nfetch.slice(l * n * hk..(l + 1) * n * hk))?;
        if nf.iter().all(|&x| x <= 0) {
            return Ok(());
        }
        let base = l * n * hk * s_slots * 2;
        let fl = gpu.download(&off.fetch.slice(base..base + n * hk * s_slots * 2))?;
        let tabs = &off.tabs_host[l * 3 * n..(l + 1) * 3 * n];
        let rows: Vec<crate::cuda::ops::offload::DmaRow> = (0..n)
            .map(|r| crate::cuda::ops::offload::DmaRow {
                host: tabs[2 * n + r],
                pool: tabs[r],
            })
            .collect();
        crate::cuda::ops::offload::fetch_dma(
            gpu,
            stream,
            &fl,
            &nf,
            s_slots,
            hk,
            &rows,
            self.plan.budget.block_size,
            self.config.head_dim,
        )
        .map(drop)
    }

    /// The split fetch of layer `l` ([`FetchEngine::Split`]): waits for the
    /// layer's fetch lists (one host synchronisation of the compute stream,
    /// as the copy engines alone do), then enqueues the copy engines' share
    /// on the step's split side stream and the SM kernel's share on
    /// `stream`, which afterwards waits for the side stream — so the
    /// attention of the layer, which follows `stream` (synchronous fetch)
    /// or its `fetched(l)` event (prefetch on the copy stream), waits for
    /// both ([`crate::cuda::ops::offload::fetch_split`] explains the order).
    pub(crate) fn fetch_split_layer(
        &self,
        off: &mut StepOffload,
        l: usize,
        n: usize,
        stream: &Arc<CudaStream>,
        ctas: usize,
        ce_pct: usize,
    ) -> Result<()> {
        use crate::cuda::ops::offload::{fetch_split, DmaRow, FetchArgs, SplitStreams};
        let gpu = &*self.gpu;
        let hk = self.config.num_key_value_heads;
        let s_slots = off.slots;
        // Made before the downloads below: they synchronise the compute
        // stream, so the zeroing of the new counts buffer (enqueued there)
        // is done before the copy stream writes to it in prefetch mode.
        if off.split.is_none() {
            off.split = Some(SplitSide::new(gpu, off.offloaded.len(), n * hk)?);
        }
        let nf = gpu.download(&off.nfetch.slice(l * n * hk..(l + 1) * n * hk))?;
        if nf.iter().all(|&x| x <= 0) {
            return Ok(());
        }
        let base = l * n * hk * s_slots * 2;
        let fl = gpu.download(&off.fetch.slice(base..base + n * hk * s_slots * 2))?;
        let tabs = &off.tabs_host[l * 3 * n..(l + 1) * 3 * n];
        let rows: Vec<DmaRow> = (0..n)
            .map(|r| DmaRow {
                host: tabs[2 * n + r],
                pool: tabs[r],
            })
            .collect();
        let tab = dptr(gpu, &off.tabs) + (l * 3 * n * 8) as u64;
        let args = FetchArgs {
            fetch: dptr(gpu, &off.fetch) + (base * 4) as u64,
            nfetch: dptr(gpu, &off.nfetch) + ((l * n * hk) * 4) as u64,
            slots: s_slots,
            rows: n,
            kv_heads: hk,
            host_tab: tab + (2 * n * 8) as u64,
            pool_tab: tab,
            block_size: self.plan.budget.block_size,
            head_dim: self.config.head_dim,
            cta_log: self.cta_log_ptr(CtaKernel::Fetch, l, ctas),
        };
        let Some(side) = off.split.as_mut() else {
            return Err(Error::Input("split fetch: no side stream".into()));
        };
        let streams = SplitStreams {
            fetch: stream,
            ce: &side.stream,
            fork: &side.fork[l],
            join: &side.join[l],
            ce_delay_ns: self.copy_delay_us as u64 * 1000,
            whole_sms: self.fetch_whole_sms_for(n, ctas),
        };
        let mut counts = side.sm_counts.slice_mut(l * n * hk..(l + 1) * n * hk);
        fetch_split(
            gpu,
            &streams,
            &args,
            &fl,
            &nf,
            &rows,
            &mut counts,
            ctas,
            ce_pct,
        )
        .map(drop)
    }

    /// Prefetch of layer `l` (forecast mode, runtime.md §2): records
    /// ready(l) on the compute stream after its diff; the copy stream waits
    /// for it, fetches the misses and records fetched(l).
    pub(crate) fn offload_prefetch(&self, st: &mut DecodeStep, l: usize) -> Result<()> {
        let Some(off) = st.off.as_ref() else {
            return Ok(());
        };
        let cs = off.copy_stream.clone();
        off.ready[l]
            .record(self.gpu.stream())
            .cuda("cuEventRecord (ready)")?;
        cs.wait(&off.ready[l]).cuda("cuStreamWaitEvent (ready)")?;
        self.offload_fetch(st, l, &cs)?;
        let off = st.off.as_ref().expect("offloaded");
        off.fetched[l].record(&cs).cuda("cuEventRecord (fetched)")?;
        Ok(())
    }

    /// The compute stream waits for fetched(l) before layer `l`'s attention.
    pub(crate) fn offload_wait_fetched(&self, st: &DecodeStep, l: usize) -> Result<()> {
        match st.off.as_ref() {
            Some(off) if off.offloaded[l] => self
                .gpu
                .stream()
                .wait(&off.fetched[l])
                .cuda("cuStreamWaitEvent (fetched)"),
            _ => Ok(()),
        }
    }

    /// Adds the fetch times of the last step (synchronises).
    pub(crate) fn offload_collect_timing(&mut self) -> Result<()> {
        if !self.fetch_timing {
            return Ok(());
        }
        let Some(off) = self.step.as_ref().and_then(|s| s.off.as_ref()) else {
            return Ok(());
        };
        let mut ms = 0.0f64;
        for (l, (a, b)) in off.timing.iter().enumerate() {
            if off.offloaded[l] {
                ms += a.elapsed_ms(b).cuda("cuEventElapsedTime (fetch)")? as f64;
            }
        }
        self.fetch_ms += ms;
        let counters = self.gpu.download(&self.offload_counters)?;
        let fetched: u64 = counters.iter().skip(1).step_by(2).sum();
        self.timed_bytes += (fetched - self.fetched_at_timing) * self.chunk_bytes() as u64;
        self.fetched_at_timing = fetched;
        Ok(())
    }

    pub(crate) fn chunk_bytes(&self) -> usize {
        2 * self.plan.budget.block_size * self.config.head_dim * 2
    }

    /// Times every fetch with CUDA events from the next step on (each
    /// step then synchronises once to read them), for the fetch GB/s of
    /// [`OffloadStats`]. Off by default: throughput runs stay free of it.
    pub fn set_fetch_timing(&mut self, on: bool) -> Result<()> {
        if on != self.fetch_timing {
            self.fetch_timing = on;
            self.step = None;
        }
        let counters = self.gpu.download(&self.offload_counters)?;
        self.fetched_at_timing = counters.iter().skip(1).step_by(2).sum();
        Ok(())
    }

    /// The offload counters (synchronises).
    ///
    /// Errors: [`Error::Cuda`] on a copy failure; a device error raised
    /// since the last check (e.g. `slot_diff` with more misses than free
    /// slots; see [`GpuModel::check_device_errors`]).
    pub fn offload_stats(&self) -> Result<OffloadStats> {
        let counters = self.gpu.download(&self.offload_counters)?;
        self.device_errors.take()?;
        Ok(OffloadStats {
            selected: counters.iter().step_by(2).copied().collect(),
            fetched: counters.iter().skip(1).step_by(2).copied().collect(),
            chunk_bytes: self.chunk_bytes(),
            fetch_ms: self.fetch_ms,
            timed_bytes: self.timed_bytes,
            steps: self.offload_steps,
        })
    }

    /// Zeroes the offload counters.
    pub fn reset_offload_stats(&mut self) -> Result<()> {
        self.gpu
            .stream()
            .memset_zeros(&mut self.offload_counters)
            .cuda("zeroing the offload counters")?;
        self.fetch_ms = 0.0;
        self.timed_bytes = 0;
        self.fetched_at_timing = 0;
        self.offload_steps = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_values_parse_print_and_refuse_unknown_ones_by_name() {
        assert_eq!(FetchEngine::parse("auto").unwrap(), FetchEngine::Auto);
        assert_eq!(
            FetchEngine::parse("sm").unwrap(),
            FetchEngine::Sm { ctas: 16 }
        );
        for e in [
            FetchEngine::Auto,
            FetchEngine::Dma,
            FetchEngine::Sm { ctas: 8 },
            FetchEngine::Split {
                ctas: 8,
                ce_pct: 50,
            },
        ] {
            assert_eq!(FetchEngine::parse(&e.label()).unwrap(), e);
            e.validate().unwrap();
        }
        assert_eq!(
            FetchEngine::Split {
                ctas: 4,
                ce_pct: 75
            }
            .label(),
            "split:4:75"
        );
        assert_eq!(
            FetchEngine::Split {
                ctas: 4,
                ce_pct: 75
            }
            .name(),
            "split"
        );
        for v in ["warp", "split:8:100", "split:0:50", "sm:", "split::"] {
            let e = FetchEngine::parse(v).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{v}`")) && e.ends_with(FETCH_FORMS),
                "{v}: {e}"
            );
        }
        let e = FetchEngine::Split { ctas: 8, ce_pct: 0 }
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("split:8:0") && e.contains("1 … 99"), "{e}");
        // a table's whole-SM configuration is not an engine: the flags that run it
        let e = FetchEngine::parse("sm-whole:8").unwrap_err().to_string();
        assert!(
            e.contains("--fetch sm:8 --fetch-whole-sms`") && !e.contains("reserve-fetch-sms"),
            "{e}"
        );
        let e = FetchEngine::parse("sm-whole:0").unwrap_err().to_string();
        assert!(
            e.contains("`sm-whole:0`") && e.contains("--fetch sm:0 --fetch-whole-sms"),
            "{e}"
        );
    }
}
