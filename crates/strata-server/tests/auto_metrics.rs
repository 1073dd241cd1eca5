//! What the default eviction policy (`auto`) has learnt is on a real worker's `/metrics`: its
//! credit for newcomers, and the pages it removed and saw come back, by class. A prompt
//! removed on probation and sent again counts as returned; another policy exports none of it.

use serde_json::json;
use strata_kv::EvictionPolicy;
use strata_test_support::{metrics_of, post, sample, spawn_worker, tiny_model, WorkerSpec};

const CREDIT: &str = "strata_cache_auto_newcomer_credit";
const REMOVED: &str = r#"strata_cache_auto_removed_pages_total{class="probation"}"#;
const RETURNED: &str = r#"strata_cache_auto_returned_pages_total{class="probation"}"#;

/// The sample `key` of the worker at `url` once `done` holds for it (the snapshot is published
/// after the engine's step, which may end after the answer was sent); panics after 10 s.
async fn once(url: &str, key: &str, done: impl Fn(f64) -> bool) -> f64 {
    let t = std::time::Instant::now();
    loop {
        let v = sample(&metrics_of(url).await, key);
        if done(v) {
            return v;
        }
        assert!(t.elapsed().as_secs() < 10, "{key} stayed at {v}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A prompt of its own, several pages long.
fn prompt(i: usize) -> String {
    format!("Document {i}: ")
        + &(0..8)
            .map(|w| format!("w{}x{}", i, w))
            .collect::<Vec<_>>()
            .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_reports_its_credit_and_the_removals_it_learns_from() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path());
    let spec = WorkerSpec {
        device_pages: 16,
        host_pages: 8,
        ..WorkerSpec::default()
    };
    let w = spawn_worker(&model, spec).await;
    let url = format!("{}/v1/completions", w.url);
    let send = |i: usize| {
        let url = url.clone();
        async move {
            let body = json!({"prompt": prompt(i), "max_tokens": 1, "ignore_eos": true});
            let (s, v) = post(&url, &body).await;
            assert_eq!(s, 200, "{v}");
            v["usage"]["prompt_tokens"].as_u64().unwrap()
        }
    };
    let m = metrics_of(&w.url).await;
    assert_eq!(
        sample(&m, CREDIT),
        0.5,
        "the credit starts at half an access"
    );
    assert_eq!((sample(&m, REMOVED), sample(&m, RETURNED)), (0.0, 0.0));

    let tokens = send(0).await;
    assert!(
        tokens >= 48,
        "prompt 0 is {tokens} tokens: three pages at least"
    );
    // One-off prompts until the oldest (prompt 0, on probation: never hit) leaves the tree
    // (a snapshot one step late sends one prompt more: well within what the policy remembers).
    let mut i = 1;
    while sample(&metrics_of(&w.url).await, REMOVED) == 0.0 {
        assert!(i < 40, "nothing removed from 24 pages after {i} prompts");
        send(i).await;
        i += 1;
    }
    let removed = sample(&metrics_of(&w.url).await, REMOVED);
    // It comes back while the policy remembers removing it: a return of its class (what was
    // removed of it: eviction takes only the pages it needs, from a leaf's end).
    send(0).await;
    once(&w.url, RETURNED, |v| v >= 1.0).await;
    let m = metrics_of(&w.url).await;
    assert!(sample(&m, REMOVED) >= removed);
    let credit = sample(&m, CREDIT);
    assert!((0.25..=1.0).contains(&credit), "credit {credit}");
    for class in ["probation", "used"] {
        for what in ["removed", "returned"] {
            let key = format!(r#"strata_cache_auto_{what}_pages_total{{class="{class}"}}"#);
            assert!(sample(&m, &key).is_finite(), "{key} missing");
        }
    }
    w.stop().await;

    // Another policy learns nothing and exports nothing of it.
    let spec = WorkerSpec {
        eviction: EvictionPolicy::Lru,
        ..WorkerSpec::default()
    };
    let w = spawn_worker(&model, spec).await;
    assert!(!metrics_of(&w.url).await.contains("strata_cache_auto_"));
    w.stop().await;
}
