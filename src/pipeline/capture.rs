//! Activation capture for `sparda forecast collect --backend cuda`
//! (forecast/README.md "collect"): at chosen positions, each layer's
//! normalized attention input x̂ and its post-RoPE query, read back from the
//! forward call's workspace after the layer's front half (spec §4 "Forecast
//! mode": what the forecast sees, and what layer l+1's selection scores).

use super::*;
use std::collections::BTreeSet;

/// One captured row of one layer ([`GpuModel::set_capture`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuCapturedRow {
    /// Token position in its sequence.
    pub position: usize,
    /// x̂: the layer's RMSNorm'd attention input, \[d\] (f32 from the bf16
    /// the QKV GEMM reads).
    pub xn: Vec<f32>,
    /// The layer's queries after RoPE (bias included), \[H·D\] (f32 from
    /// bf16), rotated at the position with the table the call used.
    pub q_rope: Vec<f32>,
}

/// What [`GpuModel::set_capture`] asked for and what was captured since.
#[derive(Debug, Default)]
pub(crate) struct GpuCapture {
    pub(crate) positions: BTreeSet<usize>,
    /// `rows[layer]`: the captured rows of that layer, in call order.
    pub(crate) rows: Vec<Vec<GpuCapturedRow>>,
}

impl GpuModel {
    /// From now on every prefill chunk ([`GpuModel::prefill`], one sequence
    /// per call) records, for its rows at `positions` (absolute token
    /// positions of that sequence), each layer's x̂
    /// and post-RoPE query ([`GpuCapturedRow`]) until
    /// [`GpuModel::take_capture`]. Each layer of a chunk with such rows
    /// synchronises and copies its x̂ and QKV rows to the host (n·(d + H·D)
    /// bf16 values), so capturing slows prefill. Decode steps capture
    /// nothing: feed teacher-forced tokens through `prefill` one at a time
    /// to capture decode positions (the same computation for that row).
    /// The rows are kept until taken: [`GpuModel::drain_capture`] after each
    /// chunk bounds them by one chunk's.
    pub fn set_capture(&mut self, positions: BTreeSet<usize>) {
        self.capture = Some(GpuCapture {
            positions,
            rows: vec![Vec::new(); self.config.num_hidden_layers],
        });
    }

    /// The rows captured since [`GpuModel::set_capture`] (`[layer][row]`,
    /// rows in call order; empty when nothing was asked for), ending the
    /// capture.
    pub fn take_capture(&mut self) -> Vec<Vec<GpuCapturedRow>> {
        self.capture.take().map(|c| c.rows).unwrap_or_default()
    }

    /// The rows captured since [`GpuModel::set_capture`] or the last drain
    /// (`[layer][row]`, rows in call order; empty when nothing was asked
    /// for); the capture goes on for the same positions. Called after each
    /// prefill chunk ([`GpuModel::prefill_observed`]), it keeps at most one
    /// chunk's captured rows in memory.
    pub fn drain_capture(&mut self) -> Vec<Vec<GpuCapturedRow>> {
        self.capture
            .as_mut()
            .map(|c| c.rows.iter_mut().map(std::mem::take).collect())
            .unwrap_or_default()
    }

    /// Captures layer `l` of a forward call (after the layer's front half:
    /// `ws.xn` holds x̂, `ws.qkv` the rotated queries).
    pub(crate) fn capture_layer(&mut self, l: usize, ws: &Workspace, rows: &[Row]) -> Result<()> {
        let Some(cap) = self.capture.as_ref() else {
            return Ok(());
        };
        let picked: Vec<usize> = (0..rows.len())
            .filter(|&i| cap.positions.contains(&rows[i].pos))
            .collect();
        if picked.is_empty() {
            return Ok(());
        }
        let (d, hd, w, n) = (
            self.config.hidden_size,
            self.config.num_attention_heads * self.config.head_dim,
            self.qkv_cols,
            rows.len(),
        );
        let xn = self.gpu.download(&ws.xn.slice(0..n * d))?;
        let qkv = self.gpu.download(&ws.qkv.slice(0..n * w))?;
        let wide = |v: &[Bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let got: Vec<GpuCapturedRow> = picked
            .iter()
            .map(|&i| GpuCapturedRow {
                position: rows[i].pos,
                xn: wide(&xn[i * d..(i + 1) * d]),
                q_rope: wide(&qkv[i * w..i * w + hd]),
            })
            .collect();
        if let Some(cap) = self.capture.as_mut() {
            cap.rows[l].extend(got);
        }
        Ok(())
    }
}
