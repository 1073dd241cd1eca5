//! Two workers on one Redis (a real redis-server): a prefix computed by one is a remote-tier
//! hit for the other, with identical greedy output; Redis killed mid-run turns into misses,
//! counted, and the workers keep serving. The same hit through a Redis Cluster.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_kv::storage::Storage;
use strata_model::tiny::TINY_TEMPLATE;
use strata_model::{ChatTemplate, Gguf, ModelTokenizer};
use strata_redis::{RedisConfig, RedisStorage};
use strata_test_support::{spawn_worker, tiny_model, Redis, RedisCluster, TestWorker, WorkerSpec};

async fn worker(path: &std::path::Path, port: u16) -> TestWorker {
    worker_on(path, &format!("redis://127.0.0.1:{port}")).await
}

async fn worker_on(path: &std::path::Path, url: &str) -> TestWorker {
    let remote: Arc<dyn Storage> = Arc::new(
        RedisStorage::connect(&RedisConfig {
            url: url.into(),
            namespace: "tiny-test".into(),
            ttl: None,
            // Room for a loaded machine (a connect at 300 ms timed out in CI on 2 cores).
            timeout: Duration::from_secs(2),
            page_key: strata_kv::storage::blob::BlobKey::public(),
            max_value_bytes: 1 << 24,
        })
        .unwrap(),
    );
    let spec = WorkerSpec {
        storage: Some(remote),
        storage_tier: "remote",
        ..WorkerSpec::default()
    };
    spawn_worker(path, spec).await
}

async fn chat(url: &str, q: &str) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(
            &json!({"messages": [{"role": "user", "content": q}], "max_tokens": 8,
                      "temperature": 0, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_computed_by_one_worker_is_a_remote_hit_for_the_other() {
    let mut rd = Redis::start();
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model(d.path());
    let (wa, wb) = (worker(&path, rd.port).await, worker(&path, rd.port).await);
    let (a, sa) = (wa.url.clone(), wa.state.clone());
    let (b, sb) = (wb.url.clone(), wb.state.clone());
    let q = "a long question that both workers will see, about the shared remote cache ".repeat(2);
    let first = chat(&a, &q).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The backup to host and the put to Redis run in the background after the request.
    let t = Instant::now();
    while sa.engine.snapshot().storage.unwrap().puts == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "nothing reached Redis"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = chat(&b, &q).await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (prompt - 1) / 16 * 16, "{second}");
    assert_eq!(sb.engine.snapshot().cached_storage_tokens, cached);
    // Worker b computed only the tail: b's output equals a's output... when the same number of
    // tokens is computed the same way; compare with a repeat on a that is also served from
    // cache, then check b against it.
    let again = chat(&a, &q).await;
    assert_eq!(
        second["choices"][0]["message"]["content"],
        again["choices"][0]["message"]["content"]
    );
    // The router's index sees the prefix in a's own tiers and, for b, in the shared remote
    // tier (at its lower weight).
    {
        use strata_router::cache_index::{CacheIndex, IndexLimits, DEFAULT_INDEX_MEMORY};
        let g = Gguf::open(&path).unwrap();
        let idx = CacheIndex::new(
            Arc::new(ModelTokenizer::from_gguf(&g).unwrap()),
            Some(ChatTemplate::new(TINY_TEMPLATE).unwrap()),
            3,
            IndexLimits::within(DEFAULT_INDEX_MEMORY, 3).unwrap(),
        );
        let client = reqwest::Client::new();
        idx.poll(&client, None, 0, &a).await.unwrap();
        let body =
            serde_json::to_vec(&json!({"messages": [{"role": "user", "content": q}]})).unwrap();
        let hashes = idx.hashes(&idx.prompt_tokens(&body).unwrap());
        let (dev, _, _) = idx.cached_prefix(0, &hashes);
        assert!(dev > 0);
        // Worker index 2 never reported anything: only the remote hints apply to it.
        let (d2, h2, r2) = idx.cached_prefix(2, &hashes);
        assert_eq!((d2, h2), (0, 0));
        assert!(r2 > 0, "remote pages are counted for every worker");
    }
    // Redis dies: requests continue (as misses), errors are counted.
    rd.kill();
    let other = chat(
        &b,
        "a different prompt while redis is down, long enough for a page or two",
    )
    .await;
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let t = Instant::now();
    while sb.engine.snapshot().storage.unwrap().errors == 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "no error counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = reqwest::get(format!("{b}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("strata_l3_errors_total{kind=\"unavailable\",tier=\"remote\"}"),
        "{m}"
    );
    assert!(
        m.contains("strata_cache_hit_tokens_total{tier=\"remote\"}"),
        "{m}"
    );
}

/// Through a Redis Cluster (3 masters, 3 replicas): worker b finds worker a's pages, spread
/// over the masters, and answers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_is_a_remote_hit_through_a_redis_cluster() {
    let c = tokio::task::spawn_blocking(|| RedisCluster::start(3, 1))
        .await
        .unwrap();
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model(d.path());
    let seeds = format!(
        "redis-cluster://127.0.0.1:{},127.0.0.1:{}",
        c.nodes[0].port, c.nodes[1].port
    );
    let (wa, wb) = (
        worker_on(&path, &seeds).await,
        worker_on(&path, &c.url(2)).await,
    );
    let q = "a long question both workers see, about a cache spread over a cluster ".repeat(3);
    let first = chat(&wa.url, &q).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let pages = (prompt - 1) / 16;
    let t = Instant::now();
    while wa.state.engine.snapshot().storage.unwrap().puts < pages {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the pages did not reach the cluster"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let holders = tokio::task::spawn_blocking(move || {
        let n = c
            .masters()
            .into_iter()
            .filter(|&m| c.cli(m, &["DBSIZE"]) != "0")
            .count();
        (n, c)
    })
    .await
    .unwrap();
    assert!(holders.0 >= 2, "{pages} pages all on one master");
    let second = chat(&wb.url, &q).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(pages * 16),
        "{second}"
    );
    let again = chat(&wa.url, &q).await;
    assert_eq!(
        second["choices"][0]["message"]["content"],
        again["choices"][0]["message"]["content"]
    );
    assert_eq!(wb.state.engine.snapshot().storage.unwrap().errors, 0);
}
