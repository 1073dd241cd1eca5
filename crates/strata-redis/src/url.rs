//! `--l3` Redis URLs: checked before a worker allocates anything (a malformed URL is a
//! configuration error, not a tier "unavailable at start"), and written to logs without their
//! password.

use strata_kv::units::shown_url;

use crate::cluster_seeds;

/// `Ok` when `url` is a `redis://` URL of a TCP host and port (a database number, user and
/// password allowed) or a `redis-cluster://` list of seeds; else why not. Nothing is
/// connected.
pub fn check_url(url: &str) -> Result<(), String> {
    if url.starts_with("redis-cluster://") {
        return cluster_seeds(url).map(|_| ()).map_err(|e| e.to_string());
    }
    let info: redis::ConnectionInfo = url
        .parse()
        .map_err(|e| format!("{}: {e}", shown_url(url)))?;
    match &info.addr {
        redis::ConnectionAddr::Tcp(h, p) if !h.is_empty() && *p > 0 => Ok(()),
        redis::ConnectionAddr::Tcp(..) => Err(format!("{}: no host or port", shown_url(url))),
        _ => Err(format!("{}: only TCP (redis://HOST:PORT)", shown_url(url))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_without_connecting() {
        for ok in [
            "redis://127.0.0.1:6379",
            "redis://h:1/2",
            "redis://:pw@h:6379",
            "redis://u:pw@h:6379/0",
            "redis-cluster://a:1,b:2",
            "redis-cluster://a:1",
        ] {
            assert_eq!(check_url(ok), Ok(()), "{ok}");
        }
        for bad in [
            "redis://",
            "redis://:99999",
            "redis://[::1",
            "redis://a:b@127.0.0.1:1/xyz",
            "redis-cluster://a:1,b",
            "redis-cluster://a:1,,b:2",
            "redis-cluster://a:1,",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
        // An error never shows the password.
        for bad in [
            "redis://u:s3cret@h:1/xyz",
            "redis-cluster://:s3cret@a:1,b",
            "redis://u:s3/cret@h:1",
        ] {
            let e = check_url(bad).unwrap_err();
            assert!(!e.contains("s3cret"), "{e}");
        }
    }
}
