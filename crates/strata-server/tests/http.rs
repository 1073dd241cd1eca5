//! The HTTP API over real sockets on a random loopback port, with the tiny test model.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_engine::EngineConfig;
use strata_kv::storage::{DiskStorage, Storage};
use strata_server::AppState;
use strata_test_support::{spawn_worker, tiny_model, TestWorker, WorkerSpec};

struct Server {
    worker: TestWorker,
    url: String,
    state: Arc<AppState>,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn stop(self) {
        self.worker.stop().await;
    }
}

struct Opts {
    device_pages: u32,
    host_pages: u32,
    disk: bool,
    cfg: EngineConfig,
    admin_key: Option<String>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            device_pages: 128,
            host_pages: 128,
            disk: false,
            cfg: EngineConfig::default(),
            admin_key: None,
        }
    }
}

async fn start(o: Opts) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_model(dir.path());
    let storage: Option<Arc<dyn Storage>> = o
        .disk
        .then(|| Arc::new(DiskStorage::open(dir.path().join("l3"), 1 << 30, false).unwrap()) as _);
    let spec = WorkerSpec {
        device_pages: o.device_pages,
        host_pages: o.host_pages,
        engine: o.cfg,
        storage,
        admin_key: o.admin_key,
        body_limit: Some(64 * 1024),
        grace: Duration::from_secs(10),
        ..WorkerSpec::default()
    };
    let worker = spawn_worker(&path, spec).await;
    Server {
        url: worker.url.clone(),
        state: worker.state.clone(),
        worker,
        _dir: dir,
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(url: &str, body: Value) -> (u16, Value) {
    let r = client().post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn greedy_chat(content: &str, max: usize) -> Value {
    json!({"model": "tiny", "messages": [{"role": "system", "content": "You are a test."},
           {"role": "user", "content": content}], "max_tokens": max, "temperature": 0,
           "ignore_eos": true})
}

/// `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_with_and_without_streaming() {
    let s = start(Opts::default()).await;
    let long = "the quick brown fox jumps over the lazy dog ".repeat(4);
    let (st, a) = post(
        &format!("{}/v1/chat/completions", s.url),
        greedy_chat(&long, 8),
    )
    .await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 8);
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
    // Repeated: the whole pages of the prompt minus its last token come from the cache.
    let (_, b) = post(
        &format!("{}/v1/chat/completions", s.url),
        greedy_chat(&long, 8),
    )
    .await;
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        (prompt - 1) / 16 * 16
    );
    assert_eq!(
        b["choices"][0]["message"]["content"],
        a["choices"][0]["message"]["content"]
    );

    // Streaming chat: role first, then content deltas, finish, usage, [DONE].
    let mut body = greedy_chat(&long, 8);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = client()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        a["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(usage["completion_tokens"], 8);
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );

    // Completions, text and token-id prompts, streaming and not.
    let c = json!({"prompt": long, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (st, x) = post(&format!("{}/v1/completions", s.url), c.clone()).await;
    assert_eq!(st, 200, "{x}");
    assert_eq!(x["object"], "text_completion");
    let mut cs = c.clone();
    cs["stream"] = json!(true);
    let r = client()
        .post(format!("{}/v1/completions", s.url))
        .json(&cs)
        .send()
        .await
        .unwrap();
    let data = sse_data(&r.text().await.unwrap());
    let text: String = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, x["choices"][0]["text"].as_str().unwrap());
    let (st, y) = post(
        &format!("{}/v1/completions", s.url),
        json!({"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200, "{y}");
    assert_eq!(y["usage"]["prompt_tokens"], 4);

    // A stop string cuts the text before it, with finish_reason "stop".
    let full = x["choices"][0]["text"].as_str().unwrap().to_string();
    let cut: String = full.chars().skip(3).take(2).collect();
    if !cut.is_empty() {
        let mut cs = c.clone();
        cs["stop"] = json!([cut.clone()]);
        let (_, z) = post(&format!("{}/v1/completions", s.url), cs).await;
        let want = &full[..full.find(&cut).unwrap()];
        assert_eq!(z["choices"][0]["text"], want);
        assert_eq!(z["choices"][0]["finish_reason"], "stop");
    }
    // Sampling with a seed is repeatable.
    let sampled = json!({"prompt": long, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9,
                         "top_k": 50, "seed": 42, "ignore_eos": true});
    let (_, s1) = post(&format!("{}/v1/completions", s.url), sampled.clone()).await;
    let (_, s2) = post(&format!("{}/v1/completions", s.url), sampled).await;
    assert_eq!(s1["choices"][0]["text"], s2["choices"][0]["text"]);

    // Models, health, a real token.
    let m: Value = client()
        .get(format!("{}/v1/models", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], "tiny");
    let h = client()
        .get(format!("{}/health", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
    let h = client()
        .get(format!("{}/health_generate", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_greedy_output_from_device_host_and_disk() {
    let s = start(Opts {
        disk: true,
        admin_key: Some("sekret".into()),
        ..Opts::default()
    })
    .await;
    let p = "a prefix long enough to fill a few pages of sixteen tokens each, and more ".repeat(2);
    let url = format!("{}/v1/chat/completions", s.url);
    let flush = |tier: &'static str, key: Option<&'static str>| {
        let mut r = client().post(format!("{}/flush_cache?tier={tier}", s.url));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    post(&url, greedy_chat(&p, 10)).await;
    let (_, dev) = post(&url, greedy_chat(&p, 10)).await;
    let cached = dev["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    assert!(cached.as_u64().unwrap() >= 64);
    let text = dev["choices"][0]["message"]["content"].clone();

    let denied = flush("device", None).await.unwrap();
    assert_eq!(denied.status(), 401);
    let e: Value = denied.json().await.unwrap();
    assert_eq!(e["error"]["type"], "authentication_error");
    // A misspelt or repeated parameter, or the tier sent in a body: a 400 in the API's error
    // shape, and nothing flushed (a flush of everything was what these once did).
    let before = s.state.engine.snapshot().cached_device_tokens;
    assert!(before > 0);
    for (q, body) in [
        ("tierr=device", ""),
        ("tier=device&tier=all", ""),
        ("", r#"{"tier": "device"}"#),
    ] {
        let r = client()
            .post(format!("{}/flush_cache?{q}", s.url))
            .bearer_auth("sekret")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "?{q} {body}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error", "?{q} {body}");
    }
    // (The snapshot may still be catching up with the last answer: never fewer tokens.)
    assert!(s.state.engine.snapshot().cached_device_tokens >= before);
    assert_eq!(flush("device", Some("sekret")).await.unwrap().status(), 200);
    let (_, host) = post(&url, greedy_chat(&p, 10)).await;
    assert_eq!(
        host["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );
    assert_eq!(host["choices"][0]["message"]["content"], text);

    assert_eq!(flush("all", Some("sekret")).await.unwrap().status(), 200);
    let (_, disk) = post(&url, greedy_chat(&p, 10)).await;
    assert_eq!(
        disk["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );
    assert_eq!(disk["choices"][0]["message"]["content"], text);
    let snap = s.state.engine.snapshot();
    assert_eq!(snap.cached_host_tokens, cached.as_u64().unwrap());
    assert_eq!(snap.cached_storage_tokens, cached.as_u64().unwrap());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_pages() {
    let s = start(Opts::default()).await;
    let before = s.state.engine.snapshot().device.pages_used;
    let mut body = greedy_chat("count to a thousand", 400);
    body["stream"] = json!(true);
    let mut r = client()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    // The first chunk arrives: the request is running.
    r.chunk().await.unwrap().unwrap();
    let t = Instant::now();
    while s.state.engine.snapshot().device_pages_held == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the request holds no pages"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(r);
    let t = Instant::now();
    loop {
        let snap = s.state.engine.snapshot();
        if snap.running == 0 {
            assert_eq!(snap.device_pages_held, 0);
            // All but the prompt's whole pages (16 tokens), which stay cached for a retry.
            let kept = snap.prompt_tokens / 16;
            assert!(kept > 0);
            assert_eq!(snap.device.pages_used, before + kept);
            assert_eq!(snap.finished.cancelled, 1);
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the cancel was not seen"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_beyond_the_queue_gets_429_and_accepted_requests_complete() {
    let s = start(Opts {
        cfg: EngineConfig {
            max_running: 1,
            max_waiting: 2,
            ..EngineConfig::default()
        },
        ..Opts::default()
    })
    .await;
    let url = format!("{}/v1/chat/completions", s.url);
    let mut tasks = Vec::new();
    for i in 0..32 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let r = client()
                .post(&url)
                .json(&greedy_chat(&format!("request {i}"), 64))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry = r.headers().get("retry-after").is_some();
            let v: Value = r.json().await.unwrap();
            (status, retry, v)
        }));
    }
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        let (status, retry, v) = t.await.unwrap();
        match status {
            200 => {
                assert_eq!(v["usage"]["completion_tokens"], 64);
                ok += 1;
            }
            429 => {
                assert!(retry, "429 without Retry-After");
                assert_eq!(v["error"]["code"], "rate_limit_exceeded");
                refused += 1;
            }
            other => panic!("status {other}: {v}"),
        }
    }
    assert!(ok >= 3 && refused > 0, "ok {ok}, refused {refused}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_json_errors_and_the_server_stays_healthy() {
    let s = start(Opts::default()).await;
    let chat = format!("{}/v1/chat/completions", s.url);
    let raw = |body: &'static str| {
        client()
            .post(&chat)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let cases: Vec<(reqwest::Response, u16, Option<&str>)> = vec![
        (raw("{not json").await.unwrap(), 400, None),
        (
            raw(r#"{"messages": "hi"}"#).await.unwrap(),
            400,
            Some("messages"),
        ),
        (
            raw(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}"#)
                .await
                .unwrap(),
            400,
            None,
        ),
        (
            raw(r#"{"messages": []}"#).await.unwrap(),
            400,
            Some("messages"),
        ),
        (
            raw(r#"{"messages": [{"role": "user", "content": "hi"}], "n": 17}"#)
                .await
                .unwrap(),
            400,
            Some("n"),
        ),
        (
            raw(r#"{"messages": [{"role": "user", "content": "hi"}], "temperature": 7}"#)
                .await
                .unwrap(),
            400,
            Some("temperature"),
        ),
        (
            raw(r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#)
                .await
                .unwrap(),
            400,
            Some("messages[0].role"),
        ),
        (
            // The error names the field the request used.
            raw(r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}"#)
                .await
                .unwrap(),
            400,
            Some("max_completion_tokens"),
        ),
        (
            raw(r#"{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}"#)
                .await
                .unwrap(),
            404,
            Some("model"),
        ),
        (
            raw(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}"#)
                .await
                .unwrap(),
            400,
            Some("max_tokens"),
        ),
        (
            raw(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}"#)
                .await
                .unwrap(),
            400,
            Some("messages"),
        ),
        (
            client()
                .post(&chat)
                .header("content-type", "application/json")
                .body(format!(
                    r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#,
                    "x".repeat(100_000)
                ))
                .send()
                .await
                .unwrap(),
            413,
            None,
        ),
        (
            client()
                .post(format!("{}/v1/completions", s.url))
                .json(&json!({"prompt": [1, 2, 100000], "max_tokens": 2}))
                .send()
                .await
                .unwrap(),
            400,
            Some("prompt"),
        ),
    ];
    for (i, (r, want, param)) in cases.into_iter().enumerate() {
        assert_eq!(r.status().as_u16(), want, "case {i}");
        let v: Value = r.json().await.unwrap();
        let e = &v["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "case {i}: {v}"
        );
        assert!(e["type"].is_string(), "case {i}: {v}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "case {i}: {v}");
        }
        let h = client()
            .get(format!("{}/health", s.url))
            .send()
            .await
            .unwrap();
        assert_eq!(h.status(), 200);
    }
    // An unknown field is refused, naming it (never accepted and ignored: docs/API.md); the
    // server still generates.
    let mut bad = greedy_chat("hello", 3);
    bad["frobnicate"] = json!({"x": 1});
    let (st, v) = post(&chat, bad).await;
    assert_eq!(
        (st, &v["error"]["param"]),
        (400, &json!("frobnicate")),
        "{v}"
    );
    let (st, v) = post(&chat, greedy_chat("hello", 3)).await;
    assert_eq!(st, 200, "{v}");
    s.stop().await;
}

/// Fuzzing the request bodies (a bounded number of cases): chat and completion bodies built from
/// the real field names with arbitrary values, sent to a real server. Every answer is JSON with
/// a status a client can act on (200, 400, 404, 413, 429, 503), and the server stays healthy.
#[test]
fn fuzzed_request_bodies_get_json_answers_and_the_server_stays_healthy() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(start(Opts::default()));
    let value = prop_oneof![
        Just(json!(null)),
        any::<bool>().prop_map(|b| json!(b)),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|u| json!(u)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(|t| json!(t)),
        proptest::collection::vec(any::<u32>(), 0..40).prop_map(|v| json!(v)),
        proptest::collection::vec(".{0,8}", 0..20).prop_map(|v| json!(v)),
        Just(json!([{"role": "user", "content": "hi"}])),
        Just(json!([{"role": "tool", "content": [{"type": "image_url"}]}])),
        Just(json!({"include_usage": true})),
    ];
    let fields = [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "seed",
        "stream",
        "stream_options",
        "n",
        "ignore_eos",
    ];
    let body = proptest::collection::vec((0..fields.len(), value), 0..8).prop_map(move |kv| {
        let mut m = serde_json::Map::new();
        for (i, v) in kv {
            m.insert(fields[i].to_string(), v);
        }
        if !m.contains_key("max_tokens") {
            m.insert("max_tokens".into(), json!(2));
        }
        Value::Object(m)
    });
    let mut runner = TestRunner::new(Config {
        cases: 150,
        ..Config::default()
    });
    let url = s.url.clone();
    runner
        .run(&(any::<bool>(), body), |(chat, body)| {
            let path = if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let (status, text) = rt.block_on(async {
                let r = client()
                    .post(format!("{url}{path}"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            });
            prop_assert!(
                [200, 400, 404, 413, 429, 503].contains(&status),
                "{status} for {body}: {text}"
            );
            if status != 200 {
                let v: Value = serde_json::from_str(&text).unwrap();
                prop_assert!(v["error"]["message"].is_string(), "{text}");
            }
            Ok(())
        })
        .unwrap();
    let h = rt.block_on(async {
        client()
            .get(format!("{}/health", s.url))
            .send()
            .await
            .unwrap()
            .status()
    });
    assert_eq!(h.as_u16(), 200);
    rt.block_on(s.stop());
}

/// A request that waits for admission longer than the queueing-time limit gets 503 with
/// Retry-After (and code `queue_timeout`); the others complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_past_the_limit_gets_503_with_retry_after() {
    let s = start(Opts {
        cfg: EngineConfig {
            max_running: 1,
            max_queue_time: Some(Duration::from_millis(1)),
            ..EngineConfig::default()
        },
        ..Opts::default()
    })
    .await;
    let url = format!("{}/v1/completions", s.url);
    let reqs = (0..20).map(|i| {
        let url = url.clone();
        async move {
            let r = client()
                .post(&url)
                .json(&json!({"prompt": [1, 2, 3, i], "max_tokens": 50, "ignore_eos": true}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let retry = r.headers().get("retry-after").is_some();
            let v: Value = r.json().await.unwrap();
            (status, retry, v)
        }
    });
    let out = futures_util::future::join_all(reqs).await;
    let late: Vec<_> = out.iter().filter(|o| o.0 == 503).collect();
    assert!(!late.is_empty(), "nothing timed out in the queue");
    for (_, retry, v) in &late {
        assert!(retry, "{v}");
        assert_eq!(v["error"]["code"], "queue_timeout", "{v}");
    }
    assert!(out.iter().any(|o| o.0 == 200));
    assert!(out.iter().all(|o| o.0 == 200 || o.0 == 503));
    let t = Instant::now();
    while s.state.engine.snapshot().finished.queue_timeout != late.len() as u64 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "queue timeouts not counted"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.stop().await;
}
