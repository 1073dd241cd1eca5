//! The scheduler end to end on a tiny random-weight model: outputs equal the plain forward
//! pass, prefixes from every tier give identical tokens, cancellation and refusals.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::request::CachedTokens;
use strata_engine::*;
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::storage::DiskStorage;
use strata_kv::storage::Storage;
use strata_kv::{CacheConfig, PageLayout, TieredCache};

mod common;
use common::*;

/// The same greedy tokens through the plain forward pass (prefill at once, then one by one).
fn reference(path: &Path, p: &[u32], n: usize) -> Vec<u32> {
    let m = model(path);
    let layout = Arc::new(PageLayout::new(PS, vec![m.pool_kind()]).unwrap());
    let pages = (p.len() + n).div_ceil(PS) as u32;
    let pool = DevicePool::new(layout, pages, &HeapAllocator).unwrap();
    let table: Vec<u32> = (0..pages).collect();
    let mut logits = m.forward_one(&pool, p, 0, &table, false).unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let t = strata_engine::sampler::argmax(&logits);
        out.push(t);
        logits = m
            .forward_one(&pool, &[t], p.len() + i, &table, false)
            .unwrap();
    }
    out
}

#[test]
fn greedy_equals_the_forward_pass_and_repeats_hit_the_device_tier() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let e = start(&path, 64, 64, None, EngineConfig::default());
    let p = prompt(45, 0);
    let (a, c, r) = run(&e, &p, greedy(12));
    assert_eq!(r, FinishReason::Length);
    assert_eq!(c.total(), 0);
    assert_eq!(a, reference(&path, &p, 12));
    let (b, c, _) = run(&e, &p, greedy(12));
    // Whole pages of the prompt minus its last token: 44 → 32.
    assert_eq!(c.device, 32);
    assert_eq!(b, a);
    let s = e.snapshot();
    assert_eq!(s.prompt_tokens, 90);
    assert_eq!(
        s.cached_device_tokens
            + s.cached_host_tokens
            + s.cached_storage_tokens
            + s.computed_prompt_tokens,
        s.prompt_tokens
    );
    assert_eq!(s.finished.length, 2);
    assert_eq!(s.device_pages_held, 0);
    e.shutdown(Duration::from_secs(5));
}

#[test]
fn prefix_from_device_host_and_disk_gives_identical_tokens() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let disk: Arc<dyn Storage> =
        Arc::new(DiskStorage::open(d.path().join("l3"), 1 << 30, false).unwrap());
    let e = start(&path, 64, 64, Some(disk), EngineConfig::default());
    let p = prompt(70, 5);
    let (cold, _, _) = run(&e, &p, greedy(10));
    let (dev, c, _) = run(&e, &p, greedy(10));
    assert_eq!(c.device, 64);
    assert_eq!(e.flush(FlushScope::Device).map(|f| f.0 > 0), Some(true));
    let (host, c, _) = run(&e, &p, greedy(10));
    assert_eq!((c.device, c.host), (0, 64));
    e.flush(FlushScope::All).unwrap();
    let (disk, c, _) = run(&e, &p, greedy(10));
    assert_eq!((c.device, c.host, c.storage), (0, 0, 64));
    assert_eq!(dev, host);
    assert_eq!(dev, disk);
    // A cached prefix leaves 6 prompt tokens to compute (a decode-sized call); cold computes
    // 70 at once. Both are close; the tiers are exact copies of each other.
    assert_eq!(cold.len(), dev.len());
    e.shutdown(Duration::from_secs(5));
}

/// A client that leaves: its request ends, its pages are freed but for its prompt's whole
/// pages, which join the cache (a client that retries finds them).
#[test]
fn dropping_the_stream_cancels_and_frees_pages() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let e = start(&path, 64, 0, None, EngineConfig::default());
    let before = e.snapshot().device.pages_used;
    let p = prompt(40, 9);
    let mut s = e.submit(p.clone(), greedy(400)).unwrap();
    first_token(&mut s);
    let t = Instant::now();
    while e.snapshot().device_pages_held == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the request holds no pages"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(s);
    let t = Instant::now();
    while e.snapshot().running > 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "cancel not seen");
        std::thread::sleep(Duration::from_millis(5));
    }
    let snap = e.snapshot();
    assert_eq!(snap.device_pages_held, 0);
    assert_eq!(
        snap.device.pages_used,
        before + 2,
        "the prompt's 2 whole pages"
    );
    assert_eq!(snap.finished.cancelled, 1);
    let (_, c, _) = run(&e, &p, greedy(4));
    assert_eq!(c.device, 32, "the retry finds them");
    e.shutdown(Duration::from_secs(5));
}

