//! Against a real Redis Cluster (3 masters, 3 replicas; Debian's redis-server and redis-cli,
//! installed by scripts/test.sh) on loopback ports: pages spread over the masters, a master
//! killed makes its own pages misses (counted) until its replica takes over, the old master
//! comes back as a replica, and a fourth master takes a share of the slots and of new pages.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use strata_kv::storage::Storage;
use strata_kv::PageHash;
use strata_redis::{RedisConfig, RedisStorage};
use strata_test_support::{free_port, RedisCluster};

fn cfg(url: &str) -> RedisConfig {
    RedisConfig {
        url: url.into(),
        namespace: "cluster-test".into(),
        ttl: None,
        // Not a test of timeouts: room for a loaded machine, short of the failover (≥ 1 s).
        timeout: Duration::from_millis(800),
        page_key: strata_kv::storage::blob::BlobKey::public(),
        max_value_bytes: 1 << 16,
    }
}

/// Page hashes spread over all their bytes, as real ones are (keys differing in a few bytes
/// only never share a CRC16 slot).
fn h(i: u32) -> PageHash {
    PageHash(
        (i as u128 + 1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
            .to_le_bytes(),
    )
}

fn page(i: u32) -> Vec<u8> {
    (0..2048u32)
        .map(|j| (i.wrapping_mul(31) ^ j) as u8)
        .collect()
}

fn put_range(s: &RedisStorage, r: std::ops::Range<u32>) {
    let pages: Vec<(PageHash, Vec<u8>)> = r.map(|i| (h(i), page(i))).collect();
    for res in s.put_many(&pages) {
        res.unwrap();
    }
}

/// Reads pages `r`: how many came back (each checked equal to what was written: a wrong page
/// fails the test at once).
fn read_back(s: &RedisStorage, r: std::ops::Range<u32>) -> usize {
    let hs: Vec<PageHash> = r.clone().map(h).collect();
    let mut found = 0;
    for (i, got) in r.zip(s.get_many(&hs)) {
        match got {
            Ok(Some(v)) => {
                assert_eq!(v, page(i), "page {i} came back wrong");
                found += 1;
            }
            Ok(None) => eprintln!("page {i}: miss"),
            Err(e) => eprintln!("page {i}: {e}"),
        }
    }
    found
}

/// Keys held by each master now.
fn keys_per_master(c: &RedisCluster) -> HashMap<usize, u64> {
    c.masters()
        .into_iter()
        .map(|m| (m, c.cli(m, &["DBSIZE"]).parse().unwrap()))
        .collect()
}

#[test]
fn pages_spread_over_masters_survive_a_failover_and_move_to_a_new_master() {
    let mut c = RedisCluster::start(3, 1);
    // A redis:// URL of any node is recognised as a cluster; redis-cluster:// takes seeds, of
    // which the first may be down.
    let dead = free_port();
    let seeds = format!(
        "redis-cluster://127.0.0.1:{dead},127.0.0.1:{}",
        c.nodes[1].port
    );
    assert_eq!(
        RedisStorage::connect(&cfg(&seeds))
            .unwrap()
            .cluster_masters()
            .len(),
        3
    );
    let s = RedisStorage::connect(&cfg(&c.url(0))).unwrap();
    assert_eq!(s.cluster_masters().len(), 3);

    // Spread: every master holds a share, and no write was redirected (our slots are the
    // cluster's).
    const N: u32 = 600;
    put_range(&s, 0..N);
    assert_eq!(read_back(&s, 0..N), N as usize);
    let before = keys_per_master(&c);
    assert_eq!(before.len(), 3);
    for (m, k) in &before {
        assert!(*k > 100, "master {m} holds only {k} of {N} pages");
    }
    assert_eq!(before.values().sum::<u64>(), N as u64);
    assert_eq!(
        s.cluster_redirects(),
        0,
        "slots computed differently from the cluster's"
    );

    // A master killed after its replica has every write: its pages, and only those, are
    // misses (counted as errors); nothing read back is wrong.
    let (&victim, &held) = before.iter().next().unwrap();
    assert!(
        c.cli(victim, &["WAIT", "1", "5000"])
            .parse::<u32>()
            .unwrap()
            >= 1
    );
    c.kill(victim);
    let errors = s.stats().errors;
    let found = read_back(&s, 0..N);
    assert_eq!(
        found,
        N as usize - held as usize,
        "pages of the killed master read back"
    );
    assert!(
        s.stats().errors > errors,
        "the misses were not counted as errors"
    );

    // Its replica takes over: every page reads back again.
    let t = Instant::now();
    let mut rounds_with_misses = 0;
    while read_back(&s, 0..N) < N as usize {
        rounds_with_misses += 1;
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no failover: {} pages still missing",
            N as usize - read_back(&s, 0..N)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "failover: all pages back after {:?} ({rounds_with_misses} rounds with misses)",
        t.elapsed()
    );
    assert_eq!(s.cluster_masters().len(), 3);
    assert!(!s
        .cluster_masters()
        .contains(&format!("127.0.0.1:{}", c.nodes[victim].port)));

    // Restored: the old master rejoins as a replica; reads and writes go on.
    c.restart(victim);
    c.wait_ok();
    assert!(c.cli(victim, &["ROLE"]).starts_with("slave"));
    put_range(&s, N..N + 100);
    assert_eq!(read_back(&s, 0..N + 100), N as usize + 100);

    // Capacity grows with a master: slots (and their keys) move to it; pages are followed
    // there (MOVED), and new pages land on it too.
    let new = c.add_master();
    assert_eq!(read_back(&s, 0..N + 100), N as usize + 100);
    assert!(
        s.cluster_redirects() > 0,
        "moved slots were read without a redirect"
    );
    let t = Instant::now();
    while s.cluster_masters().len() < 4 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the new master never entered the map"
        );
        read_back(&s, 0..N);
        std::thread::sleep(Duration::from_millis(100));
    }
    let moved_in: u64 = c.cli(new, &["DBSIZE"]).parse().unwrap();
    put_range(&s, N + 100..N + 700);
    let after: u64 = c.cli(new, &["DBSIZE"]).parse().unwrap();
    assert!(moved_in > 0, "no keys moved to the new master");
    assert!(
        after > moved_in + 50,
        "new pages did not reach the new master ({moved_in} → {after})"
    );
    assert_eq!(read_back(&s, 0..N + 700), N as usize + 700);
}

