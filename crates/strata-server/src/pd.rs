//! Prefill/decode disaggregation on the worker side.
//!
//! A decode worker receives a client request (from the router) naming a prefill worker in the
//! `x-strata-prefill` header. It tokenizes the prompt and asks that worker (`POST /pd/prefill`)
//! to compute it and ship the K/V to this worker's KV listener ([`KvInbox`]); then it writes
//! the K/V into its own device pool and generates the rest, streaming as usual.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_engine::transfer::{
    self, Admit, Hello, OutPage, Paced, Received, RecvLimits, TransferId,
};
use strata_engine::{CachedTokens, Event, FinishReason, SamplingParams};
use strata_kv::auth::ClusterKey;
use tokio::sync::Notify;

use crate::app::AppState;
use crate::error::ApiError;

/// Bounds of the KV listener: everything a peer can make it hold.
#[derive(Clone, Debug)]
pub struct KvLimits {
    /// Bytes of received pages held at most (beyond: the sender is told to retry; a
    /// transfer larger than this is refused outright).
    pub staging: u64,
    /// Connections served at once (more are closed at accept).
    pub max_connections: usize,
    /// The handshake must complete within this.
    pub handshake_timeout: Duration,
    /// Longest wait for a frame to start.
    pub idle_timeout: Duration,
    /// A started frame must arrive at this rate (after a grace of one second).
    pub min_rate: u64,
    /// A transfer expected or received and not claimed is dropped after this long.
    pub unclaimed_ttl: Duration,
    /// The receiver's context length: the most tokens one transfer may carry.
    pub max_tokens: usize,
    pub page_size: u32,
}

impl Default for KvLimits {
    fn default() -> Self {
        KvLimits {
            staging: 1 << 30,
            max_connections: 64,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            min_rate: 1 << 20,
            unclaimed_ttl: Duration::from_secs(120),
            max_tokens: 8192,
            page_size: 16,
        }
    }
}

enum Slot {
    /// A decode request waits for this id (since).
    Expected(Instant),
    /// Pages are arriving, with the bytes reserved for them.
    Receiving(u64),
    Received(Instant, Received),
    Failed(String),
}

/// Transfers this decode worker asked for: only those are accepted, each once.
pub struct KvInbox {
    pub addr: SocketAddr,
    hello: Hello,
    key: Option<ClusterKey>,
    page_bytes: u64,
    limits: KvLimits,
    staged: AtomicU64,
    conns: AtomicUsize,
    slots: Mutex<HashMap<TransferId, Slot>>,
    notify: Notify,
    /// Transfers received / failed, bytes received, connections refused (for metrics).
    pub received: AtomicU64,
    pub failed: AtomicU64,
    pub bytes: AtomicU64,
    pub refused_connections: AtomicU64,
}

