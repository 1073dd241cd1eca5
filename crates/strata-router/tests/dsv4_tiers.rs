//! DeepSeek-V4 (the tiny model) through every tier: a prompt whose first `h` tokens were cached
//! resumes with the same greedy tokens and the same log probabilities (the same logits, to the
//! bit) whether those tokens' state came from the device, host, disk or Redis tier, from a
//! prefill worker by PD transfer, or was recomputed, for hits ending before, on and after the
//! window (32) and the 128-block boundaries. With pages of 4 tokens every hit ends on a 4-block
//! boundary, and the hits after a boundary need the compressors' rows of the blocks before it;
//! pages of 256 tokens hold two 128-blocks each, and a prompt matched to its last page is
//! resumed from a copy of that page (copy-on-write) with only its last token computed.

mod common;
use common::start_router;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use strata_engine::{EngineConfig, FlushScope};
use strata_kv::storage::{DiskStorage, Storage};
use strata_redis::{RedisConfig, RedisStorage};
use strata_test_support::{post, spawn_worker, tiny_dsv4_model, Redis, TestWorker, WorkerSpec};

/// A page size, the hits to try as (cached tokens, tokens after them) and the base prompt's
/// length. A prompt of whole cached pages and nothing after them computes only its last token
/// (cached tokens − 1 are reported).
#[derive(Clone, Copy)]
struct Case {
    ps: usize,
    hits: &'static [(usize, usize)],
    base: usize,
    /// Tensor-parallel ranks of every worker.
    tp: usize,
}

const SMALL: Case = Case {
    ps: 4,
    hits: &[
        (28, 12),
        (32, 12),
        (36, 12),
        (124, 12),
        (128, 12),
        (132, 12),
        (252, 12),
        (256, 12),
        (260, 12),
        (260, 0),
    ],
    base: 300,
    tp: 1,
};
const LARGE: Case = Case {
    ps: 256,
    hits: &[(256, 12), (512, 12), (512, 0)],
    base: 700,
    tp: 1,
};

fn base_of(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 280).collect()
}

/// The base prompt's first `h` tokens, then `extra` of its own, salted (the first differs from
/// the base's, so the hit is exactly `h`; each pass over the tiers uses another salt, so its
/// prompts are not cached whole by an earlier pass).
fn with_hit((h, extra): (usize, usize), salt: u32) -> Vec<u32> {
    let b = base_of(h + 1);
    let mut p = b[..h].to_vec();
    p.extend((0..extra as u32).map(|i| (b[h] + 1 + salt + i * 53) % 280));
    assert!(extra == 0 || p[h] != b[h]);
    p
}

/// Prompt tokens a hit reports cached.
fn reported((h, extra): (usize, usize)) -> u64 {
    (if extra == 0 { h - 1 } else { h }) as u64
}

fn spec(c: Case, storage: Option<Arc<dyn Storage>>, tier: &'static str) -> WorkerSpec {
    let pages = (4096 / c.ps) as u32;
    WorkerSpec {
        page_size: c.ps,
        device_pages: pages,
        host_pages: pages,
        storage,
        storage_tier: tier,
        tp: c.tp,
        ..WorkerSpec::default()
    }
}

/// A worker without a prefix cache: every answer recomputed.
async fn cold_worker(path: &std::path::Path, c: Case) -> TestWorker {
    let engine = EngineConfig {
        prefix_cache: false,
        ..EngineConfig::default()
    };
    spawn_worker(
        path,
        WorkerSpec {
            engine,
            ..spec(c, None, "disk")
        },
    )
    .await
}

/// Greedy tokens with their log probabilities; and the prompt tokens reported cached.
async fn complete(url: &str, prompt: &[u32]) -> (Value, u64) {
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true, "logprobs": 5});
    let (st, a) = post(&format!("{url}/v1/completions"), &body).await;
    assert_eq!(st, 200, "{a}");
    let cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (a["choices"][0]["logprobs"].clone(), cached)
}

