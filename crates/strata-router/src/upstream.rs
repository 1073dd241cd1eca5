//! A worker's answer read within bounds: its size capped, each chunk within a time, and a body
//! that is not JSON where JSON is due replaced by the router's own error. A worker (or whatever
//! listens on its port) is as hostile to the router as a client is.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use strata_server::ApiError;

/// Most bytes of a worker's non-streamed answer the router holds: a completion with the log
/// probabilities of a long prompt is megabytes; this is far above.
pub const MAX_ANSWER_BYTES: usize = 256 << 20;

/// Most bytes of workers' answers the router holds at once, over all requests: past it an
/// answer being read is cut (a 502), so answers at their cap from many workers or requests
/// cannot take the router's memory.
pub const MAX_HELD_BYTES: usize = 1 << 30;

/// Bytes [`body_within`] holds now, over all answers.
static HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One answer's share of [`HELD`], given back when its reading ends.
struct Held(usize);

impl Held {
    /// Takes `n` more bytes, unless that would pass `limit` over all answers.
    fn take(&mut self, n: usize, limit: usize) -> bool {
        use std::sync::atomic::Ordering;
        let ok = HELD
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|&t| t <= limit)
            })
            .is_ok();
        if ok {
            self.0 += n;
        }
        ok
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD.fetch_sub(self.0, std::sync::atomic::Ordering::AcqRel);
    }
}

/// What waiting for the next part of an answer within its bounds gave.
pub enum Within<T> {
    Next(T),
    /// Nothing within the idle bound.
    Idle,
    /// The whole answer's time is up.
    Total,
}

/// `next` awaited within `idle` and before `end`. The end is checked before polling: a source
/// whose next part is always ready never lets a timeout fire.
pub async fn next_within<T>(
    end: tokio::time::Instant,
    idle: Duration,
    next: impl std::future::Future<Output = T>,
) -> Within<T> {
    let left = end.saturating_duration_since(tokio::time::Instant::now());
    if left.is_zero() {
        return Within::Total;
    }
    match tokio::time::timeout(idle.min(left), next).await {
        Ok(t) => Within::Next(t),
        Err(_) if left <= idle => Within::Total,
        Err(_) => Within::Idle,
    }
}

/// The body of `r`: at most `cap` bytes, each chunk within `idle` of the one before, the
/// whole within `total` (the router's own reads: cache events, scrapes, flushes).
pub async fn body_within(
    r: reqwest::Response,
    cap: usize,
    idle: Duration,
    total: Duration,
) -> Result<Bytes, String> {
    body_held(r, cap, idle, total, usize::MAX, &mut Held(0)).await
}

/// How a [`answer_within`] cut for the shared budget begins (the router's limit, not the
/// worker's fault: not counted against it).
pub const BUDGET_CUT: &str = "the router holds";

/// A worker's answer to a client, as [`body_within`] reads it, and within
/// [`MAX_HELD_BYTES`] for all such answers the router holds at once: its share is kept until
/// the client has the answer ([`held_body`]), so clients that read slowly or never cannot
/// pile answers up in the router's memory past the budget.
pub async fn answer_within(
    r: reqwest::Response,
    cap: usize,
    idle: Duration,
    total: Duration,
) -> Result<(Bytes, Share), String> {
    let mut held = Held(0);
    let bytes = body_held(r, cap, idle, total, MAX_HELD_BYTES, &mut held).await?;
    Ok((bytes, Share { _held: held }))
}

/// An answer's share of [`MAX_HELD_BYTES`], given back when dropped.
pub struct Share {
    _held: Held,
}

/// `bytes` (an answer read by [`answer_within`], as checked) as a response body that holds
/// its share until the body is dropped: written to the client, or the client gone. Its length
/// is said (`Content-Length`), as a plain body's.
pub fn held_body(bytes: Bytes, share: Share) -> axum::body::Body {
    axum::body::Body::new(HeldBody {
        bytes: Some(bytes),
        _share: share,
    })
}

