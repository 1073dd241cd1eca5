//! One connection's requests: the router's gate (its API key) before any body byte is read,
//! the body read whole under its deadline, size and the process's budget for bodies in
//! flight, then the app; the connection counts as busy (cannot yield its place) from the
//! whole request to the end of its response body.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use http_body::Frame;
use http_body_util::BodyExt;

use super::{Gate, Handle, HttpLimits, HttpStats};
use crate::error::ApiError;
use crate::ids::{client_request_id, fresh_id, REQUEST_ID};
use crate::places::{Busy, Place};

/// One connection's request handler.
#[derive(Clone)]
pub(super) struct Conn {
    pub app: Router,
    pub limits: HttpLimits,
    pub stats: Arc<HttpStats>,
    pub place: Arc<Place<Handle>>,
    pub peer: SocketAddr,
    pub gate: Option<Gate>,
    /// Bytes of request bodies being read, in all (503 beyond).
    pub bodies: Arc<tokio::sync::Semaphore>,
}

impl Conn {
    pub async fn handle(
        self,
        req: Request<hyper::body::Incoming>,
    ) -> Result<Response<Body>, std::convert::Infallible> {
        let id = client_request_id(req.headers().get(&REQUEST_ID)).unwrap_or_else(fresh_id);
        let (parts, body) = req.into_parts();
        if let Some(refusal) = self.gate.as_ref().and_then(|g| g(&parts)) {
            return Ok(close(refusal, &id)); // no byte of the body read
        }
        let bytes = match self.read_body(&parts, body, &id).await {
            Ok(b) => b,
            Err(refused) => return Ok(close(refused, &id)),
        };
        // The connection works from here until the response's body is done or dropped.
        let Some(busy) = self.place.busy() else {
            let e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "the connection was closed to make room; retry on a new one",
            );
            return Ok(close(e.into_response(), &id));
        };
        let req = Request::from_parts(parts, Body::from(bytes));
        let resp = tower_service::Service::call(&mut self.app.clone(), req)
            .await
            .unwrap_or_else(|e: std::convert::Infallible| match e {});
        Ok(resp.map(|b| {
            Body::new(Tracked {
                inner: b,
                _busy: busy,
            })
        }))
    }

    /// The whole body, read under the deadline, the size limit and the budget for bodies in
    /// flight; or the answer that refuses it. The connection stays idle meanwhile: one that
    /// dribbles its body yields to a newcomer like one that dribbles its headers.
    async fn read_body(
        &self,
        parts: &axum::http::request::Parts,
        body: hyper::body::Incoming,
        id: &str,
    ) -> Result<Bytes, Response<Body>> {
        let limit = self.limits.body_limit;
        let announced = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if announced.is_some_and(|n| n > limit as u64) {
            return Err(too_large(limit));
        }
        // The body's room in the budget: what it announces, or the limit (one acquire takes
        // at most u32::MAX permits: a larger limit reserves that much).
        let room = announced
            .unwrap_or(limit as u64)
            .min(limit as u64)
            .min(u32::MAX as u64) as u32;
        let Ok(_room) = self.bodies.clone().try_acquire_many_owned(room) else {
            let e = ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    "too many request bodies are being received now; retry shortly",
                )
            };
            return Err(e.into_response());
        };
        let read = http_body_util::Limited::new(body, limit).collect();
        match tokio::time::timeout(self.limits.body_timeout, read).await {
            Ok(Ok(b)) => Ok(b.to_bytes()),
            Ok(Err(e))
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                Err(too_large(limit))
            }
            Ok(Err(e)) => Err(ApiError::bad_request(
                format!("cannot read the request body: {e}"),
                None,
            )
            .into_response()),
            Err(_) => {
                self.stats.body_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = %self.peer, request_id = %id, "request body too slow");
                Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    format!(
                        "the request body did not arrive within {} s (--body-timeout)",
                        self.limits.body_timeout.as_secs_f64()
                    ),
                )
                .into_response())
            }
        }
    }
}

fn too_large(limit: usize) -> Response<Body> {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body exceeds the limit of {limit} bytes"),
    )
    .into_response()
}

/// An answer of the listener itself: it carries the request id (as the app's answers do)
/// and closes its connection (the body may be unread).
fn close(mut r: Response<Body>, id: &str) -> Response<Body> {
    let h = r.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    if let Ok(v) = HeaderValue::from_str(id) {
        h.insert(REQUEST_ID, v);
    }
    r
}

/// A response body that keeps its connection marked busy until it is done or dropped.
struct Tracked {
    inner: Body,
    _busy: Busy<Handle>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
