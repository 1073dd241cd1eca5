//! Prefill/decode disaggregation over real sockets with the tiny model: router → decode worker
//! → prefill worker → K/V over the transfer channel → decode, against one worker doing both.

mod common;
use common::start_router;

use std::net::TcpListener as StdListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_engine::EngineConfig;
use strata_model::tiny::TINY_TEMPLATE;
use strata_model::{ChatTemplate, Gguf, ModelTokenizer};
use strata_router::{router, Policy, RouterState};
use strata_test_support::{
    metrics_of, post, post_text, sample, spawn_worker, TestWorker, WorkerSpec,
};

async fn worker(
    path: &std::path::Path,
    page_size: usize,
    kv: bool,
    prefill_workers: &[String],
) -> TestWorker {
    worker_with(
        path,
        page_size,
        kv,
        prefill_workers,
        EngineConfig::default(),
    )
    .await
}

async fn worker_with(
    path: &std::path::Path,
    page_size: usize,
    kv: bool,
    prefill_workers: &[String],
    engine: EngineConfig,
) -> TestWorker {
    let spec = WorkerSpec {
        page_size,
        kv_listener: kv,
        prefill_workers: prefill_workers.to_vec(),
        engine,
        ..WorkerSpec::default()
    };
    spawn_worker(path, spec).await
}

fn chat(content: &str, max: usize) -> Value {
    json!({"messages": [{"role": "system", "content": "A shared system prompt for everyone."},
           {"role": "user", "content": content}],
           "max_tokens": max, "temperature": 0, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_output_equals_one_worker_and_failures_are_clean() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let single = worker(&path, 16, false, &[]).await;
    let prefill = worker(&path, 16, false, &[]).await;
    let decode = worker(&path, 16, true, std::slice::from_ref(&prefill.url)).await;
    let r = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;

    let q = "tell me about the weather in a long sentence please";
    let (s1, want) = post(&format!("{}/v1/chat/completions", single.url), &chat(q, 12)).await;
    assert_eq!(s1, 200, "{want}");
    let (s2, got) = post(&format!("{r}/v1/chat/completions"), &chat(q, 12)).await;
    assert_eq!(s2, 200, "{got}");
    assert_eq!(
        got["choices"][0]["message"]["content"],
        want["choices"][0]["message"]["content"]
    );
    assert_eq!(got["usage"]["completion_tokens"], 12);
    // Again: the decode worker's cache holds all of the prompt but its last page, which it
    // computes itself (no prefill worker, no transfer), and says so.
    let (_, again) = post(&format!("{r}/v1/chat/completions"), &chat(q, 12)).await;
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        again["choices"][0]["message"]["content"],
        want["choices"][0]["message"]["content"]
    );
    let snap = decode.state.engine.snapshot();
    assert!(snap.transferred_prompt_tokens > 0);
    assert_eq!(snap.pd_local_prefills, 1);
    // The prefill worker counts the PD prefill work it did, and both sides time the transfers.
    let pm = metrics_of(&prefill.url).await;
    assert_eq!(
        sample(&pm, "strata_pd_prefill_requests_total{outcome=\"ok\"}"),
        1.0,
        "{pm}"
    );
    assert!(
        sample(&pm, "strata_pd_prefill_prompt_tokens_total") > 0.0,
        "{pm}"
    );
    assert!(
        sample(&pm, "strata_pd_prefill_duration_seconds_count") >= 1.0,
        "{pm}"
    );
    assert!(
        sample(&pm, "strata_kv_transfer_seconds_total{direction=\"sent\"}") > 0.0,
        "{pm}"
    );
    let dm = metrics_of(&decode.url).await;
    assert!(
        sample(
            &dm,
            "strata_kv_transfer_seconds_total{direction=\"received\"}"
        ) > 0.0,
        "{dm}"
    );
    // Streaming through the router.
    let mut sb = chat(q, 5);
    sb["stream"] = json!(true);
    let text = post_text(&format!("{r}/v1/chat/completions"), &sb).await;
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // A decode side that dies mid-transfer: the prefill worker answers a clean error, holds
    // no pages, and keeps serving.
    let fake = StdListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap().to_string();
    let info = prefill.state.engine.info().clone();
    std::thread::spawn(move || {
        let (mut c, _) = fake.accept().unwrap();
        let hello = info.hello();
        strata_engine::transfer::handshake_accept(&mut c, &hello, None).unwrap();
        let _ = strata_engine::transfer::read_frame(&mut c, 1 << 24); // Begin
        let _ = strata_engine::transfer::write_frame(
            &mut c,
            &strata_engine::transfer::Frame::Ack {
                id: 1,
                ok: true,
                reason: String::new(),
            },
        );
        let _ = strata_engine::transfer::read_frame(&mut c, 1 << 24); // one page, then die
    });
    let (st, e) = post(
        &format!("{}/pd/prefill", prefill.url),
        &json!({"transfer_id": "00000000000000000000000000000001", "tokens": (0..40).collect::<Vec<u32>>(), "kv_target": fake_addr}),
    )
    .await;
    assert_eq!(st, 502, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV transfer to"),
        "{e}"
    );
    let t = Instant::now();
    while prefill.state.engine.snapshot().running > 0 {
        assert!(t.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(prefill.state.engine.snapshot().device_pages_held, 0);
    let (st, _) = post(
        &format!("{r}/v1/chat/completions"),
        &chat("still there?", 3),
    )
    .await;
    assert_eq!(st, 200);

    // An empty prompt is named as such.
    let (st, e) = post(
        &format!("{}/pd/prefill", prefill.url),
        &json!({"transfer_id": "00000000000000000000000000000003", "tokens": [],
                "kv_target": fake_addr}),
    )
    .await;
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("tokens")),
        "{e}"
    );

    // A decode worker with another page size: the handshake is refused, with the reason.
    let other = worker(&path, 32, true, &[]).await;
    let (st, e) = post(
        &format!("{}/pd/prefill", prefill.url),
        &json!({"transfer_id": "00000000000000000000000000000002", "tokens": [1, 2, 3],
                "kv_target": other.state.pd.kv.as_ref().unwrap().addr.to_string()}),
    )
    .await;
    assert_eq!(st, 502);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("differ in: page size"),
        "{e}"
    );

    // Two decode workers, one stopped: the router routes around it.
    let decode2 = worker(&path, 16, true, std::slice::from_ref(&prefill.url)).await;
    let dead_url = decode.url.clone();
    decode.stop().await;
    let r2 = start_router(
        std::slice::from_ref(&prefill.url),
        &[dead_url, decode2.url.clone()],
    )
    .await;
    for i in 0..4 {
        let (st, v) = post(
            &format!("{r2}/v1/chat/completions"),
            &chat(&format!("q{i}"), 3),
        )
        .await;
        assert_eq!(st, 200, "{v}");
    }
    for w in [single, prefill, other, decode2] {
        w.stop().await;
    }
}

