//! The load generator of `strata bench workload` and `strata bench compare`: a workload's
//! requests built and checked before any is sent, then sent (streamed) against one URL, closed
//! loop at a fixed concurrency or open loop at their arrival times.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use strata_bench::stats::Outcome;

pub use crate::bench::http::client;
use crate::bench::http::{stream_post, Progress};
use strata_bench::workload::{
    Agent, AgentTask, Conversation, MultiTurn, Rng, SharedPrefix, TraceReplay,
};

/// What to send: the workload and its shape (shared by `workload` and `compare`).
#[derive(Args, Debug, Clone)]
pub struct WorkloadOpts {
    /// multi-turn, agent, shared-prefix or trace.
    #[arg(long, default_value = "multi-turn")]
    pub workload: String,
    /// Seed of the generators (same seed, same requests).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Let requests stop at the end-of-sequence token (default: every request generates
    /// --max-tokens, so configurations do the same decode work).
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Send each conversation's (agent's) id as `prompt_cache_key`, as a chat client that
    /// names its sessions does (`false`: no key; the cache then cannot retire an answer a
    /// conversation's next turn leaves).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub session_keys: bool,
    /// Open loop instead of closed: Poisson arrivals at this many requests per second
    /// (shared-prefix; a trace has its own arrival times).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Conversations (agents), each with its own turns.
    #[arg(long, default_value_t = 4, help_heading = "multi-turn")]
    pub clients: usize,
    /// Turns per conversation (each appends the answer and a new user turn).
    #[arg(long, default_value_t = 3, help_heading = "multi-turn")]
    pub rounds: usize,
    /// Words of the system prompt every conversation (agent) shares.
    #[arg(long, default_value_t = 200, help_heading = "multi-turn")]
    pub system_words: usize,
    /// Words of each user turn.
    #[arg(long, default_value_t = 20, help_heading = "multi-turn")]
    pub user_words: usize,
    /// Words of each client's first user turn, a document private to it (0: --user-words).
    #[arg(long, default_value_t = 0, help_heading = "multi-turn")]
    pub first_words: usize,
    /// Requests per agent (--clients agents share --system-words and the tools): each but the
    /// last is a forced tool call whose result joins the context; the last answers.
    #[arg(long, default_value_t = 4, help_heading = "agent")]
    pub steps: usize,
    /// Words of each agent's task (its first user turn).
    #[arg(long, default_value_t = 300, help_heading = "agent")]
    pub task_words: usize,
    /// Words of each tool result.
    #[arg(long, default_value_t = 60, help_heading = "agent")]
    pub result_words: usize,
    /// Groups; a group's requests share one long prefix, groups share nothing.
    #[arg(long, default_value_t = 4, help_heading = "shared-prefix")]
    pub groups: usize,
    /// Requests per group (groups interleave, round-robin).
    #[arg(long, default_value_t = 4, help_heading = "shared-prefix")]
    pub per_group: usize,
    /// Words of each group's shared prefix.
    #[arg(long, default_value_t = 300, help_heading = "shared-prefix")]
    pub prefix_words: usize,
    /// Words of each request's own suffix.
    #[arg(long, default_value_t = 10, help_heading = "shared-prefix")]
    pub suffix_words: usize,
    /// Mooncake-format trace (JSONL).
    #[arg(long, help_heading = "trace")]
    pub trace: Option<PathBuf>,
    /// Tokens per hash id in the trace (before --length-scale).
    #[arg(long, default_value_t = 512, help_heading = "trace")]
    pub block_tokens: usize,
    /// Multiplies every prompt and output length (and block size).
    #[arg(long, default_value_t = 0.1, help_heading = "trace")]
    pub length_scale: f64,
    /// Multiplies every arrival time (0.1: ten times faster).
    #[arg(long, default_value_t = 0.01, help_heading = "trace")]
    pub time_scale: f64,
    /// Requests from the start of the trace (0: all).
    #[arg(long, default_value_t = 100, help_heading = "trace")]
    pub limit: usize,
    /// Token ids are drawn below this (the model's vocabulary).
    #[arg(long, default_value_t = 49152, help_heading = "trace")]
    pub vocab: u32,
    /// Send the trace's requests in order under --concurrency, ignoring their arrival times
    /// (what `strata sim` replays, one request after another at concurrency 1).
    #[arg(long, help_heading = "trace")]
    pub closed_loop: bool,
}

