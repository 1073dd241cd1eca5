//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use strata_engine::SubmitError;

/// The token of an `Authorization: Bearer <token>` header, if any (the scheme is
/// case-insensitive, as RFC 9110 says).
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
        .filter(|t| !t.is_empty())
}

/// Whether `headers` carry `Authorization: Bearer <key>` (compared with [`secret_eq`]).
pub fn bearer_is(headers: &axum::http::HeaderMap, key: &str) -> bool {
    bearer(headers).is_some_and(|g| secret_eq(g, key))
}

/// Compares a secret in time that does not depend on where the inputs differ.
pub fn secret_eq(given: &str, expected: &str) -> bool {
    constant_time_eq::constant_time_eq(given.as_bytes(), expected.as_bytes())
}

/// The most bytes of an error's message, and of its `param`: what a client sent (an id, a
/// field's name, a value) is echoed in an error, never at any length (a 3 MB id came back
/// whole).
pub const MAX_MESSAGE: usize = 2048;
pub const MAX_PARAM: usize = 256;

/// `s` cut to at most `max` bytes at a character boundary, the cut said.
fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut at = max - "… (cut)".len();
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        s.push_str("… (cut)");
    }
    s
}

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 / 503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A body sent to `/flush_cache` (worker or router): the tier goes in the query string.
    pub fn flush_body() -> ApiError {
        let m = "/flush_cache takes no body: the tier goes in the query string (`?tier=device`)";
        ApiError::bad_request(m, None)
    }

    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: clip(message.into(), MAX_MESSAGE),
            param: param.map(|p| clip(p.to_string(), MAX_PARAM)),
            code: None,
            retry_after: None,
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: clip(message.into(), MAX_MESSAGE),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The body as JSON (also used inside SSE streams).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// A refused submission: 400 for requests that can never run, 429 for overload, 503 while
    /// shutting down.
    pub fn from_submit(e: &SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull { .. } | SubmitError::TooManyTokens { .. } => ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    e.to_string(),
                )
                .with_code("rate_limit_exceeded")
            },
            SubmitError::EngineDead(_) => ApiError {
                retry_after: Some(5),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    e.to_string(),
                )
            },
            SubmitError::MaxTokensTooLarge { .. } => {
                ApiError::bad_request(e.to_string(), Some("max_tokens"))
                    .with_code("context_length_exceeded")
            }
            SubmitError::TooManyStopTokens { .. } | SubmitError::BadStopToken { .. } => {
                ApiError::bad_request(e.to_string(), Some("stop_token_ids"))
            }
            SubmitError::ShuttingDown => ApiError {
                retry_after: Some(5),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    e.to_string(),
                )
            },
            SubmitError::ZeroMaxTokens => ApiError::bad_request(e.to_string(), Some("max_tokens")),
            SubmitError::BadModifier { field, .. } => {
                ApiError::bad_request(e.to_string(), Some(field))
            }
            SubmitError::ChoicesTooLarge { .. } => {
                ApiError::bad_request(e.to_string(), Some("max_tokens"))
            }
            SubmitError::TooLongForContext { .. } | SubmitError::TooLongForPool { .. } => {
                ApiError::bad_request(e.to_string(), Some("messages"))
                    .with_code("context_length_exceeded")
            }
            SubmitError::EmptyPrompt | SubmitError::BadToken { .. } => {
                ApiError::bad_request(e.to_string(), Some("prompt"))
            }
            SubmitError::BadConstraint(_) => {
                ApiError::bad_request(e.to_string(), Some("response_format"))
            }
            SubmitError::BadKv(_) => {
                ApiError::new(StatusCode::BAD_GATEWAY, "server_error", e.to_string())
            }
        }
    }
}

impl ApiError {
    /// A request that waited longer than `--max-queue-time` for admission: 503, retry soon.
    pub fn queue_timeout(waited: std::time::Duration) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                format!(
                    "the request waited {:.1} s for admission, longer than the server's queueing-time limit; retry later",
                    waited.as_secs_f64()
                ),
            )
            .with_code("queue_timeout")
        }
    }
}

/// The `code` of an error answer, on the response (for logging by request id).
#[derive(Clone, Copy, Debug)]
pub struct ErrorCode(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let Some(code) = self.code {
            r.extensions_mut().insert(ErrorCode(code));
        }
        r
    }
}

/// A 500 for a request the engine failed.
pub fn engine_error(msg: &str) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        format!("generation failed: {msg}"),
    )
}

/// The query string of `uri` as `T`: a parameter `T` does not take (with
/// `#[serde(deny_unknown_fields)]`), a repeated one or a bad value is a 400 in the API's error
/// shape naming it, never axum's plain-text rejection, nor a parameter accepted and ignored.
pub fn query<T: serde::de::DeserializeOwned>(uri: &axum::http::Uri) -> Result<T, ApiError> {
    axum::extract::Query::<T>::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|e| {
            let text = e.body_text();
            let why = text
                .strip_prefix("Failed to deserialize query string: ")
                .unwrap_or(&text);
            ApiError::bad_request(format!("query string: {why}"), None)
        })
}

/// What an endpoint without parameters takes: nothing (any parameter is refused by
/// [`query`]).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoQuery {}

/// `?since=N`: where a log of events or samples is read from (`/cache/events`, the router's
/// `/dashboard/history`).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinceQuery {
    pub since: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_client_sent_is_echoed_within_bounds() {
        let id = "é".repeat(1_500_000); // 3 MB, two bytes a character
        let e = ApiError::bad_request(format!("previous response `{id}` is not stored"), Some(&id));
        assert!(e.message.len() <= MAX_MESSAGE && e.message.ends_with("… (cut)"));
        assert!(e.message.starts_with("previous response `éé"));
        assert!(e.param.as_ref().unwrap().len() <= MAX_PARAM);
        let short = ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "as it is");
        assert_eq!(short.message, "as it is");
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_keys_compare_whole() {
        let mut h = axum::http::HeaderMap::new();
        for v in ["Bearer k1", "bearer k1", "BEARER   k1"] {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            assert_eq!(bearer(&h), Some("k1"), "{v}");
        }
        for v in ["Basic k1", "Bearer", "Bearerk1", "Bearer "] {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            assert_eq!(bearer(&h), None, "{v}");
        }
        assert!(secret_eq("abc", "abc"));
        assert!(!secret_eq("abc", "abd"));
        assert!(!secret_eq("ab", "abc"));
    }

    /// Query strings: what the type takes is parsed; an unknown, repeated or malformed
    /// parameter is a 400 in the API's shape, saying what is wrong.
    #[test]
    fn query_strings_are_parsed_or_refused() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        struct Q {
            since: Option<u64>,
        }
        let uri = |s: &str| s.parse::<axum::http::Uri>().unwrap();
        assert_eq!(query::<Q>(&uri("/e?since=7")).unwrap().since, Some(7));
        assert_eq!(query::<Q>(&uri("/e")).unwrap().since, None);
        for (q, why) in [
            ("/e?sinse=7", "unknown field `sinse`"),
            ("/e?since=-1", "since"),
            ("/e?since=1&since=2", "duplicate field `since`"),
        ] {
            let e = query::<Q>(&uri(q)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{q}");
            let msg = e.body()["error"]["message"].as_str().unwrap().to_string();
            assert!(
                msg.starts_with("query string: ") && msg.contains(why),
                "{q}: {msg}"
            );
        }
        assert!(query::<NoQuery>(&uri("/c")).is_ok());
        assert!(query::<NoQuery>(&uri("/c?tier=host")).is_err());
    }
}
