//! Answers: one engine request becomes a JSON body or an SSE stream — two renderings of one
//! state machine, [`Answer`], which turns engine events into text deltas and an end (with the
//! usage figures and latency metrics kept on the way).
//!
//! The renderings differ only where HTTP forces them to: an SSE stream has sent its 200
//! before the end is known, so an engine failure or abort becomes an error event and a finish
//! reason (`error`, `abort`); a whole answer has not, so the same ends are a 500 or a 503.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use strata_engine::request::CachedTokens;
use strata_engine::{Event, FinishReason, RequestStream, TokenLogprobs};

use crate::api::Usage;
use crate::error::{engine_error, ApiError};
use crate::state::AppState;
use crate::text::TextStream;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

#[derive(Clone)]
pub(crate) struct Job {
    pub(crate) kind: Kind,
    /// When the request arrived (TTFT and duration are measured from here).
    pub(crate) started: std::time::Instant,
    pub(crate) id: String,
    /// Unix seconds when the request arrived (`created` of every chunk).
    pub(crate) created: u64,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) stops: Vec<String>,
    /// Stop strings count from this many tokens on.
    pub(crate) min_tokens: usize,
    /// The client asked for log probabilities.
    pub(crate) logprobs: bool,
    /// Completions' `echo` with `logprobs`: the prompt's log probabilities go before the
    /// completion's.
    pub(crate) prompt_logprobs: bool,
    /// Completions' `echo`: the prompt's text, before the completion's.
    pub(crate) echo: Option<String>,
    /// Chat with tools: the functions whose calls are parsed out of the answer.
    pub(crate) tools: Option<Vec<String>>,
    /// The calls are forced (`required`, a named function): the answer is calls only, and
    /// a call cut short by `max_tokens` is dropped, never returned as text; and whether only
    /// the first call counts (`parallel_tool_calls: false`).
    pub(crate) tool_rules: crate::tools::CallRules,
}

/// Waits for a request's first event before any status is sent, so that a request refused
/// after submission (queueing-time limit, shutdown, a dead engine) gets its own status and
/// `Retry-After` rather than a 200 stream that ends at once.
pub(crate) async fn first_event(rs: &mut RequestStream) -> Result<Event, ApiError> {
    match rs.events.recv().await {
        Some(Event::Done {
            reason: FinishReason::QueueTimeout { waited },
            ..
        }) => Err(ApiError::queue_timeout(waited)),
        Some(Event::Done {
            reason: FinishReason::Aborted,
            ..
        }) => Err(ApiError::from_submit(
            &strata_engine::SubmitError::ShuttingDown,
        )),
        Some(ev) => Ok(ev),
        None => Err(ApiError::from_submit(
            &strata_engine::SubmitError::EngineDead("the engine stopped".into()),
        )),
    }
}

/// Records a token's latency: TTFT for the first, inter-token latency after.
pub(crate) fn token_time(
    m: &crate::metrics::ServerMetrics,
    started: std::time::Instant,
    last: &mut Option<std::time::Instant>,
) {
    let now = std::time::Instant::now();
    match last {
        None => m.ttft.observe((now - started).as_secs_f64()),
        Some(t) => m.itl.observe((now - *t).as_secs_f64()),
    }
    *last = Some(now);
}

pub(crate) fn finish_name(r: &FinishReason, stopped_by_string: bool) -> &'static str {
    if stopped_by_string {
        return "stop";
    }
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Aborted | FinishReason::QueueTimeout { .. } => "abort",
        FinishReason::Error(_) => "error",
    }
}

/// How an answer ended.
pub(crate) enum End {
    /// The engine finished the request (`true`: a stop string was found first, and the rest
    /// was cancelled).
    Finished(FinishReason, bool),
    /// The engine's channel closed without an end: the engine is gone.
    EngineGone,
}

/// What one engine event means for the client.
pub(crate) enum Step {
    /// The prompt was admitted (the cache served part of it).
    Admitted,
    /// The prompt's log probabilities arrived.
    Prompt,
    /// The engine failed on this request (its end follows).
    Failed(String),
    /// New text (never empty), with the log probabilities of the tokens it completes (when
    /// asked for).
    Text(String, Vec<TokenLogprobs>),
    End(End),
}

