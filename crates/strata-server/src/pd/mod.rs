//! Prefill/decode disaggregation on the worker side.
//!
//! A decode worker receives a client request (from the router) naming a prefill worker in the
//! `x-strata-prefill` header. It tokenizes the prompt and asks that worker (`POST /pd/prefill`)
//! to compute it and ship the K/V to this worker's KV listener ([`KvInbox`]); then it writes
//! the K/V into its own device pool and generates the rest, streaming as usual.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use strata_engine::transfer;
use strata_engine::{
    CachedTokens, Event, FinishReason, PromptLogprobs, SamplingParams, TokenLogprobs,
};

use crate::error::ApiError;
pub use crate::kv_inbox::{Expectation, KvInbox, KvLimits};

mod decode;
mod ship;
use crate::state::AppState;
#[cfg(test)]
use decode::answer_cap;
pub use decode::decode_after_remote_prefill;

pub use strata_protocol::{FirstTokenSampling, PrefillRequest, PrefillResponse, WireLogprobs};

/// What the cluster MAC of a `/pd/prefill` call covers.
fn prefill_call(body: &[u8]) -> crate::auth::Call<'_> {
    crate::auth::Call {
        method: "POST",
        target: "/pd/prefill",
        body,
        prefill: None,
    }
}

fn bad_gateway(msg: String) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "server_error", msg)
}

/// Where a prefill worker may send K/V: any address with a cluster key (the receiver must
/// then prove it holds the key), a loopback address without one.
fn kv_target(st: &AppState, target: &str) -> Result<SocketAddr, ApiError> {
    let addr: SocketAddr = target.parse().map_err(|_| {
        ApiError::bad_request(
            format!("kv_target `{target}` is not IP:PORT"),
            Some("kv_target"),
        )
    })?;
    if st.cluster_key.is_none() && !addr.ip().is_loopback() {
        return Err(ApiError::bad_request(
            "kv_target must be a loopback address on a worker without a cluster key",
            Some("kv_target"),
        ));
    }
    Ok(addr)
}

