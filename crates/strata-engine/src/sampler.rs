//! Next-token choice: greedy, or temperature with top-k and top-p, from a seeded generator
//! (SplitMix64: the same seed gives the same tokens on every machine).

use crate::request::SamplingParams;

/// The sampler's generator: SplitMix64 (`strata_kv::rng`), seeded per request.
pub type Rng = strata_kv::rng::SplitMix64;

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks the next token from `logits` under `p`.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.temperature <= 0.0 || p.top_k == 1 {
        return argmax(logits);
    }
    // Candidates sorted by logit, cut by top-k.
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = if p.top_k == 0 {
        logits.len()
    } else {
        p.top_k.min(logits.len())
    };
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_logit);
    let max = logits[idx[0] as usize];
    let t = p.temperature as f64;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i as usize] - max) as f64 / t).exp())
        .collect();
    let z: f64 = probs.iter().sum();
    for x in &mut probs {
        *x /= z;
    }
    // Top-p: keep the smallest head whose mass reaches top_p.
    if p.top_p < 1.0 {
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, &x) in probs.iter().enumerate() {
            mass += x;
            if mass >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
    }
    let z: f64 = probs.iter().sum();
    let mut r = rng.next_f64() * z;
    for (i, &x) in probs.iter().enumerate() {
        if r < x {
            return idx[i];
        }
        r -= x;
    }
    *idx.last().expect("at least one candidate")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut r = Rng::new(1);
        assert_eq!(sample(&[0.1, 3.0, 2.0], &params(0.0, 0, 1.0), &mut r), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut r = Rng::new(seed);
            (0..50)
                .map(|_| sample(&logits, &params(1.0, 0, 1.0), &mut r))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0f32, 4.0, 3.0, -10.0, -10.0];
        let mut r = Rng::new(3);
        for _ in 0..500 {
            assert!(sample(&logits, &params(1.0, 2, 1.0), &mut r) < 2);
        }
        // p(0) ≈ 0.665, p(0)+p(1) ≈ 0.91: top_p 0.6 keeps only token 0.
        for _ in 0..200 {
            assert_eq!(sample(&logits, &params(1.0, 0, 0.6), &mut r), 0);
        }
        for _ in 0..500 {
            assert!(sample(&logits, &params(1.0, 0, 0.9), &mut r) < 2);
        }
    }

    #[test]
    fn temperature_follows_the_softmax() {
        // Two tokens with logits ln 3 and 0: probabilities 3/4 and 1/4 at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let mut r = Rng::new(11);
        let n = 20_000;
        let zeros = (0..n)
            .filter(|_| sample(&logits, &params(1.0, 0, 1.0), &mut r) == 0)
            .count();
        let f = zeros as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.02, "frequency {f}");
        // Temperature 2 flattens: sqrt(3)/(sqrt(3)+1) ≈ 0.634.
        let zeros = (0..n)
            .filter(|_| sample(&logits, &params(2.0, 0, 1.0), &mut r) == 0)
            .count();
        let f = zeros as f64 / n as f64;
        assert!((f - 0.634).abs() < 0.02, "frequency {f}");
    }
}
