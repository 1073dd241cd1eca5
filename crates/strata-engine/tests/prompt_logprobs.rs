//! Prompt log probabilities through the scheduler: every prompt token after the first gets
//! the log-softmax of the logits before it, equal to the plain forward pass over the whole
//! prompt, across prefill chunks, with the prompt computed whole even when it is cached.

use std::sync::Arc;

use strata_engine::*;
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::{CacheConfig, PageLayout, TieredCache};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{Gguf, Model};

const PS: usize = 16;

fn model(path: &std::path::Path) -> Model {
    Model::load(&mut Gguf::open(path).unwrap()).unwrap()
}

/// Runs a request: (prompt log probabilities, tokens, cached prompt tokens).
fn run(
    e: &EngineHandle,
    p: &[u32],
    params: SamplingParams,
) -> (Option<PromptLogprobs>, Vec<u32>, usize) {
    let mut s = e.submit(p.to_vec(), params).unwrap();
    let (mut lps, mut out) = (None, Vec::new());
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::PromptLogprobs(l) => {
                assert!(
                    out.is_empty(),
                    "the prompt's log probabilities come before any token"
                );
                assert!(lps.is_none(), "sent once");
                lps = Some((*l).clone());
            }
            Event::Token(t) => out.push(t),
            Event::Done { reason, cached, .. } => {
                assert_eq!(reason, FinishReason::Length);
                return (lps, out, cached.total());
            }
            _ => {}
        }
    }
    panic!("no Done");
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - z.ln()).collect()
}

#[test]
fn prompt_logprobs_equal_the_forward_pass_over_chunks_and_skip_the_cache() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("tiny.gguf");
    write_tiny(&path, &TinySpec::default()).unwrap();
    let m = model(&path);
    let layout = PageLayout::new(PS, vec![m.pool_kind()]).unwrap();
    let cache = TieredCache::new(CacheConfig::new(layout, 64, 64), &HeapAllocator, None).unwrap();
    let e = Engine::start(model(&path), cache, EngineConfig::default());
    // Longer than one chunk of rows (256): the log probabilities span two steps.
    let p: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % 280).collect();
    let greedy = SamplingParams {
        max_tokens: 3,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let (none, plain, _) = run(&e, &p, greedy.clone());
    assert!(none.is_none(), "not asked, not sent");
    let asked = SamplingParams {
        prompt_logprobs: Some(3),
        ..greedy.clone()
    };
    let (lps, out, cached) = run(&e, &p, asked.clone());
    let lps = lps.expect("asked, sent");
    assert_eq!(cached, 0, "the cached prompt is computed whole");
    assert_eq!(out, plain, "the answer does not change");
    assert_eq!(lps.first_token, p[0]);
    assert_eq!(lps.tokens.len(), p.len() - 1);

    // The plain forward pass over the whole prompt, every row's logits.
    let layout = Arc::new(PageLayout::new(PS, vec![m.pool_kind()]).unwrap());
    let pages = p.len().div_ceil(PS) as u32;
    let pool = DevicePool::new(layout, pages, &HeapAllocator).unwrap();
    let table: Vec<u32> = (0..pages).collect();
    let all = m.forward_one(&pool, &p, 0, &table, true).unwrap();
    let vocab = all.len() / p.len();
    for (i, l) in lps.tokens.iter().enumerate() {
        let want = log_softmax(&all[i * vocab..(i + 1) * vocab]);
        assert_eq!(l.token, p[i + 1]);
        assert!(
            (l.logprob as f64 - want[p[i + 1] as usize]).abs() < 1e-4,
            "position {}",
            i + 1
        );
        assert_eq!(l.top.len(), 3);
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
        for (k, &(t, lp)) in l.top.iter().enumerate() {
            assert!((lp as f64 - want[t as usize]).abs() < 1e-4);
            assert!(
                (want[t as usize] - want[order[k]]).abs() < 1e-5,
                "rank {k} at {}",
                i + 1
            );
        }
    }
    // Two such requests at once share the step's 256 rows and get the same answers.
    let q: Vec<u32> = (0..290u32).map(|i| (i * 53 + 7) % 280).collect();
    let (alone, _, _) = run(&e, &q, asked.clone());
    let both = [
        (&p, e.submit(p.clone(), asked.clone()).unwrap()),
        (&q, e.submit(q.clone(), asked.clone()).unwrap()),
    ];
    for (prompt, mut s) in both {
        let mut got = None;
        while let Some(ev) = s.events.blocking_recv() {
            if let Event::PromptLogprobs(l) = ev {
                got = Some((*l).clone());
            }
        }
        let want = if prompt == &p {
            &lps
        } else {
            alone.as_ref().unwrap()
        };
        let got = got.expect("sent");
        assert_eq!(got.tokens.len(), want.tokens.len());
        for (x, y) in got.tokens.iter().zip(&want.tokens) {
            assert_eq!(x.token, y.token);
            assert!((x.logprob - y.logprob).abs() < 1e-4);
        }
    }
    // The cached prompt still serves the next plain request.
    let (_, again, cached) = run(&e, &p, greedy);
    assert_eq!(again, plain);
    assert!(cached > 0);
    // Too many alternatives is refused.
    let bad = SamplingParams {
        prompt_logprobs: Some(21),
        ..SamplingParams::default()
    };
    assert!(matches!(
        e.submit(p, bad).err(),
        Some(SubmitError::BadModifier {
            field: "logprobs",
            ..
        })
    ));
}
