//! Helpers shared by the engine's integration tests: a tiny random-weight model, an engine
//! over it, a request run to its end.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use strata_engine::request::CachedTokens;
use strata_engine::*;
use strata_kv::memory::HeapAllocator;
use strata_kv::storage::Storage;
use strata_kv::{CacheConfig, PageLayout, TieredCache};
use strata_model::tiny::{write_tiny, TinySpec};
use strata_model::{Gguf, Model};

pub const PS: usize = 16;

pub fn model(path: &Path) -> Model {
    let mut g = Gguf::open(path).unwrap();
    Model::load(&mut g).unwrap()
}

pub fn start(
    path: &Path,
    device_pages: u32,
    host_pages: u32,
    storage: Option<Arc<dyn Storage>>,
    cfg: EngineConfig,
) -> EngineHandle {
    let m = model(path);
    let layout = PageLayout::new(PS, vec![m.pool_kind()]).unwrap();
    let mut cc = CacheConfig::new(layout, device_pages, host_pages);
    cc.model_id = "tiny".into();
    let cache = TieredCache::new(cc, &HeapAllocator, storage).unwrap();
    Engine::start(m, cache, cfg)
}

pub fn tiny_file(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("tiny.gguf");
    write_tiny(&p, &TinySpec::default()).unwrap();
    p
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11 + salt) % 280).collect()
}

pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

/// Waits for the stream's first token (the events before it skipped).
pub fn first_token(s: &mut RequestStream) {
    loop {
        match s.events.blocking_recv() {
            Some(Event::Token(_)) => return,
            Some(_) => continue,
            None => panic!("the stream ended before its first token"),
        }
    }
}

/// Runs a request to the end: (tokens, cached tokens, finish reason).
pub fn run(
    e: &EngineHandle,
    p: &[u32],
    params: SamplingParams,
) -> (Vec<u32>, CachedTokens, FinishReason) {
    let mut s = e.submit(p.to_vec(), params).unwrap();
    let mut out = Vec::new();
    let mut cached = None;
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::Admitted { cached: c } => cached = Some(c),
            Event::Kv(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) | Event::Held { .. } => {}
            Event::Token(t) => out.push(t),
            Event::Done {
                reason,
                completion_tokens,
                cached: c,
                ..
            } => {
                assert_eq!(completion_tokens, out.len());
                assert_eq!(Some(c), cached);
                return (out, c, reason);
            }
        }
    }
    panic!("stream ended without Done");
}

/// A prefill engine's first token and the parts of the K/V of `p`'s pages from `from` on, in
/// order, each with whether it came before the first token.
pub fn export_parts(
    e: &EngineHandle,
    p: &[u32],
    from: usize,
) -> (u32, Vec<(bool, Arc<ExportedKv>)>) {
    let mut s = e.submit_export(p.to_vec(), greedy(1), from).unwrap();
    let (mut first, mut parts) = (None, Vec::new());
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::Token(t) => first = Some(t),
            Event::Kv(k) => parts.push((first.is_none(), k)),
            _ => {}
        }
    }
    (first.expect("a first token"), parts)
}

/// A prefill engine's first token and K/V of `p`'s pages from `from` on (its parts joined,
/// checked to follow each other without gaps up to the prompt's last page).
pub fn export_from(e: &EngineHandle, p: &[u32], from: usize) -> (u32, Arc<ExportedKv>) {
    let (first, parts) = export_parts(e, p, from);
    let mut kv = ExportedKv {
        first: from,
        pages: Vec::new(),
        hashes: Vec::new(),
    };
    for (_, part) in parts {
        assert_eq!(part.first, kv.first + kv.pages.len(), "parts in order");
        assert_eq!(part.pages.len(), part.hashes.len());
        kv.pages.extend(part.pages.iter().cloned());
        kv.hashes.extend(part.hashes.iter().copied());
    }
    assert_eq!(
        kv.first + kv.pages.len(),
        p.len().div_ceil(PS),
        "up to the last page"
    );
    (first, Arc::new(kv))
}

/// K/V pages a prefill engine exported for `p`, as a decode engine imports them after the
/// prefill's first token `first` (no log-probabilities, nothing cached before).
pub fn imported(kv: &ExportedKv, first: u32) -> ImportedKv {
    ImportedKv {
        first_page: kv.first,
        first_logprobs: None,
        prompt_logprobs: None,
        pages: kv.pages.clone(),
        first_token: first,
        cached: CachedTokens::default(),
    }
}