/// The one state machine of an answer.
pub(crate) struct Answer {
    st: Arc<AppState>,
    /// None once ended (dropping the engine stream cancels whatever is left).
    rs: Option<RequestStream>,
    /// The first event, read before the response started.
    pending: Option<Event>,
    text: TextStream,
    started: Instant,
    last: Option<Instant>,
    prompt: usize,
    completion: usize,
    cached: CachedTokens,
    /// Log probabilities of tokens whose text is not out yet, and how many went out before
    /// them.
    logprobs: Vec<TokenLogprobs>,
    logprobs_out: usize,
    /// The prompt's log probabilities (requests that asked for them), rendered once.
    prompt_lps: Option<Arc<Value>>,
    /// The request's log line, told of tokens and of the end (None once told).
    log: Option<Arc<crate::request_log::RequestLog>>,
}

impl Answer {
    pub(crate) fn new(st: Arc<AppState>, rs: RequestStream, job: &Job, first: Event) -> Answer {
        Answer {
            st,
            prompt: rs.prompt_tokens,
            rs: Some(rs),
            pending: Some(first),
            text: TextStream::new(job.stops.clone()).with_min_tokens(job.min_tokens),
            started: job.started,
            last: None,
            completion: 0,
            cached: CachedTokens::default(),
            logprobs: Vec::new(),
            logprobs_out: 0,
            prompt_lps: None,
            log: crate::request_log::current(),
        }
    }

    /// Tells the request's log line how this answer ended (once).
    fn log_end(&mut self, finish: &'static str) {
        if let Some(l) = self.log.take() {
            l.ended(self.prompt, self.cached.total(), self.completion, finish);
        }
    }

    /// The prompt's log probabilities, computed by another request and rendered once for all
    /// choices (`n` > 1 computes the prompt once).
    pub(crate) fn with_prompt_logprobs(mut self, p: Option<Arc<Value>>) -> Answer {
        self.prompt_lps = p;
        self
    }

    /// The prompt's log probabilities (completions' shape), once they arrived.
    pub(crate) fn prompt_logprobs(&self) -> Option<&Value> {
        self.prompt_lps.as_deref()
    }

    /// A text step with the log probabilities of the tokens whose text it ends: a token's
    /// entry goes out with the chunk that completes its text, so text held back (a possible
    /// stop string, half a character) holds its tokens' entries too; at the end every entry
    /// left goes (the tokens a stop string cut, and an evaluation's entry for the end token).
    fn text_step(&mut self, d: String) -> Step {
        let n = match self.rs {
            None => self.logprobs.len(),
            Some(_) => {
                (self.text.settled().saturating_sub(self.logprobs_out)).min(self.logprobs.len())
            }
        };
        self.logprobs_out += n;
        Step::Text(d, self.logprobs.drain(..n).collect())
    }

    fn usage(&self) -> Usage {
        Usage::new(self.prompt, self.completion, self.cached.total())
    }

    /// Tokens generated so far (final once ended).
    pub(crate) fn completion_tokens(&self) -> usize {
        self.completion
    }

    /// Prompt tokens the cache served (final once ended).
    pub(crate) fn cached_tokens(&self) -> usize {
        self.cached.total()
    }

    /// The steps of the next engine event (None: the answer has ended).
    pub(crate) async fn next(&mut self) -> Option<Vec<Step>> {
        let ev = match self.pending.take() {
            Some(e) => Some(e),
            None => self.rs.as_mut()?.events.recv().await,
        };
        let mut out = Vec::new();
        match ev {
            Some(Event::Kv(_) | Event::Held { .. }) => {}
            Some(Event::Logprobs(l)) => self.logprobs.push(l),
            Some(Event::PromptLogprobs(p)) => {
                let v = crate::logprobs::render_prompt(&self.st.tokenizer, &p);
                self.prompt_lps = Some(Arc::new(v));
                out.push(Step::Prompt);
            }
            Some(Event::Admitted { cached }) => {
                self.cached = cached;
                out.push(Step::Admitted);
            }
            Some(Event::Token(t)) => {
                self.completion += 1;
                token_time(&self.st.metrics, self.started, &mut self.last);
                if let Some(l) = &self.log {
                    l.token();
                }
                let d = self.text.push(&self.st.tokenizer, t);
                if self.text.stopped() {
                    self.rs = None;
                    self.st
                        .metrics
                        .e2e
                        .observe(self.started.elapsed().as_secs_f64());
                    self.log_end("stop");
                    if !d.is_empty() || !self.logprobs.is_empty() {
                        out.push(self.text_step(d));
                    }
                    out.push(Step::End(End::Finished(FinishReason::Stop, true)));
                } else if !d.is_empty() {
                    out.push(self.text_step(d));
                }
            }
            Some(Event::Done {
                reason,
                completion_tokens,
                cached,
                ..
            }) => {
                self.completion = completion_tokens;
                self.cached = cached;
                match &reason {
                    // The request's duration: to its last token.
                    FinishReason::Stop | FinishReason::Length => {
                        let secs = self.started.elapsed().as_secs_f64();
                        self.st.metrics.e2e.observe(secs);
                    }
                    FinishReason::Error(m) => out.push(Step::Failed(m.clone())),
                    _ => {}
                }
                let d = self.text.finish(&self.st.tokenizer);
                self.rs = None;
                if !d.is_empty() || !self.logprobs.is_empty() {
                    out.push(self.text_step(d));
                }
                self.log_end(finish_name(&reason, false));
                out.push(Step::End(End::Finished(reason, false)));
            }
            None => {
                self.rs = None;
                self.log_end("error");
                out.push(Step::End(End::EngineGone));
            }
        }
        Some(out)
    }
}

