//! `CacheOutputs`: a conversation's next turn (a prompt that extends a cached answer) gets the
//! bits an uncached engine gives it only when the answer was computed again as prompt rows
//! before it was cached (`exact`, the default); cached as decoded, the K/V of the answer's
//! positions differ and so do the next turn's log probabilities.

use std::time::Duration;

use strata_engine::*;

mod common;
use common::*;

/// Runs `p` to its end: its tokens, the log probability of each, and its cached tokens.
fn turn(e: &EngineHandle, p: &[u32], n: usize) -> (Vec<u32>, Vec<u32>, usize) {
    let params = SamplingParams {
        logprobs: Some(0),
        ..greedy(n)
    };
    let mut s = e.submit(p.to_vec(), params).unwrap();
    let (mut toks, mut lps, mut cached) = (Vec::new(), Vec::new(), 0);
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::Admitted { cached: c } => cached = c.total(),
            Event::Token(t) => toks.push(t),
            Event::Logprobs(l) => lps.push(l.logprob.to_bits()),
            Event::Done { .. } => break,
            _ => {}
        }
    }
    (toks, lps, cached)
}

/// Turn one, then turn two = turn one's prompt, its answer and more, on an engine with the
/// given `cache_outputs`: turn two's tokens and log-probability bits, its cached tokens, and
/// the engine's settled tokens.
fn conversation(mode: CacheOutputs) -> ((Vec<u32>, Vec<u32>, usize), u64) {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let cfg = EngineConfig {
        cache_outputs: mode,
        ..EngineConfig::default()
    };
    let e = start(&path, 64, 64, None, cfg);
    let p = prompt(37, 1);
    let (answer, _, _) = turn(&e, &p, 30);
    let mut next = p.clone();
    next.extend(&answer);
    next.extend(prompt(9, 4));
    let two = turn(&e, &next, 12);
    let settled = e.snapshot().settled_tokens;
    e.shutdown(Duration::from_secs(5));
    (two, settled)
}

#[test]
fn the_next_turn_over_a_cached_answer_is_the_uncached_bits_only_when_settled() {
    let fresh = {
        let d = tempfile::tempdir().unwrap();
        let path = tiny_file(d.path());
        let cfg = EngineConfig {
            prefix_cache: false,
            ..EngineConfig::default()
        };
        let e = start(&path, 64, 64, None, cfg);
        let mut next = prompt(37, 1);
        let (answer, _, _) = turn(&e, &next, 30);
        next.extend(&answer);
        next.extend(prompt(9, 4));
        let two = turn(&e, &next, 12);
        e.shutdown(Duration::from_secs(5));
        two
    };
    let ((toks, lps, cached), settled) = conversation(CacheOutputs::Exact);
    // The answer's whole pages were cached: 37 + 30 computed positions, 4 pages of 16.
    assert_eq!(cached, 64);
    assert_eq!(settled, 29 + 11, "each turn's generated positions with K/V");
    assert_eq!((toks, lps), (fresh.0.clone(), fresh.1.clone()));
    let ((_, lps, cached), settled) = conversation(CacheOutputs::AsDecoded);
    assert_eq!((cached, settled), (64, 0));
    assert_ne!(
        lps, fresh.1,
        "cached as decoded, the answer's K/V are other bits"
    );
    let ((_, lps, cached), _) = conversation(CacheOutputs::Off);
    assert_eq!(cached, 32, "the prompt's whole pages only");
    assert_eq!(lps, fresh.1);
}
