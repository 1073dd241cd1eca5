//! What the router's integration tests share.

use std::sync::Arc;

use strata_router::{router, Policy, RouterState};

/// A router (round robin) over these workers, serving on a port the OS picks; its URL.
pub async fn start_router(prefill: &[String], decode: &[String]) -> String {
    let st = Arc::new(RouterState::new(prefill, decode, Policy::RoundRobin));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, router(st)).await });
    url
}