/// Two prefill workers: a repeated long prefix goes to the one that holds it, also once it sits
/// only in that worker's host tier; the router counts the hits by tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_routing_follows_the_prefix() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let p0 = worker(&path, 16, false, &[]).await;
    let p1 = worker(&path, 16, false, &[]).await;
    // Every repeat goes to a prefill worker (none is computed on the decode worker).
    let dec = spawn_worker(
        &path,
        WorkerSpec {
            page_size: 16,
            kv_listener: true,
            prefill_workers: vec![p0.url.clone(), p1.url.clone()],
            pd_local_prefill_tokens: 0,
            ..WorkerSpec::default()
        },
    )
    .await;
    let r = cache_aware_router(
        &path,
        &[p0.url.clone(), p1.url.clone()],
        std::slice::from_ref(&dec.url),
    )
    .await;
    let long = "a long shared document that many requests ask about, ".repeat(6);
    let prefills = [&p0, &p1];
    let holder = |i: usize| prefills[i].state.engine.snapshot();
    let (st, _) = post(&format!("{r}/v1/chat/completions"), &chat(&long, 4)).await;
    assert_eq!(st, 200);
    let first = if holder(0).prompt_tokens > 0 { 0 } else { 1 };
    let wait_index = || async {
        // Let the router read the events of the finished request.
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    wait_index().await;
    for _ in 0..3 {
        let (st, v) = post(&format!("{r}/v1/chat/completions"), &chat(&long, 4)).await;
        assert_eq!(st, 200, "{v}");
        assert!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    assert_eq!(
        holder(1 - first).prompt_tokens,
        0,
        "the other worker got a repeat"
    );
    assert!(holder(first).cached_device_tokens > 0);
    // Only in the holder's host tier now: still routed there, counted as host hits.
    let flushed = reqwest::Client::new()
        .post(format!("{}/flush_cache?tier=device", prefills[first].url))
        .send()
        .await
        .unwrap();
    assert_eq!(flushed.status(), 200);
    wait_index().await;
    let (st, _) = post(&format!("{r}/v1/chat/completions"), &chat(&long, 4)).await;
    assert_eq!(st, 200);
    assert_eq!(holder(1 - first).prompt_tokens, 0);
    assert!(holder(first).cached_host_tokens > 0);
    let w: Value = reqwest::get(format!("{r}/workers"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(w["cache_aware"]["hits"].as_u64().unwrap() >= 4, "{w}");
    assert!(
        w["cache_aware"]["hit_pages_host"].as_u64().unwrap() > 0,
        "{w}"
    );
    // A different prompt is free to go anywhere (the load term breaks ties).
    let (st, _) = post(&format!("{r}/v1/chat/completions"), &chat("short", 2)).await;
    assert_eq!(st, 200);
    for w in [p0, p1, dec] {
        w.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_api_keys_are_checked_in_the_openai_error_format() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let w = worker(&path, 16, false, &[]).await;
    let mut rs = RouterState::new(&[], std::slice::from_ref(&w.url), Policy::LeastLoad);
    rs.api_keys.insert("sesame".into());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(Arc::new(rs))).await });
    let c = reqwest::Client::new();
    for key in [None, Some("wrong")] {
        let mut req = c
            .post(format!("{r}/v1/chat/completions"))
            .json(&chat("hi", 2));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("API key"));
    }
    let ok = c
        .post(format!("{r}/v1/chat/completions"))
        .bearer_auth("sesame")
        .json(&chat("hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    // The same body limit as the workers (4 MiB), unknown routes and wrong methods: JSON. (A
    // fresh client for each: the server closes a connection whose body it refused unread.)
    let c = || reqwest::Client::new();
    for (resp, status) in [
        (
            c().post(format!("{r}/v1/chat/completions"))
                .bearer_auth("sesame")
                .header("content-type", "application/json")
                .body(vec![b' '; 5 << 20])
                .send()
                .await
                .unwrap(),
            413,
        ),
        // Unknown routes and wrong methods need the key first (401 without it).
        (
            c().get(format!("{r}/nope"))
                .bearer_auth("sesame")
                .send()
                .await
                .unwrap(),
            404,
        ),
        (c().get(format!("{r}/nope")).send().await.unwrap(), 401),
        (
            c().get(format!("{r}/v1/chat/completions"))
                .bearer_auth("sesame")
                .send()
                .await
                .unwrap(),
            405,
        ),
    ] {
        assert_eq!(resp.status().as_u16(), status);
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    // The front door on /metrics: answers by route, status and worker; latency histograms.
    let m = metrics_of(&r).await;
    let chat_route = "strata_router_http_requests_total{route=\"/v1/chat/completions\"";
    assert_eq!(
        sample(&m, &format!("{chat_route},code=\"401\",worker=\"none\"}}")),
        2.0,
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            &format!("{chat_route},code=\"200\",worker=\"{}\"}}", w.url)
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, &format!("{chat_route},code=\"413\",worker=\"none\"}}")),
        1.0,
        "{m}"
    );
    // The two chat calls above and the unkeyed /nope.
    assert_eq!(sample(&m, "strata_router_auth_failures_total"), 3.0, "{m}");
    assert!(
        sample(&m, "strata_router_request_duration_seconds_count") >= 4.0,
        "{m}"
    );
    assert!(
        sample(&m, "strata_router_added_latency_seconds_count") >= 1.0,
        "{m}"
    );
    assert_eq!(sample(&m, "strata_router_in_flight_requests"), 0.0, "{m}");

    // 429 from an overloaded worker passes through and is counted; an unreachable worker is a
    // 502 after the retry, counted with its upstream errors.
    let busy = worker_with(
        &path,
        16,
        false,
        &[],
        EngineConfig {
            max_waiting: 0,
            ..EngineConfig::default()
        },
    )
    .await;
    let dead_url = || {
        let dead = StdListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", dead.local_addr().unwrap())
    };
    for (decode, want) in [
        (vec![busy.url.clone()], 429u16),
        (vec![dead_url(), dead_url()], 502),
    ] {
        let rs = RouterState::new(&[], &decode, Policy::LeastLoad);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let r2 = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, router(Arc::new(rs))).await });
        let (st, v) = post(&format!("{r2}/v1/chat/completions"), &chat("hi", 2)).await;
        assert_eq!(st, want, "{v}");
        let m = metrics_of(&r2).await;
        let worker = if want == 429 {
            decode[0].as_str()
        } else {
            "none"
        };
        assert_eq!(
            sample(
                &m,
                &format!("{chat_route},code=\"{want}\",worker=\"{worker}\"}}")
            ),
            1.0,
            "{m}"
        );
        if want == 502 {
            assert_eq!(
                sample(&m, "strata_router_upstream_errors_total{kind=\"connect\"}"),
                2.0,
                "{m}"
            );
        } else {
            // The worker's Retry-After goes back with its 429.
            let r = reqwest::Client::new()
                .post(format!("{r2}/v1/chat/completions"))
                .json(&chat("hi", 2))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 429);
            let after = r.headers().get("retry-after").map(|v| v.to_str().unwrap());
            assert!(after.is_some_and(|s| s.parse::<u32>().is_ok()), "{after:?}");
        }
    }
    busy.stop().await;
    w.stop().await;
}