/// Which tier served the last request's prefix: (device, host, storage) tokens it added.
fn tiers(w: &TestWorker, before: (u64, u64, u64)) -> (u64, u64, u64) {
    let s = w.state.engine.snapshot();
    (
        s.cached_device_tokens - before.0,
        s.cached_host_tokens - before.1,
        s.cached_storage_tokens - before.2,
    )
}

fn counts(w: &TestWorker) -> (u64, u64, u64) {
    let s = w.state.engine.snapshot();
    (
        s.cached_device_tokens,
        s.cached_host_tokens,
        s.cached_storage_tokens,
    )
}

/// The answers recomputed from scratch by `cold` (no prefix cache) for pass `salt`.
async fn recomputed(c: Case, cold: &TestWorker, salt: u32) -> Vec<Value> {
    let mut want = Vec::new();
    for &h in c.hits {
        let (lp, cached) = complete(&cold.url, &with_hit(h, salt)).await;
        assert_eq!(cached, 0);
        want.push(lp);
    }
    want
}

/// Runs every hit on `w` after caching the base prompt, with `flush` applied before each, and
/// checks the tier that served it (index 0 device, 1 host, 2 storage) and the answers
/// against `cold`'s.
async fn through(
    c: Case,
    w: &TestWorker,
    cold: &TestWorker,
    salt: u32,
    flush: Option<FlushScope>,
    tier: usize,
) {
    let want = recomputed(c, cold, salt).await;
    complete(&w.url, &base_of(c.base)).await;
    for (&h, want) in c.hits.iter().zip(&want) {
        if let Some(f) = flush {
            w.state.engine.flush(f).unwrap();
        }
        let before = counts(w);
        let (got, cached) = complete(&w.url, &with_hit(h, salt)).await;
        assert_eq!(cached, reported(h), "hit of {h:?} on tier {tier}");
        let t = tiers(w, before);
        let by_tier = [t.0, t.1, t.2];
        assert_eq!(by_tier[tier], reported(h), "hit of {h:?}: served by {t:?}");
        assert_eq!(&got, want, "hit of {h:?} from tier {tier}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tier_and_pd_resume_a_prefix_with_the_recomputed_logits() {
    every_tier(SMALL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_of_two_128_blocks_resume_through_every_tier() {
    every_tier(LARGE).await;
}

/// The same at TP 2 and TP 4 (every worker's ranks each holding a copy of every kind): the
/// answers are the recomputed ones at that TP size, to the bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_tp_2_and_4_every_tier_and_pd_resume_a_prefix_with_the_recomputed_logits() {
    for tp in [2, 4] {
        every_tier(Case { tp, ..SMALL }).await;
    }
}

async fn every_tier(c: Case) {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_dsv4_model(d.path());

    let cold = cold_worker(&path, c).await;

    // Device, host and disk on one worker.
    let disk: Arc<dyn Storage> =
        Arc::new(DiskStorage::open(d.path().join("l3"), 1 << 30, false).unwrap());
    let w = spawn_worker(&path, spec(c, Some(disk), "disk")).await;
    through(c, &w, &cold, 0, None, 0).await;
    through(c, &w, &cold, 1, Some(FlushScope::Device), 1).await;
    through(c, &w, &cold, 2, Some(FlushScope::All), 2).await;

    // Redis.
    let rd = Redis::start();
    let remote: Arc<dyn Storage> = Arc::new(redis_storage(rd.port, "dsv4-test"));
    let r = spawn_worker(&path, spec(c, Some(remote), "remote")).await;
    through(c, &r, &cold, 3, Some(FlushScope::All), 2).await;

    // PD: the decode worker receives every prompt's state from the prefill worker, which
    // itself resumes from its cache, but for the prefix the decode worker holds (its window
    // state included).
    let prefill = spawn_worker(&path, spec(c, None, "disk")).await;
    let decode = spawn_worker(
        &path,
        WorkerSpec {
            kv_listener: true,
            prefill_workers: vec![prefill.url.clone()],
            pd_local_prefill_tokens: 0,
            ..spec(c, None, "disk")
        },
    )
    .await;
    let pd = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    complete(&pd, &base_of(c.base)).await;
    let want = recomputed(c, &cold, 4).await;
    let mut held_any = 0;
    for (&h, want) in c.hits.iter().zip(&want) {
        let snap = || decode.state.engine.snapshot();
        let before = (
            snap().transferred_prompt_tokens,
            snap().pd_held_prompt_tokens,
        );
        let (got, _) = complete(&pd, &with_hit(h, 4)).await;
        let moved = snap().transferred_prompt_tokens - before.0;
        let held = snap().pd_held_prompt_tokens - before.1;
        let prompt = (h.0 + h.1) as u64;
        eprintln!("hit {h:?}: held {held}, moved {moved}");
        assert_eq!(
            moved + held,
            prompt,
            "the prompt of hit {h:?} went through PD"
        );
        assert!(moved > 0);
        held_any += held;
        assert_eq!(&got, want, "hit of {h:?} through PD");
    }
    assert!(held_any > 0, "the decode worker held some prefix");
    for x in [cold, w, r, prefill, decode] {
        x.stop().await;
    }
}

/// Window residency (pages of 4 tokens, a window of 128 before a continuation): with few
/// window pages, an older prefix's window pages are dropped while its main pages stay on
/// device. A hit whose window state is gone backs off to the deepest boundary it can continue
/// from; with the host tier holding the window pages, they come back and the hit is whole.
/// Either way the answer is the recomputed one, to the bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_window_pages_back_off_the_hit_or_come_back_from_host() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_dsv4_model(d.path());
    let c = SMALL;
    let cold = cold_worker(&path, c).await;
    let base = base_of(c.base);
    // Shares the base's first 128 tokens: the base splits there, and this prompt's window
    // pages take those of the base's older tail (120 window pages hold one prompt and a
    // little more; main pages hold 1024).
    let mut other = base[..128].to_vec();
    other.extend((0..172u32).map(|i| (i * 17 + 5) % 280 + (i % 2)));
    let hit = (260, 12);
    for (host_windows, cached_want) in [(0, 128), (1024, 260)] {
        let w = spawn_worker(
            &path,
            WorkerSpec {
                window_pages: Some((120, host_windows)),
                ..spec(c, None, "disk")
            },
        )
        .await;
        complete(&w.url, &base).await;
        complete(&w.url, &other).await;
        let dropped = w.state.engine.snapshot().cache.evicted_device_window_pages;
        assert!(dropped > 0, "the base's tail lost its window pages");
        let prompt = with_hit(hit, 5 + host_windows);
        let (want, _) = complete(&cold.url, &prompt).await;
        let before = w.state.engine.snapshot();
        let (got, cached) = complete(&w.url, &prompt).await;
        let after = w.state.engine.snapshot();
        assert_eq!(cached, cached_want, "host window pages: {host_windows}");
        assert_eq!(
            after.cached_device_tokens - before.cached_device_tokens,
            cached_want,
            "main pages served from device"
        );
        let cut = after.cache.window_cut_tokens - before.cache.window_cut_tokens;
        assert_eq!(cut, (hit.0 as u64 - cached_want), "tokens given up");
        assert_eq!(
            got, want,
            "the recomputed answer (host window pages: {host_windows})"
        );
        w.stop().await;
    }
    cold.stop().await;
}

/// Checkpoints every 64 pages of 4 tokens (256 tokens): the base (700 tokens) keeps window
/// pages only for the spans before 256, 512 and its end. A hit at the end or at a checkpoint
/// resumes whole; one between checkpoints (560) backs off to 512 and recomputes the rest; every
/// answer equals the recomputed one, from device, host, disk, Redis and through PD (whose
/// transfer carries the window part of the kept pages only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_resume_at_the_end_at_a_checkpoint_or_back_off_to_one() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_dsv4_model(d.path());
    let c = CHECKPOINTS;
    let cold = cold_worker(&path, c).await;
    // A fresh worker for each tier: a hit's own commit keeps the window pages before its end,
    // which a later hit at the same place would then find.
    let disk = || -> Arc<dyn Storage> {
        let dir = tempfile::tempdir().unwrap().keep();
        Arc::new(DiskStorage::open(dir, 1 << 30, false).unwrap())
    };
    let rd = Redis::start();
    let redis = || -> Arc<dyn Storage> { Arc::new(redis_storage(rd.port, "dsv4-checkpoints")) };
    // (salt, flush before each hit, L3, the tier that serves the hits)
    type Pass = (u32, Option<FlushScope>, Option<Arc<dyn Storage>>, usize);
    let passes: [Pass; 4] = [
        (21, None, None, 0),
        (22, Some(FlushScope::Device), None, 1),
        (23, Some(FlushScope::All), Some(disk()), 2),
        (24, Some(FlushScope::All), Some(redis()), 2),
    ];
    for (salt, flush, storage, tier) in passes {
        let w = spawn_worker(
            &path,
            WorkerSpec {
                window_checkpoint_pages: 64,
                ..spec(c, storage, "disk")
            },
        )
        .await;
        let want = recomputed(c, &cold, salt).await;
        complete(&w.url, &base_of(c.base)).await;
        // 700 prompt tokens and 5 computed answer tokens: 176 whole pages, of which the
        // spans before 256 and 512 (32 pages each) and before the end (33) keep theirs.
        let kept = w.state.engine.snapshot().device_window.pages_used;
        assert_eq!(kept, 97, "window pages kept of a 176-page sequence");
        for ((&h, want), &r) in c.hits.iter().zip(&want).zip(&RESUMED) {
            if let Some(f) = flush {
                w.state.engine.flush(f).unwrap();
            }
            let before = w.state.engine.snapshot();
            let counted = counts(&w);
            let (got, cached) = complete(&w.url, &with_hit(h, salt)).await;
            let after = w.state.engine.snapshot();
            assert_eq!(cached, r, "hit of {h:?} (tier {tier})");
            let t = tiers(&w, counted);
            assert_eq!([t.0, t.1, t.2][tier], r, "hit of {h:?}: served by {t:?}");
            let cut = after.cache.window_cut_tokens - before.cache.window_cut_tokens;
            assert_eq!(cut, h.0 as u64 - r, "hit of {h:?}: recomputed tokens");
            assert_eq!(&got, want, "hit of {h:?} (tier {tier})");
        }
        w.stop().await;
    }

    // PD: the prefill worker resumes from its checkpoints; the decode worker, with a ring of
    // its own, receives each prompt's pages, the window part only where the prefill keeps it.
    let ck = |w: WorkerSpec| WorkerSpec {
        window_checkpoint_pages: 64,
        ..w
    };
    let prefill = spawn_worker(&path, ck(spec(c, None, "disk"))).await;
    let decode = spawn_worker(
        &path,
        ck(WorkerSpec {
            kv_listener: true,
            prefill_workers: vec![prefill.url.clone()],
            pd_local_prefill_tokens: 0,
            ..spec(c, None, "disk")
        }),
    )
    .await;
    let pd = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    complete(&pd, &base_of(c.base)).await;
    let want = recomputed(c, &cold, 25).await;
    for ((&h, want), &r) in c.hits.iter().zip(&want).zip(&RESUMED) {
        let before = prefill.state.engine.snapshot().cached_device_tokens;
        let (got, _) = complete(&pd, &with_hit(h, 25)).await;
        let served = prefill.state.engine.snapshot().cached_device_tokens - before;
        assert_eq!(served, r, "the prefill worker resumed hit {h:?}");
        assert_eq!(&got, want, "hit of {h:?} through PD");
    }
    for x in [cold, prefill, decode] {
        x.stop().await;
    }
}

/// A request far longer than the device's window pages allow (48 window pages of 4 tokens:
/// 192 tokens; the prompt is 700) completes with checkpoints: it holds window pages for the
/// span it reads only. Its answer and the answers of the hits after it are the recomputed
/// ones, to the bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_the_window_pages_completes_in_a_ring() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_dsv4_model(d.path());
    let c = CHECKPOINTS;
    let cold = cold_worker(&path, c).await;
    let w = spawn_worker(
        &path,
        WorkerSpec {
            window_checkpoint_pages: 64,
            window_pages: Some((48, 1024)),
            ..spec(c, None, "disk")
        },
    )
    .await;
    let base = base_of(c.base);
    let (want, _) = complete(&cold.url, &base).await;
    let (got, cached) = complete(&w.url, &base).await;
    assert_eq!(cached, 0);
    assert_eq!(got, want, "the long request's answer");
    let want = recomputed(c, &cold, 26).await;
    for (&h, want) in c.hits.iter().zip(&want) {
        let (got, cached) = complete(&w.url, &with_hit(h, 26)).await;
        assert!(cached <= h.0 as u64, "hit of {h:?}");
        assert_eq!(&got, want, "hit of {h:?} with 48 window pages");
    }
    w.stop().await;
    cold.stop().await;
}

