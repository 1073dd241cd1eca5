//! Through the router: the endpoints around generation are passed to a worker, request ids are
//! echoed, and an unknown route is a JSON 404.

use std::sync::Arc;

use serde_json::{json, Value};
use strata_router::{router, Policy, RouterState};
use strata_test_support::{post, spawn_worker, tiny_model, WorkerSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_passes_models_tokenize_version_and_request_ids() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let st = Arc::new(RouterState::new(
        &[],
        std::slice::from_ref(&w.url),
        Policy::RoundRobin,
    ));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(st)).await });

    let get = |p: &str| {
        let url = format!("{r}{p}");
        async move {
            let x = reqwest::get(url).await.unwrap();
            (x.status().as_u16(), x.json::<Value>().await.unwrap())
        }
    };
    let (st, m) = get("/v1/models/tiny").await;
    assert_eq!((st, &m["id"]), (200, &json!("tiny")), "{m}");
    let (st, e) = get("/v1/models/nope").await;
    assert_eq!((st, &e["error"]["code"]), (404, &json!("model_not_found")));
    // A model id is one path segment at the worker: an encoded `/`, `\\` or `?` stays in it,
    // and a dot segment is no id; none reaches another route of the worker.
    for id in [
        "..%2F..%2Fcache%2Finfo",
        "..%2F..%2Fhealth_generate",
        "..%5C..%5Ccache%5Cinfo",
        "%2E%2E",
        "..",
        "x%3F..%2F..%2Fcache%2Finfo",
        "%ff",
        "caf%C3",
    ] {
        let (st, e) = get(&format!("/v1/models/{id}")).await;
        assert_eq!(st, 404, "{id}: {e}");
        assert!(
            e["error"].is_object() && e.get("hash_key").is_none(),
            "{id}: {e}"
        );
    }
    // An id that is not UTF-8, at the worker itself: its JSON 404 too.
    let x = reqwest::get(format!("{}/v1/models/%ff", w.url))
        .await
        .unwrap();
    assert_eq!(x.status(), 404);
    let e: Value = x.json().await.unwrap();
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
    let (st, v) = get("/version").await;
    assert_eq!((st, &v["name"]), (200, &json!("strata")));
    let (st, e) = get("/no/such/route").await;
    assert_eq!(st, 404);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/no/such/route"),
        "{e}"
    );

    let (st, t) = post(&format!("{r}/tokenize"), &json!({"prompt": "hello"})).await;
    assert_eq!(st, 200, "{t}");
    let (st, b) = post(&format!("{r}/detokenize"), &json!({"tokens": t["tokens"]})).await;
    assert_eq!((st, &b["prompt"]), (200, &json!("hello")));

    let resp = reqwest::Client::new()
        .post(format!("{r}/v1/completions"))
        .header("x-request-id", "abc-123")
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "abc-123");
    w.stop().await;
}

/// A router on the workers with admin key `admin` (None: without `--admin-key`) and client
/// API key `client` (None: open).
async fn router_on(workers: &[String], admin: Option<&str>, client: Option<&str>) -> String {
    let mut st = RouterState::new(&[], workers, Policy::RoundRobin);
    st.admin_key = admin.map(String::from);
    st.api_keys.extend(client.map(String::from));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(Arc::new(st))).await });
    r
}

