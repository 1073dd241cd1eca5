//! The endpoints around generation on the tiny model: one model by id, tokenize/detokenize,
//! version, request ids echoed or made, completion ids unique, `created` the request's time.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use strata_test_support::{post, spawn_worker, tiny_model, WorkerSpec};

async fn get(url: &str) -> (u16, Value) {
    let r = reqwest::get(url).await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_tokenize_detokenize_version_and_ids() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let u = &w.url;

    let (st, m) = get(&format!("{u}/v1/models/tiny")).await;
    assert_eq!(
        (st, &m["id"], &m["object"]),
        (200, &json!("tiny"), &json!("model"))
    );
    let (st, e) = get(&format!("{u}/v1/models/org/other-model")).await;
    assert_eq!(
        (st, &e["error"]["code"]),
        (404, &json!("model_not_found")),
        "{e}"
    );

    let (st, v) = get(&format!("{u}/version")).await;
    assert_eq!(st, 200);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));

    // Tokenize a prompt and chat messages (rendered as generation would), and back.
    let (st, t) = post(&format!("{u}/tokenize"), &json!({"prompt": "hello world"})).await;
    assert_eq!(st, 200, "{t}");
    let ids: Vec<u32> = serde_json::from_value(t["tokens"].clone()).unwrap();
    assert_eq!(t["count"], ids.len());
    let (st, back) = post(&format!("{u}/detokenize"), &json!({"tokens": ids})).await;
    assert_eq!(
        (st, &back["prompt"]),
        (200, &json!("hello world")),
        "{back}"
    );
    let chat = json!({"messages": [{"role": "user", "content": "hello world"}]});
    let (_, c) = post(&format!("{u}/tokenize"), &chat).await;
    assert!(c["count"].as_u64().unwrap() > ids.len() as u64, "{c}");
    // With tools and a described format: the prompt chat generates from, counted the same.
    let mut with = chat.clone();
    with["tools"] = json!([{"type": "function", "function": {"name": "f",
        "description": "does f", "parameters": {"type": "object"}}}]);
    with["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "a",
        "description": "an answer", "schema": {"type": "object"}}});
    let (st, tools) = post(&format!("{u}/tokenize"), &with).await;
    assert_eq!(st, 200, "{tools}");
    assert!(tools["count"].as_u64() > c["count"].as_u64(), "{tools}");
    let mut gen = with.clone();
    gen["max_tokens"] = json!(1);
    let (st, a) = post(&format!("{u}/v1/chat/completions"), &gen).await;
    // The tiny model's context is shorter than the tools' text: chat's refusal counts it.
    let counted = match st {
        200 => a["usage"]["prompt_tokens"].as_u64(),
        _ => a["error"]["message"].as_str().and_then(|m| {
            m.strip_prefix("the prompt has ")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        }),
    };
    assert_eq!(counted, tools["count"].as_u64(), "{a}");
    // Bad input: out-of-vocabulary ids, unknown fields, neither prompt nor messages.
    for (path, body, param) in [
        ("/detokenize", json!({"tokens": [999_999]}), "tokens"),
        ("/tokenize", json!({"prompt": [999_999]}), "prompt"),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": false}),
            "add_special_tokens",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "add_bos": false}),
            "add_bos",
        ),
        ("/tokenize", json!({}), "prompt"),
        // As chat refuses them: no messages.
        ("/tokenize", json!({"messages": []}), "messages"),
        ("/tokenize", json!({"prompt": "a", "tools": []}), "tools"),
        // A field the body lacks is named.
        ("/v1/chat/completions", json!({"max_tokens": 1}), "messages"),
        ("/v1/completions", json!({"max_tokens": 1}), "prompt"),
    ] {
        let (st, e) = post(&format!("{u}{path}"), &body).await;
        assert_eq!(st, 400, "{path} {body}: {e}");
        if param != "add_bos" {
            assert_eq!(e["error"]["param"], param, "{e}");
        }
    }
    // A body in a content coding is refused (it would be read as plain JSON); identity passes.
    for (coding, want) in [("gzip", 415), ("identity", 200)] {
        let r = reqwest::Client::new()
            .post(format!("{u}/tokenize"))
            .header("content-type", "application/json")
            .header("content-encoding", coding)
            .body(r#"{"prompt": "hi"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), want, "{coding}");
        if want == 415 {
            let e: Value = r.json().await.unwrap();
            assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        }
    }
    // vLLM's fields: the text's own ids without special tokens, each token's text.
    let plain =
        json!({"prompt": "hello world", "add_special_tokens": false, "return_token_strs": true});
    let (_, p) = post(&format!("{u}/tokenize"), &plain).await;
    let own: Vec<u32> = serde_json::from_value(p["tokens"].clone()).unwrap();
    assert!(
        ids.ends_with(&own) && ids.len() - own.len() <= 1,
        "{p} vs {ids:?}"
    );
    assert_eq!(p["token_strs"].as_array().unwrap().len(), own.len(), "{p}");
    let info: serde_json::Value = reqwest::get(format!("{u}/tokenizer_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        info["eos_token"].is_string() && info["model_max_length"].as_u64() > Some(0),
        "{info}"
    );

    // X-Request-Id: echoed when given, made when not.
    let client = reqwest::Client::new();
    let body = json!({"prompt": "hi", "max_tokens": 2, "temperature": 0});
    let r = client
        .post(format!("{u}/v1/completions"))
        .header("x-request-id", "trace-42")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "trace-42");
    let a: Value = r.json().await.unwrap();
    let r = client
        .post(format!("{u}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let made = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(made.len(), 24, "{made}");
    let b: Value = r.json().await.unwrap();
    // Completion ids are random (unique across workers and restarts); created is now.
    assert_ne!(a["id"], b["id"]);
    assert!(a["id"].as_str().unwrap().starts_with("cmpl-"), "{a}");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let created = b["created"].as_u64().unwrap();
    assert!(now - created <= 5, "created {created}, now {now}");

    // echo: the prompt's text first, whole and streamed (as text or as ids); with logprobs in
    // tests/logprobs.rs.
    let url = format!("{u}/v1/completions");
    let echo = json!({"prompt": "hello world", "max_tokens": 3, "temperature": 0,
                      "ignore_eos": true, "echo": true});
    let (st, e) = post(&url, &echo).await;
    assert_eq!(st, 200, "{e}");
    let mut plain = echo.clone();
    plain["echo"] = json!(false);
    let (_, p) = post(&url, &plain).await;
    let completion = p["choices"][0]["text"].as_str().unwrap();
    assert_eq!(e["choices"][0]["text"], format!("hello world{completion}"));
    let mut streamed = echo.clone();
    streamed["stream"] = json!(true);
    let text = strata_test_support::post_text(&url, &streamed).await;
    let first: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .next()
        .unwrap();
    assert_eq!(first["choices"][0]["text"], "hello world", "{text}");
    let ids = json!({"prompt": t["tokens"], "max_tokens": 3, "temperature": 0,
                     "ignore_eos": true, "echo": true});
    let (_, i) = post(&url, &ids).await;
    assert_eq!(i["choices"][0]["text"], e["choices"][0]["text"]);
    w.stop().await;
}