/// Two decode workers: the repeats of a conversation go back to the decode worker that holds
/// it (which asks the prefill worker only for the pages it lacks), not to the other by turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_goes_back_to_the_decode_worker_that_holds_it() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let p = worker(&path, 16, false, &[]).await;
    let dec = |_| {
        spawn_worker(
            &path,
            WorkerSpec {
                page_size: 16,
                kv_listener: true,
                prefill_workers: vec![p.url.clone()],
                pd_local_prefill_tokens: 0,
                ..WorkerSpec::default()
            },
        )
    };
    let (d0, d1) = (dec(0).await, dec(1).await);
    let r = cache_aware_router(
        &path,
        std::slice::from_ref(&p.url),
        &[d0.url.clone(), d1.url.clone()],
    )
    .await;
    // Two prompts sharing no page (token ids: no chat template's common start): with nothing
    // cached yet they go to the two decode workers in turn.
    let talks: Vec<Value> = [10u32, 150]
        .iter()
        .map(|&t| {
            json!({"prompt": (t..t + 100).collect::<Vec<u32>>(), "max_tokens": 4,
                   "temperature": 0, "ignore_eos": true})
        })
        .collect();
    let decoders = [&d0, &d1];
    let moved = |i: usize| {
        decoders[i]
            .state
            .engine
            .snapshot()
            .transferred_prompt_tokens
    };
    let mut holders = Vec::new();
    for t in &talks {
        let before = [moved(0), moved(1)];
        let (st, _) = post(&format!("{r}/v1/completions"), t).await;
        assert_eq!(st, 200);
        holders.push(if moved(0) > before[0] { 0 } else { 1 });
    }
    assert_ne!(
        holders[0], holders[1],
        "ties alternate between decode workers"
    );
    // The router has read every worker's cache events: each prompt's 6 whole pages on its
    // decode worker and on the prefill worker.
    let t = Instant::now();
    while sample(&metrics_of(&r).await, "strata_router_index_pages") < 24.0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the index never caught up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Within its memory, every page announced indexed.
    let m = metrics_of(&r).await;
    let (bytes, limit) = (
        sample(&m, "strata_router_index_bytes"),
        sample(&m, "strata_router_index_limit_bytes"),
    );
    assert!(bytes > 0.0 && bytes <= limit, "{m}");
    assert_eq!(
        sample(&m, "strata_router_index_unindexed_pages"),
        0.0,
        "{m}"
    );
    let before = moved(0) + moved(1);
    for t in talks.iter().chain(&talks) {
        let (st, v) = post(&format!("{r}/v1/completions"), t).await;
        assert_eq!(st, 200, "{v}");
    }
    // Each repeat went to its holder, which received its last page only (a full prompt to
    // the other would be over a hundred tokens).
    assert!(moved(0) + moved(1) - before <= 4 * 16);
    let m = metrics_of(&r).await;
    assert_eq!(
        sample(&m, "strata_router_decode_cache_hits_total"),
        4.0,
        "{m}"
    );
    for w in [p, d0, d1] {
        w.stop().await;
    }
}