impl Drop for Answer {
    /// An answer dropped before its end: the client went away (or another choice failed).
    fn drop(&mut self) {
        self.log_end("cancelled");
    }
}

/// The whole answer as one JSON body (non-streaming requests).
pub(crate) async fn whole_response(
    st: Arc<AppState>,
    rs: RequestStream,
    job: Job,
    first: Event,
) -> Result<Response, ApiError> {
    let mut a = Answer::new(st.clone(), rs, &job, first);
    let (text, reason, lps) = collect(&mut a).await?;
    let prompt = a.prompt_logprobs().cloned();
    let choice = choice_json(&st, &job, 0, &text, reason, &lps, prompt);
    Ok(whole_body(&st, &job, vec![choice], a.usage()))
}

/// Runs an answer to its end: its text, finish reason and log probabilities; the ends a whole
/// answer turns into an error status are errors.
pub(crate) async fn collect(
    a: &mut Answer,
) -> Result<(String, &'static str, Vec<TokenLogprobs>), ApiError> {
    let mut out = String::new();
    let mut lps = Vec::new();
    loop {
        let Some(steps) = a.next().await else {
            unreachable!("an answer ends with an End step");
        };
        for step in steps {
            match step {
                Step::Admitted | Step::Prompt => {}
                Step::Failed(m) => return Err(engine_error(&m)),
                Step::Text(d, l) => {
                    out += &d;
                    lps.extend(l);
                }
                Step::End(End::Finished(
                    FinishReason::Aborted | FinishReason::QueueTimeout { .. },
                    _,
                )) => {
                    return Err(ApiError::from_submit(
                        &strata_engine::SubmitError::ShuttingDown,
                    ))
                }
                Step::End(End::Finished(r, by_string)) => {
                    return Ok((out, finish_name(&r, by_string), lps))
                }
                Step::End(End::EngineGone) => {
                    return Err(ApiError::from_submit(
                        &strata_engine::SubmitError::EngineDead("the engine stopped".into()),
                    ))
                }
            }
        }
    }
}

/// One choice of a whole answer (`prompt`: the prompt's part of its log probabilities).
pub(crate) fn choice_json(
    st: &AppState,
    job: &Job,
    index: usize,
    text: &str,
    reason: &str,
    lps: &[TokenLogprobs],
    prompt: Option<Value>,
) -> Value {
    let tk = &st.tokenizer;
    let logprobs = match (job.logprobs, prompt.filter(|_| job.prompt_logprobs)) {
        (true, Some(p)) => {
            let at = crate::logprobs::after(&p);
            let at = at.unwrap_or(job.echo.as_ref().map_or(0, |e| e.chars().count()));
            let gen = crate::logprobs::render(tk, false, lps, at);
            crate::logprobs::concat(p, gen)
        }
        (true, None) => crate::logprobs::render(tk, job.kind == Kind::Chat, lps, 0),
        (false, _) => Value::Null,
    };
    let echoed;
    let text = match &job.echo {
        Some(e) => {
            echoed = format!("{e}{text}");
            &echoed
        }
        None => text,
    };
    match job.kind {
        Kind::Chat if job.tools.is_some() => {
            let names = job.tools.clone().unwrap_or_default();
            let (content, calls) = crate::tools::parse_all(text, names, job.tool_rules);
            let mut message = json!({"role": "assistant", "content": content});
            let reason = if calls.is_empty() {
                reason
            } else {
                let calls: Vec<Value> = calls.iter().map(|c| c.json()).collect();
                message["tool_calls"] = Value::Array(calls);
                tool_finish(reason)
            };
            json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        }
        Kind::Chat => json!({"index": index, "message": {"role": "assistant", "content": text},
                              "logprobs": logprobs, "finish_reason": reason}),
        Kind::Completion => {
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        }
    }
}

