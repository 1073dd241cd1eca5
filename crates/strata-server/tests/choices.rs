//! `n` > 1 on the tiny model: n choices cost one prefill (the prompt is computed once, the
//! choices find it cached), seeded choices are reproducible, streaming interleaves the choices
//! and ends once; best_of returns the likeliest of its candidates.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_of_returns_the_likeliest_candidates() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 250).collect();
    // The four candidates of best_of 4 are the four choices of n 4 with the same seed
    // (candidate i samples with seed + i): rank those by mean log probability per token.
    let all = json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3,
                     "ignore_eos": true, "n": 4, "logprobs": 0});
    let (st, a) = post(&url, &all).await;
    assert_eq!(st, 200, "{a}");
    let mut ranked: Vec<(f64, String)> = a["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
            let mean = lps.iter().map(|v| v.as_f64().unwrap()).sum::<f64>() / lps.len() as f64;
            (mean, c["text"].as_str().unwrap().to_string())
        })
        .collect();
    let texts: Vec<String> = ranked.iter().map(|r| r.1.clone()).collect();
    ranked.sort_by(|x, y| y.0.total_cmp(&x.0));
    // (This seed ranks a later candidate second: taking the first two would fail.)
    assert_ne!(ranked[1].1, texts[1]);
    let best = json!({"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3,
                      "ignore_eos": true, "n": 2, "best_of": 4});
    let (st, b) = post(&url, &best).await;
    assert_eq!(st, 200, "{b}");
    let choices = b["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], ranked[i].1, "{b} vs {ranked:?}");
        // Not asked for: not shown (they were only used to rank).
        assert!(c["logprobs"].is_null());
    }
    // Every candidate's tokens count.
    assert_eq!(b["usage"]["completion_tokens"], 24, "{b}");

    let bad = [
        json!({"prompt": "a", "n": 3, "best_of": 2}),
        json!({"prompt": "a", "best_of": 17}),
        json!({"prompt": "a", "best_of": 2, "stream": true}),
    ];
    for body in bad {
        let (st, e) = post(&url, &body).await;
        assert_eq!((st, &e["error"]["param"]), (400, &json!("best_of")), "{e}");
    }
    // Candidates that cannot fit together: the refusal counts them as best_of's.
    let (st, e) = post(
        &url,
        &json!({"prompt": "a", "best_of": 16, "max_tokens": 500}),
    )
    .await;
    let m = e["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(st, 400, "{e}");
    assert!(m.starts_with("best_of = 16 "), "{m}");
    // best_of = n streams (nothing to choose).
    let ok = json!({"prompt": "a", "n": 2, "best_of": 2, "max_tokens": 2, "stream": true});
    assert!(post_text(&url, &ok).await.contains("[DONE]"));
    w.stop().await;
}

/// Huge batches: past 64 prompts, past what the queue takes at once or the in-flight bound, a 400 naming `prompt` before anything runs; the largest batch that
/// fits answers every prompt in order, and the worker keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_batches_are_refused_before_anything_runs() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let ids = |n: usize, len: usize| -> Vec<Vec<u32>> {
        (0..n)
            .map(|p| {
                (0..len)
                    .map(|i| ((p * 31 + i * 7 + 11) % 250) as u32)
                    .collect()
            })
            .collect()
    };
    let before = sample(&metrics_of(&w.url).await, "strata_prompt_tokens_total");
    let cases = [
        (json!({"prompt": ids(65, 3), "max_tokens": 2}), "64"),
        (
            json!({"prompt": ids(64, 200), "max_tokens": 300}),
            "--max-tokens-in-flight",
        ),
    ];
    for (body, names) in cases {
        let (st, e) = post(&url, &body).await;
        assert_eq!((st, &e["error"]["param"]), (400, &json!("prompt")), "{e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(names),
            "{e}"
        );
    }
    let after = sample(&metrics_of(&w.url).await, "strata_prompt_tokens_total");
    assert_eq!(after, before, "nothing ran");
    let (st, a) = post(&url, &json!({"prompt": ids(64, 3), "max_tokens": 2})).await;
    assert_eq!(st, 200, "{a}");
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 64);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    assert_eq!(a["usage"]["prompt_tokens"], 64 * 3);
    w.stop().await;
    // A server that queues 8 requests: 9 prompts are refused, 8 with 3 choices each served.
    let spec = WorkerSpec {
        engine: strata_engine::EngineConfig {
            max_waiting: 8,
            ..Default::default()
        },
        ..WorkerSpec::default()
    };
    let w = spawn_worker(&tiny_model(d.path()), spec).await;
    let url = format!("{}/v1/completions", w.url);
    let (st, e) = post(&url, &json!({"prompt": ids(9, 3), "max_tokens": 2})).await;
    assert_eq!((st, &e["error"]["param"]), (400, &json!("prompt")), "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-waiting 8"),
        "{e}"
    );
    let body = json!({"prompt": ids(8, 3), "max_tokens": 2, "n": 3});
    let (st, a) = post(&url, &body).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["choices"].as_array().unwrap().len(), 24);
    w.stop().await;
}
