//! HTTP serving for the router and the workers, bounded against idle and slow clients:
//!
//! * a request's headers must arrive within `header_timeout`, counted from the accept or
//!   from the end of the previous response (so it is also the idle keep-alive limit);
//! * its whole body within `body_timeout` (else 408, and the connection is closed), and no
//!   more than `body_limit` bytes of it (413);
//! * connections in all and per address are bounded ([`crate::places`]): when a bound is
//!   reached, the longest-idle connection yields to the newcomer, so idle or slow strangers
//!   cannot keep anybody else (a health check, a client) out;
//! * accept errors (out of file descriptors) back off instead of spinning; the process's
//!   descriptor limit is raised to its hard limit at start ([`raise_fd_limit`]).
//!
//! HTTP/1.1 only (what OpenAI's clients, Prometheus and the router speak).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Response;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::metrics::Text;
use crate::places::{Admit, PlaceLimits, Places};

/// What one HTTP listener allows.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub body_limit: usize,
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    /// Origins whose browsers may call the API (CORS; `*`: any); empty: no CORS headers.
    pub allowed_origins: Vec<String>,
    /// How long a stopping listener waits for its connections' requests to finish (their
    /// answers written out; a client that stops reading does not hold the process).
    pub drain: Duration,
}

impl HttpLimits {
    /// Defaults for a process whose descriptor limit is `fd_limit`: ¾ of it for connections,
    /// a quarter of those per address.
    pub fn for_fd_limit(fd_limit: u64, body_limit: usize) -> HttpLimits {
        let total = (fd_limit.saturating_mul(3) / 4).clamp(64, 1 << 20) as usize;
        HttpLimits {
            header_timeout: Duration::from_secs(20),
            body_timeout: Duration::from_secs(30),
            body_limit,
            max_connections: total,
            max_connections_per_ip: (total / 4).max(16),
            allowed_origins: Vec::new(),
            drain: Duration::from_secs(30),
        }
    }
}

/// The CORS layer of `--allowed-origins` (None when empty), or why an origin is not one:
/// `*` alone, or `http(s)://host[:port]` with no path. A browser on an allowed origin may send
/// the API's requests (preflight `OPTIONS` answered here, before any other check) and read
/// `X-Request-Id`; credentials (cookies) are never allowed.
pub fn cors(origins: &[String]) -> Result<Option<tower_http::cors::CorsLayer>, String> {
    use axum::http::{header, HeaderName, HeaderValue, Method};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        if origins.len() > 1 {
            return Err("--allowed-origins: `*` (any origin) stands alone".into());
        }
        AllowOrigin::any()
    } else {
        let mut list = Vec::with_capacity(origins.len());
        for o in origins {
            let rest = o
                .strip_prefix("https://")
                .or_else(|| o.strip_prefix("http://"));
            let ok = rest.is_some_and(|h| {
                !h.is_empty()
                    && !h.contains(['/', '?', '#', '@'])
                    && !h.contains(char::is_whitespace)
            });
            let v = HeaderValue::from_str(o).ok().filter(|_| ok);
            list.push(v.ok_or_else(|| {
                format!(
                    "--allowed-origins `{o}`: an origin is http(s)://host[:port], without a path \
                     (or `*` for any)"
                )
            })?);
        }
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([
                header::CONTENT_TYPE,
                header::AUTHORIZATION,
                HeaderName::from_static("x-request-id"),
            ])
            .expose_headers([HeaderName::from_static("x-request-id")])
            .max_age(Duration::from_secs(600)),
    ))
}

/// A connection's handle in the places: notified when it must yield.
type Handle = Arc<Notify>;

/// What an HTTP listener saw (for `/metrics`).
#[derive(Default)]
pub struct HttpStats {
    places: std::sync::OnceLock<Arc<Places<Handle>>>,
    accepted: AtomicU64,
    refused: AtomicU64,
    yielded: AtomicU64,
    header_timeouts: AtomicU64,
    body_timeouts: AtomicU64,
    accept_errors: AtomicU64,
}

impl HttpStats {
    /// Connections open now (0 before serving starts).
    pub fn open(&self) -> usize {
        self.places.get().map_or(0, |p| p.held())
    }

    /// Its samples, into `t`.
    pub fn render(&self, t: &mut Text) {
        t.sample("strata_http_connections", &[], self.open() as f64);
        for (outcome, n) in [
            ("accepted", &self.accepted),
            ("refused", &self.refused),
            ("yielded", &self.yielded),
            ("header_timeout", &self.header_timeouts),
        ] {
            t.sample(
                "strata_http_connections_total",
                &[("outcome", outcome)],
                n.load(Ordering::Relaxed) as f64,
            );
        }
        t.sample(
            "strata_http_body_timeouts_total",
            &[],
            self.body_timeouts.load(Ordering::Relaxed) as f64,
        );
        t.sample(
            "strata_http_accept_errors_total",
            &[],
            self.accept_errors.load(Ordering::Relaxed) as f64,
        );
    }
}