#[test]
fn refusals_are_immediate_and_name_the_numbers() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let e = start(&path, 8, 0, None, EngineConfig::default());
    assert_eq!(
        e.submit(vec![], greedy(1)).err(),
        Some(SubmitError::EmptyPrompt)
    );
    assert_eq!(
        e.submit(vec![1, 999], greedy(1)).err(),
        Some(SubmitError::BadToken {
            id: 999,
            vocab: 288
        })
    );
    assert_eq!(
        e.submit(vec![1], greedy(0)).err(),
        Some(SubmitError::ZeroMaxTokens)
    );
    let err = e.submit(prompt(500, 0), greedy(100)).err().unwrap();
    assert!(matches!(
        err,
        SubmitError::TooLongForContext {
            needed: 600,
            context: 512,
            ..
        }
    ));
    // 8 pages of 16 tokens = 128 tokens of KV.
    let err = e.submit(prompt(100, 0), greedy(40)).err().unwrap();
    assert_eq!(
        err.to_string(),
        "the request needs 140 tokens of KV (100 prompt + 40 max_tokens) but the device pool \
         holds 128 tokens"
    );
    e.shutdown(Duration::from_secs(5));
    assert_eq!(
        e.submit(vec![1], greedy(1)).err(),
        Some(SubmitError::ShuttingDown)
    );
}

#[test]
fn a_flood_beyond_the_queue_is_refused_and_accepted_requests_complete() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let cfg = EngineConfig {
        max_running: 2,
        max_waiting: 3,
        ..EngineConfig::default()
    };
    let e = start(&path, 64, 0, None, cfg);
    let mut accepted = Vec::new();
    let mut refused = 0;
    for i in 0..30 {
        match e.submit(prompt(30, i), greedy(20)) {
            Ok(s) => accepted.push(s),
            Err(err) => {
                assert!(err.is_overload(), "{err}");
                refused += 1;
            }
        }
    }
    assert!(refused > 0 && accepted.len() >= 3);
    for mut s in accepted {
        let mut done = false;
        while let Some(ev) = s.events.blocking_recv() {
            if let Event::Done { reason, .. } = ev {
                assert_eq!(reason, FinishReason::Length);
                done = true;
            }
        }
        assert!(done);
    }
    let snap = e.snapshot();
    assert_eq!(snap.tokens_in_flight, 0);
    assert_eq!(snap.waiting, 0);
    e.shutdown(Duration::from_secs(5));
}

#[test]
fn shutdown_finishes_running_requests_within_the_grace() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let e = start(&path, 64, 0, None, EngineConfig::default());
    let mut s = e.submit(prompt(20, 1), greedy(30)).unwrap();
    let e2 = e.clone();
    let t = std::thread::spawn(move || e2.shutdown(Duration::from_secs(30)));
    let mut last = None;
    while let Some(ev) = s.events.blocking_recv() {
        last = Some(ev);
    }
    t.join().unwrap();
    assert!(matches!(
        last,
        Some(Event::Done {
            reason: FinishReason::Length,
            completion_tokens: 30,
            ..
        })
    ));
}

#[test]
fn a_page_aligned_prompt_matched_in_full_computes_only_its_last_token() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let e = start(&path, 64, 64, None, EngineConfig::default());
    let p = prompt(48, 3);
    let (_, c, _) = run(&e, &p, greedy(8));
    assert_eq!(c.total(), 0);
    let used = e.snapshot().device.pages_used;
    let (a, c, _) = run(&e, &p, greedy(8));
    // 47 of 48 tokens from the cache: the third page is copied, not shared, for the last token.
    assert_eq!(c.device, 47);
    let (b, c, _) = run(&e, &p, greedy(8));
    assert_eq!(c.device, 47);
    assert_eq!(a, b);
    let s = e.snapshot();
    assert_eq!(s.device_pages_held, 0);
    assert_eq!(s.computed_prompt_tokens, 48 + 1 + 1);
    // The copies were returned; only the generated tokens' new whole pages joined the tree.
    assert!(
        s.device.pages_used <= used + 1,
        "{} vs {used}",
        s.device.pages_used
    );
    e.shutdown(Duration::from_secs(5));
}

