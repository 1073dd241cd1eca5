//! Against a real redis-server (Debian package; scripts/test.sh installs it) on a loopback port.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use strata_kv::storage::Storage;
use strata_kv::PageHash;
use strata_redis::{RedisConfig, RedisStorage};
use strata_test_support::{free_port, Redis};

fn cfg(url: &str) -> RedisConfig {
    RedisConfig {
        url: url.into(),
        namespace: "test".into(),
        ttl: None,
        timeout: Duration::from_millis(500),
        page_key: strata_kv::storage::blob::BlobKey::public(),
        max_value_bytes: 1 << 20,
    }
}

fn h(i: u8) -> PageHash {
    PageHash([i; 16])
}

#[test]
fn put_get_exists_round_trips_and_corrupt_values_are_misses() {
    let r = Redis::start();
    let s = RedisStorage::connect(&cfg(&r.url())).unwrap();
    assert_eq!(s.tier(), "remote");
    let pages: Vec<(PageHash, Vec<u8>)> = (0..20u8).map(|i| (h(i), vec![i; 1000])).collect();
    assert!(s.put_many(&pages).iter().all(|r| r.is_ok()));
    assert_eq!(
        s.exists(&[h(0), h(19), h(50)]).unwrap(),
        vec![true, true, false]
    );
    assert_eq!(s.prefix_len(&[h(0), h(1), h(50), h(2)]).unwrap(), 2);
    let got = s.get_many(&[h(3), h(50), h(7)]);
    assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&[3u8; 1000][..]));
    assert_eq!(got[1].as_ref().unwrap(), &None);
    assert_eq!(s.get(&h(7)).unwrap(), Some(vec![7; 1000]));
    // A value that is not this page (garbage, or another page's bytes) is a miss and is removed.
    let key = s.key_of(&h(5));
    let out = Command::new("redis-cli")
        .args(["-p", &r.port.to_string(), "SET", &key, "garbage"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(s.get(&h(5)).unwrap(), None);
    assert_eq!(s.stats().corrupt, 1);
    assert_eq!(
        s.exists(&[h(5)]).unwrap(),
        vec![false],
        "the corrupt value was deleted"
    );
    assert!(s.delete(&h(6)).unwrap());
    assert!(!s.delete(&h(6)).unwrap());
    // Another namespace sees none of these pages.
    let mut other = cfg(&r.url());
    other.namespace = "other-model".into();
    let o = RedisStorage::connect(&other).unwrap();
    assert_eq!(o.prefix_len(&[h(0)]).unwrap(), 0);
}

#[test]
fn an_unreachable_or_silent_redis_fails_within_the_timeout() {
    let port = free_port();
    let t = Instant::now();
    let e = RedisStorage::connect(&cfg(&format!("redis://127.0.0.1:{port}")))
        .err()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(3), "{e}");
    // The cause, not only "timed out".
    assert!(e.to_string().to_lowercase().contains("refused"), "{e}");
    // A peer that accepts and never answers.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = l.local_addr().unwrap().port();
    let _keep = std::thread::spawn(move || {
        let conns: Vec<_> = l.incoming().take(8).collect();
        std::thread::sleep(Duration::from_secs(10));
        drop(conns);
    });
    let t = Instant::now();
    let e = RedisStorage::connect(&cfg(&format!("redis://127.0.0.1:{silent}")))
        .err()
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}: {e}",
        t.elapsed()
    );
    assert!(
        e.to_string().contains("timed out") || e.to_string().contains("unavailable"),
        "{e}"
    );
}

#[test]
fn redis_killed_and_restarted_errors_are_counted_then_service_resumes() {
    let mut r = Redis::start();
    let port = r.port;
    let s = RedisStorage::connect(&cfg(&r.url())).unwrap();
    s.put(&h(1), &[1; 100]).unwrap();
    r.kill();
    let t = Instant::now();
    assert!(s.get(&h(1)).is_err());
    assert!(s.put(&h(2), &[2; 100]).is_err());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "failing took {:?}",
        t.elapsed()
    );
    assert!(s.stats().errors >= 2);
    // A few more without a reply and the tier stops waiting on Redis: it fails at once, and
    // says why, until a probe gets a reply.
    let errors: Vec<String> = (0..4)
        .map(|_| s.get(&h(1)).unwrap_err().to_string())
        .collect();
    assert!(errors[3].contains("Redis is skipped"), "{errors:?}");
    let _r2 = Redis::start_on(port);
    // The connection comes back by itself; the restarted (empty) Redis answers misses.
    let t = Instant::now();
    loop {
        if let Ok(v) = s.get(&h(1)) {
            assert_eq!(v, None);
            break;
        }
        // (The breaker probes 1, 2, 4, 8 and then every 16 s after failed tries.)
        assert!(t.elapsed() < Duration::from_secs(45), "no reconnection");
        std::thread::sleep(Duration::from_millis(100));
    }
    s.put(&h(3), &[3; 100]).unwrap();
    assert_eq!(s.get(&h(3)).unwrap(), Some(vec![3; 100]));
}