/// [`held_body`]'s body: the bytes in one frame, the share kept for the body's life.
struct HeldBody {
    bytes: Option<Bytes>,
    _share: Share,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.bytes.take().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

async fn body_held(
    mut r: reqwest::Response,
    cap: usize,
    idle: Duration,
    total: Duration,
    limit: usize,
    held: &mut Held,
) -> Result<Bytes, String> {
    let end = tokio::time::Instant::now() + total;
    let mut out = Vec::new();
    loop {
        match next_within(end, idle, r.chunk()).await {
            Within::Total => {
                return Err(format!(
                    "an answer longer than {:.0} s",
                    total.as_secs_f64()
                ))
            }
            Within::Idle => {
                return Err(format!(
                    "no byte of its answer for {:.1} s",
                    idle.as_secs_f64()
                ))
            }
            Within::Next(Err(e)) => return Err(e.to_string()),
            Within::Next(Ok(None)) => return Ok(out.into()),
            Within::Next(Ok(Some(c))) => {
                if out.len() + c.len() > cap {
                    return Err(format!("an answer over {cap} bytes"));
                }
                if limit < usize::MAX && !held.take(c.len(), limit) {
                    return Err(format!(
                        "{BUDGET_CUT} {limit} bytes of answers being read; this one is cut"
                    ));
                }
                out.extend_from_slice(&c);
            }
        }
    }
}

/// `body` when it is JSON; else the router's JSON 502 naming the worker's status (its words
/// go to the log, never to the client).
pub fn json_or_502(status: u16, body: Bytes, worker: &str) -> Result<Bytes, ApiError> {
    // A success or an error of HTTP's own range; a redirect (never followed), an
    // informational status as a final answer, or a number past 599 is not an answer a
    // client can act on.
    if !matches!(status, 200..=299 | 400..=599) {
        tracing::warn!(
            worker,
            status,
            "a worker answered a status the router does not pass on"
        );
        return Err(bad_gateway(format!("a worker answered status {status}")));
    }
    if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok() {
        return Ok(body);
    }
    let head = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    tracing::warn!(worker, status, body = ?head, "a worker's answer is not JSON");
    Err(bad_gateway(format!(
        "a worker answered {status} with a body that is not JSON"
    )))
}

/// The longest a passed-through call (models, tokenize, version, a flush, ...) may take a
/// worker: above the worker's own 60 s bound on `/health_generate`, so its answer (a 503 naming
/// why) arrives.
pub const PASS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);
/// A JSON 502 saying what went wrong upstream.
pub fn bad_gateway(msg: String) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "server_error", msg)
}

/// A worker's `Retry-After` (whole seconds, as the workers send it with a 429 or 503), to go
/// back to the client with the answer; anything else in it is dropped.
pub fn retry_after(r: &reqwest::Response) -> Option<axum::http::HeaderValue> {
    let v = r.headers().get(reqwest::header::RETRY_AFTER)?.as_bytes();
    let seconds = !v.is_empty() && v.len() <= 9 && v.iter().all(u8::is_ascii_digit);
    seconds.then(|| axum::http::HeaderValue::from_bytes(v).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_json_passes() {
        assert!(json_or_502(200, Bytes::from_static(b"{\"a\": 1}"), "w").is_ok());
        for bad in [&b"{\"choices\": [ not json"[..], b"<html>trace</html>", b""] {
            let e = json_or_502(500, Bytes::copy_from_slice(bad), "w").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_GATEWAY);
            let msg = e.body()["error"]["message"].as_str().unwrap().to_string();
            assert!(!msg.contains("trace") && msg.contains("500"), "{msg}");
        }
        // JSON under a status a client cannot act on is the router's 502; HTTP's successes
        // and errors pass.
        let json = || Bytes::from_static(b"{\"error\": {}}");
        for odd in [100, 101, 199, 301, 307, 399, 600, 999] {
            let e = json_or_502(odd, json(), "w").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_GATEWAY, "{odd}");
        }
        for fine in [200, 201, 299, 400, 429, 500, 503, 599] {
            assert!(json_or_502(fine, json(), "w").is_ok(), "{fine}");
        }
    }

    /// Answers being read share one budget: one that would pass it is cut, and a share is
    /// given back when its reading ends (this test's budgets are far below what any other
    /// answer in this process holds at once, which is nothing).
    #[tokio::test]
    async fn answers_read_together_share_one_budget() {
        let app = axum::Router::new().fallback(|| async { "x".repeat(4000) });
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        let get = || async { reqwest::get(&url).await.unwrap() };
        let s = Duration::from_secs(5);
        let limit = HELD.load(std::sync::atomic::Ordering::Acquire) + 10_000;
        let mut other = Held(0);
        assert!(other.take(7_000, limit));
        let e = body_held(get().await, 1 << 20, s, s, limit, &mut Held(0))
            .await
            .unwrap_err();
        assert!(e.contains("bytes of answers being read"), "{e}");
        drop(other);
        let mut held = Held(0);
        let b = body_held(get().await, 1 << 20, s, s, limit, &mut held)
            .await
            .unwrap();
        assert_eq!(b.len(), 4000);
        // The share stays taken while the client's body lives (a client that reads slowly or
        // never keeps it), and is given back when the body is dropped.
        let before = HELD.load(std::sync::atomic::Ordering::Acquire);
        let body = held_body(b, Share { _held: held });
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(4000));
        let mut other = Held(0);
        assert!(
            !other.take(7_000, limit),
            "the answer's share was given back early"
        );
        drop(body);
        assert_eq!(
            HELD.load(std::sync::atomic::Ordering::Acquire),
            before - 4000
        );
        assert!(other.take(7_000, limit));
    }
}
