//! Timing the pieces of a decode step and the layer-GEMM ceiling
//! (benchmarks only; spec/device.md).

use super::*;

/// Per-layer figures of the layer-GEMM ceiling ([`GpuModel::gemm_ceiling`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmCeiling {
    /// Rows (batch size) of every GEMM.
    pub batch: usize,
    /// Median over replays of the graph of every layer's four GEMMs
    /// (QKV+z, O, gate|up, down), all through cuBLAS, milliseconds: the
    /// ceiling of spec/device.md.
    pub layers_graph_ms: f64,
    /// The same graph with the engine's own routing ([`Gpu::linear`]: the
    /// small-batch kernel `gemv` where it takes the shape when
    /// [`Gpu::small_gemv_takes`] the batch, else cuBLAS too), milliseconds.
    pub layers_graph_ms_engine: f64,
    /// Median of the lm_head GEMM alone (f32 logits), milliseconds.
    pub lm_head_ms: f64,
    /// Weight bytes the layer GEMMs read per replay.
    pub layer_weight_bytes: usize,
    /// layer_weight_bytes / layers_graph_ms, GB/s.
    pub layers_gb_per_s: f64,
    /// Replays timed.
    pub reps: usize,
}

impl GpuModel {
    /// Times each piece of the current decode step ([`StepPart`]) alone: per
    /// piece, its launches for the whole step (every layer) captured as one
    /// CUDA graph, two warm-up replays, then the median of `reps` replays, in
    /// milliseconds per step. Pieces that do not run in this step (selection
    /// in a dense step) and [`StepPart::Argmax`] (it would advance the step
    /// inputs) are left out. Replays repeat the step's side effects (the
    /// same token appended again, queries rotated again), so the batch's
    /// state is garbage afterwards: the step is dropped, and the sequences
    /// must be dropped too.
    ///
    /// Errors: [`Error::Input`] without a device-resident step (run a
    /// decode step first), for reps 0, or on the host selection path;
    /// [`Error::Cuda`] on a failure.
    pub fn profile_step(&mut self, reps: usize) -> Result<Vec<(StepPart, f64)>> {
        if reps == 0 {
            return Err(Error::Input("profile_step: reps must be ≥ 1".into()));
        }
        let mut st = self.step.take().ok_or_else(|| {
            Error::Input("profile_step: no device-resident decode step; run one first".into())
        })?;
        if st.key.host_selection {
            self.step = Some(st);
            return Err(Error::Input(
                "profile_step: the host selection path cannot be captured per piece".into(),
            ));
        }
        self.last = LastLogits::None;
        let gpu = self.gpu.clone();
        let sparse = st.attn.sparse;
        let gpu_sel = self.gpu_selection();
        // on the fused GEMVs these pieces are folded into the projections
        let fused = self.gemv_fusion_applies(st.n);
        let mut out = Vec::new();
        for part in StepPart::ALL {
            let applies = match part {
                StepPart::Argmax => false,
                StepPart::NormPost | StepPart::Swiglu | StepPart::FinalNorm => !fused,
                StepPart::Compress => gpu_sel,
                StepPart::WindowScores | StepPart::Select => sparse,
                _ => true,
            };
            if !applies {
                continue;
            }
            self.only_part.set(Some(part));
            let g = gpu.capture(|| self.enqueue_step(&mut st, &mut []));
            self.only_part.set(None);
            let g = g?;
            for _ in 0..2 {
                g.launch().cuda("cuGraphLaunch")?;
            }
            let mut ms = Vec::with_capacity(reps);
            for _ in 0..reps {
                let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
                a.record(gpu.stream()).cuda("cuEventRecord")?;
                g.launch().cuda("cuGraphLaunch")?;
                b.record(gpu.stream()).cuda("cuEventRecord")?;
                b.synchronize().cuda("cuEventSynchronize")?;
                ms.push(a.elapsed_ms(&b).cuda("cuEventElapsedTime")? as f64);
            }
            ms.sort_by(f64::total_cmp);
            out.push((part, ms[ms.len() / 2]));
        }
        drop(st);
        Ok(out)
    }

