//! Sampling: greedy, temperature, top-k, top-p, seeds.

use sparda::sample::{argmax, Sampler, SamplingParams};

#[test]
fn greedy_is_argmax_with_ties_to_the_lower_id() {
    assert_eq!(argmax(&[0.5, 2.0, -1.0, 2.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0]), 2);
    // all NaN: 0, as the GPU argmax kernels give; NaN after a value never wins
    assert_eq!(argmax(&[f32::NAN, f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN, -2.0]), 1);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), 0);
    let mut s = Sampler::new(SamplingParams::default());
    assert_eq!(s.sample(&[0.1, 0.3, 0.2]).unwrap(), 1);
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let logits = [1.0, 4.0, 3.9, -2.0];
    let mut k1 = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_k: 1,
        top_p: 1.0,
        seed: 3,
    });
    let mut p0 = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1e-6,
        seed: 3,
    });
    for _ in 0..100 {
        assert_eq!(k1.sample(&logits).unwrap(), 1);
        assert_eq!(p0.sample(&logits).unwrap(), 1);
    }
}

#[test]
fn top_k_never_leaves_the_k_best() {
    let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32).collect(); // best: ids with i%7 == 6
    let mut s = Sampler::new(SamplingParams {
        temperature: 5.0,
        top_k: 3,
        top_p: 1.0,
        seed: 9,
    });
    let allowed = [6u32, 13, 20]; // ties at the cut go to the lower ids
    for _ in 0..500 {
        assert!(allowed.contains(&s.sample(&logits).unwrap()));
    }
}

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    // probabilities ≈ 0.6, 0.3, 0.1 at T = 1 → top_p 0.8 keeps ids 0 and 1 only
    let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.8,
        seed: 1,
    });
    let mut counts = [0usize; 3];
    for _ in 0..4000 {
        counts[s.sample(&logits).unwrap() as usize] += 1;
    }
    assert_eq!(counts[2], 0);
    let frac = counts[0] as f64 / 4000.0; // renormalised: 0.6 / 0.9 = 0.667
    assert!((frac - 0.667).abs() < 0.03, "{counts:?}");
}

#[test]
fn temperature_sampling_follows_softmax_and_seed() {
    let logits = [0.0f32, 1.0, 2.0];
    let run = |seed| {
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.0,
            top_k: 0,
            top_p: 1.0,
            seed,
        });
        (0..6000)
            .map(|_| s.sample(&logits).unwrap())
            .collect::<Vec<u32>>()
    };
    let a = run(5);
    assert_eq!(a, run(5));
    assert_ne!(a, run(6));
    // softmax([0, .5, 1]) = [0.186, 0.307, 0.506]
    let want = [0.186, 0.307, 0.506];
    for (id, w) in want.iter().enumerate() {
        let f = a.iter().filter(|&&t| t as usize == id).count() as f64 / a.len() as f64;
        assert!((f - w).abs() < 0.02, "id {id}: {f} vs {w}");
    }
}

#[test]
fn bad_parameters_are_errors() {
    for p in [
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 1.5,
            ..Default::default()
        },
    ] {
        assert!(p.validate().is_err(), "{p:?}");
    }
    assert!(SamplingParams::default().validate().is_ok());
}

/// The GPU path's contract: `Sampler::sample` is `sample_with_u` applied to
/// the sampler's own next draw, so handing `draw()` to a GPU sampler that
/// follows the same rule reproduces the CPU's tokens.
#[test]
fn sample_is_sample_with_u_of_the_next_draw() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    let logits: Vec<f32> = (0..500).map(|_| rng.random_range(-4.0..4.0)).collect();
    for (t, k, p) in [
        (0.7f32, 0usize, 1.0f32),
        (1.0, 20, 1.0),
        (1.2, 0, 0.8),
        (0.9, 30, 0.9),
    ] {
        let params = SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            seed: 11,
        };
        let (mut a, mut b) = (Sampler::new(params), Sampler::new(params));
        assert!(!a.is_greedy());
        for _ in 0..200 {
            let want = a.sample(&logits).unwrap();
            let u = b.draw();
            assert!((0.0..1.0).contains(&u));
            assert_eq!(sparda::sample::sample_with_u(&params, &logits, u), want);
        }
    }
}

/// Pinned values of the rule itself: u = 0 takes the most likely token, a
/// draw just under 1 the last kept one; top-k and top-p cut the order
/// (logit descending, index ascending); non-finite logits never win.
#[test]
fn sample_with_u_walks_the_cumulative_mass_in_order() {
    use sparda::sample::{sample_margin, sample_with_u};
    let p = |t: f32, k: usize, tp: f32| SamplingParams {
        temperature: t,
        top_k: k,
        top_p: tp,
        seed: 0,
    };
    // probabilities at T = 1: ln 4, ln 2, ln 1, ln 1 → 0.5, 0.25, 0.125, 0.125
    let l = [(1.0f32).ln(), (4.0f32).ln(), (1.0f32).ln(), (2.0f32).ln()];
    let all = p(1.0, 0, 1.0);
    assert_eq!(sample_with_u(&all, &l, 0.0), 1);
    assert_eq!(sample_with_u(&all, &l, 0.49), 1);
    assert_eq!(sample_with_u(&all, &l, 0.51), 3);
    assert_eq!(sample_with_u(&all, &l, 0.76), 0); // ties: id 0 before id 2
    assert_eq!(sample_with_u(&all, &l, 0.9), 2);
    assert_eq!(sample_with_u(&all, &l, 1.0 - f64::EPSILON / 2.0), 2);
    // top-k 2: {1, 3} renormalised to 2/3, 1/3
    assert_eq!(sample_with_u(&p(1.0, 2, 1.0), &l, 0.66), 1);
    assert_eq!(sample_with_u(&p(1.0, 2, 1.0), &l, 0.67), 3);
    assert_eq!(sample_with_u(&p(1.0, 2, 1.0), &l, 0.999), 3);
    // top-p 0.75 keeps {1, 3} (0.5 + 0.25 reaches 0.75); 0.7 as well
    assert_eq!(sample_with_u(&p(1.0, 0, 0.75), &l, 0.999), 3);
    assert_eq!(sample_with_u(&p(1.0, 0, 0.7), &l, 0.999), 3);
    assert_eq!(sample_with_u(&p(1.0, 0, 0.5), &l, 0.999), 1);
    // non-finite entries are outside the order; greedy ignores u
    let nf = [f32::NAN, 0.0, f32::NEG_INFINITY, 0.0];
    for u in [0.0, 0.3, 0.7, 0.99] {
        assert!([1, 3].contains(&sample_with_u(&all, &nf, u)));
        assert_eq!(sample_with_u(&p(0.0, 0, 1.0), &l, u), 1);
    }
    // the margin: distance to the nearest boundary (0.5, 0.75, …) of the mass
    assert!((sample_margin(&all, &l, 0.49) - 0.01).abs() < 1e-6);
    assert!(sample_margin(&all, &l, 0.5) < 1e-6);
    assert_eq!(sample_margin(&p(0.0, 0, 1.0), &l, 0.5), f64::INFINITY);
}
