//! `/v1/responses`' store under a flood, over HTTP against a worker: stored responses past its
//! bounds push the oldest out (count and bytes stay within them, evictions are counted), a turn
//! naming a response that is gone or never was is a 400 naming `previous_response_id`, and the
//! worker keeps serving, the newest conversations still continuing.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use strata_server::response_store::ResponseStore;
use strata_test_support::{metrics_of, post, sample, spawn_worker, tiny_model, WorkerSpec};

fn turn(input: &str, previous: Option<&str>) -> Value {
    let mut b = json!({"input": input, "max_output_tokens": 2, "temperature": 0});
    if let Some(p) = previous {
        b["previous_response_id"] = json!(p);
    }
    b
}

/// `n` stored responses, 8 at a time; their ids in order.
async fn flood(url: &str, n: usize, input: impl Fn(usize) -> String) -> Vec<String> {
    let url = url.to_string();
    let bodies: Vec<Value> = (0..n).map(|i| turn(&input(i), None)).collect();
    futures_util::stream::iter(bodies)
        .map(|b| {
            let url = url.clone();
            async move {
                let (st, a) = post(&url, &b).await;
                assert_eq!(st, 200, "{a}");
                a["id"].as_str().unwrap().to_string()
            }
        })
        .buffered(8)
        .collect()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_stored_responses_stays_within_the_store_bounds() {
    let d = tempfile::tempdir().unwrap();
    let (max, bytes) = (40, 6 << 10);
    let spec = WorkerSpec {
        response_store: Some(ResponseStore::new(max, bytes, Duration::from_secs(3600))),
        ..WorkerSpec::default()
    };
    let w = spawn_worker(&tiny_model(d.path()), spec).await;
    let url = format!("{}/v1/responses", w.url);
    let (st, first) = post(&url, &turn("the first conversation", None)).await;
    assert_eq!(st, 200, "{first}");
    let first = first["id"].as_str().unwrap().to_string();
    let (st, a) = post(&url, &turn("and then?", Some(&first))).await;
    assert_eq!(st, 200, "kept before the flood: {a}");

    // By count: 300 small conversations.
    let ids = flood(&url, 300, |i| format!("question {i}")).await;
    let m = metrics_of(&w.url).await;
    let kept = sample(&m, "strata_response_store_responses");
    assert!(kept <= max as f64, "{kept} kept");
    assert!(sample(&m, "strata_response_store_bytes") <= bytes as f64);
    assert!(sample(&m, "strata_response_store_evictions_total") >= 300.0 - max as f64);
    let (st, e) = post(&url, &turn("and then?", Some(&first))).await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "previous_response_id", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("evicted"));
    let (st, a) = post(&url, &turn("and then?", ids.last().map(String::as_str))).await;
    assert_eq!(st, 200, "the newest continues: {a}");

    // By bytes: longer conversations, fewer of them kept.
    let long = |i: usize| format!("{i} {}", "cache topic ".repeat(40));
    flood(&url, 60, long).await;
    let m = metrics_of(&w.url).await;
    let (kept, held) = (
        sample(&m, "strata_response_store_responses"),
        sample(&m, "strata_response_store_bytes"),
    );
    assert!(
        held <= bytes as f64 && kept < max as f64,
        "{kept} kept, {held} B"
    );

    // Ids that never were: refused, nothing stored, whatever their shape.
    let long_id = "r".repeat(100_000);
    for id in ["resp_0", "", "../../etc/passwd", "\u{0}", long_id.as_str()] {
        let (st, e) = post(&url, &turn("hi", Some(id))).await;
        assert_eq!(st, 400, "{e}");
        assert_eq!(e["error"]["param"], "previous_response_id", "{e}");
    }
    let guesses: Vec<Value> = (0..500)
        .map(|i| turn("hi", Some(&format!("resp_{i:032x}"))))
        .collect();
    let refused = futures_util::stream::iter(guesses)
        .map(|b| {
            let url = url.clone();
            async move { post(&url, &b).await.0 }
        })
        .buffer_unordered(16)
        .filter(|st| std::future::ready(*st == 400))
        .count()
        .await;
    assert_eq!(refused, 500);
    let m = metrics_of(&w.url).await;
    assert_eq!(sample(&m, "strata_response_store_responses"), kept);
    let health = reqwest::get(format!("{}/health", w.url)).await.unwrap();
    assert_eq!(health.status(), 200);
    w.stop().await;
}