    /// Times the layer GEMMs alone (runtime.md §4's ceiling): every layer's
    /// QKV+z, O, gate|up and down GEMMs at `batch` rows on random bf16
    /// activations, captured as one CUDA graph and replayed `reps` times
    /// (after three warm-up replays), median per replay; and the lm_head
    /// GEMM alone, eagerly, median of `reps`.
    ///
    /// Errors: [`Error::Input`] for batch 0 or reps 0; [`Error::Cuda`] on a
    /// device failure.
    pub fn gemm_ceiling(&self, batch: usize, reps: usize) -> Result<GemmCeiling> {
        if batch == 0 || reps == 0 {
            return Err(Error::Input(
                "gemm_ceiling: batch and reps must be ≥ 1".into(),
            ));
        }
        let gpu = &*self.gpu;
        let c = &self.config;
        let (d, hq, dh, inter, vocab) = (
            c.hidden_size,
            c.num_attention_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        );
        let w = self.qkv_cols;
        let width = d.max(inter).max(hq * dh);
        let x: CudaSlice<Bf16> = gpu.zeros(batch * width)?;
        {
            let f = gpu.function("fill_normal_bf16")?;
            let (p, n, seed, scale) = (dptr(gpu, &x), (batch * width) as u64, 7u64, 1.0f32);
            let mut b = gpu.stream().launch_builder(f);
            b.arg(&p).arg(&n).arg(&seed).arg(&scale);
            let cfg = LaunchConfig {
                grid_dim: ((batch * width).div_ceil(256).min(16_384) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument list matches kernels/synth.cu; x holds n values.
            unsafe { b.launch(cfg) }.cuda("fill_normal_bf16")?;
        }
        let mut yq: CudaSlice<Bf16> = gpu.zeros(batch * w)?;
        let mut yo: CudaSlice<Bf16> = gpu.zeros(batch * d)?;
        let mut yg: CudaSlice<Bf16> = gpu.zeros(batch * 2 * inter)?;
        let mut logits: CudaSlice<f32> = gpu.zeros(batch * vocab)?;
        let enqueue = |yq: &mut CudaSlice<Bf16>,
                       yo: &mut CudaSlice<Bf16>,
                       yg: &mut CudaSlice<Bf16>|
         -> Result<()> {
            for lw in &self.layers {
                gpu.linear(&x.slice(0..batch * d), batch, d, &lw.wqkv, w, yq)?;
                gpu.linear(&x.slice(0..batch * hq * dh), batch, hq * dh, &lw.wo, d, yo)?;
                gpu.linear(&x.slice(0..batch * d), batch, d, &lw.wgu, 2 * inter, yg)?;
                gpu.linear(&x.slice(0..batch * inter), batch, inter, &lw.wdown, d, yo)?;
            }
            Ok(())
        };
        // Warm up eagerly (cuBLAS picks its kernels), then capture: once with
        // cuBLAS alone, once with the engine's routing.
        let small = gpu.small_gemv_rows();
        gpu.set_small_gemv_rows(0);
        let captured = (|| -> Result<(CudaGraph, CudaGraph)> {
            enqueue(&mut yq, &mut yo, &mut yg)?;
            gpu.synchronize()?;
            let cublas = gpu.capture(|| enqueue(&mut yq, &mut yo, &mut yg))?;
            gpu.set_small_gemv_rows(small);
            enqueue(&mut yq, &mut yo, &mut yg)?;
            gpu.synchronize()?;
            let engine = gpu.capture(|| enqueue(&mut yq, &mut yo, &mut yg))?;
            Ok((cublas, engine))
        })();
        gpu.set_small_gemv_rows(small);
        let (graph, graph_engine) = captured?;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            let (a, b) = (gpu.timing_event()?, gpu.timing_event()?);
            a.record(gpu.stream()).cuda("cuEventRecord")?;
            f()?;
            b.record(gpu.stream()).cuda("cuEventRecord")?;
            b.synchronize().cuda("cuEventSynchronize")?;
            Ok(a.elapsed_ms(&b).cuda("cuEventElapsedTime")? as f64)
        };
        for _ in 0..3 {
            graph.launch().cuda("cuGraphLaunch")?;
        }
        let mut layer_ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            layer_ms.push(time(&mut || graph.launch().cuda("cuGraphLaunch"))?);
        }
        for _ in 0..3 {
            graph_engine.launch().cuda("cuGraphLaunch")?;
        }
        let mut engine_ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            engine_ms.push(time(&mut || graph_engine.launch().cuda("cuGraphLaunch"))?);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut head_ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            head_ms.push(time(&mut || {
                gpu.linear(
                    &x.slice(0..batch * d),
                    batch,
                    d,
                    head,
                    vocab,
                    &mut logits.slice_mut(0..batch * vocab),
                )
            })?);
        }
        let layer_weight_bytes: usize = self
            .layers
            .iter()
            .map(|l| (l.wqkv.len() + l.wo.len() + l.wgu.len() + l.wdown.len()) * 2)
            .sum();
        let layers_graph_ms = median(&mut layer_ms);
        Ok(GemmCeiling {
            batch,
            layers_graph_ms,
            layers_graph_ms_engine: median(&mut engine_ms),
            lm_head_ms: median(&mut head_ms),
            layer_weight_bytes,
            layers_gb_per_s: layer_weight_bytes as f64 / (layers_graph_ms * 1e-3) / 1e9,
            reps,
        })
    }
}
