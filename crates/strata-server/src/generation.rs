//! The generation endpoints: `/v1/completions` (a batch of prompts) and `/v1/chat/completions`,
//! from the request to the engine and back (whole or streamed; several choices through
//! [`crate::choices`]; under PD, the decode side of a remote prefill).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::api::{ChatRequest, CompletionRequest, Prompt, Sampling};
use crate::body::{body_bytes, parse_json};
use crate::endpoints::check_model;
use crate::error::ApiError;
use crate::fields::Endpoint;
use crate::respond::{first_event, stream_response, whole_response, Job, Kind};
use crate::state::{off_async, AppState, PREFILL_HEADER};

type St = State<Arc<AppState>>;

pub(crate) async fn completions(
    State(st): St,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(body, st.body_limit)?;
    crate::fields::check(&bytes, Endpoint::Completions, st.lenient_fields)?;
    let req: CompletionRequest = parse_json(&bytes)?;
    check_model(&st, req.model.as_deref())?;
    // The router's proof first: nothing is tokenized or compiled for a call that fails it.
    let prefill = prefill_worker(&st, &headers, Kind::Completion, &bytes)?;
    let echo = req.echo == Some(true);
    let prompts = batch(&st, req.prompt, echo).await?;
    let constraint = match crate::structured::asked(&req.sampling, None, None)? {
        Some(a) => Some(crate::structured::compile(&st, a).await?),
        None => None,
    };
    let how = How {
        kind: Kind::Completion,
        echo,
        constraint,
        tools: None,
        tool_rules: Default::default(),
        best_of: req.best_of,
        shared_prefix: 0,
    };
    // The engine names a prompt that does not fit `messages` (chat's field); here it is
    // `prompt`.
    start(st, prompts, &req.sampling, how, prefill)
        .await
        .map_err(|mut e| {
            if e.param.as_deref() == Some("messages") {
                e.param = Some("prompt".into());
            }
            e
        })
}

/// A chat answer (JSON or event stream) for a request body built here (`/v1/responses`),
/// its prompt computed on `prefill` (a prefill worker the caller checked) under PD.
pub(crate) async fn chat_answer(
    st: Arc<AppState>,
    prefill: Option<String>,
    body: Vec<u8>,
) -> Result<Response, ApiError> {
    chat_body(st, prefill, &body).await
}

pub(crate) async fn chat(
    State(st): St,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(body, st.body_limit)?;
    let prefill = prefill_worker(&st, &headers, Kind::Chat, &bytes)?;
    chat_body(st, prefill, &bytes).await
}

async fn chat_body(
    st: Arc<AppState>,
    prefill: Option<String>,
    bytes: &[u8],
) -> Result<Response, ApiError> {
    crate::fields::check(bytes, Endpoint::Chat, st.lenient_fields)?;
    let req: ChatRequest = parse_json(bytes)?;
    check_model(&st, req.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages is empty", Some("messages")));
    }
    if st.template.is_none() {
        return Err(ApiError::bad_request(
            "this model has no chat template: use /v1/completions",
            Some("messages"),
        ));
    }
    let tools = crate::tools::tools_of(&req)?;
    let forced = tools
        .as_ref()
        .and_then(|t| t.constraint())
        .map(|c| (c, "tool_choice"));
    let asked = crate::structured::asked(&req.sampling, req.response_format.as_ref(), forced)?;
    if let Some(t) = &tools {
        crate::structured::check_tool_schemas(&st, t.unheld_schemas()).await?;
    }
    // Compiled before the prompt is tokenized: an invalid constraint is named before a prompt
    // too long for the context (a tool's schema is shown in the prompt too).
    let constraint = match asked {
        Some(a) => Some(crate::structured::compile(&st, a).await?),
        None => None,
    };
    let shown = crate::prompt::Shown::of(
        tools.as_ref().map(|t| t.shown()),
        req.response_format.as_ref(),
    );
    let ChatRequest {
        messages, sampling, ..
    } = req;
    // Only a model whose window state is kept where a continuation starts uses the shared
    // prefix (it costs a second rendering of the system part).
    let want_shared = st.engine.info().window_tokens > 0;
    let context = Some(st.engine.info().context_length);
    let (ids, shared_prefix) = off_async(&st, move |st| {
        let tpl = st.template.as_deref();
        let (tk, shown) = (&st.tokenizer, shown.as_ref());
        crate::prompt::chat_ids_shared(tk, tpl, &messages, shown, want_shared, context)
    })
    .await?;
    let how = How {
        kind: Kind::Chat,
        echo: false,
        constraint,
        tool_rules: tools.as_ref().map(|t| t.rules()).unwrap_or_default(),
        tools: tools.and_then(|t| t.callable()),
        best_of: None,
        shared_prefix,
    };
    let prompt = crate::choices::OnePrompt { ids, echo: None };
    start(st, vec![prompt], &sampling, how, prefill).await
}