/// `--pd-decode-reuse false`: every request receives its whole prompt's K/V, a repeat too,
/// with the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_decode_reuse_a_repeat_moves_the_whole_prompt_again() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let prefill = worker(&path, 16, false, &[]).await;
    let decode = spawn_worker(
        &path,
        WorkerSpec {
            page_size: 16,
            kv_listener: true,
            prefill_workers: vec![prefill.url.clone()],
            pd_decode_reuse: false,
            ..WorkerSpec::default()
        },
    )
    .await;
    let r = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    let q = "tell me about the weather in a long sentence please";
    let (_, a) = post(&format!("{r}/v1/chat/completions"), &chat(q, 6)).await;
    let once = decode.state.engine.snapshot().transferred_prompt_tokens;
    let (_, b) = post(&format!("{r}/v1/chat/completions"), &chat(q, 6)).await;
    let snap = decode.state.engine.snapshot();
    assert_eq!(snap.transferred_prompt_tokens, 2 * once);
    assert_eq!((snap.pd_held_prompt_tokens, snap.pd_local_prefills), (0, 0));
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
    for w in [prefill, decode] {
        w.stop().await;
    }
}

/// A cache-aware router over `prefill` and `decode`, following their cache events every
/// 20 ms: its URL.
async fn cache_aware_router(
    path: &std::path::Path,
    prefill: &[String],
    decode: &[String],
) -> String {
    use strata_router::cache_index::{CacheIndex, IndexLimits, DEFAULT_INDEX_MEMORY};
    use strata_router::index_loop;
    let g = Gguf::open(path).unwrap();
    let tk = ModelTokenizer::from_gguf(&g).unwrap();
    let mut rs = RouterState::new(prefill, decode, Policy::CacheAware);
    rs.set_index(Arc::new(CacheIndex::new(
        Arc::new(tk),
        Some(ChatTemplate::new(TINY_TEMPLATE).unwrap()),
        prefill.len() + decode.len(),
        IndexLimits::within(DEFAULT_INDEX_MEMORY, prefill.len() + decode.len()).unwrap(),
    )));
    let rs = Arc::new(rs);
    tokio::spawn(index_loop(rs.clone(), Duration::from_millis(20)));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(rs)).await });
    r
}

