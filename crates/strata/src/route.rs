//! `strata route`: the router in front of prefill and decode workers (or workers doing both).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use strata_server::router::{health_loop, router, Policy, RouterState};

#[derive(Args, Debug, Clone)]
pub struct RouteArgs {
    #[arg(long, default_value = "127.0.0.1", help_heading = "Server")]
    pub host: String,
    #[arg(long, default_value_t = 8000, help_heading = "Server")]
    pub port: u16,
    /// A prefill worker's URL (repeat for several). With prefill workers, requests go PD:
    /// prefill on one, decode on another.
    #[arg(long, help_heading = "Workers")]
    pub prefill: Vec<String>,
    /// A decode worker's URL (repeat), or a worker doing both when no --prefill is given.
    #[arg(long, help_heading = "Workers")]
    pub decode: Vec<String>,
    /// round_robin or least_load.
    #[arg(long, default_value = "round_robin", help_heading = "Workers")]
    pub policy: String,
    /// Seconds between health checks of every worker.
    #[arg(long, default_value_t = 1.0, help_heading = "Workers")]
    pub health_interval: f64,
    /// A client API key (repeat); requests without a valid one get 401. Also $STRATA_API_KEY.
    #[arg(
        long,
        env = "STRATA_API_KEY",
        hide_env_values = true,
        help_heading = "Access"
    )]
    pub api_key: Vec<String>,
    /// A file of client API keys, one per line.
    #[arg(long, help_heading = "Access")]
    pub api_key_file: Option<PathBuf>,
}

fn check_url(u: &str) -> Result<()> {
    if !(u.starts_with("http://") || u.starts_with("https://")) || u.len() < 10 {
        bail!("worker URL `{u}`: expected http://HOST:PORT");
    }
    Ok(())
}

pub fn run(a: RouteArgs) -> Result<()> {
    let Some(policy) = Policy::parse(&a.policy) else {
        bail!(
            "--policy `{}`: expected round_robin or least_load",
            a.policy
        );
    };
    if a.decode.is_empty() {
        bail!("no worker: give --decode URL (and --prefill URL for PD)");
    }
    for u in a.prefill.iter().chain(&a.decode) {
        check_url(u)?;
    }
    if !(a.health_interval > 0.0 && a.health_interval.is_finite()) {
        bail!(
            "--health-interval {}: expected seconds > 0",
            a.health_interval
        );
    }
    let mut keys: HashSet<String> = a.api_key.iter().cloned().collect();
    if let Some(f) = &a.api_key_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("--api-key-file {}", f.display()))?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_string),
        );
    }
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .with_context(|| format!("--host {} --port {}: not an address", a.host, a.port))?;
    let mut st = RouterState::new(&a.prefill, &a.decode, policy);
    st.api_keys = keys;
    let st = Arc::new(st);
    let every = Duration::from_secs_f64(a.health_interval);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        tokio::spawn(health_loop(st.clone(), every));
        eprintln!(
            "strata route: ready on http://{addr} ({} prefill, {} decode workers, policy {})",
            a.prefill.len(),
            a.decode.len(),
            policy.name()
        );
        axum::serve(l, router(st))
            .with_graceful_shutdown(crate::serve::shutdown_signal())
            .await?;
        Ok(())
    })
}
