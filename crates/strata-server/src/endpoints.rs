//! The small endpoints around generation: `/v1/models` (and one model), `/tokenize`,
//! `/detokenize`, `/tokenizer_info`, `/version`; request ids (`X-Request-Id` echoed or made) and fresh completion
//! ids.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tracing::Instrument;

use crate::api::{ChatMessage, Prompt};
use crate::body::{body_bytes, parse_json};
use crate::error::ApiError;
use crate::state::{off_async, AppState};

type St = State<Arc<AppState>>;

pub use crate::ids::{client_request_id, fresh_id, REQUEST_ID};

/// Echoes the request's `X-Request-Id` (or a fresh one) on the answer, and logs the request
/// under it (its spans).
pub async fn request_id(req: Request, next: Next) -> Response {
    logged_request(State(false), req, next).await
}

/// [`request_id`], and with `State(true)` one line when the request is over
/// ([`crate::request_log`]).
pub async fn logged_request(State(on): State<bool>, mut req: Request, next: Next) -> Response {
    let id = client_request_id(req.headers().get(&REQUEST_ID)).unwrap_or_else(fresh_id);
    let value = HeaderValue::from_str(&id).expect("checked or hex");
    req.headers_mut().insert(REQUEST_ID, value.clone());
    let span = tracing::debug_span!("request", id = %id);
    let path = req.uri().path();
    let log = (on && crate::request_log::logged(path)).then(|| {
        let route: String = path.chars().take(80).collect();
        crate::request_log::RequestLog::new(&id, req.method().as_str(), &route)
    });
    let run = next.run(req).instrument(span);
    let mut resp = match &log {
        Some(l) => l.scope(run).await,
        None => run.await,
    };
    if let Some(l) = &log {
        l.set_status(resp.status().as_u16());
    }
    if let Some(crate::error::ErrorCode("queue_timeout")) = resp.extensions().get() {
        tracing::warn!(request_id = %id, "request not admitted within --max-queue-time: 503 queue_timeout");
    }
    resp.headers_mut().insert(REQUEST_ID, value);
    resp
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model_name, "object": "model", "created": st.created, "owned_by": "strata",
           "max_model_len": st.engine.info().context_length})
}

pub async fn models(State(st): St) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&st)]}))
}

/// `GET /v1/models/{id}`: the served model, or a 404 naming what is served (an id that is not
/// UTF-8 too, in the API's error shape).
pub async fn model(
    State(st): St,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<Value>, ApiError> {
    match id {
        Ok(Path(id)) if id == st.model_name => Ok(Json(model_card(&st))),
        Ok(Path(id)) => Err(no_such_model(&st, &format!("`{id}`"))),
        Err(_) => Err(no_such_model(&st, "named by an id that is not UTF-8")),
    }
}

/// The 404 of a model this server does not serve (`which`: how to name it).
fn no_such_model(st: &AppState, which: &str) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        "not_found_error",
        format!(
            "the model {which} does not exist; this server serves `{}`",
            st.model_name
        ),
    )
    .with_code("model_not_found")
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION"), "name": "strata"}))
}

/// `POST /tokenize`: a completion prompt or chat messages (rendered with the template, as
/// generation would) → token ids, as vLLM answers it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<ChatMessage>>,
    /// With messages, as chat shows them to the model (the prompt counted as generation's).
    tools: Option<Vec<crate::api::ToolDef>>,
    tool_choice: Option<Value>,
    response_format: Option<crate::api::ResponseFormat>,
    /// Taken for chat's sake: it does not change the prompt.
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
    /// A text prompt with the model's BOS (as generation adds it; default) or without.
    add_special_tokens: Option<bool>,
    /// Each token's text beside its id (`token_strs`).
    #[serde(default)]
    return_token_strs: bool,
}

/// `GET /tokenizer_info`: what a client needs to tokenize as this server does (vLLM's
/// endpoint; lm-eval's remote tokenizer reads it): the special tokens' texts, the chat
/// template, the context length.
pub async fn tokenizer_info(State(st): St) -> Json<Value> {
    let tk = &st.tokenizer;
    let text = |id: Option<u32>| id.and_then(|i| tk.inner.id_to_token(i));
    Json(json!({
        "tokenizer_class": "StrataGgufTokenizer",
        "eos_token": text(Some(tk.eos)),
        "bos_token": text(tk.bos),
        "pad_token": null,
        "add_bos_token": tk.add_bos && tk.bos.is_some(),
        "chat_template": st.template.as_ref().map(|t| t.source()),
        "model_max_length": st.engine.info().context_length,
        "vocab_size": st.engine.info().vocab,
    }))
}

