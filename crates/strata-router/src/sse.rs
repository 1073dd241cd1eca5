//! A worker's SSE answer relayed under guard. The stream passes through as it comes; if the
//! worker's connection breaks, the stream ends before the answer's last event, the worker
//! stays silent for the router's `stream_idle` (a live worker sends a comment every 15 s), or
//! the answer outlasts `request_timeout` (a wedged worker whose keep-alive comments still flow
//! is cut there), the client gets an error event in the API's own shape and a clean end, so
//! that no client takes a truncated answer for a whole one. Once the answer's end has been
//! relayed, whatever follows (a reset, silence) ends the stream quietly.
//!
//! The answer's end is read from its lines, whatever the chunking: the line `data: [DONE]`
//! for chat and completions; for `/v1/responses`, the blank line that closes a
//! `response.completed`, `response.incomplete`, `response.failed` or `error` event.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use futures_util::StreamExt;
use strata_server::ApiError;

use crate::state::RouterState;
use crate::worker::InFlight;

/// Which API's stream: how it ends, and how an error is said in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `/v1/chat/completions`, `/v1/completions`: `data:` lines, then `data: [DONE]`.
    Chat,
    /// `/v1/responses`: `event:` / `data:` pairs, the last a terminal event.
    Responses,
}

/// The longest line start kept: enough for every marker.
const LINE: usize = 40;

impl Dialect {
    /// What a client gets when the worker's stream broke before its end: an error in the API's
    /// shape (then `[DONE]` for chat). A blank line first: the break may have cut an event in
    /// the middle of its line.
    /// `events`: how many events the client has had (the Responses error's `sequence_number`).
    pub fn broken_tail(self, why: &str, events: u64) -> Bytes {
        let message = format!("the worker's stream broke before the end of the answer: {why}");
        match self {
            Dialect::Chat => {
                let e = ApiError::new(StatusCode::BAD_GATEWAY, "server_error", message);
                Bytes::from(format!("\n\ndata: {}\n\ndata: [DONE]\n\n", e.body()))
            }
            Dialect::Responses => {
                let e = serde_json::json!({
                    "type": "error", "code": "server_error", "message": message, "param": null,
                    "sequence_number": events,
                });
                Bytes::from(format!("\n\nevent: error\ndata: {e}\n\n"))
            }
        }
    }
}

/// Reads a stream's lines (only their first [`LINE`] bytes) to tell whether its end was seen.
#[derive(Debug)]
pub struct EndOfAnswer {
    dialect: Dialect,
    line: Vec<u8>,
    /// The event being read is a terminal one (`Responses`).
    terminal: bool,
    done: bool,
    /// `event:` lines read (`Responses`: the next event's sequence number).
    events: u64,
    /// The last line read was blank (an event is closed: nothing is pending for a client).
    blank: bool,
}

impl EndOfAnswer {
    pub fn new(dialect: Dialect) -> EndOfAnswer {
        EndOfAnswer {
            dialect,
            line: Vec::with_capacity(LINE),
            terminal: false,
            done: false,
            events: 0,
            blank: true,
        }
    }

    /// Whether the bytes read so far end with a closed event (a blank line), so that a client
    /// has dispatched everything it was sent.
    pub fn closed(&self) -> bool {
        self.blank && self.line.is_empty()
    }

    /// How many events were read.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Whether the answer's end has been seen, its line ended.
    pub fn ended(&self) -> bool {
        self.done
    }

    /// Whether the answer's end has been seen, or would be if the stream stopped here (a last
    /// `data: [DONE]` with no newline yet).
    pub fn done(&self) -> bool {
        self.done || (self.dialect == Dialect::Chat && self.line_is_done())
    }

    fn line_is_done(&self) -> bool {
        self.line.strip_suffix(b"\r").unwrap_or(&self.line) == b"data: [DONE]"
    }

    /// Reads the next bytes of the stream.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let (part, rest, ended) = match bytes.iter().position(|&b| b == b'\n') {
                Some(i) => (&bytes[..i], &bytes[i + 1..], true),
                None => (bytes, &bytes[..0], false),
            };
            let room = LINE - self.line.len();
            self.line.extend_from_slice(&part[..part.len().min(room)]);
            if ended {
                self.line_ended();
            }
            bytes = rest;
        }
    }

    fn line_ended(&mut self) {
        let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        self.blank = line.is_empty();
        match self.dialect {
            Dialect::Chat => self.done |= self.line_is_done(),
            Dialect::Responses if line.is_empty() => self.done |= self.terminal,
            Dialect::Responses => {
                if let Some(kind) = line.strip_prefix(b"event:") {
                    self.events += 1;
                    let kind = kind.strip_prefix(b" ").unwrap_or(kind);
                    self.terminal = matches!(
                        kind,
                        b"response.completed"
                            | b"response.incomplete"
                            | b"response.failed"
                            | b"error"
                    );
                }
            }
        }
        self.line.clear();
    }
}

