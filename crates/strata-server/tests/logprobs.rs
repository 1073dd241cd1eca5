//! Log probabilities through the HTTP API on the tiny model: chat and completions, whole and
//! streamed, consistent with the greedy choice; bad combinations refused naming the field.

use serde_json::{json, Value};
use strata_test_support::{post, post_text, spawn_worker, tiny_model, WorkerSpec};

fn sse(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_follow_the_greedy_choice_whole_and_streamed() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let chat_url = format!("{}/v1/chat/completions", w.url);
    let body = json!({"messages": [{"role": "user", "content": "count with me: one two"}],
                      "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": 3});
    let (st, a) = post(&chat_url, &body).await;
    assert_eq!(st, 200, "{a}");
    let content = a["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "{a}");
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the likeliest alternative, with its log probability.
        assert_eq!(e["token"], top[0]["token"], "{e}");
        assert_eq!(e["logprob"], top[0]["logprob"], "{e}");
        let lp = e["logprob"].as_f64().unwrap();
        assert!(
            lp <= 0.0 && lp >= top[2]["logprob"].as_f64().unwrap(),
            "{e}"
        );
        assert!(e["bytes"].is_array());
    }
    // Without logprobs the field is null.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let (_, p) = post(&chat_url, &plain).await;
    assert!(p["choices"][0]["logprobs"].is_null(), "{p}");
    assert_eq!(p["choices"][0]["message"], a["choices"][0]["message"]);

    // Streamed: the same entries, spread over the chunks.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = post_text(&chat_url, &streamed).await;
    let entries: Vec<Value> = sse(&text)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&entries, content, "{text}");

    // Completions: tokens, token_logprobs, top_logprobs, text_offset.
    let (st, c) = post(
        &format!("{}/v1/completions", w.url),
        &json!({"prompt": "one two three", "max_tokens": 5, "temperature": 0,
                "ignore_eos": true, "logprobs": 2}),
    )
    .await;
    assert_eq!(st, 200, "{c}");
    let l = &c["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 5, "{c}");
    assert_eq!(l["token_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2, "{c}");
    let offsets: Vec<u64> = serde_json::from_value(l["text_offset"].clone()).unwrap();
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0,
        "{offsets:?}"
    );

    // Refused: alternatives without logprobs, or too many.
    for (extra, field) in [
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
    ] {
        let mut b = plain.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (st, e) = post(&chat_url, &b).await;
        assert_eq!((st, &e["error"]["param"]), (400, &json!(field)), "{e}");
    }
    w.stop().await;
}
