//! `n` > 1 on the tiny model: n choices cost one prefill (the prompt is computed once, the
//! choices find it cached), seeded choices are reproducible, streaming interleaves the choices
//! and ends once.

use serde_json::{json, Value};
use strata_test_support::{
    metrics_of, post, post_text, sample, spawn_worker, tiny_model, WorkerSpec,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let prompt: Vec<u32> = (0..200).map(|i| (i * 7 + 3) % 250).collect();
    let miss = |m: &str| sample(m, "strata_cache_miss_tokens_total");

    let before = miss(&metrics_of(&w.url).await);
    let body = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": true,
                      "n": 4});
    let (st, a) = post(&url, &body).await;
    assert_eq!(st, 200, "{a}");
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        // Greedy: every choice the same.
        assert_eq!(c["text"], choices[0]["text"]);
    }
    assert_eq!(a["usage"]["prompt_tokens"], 200);
    assert_eq!(a["usage"]["completion_tokens"], 20);
    // One prefill: 200 prompt tokens computed once, then at most the last page per choice.
    let computed = miss(&metrics_of(&w.url).await) - before;
    assert!(
        computed <= 200.0 + 4.0 * 16.0,
        "computed {computed} prompt tokens"
    );

    // Seeded sampling: each choice reproducible (seed + index).
    let seeded = json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7,
                        "ignore_eos": true, "n": 3});
    let (_, x) = post(&url, &seeded).await;
    let (_, y) = post(&url, &seeded).await;
    let texts = |v: &Value| -> Vec<Value> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].clone())
            .collect()
    };
    assert_eq!(texts(&x), texts(&y));

    // Streamed: chunks of both choices, one usage chunk, one [DONE].
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                      "n": 2, "stream": true, "stream_options": {"include_usage": true}});
    let text = post_text(&url, &body).await;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1, "{text}");
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let finished: Vec<u64> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .map(|c| c["choices"][0]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(finished.len(), 2, "{text}");
    assert!(finished.contains(&0) && finished.contains(&1));
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 8, "{text}");

    for n in [0, 17] {
        let (st, e) = post(&url, &json!({"prompt": "a", "n": n})).await;
        assert_eq!((st, &e["error"]["param"]), (400, &json!("n")), "{e}");
    }
    w.stop().await;
}
