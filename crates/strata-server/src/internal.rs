//! The endpoints that are not the OpenAI API: health, the admin flush, and the cache views
//! routers read (cluster-authenticated when the worker has a key).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use strata_engine::{EngineHandle, EngineHealth, Event, FinishReason, FlushScope, SamplingParams};

use strata_protocol::{CacheEvents, CacheInfo, CacheSnapshot, Hex, Tier, WireEvent};

use crate::error::engine_error;
use crate::error::ApiError;
use crate::state::AppState;

type St = State<Arc<AppState>>;

/// 200 while the scheduler thread is alive and coming round its loop; 503 when it is dead
/// (the process exits too: see `watch_engine`), stalled, or shutting down.
pub(crate) async fn health(State(st): St) -> Response {
    match st.engine.health() {
        EngineHealth::Alive => Json(json!({"status": "ok"})).into_response(),
        h => engine_unhealthy(&h).into_response(),
    }
}

pub(crate) fn engine_unhealthy(h: &EngineHealth) -> ApiError {
    let msg = match h {
        EngineHealth::Alive => "ok".to_string(),
        EngineHealth::Dead(why) => format!("the engine is dead: {why}"),
        EngineHealth::Stalled(d) => format!(
            "the engine has not come round its loop for {:.1} s",
            d.as_secs_f64()
        ),
        EngineHealth::Closing => "the server is shutting down".to_string(),
    };
    ApiError {
        retry_after: Some(5),
        ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", msg)
    }
}

/// Resolves with the reason once the engine is dead (its scheduler thread panicked): the
/// server then exits non-zero so that a supervisor restarts it, instead of answering 503s
/// forever.
pub async fn watch_engine(engine: EngineHandle) -> String {
    loop {
        if let EngineHealth::Dead(why) = engine.health() {
            // Let the thread finish unwinding (its requests' errors go out meanwhile).
            let t = std::time::Instant::now();
            while !engine.has_ended() && t.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            return why;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Generates one real token through the engine.
pub(crate) async fn health_generate(State(st): St) -> Result<Json<Value>, ApiError> {
    let h = st.engine.health();
    if !h.is_alive() {
        return Err(engine_unhealthy(&h));
    }
    let first = st
        .tokenizer
        .encode("OK")
        .ok()
        .and_then(|v| v.first().copied())
        .unwrap_or(0);
    let params = SamplingParams {
        max_tokens: 1,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut rs = st
        .engine
        .submit(vec![first], params)
        .map_err(|e| ApiError::from_submit(&e))?;
    let wait = async {
        while let Some(ev) = rs.events.recv().await {
            if let Event::Done {
                reason,
                completion_tokens,
                ..
            } = ev
            {
                return (reason, completion_tokens);
            }
        }
        (FinishReason::Error("the engine stopped".into()), 0)
    };
    match tokio::time::timeout(Duration::from_secs(60), wait).await {
        Ok((FinishReason::Length, 1)) => Ok(Json(json!({"status": "ok", "generated_tokens": 1}))),
        Ok((r, _)) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("generation check failed: {r:?}"),
        )),
        Err(_) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "generation check timed out after 60 s",
        )),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FlushQuery {
    tier: Option<String>,
}

/// Internal endpoints (`/cache/*`): with a cluster key, only the deployment's own processes.
pub(crate) fn check_cluster(
    st: &AppState,
    headers: &HeaderMap,
    method: &str,
    uri: &axum::http::Uri,
) -> Result<(), ApiError> {
    match &st.cluster_key {
        Some(k) => {
            let target = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
            let call = crate::auth::Call {
                method,
                target,
                body: b"",
                prefill: None,
            };
            crate::auth::verify(k, &st.replay, headers, &call)
                .map_err(|e| crate::auth::unauthorized(&e))
        }
        None => Ok(()),
    }
}

/// Admin endpoints: the admin key, or the cluster's own processes; open only on a loopback
/// worker with neither key.
pub(crate) fn check_admin(
    st: &AppState,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
) -> Result<(), ApiError> {
    if st.cluster_key.is_some() {
        if headers.contains_key(crate::auth::AUTH_HEADER) {
            return check_cluster(st, headers, "POST", uri);
        }
        if st.admin_key.is_none() {
            return Err(crate::auth::unauthorized(
                "no cluster authentication (set --admin-key for operators)",
            ));
        }
    }
    let Some(key) = &st.admin_key else {
        return Ok(());
    };
    if crate::error::bearer_is(headers, key) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "this endpoint needs the admin key: Authorization: Bearer <key>",
        )
        .with_code("invalid_api_key"))
    }
}

