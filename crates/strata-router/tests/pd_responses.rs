//! `/v1/responses` under PD through the router: a first turn's prompt is computed by the
//! prefill worker and its K/V imported (the answer equals one worker's), a continuation by
//! `previous_response_id` goes to the decode worker storing the conversation, which computes
//! the short new part itself.

mod common;
use common::start_router;

use serde_json::{json, Value};
use strata_test_support::{metrics_of, post, sample, spawn_worker, tiny_model, WorkerSpec};

fn turn(input: &str, previous: Option<&str>) -> Value {
    let mut b = json!({"input": input, "max_output_tokens": 6, "temperature": 0});
    if let Some(p) = previous {
        b["previous_response_id"] = json!(p);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_turn_is_prefilled_by_the_prefill_worker_and_continued_on_its_decode_worker() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model(d.path());
    let single = spawn_worker(&path, WorkerSpec::default()).await;
    let prefill = spawn_worker(&path, WorkerSpec::default()).await;
    let decode = spawn_worker(
        &path,
        WorkerSpec {
            kv_listener: true,
            prefill_workers: vec![prefill.url.clone()],
            ..WorkerSpec::default()
        },
    )
    .await;
    let r = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    let prefills = || async {
        let m = metrics_of(&prefill.url).await;
        sample(&m, "strata_pd_prefill_requests_total{outcome=\"ok\"}")
    };

    let long = format!(
        "Tell me about {}",
        (0..40)
            .map(|i| format!("topic{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let (st, want) = post(&format!("{}/v1/responses", single.url), &turn(&long, None)).await;
    assert_eq!(st, 200, "{want}");
    let (st, got) = post(&format!("{r}/v1/responses"), &turn(&long, None)).await;
    assert_eq!(st, 200, "{got}");
    assert_eq!(got["output"][0]["content"], want["output"][0]["content"]);
    assert_eq!(prefills().await, 1.0, "the first turn was prefilled there");
    let snap = decode.state.engine.snapshot();
    assert!(snap.transferred_prompt_tokens > 0);

    // The next turn: on the decode worker storing the conversation, computed there.
    let id = got["id"].as_str().unwrap();
    let (st, next) = post(&format!("{r}/v1/responses"), &turn("And then?", Some(id))).await;
    assert_eq!(st, 200, "{next}");
    assert_eq!(next["previous_response_id"], id);
    let cached = next["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= got["usage"]["input_tokens"].as_u64().unwrap() / 2,
        "{next}"
    );
    assert_eq!(
        prefills().await,
        1.0,
        "the short new part was computed on the decode worker"
    );
    assert_eq!(decode.state.engine.snapshot().pd_local_prefills, 1);
}

/// A continuation whose response is stored on a decode worker that is down now is a 503
/// naming it (retry later), not sent to another worker, which would answer that no such
/// response is stored; once the worker is back, the continuation goes to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_waits_for_the_worker_storing_its_response() {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model(d.path());
    let a = spawn_worker(&path, WorkerSpec::default()).await;
    let b = spawn_worker(&path, WorkerSpec::default()).await;
    let st = Arc::new(strata_router::RouterState::new(
        &[],
        &[a.url.clone(), b.url.clone()],
        strata_router::Policy::RoundRobin,
    ));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = format!("http://{}", l.local_addr().unwrap());
    let app = strata_router::router(st.clone());
    tokio::spawn(async move { axum::serve(l, app).await });

    let (s, first) = post(&format!("{r}/v1/responses"), &turn("hello", None)).await;
    assert_eq!(s, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_string();
    let owner = st.response_owners.lock().unwrap().get(&id).unwrap();
    let w = st.decode.iter().find(|w| w.url == owner).unwrap().clone();
    w.healthy.store(false, Ordering::Relaxed);
    for _ in 0..2 {
        let (s, e) = post(&format!("{r}/v1/responses"), &turn("and?", Some(&id))).await;
        assert_eq!(s, 503, "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(&id), "{e}");
    }
    w.healthy.store(true, Ordering::Relaxed);
    let (s, next) = post(&format!("{r}/v1/responses"), &turn("and?", Some(&id))).await;
    assert_eq!(s, 200, "{next}");
}
