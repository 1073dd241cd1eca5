//! Answers: one engine request becomes a JSON body or an SSE stream.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use strata_engine::request::CachedTokens;
use strata_engine::{Event, FinishReason, RequestStream};

use crate::api::Usage;
use crate::error::{engine_error, ApiError};
use crate::state::AppState;
use crate::text::TextStream;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

pub(crate) struct Job {
    pub(crate) kind: Kind,
    /// When the request arrived (TTFT and duration are measured from here).
    pub(crate) started: std::time::Instant,
    pub(crate) id: String,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) stops: Vec<String>,
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

pub(crate) async fn whole_response(
    st: Arc<AppState>,
    mut rs: RequestStream,
    job: Job,
    first: Event,
) -> Result<Response, ApiError> {
    let mut pending = Some(first);
    let mut text = TextStream::new(job.stops.clone());
    let mut out = String::new();
    let mut completion = 0;
    let mut cached = CachedTokens::default();
    let prompt = rs.prompt_tokens;
    let mut last = None;
    let reason = loop {
        let ev = match pending.take() {
            Some(e) => Some(e),
            None => rs.events.recv().await,
        };
        match ev {
            Some(Event::Admitted { cached: c }) => cached = c,
            Some(Event::Kv(_)) => {}
            Some(Event::Token(t)) => {
                completion += 1;
                token_time(&st.metrics, job.started, &mut last);
                out += &text.push(&st.tokenizer, t);
                if text.stopped() {
                    break "stop"; // dropping `rs` cancels the rest
                }
            }
            Some(Event::Done {
                reason,
                completion_tokens,
                cached: c,
                ..
            }) => {
                if let FinishReason::Error(m) = &reason {
                    return Err(engine_error(m));
                }
                if matches!(
                    reason,
                    FinishReason::Aborted | FinishReason::QueueTimeout { .. }
                ) {
                    return Err(ApiError::from_submit(
                        &strata_engine::SubmitError::ShuttingDown,
                    ));
                }
                completion = completion_tokens;
                cached = c;
                out += &text.finish();
                st.metrics.e2e.observe(job.started.elapsed().as_secs_f64());
                break finish_name(&reason, false);
            }
            None => {
                return Err(ApiError::from_submit(
                    &strata_engine::SubmitError::EngineDead("the engine stopped".into()),
                ))
            }
        }
    };
    let usage = Usage::new(prompt, completion, cached.total());
    let choice = match job.kind {
        Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": out},
                              "logprobs": null, "finish_reason": reason}),
        Kind::Completion => {
            json!({"index": 0, "text": out, "logprobs": null, "finish_reason": reason})
        }
    };
    let object = if job.kind == Kind::Chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Ok(Json(json!({
        "id": job.id, "object": object, "created": st.created, "model": st.model_name,
        "choices": [choice], "usage": usage,
    }))
    .into_response())
}

pub(crate) struct Streaming {
    st: Arc<AppState>,
    rs: Option<RequestStream>,
    job: Job,
    text: TextStream,
    completion: usize,
    cached: CachedTokens,
    started: bool,
    done: bool,
    last: Option<std::time::Instant>,
    /// The first event, read before the response started.
    pending: Option<Event>,
}

impl Streaming {
    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> SseEvent {
        let (object, choice) = match self.job.kind {
            Kind::Chat => {
                let delta = match (text, self.started) {
                    (Some(t), false) => json!({"role": "assistant", "content": t}),
                    (Some(t), true) => json!({"content": t}),
                    (None, _) => json!({}),
                };
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
                )
            }
            Kind::Completion => (
                "text_completion",
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
            ),
        };
        let mut v = json!({"id": self.job.id, "object": object, "created": self.st.created,
                           "model": self.st.model_name, "choices": [choice]});
        if self.job.include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    }

    fn usage_chunk(&self) -> SseEvent {
        let object = if self.job.kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let usage = Usage::new(self.rs_prompt(), self.completion, self.cached.total());
        SseEvent::default().data(
            json!({"id": self.job.id, "object": object, "created": self.st.created,
                   "model": self.st.model_name, "choices": [], "usage": usage})
            .to_string(),
        )
    }

    fn rs_prompt(&self) -> usize {
        self.rs.as_ref().map(|r| r.prompt_tokens).unwrap_or(0)
    }

    fn end(&mut self, reason: &str) -> Vec<SseEvent> {
        let mut ev = vec![self.chunk(None, Some(reason))];
        if self.job.include_usage {
            ev.push(self.usage_chunk());
        }
        ev.push(SseEvent::default().data("[DONE]"));
        self.done = true;
        // Dropping the engine stream cancels whatever is left (a stop string was found).
        self.rs = None;
        ev
    }

    /// The SSE events for the next engine event (None: the stream is over).
    async fn next(&mut self) -> Option<Vec<SseEvent>> {
        if self.done {
            return None;
        }
        let ev = match self.pending.take() {
            Some(e) => Some(e),
            None => self.rs.as_mut()?.events.recv().await,
        };
        let mut out = Vec::new();
        match ev {
            Some(Event::Kv(_)) => {}
            Some(Event::Admitted { cached }) => {
                self.cached = cached;
                if self.job.kind == Kind::Chat {
                    out.push(self.chunk(Some(""), None));
                    self.started = true;
                }
            }
            Some(Event::Token(t)) => {
                self.completion += 1;
                token_time(&self.st.metrics, self.job.started, &mut self.last);
                let d = self.text.push(&self.st.tokenizer, t);
                if !d.is_empty() {
                    out.push(self.chunk(Some(&d), None));
                    self.started = true;
                }
                if self.text.stopped() {
                    out.extend(self.end("stop"));
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
                self.st
                    .metrics
                    .e2e
                    .observe(self.job.started.elapsed().as_secs_f64());
                if let FinishReason::Error(m) = &reason {
                    out.push(SseEvent::default().data(engine_error(m).body().to_string()));
                }
                let d = self.text.finish();
                if !d.is_empty() {
                    out.push(self.chunk(Some(&d), None));
                }
                out.extend(self.end(finish_name(&reason, false)));
            }
            None => {
                out.push(
                    SseEvent::default().data(engine_error("the engine stopped").body().to_string()),
                );
                out.push(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
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
    let s = Streaming {
        st,
        text: TextStream::new(job.stops.clone()),
        rs: Some(rs),
        job,
        completion: 0,
        cached: CachedTokens::default(),
        started: false,
        done: false,
        last: None,
        pending: Some(first),
    };
    let events = stream::unfold(s, |mut s| async move { s.next().await.map(|ev| (ev, s)) })
        .flat_map(|v| stream::iter(v.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}
