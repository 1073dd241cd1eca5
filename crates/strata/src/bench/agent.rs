//! The agent workload's runner: each agent's requests go in order, every one with the same
//! tool definitions; a step that must call a tool (`tool_choice: "required"`, so the call is
//! generated under its arguments' grammar) gets the call and its result appended as the
//! assistant's `tool_calls` and a `tool` message, and the last step answers
//! (`tool_choice: "none"`). The context grows by a call and a result per step, as an agent's
//! does, and the shared system prompt and tools are a prefix every agent repeats.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use serde_json::{json, Value};
use strata_bench::stats::Outcome;
use strata_bench::workload::AgentTask;

use crate::bench::http::{stream_post, Progress};

/// How many tools every request carries.
pub const TOOLS: usize = 3;

/// Tokens a tool call may take (its grammar ends it well before: names and bounded strings).
const CALL_TOKENS: usize = 96;

/// The tools every agent has: bounded string arguments, so every call completes.
fn tools() -> Value {
    let tool = |name: &str, what: &str, arg: &str, max: usize| {
        json!({"type": "function", "function": {"name": name, "description": what,
            "parameters": {"type": "object", "properties": {arg: {"type": "string", "maxLength": max}},
                           "required": [arg], "additionalProperties": false}}})
    };
    let t = json!([
        tool(
            "search_docs",
            "Search the project's documentation.",
            "query",
            24
        ),
        tool("read_file", "Read a file of the repository.", "path", 24),
        tool("run_tests", "Run the tests of one target.", "target", 16),
    ]);
    debug_assert_eq!(t.as_array().map(Vec::len), Some(TOOLS));
    t
}

/// One step's request (`answer`: the last step's max_tokens, and whether to ignore EOS).
fn step_body(msgs: &[Value], call: bool, answer: (usize, bool)) -> Value {
    json!({"messages": msgs, "tools": tools(),
           "tool_choice": if call { "required" } else { "none" }, "parallel_tool_calls": false,
           "max_tokens": if call { CALL_TOKENS } else { answer.0 },
           "temperature": 0, "ignore_eos": answer.1,
           "stream": true, "stream_options": {"include_usage": true}})
}

/// Appends a step's call and its result to the conversation: as `tool_calls` and `tool`
/// messages, or (no call parsed) as the text and a user turn.
fn append(msgs: &mut Vec<Value>, text: String, calls: &[Value], result: &str) {
    if calls.is_empty() {
        msgs.push(json!({"role": "assistant", "content": text}));
        msgs.push(json!({"role": "user", "content": format!("Tool output: {result}")}));
        return;
    }
    let history: Vec<Value> = calls
        .iter()
        .map(|c| json!({"id": c["id"], "type": "function", "function": c["function"]}))
        .collect();
    let content = if text.is_empty() {
        Value::Null
    } else {
        json!(text)
    };
    msgs.push(json!({"role": "assistant", "content": content, "tool_calls": history}));
    for c in calls {
        msgs.push(json!({"role": "tool", "tool_call_id": c["id"], "content": result}));
    }
}

/// Runs every agent (one task each, its steps in order) under the concurrency limit.
pub async fn drive(
    c: &reqwest::Client,
    url: &str,
    answer: (usize, bool),
    session_keys: bool,
    agents: &[AgentTask],
    prog: &Arc<Progress>,
    sem: &Arc<tokio::sync::Semaphore>,
) -> Result<Vec<Outcome>> {
    let endpoint = format!("{url}/v1/chat/completions");
    let called = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, a) in agents.iter().enumerate() {
        let called = called.clone();
        let (c, endpoint, prog, sem, a) = (
            c.clone(),
            endpoint.clone(),
            prog.clone(),
            sem.clone(),
            a.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut msgs = vec![
                json!({"role": "system", "content": a.system}),
                json!({"role": "user", "content": a.task}),
            ];
            let mut out = Vec::new();
            for step in 0..=a.results.len() {
                let result = a.results.get(step);
                let mut body = step_body(&msgs, result.is_some(), answer);
                if session_keys {
                    body["prompt_cache_key"] = json!(format!("agent-{i}"));
                }
                let permit = sem.acquire().await.expect("semaphore open");
                let (o, text, calls) = stream_post(&c, &endpoint, &body).await;
                drop(permit);
                if let Some(r) = result {
                    called.fetch_add(usize::from(!calls.is_empty()), Ordering::Relaxed);
                    append(&mut msgs, text, &calls, r);
                }
                out.push(o);
                prog.tick();
            }
            out
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await?);
    }
    let steps: usize = agents.iter().map(|a| a.results.len()).sum();
    eprintln!(
        "agent: {} of {steps} tool steps returned a tool call",
        called.load(Ordering::Relaxed)
    );
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_joins_the_history_as_tool_calls_and_a_tool_answer() {
        let mut msgs = Vec::new();
        let call = json!({"index": 0, "id": "call_1", "type": "function",
                          "function": {"name": "read_file", "arguments": "{\"path\":\"a\"}"}});
        append(&mut msgs, String::new(), &[call], "contents");
        assert_eq!(msgs[0]["content"], Value::Null);
        // The stream's `index` is not part of a history entry.
        assert_eq!(
            msgs[0]["tool_calls"][0],
            json!({"id": "call_1", "type": "function",
                   "function": {"name": "read_file", "arguments": "{\"path\":\"a\"}"}})
        );
        assert_eq!(
            msgs[1],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "contents"})
        );
        // No call parsed: the text and the result as a user turn.
        append(&mut msgs, "cut".into(), &[], "r");
        assert_eq!(msgs[2]["content"], "cut");
        assert_eq!(msgs[3]["role"], "user");
        assert_eq!(tools().as_array().unwrap().len(), TOOLS);
    }
}
