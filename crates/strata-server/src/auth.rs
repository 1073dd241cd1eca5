//! Cluster authentication of HTTP calls between Strata processes (router → worker, decode
//! worker → prefill worker): the header
//! `x-strata-cluster-auth: v3.<unix ms>.<nonce>.<instance>.<MAC>`, the MAC (keyed with the
//! deployment's cluster key) covering the method, the path with its query, the time, the nonce,
//! the receiver's instance, a hash of the body and the `x-strata-prefill` header. A header is
//! valid for [`SKEW`] either side of the receiver's clock, at one receiver, and once: the
//! receiver remembers the nonces it accepted within the window, so a captured call cannot be
//! replayed to it, and refuses a call signed for another instance, so neither can it be replayed
//! to another worker of the deployment or to this one after a restart (which forgets the
//! nonces). The key itself never travels.
//!
//! An instance is 16 random bytes a process draws at start; it is not secret. A worker names
//! it on every answer ([`INSTANCE_HEADER`], with a cluster key); a sender remembers each peer's
//! ([`Peers`]) and, when a call comes back 401 signed for another instance (the first call to a
//! peer, or the peer restarted), learns the new one and sends the call once more ([`send`]).
//!
//! Without a cluster key, workers listen on loopback only, and these surfaces are open to local
//! processes (stated at start-up).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use strata_kv::auth::{hex, unhex, ClusterKey};

use crate::error::ApiError;

/// The header carrying a cluster MAC.
pub const AUTH_HEADER: &str = "x-strata-cluster-auth";
/// The header naming the instance of the worker that answers (with a cluster key).
pub const INSTANCE_HEADER: &str = "x-strata-instance";
/// How far apart the two clocks may be.
pub const SKEW: Duration = Duration::from_secs(60);
const CONTEXT: &str = "strata cluster http v3";
/// Nonces remembered at most (beyond: the oldest are forgotten early; a replay then still
/// needs a nonce older than the rest of the window).
const MAX_NONCES: usize = 1 << 20;

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What a call's MAC covers besides the time and the nonce.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub method: &'a str,
    /// Path and query, as sent (`/cache/events?since=3`).
    pub target: &'a str,
    pub body: &'a [u8],
    /// The `x-strata-prefill` header, if any.
    pub prefill: Option<&'a str>,
}

/// One process's identity for the life of the process: random, never all zeros (the instance a
/// sender signs for before it has learnt its peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instance([u8; 16]);

impl Instance {
    const UNKNOWN: Instance = Instance([0; 16]);

    fn draw() -> Instance {
        loop {
            let mut b = [0u8; 16];
            getrandom::fill(&mut b).expect("the operating system's random source");
            if b != [0; 16] {
                return Instance(b);
            }
        }
    }

    /// 32 hex digits.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }

    /// From 32 hex digits.
    pub fn parse(s: &str) -> Option<Instance> {
        unhex(s).and_then(|b| b.try_into().ok()).map(Instance)
    }

    /// [`INSTANCE_HEADER`]'s value.
    pub fn header(&self) -> HeaderValue {
        HeaderValue::from_str(&self.hex()).expect("hex is ASCII")
    }
}

fn mac(key: &ClusterKey, c: &Call, ts: u64, nonce: &[u8], to: Instance) -> [u8; 32] {
    key.mac(
        CONTEXT,
        &[
            c.method.as_bytes(),
            c.target.as_bytes(),
            &ts.to_le_bytes(),
            nonce,
            &to.0,
            blake3::hash(c.body).as_bytes(),
            c.prefill.unwrap_or("").as_bytes(),
        ],
    )
}

/// The header value for `call` to the process `to` (`None`: not learnt yet, and refused by
/// every receiver, which then names its instance).
pub fn sign(key: &ClusterKey, to: Option<Instance>, call: &Call) -> HeaderValue {
    let ts = now_ms();
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).expect("the operating system's random source");
    let to = to.unwrap_or(Instance::UNKNOWN);
    let m = mac(key, call, ts, &nonce, to);
    let v = format!("v3.{ts}.{}.{}.{}", hex(&nonce), to.hex(), hex(&m));
    HeaderValue::from_str(&v).expect("ASCII")
}

