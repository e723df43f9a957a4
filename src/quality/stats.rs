//! Summary statistics of per-token values (NLLs, KL divergences, paired
//! differences): mean with its standard error, nearest-rank quantiles, and
//! the perplexity with its 95 % interval.

/// z of a two-sided 95 % normal interval.
pub const Z95: f64 = 1.96;

/// The mean of `n` values and its standard error.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MeanSe {
    /// How many values.
    pub n: usize,
    /// Their arithmetic mean (0 for none).
    pub mean: f64,
    /// Standard error of the mean: the sample standard deviation (n − 1 in
    /// the denominator) over √n; `None` for fewer than 2 values.
    pub se: Option<f64>,
}

impl MeanSe {
    /// Mean and standard error of `xs` (sums in f64, two passes).
    pub fn of(xs: &[f64]) -> MeanSe {
        let n = xs.len();
        if n == 0 {
            return MeanSe {
                n,
                mean: 0.0,
                se: None,
            };
        }
        let mean = xs.iter().sum::<f64>() / n as f64;
        let se = (n >= 2).then(|| {
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            (var / n as f64).sqrt()
        });
        MeanSe { n, mean, se }
    }

    /// The 95 % interval mean ± 1.96·se, `None` without a standard error.
    pub fn ci95(&self) -> Option<[f64; 2]> {
        self.se
            .map(|se| [self.mean - Z95 * se, self.mean + Z95 * se])
    }
}

/// Median, 99th percentile and maximum of a set of values.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Spread {
    /// The middle value (the mean of the two middle ones for an even count).
    pub median: f64,
    /// Nearest-rank 99th percentile: the smallest value with at least 99 %
    /// of the values ≤ it.
    pub p99: f64,
    /// The largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `xs` (sorted with `f64::total_cmp`; NaN sorts last);
    /// all zeros for no values.
    pub fn of(xs: &[f64]) -> Spread {
        if xs.is_empty() {
            return Spread {
                median: 0.0,
                p99: 0.0,
                max: 0.0,
            };
        }
        let mut s = xs.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            0.5 * (s[n / 2 - 1] + s[n / 2])
        };
        Spread {
            median,
            p99: nearest_rank(&s, 0.99),
            max: s[n - 1],
        }
    }
}

/// The nearest-rank `q`-quantile (q in (0, 1]) of ascending `sorted`
/// values: `sorted[⌈q·n⌉ − 1]`. Panics on an empty slice.
pub fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    sorted[rank - 1]
}

/// Perplexity over scored tokens: from the per-token negative
/// log-likelihoods NLL_i = −ln p(t_i | t_<i) (nats).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct NllSummary {
    /// Tokens scored.
    pub tokens: usize,
    /// Mean NLL, nats/token.
    pub mean_nll: f64,
    /// Standard error of the mean NLL (`None` for fewer than 2 tokens).
    pub nll_se: Option<f64>,
    /// Perplexity exp(mean NLL).
    pub ppl: f64,
    /// 95 % interval of the perplexity: exp(mean ± 1.96·se).
    pub ppl_ci95: Option<[f64; 2]>,
}

impl NllSummary {
    /// The summary of per-token NLLs (nats).
    pub fn of(nlls: &[f64]) -> NllSummary {
        let m = MeanSe::of(nlls);
        NllSummary {
            tokens: m.n,
            mean_nll: m.mean,
            nll_se: m.se,
            ppl: m.mean.exp(),
            ppl_ci95: m.ci95().map(|[lo, hi]| [lo.exp(), hi.exp()]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error() {
        let m = MeanSe::of(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!((m.n, m.mean), (4, 2.5));
        // sample variance 5/3, se = sqrt(5/3 / 4)
        assert!((m.se.unwrap() - (5.0f64 / 12.0).sqrt()).abs() < 1e-15);
        assert_eq!(MeanSe::of(&[7.0]).se, None);
        assert_eq!(MeanSe::of(&[]).mean, 0.0);
    }

    #[test]
    fn median_p99_and_max() {
        let xs: Vec<f64> = (1..=200).rev().map(f64::from).collect();
        let s = Spread::of(&xs);
        assert_eq!((s.median, s.p99, s.max), (100.5, 198.0, 200.0));
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.p99, s.max), (2.0, 3.0, 3.0));
    }

    #[test]
    fn perplexity_interval_brackets_the_perplexity() {
        let s = NllSummary::of(&[1.0, 1.5, 2.0, 2.5]);
        assert!((s.ppl - 1.75f64.exp()).abs() < 1e-12);
        let [lo, hi] = s.ppl_ci95.unwrap();
        assert!(lo < s.ppl && s.ppl < hi);
        let se = s.nll_se.unwrap();
        assert!((hi.ln() - (1.75 + Z95 * se)).abs() < 1e-12);
    }
}