/// What chat shows beside a tokenize request's messages: its tools and its format's
/// description (fields that apply to messages only).
fn shown_of(req: &TokenizeRequest) -> Result<Option<crate::prompt::Shown>, ApiError> {
    let asked = [
        ("tools", req.tools.is_some()),
        ("tool_choice", req.tool_choice.is_some()),
        ("response_format", req.response_format.is_some()),
    ];
    if let (None, Some((field, _))) = (&req.messages, asked.iter().find(|a| a.1)) {
        return Err(ApiError::bad_request(
            "tools, tool_choice and response_format apply to messages",
            Some(field),
        ));
    }
    let tools = crate::tools::tools_from(req.tools.as_deref(), req.tool_choice.as_ref(), None)?;
    Ok(crate::prompt::Shown::of(
        tools.as_ref().map(|t| t.shown()),
        req.response_format.as_ref(),
    ))
}

pub async fn tokenize(
    State(st): St,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    // Read once as JSON: messages given as arrays are refused before serde reads them.
    let v: Value = parse_json(&body_bytes(body, st.body_limit)?)?;
    crate::body::objects_at(&v, crate::fields::MESSAGE_OBJECTS)?;
    crate::body::objects_at(&v, crate::fields::OBJECTS)?;
    let req: TokenizeRequest = crate::body::from_value(v)?;
    check_model(&st, req.model.as_deref())?;
    if req.messages.is_some() && req.add_special_tokens.is_some() {
        return Err(ApiError::bad_request(
            "add_special_tokens applies to a prompt; messages are rendered by the chat template \
             as generation renders them",
            Some("add_special_tokens"),
        ));
    }
    let shown = shown_of(&req)?;
    let special = req.add_special_tokens.unwrap_or(true);
    let ids = match (req.prompt, req.messages) {
        (Some(Prompt::Tokens(t)), None) => t,
        (Some(p), None) => {
            off_async(&st, move |st| {
                let text = match &p {
                    Prompt::Text(t) => Some(t),
                    Prompt::Texts(v) if v.len() == 1 => v.first(),
                    _ => None,
                };
                match text.filter(|_| !special) {
                    // Without special tokens: the text's own ids, no BOS added.
                    Some(t) => st
                        .tokenizer
                        .encode(t)
                        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt"))),
                    None => crate::prompt::completion_ids(&st.tokenizer, &p),
                }
            })
            .await?
        }
        (None, Some(m)) if m.is_empty() => {
            return Err(ApiError::bad_request("messages is empty", Some("messages")));
        }
        (None, Some(m)) => {
            off_async(&st, move |st| {
                let tpl = st.template.as_deref();
                crate::prompt::chat_ids(&st.tokenizer, tpl, &m, shown.as_ref())
            })
            .await?
        }
        _ => {
            return Err(ApiError::bad_request(
                "give either prompt or messages",
                Some("prompt"),
            ))
        }
    };
    // Ids given as ids are checked as generation checks them (the text's own always fit).
    let vocab = st.engine.info().vocab;
    if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(
            format!("token id {t} is outside the vocabulary ({vocab} tokens)"),
            Some("prompt"),
        ));
    }
    let ctx = st.engine.info().context_length;
    let mut out = json!({"tokens": ids, "count": ids.len(), "max_model_len": ctx});
    if req.return_token_strs {
        let strs: Vec<Option<String>> = ids
            .iter()
            .map(|&i| st.tokenizer.inner.id_to_token(i))
            .collect();
        out["token_strs"] = json!(strs);
    }
    Ok(Json(out))
}

/// `POST /detokenize`: token ids → text.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

pub async fn detokenize(
    State(st): St,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse_json(&body_bytes(body, st.body_limit)?)?;
    check_model(&st, req.model.as_deref())?;
    let vocab = st.engine.info().vocab;
    if let Some(t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(
            format!("token id {t} is outside the vocabulary ({vocab} tokens)"),
            Some("tokens"),
        ));
    }
    let tokens = req.tokens;
    let text = off_async(&st, move |st| {
        st.tokenizer
            .decode(&tokens)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("tokens")))
    })
    .await?;
    Ok(Json(json!({"prompt": text})))
}

/// A request's `model`, when given, must be the served one (404 otherwise).
pub(crate) fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.model_name => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                axum::http::StatusCode::NOT_FOUND,
                "not_found_error",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    st.model_name
                ),
            )
            .with_code("model_not_found")
        }),
        _ => Ok(()),
    }
}