/// How a worker's stream stopped before the answer's end.
enum Broke {
    Ended,
    Lost(reqwest::Error),
    Total(std::time::Duration),
    Silent(std::time::Duration),
}

impl Broke {
    /// What the client is told (and the log says).
    fn why(self) -> String {
        let warn = |what: &str| {
            tracing::warn!(
                "a worker's stream {what}; ending the client's stream with an error event"
            )
        };
        match self {
            Broke::Ended => "it ended before the answer's last event".to_string(),
            Broke::Lost(e) => {
                warn(&format!("broke ({e})"));
                "connection lost".to_string()
            }
            Broke::Total(t) => {
                warn("outlasted --request-timeout");
                format!(
                    "the answer took longer than the router's {:.1} s",
                    t.as_secs_f64()
                )
            }
            Broke::Silent(t) => {
                warn("went silent");
                format!("no data from the worker for {:.1} s", t.as_secs_f64())
            }
        }
    }
}

/// The worker's SSE body `upstream`, relayed under guard (module doc); `keep` (the in-flight
/// guard) lives as long as the stream, and a stream that breaks counts a failure on its worker.
pub fn guard<S>(
    upstream: S,
    dialect: Dialect,
    keep: InFlight,
    st: Arc<RouterState>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>>
where
    S: futures_util::Stream<Item = Result<Bytes, reqwest::Error>> + Send + Unpin + 'static,
{
    struct G<S> {
        up: S,
        end: EndOfAnswer,
        over: bool,
        keep: InFlight,
        st: Arc<RouterState>,
        deadline: tokio::time::Instant,
    }
    let g = G {
        up: upstream,
        end: EndOfAnswer::new(dialect),
        over: false,
        keep,
        deadline: tokio::time::Instant::now() + st.request_timeout,
        st,
    };
    futures_util::stream::unfold(g, move |mut g| async move {
        if g.over {
            return None;
        }
        // The whole answer is out: nothing the worker sends after it is relayed (an end, a
        // reset or silence after it is no error). A `[DONE]` line not yet closed by a blank
        // line is closed here, or a client's parser would drop it.
        let finish = |mut g: G<S>| {
            g.over = true;
            let close = dialect == Dialect::Chat && !g.end.closed();
            close.then(|| (Ok(Bytes::from_static(b"\n\n")), g))
        };
        if g.end.ended() {
            return finish(g);
        }
        use crate::upstream::{next_within, Within};
        let idle = g.st.stream_idle;
        let why = match next_within(g.deadline, idle, g.up.next()).await {
            Within::Next(Some(Ok(b))) => {
                g.end.feed(&b);
                return Some((Ok(b), g));
            }
            _ if g.end.done() => return finish(g),
            Within::Next(None) => Broke::Ended,
            Within::Next(Some(Err(e))) => Broke::Lost(e),
            Within::Total => Broke::Total(g.st.request_timeout),
            Within::Idle => Broke::Silent(idle),
        }
        .why();
        g.st.front.upstream_errors[2].fetch_add(1, Ordering::Relaxed);
        g.keep.failed();
        g.over = true;
        Some((Ok(dialect.broken_tail(&why, g.end.events())), g))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"data: [DONE]\"}}]}\n\n: keep-alive\n\ndata: [DONE]\n\n";
    const RESPONSES: &[u8] = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent: response.output_text.delta\ndata: {\"delta\":\"event: error\\n\\n\"}\n\n: keep-alive\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{}}\n\n";

    fn done_after(d: Dialect, chunks: &[&[u8]]) -> bool {
        let mut e = EndOfAnswer::new(d);
        chunks.iter().for_each(|c| e.feed(c));
        e.done()
    }

    #[test]
    fn the_end_is_seen_whatever_the_chunking_and_never_before_it() {
        for (d, s, end) in [
            (Dialect::Chat, CHAT, CHAT.len() - 2),
            (Dialect::Responses, RESPONSES, RESPONSES.len()),
        ] {
            for cut in 0..=s.len() {
                assert!(done_after(d, &[&s[..cut], &s[cut..]]), "{d:?} cut at {cut}");
                // Cut short anywhere before the end: not done.
                let short = cut < end;
                assert_eq!(done_after(d, &[&s[..cut]]), !short, "{d:?} {cut} bytes");
            }
            let bytes: Vec<&[u8]> = s.chunks(1).collect();
            assert!(done_after(d, &bytes));
        }
    }

    #[test]
    fn terminal_events_and_line_ends() {
        let r = Dialect::Responses;
        for kind in ["response.incomplete", "response.failed", "error"] {
            let s = format!("event: {kind}\r\ndata: {{}}\r\n\r\n");
            assert!(done_after(r, &[s.as_bytes()]), "{kind}");
        }
        // A data line naming a terminal event is not one; nor is a long line starting alike.
        assert!(!done_after(r, &[b"data: event: error\n\n"]));
        assert!(!done_after(
            r,
            &[b"event: response.completed.not\ndata: {}\n\n"]
        ));
        assert!(!done_after(Dialect::Chat, &[b"data: [DONE] and more\n\n"]));
        assert!(done_after(Dialect::Chat, &[b"data: [DONE]\r\n"]));
    }

    #[test]
    fn tails_parse_in_their_dialect() {
        let t = Dialect::Responses.broken_tail("why", 1);
        let s = std::str::from_utf8(&t).unwrap();
        let mut e = EndOfAnswer::new(Dialect::Responses);
        e.feed(b"event: response.created\ndata: {\"partial");
        e.feed(&t);
        assert!(e.done(), "{s}");
        let data = s.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["sequence_number"], 1);
        assert_eq!(e.events(), 2);
        assert!(v["message"].as_str().unwrap().ends_with("why"));
        let t = Dialect::Chat.broken_tail("why", 0);
        let mut e = EndOfAnswer::new(Dialect::Chat);
        e.feed(b"data: {\"cut");
        e.feed(&t);
        assert!(e.done());
    }

    /// The guard over a worker that sends `chunks` then stays silent: what the client gets.
    async fn relayed(d: Dialect, chunks: &[&'static [u8]]) -> Vec<u8> {
        let mut st = RouterState::new(&[], &[], crate::Policy::RoundRobin);
        // (Short: an end line not yet ended waits out the idle bound, then ends quietly.)
        st.stream_idle = std::time::Duration::from_millis(200);
        let chunks: Vec<_> = chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        let up = futures_util::stream::iter(chunks).chain(futures_util::stream::pending());
        let out = guard(Box::pin(up), d, InFlight::start(Vec::new()), Arc::new(st));
        let parts: Vec<_> = out.collect().await;
        parts
            .into_iter()
            .flat_map(|p| p.unwrap().to_vec())
            .collect()
    }

    #[tokio::test]
    async fn nothing_is_relayed_after_the_end_and_the_end_is_closed() {
        // Ends at once after the end (the worker's later bytes and silence are not waited on).
        let out = relayed(
            Dialect::Chat,
            &[b"data: {}\n\ndata: [DONE]", b"\n\n", b"data: x\n\n"],
        )
        .await;
        assert_eq!(out, b"data: {}\n\ndata: [DONE]\n\n");
        // An end line not yet closed by a blank line is closed for the client.
        let out = relayed(Dialect::Chat, &[b"data: [DONE]"]).await;
        assert_eq!(out, b"data: [DONE]\n\n");
        let r = b"event: response.completed\ndata: {}\n\n";
        let out = relayed(Dialect::Responses, &[r, b": keep-alive\n\n"]).await;
        assert_eq!(out, r);
    }

    /// Any bytes, cut anywhere: the same verdict as whole, and no panic (a fuzz harness of the
    /// parser of what a worker sends).
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn event() -> impl Strategy<Value = String> {
            let kinds = prop::sample::select(vec![
                "response.created",
                "response.output_text.delta",
                "response.completed",
                "error",
            ]);
            let data = "[ -~]{0,30}";
            let eol = prop::sample::select(vec!["\n", "\r\n"]);
            (kinds, data, eol, any::<bool>()).prop_map(|(k, d, e, space)| {
                let sp = if space { " " } else { "" };
                format!("event:{sp}{k}{e}data: {d}{e}{e}")
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn chunking_never_changes_the_verdict(
                bytes in prop::collection::vec(any::<u8>(), 0..300),
                cuts in prop::collection::vec(0usize..300, 0..8),
            ) {
                for d in [Dialect::Chat, Dialect::Responses] {
                    let whole = done_after(d, &[&bytes]);
                    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
                    cuts.sort();
                    let mut parts = Vec::new();
                    let mut at = 0;
                    for c in cuts {
                        parts.push(&bytes[at..c]);
                        at = c;
                    }
                    parts.push(&bytes[at..]);
                    prop_assert_eq!(done_after(d, &parts), whole);
                }
            }

            #[test]
            fn a_responses_stream_is_done_exactly_after_its_terminal_event(
                events in prop::collection::vec(event(), 1..6),
            ) {
                let s = events.concat();
                let last_is_terminal = |e: &str| {
                    let k = e.lines().next().unwrap().trim_start_matches("event:").trim();
                    matches!(k, "response.completed" | "error")
                };
                // Done after the whole stream iff some event was terminal (the end is the first
                // terminal event's blank line; what follows it changes nothing).
                let any_terminal = events.iter().any(|e| last_is_terminal(e));
                prop_assert_eq!(done_after(Dialect::Responses, &[s.as_bytes()]), any_terminal);
                // Cut one byte short of the first terminal event's end: not done.
                if let Some(i) = events.iter().position(|e| last_is_terminal(e)) {
                    let end: usize = events[..=i].iter().map(String::len).sum();
                    prop_assert!(!done_after(Dialect::Responses, &[&s.as_bytes()[..end - 1]]));
                }
            }
        }
    }
}