/// A client's mistake answers the same through the router under PD as from one worker (the
/// decode worker checks the request before any prefill work): status, message and `param`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_answers_the_same_through_pd_as_from_one_worker() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let single = worker(&path, 16, false, &[]).await;
    let prefill = worker(&path, 16, false, &[]).await;
    let decode = worker(&path, 16, true, std::slice::from_ref(&prefill.url)).await;
    let r = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    for body in [
        json!({"prompt": [1, 2, 999999], "max_tokens": 2}),
        json!({"prompt": "", "max_tokens": 2}),
        json!({"prompt": "hello", "max_tokens": 2, "logit_bias": {"999999": 1}}),
        json!({"prompt": "hello", "max_tokens": 510}),
        json!({"prompt": "hello", "max_tokens": 5000}),
        json!({"prompt": vec![vec![5u32, 6]; 65], "max_tokens": 2}),
    ] {
        let (s1, one) = post(&format!("{}/v1/completions", single.url), &body).await;
        let (s2, pd) = post(&format!("{r}/v1/completions"), &body).await;
        assert!((400..500).contains(&s1), "{one}");
        assert_eq!((s2, &pd["error"]), (s1, &one["error"]), "{body}");
    }
    let pm = metrics_of(&prefill.url).await;
    assert_eq!(
        sample(&pm, "strata_pd_prefill_requests_total{outcome=\"ok\"}")
            + sample(&pm, "strata_pd_prefill_requests_total{outcome=\"failed\"}"),
        0.0,
        "nothing reached the prefill worker"
    );
    let rm = metrics_of(&r).await;
    assert_eq!(sample(&rm, "strata_router_retries_total"), 0.0, "{rm}");
    for w in [single, prefill, decode] {
        w.stop().await;
    }
}
