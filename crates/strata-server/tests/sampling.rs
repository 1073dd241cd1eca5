//! The logit modifiers through the HTTP API on the tiny model: `logit_bias` steers greedy
//! choice, `min_tokens` holds the stop tokens back, the frequency penalty breaks a repetition,
//! and each out-of-range value is a 400 naming its field.

use serde_json::{json, Value};
use strata_test_support::{post, spawn_worker, tiny_model, WorkerSpec};

fn completion(prompt: &[u32], max: usize, extra: Value) -> Value {
    let mut v = json!({"prompt": prompt, "max_tokens": max, "temperature": 0, "ignore_eos": true});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_modifiers_steer_generation_and_bad_values_name_their_field() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let tk = &w.state.tokenizer;
    let prompt: Vec<u32> = (10..40).collect();
    let x = 77u32;

    // A bias of +100 makes a token the greedy choice every time.
    let (st, a) = post(
        &url,
        &completion(&prompt, 8, json!({"logit_bias": {"77": 100}})),
    )
    .await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["choices"][0]["text"], tk.decode(&[x; 8]).unwrap());

    // The frequency penalty lowers it by 2 per use: it stops being chosen every time.
    let (_, b) = post(
        &url,
        &completion(
            &prompt,
            16,
            json!({"logit_bias": {"77": 10}, "frequency_penalty": 2.0}),
        ),
    )
    .await;
    let (_, c) = post(
        &url,
        &completion(&prompt, 16, json!({"logit_bias": {"77": 10}})),
    )
    .await;
    assert_eq!(c["choices"][0]["text"], tk.decode(&[x; 16]).unwrap());
    assert_ne!(b["choices"][0]["text"], c["choices"][0]["text"]);

    // Token 77 as a stop token that the bias makes the first choice: the answer stops at
    // once, unless min_tokens holds it back for three tokens.
    let stop = json!({"logit_bias": {"77": 100}, "stop_token_ids": [x]});
    let (_, e) = post(&url, &completion(&prompt, 8, stop.clone())).await;
    assert_eq!(e["usage"]["completion_tokens"], 0, "{e}");
    assert_eq!(e["choices"][0]["finish_reason"], "stop");
    let mut held = stop;
    held["min_tokens"] = json!(3);
    let (_, f) = post(&url, &completion(&prompt, 8, held)).await;
    assert_eq!(f["usage"]["completion_tokens"], 3, "{f}");
    assert_eq!(f["choices"][0]["finish_reason"], "stop");

    // Out of range: a 400 naming the field; the server keeps serving.
    for (extra, field) in [
        (json!({"logit_bias": {"99999": 1}}), "logit_bias"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        // Another spelling of a token id (its biases would add up past the range).
        (json!({"logit_bias": {"5": 100, "05": 100}}), "logit_bias"),
        (json!({"logit_bias": {"+5": 1}}), "logit_bias"),
        (json!({"logit_bias": {" 5": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"min_tokens": 9}), "min_tokens"),
    ] {
        let (st, e) = post(&url, &completion(&prompt, 8, extra.clone())).await;
        assert_eq!(st, 400, "{extra}: {e}");
        assert_eq!(e["error"]["param"], field, "{extra}: {e}");
    }
    // The value as sent, not as it became in 32 bits (`inf`).
    let (_, e) = post(
        &url,
        &completion(&prompt, 8, json!({"logit_bias": {"5": 1e39}})),
    )
    .await;
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("1000000000000000000000000000000000000000") || msg.contains("1e39"),
        "{e}"
    );
    let (st, _) = post(&url, &completion(&prompt, 2, json!({}))).await;
    assert_eq!(st, 200);
    w.stop().await;
}