/// Under PD with a prefill worker computing in chunks of 64 tokens and holding window pages
/// for its span only, the pages no later chunk reads leave while the prompt is still being
/// computed; the decode worker's answers to the long base and the hits after it are the
/// recomputed ones, to the bit. The decode worker's 48 window pages hold fewer than the
/// prefill worker kept (its checkpoints and the prompt's end) plus a ring: it takes those
/// decoding reads and keeps the others' main parts only (it waited forever before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_crosses_in_parts_as_its_chunks_are_computed() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_dsv4_model(d.path());
    let c = CHECKPOINTS;
    let cold = cold_worker(&path, c).await;
    let ring = |engine| WorkerSpec {
        window_checkpoint_pages: 64,
        window_pages: Some((48, 1024)),
        engine,
        ..spec(c, None, "disk")
    };
    let chunks = EngineConfig {
        max_batch_tokens: 64,
        ..EngineConfig::default()
    };
    let prefill = spawn_worker(&path, ring(chunks)).await;
    let decode = spawn_worker(
        &path,
        WorkerSpec {
            kv_listener: true,
            prefill_workers: vec![prefill.url.clone()],
            pd_local_prefill_tokens: 0,
            ..ring(EngineConfig::default())
        },
    )
    .await;
    let pd = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    let base = base_of(c.base);
    let (want, _) = complete(&cold.url, &base).await;
    let (got, _) = complete(&pd, &base).await;
    assert_eq!(got, want, "the long prompt's answer through PD");
    let early = prefill.state.engine.snapshot().pd_overlapped_pages;
    eprintln!("{early} of the base's 175 pages crossed before its end");
    assert!(
        early >= 100,
        "{early} of the base's 175 pages left before its end"
    );
    let want = recomputed(c, &cold, 27).await;
    for (&h, want) in c.hits.iter().zip(&want) {
        let (got, _) = complete(&pd, &with_hit(h, 27)).await;
        assert_eq!(&got, want, "hit of {h:?} through PD, in parts");
    }
    for x in [cold, prefill, decode] {
        x.stop().await;
    }
}

/// Hits at the end, at a checkpoint and between checkpoints of a 700-token base.
const CHECKPOINTS: Case = Case {
    ps: 4,
    hits: &[(700, 8), (512, 8), (560, 8)],
    base: 700,
    tp: 1,
};
/// What each of those resumes from.
const RESUMED: [u64; 3] = [700, 512, 512];

fn redis_storage(port: u16, namespace: &str) -> RedisStorage {
    RedisStorage::connect(&RedisConfig {
        url: format!("redis://127.0.0.1:{port}"),
        namespace: namespace.into(),
        ttl: None,
        timeout: Duration::from_secs(2),
        page_key: strata_kv::storage::blob::BlobKey::public(),
        max_value_bytes: 1 << 24,
    })
    .unwrap()
}