/// Which endpoint a request came by, what it echoes, its output constraint and the tools
/// whose calls are parsed out of its answer.
struct How {
    kind: Kind,
    /// Completions' `echo`: each prompt's text before its completion.
    echo: bool,
    constraint: Option<strata_engine::Constraint>,
    tools: Option<Vec<String>>,
    /// How the calls are read (see `Job::tool_rules`).
    tool_rules: crate::tools::CallRules,
    /// Completions' `best_of` (None: `n`).
    best_of: Option<usize>,
    /// Chat: where other conversations are expected to leave the prompt (0: unknown).
    shared_prefix: usize,
}

async fn start(
    st: Arc<AppState>,
    mut prompts: Vec<crate::choices::OnePrompt>,
    s: &Sampling,
    how: How,
    prefill: Option<String>,
) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let kind = how.kind;
    let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let (mut params, stops) = crate::sampling::sampling(&st, s, longest)?;
    params.constraint = how.constraint;
    params.shared_prefix = how.shared_prefix;
    let n = s.n.unwrap_or(1);
    // Completions' echo with logprobs: the prompt's too, with as many alternatives.
    let prompt_logprobs = how.echo && params.logprobs.is_some();
    if prompt_logprobs {
        params.prompt_logprobs = params.logprobs;
        let tokens = prompts.iter().map(|p| p.ids.len()).sum();
        check_prompt_logprobs(n, tokens, params.logprobs.unwrap_or(0))?;
    }
    let best_of = crate::choices::best_of(how.best_of, n, s.stream)?;
    let prefix = if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let job = Job {
        kind,
        started,
        id: format!("{prefix}-{}", crate::endpoints::fresh_id()),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        stream: s.stream,
        include_usage: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
        stops,
        min_tokens: params.min_tokens,
        logprobs: params.logprobs.is_some(),
        prompt_logprobs,
        echo: None,
        tools: how.tools,
        tool_rules: how.tool_rules,
    };
    if best_of > 1 || prompts.len() > 1 {
        let nb = (n, best_of);
        return crate::choices::answer(st, prompts, params, job, nb, prefill).await;
    }
    let one = prompts.pop().expect("a request has a prompt");
    let (ids, job) = (
        one.ids,
        Job {
            echo: one.echo,
            ..job
        },
    );
    let mut rs = match prefill {
        Some(url) => crate::pd::decode_after_remote_prefill(&st, &url, ids, params).await?,
        None => st
            .engine
            .submit(ids, params)
            .map_err(|e| ApiError::from_submit(&e))?,
    };
    let first = first_event(&mut rs).await?;
    if job.stream {
        Ok(stream_response(st, rs, job, first).into_response())
    } else {
        whole_response(st, rs, job, first).await
    }
}

/// Most prompts one completions request may batch (each prompt's choices count against
/// `MAX_CHOICES` on their own; together they are queued like as many requests).
pub const MAX_BATCH_PROMPTS: usize = 64;