/// Frees a connection's place when its thread ends.
struct ConnSlot<'a>(&'a AtomicUsize);
impl Drop for ConnSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl KvInbox {
    /// Starts accepting KV connections on `listener` (a thread per connection, at most
    /// `limits.max_connections`) and a thread that purges unclaimed transfers.
    pub fn start(
        listener: TcpListener,
        hello: Hello,
        page_bytes: u64,
        limits: KvLimits,
        key: Option<ClusterKey>,
    ) -> Arc<KvInbox> {
        let inbox = Arc::new(KvInbox {
            addr: listener.local_addr().expect("bound listener"),
            hello,
            key,
            page_bytes,
            limits,
            staged: AtomicU64::new(0),
            conns: AtomicUsize::new(0),
            slots: Mutex::new(HashMap::new()),
            notify: Notify::new(),
            received: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
        });
        let me = inbox.clone();
        std::thread::Builder::new()
            .name("strata-kv-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(conn) = conn else { continue };
                    let n = me.conns.fetch_add(1, Ordering::SeqCst);
                    if n >= me.limits.max_connections {
                        me.conns.fetch_sub(1, Ordering::SeqCst);
                        me.refused_connections.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("KV connection refused: at the connection limit");
                        continue; // dropped: closed
                    }
                    let me = me.clone();
                    let spawned = std::thread::Builder::new()
                        .name("strata-kv-recv".into())
                        .spawn({
                            let me = me.clone();
                            move || {
                                let _slot = ConnSlot(&me.conns);
                                me.serve(conn)
                            }
                        });
                    if spawned.is_err() {
                        me.conns.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .expect("spawn the KV listener");
        let weak = Arc::downgrade(&inbox);
        std::thread::Builder::new()
            .name("strata-kv-purge".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                match weak.upgrade() {
                    Some(i) => i.purge(Instant::now()),
                    None => return,
                }
            })
            .expect("spawn the KV purger");
        inbox
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TransferId, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops transfers expected or received longer ago than the limit, releasing their bytes.
    fn purge(&self, now: Instant) {
        let ttl = self.limits.unclaimed_ttl;
        let mut m = self.lock();
        m.retain(|_, slot| match slot {
            Slot::Expected(t) => now.duration_since(*t) <= ttl,
            Slot::Received(t, r) => {
                let keep = now.duration_since(*t) <= ttl;
                if !keep {
                    self.release(r.pages.len() as u64 * self.page_bytes);
                }
                keep
            }
            Slot::Receiving(..) | Slot::Failed(_) => true,
        });
    }

    fn release(&self, bytes: u64) {
        self.staged.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// The verdict on a `Begin` for `id` of `pages` pages.
    fn admit(&self, id: TransferId, pages: u32) -> Admit {
        let want = pages as u64 * self.page_bytes;
        if want > self.limits.staging {
            return Admit::Refuse(format!(
                "the transfer needs {want} bytes; this receiver stages at most {} (--kv-staging)",
                self.limits.staging
            ));
        }
        let mut m = self.lock();
        match m.get(&id) {
            Some(Slot::Expected(_)) => {}
            _ => return Admit::Refuse("unknown or duplicate transfer id".into()),
        }
        let now = self.staged.load(Ordering::SeqCst);
        if now + want > self.limits.staging {
            return Admit::Busy("the receiver's staging area is full now".into());
        }
        self.staged.fetch_add(want, Ordering::SeqCst);
        m.insert(id, Slot::Receiving(want));
        Admit::Yes
    }

    fn serve(&self, conn: TcpStream) {
        let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let _ = conn.set_nodelay(true);
        let _ = conn.set_write_timeout(Some(self.limits.idle_timeout));
        let mut link = Paced::new(
            conn,
            self.limits.idle_timeout,
            Duration::from_secs(1),
            self.limits.min_rate,
        );
        link.set_deadline(Some(Instant::now() + self.limits.handshake_timeout));
        if let Err(e) = transfer::handshake_accept(&mut link, &self.hello, self.key.as_ref()) {
            tracing::warn!(%peer, error = %e, "KV connection refused");
            self.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        link.set_deadline(None);
        let lim = RecvLimits {
            page_bytes: self.page_bytes,
            page_size: self.limits.page_size,
            max_tokens: self.limits.max_tokens,
        };
        loop {
            let mut admitted = None;
            let res = transfer::recv_kv(&mut link, &lim, &mut |id, pages| {
                let v = self.admit(id, pages);
                if v == Admit::Yes {
                    admitted = Some(id);
                }
                v
            });
            match res {
                Ok(r) => {
                    self.received.fetch_add(1, Ordering::Relaxed);
                    self.bytes
                        .fetch_add(r.pages.len() as u64 * self.page_bytes, Ordering::Relaxed);
                    let mut m = self.lock();
                    // Its reservation now holds the pages; if its request gave up meanwhile,
                    // the slot is gone, its bytes released, and the pages are dropped here.
                    if let Some(Slot::Receiving(..)) = m.get(&r.id) {
                        m.insert(r.id, Slot::Received(Instant::now(), r));
                    }
                    drop(m);
                    self.notify.notify_waiters();
                }
                Err(e) => {
                    if let Some(id) = admitted {
                        let mut m = self.lock();
                        if let Some(Slot::Receiving(bytes)) = m.get(&id) {
                            self.release(*bytes);
                            m.insert(id, Slot::Failed(e.to_string()));
                        }
                        drop(m);
                        self.notify.notify_waiters();
                    }
                    if matches!(&e, transfer::TransferError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
                        && admitted.is_none()
                    {
                        return; // the sender closed the connection between transfers
                    }
                    tracing::warn!(%peer, error = %e, "KV transfer failed");
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    /// Registers a transfer this worker will ask a prefill worker for: its fresh random id is
    /// the only one a `Begin` may name. Dropping the expectation forgets it (and frees any
    /// pages that arrived for it).
    pub fn expect(self: &Arc<Self>) -> Expectation {
        let id = transfer::new_transfer_id();
        self.lock().insert(id, Slot::Expected(Instant::now()));
        Expectation {
            inbox: self.clone(),
            id,
        }
    }

    /// Bytes staged now.
    pub fn staged_bytes(&self) -> u64 {
        self.staged.load(Ordering::SeqCst)
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.conns.load(Ordering::SeqCst)
    }

    /// Transfers expected, arriving or waiting to be claimed.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }
}

/// A transfer this worker waits for.
pub struct Expectation {
    inbox: Arc<KvInbox>,
    pub id: TransferId,
}

impl Expectation {
    /// Waits for the pages until `deadline`; Err says why they did not come.
    pub async fn take(&self, deadline: Duration) -> Result<Received, String> {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            let n = self.inbox.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            {
                let mut m = self.inbox.lock();
                match m.remove(&self.id) {
                    Some(Slot::Received(_, r)) => {
                        self.inbox
                            .release(r.pages.len() as u64 * self.inbox.page_bytes);
                        return Ok(r);
                    }
                    Some(Slot::Failed(why)) => return Err(why),
                    Some(other) => {
                        m.insert(self.id, other);
                    }
                    None => return Err("the transfer was dropped unclaimed".into()),
                }
            }
            if tokio::time::timeout_at(end, n).await.is_err() {
                return Err(format!("the K/V did not arrive within {deadline:?}"));
            }
        }
    }
}

impl Drop for Expectation {
    /// Forgets the transfer. Bytes reserved or held for it are released here; a receiving
    /// thread that finishes later finds no slot and keeps nothing.
    fn drop(&mut self) {
        match self.inbox.lock().remove(&self.id) {
            Some(Slot::Received(_, r)) => self
                .inbox
                .release(r.pages.len() as u64 * self.inbox.page_bytes),
            Some(Slot::Receiving(bytes)) => self.inbox.release(bytes),
            _ => {}
        }
    }
}

/// `POST /pd/prefill`: compute a prompt, ship its K/V to `kv_target`, answer the first token.
#[derive(Serialize, Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct PrefillRequest {
    /// The transfer id the decode worker expects (32 hex digits).
    pub transfer_id: String,
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
    if let Some(k) = &st.cluster_key {
        crate::auth::verify(k, &headers, "POST", "/pd/prefill")
            .map_err(|e| crate::auth::unauthorized(&e))?;
    }
    let req: PrefillRequest = crate::app::parse(body, st.body_limit)?;
    let id = strata_kv::auth::unhex(&req.transfer_id)
        .filter(|b| b.len() == 16)
        .map(|b| u128::from_le_bytes(b.try_into().expect("16 bytes")))
        .ok_or_else(|| {
            ApiError::bad_request("transfer_id: expected 32 hex digits", Some("transfer_id"))
        })?;
    let addr = kv_target(&st, &req.kv_target)?;
    let sane = (0.0..=2.0).contains(&req.temperature) && req.top_p > 0.0 && req.top_p <= 1.0;
    if !sane {
        return Err(ApiError::bad_request(
            "temperature must be in [0, 2] and top_p in (0, 1]",
            Some("temperature"),
        ));
    }
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
                if let FinishReason::QueueTimeout { waited } = reason {
                    return Err(ApiError::queue_timeout(waited));
                }
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
    let tokens = req.tokens;
    let deadline = st.kv_deadline;
    let key = st.cluster_key.clone();
    let stats = tokio::task::spawn_blocking(move || -> Result<_, transfer::TransferError> {
        let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        conn.set_read_timeout(Some(deadline))?;
        conn.set_write_timeout(Some(deadline))?;
        conn.set_nodelay(true)?;
        transfer::handshake_connect(&mut conn, &hello, key.as_ref())?;
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
        pages = stats.pages,
        bytes = stats.bytes,
        seconds = stats.seconds,
        "KV sent (bytes, seconds)"
    );
    st.transfers_sent.fetch_add(1, Ordering::Relaxed);
    st.transfer_bytes_sent
        .fetch_add(stats.bytes, Ordering::Relaxed);
    st.transfer_nanos_sent
        .fetch_add((stats.seconds * 1e9) as u64, Ordering::Relaxed);
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

/// Whether this decode worker may follow `x-strata-prefill: url` on this request: only from the
/// router (cluster-authenticated when a key is set) and only to a configured prefill worker.
/// Nothing is sent anywhere before this passes.
pub fn check_prefill_header(
    st: &AppState,
    headers: &HeaderMap,
    path: &str,
    url: &str,
) -> Result<(), ApiError> {
    if let Some(k) = &st.cluster_key {
        crate::auth::verify(k, headers, "POST", path).map_err(|e| {
            crate::auth::unauthorized(&format!(
                "{} is honoured only from the router ({e})",
                crate::app::PREFILL_HEADER
            ))
        })?;
    }
    let url = url.trim_end_matches('/');
    if !st
        .prefill_workers
        .iter()
        .any(|w| w.trim_end_matches('/') == url)
    {
        return Err(ApiError::bad_request(
            format!(
                "{} names no prefill worker this decode worker is configured with (--prefill-worker)",
                crate::app::PREFILL_HEADER
            ),
            None,
        ));
    }
    Ok(())
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
    let needed = ids.len().saturating_add(params.max_tokens);
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
    let exp = inbox.expect();
    let body = PrefillRequest {
        transfer_id: strata_kv::auth::hex(&exp.id.to_le_bytes()),
        tokens: ids.clone(),
        kv_target: inbox.addr.to_string(),
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k,
        seed: params.seed,
        stop_token_ids: params.stop_token_ids.clone(),
        ignore_eos: params.ignore_eos,
    };
    let url = format!("{}/pd/prefill", prefill_url.trim_end_matches('/'));
    let mut req = st
        .http
        .post(&url)
        .timeout(st.kv_deadline + Duration::from_secs(600))
        .json(&body);
    if let Some(k) = &st.cluster_key {
        req = req.header(
            crate::auth::AUTH_HEADER,
            crate::auth::sign(k, "POST", "/pd/prefill"),
        );
    }
    let r = req
        .send()
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
    let pr: PrefillResponse = r
        .json()
        .await
        .map_err(|e| bad_gateway(format!("prefill worker {prefill_url}: bad answer: {e}")))?;
    let got = exp
        .take(st.kv_deadline)
        .await
        .map_err(|e| bad_gateway(format!("KV transfer: {e}")))?;
    drop(exp);
    if got.tokens != ids {
        return Err(bad_gateway("the K/V received is for other tokens".into()));
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
