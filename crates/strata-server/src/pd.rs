//! Prefill/decode disaggregation on the worker side.
//!
//! A decode worker receives a client request (from the router) naming a prefill worker in the
//! `x-strata-prefill` header. It tokenizes the prompt and asks that worker (`POST /pd/prefill`)
//! to compute it and ship the K/V to this worker's KV listener ([`KvInbox`]); then it writes
//! the K/V into its own device pool and generates the rest, streaming as usual.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_engine::transfer::{self, Hello, OutPage, Received};
use strata_engine::{CachedTokens, Event, FinishReason, SamplingParams};
use tokio::sync::Notify;

use crate::app::AppState;
use crate::error::ApiError;

/// Transfers received and not yet claimed by their request.
pub struct KvInbox {
    pub addr: SocketAddr,
    hello: Hello,
    page_bytes: u64,
    /// Bytes staged at most (beyond: the sender is told to retry).
    limit: u64,
    staged: AtomicU64,
    map: Mutex<HashMap<u64, (Instant, Received)>>,
    notify: Notify,
    /// Transfers received / failed, bytes received (for metrics).
    pub received: AtomicU64,
    pub failed: AtomicU64,
    pub bytes: AtomicU64,
}

/// Unclaimed transfers are dropped after this long.
const UNCLAIMED_TTL: Duration = Duration::from_secs(120);

impl KvInbox {
    /// Starts accepting KV connections on `listener` (one thread per connection).
    pub fn start(listener: TcpListener, hello: Hello, page_bytes: u64, limit: u64) -> Arc<KvInbox> {
        let inbox = Arc::new(KvInbox {
            addr: listener.local_addr().expect("bound listener"),
            hello,
            page_bytes,
            limit,
            staged: AtomicU64::new(0),
            map: Mutex::new(HashMap::new()),
            notify: Notify::new(),
            received: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        let me = inbox.clone();
        std::thread::Builder::new()
            .name("strata-kv-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(conn) = conn else { continue };
                    let me = me.clone();
                    let _ = std::thread::Builder::new()
                        .name("strata-kv-recv".into())
                        .spawn(move || me.serve(conn));
                }
            })
            .expect("spawn the KV listener");
        inbox
    }

