//! The decode worker's KV listener: where prefill workers send the K/V of prompts this worker
//! asked for. Everything a TCP peer can make it hold is bounded before it is allocated:
//! connections (in all, and before authentication per address), the handshake's time, every
//! frame's size and pace, the bytes staged, and which transfers are accepted at all (only ids
//! this worker drew, each once).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_engine::transfer::{self, Admit, Hello, Paced, Received, RecvLimits, TransferId};
use strata_kv::auth::ClusterKey;
use tokio::sync::Notify;

use crate::places::{self, Place, PlaceLimits, Places};

/// Bounds of the KV listener: everything a peer can make it hold.
#[derive(Clone, Debug)]
pub struct KvLimits {
    /// The address to tell prefill workers (None: the listener's own), e.g. the pod's IP when
    /// the listener binds 0.0.0.0.
    pub advertise: Option<SocketAddr>,
    /// Pages of this many bytes (a page's main part without its window part) are accepted
    /// beside whole pages (layouts with window kinds; None otherwise).
    pub main_page_bytes: Option<u64>,
    /// Bytes of received pages held at most (beyond: the sender is told to retry; a
    /// transfer larger than this is refused outright).
    pub staging: u64,
    /// Connections served at once (more are closed at accept).
    pub max_connections: usize,
    /// Of those, connections not yet authenticated, in all and from one address (a peer
    /// without the key cannot take the places of authenticated ones; the longest-idle
    /// stranger yields to a newcomer, see [`crate::places`]).
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_ip: usize,
    /// A stranger younger than this yields only to an address holding fewer places.
    pub protect: Duration,
    /// The handshake must complete within this.
    pub handshake_timeout: Duration,
    /// Longest wait for a frame to start.
    pub idle_timeout: Duration,
    /// A started frame must arrive at this rate (after a grace of one second).
    pub min_rate: u64,
    /// A transfer received and not claimed is dropped after this long (an expected one lives
    /// as long as the request that expects it).
    pub unclaimed_ttl: Duration,
    /// The receiver's context length: the most tokens one transfer may carry.
    pub max_tokens: usize,
    pub page_size: u32,
}

impl Default for KvLimits {
    fn default() -> Self {
        KvLimits {
            advertise: None,
            main_page_bytes: None,
            staging: 1 << 30,
            max_connections: 64,
            max_unauthenticated: 16,
            max_unauthenticated_per_ip: 4,
            protect: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(3),
            idle_timeout: Duration::from_secs(10),
            min_rate: 1 << 20,
            unclaimed_ttl: Duration::from_secs(120),
            max_tokens: 8192,
            page_size: 16,
        }
    }
}

enum Slot {
    /// A decode request waits for this id, for the pages from this index on (it holds the
    /// ones before).
    Expected(u32),
    /// Pages are arriving, with the bytes reserved for them.
    Receiving(u64),
    /// Pages are arriving for a request that gave up: the receiving thread releases the bytes
    /// when it ends (until then they still count).
    Abandoned(u64),
    Received(Instant, Received),
    Failed(String),
}

/// A connection's place: unauthenticated ones hold a place in the listener's [`Places`]
/// (where the longest-idle stranger yields to a newcomer); an authenticated one leaves them
/// and counts among the authenticated until it ends.
struct ConnTicket<'a> {
    inbox: &'a KvInbox,
    place: Option<Place<TcpStream>>,
    authenticated: bool,
}

impl ConnTicket<'_> {
    /// Leaves the unauthenticated places; false if this connection yielded its place
    /// meanwhile (it is being closed).
    fn authenticated(&mut self) -> bool {
        let Some(p) = self.place.take() else {
            return false;
        };
        if !p.release() {
            return false;
        }
        self.inbox.authenticated.fetch_add(1, Ordering::SeqCst);
        self.authenticated = true;
        true
    }
}

