//! Non-finite logits stop generation with an error naming the decode step
//! and the sequence (and, on the CPU reference, the layer where the hidden
//! state went non-finite), greedy and sampled: a NaN anywhere, a +inf
//! anywhere, or no finite logit (all −inf). The GPU applies the same rule in
//! its argmax and sampling kernels (`sparda::checks::guards`, run by the
//! ignored test in tests/gpu_kernels.rs).

use sparda::generate::{generate_cpu, run_loop, Request, Stepper, StopReason};
use sparda::sample::{check_logits, LogitsFault, Sampler, SamplingParams};
use sparda::synth::{self, Preset};
use sparda::weights::names::{self, LayerTensor};
use sparda::weights::{Checkpoint, DType, OwnedTensor, TensorStore};
use sparda::Error;

/// A backend that yields `good` logits, except `bad` at the logits of decode
/// step `bad_step` (0: the prefill's).
struct Scripted {
    good: Vec<f32>,
    bad: Vec<f32>,
    bad_step: usize,
    step: usize,
}

impl Scripted {
    fn row(&self) -> &[f32] {
        if self.step == self.bad_step {
            &self.bad
        } else {
            &self.good
        }
    }
}

impl Stepper for Scripted {
    fn prefill(&mut self, _: &[u32], _: &mut dyn FnMut(usize, usize)) -> sparda::Result<()> {
        self.step = 0;
        Ok(())
    }
    fn decode(&mut self, _: u32) -> sparda::Result<()> {
        self.step += 1;
        Ok(())
    }
    fn next_token(&mut self, sampler: &mut Sampler, _greedy: bool) -> sparda::Result<u32> {
        sampler.sample(self.row())
    }
    fn logits(&mut self) -> sparda::Result<Vec<f32>> {
        Ok(self.row().to_vec())
    }
}

fn request(sampling: SamplingParams) -> Request {
    Request {
        prompt: vec![1, 2, 3],
        max_new_tokens: 8,
        sampling,
        stop_ids: vec![],
        logprobs: None,
    }
}

const SAMPLED: SamplingParams = SamplingParams {
    temperature: 0.8,
    top_k: 0,
    top_p: 0.95,
    seed: 7,
};

fn good_row() -> Vec<f32> {
    (0..16).map(|i| (i as f32 * 0.37).sin()).collect()
}

/// Rows no token can be chosen from, with the fault text each must give.
fn bad_rows() -> Vec<(&'static str, Vec<f32>, &'static str)> {
    let mut one_nan = good_row();
    one_nan[5] = f32::NAN;
    let mut pos_inf = good_row();
    pos_inf[9] = f32::INFINITY;
    pos_inf[12] = f32::INFINITY;
    let mut nan_and_inf = good_row();
    nan_and_inf[3] = f32::INFINITY;
    nan_and_inf[11] = f32::NAN;
    vec![
        (
            "all NaN",
            vec![f32::NAN; 16],
            "NaN at id 0 (16 of 16 entries NaN)",
        ),
        ("one NaN", one_nan, "NaN at id 5 (1 of 16 entries NaN)"),
        ("+inf", pos_inf, "+inf at id 9 (2 of 16 entries +inf)"),
        (
            "NaN before +inf",
            nan_and_inf,
            "NaN at id 11 (1 of 16 entries NaN)",
        ),
        (
            "all -inf",
            vec![f32::NEG_INFINITY; 16],
            "no finite logit (all 16 entries -inf)",
        ),
    ]
}

#[test]
fn check_logits_names_the_fault_with_id_and_count() {
    assert_eq!(check_logits(&good_row()), Ok(()));
    // −inf among finite logits is a masked token, not a fault
    let mut masked = good_row();
    masked[0] = f32::NEG_INFINITY;
    masked[15] = f32::NEG_INFINITY;
    assert_eq!(check_logits(&masked), Ok(()));
    assert_eq!(
        check_logits(&[1.0, f32::NAN, f32::INFINITY, f32::NAN]),
        Err(LogitsFault::Nan {
            id: 1,
            count: 2,
            vocab: 4
        })
    );
    assert_eq!(
        check_logits(&[f32::NEG_INFINITY, f32::INFINITY]),
        Err(LogitsFault::PosInf {
            id: 1,
            count: 1,
            vocab: 2
        })
    );
    assert_eq!(
        check_logits(&[f32::NEG_INFINITY; 3]),
        Err(LogitsFault::NoFinite { vocab: 3 })
    );
    assert_eq!(check_logits(&[]), Err(LogitsFault::NoFinite { vocab: 0 }));
    for (name, row, text) in bad_rows() {
        let f = check_logits(&row).expect_err(name);
        assert_eq!(f.to_string(), text, "{name}");
    }
}

#[test]
fn sampler_refuses_bad_rows_greedy_and_sampled_without_drawing() {
    for params in [SamplingParams::default(), SAMPLED] {
        for (name, row, text) in bad_rows() {
            let mut s = Sampler::new(params);
            match s.sample(&row) {
                Err(Error::NonFiniteLogits {
                    step: None,
                    sequence: None,
                    layer: None,
                    what,
                }) => assert_eq!(what, text, "{name}"),
                other => panic!("{name}: expected NonFiniteLogits, got {other:?}"),
            }
            // no draw was taken: the next draw is the seed's first
            assert_eq!(s.draw(), Sampler::new(params).draw(), "{name}");
        }
    }
}

