//! Under prefill/decode disaggregation the prefill worker samples the first token with the
//! request's own parameters: the logit modifiers, log probabilities (the prompt's too) and
//! output constraints give the same answer as one worker doing both.

mod common;
use common::start_router;

use serde_json::{json, Value};
use strata_test_support::{post, spawn_worker, tiny_model, TestWorker, WorkerSpec};

async fn both(path: &std::path::Path) -> TestWorker {
    spawn_worker(path, WorkerSpec::default()).await
}

/// A prefill and a decode worker behind one router, one worker doing both behind another.
struct Setup {
    prefill: TestWorker,
    decode: TestWorker,
    single: TestWorker,
    /// The routers' URLs.
    pd: String,
    one: String,
}

async fn setup(path: &std::path::Path) -> Setup {
    let prefill = both(path).await;
    let spec = WorkerSpec {
        kv_listener: true,
        prefill_workers: vec![prefill.url.clone()],
        ..WorkerSpec::default()
    };
    let decode = spawn_worker(path, spec).await;
    let single = both(path).await;
    let pd = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    let one = start_router(&[], std::slice::from_ref(&single.url)).await;
    Setup {
        prefill,
        decode,
        single,
        pd,
        one,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_honours_the_first_tokens_sampling_and_reports_its_logprobs() {
    let d = tempfile::tempdir().unwrap();
    let Setup {
        prefill,
        decode,
        single,
        pd,
        one,
    } = setup(&tiny_model(d.path())).await;
    // The bias makes token 77 the first choice: only a prefill worker that honours it
    // starts the answer with it.
    let body = json!({"prompt": (10..60).collect::<Vec<u32>>(), "max_tokens": 4,
                      "temperature": 0, "ignore_eos": true, "logprobs": 2,
                      "logit_bias": {"77": 100}, "frequency_penalty": 1.5});
    let (st, a): (u16, Value) = post(&format!("{pd}/v1/completions"), &body).await;
    assert_eq!(st, 200, "{a}");
    let (_, b) = post(&format!("{one}/v1/completions"), &body).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);
    assert_eq!(
        a["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        4,
        "{a}"
    );
    assert!(
        decode.state.engine.snapshot().transferred_prompt_tokens > 0,
        "the request went through PD"
    );
    for w in [prefill, decode, single] {
        w.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_chooses_the_first_token_under_the_output_constraint() {
    let d = tempfile::tempdir().unwrap();
    let Setup {
        prefill,
        decode,
        single,
        pd,
        one,
    } = setup(&tiny_model(d.path())).await;
    let schema = json!({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": false});
    for seed in 0..4 {
        // Sampled at temperature 1 with a seed: PD gives the same answer as one worker only if
        // the prefill worker chose the first token under the same grammar.
        let body = json!({"prompt": (10..60).collect::<Vec<u32>>(), "max_tokens": 40,
                          "temperature": 1.0, "seed": seed, "guided_json": schema});
        let (st, a): (u16, Value) = post(&format!("{pd}/v1/completions"), &body).await;
        assert_eq!(st, 200, "{a}");
        let (_, b) = post(&format!("{one}/v1/completions"), &body).await;
        assert_eq!(
            a["choices"][0]["text"], b["choices"][0]["text"],
            "seed {seed}"
        );
        let text = a["choices"][0]["text"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["n"].is_u64() && v["ok"].is_boolean(), "{text}");
        assert_eq!(a["choices"][0]["finish_reason"], "stop");
    }
    assert!(
        decode.state.engine.snapshot().transferred_prompt_tokens > 0,
        "the requests went through PD"
    );
    for w in [prefill, decode, single] {
        w.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_returns_the_prompts_logprobs_from_the_prefill_worker() {
    let d = tempfile::tempdir().unwrap();
    let Setup {
        prefill,
        decode,
        single,
        pd,
        one,
    } = setup(&tiny_model(d.path())).await;
    for n in [1, 2] {
        let body = json!({"prompt": (10..60).collect::<Vec<u32>>(), "max_tokens": 3, "n": n,
                          "temperature": 0, "ignore_eos": true, "echo": true, "logprobs": 2});
        let (st, a): (u16, Value) = post(&format!("{pd}/v1/completions"), &body).await;
        assert_eq!(st, 200, "{a}");
        let (_, b) = post(&format!("{one}/v1/completions"), &body).await;
        for i in 0..n {
            let (x, y) = (&a["choices"][i]["logprobs"], &b["choices"][i]["logprobs"]);
            assert_eq!(x, y, "n {n}, choice {i}");
            // 50 prompt tokens (the first without a log probability), then 3 generated.
            let lps = x["token_logprobs"].as_array().unwrap();
            assert_eq!(lps.len(), 53, "{x}");
            assert!(lps[0].is_null() && lps[1..].iter().all(|v| v.as_f64() <= Some(0.0)));
        }
    }
    // The first token ends the answer (end of sequence): its entry comes through PD as from
    // one worker.
    let body = json!({"prompt": (70..100).collect::<Vec<u32>>(), "max_tokens": 2,
                      "temperature": 0, "echo": true, "logprobs": 1, "logit_bias": {"259": 100}});
    let (st, a): (u16, Value) = post(&format!("{pd}/v1/completions"), &body).await;
    assert_eq!(st, 200, "{a}");
    let (_, b) = post(&format!("{one}/v1/completions"), &body).await;
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);
    let lps = a["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(lps.len(), 31, "{a}");
    assert!(
        decode.state.engine.snapshot().transferred_prompt_tokens > 0,
        "the requests went through PD"
    );
    for w in [prefill, decode, single] {
        w.stop().await;
    }
}