/// The instances of the processes this one calls, by base URL (the URLs come from flags, so
/// the map is as large as the deployment).
#[derive(Default)]
pub struct Peers {
    known: Mutex<HashMap<String, Instance>>,
}

impl Peers {
    fn of(&self, base: &str) -> Option<Instance> {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.get(base.trim_end_matches('/')).copied()
    }

    /// Remembers the instance `r` names (any answer of a peer with a cluster key names it).
    pub fn learn(&self, base: &str, r: &reqwest::Response) -> Option<Instance> {
        let i = r
            .headers()
            .get(INSTANCE_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(Instance::parse)
            .filter(|i| *i != Instance::UNKNOWN)?;
        let base = base.trim_end_matches('/');
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if known.get(base) != Some(&i) {
            known.insert(base.to_string(), i);
        }
        Some(i)
    }
}

/// Sends `call` to the peer at `base` (`build` makes the request without the cluster header,
/// so it can be made twice), signed when there is a key. A 401 that names an instance other
/// than the one signed for (a first call, or the peer restarted) is learnt from, and the call
/// sent once more, signed for it; any other answer is returned as it is.
pub async fn send(
    peers: &Peers,
    key: Option<&ClusterKey>,
    base: &str,
    call: &Call<'_>,
    build: impl Fn() -> reqwest::RequestBuilder,
) -> reqwest::Result<reqwest::Response> {
    let Some(key) = key else {
        return build().send().await;
    };
    let mut to = peers.of(base);
    let mut tries = 0;
    loop {
        let r = build()
            .header(AUTH_HEADER, sign(key, to, call))
            .send()
            .await?;
        tries += 1;
        let named = peers.learn(base, &r);
        let other = named.is_some() && named != to;
        if r.status() != reqwest::StatusCode::UNAUTHORIZED || !other || tries == 2 {
            return Ok(r);
        }
        to = named;
    }
}

/// Nonces seen, and (time, nonce) in the order they came.
type Seen = (HashSet<[u8; 16]>, VecDeque<(u64, [u8; 16])>);

/// What a receiving process keeps: its instance, and the nonces it accepted within the window.
pub struct ReplayGuard {
    instance: Instance,
    /// [`INSTANCE_HEADER`]'s value, made once (it goes on every answer).
    header: HeaderValue,
    seen: Mutex<Seen>,
}

impl Default for ReplayGuard {
    fn default() -> Self {
        let instance = Instance::draw();
        ReplayGuard {
            instance,
            header: instance.header(),
            seen: Mutex::default(),
        }
    }
}

impl ReplayGuard {
    /// This process's instance.
    pub fn instance(&self) -> Instance {
        self.instance
    }

    /// [`INSTANCE_HEADER`]'s value naming this process's instance.
    pub fn instance_header(&self) -> &HeaderValue {
        &self.header
    }