/// Empties the cache tiers of pages no running request uses.
pub(crate) async fn flush_cache(
    State(st): St,
    headers: HeaderMap,
    uri: axum::http::Uri,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    check_admin(&st, &headers, &uri)?;
    let q: FlushQuery = crate::error::query(&uri)?;
    if !body.is_empty() {
        return Err(ApiError::flush_body());
    }
    let scope = match q.tier.as_deref() {
        None | Some("all") => FlushScope::All,
        Some("device") => FlushScope::Device,
        Some(t) => {
            return Err(ApiError::bad_request(
                format!("tier `{t}`: expected `device` or `all`"),
                Some("tier"),
            ))
        }
    };
    let e = st.engine.clone();
    let r = tokio::task::spawn_blocking(move || e.flush(scope))
        .await
        .ok()
        .flatten()
        .ok_or_else(|| engine_error("the engine stopped"))?;
    Ok(Json(
        json!({"flushed": if scope == FlushScope::All { "all" } else { "device" },
                   "device_pages_freed": r.0, "host_pages_freed": r.1}),
    ))
}

/// A cache event as it travels.
pub(crate) fn wire_event(seq: Option<u64>, e: &strata_kv::CacheEvent) -> WireEvent {
    WireEvent {
        seq,
        stored: e.stored,
        tier: match e.tier {
            strata_kv::Tier::Device => Tier::Device,
            strata_kv::Tier::Host => Tier::Host,
            strata_kv::Tier::Remote => Tier::Remote,
        },
        hashes: e.hashes.iter().map(|h| Hex(h.0)).collect(),
    }
}

/// What a router needs to hash prompts as this worker does.
pub(crate) async fn cache_info(
    State(st): St,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Result<Json<CacheInfo>, ApiError> {
    check_cluster(&st, &headers, "GET", &uri)?;
    let i = st.engine.info();
    let page = st.engine.events_since(0, 0);
    Ok(Json(CacheInfo {
        model_id: i.model_id.clone(),
        page_size: i.page_size,
        hash_key: i.hash_key.map(Hex),
        epoch: page.epoch,
        next: page.next,
    }))
}

/// Cache events (pages stored / removed per tier) from `since`; `resync: true` when they
/// fell out of the log.
pub(crate) async fn cache_events(
    State(st): St,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Result<Json<CacheEvents>, ApiError> {
    check_cluster(&st, &headers, "GET", &uri)?;
    let q: crate::error::SinceQuery = crate::error::query(&uri)?;
    let since = q.since.unwrap_or(0);
    let page = st.engine.events_since(since, 10_000);
    let resync = page.events.is_none();
    let events: Vec<WireEvent> = page
        .events
        .unwrap_or_default()
        .iter()
        .map(|(seq, e)| wire_event(Some(*seq), e))
        .collect();
    let next = if resync {
        page.next
    } else {
        since + events.len() as u64
    };
    Ok(Json(CacheEvents {
        epoch: page.epoch,
        first: page.first,
        next,
        resync,
        events,
    }))
}

/// Every page in the device and host tiers, and the sequence number events continue from.
pub(crate) async fn cache_snapshot(
    State(st): St,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Result<Json<CacheSnapshot>, ApiError> {
    check_cluster(&st, &headers, "GET", &uri)?;
    let e = st.engine.clone();
    let (epoch, next, tiers) = tokio::task::spawn_blocking(move || e.cache_snapshot())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| engine_error("the engine stopped"))?;
    Ok(Json(CacheSnapshot {
        epoch,
        next,
        tiers: tiers.iter().map(|e| wire_event(None, e)).collect(),
    }))
}
