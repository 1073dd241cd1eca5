//! Every listed field that is not simply supported behaves as docs/API.md says, through a real
//! worker: a no-op is accepted with any value, a neutral value of a "neutral values only" field
//! is accepted and any other value refused naming the field, a refused field is refused naming
//! it; an unlisted field is a 400 naming it.

use serde_json::{json, Value};
use strata_server::fields::{Endpoint, Fate, Field, FIELDS, MESSAGE_FIELDS, STREAM_OPTION_FIELDS};
use strata_test_support::{spawn_worker, tiny_model, WorkerSpec};

/// Where a field goes in a request body.
#[derive(Clone, Copy)]
enum Place {
    Top,
    Message,
    StreamOptions,
}

fn base(e: Endpoint) -> Value {
    match e {
        Endpoint::Chat => json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        Endpoint::Completions => json!({"prompt": "hi", "max_tokens": 1}),
    }
}

/// The body with `name: v` in its place, and the name the error must give.
fn with(e: Endpoint, place: Place, name: &str, v: &Value) -> (Value, String) {
    let mut b = base(e);
    match place {
        Place::Top => {
            b[name] = v.clone();
            (b, name.to_string())
        }
        Place::Message => {
            b["messages"][0][name] = v.clone();
            (b, format!("messages[0].{name}"))
        }
        Place::StreamOptions => {
            b["stream"] = json!(true);
            b["stream_options"] = json!({ name: v });
            (b, format!("stream_options.{name}"))
        }
    }
}

/// (status, the error's `param`, the error's message) of a request.
async fn send(c: &reqwest::Client, url: &str, e: Endpoint, body: &Value) -> (u16, Value, String) {
    let path = match e {
        Endpoint::Chat => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    };
    let r = c
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let v = serde_json::from_str::<Value>(&text).unwrap_or(Value::Null);
    let message = v["error"]["message"].as_str().unwrap_or("").to_string();
    (status, v["error"]["param"].clone(), message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_no_op_neutral_and_refused_field_behaves_as_documented() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let c = reqwest::Client::new();
    let tables: [(&[Field], Place); 3] = [
        (FIELDS, Place::Top),
        (MESSAGE_FIELDS, Place::Message),
        (STREAM_OPTION_FIELDS, Place::StreamOptions),
    ];
    let candidates = [
        json!(null),
        json!(false),
        json!(true),
        json!(0),
        json!(1),
        json!(2),
        json!(0.5),
        json!(""),
        json!("x"),
        json!([]),
        json!([1]),
        json!({}),
        json!({"a": 1}),
    ];
    let mut checked = 0;
    for (table, place) in tables {
        for f in table {
            for e in [Endpoint::Chat, Endpoint::Completions] {
                if !f.on.covers(e)
                    || (matches!(place, Place::Message) && e == Endpoint::Completions)
                {
                    continue;
                }
                let name = f.name;
                match f.fate {
                    Fate::Supported => continue,
                    Fate::NoOp(shape, _) => {
                        // Taken with a value of its type, refused naming it with another.
                        for v in &candidates {
                            let (b, at) = with(e, place, name, v);
                            let (st, p, m) = send(&c, &w.url, e, &b).await;
                            if shape.fits(v) {
                                assert_eq!(st, 200, "no-op `{name}` = {v} refused: {m}");
                            } else {
                                assert_eq!((st, p), (400, json!(at)), "`{name}` = {v}: {m}");
                            }
                        }
                    }
                    Fate::Refused(_) => {
                        let (b, at) = with(e, place, name, &json!(1));
                        let (st, p, m) = send(&c, &w.url, e, &b).await;
                        assert_eq!((st, p), (400, json!(at)), "refused `{name}`: {m}");
                    }
                    Fate::Neutral(ok, why) => {
                        for v in &candidates {
                            let (b, at) = with(e, place, name, v);
                            let (st, p, m) = send(&c, &w.url, e, &b).await;
                            if ok(v) {
                                // Not refused for its fate (a value of another type may still
                                // be refused by the body's own type checks).
                                assert!(st == 200 || !m.contains(why), "`{name}` = {v}: {m}");
                            } else {
                                assert_eq!((st, p), (400, json!(at)), "`{name}` = {v}: {m}");
                                assert!(m.contains(why), "`{name}` = {v}: {m}");
                            }
                        }
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "{checked} fields checked");
    let typo = with(Endpoint::Chat, Place::Top, "max_tokns", &json!(3)).0;
    let (st, p, _) = send(&c, &w.url, Endpoint::Chat, &typo).await;
    assert_eq!((st, p), (400, json!("max_tokns")));
    w.stop().await;
}

/// `"stream": null` is `false` (OpenAI's schema allows null); a completions prompt too long
/// for the context is refused naming `prompt` (chat's is `messages`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_stream_is_false_and_a_long_prompt_is_named_by_its_own_field() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let c = reqwest::Client::new();
    for e in [Endpoint::Chat, Endpoint::Completions] {
        let mut b = base(e);
        b["stream"] = Value::Null;
        let (st, _, m) = send(&c, &w.url, e, &b).await;
        assert_eq!(st, 200, "{m}");
    }
    let context = w.state.engine.info().context_length;
    let long: Vec<u32> = (0..context as u32 + 10).map(|i| 10 + i % 50).collect();
    let b = json!({"prompt": long, "max_tokens": 1});
    let (st, p, m) = send(&c, &w.url, Endpoint::Completions, &b).await;
    assert_eq!((st, p), (400, json!("prompt")), "{m}");
    let b =
        json!({"messages": [{"role": "user", "content": "hi ".repeat(context)}], "max_tokens": 1});
    let (st, p, m) = send(&c, &w.url, Endpoint::Chat, &b).await;
    assert_eq!((st, p), (400, json!("messages")), "{m}");
    // A text whose bytes alone say it cannot fit is refused before it is tokenized.
    let huge = "9".repeat(context * 256);
    assert!(w.state.tokenizer.fewest_tokens(&huge) > context);
    for (e, b, field) in [
        (
            Endpoint::Completions,
            json!({"prompt": huge, "max_tokens": 1}),
            "prompt",
        ),
        (
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
            "messages",
        ),
    ] {
        let (st, p, m) = send(&c, &w.url, e, &b).await;
        assert_eq!((st, p), (400, json!(field)), "{m}");
        assert!(m.contains("has at least"), "{m}");
    }
    w.stop().await;
}
