//! Log probabilities through the HTTP API on the tiny model: chat and completions, whole and
//! streamed, consistent with the greedy choice; bad combinations refused naming the field.

use serde_json::{json, Value};
use strata_test_support::{
    metrics_of, post, post_text, sample, spawn_worker, sse_events, tiny_model, WorkerSpec,
};

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
    // Each entry's bytes are its token's own: a whole text's UTF-8, or for a part of a
    // character (its `token` alone is `�`) the part's bytes, never the encoding of `�`.
    let entries = content.iter().chain(
        content
            .iter()
            .flat_map(|e| e["top_logprobs"].as_array().unwrap().iter()),
    );
    for e in entries {
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        match e["token"].as_str().unwrap() {
            "\u{fffd}" => assert!(
                !bytes.is_empty() && std::str::from_utf8(&bytes).is_err(),
                "{e}"
            ),
            t => assert_eq!(bytes, t.as_bytes(), "{e}"),
        }
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
    let entries: Vec<Value> = sse_events(&text)
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

/// Completions' `logprobs` as one list of (token, logprob) pairs.
fn entries(l: &Value) -> Vec<(String, Value)> {
    let tokens = l["tokens"].as_array().unwrap();
    let lps = l["token_logprobs"].as_array().unwrap();
    assert_eq!(tokens.len(), lps.len());
    assert_eq!(l["top_logprobs"].as_array().unwrap().len(), tokens.len());
    assert_eq!(l["text_offset"].as_array().unwrap().len(), tokens.len());
    tokens
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .zip(lps.iter().cloned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_scores_the_prompt_whole_streamed_and_per_choice() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let prompt = "one two three four five";
    let body = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0,
                      "ignore_eos": true, "echo": true, "logprobs": 2});
    let (st, a) = post(&url, &body).await;
    assert_eq!(st, 200, "{a}");
    let c = &a["choices"][0];
    let l = &c["logprobs"];
    let all = entries(l);
    let n_prompt = a["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(all.len(), n_prompt + 3, "{a}");
    // The tokens spell the echoed text and the completion; offsets are where each starts.
    let text: String = all.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(text, c["text"].as_str().unwrap());
    assert!(text.starts_with(prompt));
    let offsets: Vec<usize> = serde_json::from_value(l["text_offset"].clone()).unwrap();
    let mut at = 0;
    for (o, e) in offsets.iter().zip(&all) {
        assert_eq!(*o, at);
        at += e.0.chars().count();
    }
    // The first prompt token has nothing before it; every other one has its log probability
    // and two alternatives, the likeliest at least as likely as the token itself.
    assert!(all[0].1.is_null() && l["top_logprobs"][0].is_null(), "{l}");
    for i in 1..all.len() {
        let lp = all[i].1.as_f64().unwrap();
        let top = l["top_logprobs"][i].as_object().unwrap();
        // (Keyed by text: two alternatives that decode alike, e.g. two halves of a character,
        // are one key.)
        assert!((1..=2).contains(&top.len()), "{l}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(lp <= 0.0 && lp <= best + 1e-6, "{i}: {l}");
    }
    // The completion's part equals a request without echo (whose prompt came from the cache).
    let mut plain = body.clone();
    plain["echo"] = json!(false);
    let (_, p) = post(&url, &plain).await;
    let gen = entries(&p["choices"][0]["logprobs"]);
    assert!(p["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    for (x, y) in all[n_prompt..].iter().zip(&gen) {
        assert_eq!(x.0, y.0);
        assert!((x.1.as_f64().unwrap() - y.1.as_f64().unwrap()).abs() < 1e-4);
    }
    // Computed whole: not served from the cache.
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, again) = post(&url, &body).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{again}"
    );
    assert_eq!(again["choices"][0]["logprobs"], *l);

    // Streamed: the echo chunk carries the prompt's entries; all chunks together equal the
    // whole answer's.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_events(&post_text(&url, &streamed).await);
    assert_eq!(chunks[0]["choices"][0]["text"], prompt);
    assert_eq!(
        entries(&chunks[0]["choices"][0]["logprobs"]).len(),
        n_prompt
    );
    let joined: Vec<(String, Value)> = chunks
        .iter()
        .filter(|c| c["choices"][0]["logprobs"].is_object())
        .flat_map(|c| entries(&c["choices"][0]["logprobs"]))
        .collect();
    assert_eq!(joined, all);

    // n = 2: the prompt is scored once, and both choices carry it.
    let mut two = body.clone();
    two["n"] = json!(2);
    let (st, t) = post(&url, &two).await;
    assert_eq!(st, 200, "{t}");
    for i in 0..2 {
        let e = entries(&t["choices"][i]["logprobs"]);
        assert_eq!(e[..n_prompt], all[..n_prompt], "choice {i}");
    }

    // An evaluation harness's loglikelihood call: token ids, one token, one alternative.
    let ids = json!({"prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "temperature": 0,
                     "echo": true, "logprobs": 1});
    let (st, e) = post(&url, &ids).await;
    assert_eq!(st, 200, "{e}");
    assert_eq!(entries(&e["choices"][0]["logprobs"]).len(), 6, "{e}");
    // lm-eval's default shape, one list of token ids in a list: the same answer.
    let mut listed = ids.clone();
    listed["prompt"] = json!([[5, 6, 7, 8, 9]]);
    let (st, l) = post(&url, &listed).await;
    assert_eq!(st, 200, "{l}");
    assert_eq!(l["choices"][0]["logprobs"], e["choices"][0]["logprobs"]);
    // A batch (lm-eval with a batch size): each prompt's choice is its answer alone.
    listed["prompt"] = json!([[5, 6], [7, 8]]);
    let (st, l) = post(&url, &listed).await;
    assert_eq!(st, 200, "{l}");
    for (i, one) in [[5, 6], [7, 8]].iter().enumerate() {
        let mut alone = ids.clone();
        alone["prompt"] = json!(one);
        let (_, a) = post(&url, &alone).await;
        assert_eq!(l["choices"][i]["index"], i, "{l}");
        assert_eq!(
            l["choices"][i]["logprobs"], a["choices"][0]["logprobs"],
            "prompt {i}"
        );
    }

    // A batch of fresh prompts computes each prompt once (not once more for its choice).
    let fresh: Vec<Vec<u32>> = (0..3)
        .map(|p| (0..40).map(|i| (p * 41 + i * 13 + 101) % 250).collect())
        .collect();
    let miss = || async { sample(&metrics_of(&w.url).await, "strata_cache_miss_tokens_total") };
    let before = miss().await;
    let batch = json!({"prompt": fresh, "max_tokens": 2, "temperature": 0});
    let (st, b) = post(&url, &batch).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["usage"]["prompt_tokens"], 120, "{b}");
    assert_eq!(miss().await - before, 120.0, "{b}");
    // Again: served from the cache but each prompt's last page, and usage says so.
    let (_, b) = post(&url, &batch).await;
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
        "{b}"
    );

    // The model's next token ends the answer (end of sequence): the harness still gets its
    // entry, after the prompt's (it sums the entries after the context but the last).
    let mut eos = ids.clone();
    eos["logit_bias"] = json!({"259": 100});
    let (st, e) = post(&url, &eos).await;
    assert_eq!(st, 200, "{e}");
    assert_eq!(e["usage"]["completion_tokens"], 0, "{e}");
    assert_eq!(e["choices"][0]["finish_reason"], "stop", "{e}");
    let l = &e["choices"][0]["logprobs"];
    assert_eq!(entries(l).len(), 6, "{e}");
    assert!(l["token_logprobs"][5].as_f64().unwrap() > -0.01, "{e}");

    // vLLM's prompt_logprobs shape is refused, naming the way that works.
    let mut v = plain.clone();
    v["prompt_logprobs"] = json!(0);
    let (st, e) = post(&url, &v).await;
    assert_eq!(
        (st, &e["error"]["param"]),
        (400, &json!("prompt_logprobs")),
        "{e}"
    );
    w.stop().await;
}

