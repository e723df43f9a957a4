//! Per-CTA timelines of one decode step (`bench --cta-timeline`): which SM
//! each CTA of the attention kernel and of the SM fetch kernel ran on, and
//! when (kernels/common.cuh `cta_log_start`; %globaltimer ns, %smid). With
//! forecast prefetch the fetch of layer l+1 runs beside layer l's compute,
//! and the trace shows layer l's attention slower than in the last layer,
//! which fetches nothing (traces/README.md, "beside a fetch"). The records
//! tell whether that time is lost in the attention CTAs that share an SM
//! with a running copy CTA (stragglers that hold the kernel's end) or in
//! every CTA alike (a shared memory system). Pure functions over the
//! records: unit-tested here without a GPU.

use serde::Serialize;

/// One CTA's record: start and end on the GPU's global timer (ns) and its
/// SM. Serialized as the array `[start_ns, end_ns, sm]` (a step holds
/// thousands).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtaRecord {
    /// %globaltimer when thread 0 of the CTA began, ns.
    pub start_ns: u64,
    /// %globaltimer when thread 0 of the CTA finished, ns.
    pub end_ns: u64,
    /// %smid of the SM it ran on.
    pub sm: u32,
}

impl Serialize for CtaRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        [self.start_ns, self.end_ns, u64::from(self.sm)].serialize(s)
    }
}

impl CtaRecord {
    /// From a raw `[start, end, sm]` triple; `None` for a CTA that did not
    /// record (start 0: the slot was not written), or an end before its start.
    pub fn from_raw(r: [u64; 3]) -> Option<CtaRecord> {
        (r[0] != 0 && r[1] >= r[0]).then_some(CtaRecord {
            start_ns: r[0],
            end_ns: r[1],
            sm: r[2] as u32,
        })
    }

    fn overlaps(&self, o: &CtaRecord) -> bool {
        self.start_ns < o.end_ns && o.start_ns < self.end_ns
    }

    fn dur_us(&self) -> f64 {
        (self.end_ns - self.start_ns) as f64 / 1e3
    }
}

/// The records of one step, per layer: the attention kernel's CTAs and the
/// SM fetch kernel's CTAs that fetched that layer's blocks (empty where the
/// layer fetched nothing through the SM kernel).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CtaTimeline {
    /// `attention[l]`: layer l's attention CTAs.
    pub attention: Vec<Vec<CtaRecord>>,
    /// `fetch[l]`: the CTAs of the fetch of layer l's blocks.
    pub fetch: Vec<Vec<CtaRecord>>,
}

/// One layer's attention CTAs by whether a copy CTA ran on their SM.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LayerCtas {
    /// The layer.
    pub layer: usize,
    /// Attention CTAs recorded.
    pub ctas: usize,
    /// First start to last end of the attention kernel's CTAs, µs.
    pub span_us: f64,
    /// CTAs that shared their SM with a copy CTA (of any layer's fetch)
    /// for part of their run.
    pub shared: usize,
    /// Their mean duration, µs (0 when none).
    pub shared_mean_us: f64,
    /// CTAs with no copy CTA on their SM while they ran.
    pub alone: usize,
    /// Their mean duration, µs (0 when none).
    pub alone_mean_us: f64,
    /// First start to the last end of the alone CTAs, µs: the span the
    /// kernel would have without the shared ones (0 when none is alone).
    pub alone_span_us: f64,
    /// Distinct SMs the copy CTAs overlapping this kernel ran on.
    pub copy_sms: usize,
}

/// [`LayerCtas`] of every layer with attention records, and the totals
/// over three groups of layers: those where some attention CTA shared its
/// SM with a copy CTA; those beside a running copy kernel whose CTAs all
/// sat on other SMs (e.g. copy CTAs holding whole SMs); and those with no
/// copy CTA running at all (the control: the last layer under prefetch,
/// beside which nothing is fetched). Means are 0 for an empty group.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CtaSummary {
    /// Per layer.
    pub layers: Vec<LayerCtas>,
    /// Layers with a shared SM: mean duration of the shared CTAs, µs.
    pub shared_mean_us: f64,
    /// Layers with a shared SM: mean duration of their alone CTAs, µs.
    pub alone_mean_us: f64,
    /// Layers with a shared SM: mean kernel span, µs.
    pub span_us: f64,
    /// Layers with a shared SM and some alone CTA: mean span of the alone
    /// CTAs, µs.
    pub alone_span_us: f64,
    /// Layers beside a copy kernel on other SMs only: mean kernel span, µs.
    pub apart_span_us: f64,
    /// The same layers: mean CTA duration, µs.
    pub apart_mean_us: f64,
    /// Layers with no copy CTA running: mean kernel span, µs.
    pub control_span_us: f64,
    /// The same layers: mean CTA duration, µs.
    pub control_mean_us: f64,
}

