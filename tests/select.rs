//! Selection on hand-computed cases (spec/nosa-model.md §3–§4).

use sparda::config::SparseConfig;
use sparda::model::select::{self, Budget, SelectionRule};

fn default_budget() -> Budget {
    Budget::new(&SparseConfig::default())
}

/// The tiny preset's budget: W = 2, S = 6, n = 5.
fn small_budget() -> Budget {
    Budget::new(&SparseConfig {
        window_size: 128,
        topk: 4,
        select_blocks: 2,
        ..SparseConfig::default()
    })
}

fn range(a: usize, b: usize) -> Vec<usize> {
    (a..b).collect()
}

#[test]
fn budget_table_matches_spec() {
    let b = default_budget();
    assert_eq!((b.attended, b.shortlist, b.window_blocks), (64, 33, 16));
    let sparda = Budget::new(&SparseConfig {
        topk: 80,
        select_blocks: 24,
        ..SparseConfig::default()
    });
    assert_eq!((sparda.attended, sparda.shortlist), (96, 41));
}

#[test]
fn window_counts_at_16_token_boundaries() {
    let b = default_budget();
    // T < 32: no window; window i exists once T ≥ 16i + 32.
    assert_eq!(b.windows(0), 0);
    assert_eq!(b.windows(31), 0);
    assert_eq!(b.windows(32), 1);
    assert_eq!(b.windows(47), 1);
    assert_eq!(b.windows(48), 2);
    assert_eq!(b.windows(49), 2);
    assert_eq!(b.windows(64), 3);
    assert_eq!(b.windows(1000), (1000 - 32) / 16 + 1);
}

#[test]
fn block_windows_are_4m_minus_1_to_4m_plus_3() {
    let b = default_budget();
    assert_eq!(b.block_windows(0, 100), 0..4);
    assert_eq!(b.block_windows(1, 100), 3..8);
    assert_eq!(b.block_windows(5, 100), 19..24);
    // clipped to existing windows
    assert_eq!(b.block_windows(5, 21), 19..21);
    assert_eq!(b.block_windows(5, 10), 10..10);
}

#[test]
fn pooling_takes_max_over_overlapping_windows_and_neg_inf_when_none() {
    let b = default_budget();
    // 6 windows exist (T = 112): windows 0..6.
    let s = [1.0, 5.0, 2.0, 3.0, 9.0, 4.0];
    let pooled = select::pool_blocks(&b, &s, 2);
    // block 0: windows 0..=3 → max(1,5,2,3) = 5; block 1: windows 3..=5 → 9
    assert_eq!(pooled, vec![5.0, 9.0]);
    // a third block with no windows yet
    let pooled = select::pool_blocks(&b, &s, 3);
    assert_eq!(pooled[2], f32::NEG_INFINITY);
    // no windows at all (T < 32)
    assert_eq!(select::pool_blocks(&b, &[], 1), vec![f32::NEG_INFINITY]);
}

#[test]
fn short_contexts_select_every_existing_block() {
    let b = default_budget();
    for n_blocks in [1usize, 2, 17, 64] {
        let r = vec![f32::NEG_INFINITY; n_blocks];
        let e = vec![0.0; n_blocks];
        assert_eq!(
            select::select(&b, SelectionRule::Nosa, &r, &e),
            range(0, n_blocks)
        );
        assert_eq!(
            select::select(&b, SelectionRule::InfLlmV2, &r, &e),
            range(0, n_blocks)
        );
    }
}

#[test]
fn nosa_shortlist_then_eviction_scores() {
    let b = default_budget();
    let nb = 100; // q = 99: forced {0} ∪ {83..=99}
    let r: Vec<f32> = (0..nb).map(|m| m as f32 * 0.01).collect();
    let e: Vec<f32> = (0..nb).map(|m| -(m as f32)).collect();
    // shortlist n = 33: 18 forced + the 15 best r outside them = 68..=82;
    // then S − n = 31 more by e (favouring low ids) = 1..=31.
    let mut want = range(0, 32);
    want.extend(68..100);
    assert_eq!(select::select(&b, SelectionRule::Nosa, &r, &e), want);
}

#[test]
fn infllmv2_takes_top_s_of_query_scores() {
    let b = default_budget();
    let nb = 100;
    let r: Vec<f32> = (0..nb).map(|m| m as f32 * 0.01).collect();
    let mut want = vec![0];
    want.extend(37..100);
    assert_eq!(select::select(&b, SelectionRule::InfLlmV2, &r, &[]), want);
}

#[test]
fn ties_go_to_the_lower_block_index() {
    let b = default_budget();
    let nb = 100;
    let zeros = vec![0.0f32; nb];
    // shortlist: forced + 1..=15; then e ties → 16..=46.
    let mut want = range(0, 47);
    want.extend(83..100);
    assert_eq!(
        select::select(&b, SelectionRule::Nosa, &zeros, &zeros),
        want
    );
    assert_eq!(select::top_k(&[1.0, 3.0, 3.0, 2.0, 3.0], 3), vec![1, 2, 4]);
}

