//! The decode side of a PD request: admitted here first (the prefix this worker's cache holds
//! matched, locked and brought onto the device), then the prefill worker computes the prompt
//! and sends the K/V of the pages after that prefix to this worker's KV listener, and the
//! engine decodes on; or, when the cache holds all but a few tokens, it computes them here.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use strata_engine::{CachedTokens, Event, ImportedKv, SamplingParams};

use super::{bad_gateway, prefill_call, unwire};
use super::{FirstTokenSampling, KvInbox, PrefillRequest, PrefillResponse, WireLogprobs};
use crate::error::ApiError;
use crate::state::AppState;

/// The decode side of a PD request: admit it here (its prefix matched in this worker's cache
/// and held), then ask the prefill worker at `prefill_url` to compute the prompt and send the
/// K/V of the pages after that prefix here, and continue generation in this engine. When the
/// cache holds all of the prompt but at most `--pd-local-prefill-tokens`, it is computed here.
pub async fn decode_after_remote_prefill(
    st: &Arc<AppState>,
    prefill_url: &str,
    ids: Vec<u32>,
    params: SamplingParams,
) -> Result<strata_engine::RequestStream, ApiError> {
    let Some(inbox) = &st.pd.kv else {
        return Err(ApiError::bad_request(
            "this worker has no KV listener: start it with --role decode (or both)",
            None,
        ));
    };
    if st.pd.decode_reuse {
        let mut rs = st
            .engine
            .submit_remote(ids.clone(), params.clone(), st.pd.local_prefill_tokens)
            .map_err(|e| ApiError::from_submit(&e))?;
        match held(&mut rs).await? {
            (_, false) => return Ok(rs),
            (0, true) => {} // handed back: nothing held
            (held, true) => {
                let kv = fetch(st, inbox, prefill_url, &ids, &params, held).await?;
                st.engine
                    .deliver(&rs, kv)
                    .map_err(|e| ApiError::from_submit(&e))?;
                return Ok(rs);
            }
        }
    } else {
        // Refused before any remote work, as one worker refuses it (`submit_remote` checks
        // the same).
        st.engine
            .check(&ids, &params)
            .map_err(|e| ApiError::from_submit(&e))?;
    }
    // The whole prompt's K/V (nothing held, or reuse off): no pages are reserved while the
    // prefill worker computes; the request is admitted with all of them.
    let kv = fetch(st, inbox, prefill_url, &ids, &params, 0).await?;
    st.engine
        .submit_prefilled(ids, params, kv)
        .map_err(|e| ApiError::from_submit(&e))
}

/// Asks the prefill worker at `prefill_url` to compute the prompt and send the K/V of its
/// pages after the first `held` tokens (which this worker holds) here; they and the first
/// token, as the engine takes them.
async fn fetch(
    st: &Arc<AppState>,
    inbox: &Arc<KvInbox>,
    prefill_url: &str,
    ids: &[u32],
    params: &SamplingParams,
    held: usize,
) -> Result<ImportedKv, ApiError> {
    let ps = st.engine.info().page_size;
    check_staging(inbox, (ids.len().div_ceil(ps) - held / ps) as u64)?;
    let exp = inbox.expect((held / ps) as u32);
    let body = PrefillRequest {
        transfer_id: strata_kv::auth::hex(&exp.id.to_le_bytes()),
        tokens: ids.to_vec(),
        kv_target: inbox.advertise.to_string(),
        shared_prefix: params.shared_prefix,
        session: params.session,
        held_tokens: held,
        held_hash: match held {
            0 => String::new(),
            _ => super::held_digest(&st.engine.info().hello(), &ids[..held]),
        },
        sampling: first_token_sampling(params),
    };
    // The prefill worker answers once its transfer ends; a transfer this side already gave
    // up on (a link gone silent) fails the request now, not when the sender's own timeouts
    // end it (up to `--kv-deadline` later).
    let mut pr = tokio::select! {
        r = call_prefill(st, prefill_url, &body) => r?,
        why = exp.failed() => return Err(bad_gateway(format!("KV transfer: {why}"))),
    };
    let got = exp
        .take(st.pd.kv_deadline)
        .await
        .map_err(|e| bad_gateway(format!("KV transfer: {e}")))?;
    drop(exp);
    if got.tokens != ids {
        return Err(bad_gateway("the K/V received is for other tokens".into()));
    }
    check_logprobs(&pr, ids, params)?;
    Ok(ImportedKv {
        first_page: got.first as usize,
        first_logprobs: pr.first_logprobs.take().map(unwire),
        prompt_logprobs: pr
            .prompt_logprobs
            .take()
            .map(|v| v.into_iter().map(unwire).collect()),
        pages: got.pages,
        first_token: pr.first_token,
        cached: CachedTokens {
            device: pr.cached_device,
            host: pr.cached_host,
            storage: pr.cached_storage,
        },
    })
}

