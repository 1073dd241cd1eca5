//! The decode side's KV listener on a real socket, against a sender written here: only ids the
//! worker expects are accepted, each once; oversized reservations are refused; staged bytes
//! never leak (repeats, abandoned and unclaimed transfers); the next legitimate transfer
//! always lands.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::transfer::{self, Frame, Hello, OutPage, TransferId};
use strata_kv::auth::ClusterKey;
use strata_server::pd::{KvInbox, KvLimits};

const PAGE: u64 = 64;

fn hello() -> Hello {
    Hello {
        model_id: "m".into(),
        page_size: 4,
        page_bytes: PAGE,
        layout: "l".into(),
    }
}

fn key() -> ClusterKey {
    ClusterKey::from_secret(&[8; 32]).unwrap()
}

fn inbox(ttl: Duration) -> Arc<KvInbox> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    KvInbox::start(
        l,
        hello(),
        PAGE,
        KvLimits {
            staging: 4 * PAGE,
            page_size: 4,
            max_tokens: 64,
            unclaimed_ttl: ttl,
            ..KvLimits::default()
        },
        Some(key()),
    )
}

fn connect(i: &KvInbox) -> TcpStream {
    let mut c = TcpStream::connect(i.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    transfer::handshake_connect(&mut c, &hello(), Some(&key())).unwrap();
    c
}

/// Sends a transfer of `pages` pages (4 tokens each); the receiver's verdict.
fn send(i: &KvInbox, id: TransferId, pages: usize) -> Result<(), String> {
    let mut c = connect(i);
    let blobs: Vec<Vec<u8>> = (0..pages).map(|p| vec![p as u8; PAGE as usize]).collect();
    let out: Vec<OutPage> = blobs
        .iter()
        .map(|d| OutPage {
            hash: [1; 16],
            data: d,
        })
        .collect();
    let tokens: Vec<u32> = (0..pages as u32 * 4).collect();
    transfer::send_kv(&mut c, id, &tokens, 0, &out, Duration::from_secs(1))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn settle(i: &KvInbox, staged: u64) {
    let t = Instant::now();
    while i.staged_bytes() != staged {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "staged {} bytes, expected {staged}",
            i.staged_bytes()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn only_expected_ids_once_and_staging_never_leaks() {
    let i = inbox(Duration::from_secs(120));
    let rt = rt();
    // An id nobody expects (a guess): refused.
    let e = send(&i, 12345, 1).unwrap_err();
    assert!(e.contains("unknown or duplicate transfer id"), "{e}");
    // An expected one lands once; a repeat (before or after it is claimed) is refused.
    let exp = i.expect(0);
    send(&i, exp.id, 2).unwrap();
    settle(&i, 2 * PAGE);
    let e = send(&i, exp.id, 2).unwrap_err();
    assert!(e.contains("duplicate"), "{e}");
    let got = rt.block_on(exp.take(Duration::from_secs(1))).unwrap();
    assert_eq!(got.pages.len(), 2);
    settle(&i, 0); // claimed: the pages are the request's now
    let id = exp.id;
    drop(exp);
    assert!(send(&i, id, 2).unwrap_err().contains("duplicate"));
    // Larger than the whole staging area: refused outright, nothing reserved.
    let big = i.expect(0);
    let e = send(&i, big.id, 5).unwrap_err();
    assert!(e.contains("stages at most"), "{e}");
    settle(&i, 0);
    // A transfer whose request gave up: its bytes come back.
    let gone = i.expect(0);
    send(&i, gone.id, 3).unwrap();
    settle(&i, 3 * PAGE);
    drop(gone);
    settle(&i, 0);
    // Pages that do not match the tokens announced: refused.
    let odd = i.expect(0);
    let mut c = connect(&i);
    transfer::write_frame(
        &mut c,
        &Frame::Begin {
            id: odd.id,
            tokens: vec![1; 5],
            first: 0,
            pages: 1,
        },
    )
    .unwrap();
    match transfer::read_frame(&mut c, 1 << 16).unwrap() {
        Frame::Abort { reason, .. } => {
            assert!(reason.contains("1 pages from page 0 announced"), "{reason}")
        }
        f => panic!("{f:?}"),
    }
    // A transfer from another page than the receiver asked for (it holds the ones before
    // page 2): refused.
    let later = i.expect(2);
    let e = send(&i, later.id, 3).unwrap_err();
    assert!(e.contains("asked for the pages from 2 on"), "{e}");
    settle(&i, 0);
    // And after all of it, the next legitimate transfer lands.
    let next = i.expect(0);
    send(&i, next.id, 4).unwrap();
    let got = rt.block_on(next.take(Duration::from_secs(1))).unwrap();
    assert_eq!(got.pages.len(), 4);
    assert_eq!(got.pages[3], vec![3u8; PAGE as usize]);
}

#[test]
fn unclaimed_transfers_are_purged_on_a_timer() {
    let i = inbox(Duration::from_millis(300));
    let exp = i.expect(0);
    send(&i, exp.id, 2).unwrap();
    settle(&i, 2 * PAGE);
    // Nobody takes it: the purge (every second) frees it.
    settle(&i, 0);
    let e = rt()
        .block_on(exp.take(Duration::from_millis(100)))
        .unwrap_err();
    assert!(e.contains("unclaimed"), "{e}");
    assert_eq!(i.pending(), 0);
}