/// One request to send.
#[derive(Clone)]
pub enum Job {
    Chat(Vec<Value>),
    /// A prompt of token ids, its max_tokens and its session (a trace's `session_id`).
    Tokens(Vec<u32>, usize, Option<u64>),
}

/// A workload built and checked: the requests, and a line stating every scaling applied.
pub struct Prepared {
    pub name: String,
    /// Requests go at their arrival times (a trace, or --rate), not at a fixed concurrency.
    pub open_loop: bool,
    pub scaling: String,
    pub requests: usize,
    body: Body,
    pub(crate) max_tokens: usize,
    pub(crate) ignore_eos: bool,
    /// Chats and agents send their id as `prompt_cache_key`.
    pub(crate) session_keys: bool,
}

enum Body {
    /// Conversations: each client's turns go in order, each after the previous answer.
    Chats(Vec<Conversation>),
    /// Agents: each one's steps go in order, each after the previous call.
    Agents(Vec<AgentTask>),
    /// Independent requests, with arrival times (µs from the start) in open loop.
    Jobs(Vec<(Job, Option<u64>)>),
}

/// The workload's sizes within what a bench sends (else a count overflowed, or prompts were
/// built until the process was stopped).
fn bounded(w: &WorkloadOpts) -> Result<()> {
    use super::limits::at_most;
    for (flag, v) in [
        ("--clients", w.clients),
        ("--rounds", w.rounds),
        ("--steps", w.steps),
        ("--groups", w.groups),
        ("--per-group", w.per_group),
    ] {
        at_most(flag, v, 100_000)?;
    }
    for (flag, v) in [
        ("--system-words", w.system_words),
        ("--user-words", w.user_words),
        ("--first-words", w.first_words),
        ("--task-words", w.task_words),
        ("--result-words", w.result_words),
        ("--prefix-words", w.prefix_words),
        ("--suffix-words", w.suffix_words),
    ] {
        at_most(flag, v, 1_000_000)?;
    }
    Ok(())
}

/// Builds the workload; every bad parameter is refused here, before any request.
pub fn prepare(w: &WorkloadOpts) -> Result<Prepared> {
    if w.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(r) = w.rate {
        if !(r > 0.0 && r.is_finite()) {
            bail!("--rate {r}: expected requests per second > 0");
        }
    }
    bounded(w)?;
    let (scaling, body) = match w.workload.as_str() {
        "multi-turn" => multi_turn(w)?,
        "agent" => agent(w)?,
        "trace" => trace(w)?,
        "shared-prefix" => shared_prefix(w)?,
        x => bail!("--workload `{x}`: expected multi-turn, agent, shared-prefix or trace"),
    };
    let requests = match &body {
        Body::Chats(c) => c.iter().map(|c| c.user_turns.len()).sum(),
        Body::Agents(a) => a.len() * w.steps,
        Body::Jobs(j) => j.len(),
    };
    let open_loop = matches!(&body, Body::Jobs(j) if j.iter().any(|(_, at)| at.is_some()));
    Ok(Prepared {
        open_loop,
        name: w.workload.clone(),
        scaling,
        requests,
        body,
        max_tokens: w.max_tokens,
        ignore_eos: !w.stop_at_eos,
        session_keys: w.session_keys,
    })
}

/// multi-turn: the conversations, and the scaling line.
fn multi_turn(w: &WorkloadOpts) -> Result<(String, Body)> {
    let m = MultiTurn {
        clients: w.clients,
        rounds: w.rounds,
        system_words: w.system_words,
        user_words: w.user_words,
        first_words: w.first_words,
        max_tokens: w.max_tokens,
        seed: w.seed,
    };
    let convs = m.conversations()?;
    Ok((
        format!(
            "{} clients × {} rounds, system prompt {} words, first turn {} words, later turns {} words",
            w.clients,
            w.rounds,
            w.system_words,
            if w.first_words > 0 { w.first_words } else { w.user_words },
            w.user_words
        ),
        Body::Chats(convs),
    ))
}

/// agent: the agents' tasks and results, and the scaling line.
fn agent(w: &WorkloadOpts) -> Result<(String, Body)> {
    let a = Agent {
        clients: w.clients,
        steps: w.steps,
        system_words: w.system_words,
        task_words: w.task_words,
        result_words: w.result_words,
        seed: w.seed,
    };
    let tasks = a.tasks()?;
    Ok((
        format!(
            "{} agents × {} steps ({} tool calls, then an answer), system prompt {} words + {} tools, task {} words, tool results {} words",
            w.clients,
            w.steps,
            w.steps - 1,
            w.system_words,
            crate::bench::agent::TOOLS,
            w.task_words,
            w.result_words
        ),
        Body::Agents(tasks),
    ))
}