    /// Records `nonce` (sent at `ts`); false if it was seen already.
    fn fresh(&self, ts: u64, nonce: [u8; 16]) -> bool {
        let mut g = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let (set, order) = &mut *g;
        let horizon = now_ms().saturating_sub(2 * SKEW.as_millis() as u64);
        while let Some(&(t, n)) = order.front() {
            if t >= horizon && order.len() < MAX_NONCES {
                break;
            }
            set.remove(&n);
            order.pop_front();
        }
        if !set.insert(nonce) {
            return false;
        }
        order.push_back((ts, nonce));
        true
    }
}

/// Checks a call's header; the error names what is wrong without echoing anything secret.
pub fn verify(
    key: &ClusterKey,
    replay: &ReplayGuard,
    headers: &HeaderMap,
    call: &Call,
) -> Result<(), String> {
    let v = headers
        .get(AUTH_HEADER)
        .ok_or_else(|| format!("no {AUTH_HEADER} header"))?
        .to_str()
        .map_err(|_| format!("{AUTH_HEADER} is not ASCII"))?;
    let parts: Vec<&str> = v.split('.').collect();
    let ["v3", ts, nonce, to, given] = parts.as_slice() else {
        return Err(format!(
            "{AUTH_HEADER} is not v3.<ms>.<nonce>.<instance>.<mac>"
        ));
    };
    let ts: u64 = ts.parse().map_err(|_| format!("{AUTH_HEADER}: bad time"))?;
    let skew = now_ms().abs_diff(ts);
    if skew > SKEW.as_millis() as u64 {
        return Err(format!(
            "{AUTH_HEADER} is {:.0} s away from this worker's clock (at most {} s)",
            skew as f64 / 1e3,
            SKEW.as_secs()
        ));
    }
    let nonce: [u8; 16] = unhex(nonce)
        .and_then(|n| n.try_into().ok())
        .ok_or_else(|| format!("{AUTH_HEADER}: the nonce is not 32 hex digits"))?;
    let to = Instance::parse(to)
        .ok_or_else(|| format!("{AUTH_HEADER}: the instance is not 32 hex digits"))?;
    if to != replay.instance {
        return Err(format!(
            "{AUTH_HEADER} is signed for another instance (this worker's is in {INSTANCE_HEADER}: \
             a first call, a restart, or a call meant for another worker)"
        ));
    }
    let given = unhex(given).ok_or_else(|| format!("{AUTH_HEADER}: the MAC is not hex"))?;
    let want = mac(key, call, ts, &nonce, to);
    if !constant_time_eq::constant_time_eq(&want, &given) {
        return Err(format!(
            "{AUTH_HEADER}: wrong MAC (another cluster key, or the call was altered)"
        ));
    }
    if !replay.fresh(ts, nonce) {
        return Err(format!(
            "{AUTH_HEADER}: this call was seen already (a replay)"
        ));
    }
    Ok(())
}

/// 401 for a call that failed cluster authentication.
pub fn unauthorized(why: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        format!("this endpoint is for the deployment's own processes: {why}"),
    )
    .with_code("cluster_auth_failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call<'a>(method: &'a str, target: &'a str, body: &'a [u8]) -> Call<'a> {
        Call {
            method,
            target,
            body,
            prefill: None,
        }
    }

    #[test]
    fn signed_calls_verify_once_and_only_as_signed() {
        let k = ClusterKey::from_secret(&[3; 32]).unwrap();
        let g = ReplayGuard::default();
        let c = call("POST", "/pd/prefill", b"{\"a\":1}");
        let mut h = HeaderMap::new();
        h.insert(AUTH_HEADER, sign(&k, Some(g.instance()), &c));
        // Anything altered: refused (and the nonce is not spent by a failed check).
        for other in [
            call("GET", "/pd/prefill", b"{\"a\":1}"),
            call("POST", "/pd/prefill?x=1", b"{\"a\":1}"),
            call("POST", "/pd/prefill", b"{\"a\":2}"),
            Call {
                prefill: Some("http://elsewhere"),
                ..c
            },
        ] {
            assert!(verify(&k, &g, &h, &other).is_err(), "{other:?}");
        }
        let other_key = ClusterKey::from_secret(&[4; 32]).unwrap();
        assert!(verify(&other_key, &g, &h, &c).is_err());
        assert!(verify(&k, &g, &HeaderMap::new(), &c).is_err());
        assert_eq!(verify(&k, &g, &h, &c), Ok(()));
        // The same header again: a replay.
        assert!(verify(&k, &g, &h, &c).unwrap_err().contains("replay"));
        // An old header is refused.
        let ts = now_ms() - 120_000;
        let nonce = [9u8; 16];
        let m = mac(&k, &c, ts, &nonce, g.instance());
        let old = format!("v3.{ts}.{}.{}.{}", hex(&nonce), g.instance().hex(), hex(&m));
        h.insert(AUTH_HEADER, HeaderValue::from_str(&old).unwrap());
        assert!(verify(&k, &g, &h, &c).unwrap_err().contains("away from"));
    }

