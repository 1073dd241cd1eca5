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
/// whole within `total`.
pub async fn body_within(
    mut r: reqwest::Response,
    cap: usize,
    idle: Duration,
    total: Duration,
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
                out.extend_from_slice(&c);
            }
        }
    }
}

/// `body` when it is JSON; else the router's JSON 502 naming the worker's status (its words
/// go to the log, never to the client).
pub fn json_or_502(status: u16, body: Bytes, worker: &str) -> Result<Bytes, ApiError> {
    if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok() {
        return Ok(body);
    }
    let head = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    tracing::warn!(worker, status, body = %head, "a worker's answer is not JSON");
    Err(bad_gateway(format!(
        "a worker answered {status} with a body that is not JSON"
    )))
}

/// A JSON 502 saying what went wrong upstream.
pub fn bad_gateway(msg: String) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "server_error", msg)
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
    }
}