/// `CLUSTER KEYSLOT` of each key, asked of node 0 in one redis-cli run.
fn slots_of(c: &RedisCluster, keys: &[String]) -> Vec<u16> {
    use std::io::Write;
    let mut ch = std::process::Command::new("redis-cli")
        .args(["-p", &c.nodes[0].port.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = String::new();
    for k in keys {
        input.push_str(&format!("CLUSTER KEYSLOT {k}\n"));
    }
    ch.stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = ch.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

/// A slot in the middle of a migration: a key already moved is answered with ASK by the old
/// master and read from the new one after ASKING, without touching the slot map; once the
/// slot is moved, MOVED updates the map and the redirects stop.
#[test]
fn keys_of_a_migrating_slot_are_followed_by_ask_then_moved() {
    let c = RedisCluster::start(3, 0);
    let s = RedisStorage::connect(&cfg(&c.url(0))).unwrap();
    // Two pages of one slot (among 1,000 pages two share a slot).
    let keys: Vec<String> = (0..1000).map(|i| s.key_of(&h(i))).collect();
    let slots = slots_of(&c, &keys);
    assert_eq!(slots.len(), keys.len());
    let mut first = HashMap::new();
    let (a, b) = (0..1000u32)
        .find_map(|j| first.insert(slots[j as usize], j).map(|i| (i, j)))
        .unwrap();
    let slot = slots[a as usize].to_string();
    put_range(&s, a..a + 1);
    put_range(&s, b..b + 1);
    let owner = |c: &RedisCluster| {
        c.masters()
            .into_iter()
            .find(|&m| c.cli(m, &["CLUSTER", "COUNTKEYSINSLOT", &slot]) != "0")
            .unwrap()
    };
    let src = owner(&c);
    let dst = c.masters().into_iter().find(|&m| m != src).unwrap();
    let (src_id, dst_id) = (
        c.cli(src, &["CLUSTER", "MYID"]),
        c.cli(dst, &["CLUSTER", "MYID"]),
    );
    c.cli(dst, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]);
    c.cli(src, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]);
    let dst_port = c.nodes[dst].port.to_string();
    let ka = s.key_of(&h(a));
    assert_eq!(
        c.cli(src, &["MIGRATE", "127.0.0.1", &dst_port, &ka, "0", "5000"]),
        "OK"
    );
    let before = s.cluster_redirects();
    let got = s.get_many(&[h(a), h(b)]);
    assert_eq!(
        got[0].as_ref().unwrap().as_deref(),
        Some(&page(a)[..]),
        "the moved key"
    );
    assert_eq!(
        got[1].as_ref().unwrap().as_deref(),
        Some(&page(b)[..]),
        "the key not moved yet"
    );
    assert_eq!(s.cluster_redirects(), before + 1, "one ASK");
    // ASK does not change the map: the next read is asked again.
    assert_eq!(s.exists(&[h(a)]).unwrap(), vec![true]);
    assert_eq!(s.cluster_redirects(), before + 2);
    // The slot moves for good: one MOVED, then the map is right.
    let kb = s.key_of(&h(b));
    c.cli(src, &["MIGRATE", "127.0.0.1", &dst_port, &kb, "0", "5000"]);
    for m in c.masters() {
        c.cli(m, &["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]);
    }
    assert_eq!(read_back(&s, a..a + 1) + read_back(&s, b..b + 1), 2);
    let after_move = s.cluster_redirects();
    assert_eq!(after_move, before + 3, "one MOVED");
    assert_eq!(read_back(&s, a..a + 1) + read_back(&s, b..b + 1), 2);
    assert_eq!(
        s.cluster_redirects(),
        after_move,
        "redirected after the map was updated"
    );
    assert_eq!(owner(&c), dst);
}

#[test]
fn a_namespace_with_a_hash_tag_is_refused() {
    let e = RedisStorage::connect(&RedisConfig {
        namespace: "model{x}".into(),
        ..cfg("redis://127.0.0.1:1")
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("brace"), "{e}");
}
