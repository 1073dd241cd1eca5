//! The HTTP listener's bounds, the same flags on `strata serve` and `strata route`
//! (docs/SECURITY.md states each with its default).

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use strata_server::listen::{raise_fd_limit, HttpLimits};

/// Longest duration flag, in seconds (a day): past it a value is a typo, and past `Duration`'s
/// range one would panic where it is used.
pub const MAX_SECONDS: f64 = 86_400.0;

/// Worker URLs given to `flag`: each `http(s)://HOST[:PORT]` with a host and nothing else (a
/// space, a bare `http://`, a user or password: it would be sent as Basic auth and shown on
/// `/workers` and `/metrics`; a path, query or fragment: the router appends its own paths, so
/// calls would go elsewhere), and no worker given twice, however spelled (`http://h:80` is
/// `http://h`).
pub fn check_worker_urls(flag: &str, urls: &[String]) -> Result<()> {
    for (i, u) in urls.iter().enumerate() {
        let p = reqwest::Url::parse(u).ok().filter(|p| {
            matches!(p.scheme(), "http" | "https")
                && p.host_str().is_some_and(|h| !h.is_empty())
                && !u.contains(char::is_whitespace)
        });
        let Some(p) = p else {
            bail!(
                "{flag} `{}`: expected http://HOST:PORT",
                strata_kv::units::shown_url(u)
            );
        };
        if !p.username().is_empty() || p.password().is_some() {
            // Not echoed: it holds a credential.
            bail!("{flag}: a worker URL with a user or password: expected http://HOST:PORT (workers are reached with the cluster key)");
        }
        if !matches!(p.path(), "" | "/") || p.query().is_some() || p.fragment().is_some() {
            bail!("{flag} `{u}`: a path, query or fragment: expected http://HOST:PORT (the router adds its own paths)");
        }
        if urls[..i]
            .iter()
            .any(|o| strata_server::pd::same_worker(o, u))
        {
            bail!("{flag} `{u}` is given twice");
        }
    }
    Ok(())
}

/// A duration flag: from `lo` (taken when `lo_taken`, else only above it) to a day.
pub fn check_seconds(flag: &str, v: f64, lo: f64, lo_taken: bool) -> Result<()> {
    let above = if lo_taken { v >= lo } else { v > lo };
    if !(above && v <= MAX_SECONDS) {
        let op = if lo_taken { "≥" } else { ">" };
        let v = strata_kv::units::shown_number(v);
        bail!("{flag} {v}: expected seconds {op} {lo}, at most {MAX_SECONDS} (a day)");
    }
    Ok(())
}

/// `--body-limit` (the same on `serve` and `route`): 1KiB to 1GiB.
pub fn body_limit(v: &str) -> Result<usize> {
    let b = strata_kv::units::parse_size(v).map_err(|e| anyhow::anyhow!("--body-limit: {e}"))?;
    if !(1 << 10..=1 << 30).contains(&b) {
        bail!("--body-limit {v}: expected 1KiB to 1GiB (a request body larger than that is not a prompt)");
    }
    Ok(b as usize)
}

#[derive(Args, Debug, Clone)]
pub struct HttpArgs {
    /// Seconds a request's headers may take to arrive, counted from the accept or from the
    /// end of the previous response on the connection (so also the idle keep-alive limit).
    #[arg(long, default_value_t = 20.0, help_heading = "Connections")]
    pub header_timeout: f64,
    /// Seconds a request's whole body may take to arrive (beyond: 408, connection closed).
    #[arg(long, default_value_t = 30.0, help_heading = "Connections")]
    pub body_timeout: f64,
    /// Connections open at once (default: ¾ of the open-file limit, which is raised to its
    /// hard limit at start). When reached, the longest-idle connection yields to a newcomer.
    #[arg(long, help_heading = "Connections")]
    pub max_connections: Option<usize>,
    /// Connections from one address (IPv4, or IPv6 /64) at once (default: a quarter of
    /// --max-connections, at least 16).
    #[arg(long, help_heading = "Connections")]
    pub max_connections_per_ip: Option<usize>,
    /// Origins whose browsers may call this API (CORS), comma-separated
    /// (`https://app.example.com,http://localhost:3000`), or `*` for any. Default: none — no
    /// CORS headers, as every non-browser client needs.
    #[arg(long, value_delimiter = ',', help_heading = "Connections")]
    pub allowed_origins: Vec<String>,
}

impl HttpArgs {
    /// The limits these flags give (the descriptor limit raised first), or why not.
    pub fn limits(&self, body_limit: usize) -> Result<HttpLimits> {
        for (flag, v) in [
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
        ] {
            check_seconds(flag, v, 0.1, true)?;
        }
        strata_server::listen::cors(&self.allowed_origins).map_err(anyhow::Error::msg)?;
        let fds = raise_fd_limit();
        let mut l = HttpLimits::for_fd_limit(fds, body_limit);
        l.header_timeout = Duration::from_secs_f64(self.header_timeout);
        l.body_timeout = Duration::from_secs_f64(self.body_timeout);
        l.allowed_origins = self.allowed_origins.clone();
        if let Some(n) = self.max_connections {
            if n == 0 {
                bail!("--max-connections 0: expected at least 1");
            }
            if n as u64 > fds {
                bail!(
                    "--max-connections {n}: more than this process's open-file limit ({fds}, \
                     its hard limit); raise the limit (ulimit -Hn, LimitNOFILE=) or lower the flag"
                );
            }
            l.max_connections = n;
            l.max_connections_per_ip = (n / 4).max(16).min(n);
        }
        if let Some(n) = self.max_connections_per_ip {
            if n == 0 || n > l.max_connections {
                bail!(
                    "--max-connections-per-ip {n}: expected 1 to --max-connections ({})",
                    l.max_connections
                );
            }
            l.max_connections_per_ip = n;
        }
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_echoed_without_its_credentials() {
        let e = check_worker_urls("--decode", &["http://u:secret@a b".into()]).unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
    }
}
