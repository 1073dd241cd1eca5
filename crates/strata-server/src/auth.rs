//! Cluster authentication of HTTP calls between Strata processes (router → worker, decode
//! worker → prefill worker): the header `x-strata-cluster-auth: v2.<unix ms>.<nonce>.<MAC>`,
//! the MAC (keyed with the deployment's cluster key) covering the method, the path with its
//! query, the time, the nonce, a hash of the body and the `x-strata-prefill` header. A header is
//! valid for [`SKEW`] either side of the receiver's clock, and once: the receiver remembers the
//! nonces it accepted within the window, so a captured call cannot be replayed. The key
//! itself never travels.
//!
//! Without a cluster key, workers listen on loopback only, and these surfaces are open to local
//! processes (stated at start-up).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use strata_kv::auth::{hex, unhex, ClusterKey};

use crate::error::ApiError;

/// The header carrying a cluster MAC.
pub const AUTH_HEADER: &str = "x-strata-cluster-auth";
/// How far apart the two clocks may be.
pub const SKEW: Duration = Duration::from_secs(60);
const CONTEXT: &str = "strata cluster http v2";
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

fn mac(key: &ClusterKey, c: &Call, ts: u64, nonce: &[u8]) -> [u8; 32] {
    key.mac(
        CONTEXT,
        &[
            c.method.as_bytes(),
            c.target.as_bytes(),
            &ts.to_le_bytes(),
            nonce,
            blake3::hash(c.body).as_bytes(),
            c.prefill.unwrap_or("").as_bytes(),
        ],
    )
}

/// The header value for `call`.
pub fn sign(key: &ClusterKey, call: &Call) -> HeaderValue {
    let ts = now_ms();
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).expect("the operating system's random source");
    let m = mac(key, call, ts, &nonce);
    HeaderValue::from_str(&format!("v2.{ts}.{}.{}", hex(&nonce), hex(&m))).expect("ASCII")
}

/// Nonces seen, and (time, nonce) in the order they came.
type Seen = (HashSet<[u8; 16]>, VecDeque<(u64, [u8; 16])>);

/// Nonces accepted within the window (per receiving process).
#[derive(Default)]
pub struct ReplayGuard {
    seen: Mutex<Seen>,
}

impl ReplayGuard {
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
    let ["v2", ts, nonce, given] = parts.as_slice() else {
        return Err(format!("{AUTH_HEADER} is not v2.<ms>.<nonce>.<mac>"));
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
    let given = unhex(given).ok_or_else(|| format!("{AUTH_HEADER}: the MAC is not hex"))?;
    let want = mac(key, call, ts, &nonce);
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
        h.insert(AUTH_HEADER, sign(&k, &c));
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
        let m = mac(&k, &c, ts, &nonce);
        h.insert(
            AUTH_HEADER,
            HeaderValue::from_str(&format!("v2.{ts}.{}.{}", hex(&nonce), hex(&m))).unwrap(),
        );
        assert!(verify(&k, &g, &h, &c).unwrap_err().contains("away from"));
    }
}