/// A stop string holds text back; the entries of its tokens wait with it. Each streamed
/// entry comes with (or after) the text of its token, never before it; all of them together,
/// offsets included, are the whole answer's, which covers every generated token (the ones the
/// stop string cut too, as `usage` counts them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_logprobs_wait_for_text_a_stop_string_holds() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let free = json!({"prompt": "one two three", "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true, "logprobs": 1});
    let (st, f) = post(&url, &free).await;
    assert_eq!(st, 200, "{f}");
    let tokens: Vec<String> = entries(&f["choices"][0]["logprobs"])
        .into_iter()
        .map(|e| e.0)
        .collect();
    // A stop string that starts inside one token (its last character, held back when it
    // comes) and ends with the next token: the first such pair whose texts are whole
    // characters and whose stop string is not met earlier.
    let whole: String = tokens.concat();
    let (k, stop) = (1..tokens.len() - 1)
        .find_map(|k| {
            let (a, b) = (&tokens[k], &tokens[k + 1]);
            let last = a.chars().last()?;
            let stop = format!("{last}{b}");
            let at: usize =
                tokens[..k].iter().map(|t| t.len()).sum::<usize>() + a.len() - last.len_utf8();
            let plain = |t: &str| !t.is_empty() && !t.contains('\u{fffd}');
            (plain(a) && plain(b) && whole.find(&stop) == Some(at)).then_some((k, stop))
        })
        .unwrap_or_else(|| panic!("no stop string to hold back in {tokens:?}"));
    let mut body = free.clone();
    body["stop"] = json!([stop]);
    body["max_tokens"] = json!(k + 4);
    let (st, a) = post(&url, &body).await;
    assert_eq!(st, 200, "{a}");
    let c = &a["choices"][0];
    assert_eq!(c["finish_reason"], "stop", "{a}");
    let all = entries(&c["logprobs"]);
    assert_eq!(
        all.len(),
        k + 2,
        "every generated token, the stop's too: {a}"
    );
    assert_eq!(a["usage"]["completion_tokens"], k + 2, "{a}");
    let text = c["text"].as_str().unwrap();
    assert_eq!(format!("{text}{stop}"), tokens[..k + 2].concat());

    body["stream"] = json!(true);
    let chunks = sse_events(&post_text(&url, &body).await);
    // (sent, said) after each chunk: the text so far, and the texts of the entries so far.
    let mut seen = Vec::new();
    let (mut sent, mut said) = (String::new(), String::new());
    for ch in &chunks {
        let choice = &ch["choices"][0];
        sent += choice["text"].as_str().unwrap_or("");
        if choice["logprobs"].is_object() {
            for e in entries(&choice["logprobs"]) {
                said += &e.0;
            }
        }
        seen.push((sent.clone(), said.clone()));
    }
    // The last entries (the stop string's tokens) come with the end; every earlier entry
    // came with its text or after it.
    let last = seen.iter().position(|(_, s)| *s == said).unwrap();
    for (sent, said) in &seen[..last] {
        assert!(
            sent.starts_with(said),
            "an entry before its text: {said:?} / {sent:?}"
        );
    }
    assert!(format!("{sent}{stop}").starts_with(&said), "{said:?}");
    assert_eq!(sent, text);
    let joined: Vec<Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["logprobs"])
        .filter(|l| l.is_object())
        .flat_map(|l| {
            let n = l["tokens"].as_array().unwrap().len();
            (0..n).map(|i| json!([l["tokens"][i], l["token_logprobs"][i], l["text_offset"][i]]))
        })
        .collect();
    let whole_entries: Vec<Value> = (0..all.len())
        .map(|i| {
            let l = &c["logprobs"];
            json!([l["tokens"][i], l["token_logprobs"][i], l["text_offset"][i]])
        })
        .collect();
    assert_eq!(joined, whole_entries);
    w.stop().await;
}

