//! A prefill engine's K/V leaves in parts as its chunks are computed: every part before the
//! first token but the last, in order, and a decode engine given them continues with the
//! tokens of one engine computing everything.

use std::time::Duration;

use strata_engine::*;

mod common;
use common::*;

fn chunked(tokens: usize) -> EngineConfig {
    EngineConfig {
        max_batch_tokens: tokens,
        ..EngineConfig::default()
    }
}

fn decode_with(e: &EngineHandle, p: &[u32], first: u32, kv: &ExportedKv) -> Vec<u32> {
    let mut s = e
        .submit_prefilled(p.to_vec(), greedy(10), imported(kv, first))
        .unwrap();
    let mut got = Vec::new();
    while let Some(ev) = s.events.blocking_recv() {
        if let Event::Token(t) = ev {
            got.push(t);
        }
    }
    got
}

#[test]
fn a_prompt_computed_in_chunks_leaves_in_parts_and_continues_identically() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    // One page a model call: 70 tokens are five calls, pages 0..4 whole, page 4 partial.
    let single = start(&path, 64, 0, None, chunked(PS));
    let prefill = start(&path, 64, 0, None, chunked(PS));
    let decode = start(&path, 64, 0, None, EngineConfig::default());
    let p = prompt(70, 9);
    let (want, _, _) = run(&single, &p, greedy(10));

    let (first, parts) = export_parts(&prefill, &p, 0);
    let shape: Vec<(bool, usize, usize)> = parts
        .iter()
        .map(|(before, k)| (*before, k.first, k.pages.len()))
        .collect();
    assert_eq!(
        shape,
        vec![
            (true, 0, 1),
            (true, 1, 1),
            (true, 2, 1),
            (true, 3, 1),
            (false, 4, 1)
        ],
        "a page after each call, the last after the first token"
    );
    let (first2, kv) = export_from(&prefill, &p, 0);
    assert_eq!(first2, first);
    assert_eq!(decode_with(&decode, &p, first, &kv), want);

    // The decode engine holds 2 pages: the parts start at page 2 — the prefill engine's own
    // cached prefix (all of it now) leaves in the first part.
    let (first3, parts) = export_parts(&prefill, &p, 2);
    assert_eq!(first3, first);
    assert_eq!(parts[0].1.first, 2);
    let (_, kv) = export_from(&prefill, &p, 2);
    assert_eq!((kv.first, kv.pages.len()), (2, 3));
    for e in [single, prefill, decode] {
        e.shutdown(Duration::from_secs(5));
    }
}
