//! Request ids: the header they travel in, a client's own id when it can be echoed, and fresh
//! random ids (a leaf module: the HTTP listener and the handlers both use it).

use axum::http::{HeaderName, HeaderValue};

/// The header a request's id travels in (echoed on the answer; the router passes it on).
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// A client's request id, if it is one we can echo: 1 to 128 visible ASCII characters.
pub fn client_request_id(v: Option<&HeaderValue>) -> Option<String> {
    let s = v?.to_str().ok()?;
    let ok = !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| s.to_string())
}

/// A fresh random id (96 bits, hex): unique across workers and restarts.
pub fn fresh_id() -> String {
    let mut b = [0u8; 12];
    getrandom::fill(&mut b).expect("the OS random source");
    strata_kv::auth::hex(&b)
}