/// A page-aligned prompt cached in full whose prompt and max_tokens fill the device pool: its
/// locked prefix plus its reservation (one page more for the copy of the last page) exceed the
/// pool. On an idle engine it is admitted without the prefix (computed again) rather than
/// waiting for pages that can never come.
#[test]
fn a_request_its_own_cached_prefix_keeps_out_still_runs() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let cfg = EngineConfig {
        max_queue_time: Some(Duration::from_secs(20)),
        ..EngineConfig::default()
    };
    let e = start(&path, 4, 4, None, cfg);
    let p = prompt(48, 5);
    let (a, c, reason) = run(&e, &p, greedy(16));
    assert_eq!((reason, c.total()), (FinishReason::Length, 0));
    let (b, c, reason) = run(&e, &p, greedy(16));
    assert_eq!(
        reason,
        FinishReason::Length,
        "admitted, not timed out in the queue"
    );
    assert_eq!(c.total(), 0, "computed without the prefix");
    assert_eq!(a, b);
    assert_eq!(e.snapshot().device_pages_held, 0);
    e.shutdown(Duration::from_secs(5));
}

/// Prefill on one engine, K/V exported and imported into another, decode there: the tokens
/// equal one engine doing both.
#[test]
fn exported_kv_continues_on_another_engine_with_identical_tokens() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let single = start(&path, 64, 0, None, EngineConfig::default());
    let prefill = start(&path, 64, 0, None, EngineConfig::default());
    let decode = start(&path, 64, 0, None, EngineConfig::default());
    let p = prompt(37, 2);
    let (want, _, _) = run(&single, &p, greedy(10));
    let (first, kv) = export_from(&prefill, &p, 0);
    assert_eq!(kv.pages.len(), 3);
    let mut s = decode
        .submit_prefilled(p.clone(), greedy(10), imported(&kv, first))
        .unwrap();
    let mut got = Vec::new();
    while let Some(ev) = s.events.blocking_recv() {
        if let Event::Token(t) = ev {
            got.push(t);
        }
    }
    assert_eq!(got, want);
    assert_eq!(decode.snapshot().transferred_prompt_tokens, 37);
    // Wrong page count or size is refused with the numbers.
    let bad = ImportedKv {
        first_page: 0,
        first_logprobs: None,
        prompt_logprobs: None,
        pages: kv.pages[..2].to_vec(),
        first_token: 1,
        cached: CachedTokens::default(),
    };
    let e = decode
        .submit_prefilled(p.clone(), greedy(2), bad)
        .err()
        .unwrap();
    assert!(
        e.to_string()
            .contains("2 pages from page 0 received for a 37-token prompt"),
        "{e}"
    );
    for e in [single, prefill, decode] {
        e.shutdown(Duration::from_secs(5));
    }
}

#[test]
fn without_the_prefix_cache_every_prompt_is_computed_and_nothing_is_kept() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let cfg = EngineConfig {
        prefix_cache: false,
        ..EngineConfig::default()
    };
    let e = start(&path, 64, 64, None, cfg);
    let p = prompt(45, 3);
    let (a, c1, _) = run(&e, &p, greedy(8));
    let (b, c2, _) = run(&e, &p, greedy(8));
    assert_eq!((c1.total(), c2.total()), (0, 0));
    assert_eq!(a, b);
    assert_eq!(a, reference(&path, &p, 8));
    let s = e.snapshot();
    assert_eq!(s.computed_prompt_tokens, 90);
    assert_eq!(s.cache.miss_tokens, 90);
    assert_eq!(s.cache.hit_tokens(), 0);
    assert_eq!(s.device.pages_used, 0, "nothing joined the tree");
    assert_eq!(s.device_pages_held, 0);
    e.shutdown(Duration::from_secs(5));
}