fn cli(r: &Redis, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &r.port.to_string()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A valid page copied under another page's key with its hash field rewritten (the attack on an
/// unkeyed checksum) is a miss under a cluster key, counted and deleted; so is a value written
/// by someone without the key.
#[test]
fn a_transplanted_or_forged_page_is_a_miss_under_a_cluster_key() {
    let r = Redis::start();
    let ck = strata_kv::auth::ClusterKey::from_secret(&[7; 32]).unwrap();
    let mut c = cfg(&r.url());
    c.page_key = strata_kv::storage::blob::BlobKey::from_cluster(&ck);
    // Not a test of timeouts: room for a loaded machine.
    c.timeout = Duration::from_secs(5);
    let s = RedisStorage::connect(&c).unwrap();
    s.put(&h(1), &[1u8; 100]).unwrap();
    let src = s.key_of(&h(1));
    let dst = s.key_of(&h(2));
    // COPY the value, then rewrite the 16-byte hash field (bytes 52..68) to page 2's.
    assert_eq!(cli(&r, &["COPY", &src, &dst]), "1");
    let out = Command::new("redis-cli")
        .args(["-p", &r.port.to_string(), "-x", "SETRANGE", &dst, "52"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut ch| {
            use std::io::Write;
            ch.stdin.take().unwrap().write_all(&h(2).0)?;
            ch.wait_with_output()
        })
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        s.get(&h(2)).unwrap(),
        None,
        "a transplanted page was accepted"
    );
    assert_eq!(s.stats().corrupt, 1);
    assert_eq!(s.exists(&[h(2)]).unwrap(), vec![false], "not deleted");
    // A well-formed page made without the cluster key (the public key), set under our key: not
    // ours either.
    let forged = strata_kv::storage::blob::encode(
        &strata_kv::storage::blob::BlobKey::public(),
        &h(3),
        &[3u8; 100],
    );
    let out = Command::new("redis-cli")
        .args(["-p", &r.port.to_string(), "-x", "SET", &s.key_of(&h(3))])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut ch| {
            use std::io::Write;
            ch.stdin.take().unwrap().write_all(&forged)?;
            ch.wait_with_output()
        })
        .unwrap();
    assert!(out.status.success());
    assert_eq!(s.exists(&[h(3)]).unwrap(), vec![true]);
    assert_eq!(s.get(&h(3)).unwrap(), None);
    assert_eq!(s.stats().corrupt, 2);
    assert_eq!(s.get(&h(1)).unwrap(), Some(vec![1u8; 100]));
}

/// A key of another Redis type (or an oversized value) is a miss for that key only, and is
/// removed; the rest of the batch is served.
#[test]
fn a_wrong_type_key_is_a_miss_for_that_key_not_the_batch() {
    let r = Redis::start();
    // Not a test of timeouts: room for a loaded machine.
    let s = RedisStorage::connect(&RedisConfig {
        timeout: Duration::from_secs(5),
        ..cfg(&r.url())
    })
    .unwrap();
    for i in 1..=3u8 {
        s.put(&h(i), &[i; 100]).unwrap();
    }
    let k2 = s.key_of(&h(2));
    cli(&r, &["DEL", &k2]);
    cli(&r, &["LPUSH", &k2, "x"]);
    let k3 = s.key_of(&h(3));
    cli(&r, &["SETRANGE", &k3, "2000000", "x"]); // past max_value_bytes (1 MiB)
    let got = s.get_many(&[h(1), h(2), h(3), h(4)]);
    assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&[1u8; 100][..]));
    assert_eq!(got[1].as_ref().unwrap(), &None);
    assert_eq!(got[2].as_ref().unwrap(), &None);
    assert_eq!(got[3].as_ref().unwrap(), &None);
    assert_eq!(s.stats().corrupt, 2);
    assert_eq!(
        cli(&r, &["EXISTS", &k2, &k3]),
        "0",
        "foreign keys left behind"
    );
    assert_eq!(s.stats().errors, 0);
}

/// The last holder of the tier may drop it inside another runtime (a server's state at
/// shutdown, an async test): the tier's own runtime must not block there, measurement running
/// or not.
#[test]
fn the_tier_can_be_dropped_inside_an_async_runtime() {
    let r = Redis::start();
    let outer = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let s = RedisStorage::connect(&cfg(&r.url())).unwrap();
    assert!(s.put_many(&[(h(1), vec![1; 100])])[0].is_ok());
    let _ = s.stats(); // starts a measurement in the tier's runtime
    outer.block_on(async move { drop(s) });
}

/// A peer that speaks the protocol but answers every page command with a reply of another
/// kind (an array: a proxy or a server that is not Redis): each operation fails and is counted,
/// never a quiet miss or a write taken as stored.
#[test]
fn replies_of_the_wrong_kind_are_counted_failures() {
    use std::io::{BufRead, BufReader, Read, Write};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming().take(4) {
            let Ok(conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut w = conn.try_clone().unwrap();
                let mut r = BufReader::new(conn);
                let mut line = String::new();
                // One command: `*N` then N bulk strings; the first names it.
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    let n: usize = line.trim()[1..].parse().unwrap_or(0);
                    let mut args = Vec::new();
                    for _ in 0..n {
                        line.clear();
                        r.read_line(&mut line).unwrap();
                        let len: usize = line.trim()[1..].parse().unwrap();
                        let mut b = vec![0; len + 2];
                        r.read_exact(&mut b).unwrap();
                        args.push(String::from_utf8_lossy(&b[..len]).to_uppercase());
                    }
                    line.clear();
                    let reply: &[u8] = match args.first().map(String::as_str) {
                        Some("CLIENT") => b"+OK\r\n",
                        Some("INFO") => b"$0\r\n\r\n",
                        _ => b"*1\r\n$3\r\nabc\r\n",
                    };
                    if w.write_all(reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    let s = RedisStorage::connect(&cfg(&format!("redis://127.0.0.1:{port}"))).unwrap();
    assert!(s.exists(&[h(1), h(2)]).is_err());
    assert!(s.put(&h(1), &[1; 100]).is_err());
    let got = s.get(&h(1));
    assert!(got.is_err(), "{got:?}");
    let st = s.stats();
    assert_eq!((st.hits, st.corrupt), (0, 0));
    assert!(st.errors >= 3, "{st:?}");
}