/// With a character split over prompt tokens (each part's text `�`), the completion's offsets
/// go on from the prompt's, whole and streamed: they never go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_offsets_go_on_past_a_split_character() {
    let d = tempfile::tempdir().unwrap();
    let w = spawn_worker(&tiny_model(d.path()), WorkerSpec::default()).await;
    let url = format!("{}/v1/completions", w.url);
    let body = json!({"prompt": "tea 🙂 time", "max_tokens": 4, "temperature": 0,
                      "ignore_eos": true, "echo": true, "logprobs": 1});
    let (st, a) = post(&url, &body).await;
    assert_eq!(st, 200, "{a}");
    let l = &a["choices"][0]["logprobs"];
    let all = entries(l);
    assert!(
        all.iter().any(|e| e.0 == "\u{fffd}"),
        "no split character: {l}"
    );
    let offsets: Vec<usize> = serde_json::from_value(l["text_offset"].clone()).unwrap();
    let mut at = 0;
    for (o, e) in offsets.iter().zip(&all) {
        assert_eq!(*o, at, "{l}");
        at += e.0.chars().count();
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let joined: Vec<Value> = sse_events(&post_text(&url, &streamed).await)
        .iter()
        .map(|c| &c["choices"][0]["logprobs"])
        .filter(|l| l.is_object())
        .flat_map(|l| l["text_offset"].as_array().unwrap().clone())
        .collect();
    assert_eq!(joined, l["text_offset"].as_array().unwrap().clone());
    w.stop().await;
}