/// The finish reason of an answer that made tool calls: `tool_calls` where it ended normally.
fn tool_finish(reason: &str) -> &str {
    if reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

/// A whole answer's body.
pub(crate) fn whole_body(st: &AppState, job: &Job, choices: Vec<Value>, usage: Usage) -> Response {
    let object = if job.kind == Kind::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Json(json!({
        "id": job.id, "object": object, "created": job.created, "model": st.model_name,
        "choices": choices, "usage": usage,
    }))
    .into_response()
}

/// The last chunk of a stream that asked for usage.
pub(crate) fn usage_event(st: &AppState, job: &Job, usage: Usage) -> SseEvent {
    let object = if job.kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    SseEvent::default().data(
        json!({"id": job.id, "object": object, "created": job.created,
               "model": st.model_name, "choices": [], "usage": usage})
        .to_string(),
    )
}

/// The answer as SSE events (streaming requests): one choice's chunks, and (when it is the only
/// one) the stream's end.
pub(crate) struct Streaming {
    answer: Answer,
    job: Job,
    /// The choice's index.
    index: usize,
    /// This choice ends the stream (usage chunk, `[DONE]`); with several choices the caller
    /// does, once all ended.
    owns_end: bool,
    /// A chat delta with the role was sent.
    started: bool,
    /// Characters before the next token's (completions' `text_offset`): the echo's, then each
    /// token's own text, as a whole answer counts them (text held back for a stop string does
    /// not shift them).
    offset_chars: usize,
    /// Chat with tools: the answer's text → content and calls, and the log probabilities of
    /// text the tool parser holds back (they go with the next chunk, or alone at the end).
    tools: Option<crate::tools::ToolStream>,
    tool_lps: Vec<TokenLogprobs>,
    /// Completions' echo was sent.
    echoed: bool,
}

impl Streaming {
    pub(crate) fn new(answer: Answer, job: Job, index: usize, owns_end: bool) -> Streaming {
        let tools = match job.kind {
            Kind::Chat => job
                .tools
                .clone()
                .map(|n| crate::tools::ToolStream::new(n).ruled(job.tool_rules)),
            Kind::Completion => None,
        };
        Streaming {
            answer,
            job,
            index,
            owns_end,
            started: false,
            offset_chars: 0,
            tools,
            tool_lps: Vec::new(),
            echoed: false,
        }
    }

    /// Tokens this choice generated so far.
    pub(crate) fn completion_tokens(&self) -> usize {
        self.answer.completion_tokens()
    }

    /// Prompt tokens the cache served this choice.
    pub(crate) fn cached_tokens(&self) -> usize {
        self.answer.cached_tokens()
    }

    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> SseEvent {
        self.chunk_with(text, finish, Value::Null)
    }

    fn chunk_with(&self, text: Option<&str>, finish: Option<&str>, logprobs: Value) -> SseEvent {
        match self.job.kind {
            Kind::Chat => {
                let delta = match (text, self.started) {
                    (Some(t), false) => json!({"role": "assistant", "content": t}),
                    (Some(t), true) => json!({"content": t}),
                    (None, _) => json!({}),
                };
                self.envelope(
                    json!({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}),
                )
            }
            Kind::Completion => self.envelope(
                json!({"index": self.index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}),
            ),
        }
    }

    /// One chunk around this choice.
    fn envelope(&self, choice: Value) -> SseEvent {
        let object = match self.job.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut v = json!({"id": self.job.id, "object": object, "created": self.job.created,
                           "model": self.answer.st.model_name, "choices": [choice]});
        if self.job.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    }

    /// The SSE events of one step.
    fn render(&mut self, step: Step, out: &mut Vec<SseEvent>) {
        match step {
            Step::Admitted if self.job.kind == Kind::Chat => {
                out.push(self.chunk(Some(""), None));
                self.started = true;
            }
            Step::Admitted | Step::Prompt => self.echo(out, false),
            Step::Text(d, lps) if self.tools.is_some() => self.render_tools(Some(&d), lps, out),
            Step::Text(d, lps) => {
                let st = &self.answer.st;
                let lp = match self.job.logprobs {
                    true => crate::logprobs::render(
                        &st.tokenizer,
                        self.job.kind == Kind::Chat,
                        &lps,
                        self.offset_chars,
                    ),
                    false => Value::Null,
                };
                // Completions' entries end where the next token's offset is (chat's have none).
                if let Some(end) = crate::logprobs::after(&lp) {
                    self.offset_chars = end;
                }
                out.push(self.chunk_with(Some(&d), None, lp));
                self.started = true;
            }
            Step::Failed(m) => {
                self.echo(out, true);
                out.push(SseEvent::default().data(engine_error(&m).body().to_string()));
            }
            Step::End(End::Finished(reason, by_string)) => {
                self.echo(out, true);
                let mut name = finish_name(&reason, by_string);
                if self.tools.is_some() {
                    self.render_tools(None, Vec::new(), out);
                    if self.tools.as_ref().is_some_and(|t| t.calls > 0) {
                        name = tool_finish(name);
                    }
                }
                out.push(self.chunk(None, Some(name)));
                if self.owns_end && self.job.include_usage {
                    let st = &self.answer.st;
                    out.push(usage_event(st, &self.job, self.answer.usage()));
                }
                if self.owns_end {
                    out.push(SseEvent::default().data("[DONE]"));
                }
            }
            Step::End(End::EngineGone) => {
                let e = engine_error("the engine stopped");
                out.push(SseEvent::default().data(e.body().to_string()));
                if self.owns_end {
                    out.push(SseEvent::default().data("[DONE]"));
                }
            }
        }
    }

    /// Completions' echo, once: at admission, or with the prompt's log probabilities when
    /// they are asked for (they come once the prompt is computed); at the end (`last`) in any
    /// case, without them if they never came (the request failed first).
    fn echo(&mut self, out: &mut Vec<SseEvent>, last: bool) {
        let Some(e) = self.job.echo.clone().filter(|_| !self.echoed) else {
            return;
        };
        let lp = match (self.job.prompt_logprobs, self.answer.prompt_logprobs()) {
            (false, _) => Value::Null,
            (true, Some(p)) => p.clone(),
            (true, None) if last => Value::Null,
            (true, None) => return,
        };
        self.offset_chars += crate::logprobs::after(&lp).unwrap_or(e.chars().count());
        out.push(self.chunk_with(Some(&e), None, lp));
        self.echoed = true;
    }

    /// Chat with tools: text (None: the end) → content chunks and tool-call deltas (a call's
    /// id and name, then its arguments as written); log probabilities go with the next chunk
    /// out (text the parser holds keeps them until then), and at the end any left go alone.
    fn render_tools(&mut self, d: Option<&str>, lps: Vec<TokenLogprobs>, out: &mut Vec<SseEvent>) {
        self.tool_lps.extend(lps);
        let ts = self.tools.as_mut().expect("a chat with tools");
        let outs = match d {
            Some(d) => ts.push(d),
            None => ts.finish(),
        };
        let rendered =
            |lps: Vec<TokenLogprobs>, st: &AppState, on: bool| match on && !lps.is_empty() {
                true => crate::logprobs::render(&st.tokenizer, true, &lps, 0),
                false => Value::Null,
            };
        if d.is_none() && outs.is_empty() && self.job.logprobs && !self.tool_lps.is_empty() {
            let lp = rendered(std::mem::take(&mut self.tool_lps), &self.answer.st, true);
            out.push(self.delta_chunk(json!({}), lp));
        }
        for o in outs {
            let lp = rendered(
                std::mem::take(&mut self.tool_lps),
                &self.answer.st,
                self.job.logprobs,
            );
            match (&o, o.delta_json()) {
                (crate::tools::ToolOut::Content(c), _) => {
                    out.push(self.chunk_with(Some(c), None, lp))
                }
                (_, call) => {
                    let mut delta = json!({"tool_calls": [call]});
                    if !self.started {
                        delta["role"] = json!("assistant");
                    }
                    out.push(self.delta_chunk(delta, lp));
                }
            }
            self.started = true;
        }
    }

    /// A chat chunk with this delta.
    fn delta_chunk(&self, delta: Value, logprobs: Value) -> SseEvent {
        self.envelope(
            json!({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": null}),
        )
    }

    /// The SSE events for the next engine event (None: the stream is over).
    pub(crate) async fn next(&mut self) -> Option<Vec<SseEvent>> {
        let steps = self.answer.next().await?;
        let mut out = Vec::new();
        for step in steps {
            self.render(step, &mut out);
        }
        Some(out)
    }
}

pub(crate) fn stream_response(
    st: Arc<AppState>,
    rs: RequestStream,
    job: Job,
    first: Event,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let s = Streaming::new(Answer::new(st, rs, &job, first), job, 0, true);
    let events = stream::unfold(s, |mut s| async move { s.next().await.map(|ev| (ev, s)) })
        .flat_map(|v| stream::iter(v.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}
