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