/// trace: the trace's requests at their (scaled) arrival times, and the scaling line.
fn trace(w: &WorkloadOpts) -> Result<(String, Body)> {
    let path = w
        .trace
        .clone()
        .context("--workload trace needs --trace FILE")?;
    let t = TraceReplay {
        path,
        block_tokens: w.block_tokens,
        length_scale: w.length_scale,
        time_scale: w.time_scale,
        vocab: w.vocab,
        limit: w.limit,
        max_tokens: w.max_tokens,
    };
    let jobs = t
        .requests()?
        .into_iter()
        .map(|r| {
            let at = (!w.closed_loop).then_some(r.at_us);
            (Job::Tokens(r.prompt, r.max_tokens, r.session), at)
        })
        .collect::<Vec<_>>();
    let arrivals = if w.closed_loop {
        "in order, closed loop".to_string()
    } else {
        format!("arrival times × {}", w.time_scale)
    };
    Ok((
        format!(
            "lengths × {} (block {} tokens), {arrivals}, first {} requests",
            w.length_scale, w.block_tokens, w.limit
        ),
        Body::Jobs(jobs),
    ))
}

/// shared-prefix: the requests (Poisson arrival times with --rate), and the scaling line.
fn shared_prefix(w: &WorkloadOpts) -> Result<(String, Body)> {
    let s = SharedPrefix {
        groups: w.groups,
        per_group: w.per_group,
        prefix_words: w.prefix_words,
        suffix_words: w.suffix_words,
        max_tokens: w.max_tokens,
        seed: w.seed,
    };
    let mut rng = Rng::new(w.seed ^ 0x5eed);
    let mut at = 0.0f64;
    let jobs = s
        .requests()?
        .into_iter()
        .map(|r| {
            let when = w.rate.map(|rate| {
                at += -(rng.next_f64().max(1e-12)).ln() / rate;
                (at * 1e6) as u64
            });
            let text = format!("{}\n\n{}", r.prefix, r.suffix);
            (
                Job::Chat(vec![json!({"role": "user", "content": text})]),
                when,
            )
        })
        .collect::<Vec<_>>();
    let arrival = match w.rate {
        Some(r) => format!(", Poisson arrivals at {r} req/s"),
        None => String::new(),
    };
    Ok((
        format!(
            "{} groups × {} requests, prefix {} words, suffix {} words{arrival}",
            w.groups, w.per_group, w.prefix_words, w.suffix_words
        ),
        Body::Jobs(jobs),
    ))
}