/// Raises this process's soft limit on open files to its hard limit; returns the soft limit
/// in force afterwards.
pub fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let r = getrlimit(Resource::Nofile);
    if r.current != r.maximum {
        let want = Rlimit {
            current: r.maximum,
            maximum: r.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, want) {
            tracing::warn!(error = %e, "cannot raise the open-file limit to its hard limit");
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Serves `app` on `listener` under `limits` until `stop` resolves; then stops accepting,
/// closes idle connections, lets requests in progress finish and returns when every
/// connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    (limits, gate): (HttpLimits, Option<Gate>),
    stats: Arc<HttpStats>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Taken out: the limits are copied to every connection (an empty list allocates nothing).
    let mut limits = limits;
    let origins = std::mem::take(&mut limits.allowed_origins);
    let app = match cors(&origins) {
        Ok(Some(layer)) => app.layer(layer),
        Ok(None) => app,
        Err(e) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)),
    };
    let places: Arc<Places<Handle>> = Places::new(PlaceLimits {
        total: limits.max_connections,
        per_addr: limits.max_connections_per_ip,
        protect: Duration::from_secs(1),
    });
    let _ = stats.places.set(places.clone());
    // A deep accept queue (the kernel caps it at net.core.somaxconn): a burst of connections
    // waits there instead of having its SYNs dropped (a dropped SYN costs a client 1 s).
    if let Err(e) = socket2::SockRef::from(&listener).listen(4096) {
        tracing::debug!(error = %e, "cannot deepen the accept queue");
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let bodies = Arc::new(tokio::sync::Semaphore::new(body_budget(limits.body_limit)));
    let mut acc = Acceptor {
        listener,
        backoff: Duration::from_millis(5),
        last_warned: None,
        spawner: Spawner {
            app,
            limits,
            stats,
            places,
            builder,
            stop_rx,
            open: Arc::new((AtomicUsize::new(0), Notify::new())),
            gate,
            bodies,
        },
    };
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            r = acc.accept() => r,
        };
        acc.spawner.spawn(stream, peer);
    }
    let (open, drain) = (acc.spawner.open.clone(), acc.spawner.limits.drain);
    drop(acc);
    let _ = stop_tx.send(true);
    // Requests in progress finish; a client that stops reading does not hold the process.
    let drained = async {
        loop {
            let n = open.1.notified();
            if open.0.load(Ordering::SeqCst) == 0 {
                return;
            }
            n.await;
        }
    };
    if tokio::time::timeout(drain, drained).await.is_err() {
        tracing::warn!(
            connections = open.0.load(Ordering::SeqCst),
            "connections still open {} s after the stop: closing them",
            drain.as_secs_f64()
        );
    }
    Ok(())
}

/// Bytes of request bodies received at once, in all: 256 MiB, or 16 bodies at the limit.
fn body_budget(body_limit: usize) -> usize {
    body_limit
        .saturating_mul(16)
        .clamp(256 << 20, tokio::sync::Semaphore::MAX_PERMITS)
}

/// A check of a request's head before any byte of its body is read (the router's API key):
/// Some(answer) refuses it.
pub type Gate = Arc<dyn Fn(&axum::http::request::Parts) -> Option<Response<Body>> + Send + Sync>;

/// The accept loop's state: accept errors back off from 5 ms to 1 s.
struct Acceptor {
    listener: TcpListener,
    backoff: Duration,
    last_warned: Option<Instant>,
    spawner: Spawner,
}

impl Acceptor {
    async fn accept(&mut self) -> (tokio::net::TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok(x) => {
                    self.backoff = Duration::from_millis(5);
                    return x;
                }
                Err(e) => {
                    self.spawner
                        .stats
                        .accept_errors
                        .fetch_add(1, Ordering::Relaxed);
                    let quiet = self
                        .last_warned
                        .is_some_and(|t| t.elapsed() < Duration::from_secs(10));
                    if !quiet {
                        self.last_warned = Some(Instant::now());
                        tracing::warn!(error = %e, backoff_ms = self.backoff.as_millis() as u64,
                            "cannot accept a connection; backing off (logged at most every 10 s)");
                    }
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// What every connection's task shares.
struct Spawner {
    app: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
    places: Arc<Places<Handle>>,
    builder: hyper::server::conn::http1::Builder,
    stop_rx: watch::Receiver<bool>,
    /// Connection tasks running, and a wake-up when one ends.
    open: Arc<(AtomicUsize, Notify)>,
    gate: Option<Gate>,
    bodies: Arc<tokio::sync::Semaphore>,
}

impl Spawner {
    /// Gives a newcomer a place (an idle connection may yield to it) and serves it on a task
    /// of its own; or closes it when every place is held by busy or protected connections.
    fn spawn(&self, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let stats = &self.stats;
        let handle: Handle = Arc::new(Notify::new());
        let place = match self.places.admit(peer.ip(), handle.clone(), false) {
            Admit::No => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                return; // dropped: closed
            }
            Admit::Yes { place, yielded } => {
                if let Some(y) = yielded {
                    stats.yielded.fetch_add(1, Ordering::Relaxed);
                    y.notify_one();
                }
                place
            }
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a connection");
        }
        self.open.0.fetch_add(1, Ordering::SeqCst);
        let conn = Conn {
            app: self.app.clone(),
            limits: self.limits.clone(),
            stats: stats.clone(),
            place: Arc::new(place),
            peer,
            gate: self.gate.clone(),
            bodies: self.bodies.clone(),
        };
        let (builder, mut stop_rx) = (self.builder.clone(), self.stop_rx.clone());
        let open = OpenGuard(self.open.clone());
        tokio::spawn(async move {
            let _open = open;
            let stats = conn.stats.clone();
            let svc = hyper::service::service_fn(move |req| conn.clone().handle(req));
            let c = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(c);
            tokio::select! {
                r = c.as_mut() => {
                    if let Err(e) = r {
                        if e.is_timeout() {
                            stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                // It yielded its place: it is idle (a response's last bytes may still be
                // on their way: a second to write them), then it is closed.
                _ = handle.notified() => {
                    c.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), c).await;
                }
                _ = async { stop_rx.wait_for(|s| *s).await.map(|_| ()) } => {
                    c.as_mut().graceful_shutdown();
                    let _ = c.await;
                }
            }
        });
    }
}

struct OpenGuard(Arc<(AtomicUsize, Notify)>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
        self.0 .1.notify_waiters();
    }
}

mod conn;

use conn::Conn;
