//! The flags of `strata serve` and their combinations, checked before anything is bound,
//! loaded or allocated (and `--kv-staging` against the planned pools before they are).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use strata_kv::auth::ClusterKey;
use strata_kv::units::parse_size;
use strata_kv::{EvictionPolicy, PageLayout};
use strata_mem::Plan;

use super::{kv_flags, Eviction, Prefetch, ServeArgs};

fn is_loopback(host: &str) -> bool {
    ip_of(host).is_some_and(|ip| ip.is_loopback())
}

/// A `--host` / `--kv-host` value as an address: an IP literal (IPv6 with or without brackets,
/// `::1` or `[::1]`) or `localhost` (127.0.0.1).
pub(crate) fn ip_of(host: &str) -> Option<std::net::IpAddr> {
    if host == "localhost" {
        return Some(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok()
}

/// `host` and `port` as the socket address to bind (`flag` names the host's flag): an IP
/// literal or `localhost`, else a name this machine resolves (its first address).
pub(crate) fn socket_of(flag: &str, host: &str, port: u16) -> Result<SocketAddr> {
    if let Some(ip) = ip_of(host) {
        return Ok(SocketAddr::new(ip, port));
    }
    use std::net::ToSocketAddrs;
    let name = !host.is_empty() && !host.contains(|c: char| c.is_whitespace() || c == '/');
    let resolved = name
        .then(|| {
            (host, port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
        })
        .flatten();
    match resolved {
        Some(a) => Ok(a),
        None => {
            bail!("{flag} `{host}`: not an IP address, localhost or a name this machine resolves")
        }
    }
}

/// `--kv-staging` against the longest prompt the planned pools can hold, before any pool is
/// allocated (the listener checks again with the engine's exact capacity).
pub(super) fn check_staging_before_pools(
    a: &ServeArgs,
    c: &Checked,
    model: &dyn strata_model::runtime::Runtime,
    plan: &Plan,
    layout: &PageLayout,
) -> Result<()> {
    let ps = layout.page_size();
    let wire = PageLayout::new(ps, model.wire_kinds(ps)?)?;
    // A model with window kinds holds no more than its window pools do (a lower bound: the
    // exact capacity may be larger in ring mode, never smaller).
    let mut device = plan.device_tokens_per_rank as usize;
    if layout.has_window() {
        device = device.min(plan.device_window_tokens_per_rank as usize);
    }
    let longest = model.context_length().min(device / ps * ps);
    super::kv::check_staging(
        &kv_flags(a, c),
        c.kv_staging,
        longest,
        ps,
        wire.page_bytes() as u64,
    )
}

/// What the flags checked before anything is bound or loaded give.
pub(super) struct Checked {
    pub eviction: EvictionPolicy,
    pub body_limit: usize,
    pub role: &'static str,
    pub kv_staging: u64,
    pub addr: SocketAddr,
    pub cluster_key: Option<ClusterKey>,
    pub http: strata_server::listen::HttpLimits,
    pub responses: strata_server::response_store::ResponseStore,
    /// `--record-trace-size` in bytes.
    pub record_trace_size: u64,
    /// `--record-trace`'s file, opened (emptied, locked) by [`open_record_trace`] before
    /// anything is allocated.
    pub record_trace: Option<std::fs::File>,
    /// `--kv-host`:`--kv-port`, resolved once.
    pub kv_addr: SocketAddr,
}

/// Opens `--record-trace`'s file (made or emptied, locked), once every flag is good and
/// before anything is allocated (`strata up`'s preflight checks the flags without it).
pub(super) fn open_record_trace(a: &ServeArgs, c: &mut Checked) -> Result<()> {
    if let Some(f) = &a.record_trace {
        let file = strata_engine::record::open_file(f)
            .with_context(|| format!("--record-trace {}", f.display()))?;
        c.record_trace = Some(file);
    }
    Ok(())
}

/// Checks every flag that needs neither the model nor the plan.
pub(super) fn check_flags(a: &ServeArgs) -> Result<Checked> {
    let eviction = match a.eviction {
        Eviction::Lru => EvictionPolicy::Lru,
        Eviction::Gdsf => EvictionPolicy::Gdsf,
        Eviction::Sieve => EvictionPolicy::Sieve,
        Eviction::S3fifo => EvictionPolicy::S3Fifo,
        Eviction::Auto => EvictionPolicy::Auto,
    };
    let body_limit = crate::http_args::body_limit(&a.body_limit)?;
    let role = a.sizing.role.name();
    let kv_staging = parse_size(&a.sizing.kv_staging).context("--kv-staging")?;
    check_numbers(a)?;
    if a.sizing.machine.is_some() {
        bail!("--machine plans for another machine; `strata serve` allocates on this one (use `strata plan --machine`)");
    }
    if a.sizing.tp_size == 0 {
        bail!("--tp-size 0: expected at least 1 rank");
    }
    if a.sizing.max_batch_tokens == 0 || a.sizing.max_running == 0 {
        bail!("--max-batch-tokens and --max-running must be at least 1");
    }
    check_l3_specs(a)?;
    prefetch_policy(a)?;
    let addr = socket_of("--host", &a.host, a.port)?;
    let kv_addr = socket_of("--kv-host", &a.kv_host, a.kv_port)?;
    let cluster_key = cluster_key(a)?;
    crate::http_args::check_worker_urls("--prefill-worker", &a.prefill_worker)?;
    let http = a.http.limits(body_limit)?;
    let responses = response_store(a)?;
    let record_trace_size = record_trace(a)?;
    Ok(Checked {
        eviction,
        body_limit,
        role,
        kv_staging,
        addr,
        cluster_key,
        http,
        responses,
        record_trace_size,
        record_trace: None,
        kv_addr,
    })
}

/// The numeric flags' ranges: durations, thread and connection counts, queue and token limits,
/// the curve's pages (its memory), and the names and keys that must not be empty.
fn check_numbers(a: &ServeArgs) -> Result<()> {
    for (flag, v, zero_ok) in [
        ("--kv-deadline", a.kv_deadline, false),
        ("--shutdown-grace", a.shutdown_grace, true),
        ("--max-queue-time", a.max_queue_time, true),
    ] {
        crate::http_args::check_seconds(flag, v, 0.0, zero_ok)?;
    }
    let ms = a.prefetch_ms_per_token;
    if !(0.0..=60_000.0).contains(&ms) {
        let ms = strata_kv::units::shown_number(ms);
        bail!("--prefetch-ms-per-token {ms}: expected milliseconds in [0, 60000]");
    }
    let counts: [(&str, usize, usize); 6] = [
        ("--threads", a.sizing.threads, crate::sizing::MAX_THREADS),
        ("--copy-threads", a.copy_threads, 64),
        ("--max-waiting", a.max_waiting, 1 << 20),
        ("--default-max-tokens", a.default_max_tokens, 1 << 24),
        ("--kv-max-connections", a.kv_max_connections, 1 << 16),
        ("--curve-pages", a.curve_pages.max(1), MAX_CURVE_PAGES),
    ];
    for (flag, v, max) in counts {
        if !(1..=max).contains(&v) {
            bail!("{flag} {v}: expected 1 to {max}");
        }
    }
    if a.served_model_name
        .as_deref()
        .is_some_and(|v| v.trim().is_empty())
    {
        bail!("--served-model-name is empty: give a value, or leave the flag out");
    }
    if let Some(k) = &a.admin_key {
        check_admin_key(k)?;
    }
    Ok(())
}

/// An admin key (`strata serve` and `strata route`, `--admin-key` or `$STRATA_ADMIN_KEY`): not
/// blank, and nothing at its ends that a bearer header would lose (a key file's newline), so
/// that the router and the workers given the same variable agree on it.
pub(crate) fn check_admin_key(k: &str) -> Result<()> {
    if k.trim().is_empty() {
        bail!("--admin-key (or $STRATA_ADMIN_KEY) is empty: give a key, or leave the flag out");
    }
    if k.trim() != k {
        bail!("--admin-key (or $STRATA_ADMIN_KEY) has white space at an end (a key file's newline?): no Authorization header could carry it; remove it");
    }
    Ok(())
}

/// Most pages `--curve-pages` may track (about 180 bytes each: 720 MiB); 0 turns it off.
const MAX_CURVE_PAGES: usize = 1 << 22;

/// `--record-trace FILE` and its size, checked (the file is made once the flags all pass).
fn record_trace(a: &ServeArgs) -> Result<u64> {
    let size = parse_size(&a.record_trace_size).context("--record-trace-size")?;
    if size < 4096 {
        bail!(
            "--record-trace-size {}: expected at least 4KiB",
            a.record_trace_size
        );
    }
    if let Some(f) = &a.record_trace {
        let dir = match f.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        if !dir.is_dir() {
            bail!(
                "--record-trace {}: the directory {} does not exist",
                f.display(),
                dir.display()
            );
        }
        if f.is_dir() {
            bail!("--record-trace {}: a directory, not a file", f.display());
        }
        if f.exists() && !f.is_file() {
            bail!(
                "--record-trace {}: not a regular file (a device or a pipe)",
                f.display()
            );
        }
    }
    Ok(size)
}

/// The `--response-store-*` bounds, checked (nothing is allocated until responses come).
fn response_store(a: &ServeArgs) -> Result<strata_server::response_store::ResponseStore> {
    let size = parse_size(&a.sizing.response_store_size).context("--response-store-size")?;
    if size < 1 << 20 || a.response_store_max == 0 {
        bail!("--response-store-size must be at least 1MiB and --response-store-max at least 1 (a conversation over a quarter of the size is not kept; one the store cannot keep cannot be continued)");
    }
    let ttl = a.response_store_ttl;
    if !(ttl > 0.0 && ttl <= 7.0 * 86_400.0) {
        let ttl = strata_kv::units::shown_number(ttl);
        bail!("--response-store-ttl {ttl}: expected seconds > 0, at most a week");
    }
    Ok(strata_server::response_store::ResponseStore::new(
        a.response_store_max,
        usize::try_from(size).unwrap_or(usize::MAX),
        Duration::from_secs_f64(ttl),
    ))
}

/// The key of `--cluster-key-file`; without one, only loopback addresses are accepted.
fn cluster_key(a: &ServeArgs) -> Result<Option<ClusterKey>> {
    Ok(match &a.cluster_key_file {
        Some(f) => Some(ClusterKey::from_file(f).context("--cluster-key-file")?),
        None => {
            for (flag, host) in [("--host", &a.host), ("--kv-host", &a.kv_host)] {
                if !is_loopback(host) {
                    bail!(
                        "{flag} {host}: a worker without --cluster-key-file listens on loopback only \
                         (its worker-to-worker endpoints would be open to the network); give the \
                         deployment's key file, see docs/SECURITY.md"
                    );
                }
            }
            say!(
                "strata serve: no cluster key (--cluster-key-file): worker endpoints are unauthenticated; listening on loopback only"
            );
            None
        }
    })
}

/// What `--l3` takes.
pub(super) const L3_SPECS: &str =
    "expected disk:PATH, redis://HOST:PORT or redis-cluster://HOST:PORT[,HOST:PORT...]";

pub(super) fn is_redis(spec: &str) -> bool {
    spec.starts_with("redis://") || spec.starts_with("redis-cluster://")
}

/// A disk tier holds at least one page (with its header) of `page_bytes`, once the model's
/// layout says how large a page is, before any pool is allocated: a smaller `--l3-size` would
/// be a tier that stores nothing and says so only as misses.
pub(super) fn check_l3_size(a: &ServeArgs, page_bytes: u64) -> Result<()> {
    if !a.l3.iter().any(|s| s.starts_with("disk:")) {
        return Ok(());
    }
    let cap = parse_size(&a.l3_size).context("--l3-size")?;
    let one = page_bytes + strata_kv::storage::blob::HEADER as u64;
    if cap < one {
        bail!(
            "--l3-size {} ({cap} bytes): the disk tier would hold no page (each takes {one} bytes with its header)",
            a.l3_size
        );
    }
    Ok(())
}

/// Longest `--l3-ttl` (10 years): Redis refuses an expiry past its clock's range, and every
/// write would then fail at run time.
const MAX_L3_TTL: u64 = 10 * 365 * 24 * 3600;

/// What a path that is not a directory is, for an error.
fn kind_of(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a file"
    }
}

/// Longest `--l3-timeout-ms`: a Redis that stalls holds each request being admitted (asked
/// off the scheduler's thread: the running streams go on) up to this until its breaker
/// opens, so more than seconds is an outage, not a bound.
const MAX_L3_TIMEOUT_MS: u64 = 10_000;

/// `--l3-ttl` and `--l3-timeout-ms` in range; one disk tier and one Redis at most.
fn check_l3_bounds(a: &ServeArgs) -> Result<()> {
    if a.l3_ttl > MAX_L3_TTL {
        bail!(
            "--l3-ttl {}: at most {MAX_L3_TTL} seconds (10 years; 0: pages never expire)",
            a.l3_ttl
        );
    }
    if !(1..=MAX_L3_TIMEOUT_MS).contains(&a.l3_timeout_ms) {
        bail!(
            "--l3-timeout-ms {}: between 1 and {MAX_L3_TIMEOUT_MS} (a Redis operation past it is \
             a failure)",
            a.l3_timeout_ms
        );
    }
    let disks = a.l3.iter().filter(|s| s.starts_with("disk:")).count();
    let redises = a.l3.iter().filter(|s| is_redis(s)).count();
    if disks > 1 || redises > 1 {
        bail!(
            "--l3: {disks} disk tiers and {redises} Redis: at most one of each (a Redis Cluster \
             is one: redis-cluster://H:P,H:P,...)"
        );
    }
    Ok(())
}

/// Refuses an `--l3` spec that is neither `disk:PATH` nor a Redis URL this build can use, a
/// spec given twice, more than one disk tier or one Redis (their metrics would be one series
/// twice), a disk path that is there and not a directory, a disk tier of no bytes, and an
/// operation bound out of range; nothing is opened or connected here.
fn check_l3_specs(a: &ServeArgs) -> Result<()> {
    let l3 = &a.l3;
    let cap = parse_size(&a.l3_size).context("--l3-size")?;
    // One store named two ways (`disk:/a/`, `disk:/a/.`) is the same store.
    let same = |a: &str, b: &str| match (a.strip_prefix("disk:"), b.strip_prefix("disk:")) {
        (Some(x), Some(y)) => {
            let norm = |p: &str| {
                std::path::Path::new(p)
                    .components()
                    .collect::<std::path::PathBuf>()
            };
            norm(x) == norm(y)
        }
        _ => a == b,
    };
    for (i, spec) in l3.iter().enumerate() {
        if l3[..i].iter().any(|o| same(o, spec)) {
            bail!(
                "--l3 `{}` is given twice",
                strata_kv::units::shown_url(spec)
            );
        }
        if let Some(path) = spec.strip_prefix("disk:") {
            if path.is_empty() {
                bail!("--l3 `disk:`: no path (disk:PATH)");
            }
            if let Some(m) = std::fs::metadata(path).ok().filter(|m| !m.is_dir()) {
                bail!(
                    "--l3 `disk:{path}`: {path} is {}, not a directory",
                    kind_of(&m)
                );
            }
            if cap == 0 {
                bail!(
                    "--l3-size {}: a disk tier of 0 bytes holds nothing",
                    a.l3_size
                );
            }
            continue;
        }
        if is_redis(spec) {
            strata_redis::check_url(spec).map_err(|e| anyhow::anyhow!("--l3: {e}"))?;
            continue;
        }
        if spec.starts_with("rediss://") {
            bail!(
                "--l3 `{}`: TLS to Redis is not built in; reach Redis over a private network \
                 or a TLS tunnel (e.g. stunnel) with redis://",
                strata_kv::units::shown_url(spec)
            );
        }
        bail!("--l3 `{}`: {L3_SPECS}", strata_kv::units::shown_url(spec));
    }
    check_l3_bounds(a)
}

/// The engine's prefetch policy from `--prefetch-policy` and `--prefetch-ms-per-token`.
pub(super) fn prefetch_policy(a: &ServeArgs) -> Result<strata_engine::PrefetchPolicy> {
    Ok(match a.prefetch_policy {
        Prefetch::BestEffort => strata_engine::PrefetchPolicy::BestEffort,
        Prefetch::WaitComplete => strata_engine::PrefetchPolicy::WaitComplete,
        // In range: `check_numbers`.
        Prefetch::Timeout => strata_engine::PrefetchPolicy::Timeout {
            per_token: Duration::from_secs_f64(a.prefetch_ms_per_token / 1e3),
        },
    })
}

/// `strata serve`'s flags alone, to read their defaults.
#[derive(clap::Parser)]
struct Defaults {
    #[command(flatten)]
    a: ServeArgs,
}

/// Flags set away from their defaults that do nothing in this worker's role (a deployment may
/// pass one set of flags to every role): each named, with the roles it applies to, to be said
/// before anything starts.
pub(super) fn idle_flags(a: &ServeArgs) -> Vec<String> {
    use clap::Parser;
    let Ok(Defaults { a: d }) = Defaults::try_parse_from(["strata serve"]) else {
        return Vec::new();
    };
    let role = a.sizing.role.name();
    let listens = a.sizing.role.receives_kv();
    let pd = role != "server";
    let staging = |a: &ServeArgs| parse_size(&a.sizing.kv_staging).ok();
    let flags = [
        ("--kv-host", a.kv_host != d.kv_host, listens),
        ("--kv-port", a.kv_port != d.kv_port, listens),
        ("--kv-advertise", a.kv_advertise.is_some(), listens),
        ("--kv-staging", staging(a) != staging(&d), listens),
        (
            "--kv-max-connections",
            a.kv_max_connections != d.kv_max_connections,
            listens,
        ),
        ("--prefill-worker", !a.prefill_worker.is_empty(), listens),
        (
            "--pd-local-prefill-tokens",
            a.pd_local_prefill_tokens != d.pd_local_prefill_tokens,
            listens,
        ),
        (
            "--pd-decode-reuse",
            a.pd_decode_reuse != d.pd_decode_reuse,
            listens,
        ),
        ("--kv-deadline", a.kv_deadline != d.kv_deadline, pd),
        (
            "--cache-outputs",
            a.cache_outputs != d.cache_outputs,
            role != "prefill",
        ),
    ];
    flags
        .iter()
        .filter(|f| f.1 && !f.2)
        .map(|f| {
            let applies = match f.0 {
                "--kv-deadline" => "PD roles (prefill, decode, both)",
                "--cache-outputs" => "the roles that decode answers (server, decode, both)",
                _ => "the roles that receive K/V (decode, both)",
            };
            format!(
                "{} does nothing on a {role} worker: it applies to {applies}; ignored",
                f.0
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn idle(args: &[&str]) -> Vec<String> {
        let all = std::iter::once("strata serve").chain(args.iter().copied());
        idle_flags(&Defaults::try_parse_from(all).unwrap().a)
    }

    #[test]
    fn flags_a_role_does_not_use_are_named() {
        let kv = ["--kv-staging", "2GiB", "--prefill-worker", "http://p:1"];
        let both: Vec<&str> = kv.iter().copied().chain(["--kv-deadline", "5"]).collect();
        let answers = idle(&["--role", "prefill", "--cache-outputs", "off"]);
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert!(answers[0].starts_with("--cache-outputs does nothing on a prefill worker"));
        assert!(idle(&["--role", "decode", "--cache-outputs", "off"]).is_empty());
        let on = |role: &str| {
            let mut a = vec!["--role", role];
            a.extend(&both);
            idle(&a)
        };
        assert!(on("decode").is_empty() && on("both").is_empty());
        let prefill = on("prefill");
        assert_eq!(prefill.len(), 2, "{prefill:?}");
        assert!(prefill[0].starts_with("--kv-staging does nothing on a prefill worker"));
        assert!(prefill[1].starts_with("--prefill-worker does nothing"));
        let server = on("server");
        assert_eq!(server.len(), 3, "{server:?}");
        assert!(server[2].starts_with("--kv-deadline does nothing on a server worker"));
        // A default given explicitly changes nothing, so nothing is said.
        assert!(idle(&["--role", "prefill", "--kv-staging", "1GiB"]).is_empty());
    }
}
