//! `prompt_cache_key` and `user` are honoured through a real worker: a conversation's next turn
//! that continues its previous prompt with another answer than the one the cache holds has
//! that answer retired (counted in `strata_cache_session_retired_tokens_total`); another
//! conversation under the same key, a turn without a key, or one that keeps the answer retire
//! nothing; a key that is not a string is refused naming it.

use serde_json::{json, Value};
use strata_test_support::{metrics_of, post, sample, spawn_worker, tiny_model, WorkerSpec};

const RETIRED: &str = "strata_cache_session_retired_tokens_total";

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// A chat request of `messages` answering `max_tokens` tokens, with `extra` fields.
fn chat(messages: Vec<Value>, max_tokens: usize, extra: Value) -> Value {
    let mut b = json!({"messages": messages, "max_tokens": max_tokens, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_retires_the_answer_its_next_turn_left() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/chat/completions", w.url);
    let retired = || async { sample(&metrics_of(&w.url).await, RETIRED) };
    assert_eq!(retired().await, 0.0);
    let system = json!({"role": "system", "content": "You answer questions about the harbour."});

    // Turn 1 of a conversation, then turn 2 with the answer as the client rewrote it: the
    // prompt continues turn 1's, the cached answer (40 tokens: whole pages of 16) is left.
    for (key, field) in [("conv-a", "prompt_cache_key"), ("alice", "user")] {
        let before = retired().await;
        let first = vec![
            system.clone(),
            user(&format!("When does the ferry leave, {key}?")),
        ];
        let (s, _) = post(&url, &chat(first.clone(), 40, json!({ field: key }))).await;
        assert_eq!(s, 200);
        let mut next = first.clone();
        next.push(json!({"role": "assistant", "content": "At nine."}));
        next.push(user("And the last one?"));
        let (s, _) = post(&url, &chat(next, 1, json!({ field: key }))).await;
        assert_eq!(s, 200);
        let after = retired().await;
        assert!(after >= before + 32.0, "{field}: {before} → {after}");
    }

    // The same flow retires nothing without a key, under another key, or when the second
    // request is another conversation of the same key.
    let before = retired().await;
    let flows: [(&str, Value, Value); 3] = [
        ("no key", json!({}), json!({})),
        (
            "another key",
            json!({"prompt_cache_key": "k1"}),
            json!({"prompt_cache_key": "k2"}),
        ),
        (
            "another chat",
            json!({"user": "bob"}),
            json!({"user": "bob"}),
        ),
    ];
    for (i, (what, a, b)) in flows.into_iter().enumerate() {
        let first = vec![system.clone(), user(&format!("Is the pier open? ({i})"))];
        let (s, _) = post(&url, &chat(first.clone(), 40, a)).await;
        assert_eq!(s, 200, "{what}");
        let mut next = if what == "another chat" {
            vec![system.clone(), user(&format!("Where is the market? ({i})"))]
        } else {
            first
        };
        next.push(json!({"role": "assistant", "content": "Yes."}));
        next.push(user("Thanks."));
        let (s, _) = post(&url, &chat(next, 1, b)).await;
        assert_eq!(s, 200, "{what}");
        assert_eq!(retired().await, before, "{what}");
    }

    // A key that is not a string is a 400 naming it.
    for field in ["prompt_cache_key", "user"] {
        let body = chat(vec![user("hi")], 1, json!({ field: 7 }));
        let (s, v) = post(&url, &body).await;
        assert_eq!(s, 400, "{field}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("string"),
            "{v}"
        );
    }
    w.stop().await;
}
