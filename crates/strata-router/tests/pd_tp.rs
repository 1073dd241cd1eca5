//! Prefill and decode workers of different tensor-parallel sizes: the prefill worker's pages
//! cross in the whole model's layout and the decode worker re-shards them on receipt; the
//! greedy answers are one TP-1 worker's, also when the decode worker holds a prefix and
//! receives only the pages after it.

mod common;
use common::start_router;

use serde_json::{json, Value};
use strata_test_support::{post, spawn_worker, tiny_dsv4_model, tiny_model, WorkerSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_of_different_tp_sizes_answer_as_one_worker() {
    let d = tempfile::tempdir().unwrap();
    across_tp_sizes(&tiny_model(d.path()), &[(2, 1), (1, 2)], Some(32)).await;
}

/// DeepSeek-V4: every rank's copy of every state kind leaves as one (the whole model's
/// layout) and arrives as a copy for each of the decode worker's ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v4_prefill_and_decode_of_different_tp_sizes_answer_as_one_worker() {
    let d = tempfile::tempdir().unwrap();
    across_tp_sizes(&tiny_dsv4_model(d.path()), &[(2, 1), (1, 4)], None).await;
}

/// Greedy answers through PD for each (prefill, decode) TP size pair, against one TP-1
/// worker's; `held`: the prefix tokens the decode worker then holds of a longer prompt
/// (None: any, the rest transferred).
async fn across_tp_sizes(path: &std::path::Path, pairs: &[(usize, usize)], held: Option<u64>) {
    let path = path.to_path_buf();
    let single = spawn_worker(&path, WorkerSpec::default()).await;
    let one = start_router(&[], std::slice::from_ref(&single.url)).await;
    for &(ptp, dtp) in pairs {
        let prefill = spawn_worker(
            &path,
            WorkerSpec {
                tp: ptp,
                ..WorkerSpec::default()
            },
        )
        .await;
        let spec = WorkerSpec {
            tp: dtp,
            kv_listener: true,
            prefill_workers: vec![prefill.url.clone()],
            pd_local_prefill_tokens: 0,
            ..WorkerSpec::default()
        };
        let decode = spawn_worker(&path, spec).await;
        let pd = start_router(
            std::slice::from_ref(&prefill.url),
            std::slice::from_ref(&decode.url),
        )
        .await;
        for start in [10u32, 90, 170] {
            let body = json!({"prompt": (start..start + 45).collect::<Vec<u32>>(),
                              "max_tokens": 12, "temperature": 0, "ignore_eos": true});
            let (st, a): (u16, Value) = post(&format!("{pd}/v1/completions"), &body).await;
            assert_eq!(st, 200, "{a}");
            let (_, b): (u16, Value) = post(&format!("{one}/v1/completions"), &body).await;
            assert_eq!(
                a["choices"][0]["text"], b["choices"][0]["text"],
                "prefill TP {ptp}, decode TP {dtp}, prompt from {start}"
            );
        }
        let snap = decode.state.engine.snapshot();
        assert_eq!(
            snap.transferred_prompt_tokens,
            3 * 45,
            "every prompt went through PD"
        );
        // A longer prompt starting with one the decode worker holds: the prefill worker of
        // the other TP size checks the held prefix and sends only the pages after it.
        let body = json!({"prompt": (10u32..100).collect::<Vec<u32>>(),
                          "max_tokens": 12, "temperature": 0, "ignore_eos": true});
        let (st, a): (u16, Value) = post(&format!("{pd}/v1/completions"), &body).await;
        assert_eq!(st, 200, "{a}");
        let (_, b): (u16, Value) = post(&format!("{one}/v1/completions"), &body).await;
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
        let after = decode.state.engine.snapshot();
        let got = after.pd_held_prompt_tokens - snap.pd_held_prompt_tokens;
        let moved = after.transferred_prompt_tokens - snap.transferred_prompt_tokens;
        assert_eq!(got + moved, 90, "prefill TP {ptp}, decode TP {dtp}");
        if let Some(h) = held {
            assert_eq!(got, h);
        }
        prefill.stop().await;
        decode.stop().await;
    }
    single.stop().await;
}
