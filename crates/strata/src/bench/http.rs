//! The HTTP side of the load generator: streamed requests posted and read (TTFT, gaps,
//! usage, text and tool calls), the client, the progress line.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use futures_util::StreamExt;
use serde_json::Value;
use strata_bench::stats::Outcome;

/// Posts a streaming request; its outcome, its text and the tool calls it made.
pub(crate) async fn stream_post(
    c: &reqwest::Client,
    url: &str,
    body: &Value,
) -> (Outcome, String, Vec<Value>) {
    let t0 = Instant::now();
    match post(c, url, body).await {
        Some(r) => read_stream(r, t0).await,
        None => (Outcome::default(), String::new(), Vec::new()),
    }
}

/// Posts `body`; None (said on stderr) when it failed or was answered with an error status.
async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Option<reqwest::Response> {
    // A pooled connection the server closed while idle fails before the request reaches it
    // (llama.cpp's server closes idle keep-alive connections after 5 s): send once more on a
    // fresh connection. Anything that got an answer is never sent twice.
    let mut tries = 0;
    let r = loop {
        match c.post(url).json(body).send().await {
            Ok(r) => break r,
            Err(e) if tries == 0 && (e.is_request() || e.is_connect()) && e.status().is_none() => {
                tries += 1;
            }
            Err(e) => {
                eprintln!("\nrequest failed: {e}");
                return None;
            }
        }
    };
    if !r.status().is_success() {
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        eprintln!(
            "\nrequest failed: {status}: {}",
            body.chars().take(300).collect::<String>()
        );
        return None;
    }
    Some(r)
}

/// Reads a streamed answer (server-sent events) sent at `t0`: its outcome, text and tool calls
/// (a tool-call delta counts as output, like text).
async fn read_stream(r: reqwest::Response, t0: Instant) -> (Outcome, String, Vec<Value>) {
    let mut o = Outcome::default();
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut last: Option<Instant> = None;
    let mut buf = Vec::new();
    let mut stream = r.bytes_stream();
    let mut done = false;
    while let Some(Ok(chunk)) = stream.next().await {
        buf.extend_from_slice(&chunk);
        while let Some(i) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..i + 2).collect();
            let line = String::from_utf8_lossy(&event);
            let Some(data) = line.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let piece = v["choices"][0]["delta"]["content"]
                .as_str()
                .or(v["choices"][0]["text"].as_str())
                .unwrap_or("");
            let delta_calls = v["choices"][0]["delta"]["tool_calls"].as_array();
            for d in delta_calls.into_iter().flatten() {
                merge_call(&mut calls, d);
            }
            if !piece.is_empty() || delta_calls.is_some_and(|d| !d.is_empty()) {
                let now = Instant::now();
                match last {
                    None => o.ttft = (now - t0).as_secs_f64(),
                    Some(l) => o.itl.push((now - l).as_secs_f64()),
                }
                last = Some(now);
                text.push_str(piece);
            }
            if v["usage"].is_object() {
                o.output_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                o.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                o.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
        }
    }
    if last.is_none() {
        o.ttft = t0.elapsed().as_secs_f64();
    }
    o.ok = done;
    (o, text, calls)
}

/// A progress bar on stderr (one line, redrawn).
pub(crate) struct Progress {
    done: AtomicUsize,
    total: usize,
    label: String,
    t0: Instant,
}

impl Progress {
    pub(crate) fn new(total: usize, label: &str, t0: Instant) -> Progress {
        Progress {
            done: AtomicUsize::new(0),
            total,
            label: label.to_string(),
            t0,
        }
    }

    /// One more request done: the bar redrawn on a terminal, else a line per tenth (a log
    /// file reads it); a stderr that cannot be written loses the progress, nothing else.
    pub(crate) fn tick(&self) {
        use std::io::{IsTerminal, Write};
        let d = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        let total = self.total.max(1);
        let terminal = std::io::stderr().is_terminal();
        if !terminal && d != total && d * 10 / total == (d - 1) * 10 / total {
            return;
        }
        let w = 30;
        let filled = (d * w / total).min(w);
        let line = format!(
            "{} [{}{}] {d}/{} requests, {:.0} s",
            self.label,
            "#".repeat(filled),
            ".".repeat(w - filled),
            self.total,
            self.t0.elapsed().as_secs_f64()
        );
        let mut err = std::io::stderr().lock();
        let _ = match (terminal, d == self.total) {
            (true, false) => write!(err, "\r{line}"),
            (true, true) => writeln!(err, "\r{line}"),
            (false, _) => writeln!(err, "{line}"),
        };
    }
}

pub fn client() -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        // Below the keep-alive timeouts servers commonly use (5 s), so idle connections are
        // dropped here before the server drops them.
        .pool_idle_timeout(Duration::from_secs(4))
        .build()?)
}

/// `rate` POSTs per second (Poisson arrivals) for `seconds` to `url`, the k-th with the body
/// `body(k, r)` (`r`: a random draw for the caller): the latencies (ms) of the successful ones,
/// and how many failed.
pub(crate) async fn poisson_load(
    c: &reqwest::Client,
    url: &str,
    (rate, seconds): (f64, f64),
    mut body: impl FnMut(usize, u64) -> Value,
) -> Result<(Vec<f64>, usize)> {
    let n = (rate * seconds) as usize;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let start = Instant::now();
    let mut at = 0.0f64;
    let mut tasks = Vec::with_capacity(n);
    for k in 0..n {
        let u = ((next() >> 11) as f64 / (1u64 << 53) as f64).max(1e-12);
        at += -u.ln() / rate;
        let b = body(k, next());
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let (c, url) = (c.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = c.post(url).json(&b).send().await?;
            let ok = r.status().is_success();
            r.bytes().await?;
            anyhow::Ok((ok, t.elapsed().as_secs_f64() * 1e3))
        }));
    }
    let mut lat = Vec::new();
    let mut fails = 0;
    for t in tasks {
        match t.await? {
            Ok((true, ms)) => lat.push(ms),
            _ => fails += 1,
        }
    }
    Ok((lat, fails))
}

/// A streamed `tool_calls` delta into the calls so far: one with an `id` begins a call, one
/// without adds to the `function.arguments` of the call at its `index`.
fn merge_call(calls: &mut Vec<Value>, d: &Value) {
    if d.get("id").is_some_and(|i| !i.is_null()) {
        calls.push(d.clone());
        return;
    }
    let piece = d["function"]["arguments"].as_str().unwrap_or("");
    if let Some(c) = calls.iter_mut().rev().find(|c| c["index"] == d["index"]) {
        let args = c["function"]["arguments"]
            .as_str()
            .unwrap_or("")
            .to_string()
            + piece;
        c["function"]["arguments"] = Value::String(args);
    }
}