impl Drop for ConnTicket<'_> {
    fn drop(&mut self) {
        if self.authenticated {
            self.inbox.authenticated.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Handshake failures logged once per address and window: the first in a window is a
/// warning with its reason, the rest are counted into the next warning (and the metric).
struct PeerLog {
    window: Duration,
    seen: Mutex<HashMap<IpAddr, (Instant, u64)>>,
}

impl PeerLog {
    fn note(&self, ip: IpAddr, error: &dyn std::fmt::Display) {
        let ip = places::addr_key(ip);
        let now = Instant::now();
        let mut m = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= 4096 && !m.contains_key(&ip) {
            let w = self.window;
            m.retain(|_, (t, _)| now.duration_since(*t) < w);
            if m.len() >= 4096 {
                return; // more addresses than the log follows: counted in the metric only
            }
        }
        match m.get_mut(&ip) {
            Some((t, n)) if now.duration_since(*t) < self.window => *n += 1,
            other => {
                let earlier = other.map_or(0, |(_, n)| *n);
                m.insert(ip, (now, 0));
                drop(m);
                tracing::warn!(
                    peer = %ip,
                    error = %error,
                    earlier_unlogged = earlier,
                    window_s = self.window.as_secs(),
                    "KV connection refused (further refusals from this address within the \
                     window are counted, not logged)"
                );
            }
        }
    }
}

/// Transfers this decode worker asked for: only those are accepted, each once.
pub struct KvInbox {
    pub addr: SocketAddr,
    /// The address prefill workers are told to send K/V to (`addr` unless advertised).
    pub advertise: SocketAddr,
    hello: Hello,
    key: Option<ClusterKey>,
    page_bytes: u64,
    limits: KvLimits,
    staged: AtomicU64,
    /// Connections not yet authenticated.
    strangers: Arc<Places<TcpStream>>,
    authenticated: AtomicUsize,
    peer_log: PeerLog,
    slots: Mutex<HashMap<TransferId, Slot>>,
    notify: Notify,
    /// Transfers received / failed, bytes received, connections refused (for metrics).
    pub received: AtomicU64,
    pub failed: AtomicU64,
    pub bytes: AtomicU64,
    pub pages: AtomicU64,
    /// Time spent receiving transfers (first page announced to the last acknowledged).
    pub nanos: AtomicU64,
    pub refused_connections: AtomicU64,
    /// Unauthenticated connections closed to make room for a newcomer.
    pub yielded_connections: AtomicU64,
    /// Connections whose handshake failed (no key, wrong key, wrong format, too slow).
    pub handshake_failures: AtomicU64,
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
        let addr = listener.local_addr().expect("bound listener");
        let strangers = Places::new(PlaceLimits {
            total: limits.max_unauthenticated,
            per_addr: limits.max_unauthenticated_per_ip,
            protect: limits.protect,
        });
        let inbox = Arc::new(KvInbox {
            addr,
            advertise: limits.advertise.unwrap_or(addr),
            hello,
            key,
            page_bytes,
            limits,
            staged: AtomicU64::new(0),
            strangers,
            authenticated: AtomicUsize::new(0),
            peer_log: PeerLog {
                window: Duration::from_secs(60),
                seen: Mutex::new(HashMap::new()),
            },
            slots: Mutex::new(HashMap::new()),
            notify: Notify::new(),
            received: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            pages: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            yielded_connections: AtomicU64::new(0),
            handshake_failures: AtomicU64::new(0),
        });
        let me = inbox.clone();
        std::thread::Builder::new()
            .name("strata-kv-accept".into())
            .spawn(move || me.accept_loop(listener))
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

    /// Accepts connections, each served on a thread of its own once it has a place.
    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for conn in listener.incoming() {
            let Ok(conn) = conn else {
                // Out of descriptors or memory: back off instead of spinning.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            let Ok(peer) = conn.peer_addr() else { continue };
            let Some(place) = self.take_place(&conn, peer.ip()) else {
                self.refused_connections.fetch_add(1, Ordering::Relaxed);
                continue; // dropped: closed
            };
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("strata-kv-recv".into())
                .spawn(move || {
                    let ticket = ConnTicket {
                        inbox: &me,
                        place: Some(place),
                        authenticated: false,
                    };
                    me.serve(conn, ticket)
                });
            // A thread that cannot start drops its place (and connection) with it.
            drop(spawned);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TransferId, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a place for a new, unauthenticated connection from `ip`: refused (None) when
    /// every connection is authenticated, or when every stranger that could yield is still
    /// protected. A stranger that yields is closed here.
    fn take_place(&self, conn: &TcpStream, ip: IpAddr) -> Option<Place<TcpStream>> {
        let total = self.authenticated.load(Ordering::SeqCst) + self.strangers.held();
        let outer_full = total >= self.limits.max_connections;
        // A handle to close this connection if it must yield later.
        let handle = conn.try_clone().ok()?;
        match self.strangers.admit(ip, handle, outer_full) {
            places::Admit::No => None,
            places::Admit::Yes { place, yielded } => {
                if let Some(s) = yielded {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    self.yielded_connections.fetch_add(1, Ordering::Relaxed);
                }
                Some(place)
            }
        }
    }

    /// Drops transfers received longer ago than the limit, releasing their bytes. Expected
    /// ones live as long as their request (its `Expectation` removes them).
    fn purge(&self, now: Instant) {
        let ttl = self.limits.unclaimed_ttl;
        let mut m = self.lock();
        m.retain(|_, slot| match slot {
            Slot::Expected(_) => true,
            Slot::Received(t, r) => {
                let keep = now.duration_since(*t) <= ttl;
                if !keep {
                    self.release(r.pages.len() as u64 * self.page_bytes);
                }
                keep
            }
            Slot::Receiving(..) | Slot::Abandoned(_) | Slot::Failed(_) => true,
        });
    }

    fn release(&self, bytes: u64) {
        self.staged.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// The verdict on a `Begin` for `id` of `pages` pages from page `first` on.
    fn admit(&self, id: TransferId, first: u32, pages: u32) -> Admit {
        let want = pages as u64 * self.page_bytes;
        if want > self.limits.staging {
            return Admit::Refuse(format!(
                "the transfer needs {want} bytes; this receiver stages at most {} (--kv-staging)",
                self.limits.staging
            ));
        }
        let mut m = self.lock();
        match m.get(&id) {
            Some(&Slot::Expected(want)) if want == first => {}
            Some(&Slot::Expected(want)) => {
                return Admit::Refuse(format!(
                    "the transfer starts at page {first}; this receiver asked for the pages from {want} on"
                ))
            }
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

    fn serve(&self, conn: TcpStream, mut ticket: ConnTicket<'_>) {
        let peer_addr = conn.peer_addr().ok();
        let peer = peer_addr.map(|a| a.to_string()).unwrap_or_default();
        let _ = conn.set_nodelay(true);
        let _ = conn.set_write_timeout(Some(self.limits.idle_timeout));
        let mut link = Paced::new(
            conn,
            self.limits.idle_timeout,
            Duration::from_secs(1),
            self.limits.min_rate,
        );
        link.set_deadline(Some(Instant::now() + self.limits.handshake_timeout));
        // The place is left (or found gone) before `Accept` is written: a connection that
        // yielded meanwhile ends unanswered, and its sender retries.
        let r =
            transfer::handshake_accept_if(&mut link, &self.hello, self.key.as_ref(), &mut || {
                ticket.authenticated()
            });
        if let Err(e) = r {
            let yielded =
                !ticket.authenticated && ticket.place.as_ref().is_none_or(|p| !p.is_held());
            if !yielded {
                self.handshake_failures.fetch_add(1, Ordering::Relaxed);
                if let Some(a) = peer_addr {
                    self.peer_log.note(a.ip(), &e);
                }
            }
            return;
        }
        link.set_deadline(None);
        let lim = RecvLimits {
            page_bytes: self.page_bytes,
            main_page_bytes: self.limits.main_page_bytes,
            page_size: self.limits.page_size,
            max_tokens: self.limits.max_tokens,
        };
        loop {
            let mut admitted = None;
            let mut began = None;
            let mut admit = |id, first, pages| {
                let v = self.admit(id, first, pages);
                if v == Admit::Yes {
                    admitted = Some(id);
                    began = Some(Instant::now());
                }
                v
            };
            // A transfer whose request gave up is cut at the sender's next `Wait`.
            let mut wanted = |id| matches!(self.lock().get(&id), Some(Slot::Receiving(_)));
            let res = transfer::recv_kv_watched(&mut link, &lim, &mut admit, &mut wanted);
            if let Some(t) = began {
                self.nanos
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            match res {
                Ok(r) => self.landed(r),
                Err(e) => {
                    if let Some(id) = admitted {
                        self.failed_transfer(id, &e);
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

    /// A transfer received whole: its reservation now holds the pages; if its request gave
    /// up meanwhile, the pages are dropped here and their bytes released.
    fn landed(&self, r: Received) {
        self.received.fetch_add(1, Ordering::Relaxed);
        self.pages
            .fetch_add(r.pages.len() as u64, Ordering::Relaxed);
        self.bytes
            .fetch_add(r.pages.len() as u64 * self.page_bytes, Ordering::Relaxed);
        let mut m = self.lock();
        match m.remove(&r.id) {
            Some(Slot::Receiving(_)) => {
                m.insert(r.id, Slot::Received(Instant::now(), r));
            }
            Some(Slot::Abandoned(bytes)) => self.release(bytes),
            Some(other) => {
                m.insert(r.id, other);
            }
            None => {}
        }
        drop(m);
        self.notify.notify_waiters();
    }

    /// A transfer admitted and then failed: its staged bytes are released and its waiter
    /// told why.
    fn failed_transfer(&self, id: TransferId, e: &transfer::TransferError) {
        let mut m = self.lock();
        match m.remove(&id) {
            Some(Slot::Receiving(bytes)) => {
                self.release(bytes);
                m.insert(id, Slot::Failed(e.to_string()));
            }
            Some(Slot::Abandoned(bytes)) => self.release(bytes),
            Some(other) => {
                m.insert(id, other);
            }
            None => {}
        }
        drop(m);
        self.notify.notify_waiters();
    }

    /// Registers a transfer this worker will ask a prefill worker for, of the prompt's pages
    /// from index `first` on (it holds the ones before): its fresh random id is the only one a
    /// `Begin` may name, and for those pages only. Dropping the expectation forgets it (and
    /// frees any pages that arrived for it).
    pub fn expect(self: &Arc<Self>, first: u32) -> Expectation {
        let id = transfer::new_transfer_id();
        self.lock().insert(id, Slot::Expected(first));
        Expectation {
            inbox: self.clone(),
            id,
        }
    }

    /// The most bytes one transfer may stage (`--kv-staging`).
    pub fn staging_limit(&self) -> u64 {
        self.limits.staging
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Bytes staged now.
    pub fn staged_bytes(&self) -> u64 {
        self.staged.load(Ordering::SeqCst)
    }

    /// Connections being served now: (authenticated, not yet).
    pub fn connections(&self) -> (usize, usize) {
        (
            self.authenticated.load(Ordering::SeqCst),
            self.strangers.held(),
        )
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
                    Some(Slot::Abandoned(b)) => {
                        m.insert(self.id, Slot::Abandoned(b));
                        return Err("the transfer was abandoned".into());
                    }
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

impl Expectation {
    /// Resolves once the transfer has failed (the receiving side gave up: a peer silent too
    /// long, a bad frame), with why; pending while it is expected, arriving or arrived.
    pub async fn failed(&self) -> String {
        loop {
            let n = self.inbox.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            match self.inbox.lock().get(&self.id) {
                Some(Slot::Failed(why)) => return why.clone(),
                None => return "the transfer was dropped unclaimed".into(),
                Some(_) => {}
            }
            n.await;
        }
    }
}

impl Drop for Expectation {
    /// Forgets the transfer. Bytes held for received pages are released here; pages still
    /// arriving keep their reservation until the receiving thread ends (it releases them), so
    /// the staging bound holds for what is really in memory.
    fn drop(&mut self) {
        let mut m = self.inbox.lock();
        match m.remove(&self.id) {
            Some(Slot::Received(_, r)) => self
                .inbox
                .release(r.pages.len() as u64 * self.inbox.page_bytes),
            Some(Slot::Receiving(bytes)) => {
                m.insert(self.id, Slot::Abandoned(bytes));
            }
            _ => {}
        }
    }
}