/// A completions prompt as the batch it is: a string, a token-id list (one prompt each), a
/// list of strings or of token-id lists (one prompt per entry), with each prompt's text for
/// `echo`. Text is tokenized off the async workers.
async fn batch(
    st: &Arc<AppState>,
    prompt: Prompt,
    echo: bool,
) -> Result<Vec<crate::choices::OnePrompt>, ApiError> {
    use crate::choices::OnePrompt;
    let entries = match &prompt {
        Prompt::Texts(v) => v.len(),
        Prompt::TokenLists(v) => v.len(),
        _ => 1,
    };
    if entries == 0 || entries > MAX_BATCH_PROMPTS {
        return Err(ApiError::bad_request(
            format!("{entries} prompts in one request: from 1 to {MAX_BATCH_PROMPTS}"),
            Some("prompt"),
        ));
    }
    let ids: Vec<Vec<u32>> = match prompt.clone() {
        Prompt::Tokens(t) => vec![t],
        Prompt::TokenLists(v) => v,
        p => {
            off_async(st, move |st| {
                let texts = match p {
                    Prompt::Text(t) => vec![t],
                    Prompt::Texts(v) => v,
                    _ => unreachable!("token prompts are matched above"),
                };
                let context = Some(st.engine.info().context_length);
                let one =
                    |t: &String| crate::prompt::encode_within(&st.tokenizer, t, context, "prompt");
                texts.iter().map(one).collect::<Result<Vec<_>, _>>()
            })
            .await?
        }
    };
    let mut out = Vec::with_capacity(ids.len());
    for (i, ids) in ids.into_iter().enumerate() {
        let echo = match (&prompt, echo) {
            (_, false) => None,
            (Prompt::Text(t), true) => Some(t.clone()),
            (Prompt::Texts(v), true) => Some(v[i].clone()),
            (_, true) => {
                let ids = ids.clone();
                Some(off_async(st, move |st| crate::prompt::decode_ids(&st.tokenizer, &ids)).await?)
            }
        };
        out.push(OnePrompt { ids, echo });
    }
    Ok(out)
}

/// Most log-probability entries (a token or an alternative) of the prompt one answer carries
/// over all its choices: the prompt's part is repeated in every choice.
pub const MAX_PROMPT_LOGPROB_ENTRIES: usize = 1 << 21;

/// Refuses echo with logprobs whose answer would carry more prompt entries than the bound.
fn check_prompt_logprobs(n: usize, prompt: usize, k: usize) -> Result<(), ApiError> {
    let entries = n.saturating_mul(prompt).saturating_mul(k + 1);
    if entries > MAX_PROMPT_LOGPROB_ENTRIES {
        return Err(ApiError::bad_request(
            format!(
                "echo with logprobs: {n} choices × {prompt} prompt tokens × {} entries = {entries} log probabilities, at most {MAX_PROMPT_LOGPROB_ENTRIES}: ask for fewer choices or alternatives",
                k + 1
            ),
            Some("logprobs"),
        ));
    }
    Ok(())
}

/// The prefill worker the router named for this request (`x-strata-prefill`), checked.
fn prefill_worker(
    st: &AppState,
    headers: &HeaderMap,
    kind: Kind,
    body: &[u8],
) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(PREFILL_HEADER) else {
        return Ok(None);
    };
    let url = v
        .to_str()
        .map_err(|_| ApiError::bad_request(format!("{PREFILL_HEADER} is not ASCII"), None))?;
    let path = match kind {
        Kind::Chat => "/v1/chat/completions",
        Kind::Completion => "/v1/completions",
    };
    crate::pd::check_prefill_header(st, headers, path, body, url)?;
    Ok(Some(url.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_logprobs_are_bounded_over_all_choices() {
        assert!(check_prompt_logprobs(1, 8192, 21).is_ok());
        assert!(check_prompt_logprobs(16, 8192, 5).is_ok());
        let e = check_prompt_logprobs(16, 8192, 20).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "logprobs");
        assert!(check_prompt_logprobs(usize::MAX, usize::MAX, usize::MAX - 1).is_err());
    }
}
