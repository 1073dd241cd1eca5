//! `POST /v1/responses`: OpenAI's Responses API over the chat machinery. A request becomes a
//! chat request (`convert`): instructions → a system message, the stored conversation of
//! `previous_response_id` ([`crate::response_store`]), input items → messages (function calls and their
//! outputs → assistant tool calls and tool messages), flat function tools → chat tools,
//! `text.format` → `response_format`, `max_output_tokens` → `max_tokens`. The chat answer
//! becomes a response object (or its event stream, [`stream`]); the conversation, with the
//! answer, is kept under the response's id when `store` is not false. Every field is honoured
//! or refused, as elsewhere.

mod convert;
mod stream;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::body::body_bytes;
use crate::error::ApiError;
use crate::state::AppState;

pub use convert::ResponsesRequest;

type St = State<Arc<AppState>>;

/// `POST /v1/responses`.
pub async fn create(
    State(st): St,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(body, st.body_limit)?;
    // Under PD the router names the prefill worker, signing this request (checked once: the
    // chat request built below is this worker's own).
    let prefill = match headers.get(crate::state::PREFILL_HEADER) {
        Some(v) => {
            let url = v.to_str().map_err(|_| {
                ApiError::bad_request(
                    format!("{} is not ASCII", crate::state::PREFILL_HEADER),
                    None,
                )
            })?;
            crate::pd::check_prefill_header(&st, &headers, "/v1/responses", &bytes, url)?;
            Some(url.to_string())
        }
        None => None,
    };
    let req: ResponsesRequest = convert::parse(&bytes)?;
    crate::endpoints::check_model(&st, req.model.as_deref())?;
    let earlier = match &req.previous_response_id {
        Some(id) => Some(st.responses.get(id).ok_or_else(|| {
            ApiError::bad_request(
                format!("previous response `{id}` is not stored here (unknown, expired or evicted: see docs/API.md)"),
                Some("previous_response_id"),
            )
        })?),
        None => None,
    };
    let (chat_body, conversation) = convert::to_chat(&req, earlier.as_deref())?;
    let stream = req.stream == Some(true);
    let answer = crate::generation::chat_answer(st.clone(), prefill, chat_body).await;
    let answer = answer.map_err(|e| convert::rename_param(e, req.instructions.is_some()))?;
    let echo = convert::Echo::of(&req, &st.model_name);
    let keep = req.store != Some(false);
    if stream {
        return Ok(stream::events(st, answer, echo, conversation, keep).into_response());
    }
    let body = axum::body::to_bytes(answer.into_body(), usize::MAX)
        .await
        .map_err(|e| crate::error::engine_error(&format!("the answer could not be read: {e}")))?;
    let chat: Value = serde_json::from_slice(&body)
        .map_err(|e| crate::error::engine_error(&format!("the answer is not JSON: {e}")))?;
    let (response, said) = convert::from_chat(&chat, &echo);
    if keep {
        st.responses
            .put(&echo.id, convert::with_answer(conversation, said));
    }
    Ok((StatusCode::OK, axum::Json(response)).into_response())
}

/// A response object in progress (the stream's first events).
pub(crate) fn in_progress(echo: &convert::Echo) -> Value {
    let mut r = echo.object();
    r["status"] = json!("in_progress");
    r["output"] = json!([]);
    r["usage"] = Value::Null;
    r
}
