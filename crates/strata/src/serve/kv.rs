//! A decode worker's KV-transfer listener: bound and checked before anything is allocated,
//! started once the engine runs, and the address it announces.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use strata_kv::auth::ClusterKey;
use strata_kv::units::format_bytes;
use strata_server::AppState;

/// The `--kv-*` flags of `strata serve`.
pub(crate) struct KvFlags<'a> {
    /// `--kv-host`:`--kv-port`, resolved by the flag checks.
    pub addr: std::net::SocketAddr,
    pub advertise: Option<&'a str>,
    /// `--kv-staging` as typed (for messages).
    pub staging_text: &'a str,
    pub max_connections: usize,
}

/// A decode worker's KV-transfer listener, bound (before anything is allocated) and the
/// address it announces, checked.
pub(crate) struct KvBound {
    listener: std::net::TcpListener,
    advertise: Option<std::net::SocketAddr>,
}

/// Binds the KV-transfer listener and checks the address prefill workers are told: a port in
/// use or an address they cannot reach is refused before the model or any pool is loaded.
pub(crate) fn kv_bind(a: &KvFlags, keyed: bool) -> Result<KvBound> {
    let kv_addr = a.addr;
    let listener = std::net::TcpListener::bind(kv_addr)
        .with_context(|| format!("cannot listen for KV transfers on {kv_addr}"))?;
    let advertise = kv_advertise(a.advertise, listener.local_addr()?)?;
    if let Some(ad) = advertise {
        // A prefill worker without the key accepts only a loopback KV target (pd.rs): say so
        // now rather than fail every transfer.
        if !keyed && !ad.ip().is_loopback() {
            bail!(
                "--kv-advertise {ad}: without --cluster-key-file prefill workers send K/V to \
                 loopback addresses only"
            );
        }
    }
    Ok(KvBound {
        listener,
        advertise,
    })
}

/// One request of the longest prompt this worker can hold (`longest` tokens) must fit the
/// staging area, or such prompts could never arrive.
pub(crate) fn check_staging(
    a: &KvFlags,
    kv_staging: u64,
    longest: usize,
    page_size: usize,
    page_bytes: u64,
) -> Result<()> {
    let one = longest.div_ceil(page_size.max(1)) as u64 * page_bytes;
    if kv_staging < one {
        bail!(
            "--kv-staging {}: one prompt of {longest} tokens needs {one} bytes of K/V ({}); give at least that",
            a.staging_text,
            format_bytes(one)
        );
    }
    Ok(())
}

/// Starts the bound listener with the engine's exact sizes.
pub(crate) fn kv_start(
    bound: KvBound,
    a: &KvFlags,
    st: &AppState,
    kv_staging: u64,
    cluster_key: Option<ClusterKey>,
) -> Result<Arc<strata_server::pd::KvInbox>> {
    let info = st.engine.info().clone();
    let hello = info.hello();
    let longest = info.context_length.min(info.device_tokens);
    check_staging(
        a,
        kv_staging,
        longest,
        info.page_size,
        info.page_bytes as u64,
    )?;
    let limits = strata_server::pd::KvLimits {
        staging: kv_staging,
        max_connections: a.max_connections.max(1),
        max_tokens: info.context_length,
        page_size: info.page_size as u32,
        main_page_bytes: info.main_page_bytes(),
        advertise: bound.advertise,
        ..strata_server::pd::KvLimits::default()
    };
    let inbox = strata_server::pd::KvInbox::start(
        bound.listener,
        hello,
        info.page_bytes as u64,
        limits,
        cluster_key,
    );
    tracing::info!(addr = %inbox.addr, advertised = %inbox.advertise, staging_bytes = kv_staging, "KV-transfer listener ready (staging limit in bytes)");
    say!(
        "strata serve: KV-transfer listener on {} (announced as {})",
        inbox.addr,
        inbox.advertise
    );
    Ok(inbox)
}

/// The KV address to tell prefill workers: `--kv-advertise` (IP, or IP:PORT), else the bound
/// address, which must then be one a peer can reach (not 0.0.0.0 / ::).
fn kv_advertise(
    given: Option<&str>,
    bound: std::net::SocketAddr,
) -> Result<Option<std::net::SocketAddr>> {
    let Some(g) = given else {
        if bound.ip().is_unspecified() {
            bail!(
                "--kv-host {}: prefill workers cannot send K/V to an unspecified address; give \
                 --kv-advertise IP[:PORT], the address they reach this worker at",
                bound.ip()
            );
        }
        return Ok(None);
    };
    let addr = match g.parse::<std::net::SocketAddr>() {
        Ok(a) => a,
        Err(_) => match g.parse::<std::net::IpAddr>() {
            Ok(ip) => std::net::SocketAddr::new(ip, bound.port()),
            Err(_) => bail!("--kv-advertise `{g}`: expected IP or IP:PORT"),
        },
    };
    if addr.ip().is_unspecified() || addr.port() == 0 {
        bail!("--kv-advertise {addr}: give the IP and port prefill workers reach");
    }
    Ok(Some(addr))
}

#[cfg(test)]
mod tests {
    use super::kv_advertise;

    #[test]
    fn an_unspecified_kv_address_needs_an_advertised_one() {
        let any: std::net::SocketAddr = "0.0.0.0:9000".parse().unwrap();
        let lo: std::net::SocketAddr = "127.0.0.1:9000".parse().unwrap();
        assert!(kv_advertise(None, any)
            .unwrap_err()
            .to_string()
            .contains("--kv-advertise"));
        assert_eq!(kv_advertise(None, lo).unwrap(), None);
        let ip = kv_advertise(Some("10.1.2.3"), any).unwrap().unwrap();
        assert_eq!(ip.to_string(), "10.1.2.3:9000");
        let full = kv_advertise(Some("10.1.2.3:7000"), any).unwrap().unwrap();
        assert_eq!(full.port(), 7000);
        for bad in ["pod", "0.0.0.0:9000", "10.1.2.3:0"] {
            assert!(kv_advertise(Some(bad), any).is_err(), "{bad}");
        }
    }
}
