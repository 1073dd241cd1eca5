//! Before anything starts: every port of the deployment is free, or one clear error naming the
//! port and the process that holds it (from /proc, where this user may read it).

use std::net::TcpListener;

use anyhow::{bail, Result};

/// No nonzero port given to two of `ports` (each named by who wants it); the error names
/// `what` (the deployment file), the port and both.
pub(super) fn distinct(what: &str, ports: &[(String, u16)]) -> Result<()> {
    for (i, (who, p)) in ports.iter().enumerate() {
        if let Some((other, _)) = ports[..i].iter().find(|(_, q)| *q == *p && *p != 0) {
            bail!("{what}: port {p} is given to both {other} and {who}");
        }
    }
    Ok(())
}

/// Binds each nonzero port on `host` (and lets go at once); the first one in use is an error
/// naming it, who in the deployment wanted it, and the process listening on it.
pub(super) fn check_free(host: &str, ports: &[(String, u16)]) -> Result<()> {
    for (who, port) in ports.iter().filter(|(_, p)| *p != 0) {
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        match TcpListener::bind(&addr) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                let by = match holder(*port) {
                    Some((pid, cmd)) => format!("by pid {pid} ({cmd})"),
                    None => "by another process (not one this user can see)".into(),
                };
                bail!(
                    "port {port} ({who}) on {host} is already in use {by}: stop it, or give \
                     this deployment other ports (port 0: any free one)"
                );
            }
            Err(e) => bail!("port {port} ({who}) on {host}: cannot listen: {e}"),
        }
    }
    Ok(())
}

/// The process listening on TCP `port` (any address): its pid and command line.
pub(super) fn holder(port: u16) -> Option<(u32, String)> {
    let inodes: Vec<u64> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| listening_inodes(&t, port))
        .collect();
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let t = target.to_string_lossy();
            let ino = t
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
                .and_then(|s| s.parse::<u64>().ok());
            if ino.is_some_and(|i| inodes.contains(&i)) {
                return Some((pid, cmdline(pid)));
            }
        }
    }
    None
}

/// Socket inodes of /proc/net/tcp{,6} rows in LISTEN (state 0A) on `port`.
fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local = f.get(1)?;
            let p = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            (p == port && *f.get(3)? == "0A")
                .then(|| f.get(9)?.parse().ok())
                .flatten()
        })
        .collect()
}

fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let s: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let s = s.join(" ");
    if s.chars().count() > 120 {
        format!("{}…", s.chars().take(120).collect::<String>())
    } else if s.is_empty() {
        "command line unknown".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_port_names_the_port_and_this_process() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let e = check_free("127.0.0.1", &[("router".into(), port)])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("port {port} (router)")), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(l);
        check_free("127.0.0.1", &[("router".into(), port), ("any".into(), 0)]).unwrap();
    }

    #[test]
    fn listening_rows_are_read_by_port_and_state() {
        let t = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
                 0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n\
                 1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1\n";
        assert_eq!(listening_inodes(t, 8080), vec![4242]);
        assert!(listening_inodes(t, 8081).is_empty());
    }
}