/// Sorts each layer's attention CTAs by whether a copy CTA of any layer's
/// fetch ran on the same SM during an overlapping interval.
pub fn analyze(t: &CtaTimeline) -> CtaSummary {
    let copies: Vec<&CtaRecord> = t.fetch.iter().flatten().collect();
    let mut layers = Vec::new();
    for (l, attn) in t.attention.iter().enumerate() {
        if attn.is_empty() {
            continue;
        }
        let first = attn.iter().map(|c| c.start_ns).min().unwrap_or(0);
        let last = attn.iter().map(|c| c.end_ns).max().unwrap_or(0);
        let mut s = LayerCtas {
            layer: l,
            ctas: attn.len(),
            span_us: (last - first) as f64 / 1e3,
            ..LayerCtas::default()
        };
        let mut alone_end = None;
        let mut sms = std::collections::BTreeSet::new();
        for c in copies
            .iter()
            .filter(|c| c.start_ns < last && first < c.end_ns)
        {
            sms.insert(c.sm);
        }
        s.copy_sms = sms.len();
        for a in attn {
            let shared = copies.iter().any(|c| c.sm == a.sm && c.overlaps(a));
            if shared {
                s.shared += 1;
                s.shared_mean_us += a.dur_us();
            } else {
                s.alone += 1;
                s.alone_mean_us += a.dur_us();
                alone_end = alone_end.max(Some(a.end_ns));
            }
        }
        s.shared_mean_us /= s.shared.max(1) as f64;
        s.alone_mean_us /= s.alone.max(1) as f64;
        s.alone_span_us = alone_end.map_or(0.0, |e| (e - first) as f64 / 1e3);
        layers.push(s);
    }
    let beside: Vec<&LayerCtas> = layers.iter().filter(|s| s.shared > 0).collect();
    let with_alone: Vec<&LayerCtas> = beside.iter().copied().filter(|s| s.alone > 0).collect();
    let apart: Vec<&LayerCtas> = layers
        .iter()
        .filter(|s| s.shared == 0 && s.copy_sms > 0)
        .collect();
    let control: Vec<&LayerCtas> = layers.iter().filter(|s| s.copy_sms == 0).collect();
    let mean = |v: &[&LayerCtas], f: &dyn Fn(&LayerCtas) -> (f64, usize)| {
        let (sum, n) = v.iter().fold((0.0, 0usize), |(s, n), x| {
            let (a, k) = f(x);
            (s + a * k as f64, n + k)
        });
        if n > 0 {
            sum / n as f64
        } else {
            0.0
        }
    };
    CtaSummary {
        shared_mean_us: mean(&beside, &|s| (s.shared_mean_us, s.shared)),
        alone_mean_us: mean(&beside, &|s| (s.alone_mean_us, s.alone)),
        span_us: mean(&beside, &|s| (s.span_us, 1)),
        alone_span_us: mean(&with_alone, &|s| (s.alone_span_us, 1)),
        apart_span_us: mean(&apart, &|s| (s.span_us, 1)),
        apart_mean_us: mean(&apart, &|s| (s.alone_mean_us, s.alone)),
        control_span_us: mean(&control, &|s| (s.span_us, 1)),
        control_mean_us: mean(&control, &|s| (s.alone_mean_us, s.alone)),
        layers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(start: u64, end: u64, sm: u32) -> CtaRecord {
        CtaRecord {
            start_ns: start,
            end_ns: end,
            sm,
        }
    }

    #[test]
    fn a_record_serializes_as_one_array() {
        let j = serde_json::to_string(&rec(10, 15, 7)).unwrap();
        assert_eq!(j, "[10,15,7]");
    }

    #[test]
    fn raw_records_without_a_start_are_dropped() {
        assert_eq!(CtaRecord::from_raw([0, 0, 0]), None);
        assert_eq!(CtaRecord::from_raw([10, 5, 1]), None);
        assert_eq!(CtaRecord::from_raw([10, 15, 7]), Some(rec(10, 15, 7)));
    }

    /// Layer 0: four attention CTAs on SMs 0–3 while a copy CTA runs on SM
    /// 1 (0–100 µs): the one on SM 1 takes 40 µs, the others 10; a CTA on
    /// SM 1 after the copy ended counts as alone. Layer 1: no copy beside
    /// it (the control), CTAs of 10 µs.
    #[test]
    fn attention_ctas_are_split_by_a_copy_cta_on_their_sm() {
        let us = 1000;
        let t = CtaTimeline {
            attention: vec![
                vec![
                    rec(0, 10 * us, 0),
                    rec(0, 40 * us, 1),
                    rec(0, 10 * us, 2),
                    rec(10 * us, 20 * us, 3),
                    rec(150 * us, 160 * us, 1),
                ],
                vec![rec(200 * us, 210 * us, 1), rec(200 * us, 210 * us, 5)],
            ],
            fetch: vec![vec![], vec![rec(0, 100 * us, 1)]],
        };
        let s = analyze(&t);
        assert_eq!(s.layers.len(), 2);
        let l0 = &s.layers[0];
        assert_eq!((l0.ctas, l0.shared, l0.alone, l0.copy_sms), (5, 1, 4, 1));
        assert!((l0.shared_mean_us - 40.0).abs() < 1e-9, "{l0:?}");
        assert!((l0.alone_mean_us - 10.0).abs() < 1e-9, "{l0:?}");
        assert!((l0.span_us - 160.0).abs() < 1e-9);
        assert!((l0.alone_span_us - 160.0).abs() < 1e-9);
        let l1 = &s.layers[1];
        assert_eq!((l1.shared, l1.alone, l1.copy_sms), (0, 2, 0));
        assert!((s.shared_mean_us - 40.0).abs() < 1e-9);
        assert!((s.alone_mean_us - 10.0).abs() < 1e-9);
        assert!((s.control_span_us - 10.0).abs() < 1e-9);
        assert!((s.control_mean_us - 10.0).abs() < 1e-9);
        assert_eq!(s.apart_span_us, 0.0);
    }

    /// Copy CTAs that hold their own SMs: a layer whose attention ran
    /// while they ran, on other SMs, is neither shared nor the control; a
    /// layer whose CTAs all shared has no alone span to average.
    #[test]
    fn layers_beside_a_copy_on_other_sms_are_their_own_group() {
        let us = 1000;
        let t = CtaTimeline {
            attention: vec![
                vec![rec(0, 30 * us, 0), rec(0, 20 * us, 2)],
                vec![rec(100 * us, 150 * us, 1)],
                vec![rec(300 * us, 310 * us, 0)],
            ],
            // SM 1 runs copies during layers 0 and 1
            fetch: vec![vec![rec(0, 200 * us, 1)]],
        };
        let s = analyze(&t);
        let groups: Vec<(usize, usize, usize)> = s
            .layers
            .iter()
            .map(|l| (l.shared, l.alone, l.copy_sms))
            .collect();
        assert_eq!(groups, vec![(0, 2, 1), (1, 0, 1), (0, 1, 0)]);
        assert!((s.apart_span_us - 30.0).abs() < 1e-9);
        assert!((s.apart_mean_us - 25.0).abs() < 1e-9);
        assert!((s.shared_mean_us - 50.0).abs() < 1e-9);
        // layer 1 has no alone CTA: no alone span, and it is not averaged as 0
        assert_eq!(s.layers[1].alone_span_us, 0.0);
        assert_eq!(s.alone_span_us, 0.0);
        assert!((s.control_span_us - 10.0).abs() < 1e-9);
    }

    /// The straggler reading: the alone CTAs end long before the kernel does.
    #[test]
    fn the_alone_span_ends_with_the_last_alone_cta() {
        let us = 1000;
        let t = CtaTimeline {
            attention: vec![vec![rec(0, 10 * us, 0), rec(0, 50 * us, 1)]],
            fetch: vec![vec![rec(0, 60 * us, 1)]],
        };
        let s = analyze(&t);
        assert!((s.layers[0].span_us - 50.0).abs() < 1e-9);
        assert!((s.layers[0].alone_span_us - 10.0).abs() < 1e-9);
        assert_eq!(s.control_span_us, 0.0);
        // no records at all: nothing to say
        assert!(analyze(&CtaTimeline::default()).layers.is_empty());
    }
}