/// Waits for a remote request's `Event::Held`: (tokens held, whether a prefill worker
/// computes the rest).
async fn held(rs: &mut strata_engine::RequestStream) -> Result<(usize, bool), ApiError> {
    match crate::respond::first_event(rs).await? {
        Event::Held { tokens, prefill } => Ok((tokens, prefill)),
        Event::Done { reason, .. } => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("the request ended before its prompt was admitted: {reason:?}"),
        )),
        ev => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("a PD request's first event was {ev:?}"),
        )),
    }
}

/// The client's sampling as the prefill worker applies it to the first token.
fn first_token_sampling(params: &SamplingParams) -> FirstTokenSampling {
    FirstTokenSampling {
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k,
        seed: params.seed,
        stop_token_ids: params.stop_token_ids.clone(),
        ignore_eos: params.ignore_eos,
        frequency_penalty: params.frequency_penalty,
        presence_penalty: params.presence_penalty,
        repetition_penalty: params.repetition_penalty,
        logit_bias: params.logit_bias.clone(),
        min_p: params.min_p,
        min_tokens: params.min_tokens,
        logprobs: params.logprobs,
        prompt_logprobs: params.prompt_logprobs,
        constraint: params
            .constraint
            .as_ref()
            .and_then(crate::structured::spec_of),
    }
}

/// The prefill worker's log probabilities are what was asked, for these tokens: the first
/// token's when asked, and one entry per prompt token after the first, each for that token,
/// with at most the alternatives asked.
fn check_logprobs(pr: &PrefillResponse, ids: &[u32], p: &SamplingParams) -> Result<(), ApiError> {
    let fits = |l: &WireLogprobs, k: usize| l.top.len() <= k && l.logprob <= 0.0;
    let first_ok = match (&pr.first_logprobs, p.logprobs) {
        (None, None) => true,
        (Some(l), Some(k)) => l.token == pr.first_token && fits(l, k),
        _ => false,
    };
    let prompt_ok = match (&pr.prompt_logprobs, p.prompt_logprobs) {
        (None, None) => true,
        (Some(v), Some(k)) => {
            v.len() + 1 == ids.len()
                && v.iter()
                    .zip(&ids[1..])
                    .all(|(l, &t)| l.token == t && fits(l, k))
        }
        _ => false,
    };
    if first_ok && prompt_ok {
        Ok(())
    } else {
        Err(bad_gateway(
            "the prefill worker's log probabilities do not match the request".into(),
        ))
    }
}

/// Refuses K/V larger than this worker's staging area (`pages` to receive).
fn check_staging(inbox: &KvInbox, pages: u64) -> Result<(), ApiError> {
    let need = pages * inbox.page_bytes();
    if need > inbox.staging_limit() {
        return Err(ApiError::bad_request(
            format!(
                "the prompt's K/V ({need} bytes) exceeds this decode worker's KV staging area ({} bytes, --kv-staging)",
                inbox.staging_limit()
            ),
            Some("messages"),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// Asks the prefill worker to compute the prompt and send its K/V here; its answer.
async fn call_prefill(
    st: &AppState,
    prefill_url: &str,
    body: &PrefillRequest,
) -> Result<PrefillResponse, ApiError> {
    let url = format!("{}/pd/prefill", prefill_url.trim_end_matches('/'));
    let bytes =
        axum::body::Bytes::from(serde_json::to_vec(body).expect("a prefill request serializes"));
    let build = || {
        st.pd
            .http
            .post(&url)
            .timeout(st.pd.kv_deadline + Duration::from_secs(600))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(bytes.clone())
    };
    let (peers, key) = (&st.pd.peers, st.cluster_key.as_ref());
    let r = crate::auth::send(peers, key, prefill_url, &prefill_call(&bytes), build)
        .await
        .map_err(|e| bad_gateway(format!("prefill worker {prefill_url}: {e}")))?;
    let status = r.status();
    if !status.is_success() {
        // Its words go to the log only: nothing an upstream says is echoed to a client.
        let text = r.text().await.unwrap_or_default();
        tracing::warn!(prefill = prefill_url, %status, %text, "prefill worker refused");
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS
            || status == reqwest::StatusCode::SERVICE_UNAVAILABLE
        {
            return Err(ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    format!("the prefill worker is busy ({status}); retry later"),
                )
            });
        }
        return Err(bad_gateway(format!("the prefill worker answered {status}")));
    }
    let bytes = read_capped(r, answer_cap(body))
        .await
        .map_err(|e| bad_gateway(format!("prefill worker {prefill_url}: {e}")))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| bad_gateway(format!("prefill worker {prefill_url}: bad answer: {e}")))
}

/// The most bytes a prefill worker's answer to `body` may take: a few KiB, and the log
/// probabilities asked for (each entry a token id and a number, generously).
pub(super) fn answer_cap(body: &PrefillRequest) -> usize {
    let per_token = |k: Option<usize>| k.map_or(0, |k| (k + 2) * 64);
    let s = &body.sampling;
    64 * 1024 + per_token(s.logprobs) + body.tokens.len() * per_token(s.prompt_logprobs)
}

/// Reads a response body of at most `cap` bytes (more is an error, read no further).
async fn read_capped(mut r: reqwest::Response, cap: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| e.to_string())? {
        if out.len() + chunk.len() > cap {
            return Err(format!("answer over {cap} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}
