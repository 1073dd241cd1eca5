//! Tools on the tiny random-weight model: every tool's schema is checked whatever
//! `tool_choice` says (leniently where nothing enforces it), and a streamed answer with tools
//! carries every token's log probability, as the whole answer does.

use serde_json::{json, Value};
use strata_test_support::{post, post_text, spawn_roomy_worker, sse_events};

fn tool(name: &str, parameters: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": parameters}})
}

fn chat(tools: &Value, choice: Value, extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                       "tools": tools, "tool_choice": choice});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// A broken schema is refused naming its tool under every choice (a named choice checks the
/// tools it does not name too); valid JSON Schema the grammar engine does not implement (a
/// pydantic decimal's look-ahead pattern, `uniqueItems`, `if`, a custom `format`) is served
/// where nothing enforces it and refused where the answer is held to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_schemas_are_checked_under_every_choice() {
    let (_d, w) = spawn_roomy_worker().await;
    let url = format!("{}/v1/chat/completions", w.url);
    let plain = tool(
        "add",
        json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
    );
    let missing = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}});
    let broken = json!([plain, tool("broken", missing)]);
    let unusual = json!([
        plain,
        tool(
            "tag",
            json!({"type": "object", "properties": {
        "price": {"anyOf": [{"type": "number"},
                            {"type": "string", "pattern": "^(?!^[-+.]*$)[+-]?0*\\d*\\.?\\d*$"}]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": true},
        "when": {"type": "string", "format": "my-format"}},
        "patternProperties": {"^x-(?=.)": {"type": "string"}},
        "if": {"required": ["tags"]}, "then": {"required": ["when"]}})
        )
    ]);
    let named = |n: &str| json!({"type": "function", "function": {"name": n}});
    let cases = [
        (&broken, json!("auto"), 400, "tools"),
        (&broken, json!("none"), 400, "tools"),
        (&broken, named("add"), 400, "tools"),
        (&broken, json!("required"), 400, "tool_choice"),
        (&unusual, json!("auto"), 200, ""),
        (&unusual, json!("none"), 200, ""),
        (&unusual, named("add"), 200, ""),
        (&unusual, json!("required"), 400, "tool_choice"),
    ];
    for (tools, choice, want, field) in cases {
        let (st, e) = post(&url, &chat(tools, choice.clone(), json!({}))).await;
        assert_eq!(st, want, "{choice}: {e}");
        if want == 400 {
            assert_eq!(e["error"]["param"], field, "{choice}: {e}");
        }
        if field == "tools" {
            let m = e["error"]["message"].as_str().unwrap();
            assert!(m.starts_with("tools[1].function.parameters: "), "{m}");
        }
    }
    // Sent again (each distinct schema is compiled once), the same answers.
    for _ in 0..2 {
        let (st, a) = post(&url, &chat(&unusual, json!("auto"), json!({}))).await;
        assert_eq!(st, 200, "{a}");
    }
    w.stop().await;
}

/// With tools, a stream's chunks carry every generated token's entry, as the whole answer
/// does, whether the text went out as content, as a call, or was held by the tool parser or
/// a stop string.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_with_tools_has_every_logprob() {
    let (_d, w) = spawn_roomy_worker().await;
    let url = format!("{}/v1/chat/completions", w.url);
    let tools = json!([tool(
        "add",
        json!({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})
    )]);
    for choice in ["auto", "required"] {
        for stop in [json!(null), json!([" ", "e"])] {
            let extra = json!({"max_tokens": 24, "temperature": 0, "ignore_eos": true,
                               "logprobs": true, "stop": stop});
            let body = chat(&tools, json!(choice), extra);
            let (st, a) = post(&url, &body).await;
            assert_eq!(st, 200, "{a}");
            let whole = a["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .clone();
            let n = a["usage"]["completion_tokens"].as_u64().unwrap() as usize;
            assert_eq!(whole.len(), n, "{choice} {stop}: {a}");
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            let text = post_text(&url, &streamed).await;
            let entries: Vec<Value> = sse_events(&text)
                .iter()
                .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
                .flatten()
                .collect();
            assert_eq!(entries, whole, "{choice} {stop}: {text}");
        }
    }
    w.stop().await;
}