pub async fn prefill(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<PrefillResponse>, ApiError> {
    let arrived = std::time::Instant::now();
    let bytes = crate::body::body_bytes(body, st.body_limit)?;
    if let Some(k) = &st.cluster_key {
        crate::auth::verify(k, &st.replay, &headers, &prefill_call(&bytes))
            .map_err(|e| crate::auth::unauthorized(&e))?;
    }
    let r = prefill_work(&st, &bytes, arrived).await;
    let m = &st.pd.metrics;
    match &r {
        Ok(_) => m.ok.fetch_add(1, Ordering::Relaxed),
        Err(_) => m.failed.fetch_add(1, Ordering::Relaxed),
    };
    r
}

/// An authenticated `/pd/prefill`: compute, and send the pages as they are computed.
async fn prefill_work(
    st: &Arc<AppState>,
    bytes: &[u8],
    arrived: std::time::Instant,
) -> Result<Json<PrefillResponse>, ApiError> {
    let (req, id, addr, mut params) = prefill_request(st, bytes)?;
    if let Some(c) = req.sampling.constraint.clone() {
        params.constraint = Some(crate::structured::compile(st, (c, "sampling.constraint")).await?);
    }
    let prompt_tokens = req.tokens.len();
    let from = held_pages(st, &req)?;
    let ship = ship::Shipment::new(ship::Route {
        addr,
        id,
        tokens: req.tokens.clone(),
        from,
    });
    let (done, ship) = compute_prefill(st, &req.tokens, params, from, arrived, ship).await?;
    let (first, cached) = (done.first, done.cached);
    let first_logprobs = done.logprobs.map(wire);
    let prompt_logprobs = done.prompt_logprobs.map(|p| {
        let tokens = Arc::try_unwrap(p).map_or_else(|p| p.tokens.clone(), |p| p.tokens);
        tokens.into_iter().map(wire).collect()
    });
    let stats = match ship.finish().await {
        Ok(Ok(stats)) => stats,
        Ok(Err(e)) => {
            st.pd
                .metrics
                .kv_send_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(bad_gateway(format!(
                "KV transfer to {}: {e}",
                req.kv_target
            )));
        }
        Err(e) => return Err(bad_gateway(format!("KV transfer task: {e}"))),
    };
    tracing::debug!(
        pages = stats.pages,
        bytes = stats.bytes,
        seconds = stats.seconds,
        "KV sent (bytes, seconds sending)"
    );
    count_sent(st, &stats);
    Ok(Json(PrefillResponse {
        first_logprobs,
        prompt_logprobs,
        first_token: first,
        prompt_tokens,
        cached_device: cached.device,
        cached_host: cached.host,
        cached_storage: cached.storage,
        transfer_pages: stats.pages,
        transfer_bytes: stats.bytes,
        transfer_seconds: stats.seconds,
    }))
}

fn count_sent(st: &AppState, stats: &transfer::TransferStats) {
    let m = &st.pd.metrics;
    m.kv_sent.fetch_add(1, Ordering::Relaxed);
    m.kv_sent_bytes.fetch_add(stats.bytes, Ordering::Relaxed);
    m.kv_sent_pages.fetch_add(stats.pages, Ordering::Relaxed);
    m.kv_send_nanos
        .fetch_add((stats.seconds * 1e9) as u64, Ordering::Relaxed);
}

/// The request checked: its transfer id, the decode worker's KV address, the sampling of the
/// first token.
fn prefill_request(
    st: &AppState,
    bytes: &[u8],
) -> Result<(PrefillRequest, u128, SocketAddr, SamplingParams), ApiError> {
    let req: PrefillRequest = crate::body::parse_json(bytes)?;
    let id = strata_kv::auth::unhex(&req.transfer_id)
        .filter(|b| b.len() == 16)
        .map(|b| u128::from_le_bytes(b.try_into().expect("16 bytes")))
        .ok_or_else(|| {
            ApiError::bad_request("transfer_id: expected 32 hex digits", Some("transfer_id"))
        })?;
    let addr = kv_target(st, &req.kv_target)?;
    let w = &req.sampling;
    let sane = (0.0..=2.0).contains(&w.temperature) && w.top_p > 0.0 && w.top_p <= 1.0;
    if !sane {
        return Err(ApiError::bad_request(
            "temperature must be in [0, 2] and top_p in (0, 1]",
            Some("temperature"),
        ));
    }
    let params = SamplingParams {
        max_tokens: 1,
        temperature: w.temperature,
        top_p: w.top_p,
        top_k: w.top_k,
        seed: w.seed,
        stop_token_ids: w.stop_token_ids.clone(),
        ignore_eos: w.ignore_eos,
        frequency_penalty: w.frequency_penalty,
        presence_penalty: w.presence_penalty,
        repetition_penalty: w.repetition_penalty,
        logit_bias: w.logit_bias.clone(),
        min_p: w.min_p,
        // The decode worker counts the rest; one token here: at most one.
        min_tokens: w.min_tokens.min(1),
        logprobs: w.logprobs,
        prompt_logprobs: w.prompt_logprobs,
        constraint: None,
        shared_prefix: req.shared_prefix,
        session: req.session,
    };
    if req.tokens.is_empty() {
        return Err(ApiError::bad_request(
            "tokens is empty: a prompt has at least one token",
            Some("tokens"),
        ));
    }
    if req.shared_prefix > req.tokens.len() {
        return Err(ApiError::bad_request(
            format!(
                "shared_prefix {} is longer than the prompt's {} tokens",
                req.shared_prefix,
                req.tokens.len()
            ),
            Some("shared_prefix"),
        ));
    }
    Ok((req, id, addr, params))
}

/// The digest both sides of a PD transfer compute over the prompt's first tokens, the ones
/// the decode worker holds, in the transfer format (the handshake's `Hello`): the decode
/// worker names its prefix with it, the prefill worker checks it before computing. Unlike
/// the caches' page hashes, it does not depend on either worker's tensor-parallel layout.
pub(crate) fn held_digest(hello: &transfer::Hello, tokens: &[u32]) -> String {
    let mut h = blake3::Hasher::new_derive_key("strata 2026 pd held prefix v1");
    for field in [hello.model_id.as_bytes(), hello.layout.as_bytes()] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field);
    }
    h.update(&hello.page_size.to_le_bytes());
    h.update(&hello.page_bytes.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    strata_kv::auth::hex(&h.finalize().as_bytes()[..16])
}