    fn serve(&self, mut conn: TcpStream) {
        let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
        let _ = conn.set_nodelay(true);
        if let Err(e) = transfer::handshake_accept(&mut conn, &self.hello) {
            tracing::warn!(%peer, error = %e, "KV connection refused");
            self.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        loop {
            let mut reserved = 0u64;
            let mut admit = |pages: u32| {
                let want = pages as u64 * self.page_bytes;
                let now = self.staged.load(Ordering::SeqCst);
                if now > 0 && now + want > self.limit {
                    return false;
                }
                self.staged.fetch_add(want, Ordering::SeqCst);
                reserved = want;
                true
            };
            let res = transfer::recv_kv(&mut conn, self.page_bytes, &mut admit);
            if res.is_err() {
                // Nothing of a failed transfer is kept.
                self.staged.fetch_sub(reserved, Ordering::SeqCst);
            }
            match res {
                Ok(r) => {
                    self.received.fetch_add(1, Ordering::Relaxed);
                    self.bytes
                        .fetch_add(r.pages.len() as u64 * self.page_bytes, Ordering::Relaxed);
                    let mut m = self.map.lock().expect("inbox lock");
                    let now = Instant::now();
                    let stale: Vec<u64> = m
                        .iter()
                        .filter(|(_, (t, _))| now.duration_since(*t) > UNCLAIMED_TTL)
                        .map(|(k, _)| *k)
                        .collect();
                    for k in stale {
                        if let Some((_, r)) = m.remove(&k) {
                            self.release(&r);
                        }
                    }
                    m.insert(r.id, (now, r));
                    drop(m);
                    self.notify.notify_waiters();
                }
                Err(transfer::TransferError::Io(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof =>
                {
                    return; // the sender closed the connection between transfers
                }
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "KV transfer failed");
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    fn release(&self, r: &Received) {
        self.staged
            .fetch_sub(r.pages.len() as u64 * self.page_bytes, Ordering::SeqCst);
    }

    /// Waits for transfer `id` until `deadline`.
    pub async fn take(&self, id: u64, deadline: Duration) -> Option<Received> {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some((_, r)) = self.map.lock().expect("inbox lock").remove(&id) {
                self.release(&r);
                return Some(r);
            }
            if tokio::time::timeout_at(end, n).await.is_err() {
                return None;
            }
        }
    }

    /// Bytes staged now.
    pub fn staged_bytes(&self) -> u64 {
        self.staged.load(Ordering::SeqCst)
    }
}

/// `POST /pd/prefill`: compute a prompt, ship its K/V to `kv_target`, answer the first token.
#[derive(Deserialize)]
pub struct PrefillRequest {
    pub id: u64,
    pub tokens: Vec<u32>,
    pub kv_target: String,
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "one")]
    pub top_p: f32,
    #[serde(default)]
    pub top_k: usize,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
}

fn one() -> f32 {
    1.0
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct PrefillResponse {
    pub first_token: u32,
    pub prompt_tokens: usize,
    pub cached_device: usize,
    pub cached_host: usize,
    pub cached_storage: usize,
    pub transfer_pages: u64,
    pub transfer_bytes: u64,
    pub transfer_seconds: f64,
}

fn bad_gateway(msg: String) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, "server_error", msg)
}

pub async fn prefill(
    State(st): State<Arc<AppState>>,
    Json(req): Json<PrefillRequest>,
) -> Result<Json<PrefillResponse>, ApiError> {
    let params = SamplingParams {
        max_tokens: 1,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        seed: req.seed,
        stop_token_ids: req.stop_token_ids.clone(),
        ignore_eos: req.ignore_eos,
    };
    let prompt_tokens = req.tokens.len();
    let mut rs = st
        .engine
        .submit_export(req.tokens.clone(), params)
        .map_err(|e| ApiError::from_submit(&e))?;
    let (mut first, mut kv, mut cached) = (None, None, CachedTokens::default());
    while let Some(ev) = rs.events.recv().await {
        match ev {
            Event::Admitted { cached: c } => cached = c,
            Event::Token(t) => first = Some(t),
            Event::Kv(k) => kv = Some(k),
            Event::Done { reason, .. } => {
                if matches!(reason, FinishReason::Error(_) | FinishReason::Aborted) {
                    return Err(bad_gateway(format!("prefill ended: {reason:?}")));
                }
            }
        }
    }
    let (Some(first), Some(kv)) = (first, kv) else {
        return Err(bad_gateway("prefill produced no token".into()));
    };
    let info = st.engine.info().clone();
    let hello = info.hello();
    let target = req.kv_target.clone();
    let (id, tokens) = (req.id, req.tokens);
    let deadline = st.kv_deadline;
    let stats = tokio::task::spawn_blocking(move || -> Result<_, transfer::TransferError> {
        let addr: SocketAddr = target.parse().map_err(|_| {
            transfer::TransferError::Protocol(format!("kv_target `{target}` is not host:port"))
        })?;
        let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        conn.set_read_timeout(Some(deadline))?;
        conn.set_write_timeout(Some(deadline))?;
        conn.set_nodelay(true)?;
        transfer::handshake_connect(&mut conn, &hello)?;
        let pages: Vec<OutPage> = kv
            .pages
            .iter()
            .zip(&kv.hashes)
            .map(|(d, h)| OutPage { hash: *h, data: d })
            .collect();
        transfer::send_kv(&mut conn, id, &tokens, &pages, deadline)
    })
    .await
    .map_err(|e| bad_gateway(format!("KV transfer task: {e}")))?
    .map_err(|e| {
        st.transfer_failures.fetch_add(1, Ordering::Relaxed);
        bad_gateway(format!("KV transfer to {}: {e}", req.kv_target))
    })?;
    tracing::debug!(
        id,
        pages = stats.pages,
        bytes = stats.bytes,
        seconds = stats.seconds,
        "KV sent (bytes, seconds)"
    );
    st.transfers_sent.fetch_add(1, Ordering::Relaxed);
    st.transfer_bytes_sent
        .fetch_add(stats.bytes, Ordering::Relaxed);
    Ok(Json(PrefillResponse {
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

/// The decode side of a PD request: ask the prefill worker at `prefill_url` to compute the
/// prompt and send its K/V here, then continue generation in this engine.
pub async fn decode_after_remote_prefill(
    st: &Arc<AppState>,
    prefill_url: &str,
    ids: Vec<u32>,
    params: SamplingParams,
) -> Result<strata_engine::RequestStream, ApiError> {
    let Some(inbox) = &st.kv else {
        return Err(ApiError::bad_request(
            "this worker has no KV listener: start it with --role decode (or both)",
            None,
        ));
    };
    // Refuse before any remote work what this worker could not run anyway.
    let info = st.engine.info();
    let needed = ids.len() + params.max_tokens;
    if needed > info.context_length
        || needed.div_ceil(info.page_size) * info.page_size > info.device_tokens
    {
        return Err(ApiError::from_submit(
            &strata_engine::SubmitError::TooLongForPool {
                prompt: ids.len(),
                max_tokens: params.max_tokens,
                needed,
                capacity: info.device_tokens.min(info.context_length),
            },
        ));
    }
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = (std::process::id() as u64) << 32 | NEXT.fetch_add(1, Ordering::Relaxed);
    let body = serde_json::json!({
        "id": id, "tokens": ids, "kv_target": inbox.addr.to_string(),
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "seed": params.seed, "stop_token_ids": params.stop_token_ids, "ignore_eos": params.ignore_eos,
    });
    let url = format!("{}/pd/prefill", prefill_url.trim_end_matches('/'));
    let r = st
        .http
        .post(&url)
        .timeout(st.kv_deadline + Duration::from_secs(600))
        .json(&body)
        .send()
        .await
        .map_err(|e| bad_gateway(format!("prefill worker {prefill_url}: {e}")))?;
    let status = r.status();
    if !status.is_success() {
        let text = r.text().await.unwrap_or_default();
        return Err(bad_gateway(format!(
            "prefill worker {prefill_url} answered {status}: {text}"
        )));
    }
    let pr: PrefillResponse = r
        .json()
        .await
        .map_err(|e| bad_gateway(format!("prefill worker {prefill_url}: bad answer: {e}")))?;
    let got = inbox.take(id, st.kv_deadline).await.ok_or_else(|| {
        bad_gateway(format!(
            "the K/V of request {id} did not arrive within {:?}",
            st.kv_deadline
        ))
    })?;
    if got.tokens != ids {
        return Err(bad_gateway(format!(
            "the K/V of request {id} is for other tokens"
        )));
    }
    let kv = strata_engine::ImportedKv {
        pages: got.pages,
        first_token: pr.first_token,
        cached: CachedTokens {
            device: pr.cached_device,
            host: pr.cached_host,
            storage: pr.cached_storage,
        },
    };
    st.engine
        .submit_prefilled(ids, params, kv)
        .map_err(|e| ApiError::from_submit(&e))
}