/// Sends one streaming request; returns its outcome and the generated text.
async fn send(
    c: &reqwest::Client,
    url: &str,
    job: &Job,
    p: &Prepared,
    session: Option<&str>,
) -> (Outcome, String) {
    let (path, mut body) = match job {
        Job::Chat(msgs) => (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": p.max_tokens, "temperature": 0,
                   "ignore_eos": p.ignore_eos,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
        Job::Tokens(t, m, _) => (
            "/v1/completions",
            json!({"prompt": t, "max_tokens": m, "temperature": 0, "ignore_eos": p.ignore_eos,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
    };
    if let Some(k) = session.filter(|_| p.session_keys) {
        body["prompt_cache_key"] = json!(k);
    }
    let (o, text, _) = stream_post(c, &format!("{url}{path}"), &body).await;
    (o, text)
}

/// What one run of a workload gave.
pub struct RunResult {
    pub outcomes: Vec<Outcome>,
    pub wall: f64,
}

/// Runs the workload against `url`: closed loop with `concurrency` requests in flight, or
/// open loop at the prepared arrival times.
pub async fn drive(
    c: &reqwest::Client,
    url: &str,
    p: &Arc<Prepared>,
    concurrency: usize,
    label: &str,
) -> Result<RunResult> {
    super::limits::count("--concurrency", concurrency, super::limits::MAX_CONCURRENCY)?;
    let url = url.trim_end_matches('/').to_string();
    let t0 = Instant::now();
    let prog = Arc::new(Progress::new(p.requests, label, t0));
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let outcomes = match &p.body {
        Body::Chats(convs) => drive_chats(c, &url, p, convs.len(), &prog, &sem).await?,
        Body::Agents(a) => {
            let answer = (p.max_tokens, p.ignore_eos);
            let keys = p.session_keys;
            crate::bench::agent::drive(c, &url, answer, keys, a, &prog, &sem).await?
        }
        Body::Jobs(jobs) => drive_jobs(c, &url, p, jobs, t0, &prog, &sem).await?,
    };
    Ok(RunResult {
        outcomes,
        wall: t0.elapsed().as_secs_f64(),
    })
}

/// Conversations: one task each, its turns in order, each after the previous answer.
async fn drive_chats(
    c: &reqwest::Client,
    url: &str,
    p: &Arc<Prepared>,
    conversations: usize,
    prog: &Arc<Progress>,
    sem: &Arc<tokio::sync::Semaphore>,
) -> Result<Vec<Outcome>> {
    let mut tasks = Vec::new();
    for i in 0..conversations {
        let (c, url, prog, sem, p) = (
            c.clone(),
            url.to_string(),
            prog.clone(),
            sem.clone(),
            p.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let Body::Chats(convs) = &p.body else {
                unreachable!()
            };
            let conv = &convs[i];
            let mut msgs = vec![json!({"role": "system", "content": conv.system})];
            let mut out = Vec::new();
            for turn in &conv.user_turns {
                msgs.push(json!({"role": "user", "content": turn}));
                let permit = sem.acquire().await.expect("semaphore open");
                let key = format!("conversation-{i}");
                let (o, text) = send(&c, &url, &Job::Chat(msgs.clone()), &p, Some(&key)).await;
                drop(permit);
                msgs.push(json!({"role": "assistant", "content": text}));
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
    Ok(outcomes)
}

/// Independent requests: each at its arrival time (open loop), or when a slot is free.
async fn drive_jobs(
    c: &reqwest::Client,
    url: &str,
    p: &Arc<Prepared>,
    jobs: &[(Job, Option<u64>)],
    t0: Instant,
    prog: &Arc<Progress>,
    sem: &Arc<tokio::sync::Semaphore>,
) -> Result<Vec<Outcome>> {
    let mut tasks = Vec::new();
    for (i, (_, when)) in jobs.iter().enumerate() {
        if let Some(us) = when {
            tokio::time::sleep_until((t0 + Duration::from_micros(*us)).into()).await;
        }
        let permit = if when.is_none() {
            Some(sem.clone().acquire_owned().await?)
        } else {
            None
        };
        let (c, url, prog, p) = (c.clone(), url.to_string(), prog.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let Body::Jobs(jobs) = &p.body else {
                unreachable!()
            };
            let key = match jobs[i].0 {
                Job::Tokens(_, _, Some(k)) => Some(format!("session-{k:016x}")),
                _ => None,
            };
            let (o, _) = send(&c, &url, &jobs[i].0, &p, key.as_deref()).await;
            drop(permit);
            prog.tick();
            o
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await?);
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(workload: &str) -> WorkloadOpts {
        WorkloadOpts {
            workload: workload.into(),
            seed: 1,
            max_tokens: 4,
            stop_at_eos: false,
            session_keys: true,
            rate: None,
            clients: 3,
            rounds: 2,
            system_words: 5,
            user_words: 2,
            first_words: 0,
            steps: 3,
            task_words: 4,
            result_words: 2,
            groups: 2,
            per_group: 3,
            prefix_words: 5,
            suffix_words: 1,
            trace: None,
            block_tokens: 16,
            length_scale: 1.0,
            time_scale: 1.0,
            limit: 0,
            vocab: 100,
            closed_loop: false,
        }
    }

    #[test]
    fn prepare_counts_requests_and_refuses_bad_parameters() {
        assert_eq!(prepare(&opts("multi-turn")).unwrap().requests, 6);
        assert_eq!(prepare(&opts("agent")).unwrap().requests, 9);
        assert_eq!(prepare(&opts("shared-prefix")).unwrap().requests, 6);
        let e = |o: WorkloadOpts| prepare(&o).err().unwrap().to_string();
        assert!(e(opts("chat")).contains("--workload `chat`"));
        assert!(e(opts("trace")).contains("--trace FILE"));
        let mut o = opts("shared-prefix");
        o.rate = Some(-1.0);
        assert!(e(o).contains("--rate -1"));
        let mut o = opts("multi-turn");
        o.max_tokens = 0;
        assert!(e(o).contains("--max-tokens"));
    }
}