#[test]
fn a_host_hit_loads_back_into_a_pool_that_holds_the_request_only_once() {
    // 8 device pages; each request needs 7 (100 prompt + 8 generated tokens, page 16). The
    // second run of `a` finds most of its prefix in host memory and reserves 7 pages less the
    // device part: the load-back fits only if it lands in that reservation rather than beside
    // it. Its tokens equal the first run's: the few prompt tokens left to compute use the same
    // (f32) weights as a full prefill, never the decode steps' Q8_0.
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let e = start(&path, 8, 64, None, EngineConfig::default());
    let a = prompt(100, 5);
    let b = prompt(100, 2);
    let (first, _, _) = run(&e, &a, greedy(8));
    assert_eq!(first, reference(&path, &a, 8));
    run(&e, &b, greedy(8));
    let (again, c, _) = run(&e, &a, greedy(8));
    assert_eq!(c.device + c.host, 96, "{c:?}");
    assert!(c.host >= 64, "{c:?}");
    assert_eq!(again, first);
    let s = e.snapshot();
    assert_eq!(s.cache.load_back_skipped_tokens, 0);
    assert_eq!(s.device_pages_held, 0);
    e.shutdown(Duration::from_secs(5));
}

/// An engine over tensor-parallel ranks (each rank's K/V its own pool kind; the host pool's
/// pages split by rank over regions).
fn start_tp(path: &Path, tp: usize, device_pages: u32, host_pages: u32) -> EngineHandle {
    let opts = strata_model::LoadOptions {
        ranks: vec![strata_model::RankPlacement::default(); tp],
        ..strata_model::LoadOptions::new(1)
    };
    let m = strata_model::load(path, opts).unwrap().runtime;
    let layout = PageLayout::new(PS, m.pool_kinds(PS).unwrap()).unwrap();
    let mut cc = CacheConfig::new(layout, device_pages, host_pages);
    cc.model_id = "tiny".into();
    let (a, b) = (HeapAllocator, HeapAllocator);
    let host: [&dyn strata_kv::memory::HostAllocator; 2] = [&a, &b];
    let cache = TieredCache::with_allocators(cc, &HeapAllocator, &host, &[], None).unwrap();
    Engine::start(m, cache, EngineConfig::default())
}

/// Pages leave and enter a TP-2 engine in the whole model's layout: TP 2 → TP 1 and TP 1 →
/// TP 2 continue as one engine does; a prefix the TP-2 engine backed up to its split host
/// pool and loaded back gives the same tokens; a page of another size is refused.
#[test]
fn tp_engines_trade_kv_with_one_rank_engines_in_the_wire_layout() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let single = start(&path, 64, 0, None, EngineConfig::default());
    let tp = start_tp(&path, 2, 16, 64);
    assert_eq!(tp.info().page_bytes, single.info().page_bytes);
    assert_eq!(tp.info().layout, single.info().layout);
    let p = prompt(37, 5);
    let (want, _, _) = run(&single, &p, greedy(10));
    let export = |e: &EngineHandle| export_from(e, &p, 0);
    let import = |e: &EngineHandle, first: u32, pages: Vec<Vec<u8>>| {
        let kv = ImportedKv {
            first_page: 0,
            first_logprobs: None,
            prompt_logprobs: None,
            pages,
            first_token: first,
            cached: CachedTokens::default(),
        };
        let mut s = e.submit_prefilled(p.clone(), greedy(10), kv)?;
        let mut got = Vec::new();
        while let Some(ev) = s.events.blocking_recv() {
            if let Event::Token(t) = ev {
                got.push(t);
            }
        }
        Ok::<_, SubmitError>(got)
    };
    let (first, kv) = export(&tp);
    assert_eq!(
        import(&single, first, kv.pages.clone()).unwrap(),
        want,
        "TP 2 → TP 1"
    );
    let (first, kv) = export(&single);
    assert_eq!(
        import(&tp, first, kv.pages.clone()).unwrap(),
        want,
        "TP 1 → TP 2"
    );
    let mut short = kv.pages.clone();
    short[1].truncate(100);
    let e = import(&tp, first, short).err().unwrap().to_string();
    assert!(e.contains("a page of 100 bytes"), "{e}");
    // Dropped from the device pool (kept on the host pool, split by rank), asked again: it
    // comes back from there with the same answer.
    assert_eq!(tp.flush(FlushScope::Device).map(|f| f.0 > 0), Some(true));
    let (again, cached, _) = run(&tp, &p, greedy(10));
    assert_eq!(again, want);
    assert!(cached.host > 0, "served from the host tier: {cached:?}");
    for e in [single, tp] {
        e.shutdown(Duration::from_secs(5));
    }
}