#[test]
fn window_edge_block_is_not_forced() {
    let b = small_budget(); // init 1, W 2, S 6, n 5
    let nb = 10; // q = 9: forced {0, 7, 8, 9}
    assert!(b.is_forced(7, 9) && !b.is_forced(6, 9) && b.is_forced(0, 9));
    // block 6 (just outside the window) is best on r → shortlist; block 3 best on e.
    let mut r = vec![0.0f32; nb];
    r[6] = 10.0;
    let mut e = vec![-1.0f32; nb];
    e[3] = 5.0;
    assert_eq!(
        select::select(&b, SelectionRule::Nosa, &r, &e),
        vec![0, 3, 6, 7, 8, 9]
    );
    // block 6 low on both → not selected although adjacent to the window.
    r[6] = -10.0;
    e[6] = -10.0;
    r[2] = 1.0;
    assert_eq!(
        select::select(&b, SelectionRule::Nosa, &r, &e),
        vec![0, 2, 3, 7, 8, 9]
    );
}

#[test]
fn neg_inf_blocks_still_fill_the_budget_in_index_order() {
    let b = small_budget();
    // Current block without windows has −∞ pooled score but is forced.
    let r = vec![f32::NEG_INFINITY; 8];
    let e = vec![f32::NEG_INFINITY; 8];
    assert_eq!(
        select::select(&b, SelectionRule::Nosa, &r, &e),
        vec![0, 1, 2, 5, 6, 7]
    );
}

/// A brute-force oracle written differently: full stable sort by score.
fn brute(b: &Budget, rule: SelectionRule, r: &[f32], e: &[f32]) -> Vec<usize> {
    let nb = r.len();
    if nb <= b.attended {
        return (0..nb).collect();
    }
    let q = nb - 1;
    let forced: Vec<bool> = (0..nb)
        .map(|m| m < b.init_blocks || (m + b.window_blocks >= q))
        .collect();
    let rank = |s: &Vec<f64>, k: usize| -> Vec<usize> {
        let mut ids: Vec<usize> = (0..nb).collect();
        ids.sort_by(|&x, &y| s[y].partial_cmp(&s[x]).unwrap()); // stable: lower index first on ties
        ids.truncate(k);
        ids
    };
    let rr: Vec<f64> = (0..nb)
        .map(|m| {
            if forced[m] {
                f64::INFINITY
            } else {
                r[m] as f64
            }
        })
        .collect();
    let mut out = match rule {
        SelectionRule::InfLlmV2 => rank(&rr, b.attended),
        SelectionRule::Nosa => {
            let qa = rank(&rr, b.shortlist);
            let ee: Vec<f64> = (0..nb)
                .map(|m| {
                    if forced[m] || qa.contains(&m) {
                        f64::INFINITY
                    } else {
                        e[m] as f64
                    }
                })
                .collect();
            rank(&ee, b.attended)
        }
    };
    out.sort();
    out
}

#[test]
fn selection_equals_brute_force_on_random_scores() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for b in [default_budget(), small_budget()] {
        for _ in 0..200 {
            let nb = rng.random_range(1..200);
            // coarse values make ties frequent
            let r: Vec<f32> = (0..nb).map(|_| rng.random_range(0..8) as f32).collect();
            let e: Vec<f32> = (0..nb)
                .map(|_| rng.random_range(0..8) as f32 * -0.5)
                .collect();
            for rule in [SelectionRule::Nosa, SelectionRule::InfLlmV2] {
                let got = select::select(&b, rule, &r, &e);
                assert_eq!(got, brute(&b, rule, &r, &e), "nb {nb} rule {rule:?}");
                assert_eq!(got.len(), nb.min(b.attended));
            }
        }
    }
}

/// s[i] = Σ_g softmax_i(q_g·Kc[i]/√D), checked against f64 arithmetic for
/// GQA groups 3 and 16 and head dims 64 and 128, plus the uniform case.
#[test]
fn query_window_scores_sum_softmax_over_group() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for g in [3usize, 8, 16] {
        for d in [64usize, 80, 128] {
            let mc = 9;
            let stride = 2 * d; // two KV heads interleaved: [Mc, Hkv=2, D], head 1 used
            let q: Vec<f32> = (0..g * d).map(|_| rng.random_range(-1.0..1.0)).collect();
            let kc_all: Vec<f32> = (0..mc * stride)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let got = select::query_window_scores(&q, d, &kc_all[d..], stride, mc);
            let mut want = vec![0.0f64; mc];
            for gi in 0..g {
                let logits: Vec<f64> = (0..mc)
                    .map(|i| {
                        (0..d)
                            .map(|x| q[gi * d + x] as f64 * kc_all[i * stride + d + x] as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
                for i in 0..mc {
                    want[i] += (logits[i] - mx).exp() / z;
                }
            }
            for i in 0..mc {
                assert!(
                    (got[i] as f64 - want[i]).abs() < 1e-5,
                    "g {g} d {d} i {i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
            assert!((got.iter().sum::<f32>() - g as f32).abs() < 1e-4);
            // identical compressed keys → uniform softmax → G / Mc each
            let same: Vec<f32> = (0..mc).flat_map(|_| kc_all[..d].to_vec()).collect();
            let u = select::query_window_scores(&q, d, &same, d, mc);
            assert!(u.iter().all(|&x| (x - g as f32 / mc as f32).abs() < 1e-5));
        }
    }
}
