//! Next-token choice: greedy, or temperature with top-k, min-p and top-p, from a seeded
//! generator (SplitMix64: the same seed gives the same tokens on every machine).
//!
//! Before the choice, in vLLM's order: stop tokens masked until `min_tokens`, `logit_bias`
//! added, the repetition penalty (prompt and output tokens), the frequency and presence
//! penalties (output tokens). Then temperature, top-k, min-p, top-p. Greedy takes the largest
//! logit after the penalties.

use rustc_hash::FxHashMap;

use crate::constraint::TokenMask;
use crate::request::{SamplingParams, TokenLogprobs};

/// What the logit modifiers look at: the request's tokens so far and its stop tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct History<'a> {
    pub prompt: &'a [u32],
    pub output: &'a [u32],
    /// End-of-sequence and `stop_token_ids` (masked until `min_tokens`), or under a mask with
    /// `ignore_eos` the end-of-sequence tokens (masked while the mask allows another token:
    /// the caller passes them only then).
    pub stops: &'a [u32],
    /// A constraint's mask of the tokens allowed next (applied first), and the tokens that
    /// end the output (allowed when the mask says it may end).
    pub mask: Option<&'a TokenMask>,
    pub ends: &'a [u32],
}

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

/// Applies the logit modifiers of `p` (see the module docs) to `logits`.
pub fn modify(logits: &mut [f32], p: &SamplingParams, h: &History) {
    let n = logits.len();
    if h.output.len() < p.min_tokens || (p.ignore_eos && h.mask.is_some()) {
        for &t in h.stops {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if p.repetition_penalty != 1.0 {
        let mut seen = vec![false; n];
        for &t in h.prompt.iter().chain(h.output) {
            if let Some(s) = seen.get_mut(t as usize) {
                if !*s {
                    *s = true;
                    let l = &mut logits[t as usize];
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let mut counts: FxHashMap<u32, u32> = FxHashMap::default();
        for &t in h.output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
    }
}

/// Picks the next token from `logits` under `p`, given the request's tokens so far.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng, h: &History) -> u32 {
    sample_with_logprobs(logits, p, rng, h).0
}

/// [`sample`], and the chosen token's log probabilities when `p` asks for them.
pub fn sample_with_logprobs(
    logits: &[f32],
    p: &SamplingParams,
    rng: &mut Rng,
    h: &History,
) -> (u32, Option<TokenLogprobs>) {
    let modified;
    let l = if p.modifies_logits() || h.mask.is_some() {
        let mut m = logits.to_vec();
        if let Some(mask) = h.mask {
            mask.apply(&mut m, h.ends);
        }
        modify(&mut m, p, h);
        modified = m;
        &modified[..]
    } else {
        logits
    };
    let t = choose(l, p, rng);
    (t, p.logprobs.map(|k| logprobs(l, p.temperature, t, k)))
}

/// The least log probability reported (OpenAI's floor): below it, at a temperature near 0,
/// the value would be minus infinity, which JSON cannot carry (it went out as `null`).
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// Log-softmax of `logits / temperature` (temperature 1 when greedy): the chosen token's
/// value and the `k` largest (of the tokens that could be chosen); none below
/// [`LOGPROB_FLOOR`].
pub fn logprobs(logits: &[f32], temperature: f32, chosen: u32, k: usize) -> TokenLogprobs {
    let t = if temperature > 0.0 {
        temperature as f64
    } else {
        1.0
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&x| ((x as f64 - max) / t).exp()).sum();
    let lp = |x: f32| (((x as f64 - max) / t - z.ln()) as f32).max(LOGPROB_FLOOR);
    let mut top: Vec<u32> = (0..logits.len() as u32).collect();
    let by = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let k = k.min(top.len());
    if k > 0 && k < top.len() {
        top.select_nth_unstable_by(k - 1, by);
    }
    top.truncate(k);
    top.sort_unstable_by(by);
    // Tokens a constraint ruled out are no alternatives.
    top.retain(|&i| logits[i as usize] > f32::NEG_INFINITY);
    TokenLogprobs {
        token: chosen,
        logprob: lp(logits[chosen as usize]),
        top: top
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// Whether a choice under `p` draws from the generator (one draw when it does).
fn draws(p: &SamplingParams) -> bool {
    !(p.temperature <= 0.0 || p.top_k == 1)
}

/// Moves the generator past one choice made elsewhere (a prefill worker's first token).
pub fn skip_choice(p: &SamplingParams, rng: &mut Rng) {
    if draws(p) {
        rng.next_f64();
    }
}

/// The choice itself, on final logits.
fn choose(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if !draws(p) {
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
    // Min-p: drop what is less likely than min_p × the likeliest (sorted: the first).
    if p.min_p > 0.0 {
        let floor = probs[0] * p.min_p as f64;
        let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        probs.truncate(keep);
        idx.truncate(keep);
        let z: f64 = probs.iter().sum();
        for x in &mut probs {
            *x /= z;
        }
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

    const H: History<'static> = History {
        prompt: &[],
        output: &[],
        stops: &[],
        mask: None,
        ends: &[],
    };

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
        assert_eq!(
            sample(&[0.1, 3.0, 2.0], &params(0.0, 0, 1.0), &mut r, &H),
            1
        );
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut r = Rng::new(seed);
            (0..50)
                .map(|_| sample(&logits, &params(1.0, 0, 1.0), &mut r, &H))
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
            assert!(sample(&logits, &params(1.0, 2, 1.0), &mut r, &H) < 2);
        }
        // p(0) ≈ 0.665, p(0)+p(1) ≈ 0.91: top_p 0.6 keeps only token 0.
        for _ in 0..200 {
            assert_eq!(sample(&logits, &params(1.0, 0, 0.6), &mut r, &H), 0);
        }
        for _ in 0..500 {
            assert!(sample(&logits, &params(1.0, 0, 0.9), &mut r, &H) < 2);
        }
    }

    #[test]
    fn temperature_follows_the_softmax() {
        // Two tokens with logits ln 3 and 0: probabilities 3/4 and 1/4 at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let mut r = Rng::new(11);
        let n = 20_000;
        let zeros = (0..n)
            .filter(|_| sample(&logits, &params(1.0, 0, 1.0), &mut r, &H) == 0)
            .count();
        let f = zeros as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.02, "frequency {f}");
        // Temperature 2 flattens: sqrt(3)/(sqrt(3)+1) ≈ 0.634.
        let zeros = (0..n)
            .filter(|_| sample(&logits, &params(2.0, 0, 1.0), &mut r, &H) == 0)
            .count();
        let f = zeros as f64 / n as f64;
        assert!((f - 0.634).abs() < 0.02, "frequency {f}");
    }

    fn frequency(logits: &[f32], p: &SamplingParams, h: &History, token: u32) -> f64 {
        let mut r = Rng::new(5);
        let n = 20_000;
        let hits = (0..n)
            .filter(|_| sample(logits, p, &mut r, h) == token)
            .count();
        hits as f64 / n as f64
    }

    #[test]
    fn min_p_drops_the_unlikely() {
        // Probabilities 0.5, 0.3, 0.2 at temperature 1: min_p 0.5 keeps tokens ≥ 0.25.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = SamplingParams {
            min_p: 0.5,
            ..params(1.0, 0, 1.0)
        };
        assert_eq!(frequency(&logits, &p, &H, 2), 0.0);
        // Renormalised: 0.5 / 0.8 = 0.625.
        assert!((frequency(&logits, &p, &H, 0) - 0.625).abs() < 0.02);
    }

    #[test]
    fn penalties_follow_openai_and_vllm() {
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        };
        let h = History {
            prompt: &[0],
            output: &[1, 1, 2],
            ..H
        };
        let mut l = [1.0f32, 1.0, 1.0, 1.0];
        modify(&mut l, &p, &h);
        // Prompt tokens are not penalised by OpenAI's penalties; token 1 twice, token 2 once.
        assert_eq!(l, [1.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25, 1.0]);
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let mut l = [3.0f32, -3.0, 3.0, 3.0];
        modify(&mut l, &p, &h);
        // Prompt and output tokens, each once: positive halved, negative doubled.
        assert_eq!(l, [1.5, -6.0, 1.5, 3.0]);
    }

    #[test]
    fn logit_bias_and_min_tokens_steer_even_greedy_choice() {
        let logits = [2.0f32, 1.0, 0.0];
        let mut r = Rng::new(1);
        let biased = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..SamplingParams::default()
        };
        assert_eq!(sample(&logits, &biased, &mut r, &H), 2);
        let banned = SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..SamplingParams::default()
        };
        assert_eq!(sample(&logits, &banned, &mut r, &H), 1);
        // Token 0 is the end of sequence: not before two tokens were generated.
        let p = SamplingParams {
            min_tokens: 2,
            ..SamplingParams::default()
        };
        let early = History {
            prompt: &[1],
            output: &[1],
            stops: &[0],
            ..H
        };
        assert_eq!(sample(&logits, &p, &mut r, &early), 1);
        let late = History {
            output: &[1, 1],
            ..early
        };
        assert_eq!(sample(&logits, &p, &mut r, &late), 0);
        // At temperature 1 as well: never, not just rarely.
        let t1 = SamplingParams {
            temperature: 1.0,
            ..p
        };
        assert_eq!(frequency(&logits, &t1, &early, 0), 0.0);
    }

    #[test]
    fn a_mask_restricts_the_choice_and_its_logprobs() {
        // Token 0 is likeliest but ruled out; 1 and 2 allowed; 3 ends and may (can_end).
        let logits = [5.0f32, 1.0, 2.0, 0.0];
        let mask = TokenMask {
            words: vec![0b0110],
            can_end: true,
        };
        let h = History {
            mask: Some(&mask),
            ends: &[3],
            ..H
        };
        let p = SamplingParams {
            temperature: 1.0,
            logprobs: Some(4),
            ..SamplingParams::default()
        };
        let mut r = Rng::new(9);
        for _ in 0..300 {
            let (t, lp) = sample_with_logprobs(&logits, &p, &mut r, &h);
            assert!(t != 0, "a ruled-out token was chosen");
            let lp = lp.unwrap();
            assert_eq!(lp.top.len(), 3, "ruled-out tokens are no alternatives");
            // Renormalised over 1, 2, 3.
            let z = 1f32.exp() + 2f32.exp() + 1.0;
            let want = logits[t as usize] - z.ln();
            assert!((lp.logprob - want).abs() < 1e-5);
        }
        // Greedy: the likeliest allowed; without can_end the stop token is out too.
        let closed = TokenMask {
            words: vec![0b11000],
            can_end: false,
        };
        let h = History {
            mask: Some(&closed),
            ends: &[3],
            ..H
        };
        let (t, _) = sample_with_logprobs(
            &[0.0, 9.0, 0.0, 1.0, 2.0],
            &SamplingParams::default(),
            &mut r,
            &h,
        );
        assert_eq!(t, 4, "a stop token is out while the output may not end");
    }

    #[test]
    fn a_temperature_near_zero_gives_finite_logprobs() {
        let lp = logprobs(&[1.0, 2.0, 3.0], 1e-45, 2, 3);
        assert_eq!(lp.logprob, 0.0);
        let alts: Vec<f32> = lp.top.iter().map(|&(_, v)| v).collect();
        assert_eq!(alts, [0.0, LOGPROB_FLOOR, LOGPROB_FLOOR]);
    }

    #[test]
    fn logprobs_are_the_log_softmax_the_choice_was_made_from() {
        // Probabilities 0.5, 0.3, 0.2.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let p = SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::default()
        };
        let (t, lp) = sample_with_logprobs(&logits, &p, &mut Rng::new(1), &H);
        let lp = lp.unwrap();
        assert_eq!((t, lp.token), (0, 0), "greedy takes the likeliest");
        assert!((lp.logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(lp.top.len(), 2);
        assert_eq!((lp.top[0].0, lp.top[1].0), (0, 1));
        assert!((lp.top[1].1 - 0.3f32.ln()).abs() < 1e-6);
        // Temperature 2 flattens: p ∝ sqrt(p).
        let hot = SamplingParams {
            temperature: 2.0,
            ..p.clone()
        };
        let lp = logprobs(&logits, hot.temperature, 2, 0);
        let s: f32 = [0.5f32, 0.3, 0.2].iter().map(|x| x.sqrt()).sum();
        assert!((lp.logprob - (0.2f32.sqrt() / s).ln()).abs() < 1e-5);
        assert!(lp.top.is_empty());
        // After a bias: the distribution the choice was made from.
        let biased = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..p
        };
        let (t, lp) = sample_with_logprobs(&logits, &biased, &mut Rng::new(1), &H);
        assert_eq!(t, 2);
        assert!(lp.unwrap().logprob > -1e-6);
    }
}