/// The rest of a request's events: its tokens and how it ended.
fn drain(s: &mut RequestStream) -> (Vec<u32>, FinishReason) {
    let mut got = Vec::new();
    while let Some(ev) = s.events.blocking_recv() {
        match ev {
            Event::Token(t) => got.push(t),
            Event::Done { reason, .. } => return (got, reason),
            _ => {}
        }
    }
    panic!("stream ended without Done");
}

fn held(s: &mut RequestStream) -> (usize, bool) {
    match s.events.blocking_recv() {
        Some(Event::Held { tokens, prefill }) => (tokens, prefill),
        e => panic!("{e:?}"),
    }
}

/// PD with decode-side reuse: a decode engine that holds a prefix (an earlier turn) waits for
/// the K/V of the pages after it only and decodes the tokens one engine gives; under its
/// local threshold it computes the rest itself; pages that do not start where its prefix
/// ends are refused. A TP-2 decode engine with a TP-1 prefill engine too.
#[test]
fn a_held_prefix_and_the_transferred_rest_continue_as_one_engine() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_file(d.path());
    let single = start(&path, 64, 0, None, EngineConfig::default());
    let prefill = start(&path, 64, 0, None, EngineConfig::default());
    let turn = prompt(40, 9);
    let mut p = turn.clone();
    p.extend(prompt(30, 77));
    let (want, _, _) = run(&single, &p, greedy(10));
    let decoders = [
        start(&path, 64, 0, None, EngineConfig::default()),
        start_tp(&path, 2, 64, 0),
    ];
    for decode in decoders {
        // Nothing held yet: the request is handed back (no pages reserved meanwhile).
        let mut rs = decode.submit_remote(p.clone(), greedy(10), 0).unwrap();
        assert_eq!(held(&mut rs), (0, true));
        assert!(rs.events.blocking_recv().is_none(), "the stream closes");
        let t = Instant::now();
        while decode.snapshot().device_pages_held > 0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "its pages were not freed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(decode.snapshot().finished, Default::default());
        // The earlier turn leaves 2 whole pages (41 tokens computed) in the decode cache.
        run(&decode, &turn, greedy(1));
        let mut rs = decode.submit_remote(p.clone(), greedy(10), 0).unwrap();
        let (n, remote) = held(&mut rs);
        assert_eq!((n, remote), (32, true));
        let (first, kv) = export_from(&prefill, &p, n / PS);
        assert_eq!(
            (kv.first, kv.pages.len()),
            (2, 3),
            "70 tokens: pages 2..5 cross"
        );
        let imported = imported(&kv, first);
        decode.deliver(&rs, imported.clone()).unwrap();
        assert_eq!(drain(&mut rs).0, want);
        let snap = decode.snapshot();
        assert_eq!(
            (snap.pd_held_prompt_tokens, snap.transferred_prompt_tokens),
            (32, 38)
        );
        // Pages from another page than where the held prefix ends: the request fails.
        let mut other = turn.clone();
        other.extend(prompt(30, 5));
        let mut rs = decode.submit_remote(other.clone(), greedy(4), 0).unwrap();
        assert_eq!(held(&mut rs), (32, true));
        let (first, kv) = export_from(&prefill, &other, 0);
        let whole = ImportedKv {
            first_page: 0,
            pages: kv.pages.clone(),
            first_token: first,
            ..imported
        };
        decode.deliver(&rs, whole).unwrap();
        let (_, reason) = drain(&mut rs);
        assert!(
            matches!(&reason, FinishReason::Error(e) if e.contains("holds the first 2")),
            "{reason:?}"
        );
        // The whole prompt held but for a few tokens, under the local threshold: computed
        // here, with no transfer.
        let mut rs = decode.submit_remote(p.clone(), greedy(10), 64).unwrap();
        assert_eq!(held(&mut rs), (64, false));
        assert_eq!(drain(&mut rs).0, want);
        assert_eq!(decode.snapshot().pd_local_prefills, 1);
        decode.shutdown(Duration::from_secs(5));
    }
    for e in [single, prefill] {
        e.shutdown(Duration::from_secs(5));
    }
}
