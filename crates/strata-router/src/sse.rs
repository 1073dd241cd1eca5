//! A worker's SSE answer relayed under guard. The stream passes through event by event (a
//! chunk's bytes up to its last closed event go at once; an event still open waits for the rest
//! of it, up to [`HOLD`] bytes); if the worker's connection breaks, the stream ends before the answer's last event, the worker
//! stays silent for the router's `stream_idle` (a live worker sends a comment every 15 s), or
//! the answer outlasts `request_timeout` (a wedged worker whose keep-alive comments still flow
//! is cut there), the client gets an error event in the API's own shape and a clean end, so
//! that no client takes a truncated answer for a whole one, nor parses half an event. Once the answer's end has been
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

/// The most bytes of one open event held back (a `response.completed` carries the whole
/// answer; the bound is per stream, so many streams stay within memory). An event larger than
/// this passes through as it comes from there to its end: a break in it may then reach a
/// client as half an event before the error event.
pub const HOLD: usize = 1 << 20;

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
    /// Events closed that named their kind (`Responses`: the next event's sequence number).
    events: u64,
    /// An `event:` line was read since the last blank line.
    named: bool,
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
            named: false,
            blank: true,
        }
    }

    /// How many events were read whole (`Responses`: those that named their kind).
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Whether the answer's end has been seen, its line ended (nothing more is read).
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

    /// Reads the next bytes of the stream, up to the answer's end (nothing after it is read).
    /// Returns how many of them a client can be given whole: through the last blank line read,
    /// or through the answer's end.
    pub fn feed(&mut self, bytes: &[u8]) -> usize {
        let (mut at, mut whole) = (0, 0);
        while at < bytes.len() && !self.done {
            let rest = &bytes[at..];
            let (part, ended) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..i], true),
                None => (rest, false),
            };
            let room = LINE - self.line.len();
            self.line.extend_from_slice(&part[..part.len().min(room)]);
            at += part.len() + usize::from(ended);
            if ended {
                self.line_ended();
                if self.blank || self.done {
                    whole = at;
                }
            }
        }
        whole
    }

    fn line_ended(&mut self) {
        let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        self.blank = line.is_empty();
        if self.blank && std::mem::take(&mut self.named) {
            self.events += 1;
        }
        match self.dialect {
            Dialect::Chat => self.done |= self.line_is_done(),
            Dialect::Responses if line.is_empty() => self.done |= self.terminal,
            Dialect::Responses => {
                if let Some(kind) = line.strip_prefix(b"event:") {
                    self.named = true;
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

/// One guarded stream's state.
struct G<S> {
    up: S,
    end: EndOfAnswer,
    /// The open event's bytes read so far (not yet relayed).
    held: Vec<u8>,
    /// The open event outgrew [`HOLD`]: it passes through as it comes until it closes.
    passing: bool,
    over: bool,
    keep: InFlight,
    st: Arc<RouterState>,
    deadline: tokio::time::Instant,
}

impl<S> G<S> {
    /// The next bytes `b` from the worker: what of them (and of the bytes held before them)
    /// goes to the client now, whole events only; the rest is held.
    fn relay(&mut self, b: Bytes) -> Option<Bytes> {
        let whole = self.end.feed(&b);
        let out = if whole == 0 && self.passing {
            b // the rest of an event too large to hold, as it comes
        } else if whole == 0 {
            self.held.extend_from_slice(&b);
            if self.held.len() <= HOLD {
                return None;
            }
            // An event too large to hold passes through from here to its end.
            self.passing = true;
            Bytes::from(std::mem::take(&mut self.held))
        } else if self.held.is_empty() && whole == b.len() {
            self.passing = false;
            b // the common case: a chunk of whole events, relayed without a copy
        } else {
            self.passing = false;
            let mut out = std::mem::take(&mut self.held);
            out.extend_from_slice(&b[..whole]);
            if !self.end.ended() {
                self.held.extend_from_slice(&b[whole..]);
            }
            Bytes::from(out)
        };
        (!out.is_empty()).then_some(out)
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
    let g = G {
        up: upstream,
        end: EndOfAnswer::new(dialect),
        held: Vec::new(),
        passing: false,
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
        // reset or silence after it is no error). A `[DONE]` line is closed by a blank line
        // here (held back if its line has not ended), or a client's parser would drop it.
        let finish = |mut g: G<S>| {
            g.over = true;
            let mut last = std::mem::take(&mut g.held);
            if dialect == Dialect::Chat {
                last.extend_from_slice(if g.end.ended() { b"\n" } else { b"\n\n" });
            }
            (!last.is_empty()).then(|| (Ok(Bytes::from(last)), g))
        };
        loop {
            if g.end.ended() {
                return finish(g);
            }
            use crate::upstream::{next_within, Within};
            let idle = g.st.stream_idle;
            let why = match next_within(g.deadline, idle, g.up.next()).await {
                Within::Next(Some(Ok(b))) => {
                    if let Some(whole) = g.relay(b) {
                        return Some((Ok(whole), g));
                    }
                    continue;
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
            // The open event's part is dropped: the client's last event is a whole one.
            return Some((Ok(dialect.broken_tail(&why, g.end.events())), g));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"data: [DONE]\"}}]}\n\n: keep-alive\n\ndata: [DONE]\n\n";
    const RESPONSES: &[u8] = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent: response.output_text.delta\ndata: {\"delta\":\"event: error\\n\\n\"}\n\n: keep-alive\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{}}\n\n";

    fn done_after(d: Dialect, chunks: &[&[u8]]) -> bool {
        let mut e = EndOfAnswer::new(d);
        for c in chunks {
            e.feed(c);
        }
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
    async fn relayed(d: Dialect, chunks: &[&[u8]]) -> Vec<u8> {
        relayed_then(d, chunks, false).await
    }

    /// The same, the worker's stream ending after `chunks` if `end`.
    async fn relayed_then(d: Dialect, chunks: &[&[u8]], end: bool) -> Vec<u8> {
        pieces(d, chunks, end).await.concat()
    }

    /// What the client gets, piece by piece.
    async fn pieces(d: Dialect, chunks: &[&[u8]], end: bool) -> Vec<Vec<u8>> {
        let mut st = RouterState::new(&[], &[], crate::Policy::RoundRobin);
        // (Short: an end line not yet ended waits out the idle bound, then ends quietly.)
        st.stream_idle = std::time::Duration::from_millis(200);
        let chunks: Vec<_> = chunks.iter().map(|c| Ok(Bytes::from(c.to_vec()))).collect();
        let then = match end {
            true => futures_util::stream::empty().boxed(),
            false => futures_util::stream::pending().boxed(),
        };
        let up = futures_util::stream::iter(chunks).chain(then);
        let out = guard(Box::pin(up), d, InFlight::start(Vec::new()), Arc::new(st));
        let parts: Vec<_> = out.collect().await;
        parts.into_iter().map(|p| p.unwrap().to_vec()).collect()
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

    #[tokio::test]
    async fn a_break_anywhere_leaves_the_client_whole_events_then_the_error() {
        let why = "it ended before the answer's last event";
        for (d, s, end) in [
            (Dialect::Chat, CHAT, CHAT.len() - 2),
            (Dialect::Responses, RESPONSES, RESPONSES.len()),
        ] {
            for cut in 0..end {
                let out = relayed_then(d, &[&s[..cut / 2], &s[cut / 2..cut]], true).await;
                let whole = s[..cut].windows(2).rposition(|w| w == b"\n\n");
                let whole = &s[..whole.map_or(0, |i| i + 2)];
                let events = whole
                    .split(|&b| b == b'\n')
                    .filter(|l| l.starts_with(b"event:"));
                let tail = d.broken_tail(why, events.count() as u64);
                assert_eq!(out, [whole, &tail[..]].concat(), "{d:?} cut at {cut}");
            }
        }
    }

    #[tokio::test]
    async fn an_event_too_large_to_hold_passes_through() {
        let big = vec![b'x'; HOLD / 2 + 1];
        let out = relayed_then(Dialect::Chat, &[b"data: ", &big, &big], true).await;
        let tail = Dialect::Chat.broken_tail("it ended before the answer's last event", 0);
        assert_eq!(out.len(), 6 + 2 * big.len() + tail.len());
        assert!(out.ends_with(&tail));
        // From there to its end the event goes as it comes; the next is held again.
        let chunks: [&[u8]; 6] = [b"data: ", &big, &big, b"yy", b"\n\ndata: {", b"}\n\n"];
        let p = pieces(Dialect::Chat, &chunks, true).await;
        assert_eq!(p[0].len(), 6 + 2 * big.len());
        assert_eq!(
            (&p[1][..], &p[2][..], &p[3][..]),
            (&b"yy"[..], &b"\n\n"[..], &b"data: {}\n\n"[..])
        );
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