#[test]
fn generation_stops_naming_the_decode_step_and_sequence() {
    for (mode, params) in [("greedy", SamplingParams::default()), ("sampled", SAMPLED)] {
        for bad_step in [0usize, 3] {
            for (name, row, text) in bad_rows() {
                let mut eng = Scripted {
                    good: good_row(),
                    bad: row,
                    bad_step,
                    step: 0,
                };
                let mut seen = Vec::new();
                let r = run_loop(
                    &mut eng,
                    &request(params),
                    1024,
                    |_, _| {},
                    |t| {
                        seen.push(t);
                        Ok(())
                    },
                );
                let e = r.expect_err(name);
                let msg = e.to_string();
                assert!(
                    matches!(
                        e,
                        Error::NonFiniteLogits {
                            step: Some(s),
                            sequence: Some(0),
                            layer: None,
                            ..
                        } if s == bad_step
                    ),
                    "{mode} {name}: {e:?}"
                );
                for part in [
                    format!("non-finite logits at decode step {bad_step}, sequence 0: "),
                    text.to_string(),
                ] {
                    assert!(
                        msg.contains(&part),
                        "{mode} {name}: {part:?} missing in {msg}"
                    );
                }
                // the tokens before the bad step were chosen and reported
                assert_eq!(seen.len(), bad_step, "{mode} {name}");
            }
        }
    }
}

#[test]
fn masked_tokens_do_not_stop_generation() {
    let mut masked = good_row();
    masked[2] = f32::NEG_INFINITY;
    for params in [SamplingParams::default(), SAMPLED] {
        let mut eng = Scripted {
            good: good_row(),
            bad: masked.clone(),
            bad_step: 2,
            step: 0,
        };
        let out = run_loop(&mut eng, &request(params), 1024, |_, _| {}, |_| Ok(())).unwrap();
        assert_eq!(out.tokens.len(), 8);
        assert_eq!(out.stop, StopReason::MaxTokens);
        assert_ne!(out.tokens[2], 2, "the masked id was chosen");
    }
}

/// The tiny synthetic model with every weight of `tensor` in `layer` set to
/// `value`.
fn poisoned_tiny(layer: usize, tensor: LayerTensor, value: f32) -> Checkpoint {
    let ckpt = synth::build(Preset::Tiny, 3).unwrap();
    let name = names::layer(layer, tensor);
    let mut store = TensorStore::from_tensors(ckpt.store.to_owned_tensors());
    let (_, shape) = store.info(&name).map(|(d, s)| (d, s.to_vec())).unwrap();
    let n: usize = shape.iter().product();
    store.insert(OwnedTensor::from_f32(&name, shape, &vec![value; n], DType::BF16).unwrap());
    Checkpoint::from_parts(ckpt.config.clone(), store).unwrap()
}

#[test]
fn cpu_reference_names_the_layer_where_the_hidden_state_broke() {
    let ckpt = poisoned_tiny(1, LayerTensor::DownProj, f32::NAN);
    let model = sparda::cpu::CpuModel::new(&ckpt, Default::default()).unwrap();
    for params in [SamplingParams::default(), SAMPLED] {
        let e = generate_cpu(&model, &request(params), |_, _| {}, |_| Ok(()))
            .map(|_| ())
            .expect_err("NaN weights");
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                Error::NonFiniteLogits {
                    step: Some(0),
                    sequence: Some(0),
                    layer: Some(1),
                    ..
                }
            ),
            "{e:?}"
        );
        for part in [
            "non-finite logits at decode step 0, sequence 0",
            "entries NaN",
            "first held a NaN or ±inf after layer 1",
        ] {
            assert!(msg.contains(part), "{part:?} missing in {msg}");
        }
    }
    // Layer 0's output projection poisoned: the hidden state breaks at layer 0.
    let ckpt = poisoned_tiny(0, LayerTensor::OProj, f32::INFINITY);
    let model = sparda::cpu::CpuModel::new(&ckpt, Default::default()).unwrap();
    let e = generate_cpu(
        &model,
        &request(SamplingParams::default()),
        |_, _| {},
        |_| Ok(()),
    )
    .map(|_| ())
    .expect_err("inf weights");
    assert!(
        matches!(e, Error::NonFiniteLogits { layer: Some(0), .. }),
        "{e:?}"
    );
}

#[test]
fn locate_keeps_what_the_engine_knew() {
    let gpu_side = Error::NonFiniteLogits {
        step: None,
        sequence: Some(3),
        layer: None,
        what: "NaN at id 0 (1 of 8 entries NaN)".into(),
    };
    let e = gpu_side.locate(5, 0);
    assert_eq!(
        e.to_string().split(':').next().unwrap(),
        "non-finite logits at decode step 5, sequence 3"
    );
    // other errors pass through unchanged
    let other = Error::Input("x".into()).locate(1, 2);
    assert_eq!(other.to_string(), "invalid input: x");
}
