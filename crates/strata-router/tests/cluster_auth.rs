//! PD with a cluster key over real sockets: the router's and the decode worker's signed calls
//! learn each receiver's instance on their first call and go through; a router with another
//! key gets the router's own 502, never the worker's 401. The router's admin flushes the
//! workers by signed calls.

use std::sync::Arc;

use serde_json::{json, Value};
use strata_kv::auth::ClusterKey;
use strata_router::{router, Policy, RouterState};
use strata_test_support::{post, spawn_worker, TestWorker, WorkerSpec};

async fn worker(path: &std::path::Path, key: &ClusterKey, prefill: Option<&str>) -> TestWorker {
    let spec = WorkerSpec {
        kv_listener: prefill.is_some(),
        prefill_workers: prefill.map(String::from).into_iter().collect(),
        // Every PD request through the prefill worker: the decode worker's signed call too.
        pd_local_prefill_tokens: 0,
        cluster_key: Some(key.clone()),
        ..WorkerSpec::default()
    };
    spawn_worker(path, spec).await
}

async fn router_with(key: &ClusterKey, prefill: &str, decode: &str) -> String {
    let mut rs = RouterState::new(&[prefill.into()], &[decode.into()], Policy::RoundRobin);
    rs.cluster_key = Some(key.clone());
    rs.admin_key = Some("op".into());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(Arc::new(rs))).await });
    url
}

fn chat(content: &str) -> Value {
    json!({"messages": [{"role": "user", "content": content}],
           "max_tokens": 3, "temperature": 0, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_calls_learn_each_instance_and_another_key_is_the_routers_502() {
    let d = tempfile::tempdir().unwrap();
    let path = strata_test_support::tiny_model(d.path());
    let key = ClusterKey::from_secret(&[7; 32]).unwrap();
    let prefill = worker(&path, &key, None).await;
    let decode = worker(&path, &key, Some(&prefill.url)).await;
    let r = router_with(&key, &prefill.url, &decode.url).await;
    // The first calls are signed before the router (and the decode worker) know their
    // receivers' instances: each is refused once, learnt from, and sent again.
    for q in ["the first question", "another question"] {
        let (status, v) = post(&format!("{r}/v1/chat/completions"), &chat(q)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    }
    let body = json!({"input": "a responses turn", "max_output_tokens": 3, "temperature": 0});
    let (status, v) = post(&format!("{r}/v1/responses"), &body).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        decode.state.engine.snapshot().transferred_prompt_tokens > 0,
        "the prompts went through the prefill worker"
    );

    // A router with another key: the worker's refusal stays in the router's log; the client
    // gets the router's 502 saying what to check, on both routes.
    let other = ClusterKey::from_secret(&[8; 32]).unwrap();
    let wrong = router_with(&other, &prefill.url, &decode.url).await;
    let answers = [
        post(&format!("{wrong}/v1/chat/completions"), &chat("hi")).await,
        post(&format!("{wrong}/v1/responses"), &body).await,
    ];
    for (status, v) in answers {
        assert_eq!(status, 502, "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("refused the router's authentication"), "{v}");
    }

    // The router's admin flushes both workers (which have no admin key) by signed calls; the
    // router with another cluster key flushes neither, and names both.
    let used = |w: &TestWorker| w.state.engine.snapshot().device.pages_used;
    let flush = |router: &str| {
        let url = format!("{router}/flush_cache?tier=device");
        reqwest::Client::new().post(url).bearer_auth("op").send()
    };
    let refused = flush(&wrong).await.unwrap();
    assert_eq!(refused.status(), 502);
    let e: Value = refused.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&prefill.url) && msg.contains(&decode.url),
        "{e}"
    );
    assert!(used(&prefill) > 0 && used(&decode) > 0);
    // A query the URL parser spells otherwise on the wire (a quote, a non-ASCII letter): the
    // MAC covers what is sent, so the worker reads it and refuses the tier, not the router.
    let (status, answer) = raw_flush(&r, "?tier='d\u{e9}vice'").await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("expected `device` or `all`"), "{answer}");
    assert!(used(&prefill) > 0 && used(&decode) > 0);
    let ok = flush(&r).await.unwrap();
    assert_eq!(ok.status(), 200);
    for w in [&prefill, &decode] {
        assert_eq!(used(w), 0, "{}", w.url);
    }
}

/// `POST /flush_cache{query}` with the admin key, the query sent byte for byte as given (an
/// HTTP client would encode it first): the status and the whole answer.
async fn raw_flush(router: &str, query: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = router.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /flush_cache{query} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer op\r\n\
         content-length: 0\r\nconnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out.get(9..12).and_then(|x| x.parse().ok()).unwrap_or(0);
    (status, out)
}

/// With a cluster key the router's flush carries its MAC and nothing else: the admin key stays
/// at the router (a stand-in worker records what arrives). Each call carries the caller's
/// `X-Request-Id`, so the workers log the flush under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_flush_carries_no_admin_key() {
    use axum::http::HeaderMap;
    use std::sync::Mutex;
    let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
    let record = seen.clone();
    let stub = axum::Router::new().route(
        "/flush_cache",
        axum::routing::post(move |h: HeaderMap| {
            record.lock().unwrap().push(h);
            async { axum::Json(json!({"flushed": "all"})) }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, stub).await });
    let key = ClusterKey::from_secret(&[7; 32]).unwrap();
    let r = router_with(&key, &worker, &worker).await;
    let ok = reqwest::Client::new()
        .post(format!("{r}/flush_cache"))
        .bearer_auth("op")
        .header("x-request-id", "flush-42")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "the worker is both prefill and decode here");
    for h in seen.iter() {
        assert!(h.contains_key("x-strata-cluster-auth"), "{h:?}");
        assert!(!h.contains_key("authorization"), "{h:?}");
        assert_eq!(h.get("x-request-id").unwrap(), "flush-42", "{h:?}");
    }
}
