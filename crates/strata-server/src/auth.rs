//! Cluster authentication of HTTP calls between Strata processes (router → worker, decode
//! worker → prefill worker): the header `x-strata-cluster-auth: v1.<unix ms>.<hex MAC>`, the MAC
//! (keyed with the deployment's cluster key) covering the method, the path and the time. A
//! header is valid for [`SKEW`] either side of the receiver's clock. The key itself never
//! travels.
//!
//! Without a cluster key, workers listen on loopback only, and these surfaces are open to local
//! processes (stated at start-up).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use strata_kv::auth::{hex, unhex, ClusterKey};

use crate::error::ApiError;

/// The header carrying a cluster MAC.
pub const AUTH_HEADER: &str = "x-strata-cluster-auth";
/// How far apart the two clocks may be.
pub const SKEW: Duration = Duration::from_secs(60);
const CONTEXT: &str = "strata cluster http v1";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The header value for a call of `method` on `path`.
pub fn sign(key: &ClusterKey, method: &str, path: &str) -> HeaderValue {
    let ts = now_ms();
    let mac = key.mac(
        CONTEXT,
        &[method.as_bytes(), path.as_bytes(), &ts.to_le_bytes()],
    );
    HeaderValue::from_str(&format!("v1.{ts}.{}", hex(&mac))).expect("ASCII")
}

/// Checks a call's header; the error names what is wrong without echoing anything secret.
pub fn verify(
    key: &ClusterKey,
    headers: &HeaderMap,
    method: &str,
    path: &str,
) -> Result<(), String> {
    let v = headers
        .get(AUTH_HEADER)
        .ok_or_else(|| format!("no {AUTH_HEADER} header"))?
        .to_str()
        .map_err(|_| format!("{AUTH_HEADER} is not ASCII"))?;
    let mut it = v.splitn(3, '.');
    let (Some("v1"), Some(ts), Some(mac)) = (it.next(), it.next(), it.next()) else {
        return Err(format!("{AUTH_HEADER} is not v1.<ms>.<mac>"));
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
    let mac = unhex(mac).ok_or_else(|| format!("{AUTH_HEADER}: the MAC is not hex"))?;
    if key.verify(
        CONTEXT,
        &[method.as_bytes(), path.as_bytes(), &ts.to_le_bytes()],
        &mac,
    ) {
        Ok(())
    } else {
        Err(format!("{AUTH_HEADER}: wrong MAC (another cluster key?)"))
    }
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

    #[test]
    fn signed_calls_verify_only_for_their_method_path_and_key() {
        let k = ClusterKey::from_secret(&[3; 32]).unwrap();
        let mut h = HeaderMap::new();
        h.insert(AUTH_HEADER, sign(&k, "POST", "/pd/prefill"));
        assert_eq!(verify(&k, &h, "POST", "/pd/prefill"), Ok(()));
        assert!(verify(&k, &h, "GET", "/pd/prefill").is_err());
        assert!(verify(&k, &h, "POST", "/cache/events").is_err());
        let other = ClusterKey::from_secret(&[4; 32]).unwrap();
        assert!(verify(&other, &h, "POST", "/pd/prefill").is_err());
        assert!(verify(&k, &HeaderMap::new(), "POST", "/pd/prefill").is_err());
        // An old header (replayed after the window) is refused.
        let ts = now_ms() - 120_000;
        let mac = k.mac(CONTEXT, &[b"POST", b"/pd/prefill", &ts.to_le_bytes()]);
        h.insert(
            AUTH_HEADER,
            HeaderValue::from_str(&format!("v1.{ts}.{}", hex(&mac))).unwrap(),
        );
        assert!(verify(&k, &h, "POST", "/pd/prefill")
            .unwrap_err()
            .contains("away from"));
    }
}