/// The pages of a `/pd/prefill` request's prompt the decode worker holds (not to be sent):
/// whole pages, fewer than the prompt's, named by their digest (checked here, before any
/// work) when there are any.
fn held_pages(st: &AppState, req: &PrefillRequest) -> Result<usize, ApiError> {
    let ps = st.engine.info().page_size;
    let held = req.held_tokens;
    let bad = |msg: String| Err(ApiError::bad_request(msg, Some("held_tokens")));
    if held >= req.tokens.len() || !held.is_multiple_of(ps) {
        return bad(format!(
            "held_tokens {held}: whole pages of {ps} tokens, fewer than the prompt's {}",
            req.tokens.len()
        ));
    }
    let hash_ok = match held {
        0 => req.held_hash.is_empty(),
        _ => strata_kv::auth::unhex(&req.held_hash).is_some_and(|b| b.len() == 16),
    };
    if !hash_ok {
        return Err(ApiError::bad_request(
            "held_hash: 32 hex digits with held_tokens, empty without",
            Some("held_hash"),
        ));
    }
    if held > 0 && held_digest(&st.engine.info().hello(), &req.tokens[..held]) != req.held_hash {
        return Err(ApiError::bad_request(
            "held_hash: not the digest of the held tokens in this worker's transfer format",
            Some("held_hash"),
        ));
    }
    Ok(held / ps)
}

/// A computed prompt.
struct Prefilled {
    first: u32,
    logprobs: Option<TokenLogprobs>,
    prompt_logprobs: Option<Arc<PromptLogprobs>>,
    cached: CachedTokens,
}

/// Computes the prompt: the first token (and its log probabilities if asked) and how the
/// cache served it; its pages go to `ship` as they are computed.
async fn compute_prefill(
    st: &AppState,
    tokens: &[u32],
    params: SamplingParams,
    from: usize,
    arrived: std::time::Instant,
    mut ship: ship::Shipment,
) -> Result<(Prefilled, ship::Shipment), ApiError> {
    let mut rs = st
        .engine
        .submit_export(tokens.to_vec(), params, from)
        .map_err(|e| ApiError::from_submit(&e))?;
    let (mut first, mut cached) = (None, CachedTokens::default());
    let (mut logprobs, mut prompt_logprobs) = (None, None);
    while let Some(ev) = rs.events.recv().await {
        match ev {
            Event::Admitted { cached: c } => cached = c,
            Event::PromptLogprobs(p) => prompt_logprobs = Some(p),
            Event::Logprobs(l) => logprobs = Some(l),
            Event::Token(t) => {
                // The prefill's part of the client's TTFT (the client's own TTFT is measured
                // by the decode worker that answers it: not counted twice).
                let secs = arrived.elapsed().as_secs_f64();
                st.pd.metrics.duration.observe(secs);
                st.pd
                    .metrics
                    .prompt_tokens
                    .fetch_add(tokens.len() as u64, Ordering::Relaxed);
                first = Some(t)
            }
            Event::Kv(k) => ship.part(st, k),
            Event::Held { .. } => {}
            Event::Done { reason, .. } => {
                if let FinishReason::QueueTimeout { waited } = reason {
                    return Err(ApiError::queue_timeout(waited));
                }
                if matches!(reason, FinishReason::Error(_) | FinishReason::Aborted) {
                    return Err(bad_gateway(format!("prefill ended: {reason:?}")));
                }
            }
        }
    }
    match first {
        Some(first) => Ok((
            Prefilled {
                first,
                logprobs,
                prompt_logprobs,
                cached,
            },
            ship,
        )),
        _ => Err(bad_gateway("prefill produced no token".into())),
    }
}

/// Connects to a decode worker's KV listener and completes the handshake. A connection closed
/// before the handshake ends (the listener at a connection limit, e.g. while a peer without
/// the key floods it) is retried until `deadline`; a refusal is final.
fn connect_kv(
    addr: SocketAddr,
    hello: &transfer::Hello,
    key: Option<&strata_kv::auth::ClusterKey>,
    deadline: Duration,
) -> Result<TcpStream, transfer::TransferError> {
    let t = std::time::Instant::now();
    let mut wait = Duration::from_millis(20);
    loop {
        let attempt = (|| {
            let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            conn.set_read_timeout(Some(deadline))?;
            conn.set_write_timeout(Some(deadline))?;
            conn.set_nodelay(true)?;
            transfer::handshake_connect(&mut conn, hello, key)?;
            Ok(conn)
        })();
        match attempt {
            Err(transfer::TransferError::Io(e)) if t.elapsed() + wait < deadline => {
                tracing::debug!(%addr, error = %e, "KV connection lost before the handshake; retrying");
                std::thread::sleep(wait);
                wait = (wait * 2).min(Duration::from_millis(500));
            }
            r => return r,
        }
    }
}