    #[test]
    fn a_call_verifies_only_at_the_instance_it_was_signed_for() {
        let k = ClusterKey::from_secret(&[3; 32]).unwrap();
        let (a, b) = (ReplayGuard::default(), ReplayGuard::default());
        assert_ne!(a.instance(), b.instance());
        let c = call("POST", "/pd/prefill", b"{}");
        let mut h = HeaderMap::new();
        h.insert(AUTH_HEADER, sign(&k, Some(a.instance()), &c));
        // Another worker (or this one restarted: a new guard) refuses it, naming why; the
        // worker it was signed for takes it after that.
        let e = verify(&k, &b, &h, &c).unwrap_err();
        assert!(e.contains("another instance"), "{e}");
        assert_eq!(verify(&k, &a, &h, &c), Ok(()));
        // Before a sender has learnt the instance, every receiver refuses.
        h.insert(AUTH_HEADER, sign(&k, None, &c));
        assert!(verify(&k, &a, &h, &c)
            .unwrap_err()
            .contains("another instance"));
        // The instance is part of what the MAC covers: naming another one breaks it.
        let good = sign(&k, Some(b.instance()), &c);
        let good = good.to_str().unwrap();
        let forged = good.replace(&b.instance().hex(), &a.instance().hex());
        h.insert(AUTH_HEADER, HeaderValue::from_str(&forged).unwrap());
        assert!(verify(&k, &a, &h, &c).unwrap_err().contains("wrong MAC"));
    }

    /// A peer that verifies calls as a worker does, with an instance a "restart" replaces.
    struct Peer {
        key: ClusterKey,
        guard: Mutex<std::sync::Arc<ReplayGuard>>,
        calls: std::sync::atomic::AtomicUsize,
        /// A new instance on every call: no sender can ever sign for it.
        restarts_every_call: bool,
    }

    async fn peer(
        st: axum::extract::State<std::sync::Arc<Peer>>,
        h: HeaderMap,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        st.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut g = st.guard.lock().unwrap().clone();
        if st.restarts_every_call {
            g = Default::default();
        }
        let status = match verify(&st.key, &g, &h, &call("GET", "/x", b"")) {
            Ok(()) => StatusCode::OK,
            Err(_) => StatusCode::UNAUTHORIZED,
        };
        (status, [(INSTANCE_HEADER, g.instance().header())]).into_response()
    }

    /// Serves `st` on a port the OS picks; its base URL.
    async fn serve_peer(st: std::sync::Arc<Peer>) -> String {
        let app = axum::Router::new()
            .route("/x", axum::routing::get(peer))
            .with_state(st);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        base
    }

    fn new_peer(key: &ClusterKey, restarts_every_call: bool) -> std::sync::Arc<Peer> {
        std::sync::Arc::new(Peer {
            key: key.clone(),
            guard: Mutex::new(Default::default()),
            calls: Default::default(),
            restarts_every_call,
        })
    }

    #[tokio::test]
    async fn a_call_is_sent_at_most_twice() {
        let key = ClusterKey::from_secret(&[5; 32]).unwrap();
        let st = new_peer(&key, true);
        let base = serve_peer(st.clone()).await;
        let client = reqwest::Client::new();
        let build = || client.get(format!("{base}/x"));
        let c = call("GET", "/x", b"");
        let r = send(&Peers::default(), Some(&key), &base, &c, build)
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
        assert_eq!(st.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_sender_learns_the_instance_once_and_again_after_a_restart() {
        use std::sync::atomic::Ordering::SeqCst;
        let key = ClusterKey::from_secret(&[5; 32]).unwrap();
        let st = new_peer(&key, false);
        let base = serve_peer(st.clone()).await;
        let (client, peers) = (reqwest::Client::new(), Peers::default());
        let build = || client.get(format!("{base}/x"));
        let c = call("GET", "/x", b"");
        let send_once = async |k: &ClusterKey| {
            let before = st.calls.load(SeqCst);
            let r = send(&peers, Some(k), &base, &c, build).await.unwrap();
            (r.status().as_u16(), st.calls.load(SeqCst) - before)
        };
        // First call: refused for the unknown instance, learnt, sent again.
        assert_eq!(send_once(&key).await, (200, 2));
        // Known: one call.
        assert_eq!(send_once(&key).await, (200, 1));
        // The peer restarts (a new instance, its nonces forgotten): learnt again.
        *st.guard.lock().unwrap() = Default::default();
        assert_eq!(send_once(&key).await, (200, 2));
        // Another key: refused for a reason the instance does not explain, not sent again.
        let other = ClusterKey::from_secret(&[6; 32]).unwrap();
        assert_eq!(send_once(&other).await, (401, 1));
    }
}
