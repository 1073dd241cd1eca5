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
    turn_with(e, p, greedy(n))
}

/// [`turn`] with `params` (log probabilities asked for); `Done` names the request's own
/// prompt and answer, not the positions computed again.
fn turn_with(e: &EngineHandle, p: &[u32], params: SamplingParams) -> (Vec<u32>, Vec<u32>, usize) {
    let params = SamplingParams {
        logprobs: Some(0),
        ..params
    };
    let mut s = e.submit(p.to_vec(), params).unwrap();
    let (mut toks, mut lps, mut cached) = (Vec::new(), Vec::new(), 0);
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::Admitted { cached: c } => cached = c.total(),
            Event::Token(t) => toks.push(t),
            Event::Logprobs(l) => lps.push(l.logprob.to_bits()),
            Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                assert_eq!((prompt_tokens, completion_tokens), (p.len(), toks.len()));
                break;
            }
            _ => {}
        }
    }
    (toks, lps, cached)
}

/// Turn one, then turn two = turn one's prompt, its answer and more, on an engine with
/// `cfg`: turn two's tokens and log-probability bits, its cached tokens, and the engine's
/// settled tokens.
fn conversation(cfg: EngineConfig) -> ((Vec<u32>, Vec<u32>, usize), u64) {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
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

/// An engine's configuration: no prefix cache (`None`), or one caching answers so.
fn config(mode: Option<CacheOutputs>) -> EngineConfig {
    EngineConfig {
        prefix_cache: mode.is_some(),
        cache_outputs: mode.unwrap_or(CacheOutputs::Exact),
        ..EngineConfig::default()
    }
}

#[test]
fn the_next_turn_over_a_cached_answer_is_the_uncached_bits_only_when_settled() {
    let (fresh, _) = conversation(config(None));
    let ((toks, lps, cached), settled) = conversation(config(Some(CacheOutputs::Exact)));
    // The answer's whole pages were cached: 37 + 30 computed positions, 4 pages of 16.
    assert_eq!(cached, 64);
    assert_eq!(settled, 29 + 11, "each turn's generated positions with K/V");
    assert_eq!((toks, lps), (fresh.0.clone(), fresh.1.clone()));
    let ((_, lps, cached), settled) = conversation(config(Some(CacheOutputs::AsDecoded)));
    assert_eq!((cached, settled), (64, 0));
    assert_ne!(
        lps, fresh.1,
        "cached as decoded, the answer's K/V are other bits"
    );
    let ((_, lps, cached), _) = conversation(config(Some(CacheOutputs::Off)));
    assert_eq!(cached, 32, "the prompt's whole pages only");
    assert_eq!(lps, fresh.1);
}

/// An answer ended by a stop token (every generated position has K/V: all are computed
/// again), and one whose client left before `Done` (computed again and cached all the same):
/// the next turn over either is the uncached bits.
#[test]
fn a_stopped_answer_and_one_whose_client_left_are_settled_too() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let fresh = start(&path, 64, 64, None, config(None));
    let e = start(&path, 64, 64, None, EngineConfig::default());
    let p = prompt(37, 2);
    let (long, _, _) = turn(&fresh, &p, 30);
    let stop = long[12];
    let params = SamplingParams {
        stop_token_ids: vec![stop],
        ..greedy(30)
    };
    let (answer, _, _) = turn_with(&e, &p, params.clone());
    assert_eq!(turn_with(&fresh, &p, params).0, answer);
    assert!(answer.len() <= 12 && !answer.contains(&stop), "{answer:?}");
    assert_eq!(e.snapshot().settled_tokens, answer.len() as u64);
    let mut next = p.clone();
    next.extend(&answer);
    next.extend(prompt(9, 4));
    let (toks, lps, cached) = turn(&e, &next, 8);
    assert_eq!(cached, (p.len() + answer.len()) / 16 * 16);
    assert_eq!((toks, lps), {
        let (t, l, _) = turn(&fresh, &next, 8);
        (t, l)
    });
    // A client that leaves after its last token, before `Done`.
    let q = prompt(41, 9);
    let before = e.snapshot().settled_tokens;
    let mut s = e.submit(q.clone(), greedy(20)).unwrap();
    let mut answer = Vec::new();
    while answer.len() < 20 {
        if let Some(Event::Token(t)) = s.events.blocking_recv() {
            answer.push(t);
        }
    }
    drop(s);
    let t = std::time::Instant::now();
    while e.snapshot().settled_tokens < before + 19 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the answer was never settled"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut next = q.clone();
    next.extend(&answer);
    let (_, _, cached) = turn(&e, &next, 4);
    assert_eq!(cached, (q.len() + 19) / 16 * 16);
    e.shutdown(Duration::from_secs(5));
    fresh.shutdown(Duration::from_secs(5));
}

/// An answer computed again takes a share of each step's prefill budget however long the
/// prompts beside it: its client's `Done` does not wait for another request's prefill (here a
/// 480-token prompt, 8 tokens a step: the answer's `Done` comes before that prompt's first
/// token).
#[test]
fn a_long_prompt_beside_it_does_not_hold_up_an_answers_end() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let cfg = EngineConfig {
        max_batch_tokens: 8,
        ..EngineConfig::default()
    };
    let e = start(&path, 64, 64, None, cfg);
    let mut a = e.submit(prompt(8, 3), greedy(24)).unwrap();
    let mut b = e.submit(prompt(480, 5), greedy(2)).unwrap();
    loop {
        match b.events.blocking_recv() {
            Some(Event::Token(_)) => break,
            Some(_) => {}
            None => panic!("the long prompt ended without a token"),
        }
    }
    // A's end was sent before B's first token: it is in A's channel now.
    let mut done = false;
    while let Ok(ev) = a.events.try_recv() {
        done |= matches!(ev, Event::Done { .. });
    }
    assert!(
        done,
        "the answer's end waited for the long prompt's prefill"
    );
    assert_eq!(e.snapshot().settled_tokens, 23);
    drop((a, b));
    e.shutdown(Duration::from_secs(5));
}