/// Whether this decode worker may follow `x-strata-prefill: url` on this request: only from the
/// router (cluster-authenticated when a key is set) and only to a configured prefill worker.
/// Nothing is sent anywhere before this passes.
pub fn check_prefill_header(
    st: &AppState,
    headers: &HeaderMap,
    path: &str,
    body: &[u8],
    url: &str,
) -> Result<(), ApiError> {
    if let Some(k) = &st.cluster_key {
        let call = crate::auth::Call {
            method: "POST",
            target: path,
            body,
            prefill: Some(url),
        };
        crate::auth::verify(k, &st.replay, headers, &call).map_err(|e| {
            crate::auth::unauthorized(&format!(
                "{} is honoured only from the router ({e})",
                crate::state::PREFILL_HEADER
            ))
        })?;
    }
    if !st.pd.prefill_workers.iter().any(|w| same_worker(w, url)) {
        return Err(ApiError::bad_request(
            format!(
                "{} names no prefill worker this decode worker is configured with (--prefill-worker)",
                crate::state::PREFILL_HEADER
            ),
            None,
        ));
    }
    Ok(())
}

fn wire(l: TokenLogprobs) -> WireLogprobs {
    WireLogprobs {
        token: l.token,
        logprob: l.logprob,
        top: l.top,
    }
}

fn unwire(l: WireLogprobs) -> TokenLogprobs {
    TokenLogprobs {
        token: l.token,
        logprob: l.logprob,
        top: l.top,
    }
}

/// Whether two worker URLs name one worker however spelled (`http://H:80` is `http://h/`): the
/// decode worker's check of the router's prefill URL, and the checks of the flags naming
/// workers.
pub fn same_worker(a: &str, b: &str) -> bool {
    let origin = |u: &str| reqwest::Url::parse(u).ok().map(|p| p.origin());
    match (origin(a), origin(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a.trim_end_matches('/') == b.trim_end_matches('/'),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_worker_however_spelled() {
        assert!(same_worker("http://H:80", "http://h/"));
        assert!(same_worker("http://10.0.0.1:8100", "http://10.0.0.1:8100/"));
        assert!(!same_worker("http://h:8100", "http://h:8101"));
        assert!(!same_worker("http://h:8100", "https://h:8100"));
    }

    #[test]
    fn the_answer_cap_fits_the_largest_honest_answer() {
        let (prompt, k) = (8192usize, 20usize);
        let worst = |token: u32| WireLogprobs {
            token,
            logprob: -1.234_567_9e-30,
            top: (0..k as u32)
                .map(|t| (t + 4_000_000_000, -9.876_543e-30))
                .collect(),
        };
        let answer = PrefillResponse {
            first_token: u32::MAX,
            prompt_tokens: prompt,
            cached_device: prompt,
            cached_host: prompt,
            cached_storage: prompt,
            transfer_pages: u64::MAX,
            transfer_bytes: u64::MAX,
            transfer_seconds: 1e300,
            first_logprobs: Some(worst(u32::MAX)),
            prompt_logprobs: Some(
                (1..prompt as u32)
                    .map(|t| worst(t + 4_000_000_000))
                    .collect(),
            ),
        };
        let len = serde_json::to_vec(&answer).unwrap().len();
        let body = PrefillRequest {
            transfer_id: String::new(),
            tokens: vec![0; prompt],
            kv_target: String::new(),
            shared_prefix: 0,
            held_tokens: 0,
            held_hash: String::new(),
            session: None,
            sampling: FirstTokenSampling {
                logprobs: Some(k),
                prompt_logprobs: Some(k),
                ..FirstTokenSampling::default()
            },
        };
        assert!(len < answer_cap(&body), "{len} >= {}", answer_cap(&body));
        // Without log probabilities the cap is small.
        let plain = PrefillRequest {
            sampling: FirstTokenSampling::default(),
            ..body
        };
        assert_eq!(answer_cap(&plain), 64 * 1024);
    }
}