/// `/tokenizer_info` passes to a worker; `/flush_cache` is the router's admin endpoint: refused
/// by a router without `--admin-key` and to a caller without it (even where a worker would take
/// anything: a keyless loopback worker), and with it every worker is reached with the router's
/// credential; a worker's refusal of the query comes back as it gave it, its refusal of the
/// router's credential is the router's 502 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_answers_tokenizer_info_and_flushes_every_worker() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model(d.path());
    let keyed = WorkerSpec {
        admin_key: Some("op-key".into()),
        ..WorkerSpec::default()
    };
    // `a` wants the admin key; `b` has no key at all (open to local processes).
    let (a, b) = (
        spawn_worker(&path, keyed).await,
        spawn_worker(&path, WorkerSpec::default()).await,
    );
    let urls = [a.url.clone(), b.url.clone()];
    let (open, r, other, keyed) = (
        router_on(&urls, None, None).await,
        router_on(&urls, Some("op-key"), None).await,
        router_on(&urls, Some("not-the-workers"), None).await,
        router_on(&urls, Some("op-key"), Some("a-client-key")).await,
    );
    let info: Value = reqwest::get(format!("{r}/tokenizer_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(info["eos_token"].is_string(), "{info}");
    // Both workers cache a prompt.
    for w in [&a, &b] {
        let body = json!({"prompt": (1..40).collect::<Vec<u32>>(), "max_tokens": 1});
        let (st, x) = post(&format!("{}/v1/completions", w.url), &body).await;
        assert_eq!(st, 200, "{x}");
    }
    let used = |w: &strata_test_support::TestWorker| w.state.engine.snapshot().device.pages_used;
    assert!(used(&a) > 0 && used(&b) > 0);
    let c = reqwest::Client::new();
    let flush = |router: &str, key: Option<&str>, q: &str, body: &str| {
        let mut req = c
            .post(format!("{router}/flush_cache{q}"))
            .body(body.to_string());
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        req.send()
    };
    let refused = [
        (
            flush(&open, Some("op-key"), "", "").await.unwrap(),
            403,
            "--admin-key",
        ),
        (flush(&r, None, "", "").await.unwrap(), 401, "admin key"),
        (
            flush(&r, Some("a-client-key"), "", "").await.unwrap(),
            401,
            "admin key",
        ),
        // A client key is no admin key, on a router that has both.
        (
            flush(&keyed, Some("a-client-key"), "", "").await.unwrap(),
            401,
            "admin key",
        ),
    ];
    for (answer, status, says) in refused {
        assert_eq!(answer.status(), status);
        let e: Value = answer.json().await.unwrap();
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{e}");
    }
    assert!(
        used(&a) > 0 && used(&b) > 0,
        "nothing flushed without the router's admin key, not even the keyless worker"
    );
    // A misspelt parameter (the workers refuse it) or the tier in a body (the router refuses
    // it): a 400 in the API's shape, and nothing flushed.
    for (q, body) in [("?tierr=device", ""), ("", r#"{"tier": "device"}"#)] {
        let answer = flush(&r, Some("op-key"), q, body).await.unwrap();
        assert_eq!(answer.status(), 400, "{q} {body}");
        let e: Value = answer.json().await.unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    }
    assert!(
        used(&a) > 0 && used(&b) > 0,
        "nothing flushed by a refused call"
    );
    // A router whose admin key the keyed worker does not share: named in the router's 502
    // (the keyless worker flushes).
    let answer = flush(&other, Some("not-the-workers"), "?tier=device", "")
        .await
        .unwrap();
    assert_eq!(answer.status(), 502);
    let e: Value = answer.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&a.url) && msg.contains("refused the router's credential"),
        "{e}"
    );
    assert!(used(&a) > 0, "the keyed worker kept its cache");
    let ok = flush(&keyed, Some("op-key"), "?tier=device", "")
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let v: Value = ok.json().await.unwrap();
    assert_eq!(v["workers"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["workers"][1]["answer"]["flushed"], "device", "{v}");
    assert_eq!((used(&a), used(&b)), (0, 0));
    a.stop().await;
    b.stop().await;
}

/// `/v1/responses` through the router: a turn continuing a stored response goes to the worker
/// that stores it (with two workers, a wrong one would answer 400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_turn_goes_to_the_worker_storing_its_previous_response() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model(d.path());
    let (a, b) = (
        spawn_worker(&path, WorkerSpec::default()).await,
        spawn_worker(&path, WorkerSpec::default()).await,
    );
    let st = Arc::new(RouterState::new(
        &[],
        &[a.url.clone(), b.url.clone()],
        Policy::RoundRobin,
    ));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(st)).await });
    let url = format!("{r}/v1/responses");
    let mut ids = Vec::new();
    for i in 0..4 {
        let (st, x) = post(
            &url,
            &json!({"input": format!("turn {i}"), "max_output_tokens": 2}),
        )
        .await;
        assert_eq!(st, 200, "{x}");
        ids.push(x["id"].as_str().unwrap().to_string());
    }
    // Round robin spread the first turns over both workers.
    let kept = |w: &strata_test_support::TestWorker| w.state.responses.size().0;
    assert!(kept(&a) > 0 && kept(&b) > 0, "{} {}", kept(&a), kept(&b));
    for id in &ids {
        let body = json!({"input": "again", "previous_response_id": id, "max_output_tokens": 2});
        let (st, x) = post(&url, &body).await;
        assert_eq!(st, 200, "{x}");
        assert_eq!(x["previous_response_id"], json!(id));
    }
    a.stop().await;
    b.stop().await;
}

/// A worker's redirect is not followed (it could send the call, its body and any signature,
/// to another host): the client gets a 502, and the place it pointed to is never asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_redirect_is_not_followed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let asked = Arc::new(AtomicUsize::new(0));
    let seen = asked.clone();
    let elsewhere = axum::Router::new().fallback(move || {
        seen.fetch_add(1, Ordering::SeqCst);
        async { axum::Json(json!({"secret": true})) }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let there = format!("http://{}/secret", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, elsewhere).await });
    let fake = axum::Router::new().fallback(move || {
        let to = there.clone();
        async move {
            (
                axum::http::StatusCode::TEMPORARY_REDIRECT,
                [("location", to)],
                "",
            )
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, fake).await });
    let st = Arc::new(RouterState::new(&[], &[worker], Policy::RoundRobin));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(st)).await });
    let (st, e) = post(
        &format!("{r}/v1/completions"),
        &json!({"prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 502, "{e}");
    assert!(e.get("secret").is_none(), "{e}");
    let m = reqwest::get(format!("{r}/v1/models/tiny")).await.unwrap();
    assert_ne!(m.status(), 200);
    assert_eq!(asked.load(Ordering::SeqCst), 0, "the redirect was followed");
}
