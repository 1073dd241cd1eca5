//! The official `openai` Python client (pinned in scripts/requirements-test.txt, installed by
//! scripts/test.sh) against one worker and against the router in front of a prefill and a
//! decode worker: chat, streaming with usage, logprobs (the prompt's with echo), best_of, sampling fields, documented no-ops,
//! refusals naming their field, unknown fields refused, models, request ids, structured output
//! (20/20 valid at temperature 1) and tool calls; and langchain-openai's `bind_tools`
//! (`tool_choice="required"`) and `with_structured_output` (json_schema, 20/20).

mod common;
use common::start_router;

use std::process::Command;

use strata_test_support::{spawn_worker, tiny_model_with_context, WorkerSpec};

/// Runs the client scripts (the official client's, langchain-openai's) against `base`; fails
/// with their output.
async fn client_checks(base: String, mode: &'static str) {
    for script in [
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py"),
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/langchain_client.py"
        ),
    ] {
        run_script(script, base.clone(), mode).await;
    }
}

async fn run_script(script: &'static str, base: String, mode: &'static str) {
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args([script, &base, "tiny", mode])
            .output()
            .expect("python3 (scripts/test.sh installs it with the openai package)")
    })
    .await
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("No module named"),
        "a Python package is missing: pip install -r scripts/requirements-test.txt (scripts/test.sh does)\n{text}"
    );
    assert!(
        out.status.success() && text.contains("all checks passed"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_against_a_worker_and_the_pd_router() {
    let d = tempfile::tempdir().unwrap();
    let path = tiny_model_with_context(d.path(), 4096);
    let single = spawn_worker(&path, WorkerSpec::default()).await;
    client_checks(single.url.clone(), "single").await;

    let prefill = spawn_worker(&path, WorkerSpec::default()).await;
    let spec = WorkerSpec {
        kv_listener: true,
        prefill_workers: vec![prefill.url.clone()],
        ..WorkerSpec::default()
    };
    let decode = spawn_worker(&path, spec).await;
    let r = start_router(
        std::slice::from_ref(&prefill.url),
        std::slice::from_ref(&decode.url),
    )
    .await;
    client_checks(r, "pd").await;
    assert!(decode.state.engine.snapshot().transferred_prompt_tokens > 0);
    for w in [single, prefill, decode] {
        w.stop().await;
    }
}
