//! Percentiles and the per-configuration summary of a benchmark run.

/// The `p`-quantile (0..=1) of `v` by linear interpolation between closest ranks (numpy's
/// default); None for no data.
pub fn quantile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let x = p.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
    Some(s[lo] + (s[hi] - s[lo]) * (x - lo as f64))
}

/// What one request did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub ok: bool,
    /// Seconds to the first token.
    pub ttft: f64,
    /// Seconds between consecutive tokens.
    pub itl: Vec<f64>,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// One configuration's results.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    pub requests: usize,
    pub failures: usize,
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    pub itl_p50: f64,
    pub itl_p99: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Cached / prompt tokens over successful requests.
    pub cached_fraction: f64,
}

/// Summarises outcomes over `wall_s` seconds.
pub fn summarize(outcomes: &[Outcome], wall_s: f64) -> Summary {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let ttft: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let q = |v: &[f64], p| quantile(v, p).unwrap_or(f64::NAN);
    let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
    Summary {
        requests: outcomes.len(),
        failures: outcomes.len() - ok.len(),
        ttft_p50: q(&ttft, 0.5),
        ttft_p90: q(&ttft, 0.9),
        ttft_p99: q(&ttft, 0.99),
        itl_p50: q(&itl, 0.5),
        itl_p99: q(&itl, 0.99),
        requests_per_s: ok.len() as f64 / wall_s,
        output_tokens_per_s: ok.iter().map(|o| o.output_tokens).sum::<u64>() as f64 / wall_s,
        cached_fraction: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_like_numpy() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(quantile(&v, 0.0), Some(1.0));
        assert_eq!(quantile(&v, 1.0), Some(4.0));
        assert_eq!(quantile(&v, 0.5), Some(2.5));
        // numpy.percentile([1, 2, 3, 4], 90) == 3.7
        assert!((quantile(&v, 0.9).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(quantile(&[7.0], 0.99), Some(7.0));
    }

    #[test]
    fn summary_of_known_outcomes() {
        let o = |ok, ttft, itl: &[f64], out, prompt, cached| Outcome {
            ok,
            ttft,
            itl: itl.to_vec(),
            output_tokens: out,
            prompt_tokens: prompt,
            cached_tokens: cached,
        };
        let s = summarize(
            &[
                o(true, 0.1, &[0.01, 0.02], 3, 100, 50),
                o(true, 0.3, &[0.03], 2, 100, 0),
                o(false, 9.0, &[], 0, 100, 0),
            ],
            2.0,
        );
        assert_eq!((s.requests, s.failures), (3, 1));
        assert!((s.ttft_p50 - 0.2).abs() < 1e-12);
        assert!((s.itl_p50 - 0.02).abs() < 1e-12);
        assert_eq!(s.requests_per_s, 1.0);
        assert_eq!(s.output_tokens_per_s, 2.5);
        assert_eq!(s.cached_fraction, 0.25);
    }
}
